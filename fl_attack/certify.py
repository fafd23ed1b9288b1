"""Selection and certificate steps: assess the pool after each step, keep only feasible
columns to build on, and the final selection (stage 2 swaps, repair, noisy refit).

The certificate is the sparsity-matching coefficient λ (SPEAR §4.2, :mod:`fl_attack.match`):
λ = 1 with all B columns found certifies the batch without ground truth. Partial bases are
checked column by column with a linear program (:mod:`fl_attack.feasibility`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from fl_attack import feasibility, filtering, match, polish, select, violations
from fl_attack.columns import dedupe, pattern_keys, zero_mask
from fl_attack.pool import CandidatePool, Selection
from fl_attack.rounds import missing_candidates
from fl_attack.state import SearchContext, SearchState
from fl_attack.tolerances import row_noise


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
        The search (:mod:`fl_attack.state`); the state's selection fields are set here.

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
"""A column's evidence rows pin it down when the second-smallest singular value of L on them
exceeds this many noise units (:func:`zero_evidence`): mixtures of two similar samples stay
far below it, true columns far above (the values: ``experiments/results/tuning.md``)."""


def zero_evidence(ctx: SearchContext, Q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What the zero rows of each column of ``Q`` (B, B) prove, at the update's noise level.

    A column's zero test is relative (``ctx.zero_rtol`` of its largest entry), far above the
    rounding noise, so near-cancellations pass it too: on a narrow layer a mixture of samples
    vanishes to 1e-5 of its largest entry on a dozen rows of L. A true column's zero rows lie
    within a few noise stds (``filtering.noise_scales``), near-cancellations tens to hundreds
    of stds out. The evidence rows are the live rows (a row of L that is exactly zero, a unit
    no sample activates, vanishes for every direction) within ``filtering.CLEAR_ZERO_SD``
    noise stds. They pin the column down when the kernel of L on them is one-dimensional: a
    mixture of samples vanishes only where all of them do, where every one of them vanishes
    too (a kernel of dimension ≥ 2, its second singular value at the noise level).

    Returns
    -------
    (counts (B,), margins (B,))
        The evidence rows per column, and the second-smallest singular value of L on them
        over the noise it would have if the kernel were two-dimensional, ‖ν / s‖ times the
        square root of the row count (0 with fewer than B rows).
    """
    L = ctx.L
    Qd = Q.to(L)
    noise = row_noise(ctx.dec, L.device)
    scale = filtering.noise_scales(Qd, noise)
    near = (L @ Qd).abs() <= filtering.CLEAR_ZERO_SD * scale[None, :]
    near &= (L.abs().amax(dim=1) > 0)[:, None]
    counts = near.sum(dim=0)
    B = L.shape[1]
    margins = torch.zeros(B, dtype=L.dtype, device=L.device)
    for k in torch.nonzero(counts >= B).squeeze(1).tolist():
        rows = L[near[:, k]]
        sv = torch.linalg.svdvals(rows)
        margins[k] = sv[B - 2] / (float(noise.norm()) * rows.shape[0] ** 0.5)
    return counts, margins


def supported(ctx: SearchContext, Q: torch.Tensor) -> bool:
    """Whether a full basis ``Q`` (B, B) carries the evidence its certificate needs.

    The single-step λ checks every entry of every column both ways and needs nothing more.
    The FedAvg λ (``AttackConfig.update="fedavg"``) checks only that zero rows are inactive
    units, which a column without zeros passes by default and a mixture of samples passes
    on the rows where all of them are inactive. There every column must show at least
    ``ctx.min_zeros`` zero rows at the noise level, as many as a true column needs to enter
    the pool, on which it is the only direction (kernel margin above :data:`KERNEL_MARGIN`)
    (:func:`zero_evidence`). A sample whose inactive units all are inactive for another
    sample too has no such rows: its batch is then not certified (the zeros cannot tell its
    column from its mixtures with the other one).
    """
    if not ctx.system.subset:
        return True
    counts, margins = zero_evidence(ctx, Q)
    return bool(((counts >= ctx.min_zeros) & (margins > KERNEL_MARGIN)).all())
