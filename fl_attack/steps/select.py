"""Step 4 (SPEAR §4.2): pick B directions among the candidates.

Stage 1 takes the sparsest candidates that increase the rank (completing with an orthonormal
basis of the complement when too few exist: a partial reconstruction). Stage 2 greedily swaps a
column for a spare candidate while the sparsity-matching coefficient λ increases. A swap changes
Q̄ by a rank-one term, so its λ is evaluated in O(m B) with Sherman-Morrison instead of the
O(m n B) of a fresh reconstruction.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from fl_attack.core.clock import passed
from fl_attack.core.columns import span_distances, zero_mask
from fl_attack.steps.match import Match, ambiguous, matches, sparsity_match
from fl_attack.steps.scale import LayerSystem

Trial = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                 torch.Tensor]
"""Scores a chunk of swap trials: ``trial(u, i, a_i, ok, ratio)`` (see :func:`best_swap`)."""


def stage1(candidates: torch.Tensor, B: int, tol: float = 1e-8) -> tuple[torch.Tensor, int]:
    """Stage 1 (SPEAR §4.2): the first columns (in given order) that increase the rank.

    Parameters
    ----------
    candidates : (B, K)
        Candidate directions, sorted by decreasing sparsity.
    B
        At most this many are chosen.
    tol
        A direction closer than this to the span of those chosen adds no rank.

    Returns
    -------
    (indices (count,), count)
        The chosen columns; count < B when too few are independent.
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


