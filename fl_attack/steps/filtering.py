"""Filtering candidates (SPEAR §4.1, SPEAR++ §4.3): the sparsity a true column must show, and
how clearly sparse a column is under noise."""

from __future__ import annotations

import functools

import torch
from scipy.stats import binom


@functools.lru_cache(maxsize=256)
def min_zero_count(m: int, p_false_reject: float, tau: float | None = None,
                   rate: float = 0.5) -> int:
    """Smallest number of zeros a true direction must show.

    With τ from the binomial tail, a true column (each entry zero w.p. ``rate``, 1/2 in the
    papers) is rejected with probability ``P(Binom(m, rate) ≤ ⌊τm⌋) < p_false_reject``.
    """
    if tau is not None:
        return int(tau * m) + 1
    k = int(binom.ppf(p_false_reject, m, rate))
    while k >= 0 and binom.cdf(k, m, rate) >= p_false_reject:
        k -= 1
    return max(k, 0) + 1


def noise_scales(Q: torch.Tensor, row_noise: torch.Tensor) -> torch.Tensor:
    """Std of the noise on each entry of L q for the columns q of ``Q`` (B, K) (K,).

    L is the orthonormal factor of a gradient carrying i.i.d. noise of std ν, whose j-th
    column is perturbed by about ν / s_j (s_j its singular value); ``row_noise`` is that
    vector ν / s (B,).
    """
    return (Q * row_noise[:, None].to(Q)).norm(dim=0)


CLEAR_ZERO_SD = 3.0
"""Entries within this many noise stds count as zeros in :func:`noisy_sparsity`."""


CLEAR_SIGNAL_SD = 20.0
"""Entries beyond this many noise stds count as clearly active in :func:`noisy_sparsity`."""


def noisy_sparsity(V: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """How clearly each column of ``V`` = L Q (m, K) is a sparse column plus noise (K,): its
    entries within :data:`CLEAR_ZERO_SD` noise stds ``scale`` (K,) minus those in the
    ambiguous band up to :data:`CLEAR_SIGNAL_SD`.

    A true column under noise is bimodal: about half its entries at the noise level, the rest
    far above. A zero count relative to the column's largest entry ranks such columns below
    directions dominated by the noisiest singular vectors (larger noise, one large entry, a
    continuum below it); this score ranks the true columns first.
    """
    r = V.abs() / scale.clamp_min(torch.finfo(V.dtype).tiny)
    zero = r <= CLEAR_ZERO_SD
    return zero.sum(dim=0) - ((~zero) & (r <= CLEAR_SIGNAL_SD)).sum(dim=0)
