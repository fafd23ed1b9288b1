"""Input checks of the attack entry points: precise errors instead of silent wrong answers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fl_attack.config import AttackConfig
from fl_attack.errors import ZeroUpdate
from fl_attack.steps.tolerances import rounding_edge


def as_tensor(value: Any, name: str, *, ndim: int, device: torch.device) -> torch.Tensor:
    """Convert a torch tensor or numpy array to a float64 tensor on ``device``, checking rank."""
    if isinstance(value, np.ndarray):
        if not np.issubdtype(value.dtype, np.number) or np.iscomplexobj(value):
            raise TypeError(f"{name} must hold real numbers, got dtype {value.dtype}")
        value = torch.from_numpy(np.ascontiguousarray(value))
    elif not isinstance(value, torch.Tensor):
        kind = type(value).__name__
        raise TypeError(f"{name} must be a torch.Tensor or numpy.ndarray, got {kind}")
    if value.is_complex() or value.dtype == torch.bool:
        raise TypeError(f"{name} must hold real numbers, got dtype {value.dtype}")
    if value.ndim != ndim:
        want = "(m, n) matrix" if ndim == 2 else "(m,) vector"
        raise ValueError(f"{name} must be a {want}, got shape {tuple(value.shape)}")
    if value.numel() == 0:
        raise ValueError(f"{name} is empty (shape {tuple(value.shape)})")
    value = value.detach()
    if not torch.isfinite(value).all():
        bad = int((~torch.isfinite(value)).sum())
        raise ValueError(f"{name} contains {bad} non-finite value(s) (NaN or Inf)")
    return value.to(device=device, dtype=torch.float64)


def input_precision(*values: Any) -> torch.dtype:
    """The coarsest float precision among the given arrays (decides numerical zero tolerances)."""
    for value in values:
        dtype = getattr(value, "dtype", None)
        if dtype in (torch.float16, torch.bfloat16, torch.float32, np.float32, np.float16):
            return torch.float32
    return torch.float64


def check_layer(
    weight_grad: torch.Tensor,
    bias_grad: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> None:
    """Check that gradient, weight and bias shapes describe one linear layer."""
    m, n = weight_grad.shape
    if bias_grad.shape != (m,):
        raise ValueError(
            f"bias_grad has shape {tuple(bias_grad.shape)} but weight_grad {(m, n)} needs ({m},)"
        )
    if (weight is None) != (bias is None):
        raise ValueError("pass both weight and bias (needed for λ) or neither")
    if weight is not None and weight.shape != (m, n):
        raise ValueError(f"weight has shape {tuple(weight.shape)}, weight_grad has {(m, n)}")
    if bias is not None and bias.shape != (m,):
        raise ValueError(f"bias has shape {tuple(bias.shape)}, expected ({m},)")
    if min(m, n) < 2:
        raise ValueError(f"layer of shape {(m, n)} is too small to invert (need m, n >= 2)")
    if not weight_grad.abs().max() > 0:
        raise ZeroUpdate("weight_grad is identically zero: the update carries no information",
                         part="weight")
    if not bias_grad.abs().max() > 0:
        raise ZeroUpdate(
            "bias_grad is identically zero: sample scales cannot be fixed without the bias "
            "gradient", part="bias")


def resolve_device(device: str | torch.device | None) -> torch.device:
    """None picks CUDA when available; anything else must name an available device."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"unknown device {device!r}") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available")
    return dev


def check_next_layer(G: torch.Tensor, G2: torch.Tensor, W: torch.Tensor | None,
                      cfg: AttackConfig) -> None:
    """Errors for a ``next_weight_grad`` that cannot belong to this layer or this attack."""
    if G2.shape[1] != G.shape[0]:
        raise ValueError(f"next_weight_grad has shape {tuple(G2.shape)}: the next layer takes "
                         f"this layer's {G.shape[0]} outputs, so it must be (k, {G.shape[0]})")
    if W is None:
        raise ValueError("next_weight_grad needs weight and bias (the samples are solved from "
                         "W x + b)")
    if cfg.sparse != "output":
        raise ValueError(f"next_weight_grad applies to sparse='output' only, got {cfg.sparse!r}")
    if cfg.update == "fedavg":
        raise ValueError("next_weight_grad needs a single-step gradient: a FedAvg update's "
                         "next layer mixes each sample's activations from several steps")
    if not G2.abs().max() > 0:
        raise ZeroUpdate("next_weight_grad is identically zero", part="next-weight")


