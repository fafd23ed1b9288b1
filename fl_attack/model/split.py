"""Split a model at the linear layer SPEAR attacks: the part before it, and what surrounds it.

SPEAR (§6.4) and the Cocktail Party Attack (Kariyappa et al., ICML 2023) recover the *input
features* of a network's first linear layer; turning those into pixels needs the forward pass
up to that layer (:func:`feature_extractor`), which the server can run since it sent every
weight. Whether the attack applies at all depends on the layer's surroundings
(:func:`layer_context`): SPEAR's sparsity argument (§3.2) needs a ReLU right after the layer,
and a normalisation over the batch before it makes each sample's features depend on the others.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

_NORMS = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm, nn.LocalResponseNorm)
_NORM_FUNCTIONS = (F.batch_norm, F.layer_norm, F.group_norm, F.instance_norm,
                   F.local_response_norm, torch.batch_norm, torch.layer_norm)
_RELU_FUNCTIONS = (F.relu, torch.relu, torch.relu_, F.relu_)


class _Stop(Exception):
    """Raised by the pre-hook once the attacked layer's input is captured."""


def _linear(model: nn.Module, weight_key: str) -> tuple[str, nn.Linear]:
    """The module name and the :class:`nn.Linear` whose weight is ``weight_key``."""
    name, _, leaf = weight_key.rpartition(".")
    try:
        module = model.get_submodule(name) if name else model
    except AttributeError:
        module = None
    if leaf != "weight" or not isinstance(module, nn.Linear):
        linears = [n + ".weight" for n, m in model.named_modules() if isinstance(m, nn.Linear)]
        raise ValueError(
            f"{weight_key!r} is not the weight of an nn.Linear of this model "
            f"(linear layers: {linears})"
        )
    return name, module


class FeatureExtractor:
    """``images -> (rows, n)``: the inputs the attacked linear layer sees, with autograd.

    Runs ``model`` with a forward pre-hook on the layer that captures its input and stops the
    forward pass there (nothing after the layer is computed). Gradients flow from the features
    back to the images and to the parameters used before the layer.

    Attributes
    ----------
    model : nn.Module
        The model (its parameters are those the features depend on).
    weight_key : str
        The attacked layer's state-dict weight key, e.g. ``"fc1.weight"``.
    module_name : str
        The attacked module's name in ``model``.
    in_features : int
        n, the attacked layer's input width.
    """

    def __init__(self, model: nn.Module, weight_key: str) -> None:
        self.model = model
        self.weight_key = weight_key
        self.module_name, self._layer = _linear(model, weight_key)
        self.in_features = int(self._layer.in_features)

    def __call__(self, images: Tensor) -> Tensor:
        """The attacked layer's inputs for ``images`` (in the model's input space), one row
        per vector the layer sees: ``(B, n)`` for an image model."""
        seen: list[Tensor] = []

        def hook(_module: nn.Module, args: tuple[Tensor, ...]) -> None:
            seen.append(args[0])
            raise _Stop

        handle = self._layer.register_forward_pre_hook(hook)
        try:
            self.model(images)
        except _Stop:
            pass
        finally:
            handle.remove()
        if not seen:
            raise ValueError(f"{self.weight_key!r}: the layer was not called in the forward pass")
        return seen[0].reshape(-1, self.in_features)


def feature_extractor(model: nn.Module, weight_key: str) -> FeatureExtractor:
    """The forward pass of ``model`` up to the linear layer whose weight is ``weight_key``.

    Parameters
    ----------
    model : nn.Module
        Any model that calls the layer in its forward pass.
    weight_key : str
        The layer's state-dict weight key, e.g. ``"fc1.weight"``.

    Returns
    -------
    FeatureExtractor
        Callable ``images -> (B, n)`` features (the layer's inputs, flattened).

    Raises
    ------
    ValueError
        When ``weight_key`` is not the weight of an :class:`nn.Linear` of ``model``.
    """
    return FeatureExtractor(model, weight_key)


