"""The search loop and its stop rule: rounds of search, completions after each, until B
certified columns, the round cap or the time budget; then the final selection.

Both sides of the attack run this loop (the input side with ``SearchContext.input_side``),
and the output side's peeling levels run it once per level (:mod:`fl_attack.solver.output_side`).
Progress goes to ``logging.getLogger("fl_attack")``: at INFO with ``AttackConfig.progress``,
else at DEBUG.
"""

from __future__ import annotations

import logging
import time

import torch

from fl_attack.core.clock import passed
from fl_attack.core.columns import pattern_keys, zero_mask
from fl_attack.solver import candidates, certify
from fl_attack.solver.certify import Assessment
from fl_attack.solver.pool import CandidatePool
from fl_attack.solver.state import SearchContext, SearchState, relaxed

log = logging.getLogger("fl_attack")


def search(ctx: SearchContext, state: SearchState,
           pool: CandidatePool) -> tuple[torch.Tensor, int]:
    """Search until B directions with λ at the stop level, convergence, the round cap or the
    time budget.

    SPEAR++ rounds (SPEAR++ §4) or SPEAR sampling steps (SPEAR §5.1), each followed by the
    completions from the trusted columns (:func:`completions`). The loop stops when the
    selection is done, the budget is spent, SPEAR's sample cap is reached, or (SPEAR++) a full
    basis (under noise, any selection) has stopped improving for ``Tuning.stale_rounds`` rounds
    (:class:`Staleness`; λ < 1 is then final). After SPEAR++ round 1 the neighbour search runs
    once. With a peeler the loop returns early when samples read through the next layer wait
    in ``state.peeled``. ``state.stopped`` says why the loop ended (``state.STOP_REASONS``).

    Parameters
    ----------
    ctx, state, pool
        The search's context (read only), its state and pool, which the steps grow.

    Returns
    -------
    (Q, count)
        The basis (B, B) after the final selection (:func:`~fl_attack.solver.certify.finish`), or
        the current selection when samples were peeled, and how many columns came from the pool.
    """
    cfg = ctx.cfg
    spear = cfg.method == "spear"
    max_rounds = cfg.round_cap(ctx.B) if not spear else 1 << 62
    if cfg.max_rounds is None:  # the default cap is per call, an explicit one for them all
        max_rounds += state.rounds
    state.completed = {}
    if not spear and not ctx.input_side and cfg.first_slice(ctx.L.shape[0], noisy=ctx.noisy):
        # complete from nothing (the empty pool selects no column): the slice of all B samples
        now = completions(ctx, state, pool, certify.assess(ctx, state, pool))
        progress(ctx, "slice sampling before the search: %d/%d directions", now.count, ctx.B)
        if now.done:
            state.exhausted = ctx.clock.expired()
            state.stopped = done_reason(ctx, state)
            return certify.finish(ctx, state, pool)
        if state.peeled is not None:
            state.stopped = "peeled"
            return now.Q, now.count
    stale = Staleness(ctx)
    state.stopped = "rounds"
    while state.rounds < max_rounds:
        state.rounds += 1
        step = candidates.spear_round if spear else candidates.spearpp_round
        if (ctx.activation_span is not None and state.rounds > ctx.tuning.activation_after
                and (state.rounds - ctx.tuning.activation_after) % 2 == 1):
            step = candidates.activation_round
        step(ctx, state, pool)
        now = completions(ctx, state, pool, certify.assess(ctx, state, pool))
        _log_round(ctx, state, pool, now)
        if state.peeled is not None:
            state.stopped = "peeled"
            return now.Q, now.count
        stale_rounds = stale.update(state, pool, now)
        reason = _stop_reason(ctx, state, now, stale)
        if reason is not None:
            state.stopped = reason
            if reason == "converged":
                progress(ctx, "%.1fs: converged: %d rounds without improvement",
                         ctx.clock.elapsed(), stale_rounds)
            break
        if (not spear and cfg.polish and state.rounds == 1 and len(pool)
                and not ctx.clock.expired()):
            candidates.neighbour_search(ctx, state, pool)
    state.exhausted = ctx.clock.expired()
    return certify.finish(ctx, state, pool)


def done_reason(ctx: SearchContext, state: SearchState) -> str:
    """Why a done selection is done: ``certified`` (λ = 1 on a clean update), ``lambda``
    (λ at a stop level below 1, or under noise) or ``found`` (no λ without weight and bias)."""
    if state.match is None:
        return "found"
    return "certified" if not ctx.noisy and state.match.value >= 1.0 else "lambda"


def _stop_reason(ctx: SearchContext, state: SearchState, now: Assessment,
                 stale: Staleness) -> str | None:
    """Why the loop stops after this round (``state.STOP_REASONS``), or None to go on."""
    spear = ctx.cfg.method == "spear"
    if now.done:
        return done_reason(ctx, state)
    if ctx.clock.expired():
        return "budget"
    if spear and state.samples >= ctx.cfg.max_samples:
        return "samples"
    tuning = ctx.tuning
    # a partial selection that the rounds do not grow, while a lower zero threshold may
    if (not spear and now.count < ctx.B and relaxed(ctx) is not None
            and ((state.rounds >= tuning.starved_rounds
                  and now.count < tuning.starved_share * ctx.B)
                 or stale.stuck >= tuning.stale_rounds)):
        return "starved"
    # clean: a full basis that stopped changing; noisy: no progress at all (a column that
    # noise hides stays hidden, so rounds that find nothing new do not pay)
    full = now.count == ctx.B or ctx.noisy
    if not spear and full and stale.rounds >= tuning.stale_rounds:
        return "converged"
    return None


