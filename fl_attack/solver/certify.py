"""Selection and certificate steps: assess the pool after each step, keep only feasible
columns to build on, and the final selection (stage 2 swaps, repair, noisy refit).

The certificate is the sparsity-matching coefficient λ (SPEAR §4.2, :mod:`fl_attack.steps.match`):
λ = 1 with all B columns found certifies the batch without ground truth. Partial bases are
checked column by column with a linear program (:mod:`fl_attack.steps.feasibility`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from fl_attack.core.columns import (
    dedupe,
    normalize_columns,
    pattern_keys,
    span_distances,
    zero_mask,
)
from fl_attack.solver import violations
from fl_attack.solver.candidates import missing_candidates
from fl_attack.solver.pool import CandidatePool, Selection
from fl_attack.solver.state import SearchContext, SearchState
from fl_attack.steps import feasibility, match, polish, select


@dataclass(frozen=True)
class Assessment:
    """The pool's stage-1 selection after a step, and whether the search may stop."""

    Q: torch.Tensor
    """(B, B) the selection (first ``count`` columns from the pool)."""
    count: int
    done: bool
    """B columns with λ at the stop level (under noise: all B trusted too)."""


def assess(ctx: SearchContext, state: SearchState, pool: CandidatePool) -> Assessment:
    """Select from the pool, compute λ of a full selection, and decide which columns to trust.

    Sets ``state.match``, ``state.trusted`` (clean: the columns whose patterns match on all m
    units; partial: the feasible ones; noisy: those scoring ``Tuning.noisy_trust`` of a true
    column's sparsity and, in a full selection, without more than ``Tuning.noisy_violations``
    confident violations of the ReLU law, ``violations.violating``) and ``state.deflated``
    (what later rounds search the complement of).

    Parameters
    ----------
    ctx, state, pool
        The search (:mod:`fl_attack.solver.state`); the state's selection fields are set here.

    Returns
    -------
    Assessment
        The selection (B, B), how many of its columns are from the pool, whether done.
    """
    t0 = time.perf_counter()
    sel = pool.select()
    Q, count, B = sel.Q, sel.count, ctx.B
    state.match = match.sparsity_match(Q, ctx.system) if count == B else None
    state.trusted = Q[:, :count]
    if ctx.row_noise is not None:  # under noise no pattern matches on every unit
        trust = _noisy_trusted(ctx, pool.scores[sel.idx])
        if count == B:  # and a column that clearly breaks the ReLU law is not a sample's
            trust &= ~violations.violating(ctx, Q).to(trust.device)
        state.trusted = state.trusted[:, trust]
    elif state.match is not None:  # with a full basis, trust the columns whose patterns match
        state.trusted = Q[:, state.match.per_column >= ctx.L.shape[0]]
    ctx.clock.tick("select", t0)
    if state.match is None and 0 < count < B:
        state.trusted = state.trusted[:, feasible(ctx, state, state.trusted)]
    noisy_partial = ctx.row_noise is not None and count < B
    state.deflated = Q[:, :count] if noisy_partial else state.trusted
    done = count == B and (state.match is None or state.match.value >= ctx.lambda_stop)
    if ctx.row_noise is not None:  # under noise λ stays high with wrong columns selected
        done = done and state.trusted.shape[1] == B
    return Assessment(Q=Q, count=count, done=done)