def best_swap(
    A: torch.Tensor,
    trial: Trial,
    *,
    base: float,
    positions: int,
    chunk: int,
    deadline: float | None = None,
    min_pivot: torch.Tensor | None = None,
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
    ``min_pivot`` (B,): the smallest usable |a_i| per column (a spare that would lie closer to
    the span of the other columns than the selection's tolerance is the same up to noise).
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
        if min_pivot is not None:
            ok &= a_i.abs() > min_pivot[i][None]
        ratio = a / torch.where(ok, a_i, torch.ones_like(a_i))  # (B, p)
        total = trial(u, i, a_i, ok, ratio)
        total[~ok[0]] = -1.0
        gain, j = total.max(dim=0)
        if float(gain) - base > best_gain:
            best_gain, best = float(gain) - base, (int(u[j]), int(i[j]))
    return best


class SwapScorer(Protocol):
    """What :func:`swap_greedily` needs from a side of the attack to score swaps.

    ``match(Q)`` evaluates a basis (None: no certificate, nothing to swap); ``total(match)`` is
    its number of matching entries; ``trials(Q, spare, match)`` returns the spares' coordinates
    in the current basis (B, c) and the :data:`Trial` scoring a chunk of swaps;
    ``swapped(i, u, old)`` updates the scorer's caches after column ``i`` of Q and spare ``u``
    were exchanged (``old``: the column that went to the spares).
    """

    units: int
    """m, the layer's units (rows of L Q): sizes the chunks of trials."""

    def match(self, Q: torch.Tensor) -> Any: ...

    def total(self, match: Any) -> float: ...

    def trials(self, Q: torch.Tensor, spare: torch.Tensor,
               match: Any) -> tuple[torch.Tensor, Trial]: ...

    def swapped(self, i: int, u: int, old: torch.Tensor) -> None: ...


def swap_greedily(
    Q: torch.Tensor,
    spare: torch.Tensor,
    scorer: SwapScorer,
    *,
    max_swaps: int = 200,
    positions: int = 6,
    chunk_elems: int = 2**25,
    deadline: float | None = None,
    span_tol: float = 0.0,
) -> tuple[torch.Tensor, Any, int]:
    """Stage 2 (SPEAR §4.2): best-improvement swaps of columns of ``Q`` (B, B) for ``spare``
    candidates (B, c), for either side of the attack (``scorer``).

    Parameters
    ----------
    Q, spare
        The stage-1 basis and the candidates left over (unit columns).
    scorer
        The side's λ and its rank-one trial score (:class:`SwapScorer`).
    max_swaps, positions, chunk_elems
        Swap cap; columns tried per spare (largest coefficients); elements per chunk of trials.
    deadline
        A ``time.perf_counter()`` value: past it no new swap is searched, and the one being
        searched keeps the best trial so far. Each swap raises λ, so stopping early is safe.
    span_tol
        A spare goes in only if its distance to the span of the other columns exceeds this
        (stage 1's rule: closer directions are the same up to noise). Without it a swap can
        put a column's near-copy beside it: on a trained model's update, whose weakest
        samples sit near the rounding, a strong sample's column mixed with a weak one's keeps
        λ rising while Q becomes nearly singular and every sample's solve goes wrong.

    Returns
    -------
    (Q, match, swaps)
        The final basis (a copy), its match and the number of swaps made.
    """
    match = scorer.match(Q)
    if match is None or spare.shape[1] == 0:
        return Q, match, 0
    Q, spare = Q.clone(), spare.clone()
    m, B = scorer.units, Q.shape[0]
    swaps = 0
    while swaps < max_swaps and match.value < 1.0:
        if passed(deadline):
            break
        coords, trial = scorer.trials(Q, spare, match)
        min_pivot = None
        if span_tol > 0:  # the spare's distance to the others' span is |a_i| x column i's
            dist = span_distances(Q)
            if dist is None:
                break
            min_pivot = span_tol / dist
        best = best_swap(coords, trial, base=scorer.total(match), positions=positions,
                         chunk=max(1, chunk_elems // (m * B)), deadline=deadline,
                         min_pivot=min_pivot)
        if best is None:
            break
        u_sel, i_sel = best
        old = Q[:, i_sel].clone()
        Q[:, i_sel] = spare[:, u_sel]
        spare[:, u_sel] = old
        scorer.swapped(i_sel, u_sel, old)
        match = scorer.match(Q)
        swaps += 1
    return Q, match, swaps


class OutputSwaps:
    """The output side's swap score: λ of :func:`~fl_attack.steps.match.sparsity_match`, each trial
    in O(m B) by the rank-one update of Q̄⁻¹ (SPEAR §4.2)."""

    def __init__(self, system: LayerSystem, Q: torch.Tensor, spare: torch.Tensor) -> None:
        self.system = system
        L = system.L
        self.units = L.shape[0]
        self.spare_zero = zero_mask(L @ spare, system.zero_rtol)  # (m, c)
        self.spare_amb = ambiguous(L @ spare, system.zero_rtol)
        self.Dzero = zero_mask(L @ Q, system.zero_rtol)
        self.Damb = ambiguous(L @ Q, system.zero_rtol)

    def match(self, Q: torch.Tensor) -> Match | None:
        return sparsity_match(Q, self.system)

    def total(self, match: Match) -> float:
        return float(match.per_column.sum())

    def trials(self, Q: torch.Tensor, spare: torch.Tensor,
               match: Match) -> tuple[torch.Tensor, Trial]:
        system, b = self.system, self.system.bias
        assert b is not None
        Dzero, Damb, spare_zero, spare_amb = self.Dzero, self.Damb, self.spare_zero, self.spare_amb

        def trial(u: torch.Tensor, i: torch.Tensor, a_i: torch.Tensor, ok: torch.Tensor,
                  ratio: torch.Tensor) -> torch.Tensor:
            Hi = match.H[:, i]  # (m, p)
            s_new = match.s[:, None] - ratio * match.s[i][None]  # (B, p)
            H_new = match.H[:, :, None] - Hi[:, None, :] * ratio[None]  # (m, B, p)
            Z_new = H_new / s_new[None] + b[:, None, None]
            counts = (matches(Z_new, Dzero[:, :, None], system.z_band, system.subset)
                      | Damb[:, :, None]).sum(dim=0)  # (B, p)
            # column i keeps x_i (its Z is unchanged) but its pattern becomes that of the spare
            Zi = match.H[:, i] / match.s[i][None] + b[:, None]
            counts_i = (matches(Zi, spare_zero[:, u], system.z_band, system.subset)
                        | spare_amb[:, u]).sum(dim=0)
            counts.scatter_(0, i[None], counts_i[None])
            return counts.sum(dim=0).to(torch.float64)

        return match.P @ spare, trial

    def swapped(self, i: int, u: int, old: torch.Tensor) -> None:
        for cur, spr in ((self.Dzero, self.spare_zero), (self.Damb, self.spare_amb)):
            swapped = cur[:, i].clone()
            cur[:, i] = spr[:, u]
            spr[:, u] = swapped