@dataclass(frozen=True)
class LayerContext:
    """What surrounds the attacked linear layer, read off the model's traced graph.

    ``None`` means "could not be determined" (the model does not trace, or the layer's output
    is used in several places); the plugin then says so instead of guessing.
    """

    weight_key: str
    """The attacked layer's weight key."""
    relu_after: bool | None
    """The layer's output goes straight into a ReLU (SPEAR §3.2's sparse ∂L/∂Z)."""
    after: str | None
    """What consumes the layer's output (e.g. ``"relu"``, ``"tanh"``, ``"Dropout"``)."""
    norm_before: bool | None
    """A normalisation layer (batch, layer, group, instance, local response) lies between the
    model's inputs and the attacked layer."""
    traced: bool
    """Whether ``torch.fx`` symbolic tracing succeeded."""


def _op_name(node: torch.fx.Node, modules: dict[str, nn.Module]) -> str:
    """A short name for what ``node`` computes."""
    if node.op == "call_module":
        return type(modules[str(node.target)]).__name__
    if node.op in ("call_function", "call_method"):
        return getattr(node.target, "__name__", str(node.target))
    return node.op


def _is_relu(node: torch.fx.Node, modules: dict[str, nn.Module]) -> bool:
    if node.op == "call_module":
        return isinstance(modules[str(node.target)], nn.ReLU)
    if node.op == "call_function":
        return node.target in _RELU_FUNCTIONS
    return node.op == "call_method" and node.target in ("relu", "relu_")


def _is_norm(node: torch.fx.Node, modules: dict[str, nn.Module]) -> bool:
    if node.op == "call_module":
        return isinstance(modules[str(node.target)], _NORMS)
    return node.op == "call_function" and node.target in _NORM_FUNCTIONS


def _ancestors(node: torch.fx.Node) -> list[torch.fx.Node]:
    """Every node ``node`` depends on."""
    seen: dict[torch.fx.Node, None] = {}
    stack = list(node.all_input_nodes)
    while stack:
        cur = stack.pop()
        if cur not in seen:
            seen[cur] = None
            stack.extend(cur.all_input_nodes)
    return list(seen)


def layer_context(model: nn.Module, weight_key: str,
                  tracer: Callable[[nn.Module], torch.fx.GraphModule] | None = None
                  ) -> LayerContext:
    """Whether the attacked layer is followed by a ReLU and preceded by a normalisation.

    Traces ``model`` with :func:`torch.fx.symbolic_trace` (or ``tracer``) and looks at the
    layer's call: its single consumer (``relu_after``, ``after``) and its ancestors
    (``norm_before``). A model that does not trace (data-dependent control flow) gives
    ``None`` for both instead of an error.

    Parameters
    ----------
    model : nn.Module
        The model.
    weight_key : str
        The attacked layer's weight key, e.g. ``"fc1.weight"``.
    tracer : callable, optional
        ``model -> GraphModule``; default :func:`torch.fx.symbolic_trace`.

    Returns
    -------
    LayerContext

    Raises
    ------
    ValueError
        When ``weight_key`` is not the weight of an :class:`nn.Linear` of ``model``.
    """
    name, _ = _linear(model, weight_key)
    try:
        graph = (tracer or torch.fx.symbolic_trace)(model)
    except Exception:  # any tracing failure means "unknown", never an error
        return LayerContext(weight_key, None, None, None, traced=False)
    modules = dict(graph.named_modules())
    calls = [n for n in graph.graph.nodes if n.op == "call_module" and n.target == name]
    if len(calls) != 1:
        return LayerContext(weight_key, None, None, None, traced=True)
    call = calls[0]
    norm_before = any(_is_norm(n, modules) for n in _ancestors(call))
    users = list(call.users)
    if len(users) != 1:
        return LayerContext(weight_key, None, None, norm_before, traced=True)
    return LayerContext(weight_key, _is_relu(users[0], modules), _op_name(users[0], modules),
                        norm_before, traced=True)
