"""Column utilities shared by every step: numerical zeros, unit columns, duplicates, patterns.

A candidate direction q is judged by the column ``L q``; these helpers work on a matrix of such
columns (m, K) or of directions (B, K) at once.
"""

from __future__ import annotations

import torch


def zero_mask(V: torch.Tensor, rtol: float) -> torch.Tensor:
    """Entries of each column of ``V`` (m, K) that are numerically zero relative to its max."""
    scale = V.abs().amax(dim=0, keepdim=True).clamp_min(torch.finfo(V.dtype).tiny)
    return V.abs() <= rtol * scale


def normalize_columns(Q: torch.Tensor) -> torch.Tensor:
    """Unit-norm columns with a canonical sign (largest-magnitude entry positive)."""
    Q = Q / Q.norm(dim=0, keepdim=True).clamp_min(torch.finfo(Q.dtype).tiny)
    idx = Q.abs().argmax(dim=0)
    sign = torch.sign(Q.gather(0, idx[None])).squeeze(0)
    sign[sign == 0] = 1
    return Q * sign


def dedupe(Q: torch.Tensor, tol: float = 1e-6) -> torch.Tensor:
    """Indices of the columns of ``Q`` to keep: the first of each group of ± duplicates."""
    K = Q.shape[1]
    if K <= 1:
        return torch.arange(K, device=Q.device)
    Qn = normalize_columns(Q)
    cos = (Qn.T @ Qn).abs()
    dup = torch.triu(cos > 1 - tol, diagonal=1).any(dim=0)
    return torch.nonzero(~dup).squeeze(1)


def span_distances(Q: torch.Tensor) -> torch.Tensor | None:
    """(B,) each unit column's distance to the span of the other columns of the square ``Q``:
    1 / ‖row i of Q⁻¹‖. None when ``Q`` is singular (or its inverse overflows)."""
    inv, info = torch.linalg.inv_ex(Q)
    if int(info) != 0 or not bool(torch.isfinite(inv).all()):
        return None
    return 1.0 / inv.norm(dim=1)


def pattern_keys(mask: torch.Tensor) -> list[bytes]:
    """Hashable keys of the boolean columns of ``mask`` (m, K), one per column: the zero
    pattern of a candidate, to remember what was already tried for it."""
    mask = mask.cpu()
    return [mask[:, j].numpy().tobytes() for j in range(mask.shape[1])]