def feasible(ctx: SearchContext, state: SearchState, cols: torch.Tensor) -> torch.Tensor:
    """Mask (F,) of the found columns ``cols`` (B, F) whose ReLU pattern is feasible given the
    others.

    One LP per column (``feasibility.pattern_margins``) once at most ``cfg.verify_dim``
    columns are missing; a verdict is kept until the number missing has halved (the test
    tightens as columns are added). Clean single-step updates with weight and bias only (a
    FedAvg column's zero rows are only part of its W₀ pattern, which the LP cannot test).

    Parameters
    ----------
    ctx, state
        The search's context and state (``state.verdicts`` caches the LPs' verdicts).
    cols : (B, F)
        Found unit columns, F < B.

    Returns
    -------
    torch.Tensor
        (F,) bool, True for the columns to keep.
    """
    F = cols.shape[1]
    missing = ctx.B - F
    keep = torch.ones(F, dtype=torch.bool, device=cols.device)
    if (ctx.noisy or ctx.system.WR is None or ctx.system.subset
            or not ctx.cfg.verify_dim or missing > ctx.cfg.verify_dim):
        return keep
    t0 = time.perf_counter()
    keys = pattern_keys(zero_mask(ctx.L @ cols, ctx.zero_rtol))
    verdicts = state.verdicts
    todo = [j for j, key in enumerate(keys)
            if key not in verdicts or missing <= verdicts[key][1] // 2]
    if todo:
        margins = feasibility.pattern_margins(cols, ctx.system, torch.tensor(todo),
                                              deadline=ctx.clock.deadline)
        late = ctx.clock.expired()  # LPs after the deadline were skipped (NaN): not cached
        for j, margin in zip(todo, margins.tolist(), strict=True):  # NaN: feasible
            if not (late and margin != margin):
                verdicts[keys[j]] = (not margin < feasibility.FAIL_MARGIN, missing)
    for j, key in enumerate(keys):
        keep[j] = verdicts[key][0] if key in verdicts else True
    ctx.clock.tick("verify", t0)
    return keep


def finish(ctx: SearchContext, state: SearchState,
           pool: CandidatePool) -> tuple[torch.Tensor, int]:
    """The final selection: stage 2 swaps (SPEAR §4.2), the repair of 1-3 mismatching columns
    (:func:`repair`) and, under noise, the columns that clearly break the ReLU law completed
    anew (``violations.repair``) and the found columns re-estimated from all their zero rows
    (``polish.noisy_refit``). Runs until the finish deadline; sets ``state.match``,
    ``state.swaps`` and, when that deadline passed, ``state.exhausted``.

    Parameters
    ----------
    ctx, state, pool
        The search; the pool's spare columns are what stage 2 swaps in.

    Returns
    -------
    (Q, count)
        The final basis (B, B) and how many of its columns came from the pool.
    """
    cfg, clock = ctx.cfg, ctx.clock
    t0 = time.perf_counter()
    sel = pool.select()
    Q, count, spare = sel.Q, sel.count, _swap_candidates(ctx, sel)
    if cfg.greedy and ctx.system.WR is not None:
        Q, state.match, state.swaps = select.swap_greedily(
            Q, spare, select.OutputSwaps(ctx.system, Q, spare),
            max_swaps=cfg.max_swaps, positions=cfg.swap_positions,
            deadline=clock.finish_deadline,
            span_tol=ctx.span_tol,
        )
    else:
        state.match = match.sparsity_match(Q, ctx.system)
    clock.tick("select", t0)
    if count == ctx.B and state.match is not None and state.match.value < 1.0:
        Q = repair(ctx, state, Q)
    if ctx.row_noise is not None and count == ctx.B and violations.applies(ctx):
        t0 = time.perf_counter()  # columns that clearly break the ReLU law, completed anew
        Q = violations.repair(ctx, Q, clock.finish_deadline)
        clock.tick("repair", t0)
    if ctx.row_noise is not None and count:  # each found column from all its zero rows
        t0 = time.perf_counter()
        Q = Q.clone()
        Q[:, :count] = polish.noisy_refit(ctx.L, Q[:, :count], ctx.row_noise)
        if state.match is not None:
            state.match = match.sparsity_match(Q, ctx.system)
        clock.tick("refit", t0)
    state.exhausted = state.exhausted or clock.expired(clock.finish_deadline)
    return Q, count


def _swap_candidates(ctx: SearchContext, sel: Selection) -> torch.Tensor:
    """The spare columns stage 2 may swap in: all of them on a clean update; under noise only
    those as sparse as a trusted column (``Tuning.noisy_trust``; beyond the papers)."""
    if ctx.row_noise is None or not sel.spare.shape[1]:
        return sel.spare
    return sel.spare[:, _noisy_trusted(ctx, sel.spare_scores).to(sel.spare.device)]


def _noisy_trusted(ctx: SearchContext, scores: torch.Tensor) -> torch.Tensor:
    """(K,) bool: candidates whose noisy sparsity score is at least ``Tuning.noisy_trust`` of
    a true column's least zero count (the trust test under noise)."""
    return scores >= ctx.tuning.noisy_trust * ctx.min_zeros


def repair(ctx: SearchContext, state: SearchState, Q: torch.Tensor) -> torch.Tensor:
    """Replace the 1-3 columns of ``Q`` (B, B) whose patterns mismatch by the completion's
    candidates, keeping the trial basis with the highest λ (``state.match`` is updated).

    Mixing up two samples of a face corrupts only those two reconstructions (every other row
    of Q⁻¹ is orthogonal to their span), so the mismatching columns are the wrong ones. No
    leverage cut here: every trial must raise λ to be kept, and a true column can have a zero
    row of leverage above ``cfg.max_leverage`` (a sample whose zero rows nearly all belong to
    another's).

    Parameters
    ----------
    ctx, state
        The search's context and state; ``state.match`` is the match of ``Q``.
    Q : (B, B)
        A full basis with λ < 1.

    Returns
    -------
    torch.Tensor
        (B, B) the best basis found (``Q`` itself when no trial raised λ).
    """
    assert state.match is not None
    cfg, B, tuning = ctx.cfg, ctx.B, ctx.tuning
    bad = torch.nonzero(state.match.per_column < ctx.L.shape[0]).squeeze(1)
    if bad.numel() not in (1, 2, 3) or not cfg.polish:
        return Q
    t0 = time.perf_counter()
    good = torch.ones(B, dtype=torch.bool, device=Q.device)
    good[bad] = False
    deadline = ctx.clock.finish_deadline
    Qc = missing_candidates(ctx, Q[:, good], sampled=ctx.system.subset, deadline=deadline)
    best_Q, best = Q, state.match
    if Qc.shape[1]:
        Qc, zeros, _, _ = polish.polish(ctx.L, Qc, n_rows=ctx.n_rows(), zero_rtol=ctx.zero_rtol)
        keep = zeros >= ctx.min_zeros
        Qc, zeros = Qc[:, keep], zeros[keep]
        Qc = Qc[:, torch.argsort(zeros, descending=True, stable=True)]
        r = bad.numel()
        top = tuning.repair_candidates if r < 3 else tuning.repair_candidates_three
        Qc = Qc[:, dedupe(Qc, cfg.dedupe_tol)][:, :top]
        combos = (torch.arange(Qc.shape[1])[:, None] if r == 1
                  else torch.combinations(torch.arange(Qc.shape[1]), r))
        for combo in combos.tolist():
            if ctx.clock.expired(deadline):
                break
            trial = torch.cat([Q[:, good], Qc[:, combo]], dim=1)
            if torch.linalg.matrix_rank(trial) < B:
                continue
            got = match.sparsity_match(trial, ctx.system)
            if got is not None and got.value > best.value:
                best_Q, best = trial, got
    state.match = best
    ctx.clock.tick("repair", t0)
    return best_Q


KERNEL_MARGIN = 6.0
"""A column's evidence rows pin it down when the second-smallest singular value of L on them,
less what any one row carries, exceeds this many noise units (:func:`pinning`): the columns
of two samples whose patterns nest, or differ on a single unit, and mixtures of samples
vanishing by cancellation stay below 1, true columns of distinct samples lie 10²-10⁶ above
(``experiments/results/duplicates.md``)."""

KERNEL_RESIDUAL = 10.0
"""A column's evidence rows are zeros of one direction when the smallest singular value of L
on them stays below this many noise units (:func:`pinning`): true zero rows lie at 0.01-0.3 on
gradients and up to 1.7 on the rounding of a weight difference (W₀ - W₁ of float32 weights),
while a row on which a mixture of samples cancels only to the zero test's tolerance (1e-4 of
the column's largest entry for float32, about 10³ noise units) lies hundreds of units out."""


@dataclass(frozen=True)
class Pinning:
    """Whether each column of a full basis is proven by its own zero rows.

    SPEAR's Theorem 3.3: a column q_i of Q is the kernel of L on the sample's zero rows when
    ∂L/∂Z has rank B - 1 there. Checked on the reconstruction itself, a column is *pinned*
    when its evidence rows (zero rows of the column on which the reconstructed sample leaves
    the unit inactive) have a common kernel at the noise level (:data:`KERNEL_RESIDUAL`),
    the column is that kernel, and the kernel is one-dimensional and stays so without any one
    of the rows (:data:`KERNEL_MARGIN`). λ = 1 alone does not prove a batch: when the inactive
    units of one sample are all inactive for another too (their ReLU patterns nest), both
    columns vanish on the first sample's zero rows, so does every mixture of them, and a
    one-parameter family of reconstructions of the pair has λ = 1. A mixture of k samples can
    cancel exactly on k - 1 further rows (one per ratio) and be pinned by those alone; without
    any one of them it is not, while a sample's column rests on all its zero rows. So with
    every column pinned, a wrong column would need one more exact cancellation than its
    ratios allow: a coincidence at the update's precision (``docs/algorithm.md``, "The
    certificate").
    """

    margins: torch.Tensor
    """(B,) per column: the second-smallest singular value of L on its evidence rows, times
    √(1 - the largest leverage of a row in it), in noise units (0 with fewer than B rows)."""
    residuals: torch.Tensor
    """(B,) per column: the larger of the smallest singular value of L on its evidence rows
    and of the column's own residual there, in noise units (inf with fewer than B rows)."""
    kernels: torch.Tensor
    """(B, B) per column, the unit kernel of L on its evidence rows (the column itself where
    it has fewer than B rows), signed as the column."""
    pinned: torch.Tensor
    """(B,) bool, the columns its evidence rows prove."""
    groups: tuple[tuple[int, ...], ...] = ()
    """Columns (= rows of the reconstructed inputs) read only up to a mixture of each other:
    each column not pinned with the columns that vanish on its evidence rows too (all but
    the row it rests on most)."""

    @property
    def all(self) -> bool:
        """Every column pinned."""
        return bool(self.pinned.all())


def pinning(ctx: SearchContext, Q: torch.Tensor,
            lam: match.Match | None = None) -> Pinning:
    """Which columns of a full basis ``Q`` (B, B) their zero rows prove (:class:`Pinning`).

    Evidence rows of a column: the live rows where it passes the zero test and, with the
    layer's weight and bias, where the reconstruction leaves the unit inactive (the λ₋
    entries of ``lam``, the match of ``Q``, computed when not given: a chance zero, an
    active unit with a tiny gradient, is no evidence).
    """
    L = ctx.L
    Qd = Q.to(L)
    rows = zero_mask(L @ Qd, ctx.zero_rtol) & (L.abs().amax(dim=1) > 0)[:, None]
    if lam is None and ctx.system.WR is not None:
        lam = match.sparsity_match(Qd, ctx.system)
    if lam is not None:
        assert ctx.system.bias is not None
        Z = lam.H / lam.s + ctx.system.bias[:, None]
        rows &= Z <= ctx.system.z_band * Z.abs().amax(dim=0, keepdim=True)
    margins, residuals, kernels, lean = _kernels(ctx, Qd, rows)
    pinned = (margins > KERNEL_MARGIN) & (residuals < KERNEL_RESIDUAL)
    groups = _mix_groups(ctx, Qd, rows, pinned, lean)
    return Pinning(margins=margins, residuals=residuals, kernels=kernels, pinned=pinned,
                   groups=groups)


@dataclass(frozen=True)
class Proof:
    """The final basis of a clean single-step search as the certificate judges it."""

    Q: torch.Tensor
    """(B, B) the basis, each column whose evidence rows pin it replaced by their kernel."""
    lam: match.Match | None
    """λ of ``Q``."""
    pinning: Pinning
    """The pinning of ``Q``."""


def prove(ctx: SearchContext, Q: torch.Tensor) -> Proof:
    """Settle a full basis ``Q`` (B, B) on its zero rows and judge it (:class:`Proof`).

    Each column whose evidence rows pin their kernel is replaced by that kernel (the search's
    last swaps and completions may leave a column off it by more than the noise; the zero
    rows, not the column as found, define the sample), unless that lowers λ; then the
    :func:`pinning` of the result.
    """
    lam = match.sparsity_match(Q, ctx.system)
    first = pinning(ctx, Q, lam)
    settle = (first.margins > KERNEL_MARGIN) & torch.isfinite(first.residuals)
    if bool(settle.any()):
        fitted = torch.where(settle[None, :], first.kernels.to(Q), Q)
        if not _independent(ctx, fitted):  # two columns settled on one kernel
            return Proof(Q=Q, lam=lam, pinning=first)
        lam_fit = match.sparsity_match(fitted, ctx.system)
        if lam is None or (lam_fit is not None and lam_fit.value >= lam.value):
            Q, lam = fitted, lam_fit
            first = pinning(ctx, Q, lam)
    return Proof(Q=Q, lam=lam, pinning=first)


def _independent(ctx: SearchContext, Q: torch.Tensor) -> bool:
    """Whether every column of ``Q`` (B, B) lies farther from the span of the others than
    ``SearchContext.span_tol`` (stage 1's rule)."""
    dist = span_distances(normalize_columns(Q))
    return dist is not None and float(dist.min()) > ctx.span_tol


def _kernels(ctx: SearchContext, Q: torch.Tensor, rows: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per column of ``Q`` (B, B) and its ``rows`` (m, B): the singular values of L on the
    rows in noise units (the second-smallest less the largest leverage; the smallest, or the
    column's own residual there if larger), the unit kernel, and the row it leans on most
    (-1 where it has fewer than B rows).

    The noise unit is what the second-smallest singular value would be if the kernel there
    were two-dimensional: ‖ν / s‖ times the square root of the row count, ν floored at
    float64 rounding of the largest singular value. Without row j the second-smallest value
    is at least σ_{B-1} √(1 - h_j), h_j the leverage of row j in the span orthogonal to the
    kernel (Courant-Fischer; the squared norm of the row's first B - 1 left singular
    coordinates).
    """
    L, dec = ctx.L, ctx.dec
    B = L.shape[1]
    eps = torch.finfo(torch.float64).eps * float(dec.singular_values[0])
    S = dec.singular_values[:B].to(device=L.device, dtype=torch.float64)
    noise = float((max(dec.noise_std, eps) / S.clamp_min(torch.finfo(S.dtype).tiny)).norm())
    counts = rows.sum(dim=0)
    margins = torch.zeros(B, dtype=L.dtype, device=L.device)
    residuals = torch.full((B,), float("inf"), dtype=L.dtype, device=L.device)
    kernels = Q.clone()
    lean = torch.full((B,), -1, dtype=torch.long, device=L.device)
    if B < 2:
        return margins.fill_(float("inf")), residuals.fill_(0.0), kernels, lean
    for k in torch.nonzero(counts >= B).squeeze(1).tolist():
        idx = torch.nonzero(rows[:, k]).squeeze(1)
        A = L[idx]
        U, sv, Vh = torch.linalg.svd(A, full_matrices=False)
        h = U[:, :B - 1].square().sum(dim=1)
        unit = noise * idx.numel() ** 0.5
        top = int(h.argmax())
        v = Vh[B - 1]
        kernels[:, k] = v if float(v @ Q[:, k]) >= 0 else -v
        margins[k] = sv[B - 2] * max(1.0 - float(h[top]), 0.0) ** 0.5 / unit
        residuals[k] = max(float(sv[B - 1]), float((A @ Q[:, k]).norm())) / unit
        lean[k] = idx[top]
    return margins, residuals, kernels, lean


def _mix_groups(ctx: SearchContext, Q: torch.Tensor, rows: torch.Tensor, pinned: torch.Tensor,
                lean: torch.Tensor) -> tuple[tuple[int, ...], ...]:
    """Each column not pinned with the columns that also vanish on its evidence ``rows`` but
    the one it ``lean``s on most, overlapping groups merged: the samples read only up to a
    mixture of each other."""
    zero = zero_mask(ctx.L @ Q, ctx.zero_rtol)
    groups: list[set[int]] = []
    for k in torch.nonzero(~pinned).squeeze(1).tolist():
        on = rows[:, k].clone()
        if int(lean[k]) >= 0:
            on[int(lean[k])] = False
        group = {k} | {j for j in range(Q.shape[1]) if j != k and bool(on.any())
                       and bool(zero[on, j].all())}
        for other in [g for g in groups if g & group]:
            group |= other
            groups.remove(other)
        groups.append(group)
    return tuple(tuple(sorted(g)) for g in sorted(groups, key=min))


def supported(ctx: SearchContext, Q: torch.Tensor) -> bool:
    """Whether a full basis ``Q`` (B, B) with λ = 1 proves its batch: every column pinned
    (:func:`pinning`), on a single-step update.

    A FedAvg sum (``AttackConfig.update="fedavg"``) is never proven: its λ checks only that
    zero rows are inactive units at W₀ (a sample may activate a unit at a later step), and a
    mixture of samples whose patterns nearly coincide passes that test and the pinning on
    the rows where it cancels within the float32 rounding of ``W₀ - W_E``.
    """
    return not ctx.system.subset and pinning(ctx, Q).all
