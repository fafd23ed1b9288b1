"""The ReLU law under noise: which columns of a noisy basis break it beyond doubt (beyond the
papers).

SPEAR's λ (SPEAR §4.2, :mod:`fl_attack.steps.match`) counts the entries where "Z ≤ 0" and
"∂L/∂Z = 0" disagree. Under DP-SGD noise both sides are noisy: entries near either boundary
disagree for the true basis too, so λ stays below 1 and a basis with a wrong column (a
mixture of similar samples) scores within a few entries of the true one. Here only *confident*
violations count: a unit that the reconstruction puts clearly below zero (its pre-activation
more than :data:`VIOLATION_SD` of its own noise below 0) while the column's gradient there is
clearly not zero (more than :data:`VIOLATION_SD` noise stds). The ReLU law forbids that
outright. The true basis shows at most about one such entry per column at the measured noise
levels (``experiments/results/dp.md``); a basis with a wrong column shows many, on the wrong
column and on the columns whose reconstructions it spoils (every row of Q⁻¹ depends on all B
columns).

The noise of a pre-activation: a reconstructed input is x̂ᵢ = (Q⁻¹ R)ᵢ / sᵢ, and R = Lᵀ G
carries the update's noise ν per entry, so W_j x̂ᵢ carries ν ‖W_j‖ ‖(Q⁻¹)ᵢ‖ / |sᵢ|.
"""

from __future__ import annotations

import time

import torch

from fl_attack.core import batched_lu
from fl_attack.core.columns import dedupe
from fl_attack.solver.candidates import missing_candidates
from fl_attack.solver.state import SearchContext
from fl_attack.steps import filtering, polish

VIOLATION_SD = 5.0
"""A pre-activation this many of its noise stds below zero is clearly inactive, a gradient
entry this many noise stds from zero clearly non-zero (:func:`law_violations`)."""

CHUNK = 256
"""Trial bases judged at once (each holds m x B pre-activations)."""


def applies(ctx: SearchContext) -> bool:
    """Whether the test applies: a noisy single-step update with the layer's weight and bias
    (a FedAvg sum's zeros are only part of a sample's inactive units, and without W and b
    there are no pre-activations)."""
    system = ctx.system
    return (ctx.row_noise is not None and system.WR is not None and system.bias is not None
            and system.weight is not None and not system.subset and not ctx.input_side)


def law_violations(ctx: SearchContext, Qs: torch.Tensor) -> torch.Tensor:
    """Confident violations of the ReLU law per column of each basis (T, B).

    Parameters
    ----------
    ctx
        A noisy search's context (:func:`applies`).
    Qs : (B, B) or (T, B, B)
        Full bases (unscaled columns).

    Returns
    -------
    torch.Tensor
        (B,) or (T, B) counts: units clearly inactive for a column's reconstructed sample
        (Z < -:data:`VIOLATION_SD` of its noise) whose gradient entry is clearly non-zero; a
        singular basis counts m B on every column (it reconstructs nothing).
    """
    system, k = ctx.system, VIOLATION_SD
    assert system.WR is not None and system.bias is not None and system.weight is not None
    single = Qs.dim() == 2
    Qs = (Qs[None] if single else Qs).to(system.L)
    out = []
    w_norm = system.weight.to(system.L).norm(dim=1)  # (m,)
    noise = ctx.row_noise.to(system.L)
    for start in range(0, Qs.shape[0], CHUNK):
        Q = Qs[start:start + CHUNK]
        P, info = batched_lu.inv_ex(Q)  # (T, B, B): row i of Q⁻¹ gives sample i
        P = torch.where((info != 0)[:, None, None], torch.eye(Q.shape[-1]).to(P), P)
        s = P @ system.t  # (T, B)
        Z = torch.einsum("mk,tik->tmi", system.WR, P) / s[:, None, :] + system.bias[:, None]
        sigma_z = (ctx.dec.noise_std * w_norm[None, :, None]
                   * (P.norm(dim=2) / s.abs())[:, None, :])
        V = system.L @ Q  # (T, m, B)
        sigma_v = (Q * noise[None, :, None]).norm(dim=1)  # (T, B): filtering.noise_scales
        hard = (Z < -k * sigma_z) & (V.abs() > k * sigma_v[:, None, :])
        counts = hard.sum(dim=1)
        out.append(torch.where((info != 0)[:, None], Q.shape[1] * system.L.shape[0], counts))
    counts = torch.cat(out)
    return counts[0] if single else counts


def violating(ctx: SearchContext, Q: torch.Tensor) -> torch.Tensor:
    """(B,) bool: the columns of the full basis ``Q`` with more confident violations than
    ``Tuning.noisy_violations``; all False where the test does not apply."""
    if not applies(ctx):
        return torch.zeros(Q.shape[1], dtype=torch.bool, device=Q.device)
    return (law_violations(ctx, Q) > ctx.tuning.noisy_violations).to(Q.device)


def _judge(ctx: SearchContext, Qs: torch.Tensor) -> torch.Tensor:
    """(T, 2) per trial basis: total violations and violating columns (smaller is better);
    singular trials get +inf."""
    counts = law_violations(ctx, Qs).double()
    bad = (counts > ctx.tuning.noisy_violations).double()
    ranks = torch.linalg.matrix_rank(Qs)
    score = torch.stack([counts.sum(dim=1), bad.sum(dim=1)], dim=1)
    score[ranks < Qs.shape[-1]] = float("inf")
    return score


