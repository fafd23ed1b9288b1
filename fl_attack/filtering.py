"""Step 3 (SPEC §3.2, §4): keep candidate directions that are sparse enough and new (up to sign)."""

from __future__ import annotations

import functools

import torch
from scipy.stats import binom


@functools.lru_cache(maxsize=256)
def min_zero_count(m: int, p_false_reject: float, tau: float | None = None) -> int:
    """Smallest number of zeros a true direction must show.

    With τ from the binomial tail, a true column (each entry zero w.p. 1/2) is rejected with
    probability ``2^-m Σ_{i ≤ ⌊τm⌋} C(m, i) < p_false_reject``.
    """
    if tau is not None:
        return int(tau * m) + 1
    k = int(binom.ppf(p_false_reject, m, 0.5))
    while k >= 0 and binom.cdf(k, m, 0.5) >= p_false_reject:
        k -= 1
    return max(k, 0) + 1


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