class Staleness:
    """Rounds in a row in which the search has not improved its selection.

    A clean gradient's full basis is final when its pool no round changes any more (neither
    its size nor λ): not every true basis reaches λ = 1 (a sample with a tiny loss gradient
    has a column at the noise level). A FedAvg pool keeps growing by mixtures of similar
    samples (τ = 0.2 lets them in), so there only λ not changing counts. Under noise every
    round adds noisy copies of columns already found, so the pool grows and λ moves by a few
    entries either way without the reconstruction changing; there a round counts as progress
    only when it raises the best λ so far, the number of selected columns or the number of
    trusted ones (beyond the papers: SPEAR §5.1 stops on λ or a sample cap; measured in
    ``experiments/results/dp.md``).
    """

    def __init__(self, ctx: SearchContext) -> None:
        self.ctx = ctx
        self.last: tuple | None = None
        self.best: tuple[int, int, float] | None = None
        self.rounds = 0
        self.most = -1
        self.stuck = 0
        """Rounds in a row that did not select more columns than before."""

    def update(self, state: SearchState, pool: CandidatePool, now: Assessment) -> int:
        """Record this round's selection; the rounds in a row without progress."""
        ctx = self.ctx
        self.stuck = 0 if now.count > self.most else self.stuck + 1
        self.most = max(self.most, now.count)
        if not ctx.noisy:
            size = None if ctx.system.subset else len(pool)
            key = (size, now.count, state.match.value if state.match else None)
            self.rounds, self.last = (self.rounds + 1 if key == self.last else 0), key
            return self.rounds
        trusted = 0 if state.trusted is None else state.trusted.shape[1]
        lam = state.match.value if state.match is not None else -1.0
        if self.best is None:
            self.best, self.rounds = (now.count, trusted, lam), 0
            return 0
        count, most, top = self.best
        better = now.count > count or trusted > most or lam > top
        self.best = (max(count, now.count), max(most, trusted), max(top, lam))
        self.rounds = 0 if better else self.rounds + 1
        return self.rounds


def completions(ctx: SearchContext, state: SearchState, pool: CandidatePool,
                now: Assessment) -> Assessment:
    """Complete from the trusted columns while each completion may enable the next.

    Parameters
    ----------
    ctx, state, pool
        The search; completions add to the pool, peeling sets ``state.peeled``.
    now
        The assessment after the last search step.

    Returns
    -------
    Assessment
        The assessment after the last completion. With a peeler, the trusted columns'
        samples are then peeled (``state.peeled``), or earlier, once ``Tuning.peel_share``
        of B new trusted columns is there (a tenth of B past ``Tuning.peel_time_share`` of the
        budget).
    """
    tuning, clock, B = ctx.tuning, ctx.clock, ctx.B
    while (not now.done and state.trusted is not None and not clock.expired()
           and candidates.complete(ctx, state, pool, state.trusted)):
        now = certify.assess(ctx, state, pool)
        late = passed(clock.at(tuning.peel_time_share))
        min_new = max(1, B // 10 if late else int(tuning.peel_share * B))
        if not now.done and peel_found(ctx, state, pool, min_new=min_new):
            return now
    if not now.done:
        peel_found(ctx, state, pool, deadline=clock.finish_deadline)
    return now


def peel_found(ctx: SearchContext, state: SearchState, pool: CandidatePool, min_new: int = 1,
               deadline: float | None = None) -> bool:
    """Recover the samples of the trusted columns not tried yet, when at least ``min_new``,
    before ``deadline`` (by default the search's); True when some were read (then in
    ``state.peeled``, for the caller to peel off).

    Samples only read (``peel.READ_RTOL``, not verified) are peeled too: the smaller batch
    left is searched as the verified ones' is, and the final basis is judged on the whole
    gradient (their columns are never proven by being peeled). Once peeling is given up (no
    clean rank left), the samples are kept instead (``candidates.verify_sparsest``), and
    later rounds search the complement of their coordinates."""
    if state.trusted is None or ctx.clock.expired(deadline):
        return False
    if state.peeler is None:
        candidates.verify_sparsest(ctx, state, pool, state.trusted, limit=ctx.B)
        return False
    keys = pattern_keys(zero_mask(ctx.L @ state.trusted, ctx.zero_rtol))
    todo = [j for j, key in enumerate(keys) if key not in state.peel_tried]
    if len(todo) < min_new:
        return False
    t0 = time.perf_counter()
    state.peel_tried.update(keys[j] for j in todo)
    peeled = state.peeler(state.trusted[:, todo],
                          deadline if deadline is not None else ctx.clock.deadline)
    ctx.clock.tick("peel", t0)
    if not peeled.coords.shape[0]:
        return False
    state.peeled = peeled
    return True


def progress(ctx: SearchContext, msg: str, *args: object) -> None:
    """Log a progress line: at INFO with ``AttackConfig.progress``, else at DEBUG."""
    log.log(logging.INFO if ctx.cfg.progress else logging.DEBUG, msg, *args)


def _log_round(ctx: SearchContext, state: SearchState, pool: CandidatePool,
               now: Assessment) -> None:
    if not log.isEnabledFor(logging.INFO if ctx.cfg.progress else logging.DEBUG):
        return
    lam = f"{state.match.value:.4f}" if state.match else "-"
    trusted = state.trusted.shape[1] if state.trusted is not None else 0
    got = state.verified
    verified = 0 if got is None else int(got.proven_mask().sum())
    read = 0 if got is None else got.coords.shape[0] - verified
    progress(ctx, "%.1fs: round %d: %d candidates, %d/%d directions (%d trusted, %d verified, "
             "%d read), λ=%s", ctx.clock.elapsed(), state.rounds, len(pool), now.count, ctx.B,
             trusted, verified, read, lam)
