"""Input checks of the attack entry points: precise errors instead of silent wrong answers."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


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
        raise ValueError("weight_grad is identically zero: the update carries no information")
    if not bias_grad.abs().max() > 0:
        raise ValueError(
            "bias_grad is identically zero: sample scales cannot be fixed without the bias gradient"
        )


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
