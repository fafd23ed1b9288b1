"""The attacked models: fully connected ReLU networks, and the gradients a client would share.

SPEAR and SPEAR++ invert the gradient of a linear layer followed by a ReLU. For such a layer
with weight ``W`` (m, n) and a batch ``X`` (B, n), the weight gradient is
``dL/dW = (dL/dZ)^T X`` — a matrix of rank at most ``B`` whose factor ``dL/dZ`` is sparse
because of the ReLU. The papers' protocol attacks the first layer of an MLP with three hidden
layers of width ``m`` (:func:`relu_mlp` with ``depth=3``) trained with mean cross-entropy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "first_layer_gradients",
    "layer_gradients",
    "layer_inputs",
    "linear_layers",
    "relu_mlp",
]

_LOSSES = ("ce",)


def relu_mlp(
    in_features: int,
    width: int,
    depth: int = 3,
    num_classes: int = 10,
    *,
    seed: int | None = None,
) -> nn.Sequential:
    """``Flatten -> depth x (Linear(., width) -> ReLU) -> Linear(width, num_classes)``.

    ``depth=3`` is the SPEAR++ protocol ("three hidden layers of width m"); SPEAR's uses a
    6-layer MLP of width 200 (``depth=5``). The leading :class:`~torch.nn.Flatten` lets the model
    take images ``(B, C, H, W)`` or flat rows ``(B, in_features)``. Weights use PyTorch's default
    initialisation; with ``seed`` they are drawn from a private generator state, so the model is
    reproducible and the global RNG is left untouched.
    """
    for what, value in (("in_features", in_features), ("width", width), ("depth", depth)):
        if int(value) != value or value < 1:
            raise ValueError(f"{what} must be a positive integer, got {value!r}")
    if int(num_classes) != num_classes or num_classes < 2:
        raise ValueError(f"num_classes must be an integer >= 2, got {num_classes!r}")

    def build() -> nn.Sequential:
        layers: list[nn.Module] = [nn.Flatten()]
        prev = int(in_features)
        for _ in range(int(depth)):
            layers += [nn.Linear(prev, int(width)), nn.ReLU()]
            prev = int(width)
        layers.append(nn.Linear(prev, int(num_classes)))
        return nn.Sequential(*layers)

    if seed is None:
        return build()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(seed))
        return build()


def linear_layers(model: nn.Module) -> list[nn.Linear]:
    """The model's :class:`~torch.nn.Linear` layers in forward (registration) order."""
    return [m for m in model.modules() if isinstance(m, nn.Linear)]


def _layer(model: nn.Module, layer: int) -> nn.Linear:
    layers = linear_layers(model)
    if not layers:
        raise ValueError("model has no nn.Linear layer")
    if not -len(layers) <= layer < len(layers):
        raise ValueError(f"layer {layer} out of range: the model has {len(layers)} Linear layers")
    return layers[layer]


def _as_model_input(model: nn.Module, inputs: Tensor) -> Tensor:
    p = next(model.parameters())
    if not isinstance(inputs, Tensor) or inputs.ndim < 2:
        raise ValueError(
            f"inputs must be a batch tensor (B, ...), got {getattr(inputs, 'shape', inputs)}"
        )
    return inputs.detach().to(device=p.device, dtype=p.dtype)


def layer_gradients(
    model: nn.Module,
    inputs: Tensor,
    labels: Tensor,
    layer: int = 0,
    *,
    loss: str = "ce",
    dtype: torch.dtype = torch.float32,
) -> tuple[Tensor, Tensor]:
    """Gradient of the batch loss w.r.t. ``linear_layers(model)[layer]``: ``(dW (m, n), db (m,))``.

    This is what a FedSGD client shares for that layer. ``loss="ce"`` is the mean
    cross-entropy over the batch (PyTorch's default reduction, as in the papers). Computed with
    :func:`torch.autograd.grad`, so nothing is accumulated in the parameters' ``.grad``; the
    results are detached and cast to ``dtype`` (float32 by default; pass ``torch.float64`` with
    a float64 model for gradients exact to double precision). Inputs are cast to the model's
    dtype and device.
    """
    if loss not in _LOSSES:
        raise ValueError(f"unknown loss {loss!r}; expected one of {_LOSSES}")
    lin = _layer(model, layer)
    x = _as_model_input(model, inputs)
    y = torch.as_tensor(labels).to(device=x.device, dtype=torch.int64)
    if y.shape != (x.shape[0],):
        raise ValueError(f"labels must have shape ({x.shape[0]},), got {tuple(y.shape)}")
    with torch.enable_grad():
        out = F.cross_entropy(model(x), y)
        gw, gb = torch.autograd.grad(out, [lin.weight, lin.bias])
    return gw.detach().to(dtype), gb.detach().to(dtype)


def first_layer_gradients(
    model: nn.Module, inputs: Tensor, labels: Tensor
) -> tuple[Tensor, Tensor]:
    """``layer_gradients(model, inputs, labels, layer=0)``: the layer SPEAR(++) attacks."""
    return layer_gradients(model, inputs, labels, layer=0)


def layer_inputs(model: nn.Module, inputs: Tensor, layer: int = 0) -> Tensor:
    """The ``(B, n)`` inputs that ``linear_layers(model)[layer]`` sees on this batch.

    For layer 0 of :func:`relu_mlp` these are the flattened images; for deeper layers the
    previous ReLU's outputs — the ground truth to score an inversion of that layer against.
    Detached, in the model's dtype.
    """
    lin = _layer(model, layer)
    x = _as_model_input(model, inputs)
    seen: list[Tensor] = []

    def hook(_module: nn.Module, args: tuple[Tensor, ...]) -> None:
        seen.append(args[0].detach())

    handle = lin.register_forward_pre_hook(hook)
    try:
        with torch.no_grad():
            model(x)
    finally:
        handle.remove()
    if not seen:
        raise ValueError(f"layer {layer} was not called in the model's forward pass")
    z = seen[0]
    return z.reshape(z.shape[0], -1)
