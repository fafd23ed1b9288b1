"""Step 5 (SPEAR §3.4): fix the unknown column scales from the bias gradient, reconstruct X.

For unscaled columns Q̄, g = ∂L/∂Z · 1 = L Q̄ s, so s = Q̄⁻¹ L⁺ g and Xᵀ = diag(s)⁻¹ Q̄⁻¹ R.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LayerSystem:
    """What every selection/scale step needs, precomputed once per gradient (float64)."""

    L: torch.Tensor
    """(m, B) left factor, G = L R."""
    R: torch.Tensor
    """(B, n) right factor."""
    t: torch.Tensor
    """(B,) L⁺ g: the bias gradient in the coordinates of L."""
    WR: torch.Tensor | None
    """(m, B) W Rᵀ, so that Z = W X + b costs O(m B²) per candidate basis, not O(m n B)."""
    bias: torch.Tensor | None
    zero_rtol: float
    weight: torch.Tensor | None = None
    z_band: float = 0.0
    """Relative band around Z = 0 within which the sign is rounding error (λ test)."""
    subset: bool = False
    """Zero rows of a column need only be inactive units (a FedAvg sum over local steps), not
    all of them: λ then checks the inclusion (``AttackConfig.update``)."""


def make_system(
    L: torch.Tensor,
    R: torch.Tensor,
    bias_grad: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    zero_rtol: float,
    z_band: float = 0.0,
    subset: bool = False,
) -> LayerSystem:
    """Precompute the reusable products of one layer's decomposition."""
    t = torch.linalg.lstsq(L, bias_grad[:, None]).solution[:, 0]
    WR = weight @ R.T if weight is not None else None
    return LayerSystem(L=L, R=R, t=t, WR=WR, bias=bias, zero_rtol=zero_rtol, z_band=z_band,
                       weight=weight, subset=subset)


def scales(Q: torch.Tensor, system: LayerSystem) -> torch.Tensor:
    """Scales s with Q = Q̄ diag(s) (SPEAR §3.4)."""
    return torch.linalg.solve(Q, system.t)


def reconstruct(Q: torch.Tensor, system: LayerSystem) -> tuple[torch.Tensor, torch.Tensor]:
    """The inputs for unscaled columns ``Q`` (SPEAR §3.4): Xᵀ = diag(s)⁻¹ Q⁻¹ R.

    Parameters
    ----------
    Q : (B, B)
        The selected unit columns.
    system
        The layer's products (R and t = L⁺ g).

    Returns
    -------
    (X (B, n), s (B,))
        The inputs (rows) and the scales used (tiny scales floored at float epsilon).
    """
    P_R = torch.linalg.solve(Q, system.R)
    s = scales(Q, system)
    tiny = torch.finfo(s.dtype).eps * s.abs().max()
    s = torch.where(s.abs() < tiny, torch.full_like(s, tiny), s)
    return P_R / s[:, None], s
