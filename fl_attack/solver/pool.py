"""The candidate pool: every sparse direction a search step found, ranked by sparsity.

Search rounds, face splitting and completions :meth:`~CandidatePool.add` candidates; stage 1 of
the selection (SPEAR §4.2) :meth:`~CandidatePool.select` s the sparsest independent ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fl_attack.core.columns import dedupe, normalize_columns, zero_mask
from fl_attack.solver.state import SearchContext
from fl_attack.steps import filtering, polish, select


@dataclass(frozen=True)
class Selection:
    """Stage 1 of the selection from the pool."""

    Q: torch.Tensor
    """(B, B) the selected basis: its first ``count`` columns are pool columns, the rest an
    orthonormal completion (a partial reconstruction when ``count`` < B)."""
    count: int
    spare: torch.Tensor
    """(B, c) the pool columns not selected (stage 2 swaps them in)."""
    idx: torch.Tensor
    """(count,) pool indices of the selected columns."""
    spare_scores: torch.Tensor
    """(c,) the spare columns' sparsity scores (``CandidatePool.scores``)."""


class CandidatePool:
    """Unit candidate directions (B, K), deduplicated up to sign, sparsest first.

    Parameters
    ----------
    ctx
        The search's context: thresholds (``min_zeros``, ``cfg.max_leverage``,
        ``cfg.dedupe_tol``) and, under noise, ``row_noise``.
    """

    def __init__(self, ctx: SearchContext) -> None:
        self.ctx = ctx
        self.columns = torch.empty(ctx.B, 0, dtype=torch.float64, device=ctx.device)
        """(B, K) the candidates, unit columns with a canonical sign."""
        self.scores = torch.empty(0, dtype=torch.long, device=ctx.device)
        """(K,) each column's sparsity, the pool's order: its zero count, under noise
        ``filtering.noisy_sparsity``."""

    def __len__(self) -> int:
        return self.columns.shape[1]

    def add(self, Q: torch.Tensor, zeros: torch.Tensor,
            leverage: torch.Tensor | None = None, *, least_zeros: int | None = None,
            proven: bool = False) -> None:
        """Add the candidates among ``Q`` (B, k) that pass the filters.

        Parameters
        ----------
        Q : (B, k)
            Directions (any norm).
        zeros : (k,)
            Their zero counts; fewer than ``ctx.min_zeros`` is no candidate (SPEAR §4.1).
        leverage : (k,), optional
            Their largest zero-row leverage (``polish.max_leverage``); at or above
            ``cfg.max_leverage`` the zeros are coincidental and the direction is dropped.
        least_zeros
            The zero count a candidate needs instead of ``ctx.min_zeros``: B - 1 for columns
            whose zeros are proven otherwise (``activations.consistent_columns``).
        proven
            The columns of samples verified on their own (``peel.recover``): kept whatever
            their zero count, and ranked before every other candidate (score m + 1).

        Notes
        -----
        Under noise each candidate is refit to its zero rows within the noise
        (``polish.noisy_refit``) before it is scored: rounded on the clean test's zeros it is
        still up to 7e-4 (1 - cos) off its column, which the noisy score puts below mixtures.
        """
        ctx = self.ctx
        if proven:
            zeros = torch.full((Q.shape[1],), ctx.L.shape[0] + 1, dtype=torch.long,
                               device=Q.device)
            least_zeros, leverage = 0, None
        keep = zeros >= (ctx.min_zeros if least_zeros is None else least_zeros)
        if leverage is not None:
            keep &= leverage < ctx.cfg.max_leverage
        Q, score = Q[:, keep].to(self.columns), zeros[keep]
        if ctx.row_noise is not None and Q.shape[1]:
            L = ctx.L.to(self.columns)
            if not proven:
                Q = polish.noisy_refit(L, Q, ctx.row_noise)
            score = filtering.noisy_sparsity(L @ Q, filtering.noise_scales(Q, ctx.row_noise))
        pool = torch.cat([self.columns, Q], dim=1)
        pz = torch.cat([self.scores, score.to(self.scores)])
        order = torch.argsort(pz, descending=True, stable=True)
        pool, pz = pool[:, order], pz[order]
        idx = dedupe(pool, ctx.cfg.dedupe_tol)
        self.columns = normalize_columns(pool[:, idx])
        self.scores = pz[idx]

    def seed(self, directions: torch.Tensor) -> None:
        """Start the pool with the unit ∂L/∂Z directions (m, P) that lie in this gradient's
        column space: after a peel, the columns already found for the samples left over (the
        peeled ones' directions fall outside it and are dropped)."""
        L = self.ctx.L.to(self.columns)
        q = L.T @ directions.to(self.columns)
        q = normalize_columns(q[:, q.norm(dim=0) > 1 - self.ctx.tuning.seed_tol])
        if q.shape[1]:
            self.add(q, zero_mask(L @ q, self.ctx.zero_rtol).sum(dim=0))

    def select(self) -> Selection:
        """Stage 1: the sparsest columns that increase the rank, completed to a basis."""
        ctx = self.ctx
        idx, count = select.stage1(self.columns, ctx.B, tol=ctx.span_tol)
        Q = select.complete_basis(self.columns[:, idx], ctx.B)
        rest = torch.ones(self.columns.shape[1], dtype=torch.bool, device=self.columns.device)
        rest[idx] = False
        return Selection(Q=Q, count=count, spare=self.columns[:, rest], idx=idx,
                         spare_scores=self.scores[rest])