def _candidates(ctx: SearchContext, keep: torch.Tensor, top: int,
                deadline: float | None) -> torch.Tensor:
    """Completion candidates (B, c) for the columns missing from ``keep`` (B, F): the exact
    completion for 1-3 missing and the sampled one, polished, sparsest first (at most
    ``top``)."""
    parts = []
    if ctx.B - keep.shape[1] <= 3:
        parts.append(missing_candidates(ctx, keep, sampled=False, deadline=deadline))
    if ctx.cfg.slice_samples:
        parts.append(missing_candidates(ctx, keep, sampled=True, deadline=deadline))
    Qc = torch.cat(parts, dim=1) if parts else keep[:, :0]
    if not Qc.shape[1]:
        return Qc
    Qc, zeros, _, _ = polish.polish(ctx.L, Qc, n_rows=ctx.n_rows(), zero_rtol=ctx.zero_rtol)
    Qc = Qc[:, zeros >= ctx.min_zeros]
    score = filtering.noisy_sparsity(ctx.L @ Qc, filtering.noise_scales(Qc, ctx.row_noise))
    Qc = Qc[:, torch.argsort(score, descending=True, stable=True)]
    return Qc[:, dedupe(Qc, ctx.cfg.dedupe_tol)][:, :top]


def _trials(Q: torch.Tensor, out: torch.Tensor, Qc: torch.Tensor) -> torch.Tensor:
    """Every basis (T, B, B) that replaces the columns ``out`` of ``Q`` by distinct candidates
    of ``Qc`` (B, c), one per column."""
    r, c = out.numel(), Qc.shape[1]
    combos = (torch.arange(c)[:, None] if r == 1
              else torch.combinations(torch.arange(c), r))
    trials = Q[None].repeat(combos.shape[0], 1, 1)
    trials[:, :, out] = Qc[:, combos].permute(1, 0, 2)
    return trials


LEAVE_OUT_TOP = {1: 64, 2: 40, 3: 20}
"""Candidates tried per left-out column count: C(64, 1), C(40, 2) = 780 and C(20, 3) = 1140
trial bases."""

MAX_PASSES = 6
"""Repair passes (each replaces one set of violating columns) of :func:`repair`."""


def repair(ctx: SearchContext, Q: torch.Tensor, deadline: float | None) -> torch.Tensor:
    """Replace the columns of a noisy full basis ``Q`` (B, B) that break the ReLU law by
    completions from the others, while the total of confident violations falls.

    A column with more than ``Tuning.noisy_violations`` confident violations is a wrong column
    or one whose reconstruction a wrong column spoils. With 1-3 such columns they are left out
    together (then with the next-worst columns, up to 3) and completed from the rest
    (``completion``: exact for 1-3 missing columns, and sampled); every way of filling them
    with the candidates is judged. With more, one at a time, worst first. A trial is kept when
    it lowers the total of confident violations without adding a violating column: the test
    decides what λ cannot under noise (the true basis and one with a wrong column differ by a
    few λ entries). Beyond the papers; the measurements are in ``experiments/results/dp.md``.

    Parameters
    ----------
    ctx
        A noisy search (:func:`applies`).
    Q : (B, B)
        The final selection.
    deadline
        A ``time.perf_counter()`` value (the final selection's), or None.

    Returns
    -------
    torch.Tensor
        (B, B) the repaired basis (``Q`` itself when nothing improved).
    """
    if not applies(ctx):
        return Q
    best = _judge(ctx, Q[None])[0]
    for _ in range(MAX_PASSES):
        if deadline is not None and time.perf_counter() > deadline:
            break
        counts = law_violations(ctx, Q)
        order = torch.argsort(counts, descending=True, stable=True)
        n_bad = int((counts > ctx.tuning.noisy_violations).sum())
        if n_bad == 0:
            break
        found = None
        for out, keep in _leave_out_sets(order, n_bad):
            top = LEAVE_OUT_TOP[out.numel()] if n_bad <= 3 else LEAVE_OUT_TOP[1]
            Qc = _candidates(ctx, Q[:, keep], top, deadline)
            if Qc.shape[1] < (out.numel() if n_bad <= 3 else 1):
                continue
            if n_bad <= 3:
                trials = _trials(Q, out, Qc)
            else:  # many: one column at a time, from candidates for all of them
                trials = torch.cat([_trials(Q, out[j:j + 1], Qc) for j in range(out.numel())])
            score = _judge(ctx, trials)
            ok = (score[:, 0] < best[0]) & (score[:, 1] <= best[1])
            if bool(ok.any()):
                pick = int(torch.where(ok, score[:, 0], float("inf")).argmin())
                found, best = trials[pick], score[pick]
                break
        if found is None:
            break
        Q = found
    return Q


def _leave_out_sets(order: torch.Tensor, n_bad: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The columns to leave out and the mask of those to complete from, in the order
    :func:`repair` tries them: the ``n_bad`` worst (``order``: most violations first), then
    with the next-worst up to 3; more than 3 are completed together and replaced one at a
    time."""
    B = order.numel()
    sets = []
    for r in (range(n_bad, min(3, B - 1) + 1) if n_bad <= 3 else (n_bad,)):
        keep = torch.ones(B, dtype=torch.bool, device=order.device)
        keep[order[:r]] = False
        sets.append((order[:r], keep))
    return sets