@dataclass(frozen=True)
class LayerUpdate:
    """One linear layer's update, validated: what every side of the attack inverts.

    Tensors are float64 on ``device``; ``precision`` is the coarsest precision they were given
    in, or float32 for a difference of weights stored in float32 or coarser (``weights_dtype``:
    a float64 copy of ``W₀ - W_E`` holds no more), and sets the numerical tolerances
    (``fl_attack.steps.tolerances``).
    """

    weight_grad: torch.Tensor
    """(m, n) ∂L/∂W, or W₀ - W_E."""
    bias_grad: torch.Tensor
    """(m,) ∂L/∂b, or b₀ - b_E."""
    weight: torch.Tensor | None
    """(m, n) the layer's weight the client started from (None: no certificate)."""
    bias: torch.Tensor | None
    """(m,) its bias."""
    next_weight_grad: torch.Tensor | None
    """(k, m) the next linear layer's weight gradient, for peeling (``fl_attack.steps.peel``)."""
    precision: torch.dtype
    device: torch.device
    rounding_edge: float = 0.0
    """The estimated largest singular value the stored weights' rounding adds to ``weight_grad``
    (``AttackConfig.weights_dtype``, ``tolerances.rounding_edge``); 0 for a gradient."""
    next_rounding_edge: float = 0.0
    """The same for ``next_weight_grad`` (needs ``next_weight``); 0 when not known."""


def load_layer(weight_grad: Any, bias_grad: Any, weight: Any, bias: Any,
               next_weight_grad: Any, device: str | torch.device | None,
               cfg: AttackConfig, *, next_weight: Any = None) -> LayerUpdate:
    """Check the arguments of ``fl_attack.invert`` and convert them to a :class:`LayerUpdate`.

    Raises
    ------
    TypeError
        An argument that is not a real torch tensor or numpy array.
    ValueError
        Wrong shapes, non-finite gradients, weight without bias, an unknown device, or a
        ``next_weight_grad`` (or ``next_weight``) that cannot belong to this layer or attack.
    fl_attack.errors.ZeroUpdate
        An all-zero gradient (``part``: ``"weight"``, ``"bias"`` or ``"next-weight"``).
    """
    dev = resolve_device(device)
    precision = input_precision(weight_grad, bias_grad)
    if cfg.weights_dtype not in (None, "float64"):  # W₀ - W_E is no finer than W_E's storage
        precision = torch.float32
    G = as_tensor(weight_grad, "weight_grad", ndim=2, device=dev)
    g = as_tensor(bias_grad, "bias_grad", ndim=1, device=dev)
    W = as_tensor(weight, "weight", ndim=2, device=dev) if weight is not None else None
    b = as_tensor(bias, "bias", ndim=1, device=dev) if bias is not None else None
    check_layer(G, g, W, b)
    G2 = None
    if next_weight_grad is not None:
        G2 = as_tensor(next_weight_grad, "next_weight_grad", ndim=2, device=dev)
        check_next_layer(G, G2, W, cfg)
    next_edge = _next_rounding_edge(next_weight, G2, dev, cfg)
    edge = 0.0
    if cfg.weights_dtype is not None:
        if W is None:
            raise ValueError(f"weights_dtype={cfg.weights_dtype!r} needs the layer's weight "
                             "(pass weight= and bias=): its rounding is read off W₀ - update")
        edge = rounding_edge(W, G, cfg.weights_dtype)
    return LayerUpdate(weight_grad=G, bias_grad=g, weight=W, bias=b, next_weight_grad=G2,
                       precision=precision, device=dev, rounding_edge=edge,
                       next_rounding_edge=next_edge)


def _next_rounding_edge(next_weight: Any, G2: torch.Tensor | None,
                        dev: torch.device, cfg: AttackConfig) -> float:
    """The rounding edge of the next layer's weight difference (0 without ``next_weight`` or
    ``weights_dtype``), after checking ``next_weight`` against ``next_weight_grad``."""
    if next_weight is None:
        return 0.0
    if G2 is None:
        raise ValueError("next_weight needs next_weight_grad (it sets the rounding floor of "
                         "the next layer's weight difference)")
    W2 = as_tensor(next_weight, "next_weight", ndim=2, device=dev)
    if W2.shape != G2.shape:
        raise ValueError(f"next_weight has shape {tuple(W2.shape)}, next_weight_grad "
                         f"{tuple(G2.shape)}: they must match")
    return rounding_edge(W2, G2, cfg.weights_dtype) if cfg.weights_dtype is not None else 0.0
