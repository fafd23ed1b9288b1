"""Step 4 (SPEC §5): pick B directions among the candidates.

Stage 1 takes the sparsest candidates that increase the rank (completing with an orthonormal
basis of the complement when too few exist: a partial reconstruction). Stage 2 greedily swaps a
column for a spare candidate while the sparsity-matching coefficient λ increases. A swap changes
Q̄ by a rank-one term, so its λ is evaluated in O(m B) with Sherman-Morrison instead of the
O(m n B) of a fresh reconstruction.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fl_attack.clock import passed
from fl_attack.filtering import zero_mask
from fl_attack.scale import LayerSystem, scales


def stage1(candidates: torch.Tensor, B: int, tol: float = 1e-8) -> tuple[torch.Tensor, int]:
    """Indices of the first columns (in given order) that increase the rank, at most B.

    Returns (indices, count). ``candidates`` (B, K) is expected sorted by decreasing sparsity.
    """
    basis = torch.empty(B, 0, dtype=candidates.dtype, device=candidates.device)
    chosen: list[int] = []
    C = candidates / candidates.norm(dim=0, keepdim=True)
    for k in range(C.shape[1]):
        c = C[:, k]
        r = c - basis @ (basis.T @ c)
        r = r - basis @ (basis.T @ r)
        norm = float(r.norm())
        if norm > tol:
            basis = torch.cat([basis, (r / norm)[:, None]], dim=1)
            chosen.append(k)
            if len(chosen) == B:
                break
    return torch.tensor(chosen, dtype=torch.long, device=candidates.device), len(chosen)


def complete_basis(Q: torch.Tensor, B: int) -> torch.Tensor:
    """Append an orthonormal basis of the orthogonal complement of span(Q) to reach B columns."""
    k = Q.shape[1]
    if k >= B:
        return Q
    if k == 0:
        return torch.eye(B, dtype=Q.dtype, device=Q.device)
    U, _, _ = torch.linalg.svd(Q, full_matrices=True)
    return torch.cat([Q, U[:, k:B]], dim=1)


def _matches(Z: torch.Tensor, Dzero: torch.Tensor, band: float = 0.0,
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


def _ambiguous(V: torch.Tensor, zero_rtol: float) -> torch.Tensor:
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
    column's largest entry; such units were measured at 5e-8 to 1e-6, 1-3 per batch at
    (150, 4000), on 13 of 20 true bases). ``n_band`` active entries were seen in the
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
    (``_ambiguous``). Shared by the output side (:func:`sparsity_match`) and the input side
    (``fl_attack.input_layer.pattern_match``). Returns (ok, forgiven).
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
    """λ = (λ₋ + λ₊)/(m B) for unscaled columns ``Q`` (SPEC §1); None without weight and bias.

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
    amb = _ambiguous(V, system.zero_rtol)
    ok = _matches(Z, Dzero, system.z_band, system.subset) | amb
    # FedAvg sums (whose λ checks only zeros) forgive nothing
    ok, forgiven = ((ok, 0) if system.subset
                    else forgive_chance_zeros(ok, Z, amb, Dzero, system.z_band))
    per_col = ok.sum(dim=0)
    value = float(per_col.sum()) / (m * Q.shape[1])
    return Match(value=value, per_column=per_col, H=H, s=s, P=P, chance_zeros=forgiven)


