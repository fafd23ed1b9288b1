"""Each sample's gradient at the attacked layer, from SPEAR's exact reconstruction.

For a linear layer ``Z = W X + b`` the weight gradient is ``G = Σ_i (∂L/∂Z_i) x_iᵀ``, i.e.
``G = Dᵀ X`` with ``D`` (B, m) the per-sample ``∂L/∂Z`` and ``X`` (B, n) the inputs (SPEAR
§3.1). Once ``X`` is recovered exactly, ``D`` follows by least squares, ``Dᵀ = G X⁺``
(exact when the B inputs are linearly independent, which a certified reconstruction implies),
and the gradient flowing back into the features is ``∂L/∂X_i = Wᵀ ∂L/∂Z_i``. With a weight
update ``lr · G`` instead of ``G`` both carry the factor ``lr``, as do the updates of the
earlier layers, so the factor cancels in :func:`fl_attack.pixels.terms.gradient_mismatch`.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

__all__ = ["feature_gradients", "output_gradients"]


def _f64(value: Tensor | np.ndarray, what: str) -> Tensor:
    t = torch.as_tensor(value).detach().to("cpu", torch.float64)
    if t.ndim != 2:
        raise ValueError(f"{what} must be 2-d, got shape {tuple(t.shape)}")
    return t


def output_gradients(weight_grad: Tensor | np.ndarray, inputs: Tensor | np.ndarray) -> Tensor:
    """Per-sample ``∂L/∂Z`` of the attacked layer: ``D = (G X⁺)ᵀ`` (SPEAR §3.1).

    Parameters
    ----------
    weight_grad : (m, n)
        The layer's weight gradient or weight update ``W₀ − W₁``.
    inputs : (B, n)
        The reconstructed inputs (``Reconstruction.inputs``), in the order the result keeps.

    Returns
    -------
    (B, m) float64 tensor
        Row ``i`` is sample ``i``'s ``∂L/∂Z`` (times the learning rate for an update).
    """
    g = _f64(weight_grad, "weight_grad")
    x = _f64(inputs, "inputs")
    if g.shape[1] != x.shape[1]:
        raise ValueError(f"weight_grad {tuple(g.shape)} and inputs {tuple(x.shape)} disagree on n")
    return (g @ torch.linalg.pinv(x)).T.contiguous()


def feature_gradients(weight_grad: Tensor | np.ndarray, inputs: Tensor | np.ndarray,
                      weight: Tensor | np.ndarray) -> Tensor:
    """Per-sample gradient flowing back into the layer's inputs: ``∂L/∂X_i = Wᵀ ∂L/∂Z_i``.

    This is the known upstream gradient of the layers before the attacked one, the
    ``upstream`` argument of :func:`fl_attack.pixels.invert_features`.

    Parameters
    ----------
    weight_grad : (m, n)
        The layer's weight gradient or update.
    inputs : (B, n)
        The reconstructed inputs.
    weight : (m, n)
        The layer's weight the client started from (the server sent it).

    Returns
    -------
    (B, n) float64 tensor
    """
    w = _f64(weight, "weight")
    d = output_gradients(weight_grad, inputs)
    if w.shape[0] != d.shape[1] or w.shape[1] != _f64(inputs, "inputs").shape[1]:
        raise ValueError(f"weight {tuple(w.shape)} does not fit the layer's gradient")
    return d @ w
