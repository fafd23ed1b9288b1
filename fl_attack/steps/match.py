"""The sparsity-matching coefficient λ (SPEAR §4.2): does a basis explain the ReLU law?

For unscaled columns Q̄ the reconstruction gives every sample's pre-activations Z = W X + b, and
L Q̄ its gradient columns ∂L/∂Z. The ReLU law says ∂L/∂Z is zero exactly where Z ≤ 0; λ is the
fraction of the m B entries where the two patterns agree, 1 for the true basis. A basis with
λ = 1 is certified without ground truth (``result.certified``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fl_attack.core.columns import zero_mask
from fl_attack.steps.scale import LayerSystem


def matches(Z: torch.Tensor, Dzero: torch.Tensor, band: float = 0.0,
             subset: bool = False) -> torch.Tensor:
    """Entry-wise agreement of "Z ≤ 0" with "∂L/∂Z = 0" (the λ₋ and λ₊ terms).

    Pre-activations within ``band`` x the column's largest |Z| of zero are within the
    reconstruction's rounding error, so either pattern counts as a match there. ``subset``
    (FedAvg sums, ``LayerSystem.subset``): only zeros need an inactive unit; a non-zero entry
    always matches (the unit may have been inactive at W₀ and active at a later step).
    """
    tol = band * Z.abs().amax(dim=0, keepdim=True) if band > 0 else 0.0
    inactive = Z <= tol
    if subset:
        return inactive | ~Dzero
    if band <= 0:
        return inactive == Dzero
    return torch.where(Dzero, inactive, Z > -tol)


AMBIGUOUS_FLOOR = 1e-2
"""Below this fraction of the zero tolerance an entry counts as a zero for λ."""


def ambiguous(V: torch.Tensor, zero_rtol: float) -> torch.Tensor:
    """Entries of ∂L/∂Z too small to tell from rounding noise (within 100x of the zero test).

    Real ∂L/∂Y can be that small; such entries count as matching either way in λ.
    """
    return zero_mask(V, zero_rtol) & ~zero_mask(V, zero_rtol * AMBIGUOUS_FLOOR)


CHANCE_TAIL = 1e-3
"""Tail probability below which more chance zeros than observed are implausible."""


def chance_zero_allowance(n_band: int, band_ratio: float) -> int:
    """How many active units may show a gradient below the zero test by chance.

    An active unit's ∂L/∂Z is its ∂L/∂A, which can be arbitrarily small: the ReLU law allows
    it, and a float32 gradient cannot tell it from zero (true zeros scatter up to ~2e-6 of the
    column's largest entry, and real batches have such units). ``n_band`` active entries were
    seen in the
    ambiguous band; a density flat near zero predicts about ``n_band · band_ratio`` below it
    (``n_band + 1``: the band count is itself a Poisson draw, and at small layers it is often
    0). The allowance is the (1 − CHANCE_TAIL) quantile of that Poisson count.
    """
    mu = (n_band + 1) * band_ratio
    if mu <= 0.0:
        return 0
    k, cdf = 0, 0.0
    while True:  # in logs: e^-mu underflows for mu > 745 (noisy updates fill the band)
        cdf += math.exp(k * math.log(mu) - mu - math.lgamma(k + 1))
        if 1.0 - cdf <= CHANCE_TAIL:
            return k
        k += 1


def forgive_chance_zeros(ok: torch.Tensor, Z: torch.Tensor, ambiguous: torch.Tensor,
                         Dzero: torch.Tensor, z_band: float) -> tuple[torch.Tensor, int]:
    """Count chance zeros as matches when they are the only mismatches and plausibly few.

    A chance zero is an active unit (``Z`` (m, B) above the band) whose ∂L/∂Z passes the zero
    test (``Dzero``). The ReLU law (Z ≤ 0 ⇒ ∂L/∂Z = 0) holds there; only the paper's λ₊ term
    counts it. A wrong basis breaks the law itself (a column mixing two samples is non-zero
    where one of them is inactive), so any law violation keeps every mismatch counted.
    ``ok``: the entries matching so far; ``ambiguous``: the entries in the band
    (:func:`ambiguous`). Shared by the output side (:func:`sparsity_match`) and the input side
    (``fl_attack.solver.input_side.pattern_match``). Returns (ok, forgiven).
    """
    bad = ~ok
    n_bad = int(bad.sum())
    if n_bad == 0 or bool((bad & ~Dzero).any()):
        return ok, 0
    tol = z_band * Z.abs().amax(dim=0, keepdim=True)
    n_band = int(((Z > tol) & ambiguous).sum())
    if n_bad > chance_zero_allowance(n_band, AMBIGUOUS_FLOOR / (1.0 - AMBIGUOUS_FLOOR)):
        return ok, 0
    return torch.ones_like(ok), n_bad


@dataclass
class Match:
    """The sparsity-matching coefficient λ of a basis and what is needed to update it."""

    value: float
    per_column: torch.Tensor
    H: torch.Tensor
    s: torch.Tensor
    P: torch.Tensor
    chance_zeros: int = 0
    """Active units whose ∂L/∂Z passed the zero test, counted as matches
    (:func:`forgive_chance_zeros`)."""


def sparsity_match(Q: torch.Tensor, system: LayerSystem) -> Match | None:
    """λ = (λ₋ + λ₊)/(m B) for unscaled columns ``Q`` (SPEAR §4.2); None without weight and bias.

    Chance zeros (an active unit whose ∂L/∂Z is indistinguishable from zero) count as
    matches when they are the only mismatches and no more than chance explains
    (:func:`forgive_chance_zeros`): otherwise the true basis of such a batch could never reach
    λ = 1.
    """
    if system.WR is None or system.bias is None:
        return None
    m = system.L.shape[0]
    P = torch.linalg.inv(Q)
    s = P @ system.t
    H = system.WR @ P.T
    Z = H / s + system.bias[:, None]
    V = system.L @ Q
    Dzero = zero_mask(V, system.zero_rtol)
    amb = ambiguous(V, system.zero_rtol)
    ok = matches(Z, Dzero, system.z_band, system.subset) | amb
    # FedAvg sums (whose λ checks only zeros) forgive nothing
    ok, forgiven = ((ok, 0) if system.subset
                    else forgive_chance_zeros(ok, Z, amb, Dzero, system.z_band))
    per_col = ok.sum(dim=0)
    value = float(per_col.sum()) / (m * Q.shape[1])
    return Match(value=value, per_column=per_col, H=H, s=s, P=P, chance_zeros=forgiven)