def best_swap(
    A: torch.Tensor,
    trial: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                    torch.Tensor],
    *,
    base: float,
    positions: int,
    chunk: int,
    deadline: float | None = None,
) -> tuple[int, int] | None:
    """The best (spare u, column i) swap by ``trial``'s score, or None if none beats ``base``.

    ``A`` (B, c) holds the spares' coordinates in the current basis. Only the ``positions``
    columns with the largest |A[i, u]| are tried per spare (the others would make the basis
    nearly singular), in chunks of ``chunk`` trials. ``trial(u, i, a_i, ok, ratio)`` scores a
    chunk of trials (p,): spares ``u`` (p,), columns ``i`` (p,), pivots ``a_i`` (1, p), ``ok``
    (1, p) where the pivot is usable, ``ratio = A[:, u] / a_i`` (B, p). Shared by the
    output-side and the input-side greedy selections, which differ only in that score.
    Past ``deadline`` (a ``time.perf_counter()`` value) no further chunk starts: the best
    swap among the trials made is returned (any swap that beats ``base`` improves λ).
    """
    c = A.shape[1]
    r = min(positions, A.shape[0])
    pos = A.abs().topk(r, dim=0).indices  # (r, c)
    u_idx = torch.arange(c, device=A.device).repeat(r)
    i_idx = pos.reshape(-1)
    best_gain, best = 0.0, None
    for start in range(0, u_idx.numel(), chunk):
        if start > 0 and passed(deadline):
            break
        u = u_idx[start:start + chunk]
        i = i_idx[start:start + chunk]
        a = A[:, u]  # (B, p)
        a_i = a.gather(0, i[None])  # (1, p)
        ok = a_i.abs() > 1e-10
        ratio = a / torch.where(ok, a_i, torch.ones_like(a_i))  # (B, p)
        total = trial(u, i, a_i, ok, ratio)
        total[~ok[0]] = -1.0
        gain, j = total.max(dim=0)
        if float(gain) - base > best_gain:
            best_gain, best = float(gain) - base, (int(u[j]), int(i[j]))
    return best


def greedy_swaps(
    Q: torch.Tensor,
    spare: torch.Tensor,
    system: LayerSystem,
    *,
    max_swaps: int = 200,
    positions: int = 6,
    chunk_elems: int = 2**25,
    deadline: float | None = None,
) -> tuple[torch.Tensor, Match | None, int]:
    """Stage 2: best-improvement swaps of columns of ``Q`` with ``spare`` candidates.

    Returns (Q, its Match, number of swaps made). Each swap raises λ, so stopping early is
    safe: past ``deadline`` (a ``time.perf_counter()`` value) no new swap is searched and the
    one being searched keeps the best trial so far.
    """
    match = sparsity_match(Q, system)
    if match is None or spare.shape[1] == 0:
        return Q, match, 0
    L, b = system.L, system.bias
    m, B = L.shape
    Q = Q.clone()
    spare = spare.clone()
    spare_zero = zero_mask(L @ spare, system.zero_rtol)  # (m, c)
    spare_amb = _ambiguous(L @ spare, system.zero_rtol)
    Dzero = zero_mask(L @ Q, system.zero_rtol)
    Damb = _ambiguous(L @ Q, system.zero_rtol)
    swaps = 0
    while swaps < max_swaps and match.value < 1.0:
        if passed(deadline):
            break
        now = match

        def trial(u: torch.Tensor, i: torch.Tensor, a_i: torch.Tensor, ok: torch.Tensor,
                  ratio: torch.Tensor, now: Match = now) -> torch.Tensor:
            Hi = now.H[:, i]  # (m, p)
            s_new = now.s[:, None] - ratio * now.s[i][None]  # (B, p)
            H_new = now.H[:, :, None] - Hi[:, None, :] * ratio[None]  # (m, B, p)
            Z_new = H_new / s_new[None] + b[:, None, None]
            counts = (_matches(Z_new, Dzero[:, :, None], system.z_band, system.subset)
                      | Damb[:, :, None]).sum(dim=0)  # (B, p)
            # column i keeps x_i (its Z is unchanged) but its pattern becomes that of the spare
            Zi = now.H[:, i] / now.s[i][None] + b[:, None]
            counts_i = (_matches(Zi, spare_zero[:, u], system.z_band, system.subset)
                        | spare_amb[:, u]).sum(dim=0)
            counts.scatter_(0, i[None], counts_i[None])
            return counts.sum(dim=0).to(torch.float64)

        best = best_swap(match.P @ spare, trial, base=float(match.per_column.sum()),
                         positions=positions, chunk=max(1, chunk_elems // (m * B)),
                         deadline=deadline)
        if best is None:
            break
        u_sel, i_sel = best
        old = Q[:, i_sel].clone()
        Q[:, i_sel] = spare[:, u_sel]
        spare[:, u_sel] = old
        for cur, spr in ((Dzero, spare_zero), (Damb, spare_amb)):
            swapped = cur[:, i_sel].clone()
            cur[:, i_sel] = spr[:, u_sel]
            spr[:, u_sel] = swapped
        match = sparsity_match(Q, system)
        swaps += 1
    return Q, match, swaps


__all__ = ["Match", "best_swap", "complete_basis", "forgive_chance_zeros", "greedy_swaps", "scales",
           "sparsity_match", "stage1"]
