"""Inverting a layer through its sparse *inputs* (SPEAR §3.2, "input sparsity"):
``sparse="input"`` (``"auto"``, which tries both sides, is :mod:`fl_attack.solver.both_sides`).

A linear layer preceded by a ReLU sees non-negative, sparse inputs ``x_i`` (about half of the
entries exactly zero). Its weight gradient ``G = Σ_i g_i x_iᵀ`` (m, n), ``g_i = ∂L/∂z_i``, has
the transpose ``Gᵀ = Σ_i x_i g_iᵀ`` (n, m) with the same structure as the usual problem with the
roles swapped: factor ``Gᵀ = L' R'`` (rank B, :func:`~fl_attack.steps.decompose.decompose` on
``Gᵀ``), then ``X = L' Q`` has sparse columns and ``[g_1 … g_B]ᵀ = Q⁻¹ R'``. The SPEAR++ search
of :mod:`fl_attack.solver.loop` (which looks for sparse columns of ``L Q``) therefore runs
unchanged on the
transposed decomposition.

Scales. Directions are found up to scale: for unscaled columns ``Q̄`` the true pairs are
``x_i = s_i x̂_i`` and ``g_i = ĝ_i / s_i`` with ``x̂_i = L' q̄_i`` and ``ĝ_iᵀ = (Q̄⁻¹ R')_i``.
The bias gradient ``db = Σ_i g_i = Σ_i u_i ĝ_i`` (``u_i = 1/s_i``) is m equations in B unknowns;
with ``t' = (R'ᵀ)⁺ db`` the least-squares solution is simply ``u = Q̄ᵀ t'`` (one product per
candidate basis, see :func:`inverse_scales`). Signs: ReLU outputs are non-negative, so each
``x̂_i`` is first oriented to carry its mass on the positive side; the solved ``u_i`` must then be
positive. A non-positive ``u_i`` or an ``x_i`` with clearly negative entries means the direction
is not a sample (noise, or a mixture) and voids the certificate.

Certificate (input mode). With the layer's ``W`` and ``b``, ``z_i = W x_i + b`` follows from the
recovered inputs, and if the layer is followed by a ReLU then ``g_i = ∂L/∂y_i ⊙ 1[z_i > 0]``:
``g_i`` is zero exactly where ``z_i ≤ 0`` (when ``∂L/∂y`` is dense). :func:`pattern_match`
counts, over the m B entries, those where "``z ≤ 0``" agrees with "``g`` numerically zero" (the
same zero test, rounding band and ambiguity rule as the output-mode λ of ``fl_attack.steps.match``),
so λ = 1 for the true batch. ``exact`` is claimed only when λ = 1 **and** all B directions were
found **and** every ``x_i`` is non-negative up to the zero tolerance with a positive scale.
For a layer *not* followed by a ReLU (an output layer) the certificate does not apply: λ stays
below 1 and nothing is marked exact, although the reconstruction itself may be right.

Selection. The search loop of :mod:`fl_attack.solver.loop` runs on the transposed decomposition with
``SearchContext.input_side`` set (sign-aware loss, uniform restarts) and a
:class:`~fl_attack.steps.scale.LayerSystem` whose ``weight``/``WR``/``bias`` are None: its pool and
stage-1 selection (sparsest independent candidates) are what input mode needs, while the
output side's stage 2, exact completion and repair are written in output-mode formulas (they
predict the pattern of ``L Q`` from ``Z = W (Q⁻¹R)ᵀ + b``), which do not hold for the transposed
problem. Instead, when λ < 1, :func:`greedy_swaps` does the input-mode stage 2 (the shared
``select.swap_greedily`` with :class:`InputSwaps`: each trial in O(m B) by the rank-one update
of ``Q̄⁻¹``), and further search passes feed the pool until λ = 1, ``max_rounds`` or
``max_seconds``.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch

from fl_attack.config import AttackConfig
from fl_attack.core.clock import Clock, passed
from fl_attack.core.columns import normalize_columns, zero_mask
from fl_attack.errors import NotIdentifiable
from fl_attack.result import Reconstruction, build_reconstruction
from fl_attack.solver import loop
from fl_attack.solver.pool import CandidatePool
from fl_attack.solver.state import SearchContext, SearchState, search_context
from fl_attack.steps.decompose import decompose
from fl_attack.steps.match import ambiguous, forgive_chance_zeros
from fl_attack.steps.scale import LayerSystem
from fl_attack.steps.select import Trial, swap_greedily
from fl_attack.steps.tolerances import exact_possible, rank_floor, tolerances
from fl_attack.validation import LayerUpdate


def orient_nonnegative(Lt: torch.Tensor, Q: torch.Tensor) -> torch.Tensor:
    """Flip columns of ``Q`` (B, K) so that ``Lt Q`` carries more positive than negative mass.

    ReLU outputs are non-negative; a direction is only known up to ±, and this picks the sign
    under which the candidate input could be a ReLU output.
    """
    V = Lt @ Q
    pos = V.clamp_min(0).sum(dim=0)
    neg = (-V).clamp_min(0).sum(dim=0)
    sign = torch.where(neg > pos, -1.0, 1.0).to(Q.dtype)
    return Q * sign


def inverse_scales(Q: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Inverse scales ``u`` (B,) with ``db = Σ_i u_i ĝ_i`` for unscaled columns ``Q`` (B, B).

    ``t`` is ``(R'ᵀ)⁺ db``; since the ``ĝ_iᵀ`` are the rows of ``Q⁻¹ R'``, the least-squares
    solution of the m equations ``R'ᵀ Q⁻ᵀ u = db`` is ``u = Qᵀ t``.
    """
    return Q.T @ t


def input_factors(
    Q: torch.Tensor, Lt: torch.Tensor, Rt: torch.Tensor, t: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Scaled pairs for unscaled columns ``Q`` (B, B) of the transposed decomposition.

    ``Lt`` (n, B), ``Rt`` (B, m) factor ``Gᵀ``; ``t = (R'ᵀ)⁺ db``. Returns ``X`` (B, n), the
    inputs ``x_i = x̂_i / u_i``; ``D`` (B, m), the output gradients ``g_i = u_i ĝ_i``; and ``u``
    (B,). Tiny ``|u_i|`` are floored (at float epsilon times the largest) to keep ``X`` finite.
    """
    u = inverse_scales(Q, t)
    tiny = torch.finfo(u.dtype).eps * u.abs().max().clamp_min(torch.finfo(u.dtype).tiny)
    u_safe = torch.where(u.abs() < tiny, torch.where(u < 0, -tiny, tiny), u)
    X = (Lt @ Q).T / u_safe[:, None]
    D = u[:, None] * torch.linalg.solve(Q, Rt)
    return X, D, u


def _agree(Z: torch.Tensor, Dzero: torch.Tensor, band: float) -> torch.Tensor:
    """Entry-wise agreement of "Z ≤ 0" with "∂L/∂Z = 0", Z within ``band`` of 0 matching both."""
    if band <= 0:
        return (Z <= 0) == Dzero
    tol = band * Z.abs().amax(dim=0, keepdim=True)
    return torch.where(Dzero, Z <= tol, Z > -tol)


@dataclass
class InputMatch:
    """Input-mode certificate of a candidate basis (see the module docstring)."""

    value: float
    """λ: fraction of the m B entries whose ReLU pattern and gradient zeros agree."""
    per_sample: torch.Tensor
    """(B,) agreeing entries per sample (out of m)."""
    nonnegative: torch.Tensor
    """(B,) bool: ``x_i`` has no entry below ``-zero_rtol · max|x_i|`` and ``u_i > 0``."""
    chance_zeros: int = 0
    """Active units whose output gradient passed the zero test, counted as matches
    (:func:`fl_attack.steps.match.forgive_chance_zeros`)."""


def pattern_match(
    X: torch.Tensor,
    D: torch.Tensor,
    u: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    *,
    zero_rtol: float,
    z_band: float = 0.0,
) -> InputMatch:
    """λ for inputs ``X`` (B, n) and output gradients ``D`` (B, m) of a layer followed by ReLU.

    Entry (i, j) agrees when ``z_ij = (W x_i + b)_j ≤ 0`` exactly where ``D_ij`` is numerically
    zero (``|D_ij| ≤ zero_rtol · max_j |D_ij|``). Pre-activations within ``z_band · max_j |z_ij|``
    of zero match either way (rounding of ``z``), and so do gradient entries between
    ``zero_rtol/100`` and ``zero_rtol`` relative (too small to tell from rounding noise), as in the
    output-mode λ. λ = agreeing entries / (m B). Chance zeros (an active unit whose gradient
    passed the zero test) count as matches when they are the only mismatches and no more than
    chance explains, as in the output-mode λ (``forgive_chance_zeros``).
    """
    Z = (X @ weight.T + bias).T  # (m, B)
    V = D.T  # (m, B)
    Dzero = zero_mask(V, zero_rtol)
    amb = ambiguous(V, zero_rtol)
    agree, forgiven = forgive_chance_zeros(_agree(Z, Dzero, z_band) | amb, Z, amb, Dzero, z_band)
    per = agree.sum(dim=0)
    m, B = V.shape
    xmax = X.abs().amax(dim=1).clamp_min(torch.finfo(X.dtype).tiny)
    nonneg = (X >= -zero_rtol * xmax[:, None]).all(dim=1) & (u > 0)
    return InputMatch(value=float(per.sum()) / (m * B), per_sample=per, nonnegative=nonneg,
                      chance_zeros=forgiven)


def input_match(Q: torch.Tensor, system: LayerSystem, W: torch.Tensor, b: torch.Tensor,
                t: torch.Tensor) -> InputMatch:
    """:func:`pattern_match` of the unscaled columns ``Q`` (B, B) of the transposed problem."""
    X, D, u = input_factors(Q, system.L, system.R, t)
    return pattern_match(X, D, u, W, b, zero_rtol=system.zero_rtol, z_band=system.z_band)


def greedy_swaps(
    Q: torch.Tensor,
    spare: torch.Tensor,
    system: LayerSystem,
    weight: torch.Tensor,
    bias: torch.Tensor,
    t: torch.Tensor,
    *,
    max_swaps: int = 200,
    positions: int = 6,
    chunk_elems: int = 2**25,
    deadline: float | None = None,
) -> tuple[torch.Tensor, InputMatch, int]:
    """Input-mode stage 2: best-improvement swaps of columns of ``Q`` for ``spare`` candidates.

    Replacing column i by a candidate c changes, with ``a = Q⁻¹ c``: ``x̂_i`` (and its ``z_i``;
    ``u_i = cᵀ t`` only for this column) and every ``ĝ_j ← ĝ_j − (a_j/a_i) ĝ_i``
    (``ĝ_i ← ĝ_i/a_i``).
    Each trial is O(m B). Only the ``positions`` columns with the largest ``|a_i|`` are tried per
    candidate (the others would make the basis nearly singular). Returns (Q, match, swaps).
    Past ``deadline`` (a ``time.perf_counter()`` value) no new swap is searched.
    """
    scorer = InputSwaps(system, weight, bias, t, spare)
    return swap_greedily(Q, spare, scorer, max_swaps=max_swaps, positions=positions,
                         chunk_elems=chunk_elems, deadline=deadline)


class InputSwaps:
    """The input side's swap score (:class:`~fl_attack.steps.select.SwapScorer`): λ of
    :func:`pattern_match`, each trial by the rank-one update of ``Q̄⁻¹`` (see
    :func:`greedy_swaps`)."""

    def __init__(self, system: LayerSystem, weight: torch.Tensor, bias: torch.Tensor,
                 t: torch.Tensor, spare: torch.Tensor) -> None:
        self.system, self.weight, self.bias, self.t = system, weight, bias, t
        self.units = system.R.shape[1]
        self.WL = weight @ system.L  # (m, B): z of any direction c is WL c / u + b
        self.z_spare = self.WL @ spare  # (m, c) unscaled
        self.u_spare = spare.T @ t  # (c,)

    def match(self, Q: torch.Tensor) -> InputMatch:
        return input_match(Q, self.system, self.weight, self.bias, self.t)

    def total(self, match: InputMatch) -> float:
        return float(match.per_sample.sum())

    def trials(self, Q: torch.Tensor, spare: torch.Tensor,
               match: InputMatch) -> tuple[torch.Tensor, Trial]:
        rtol, band, bias = self.system.zero_rtol, self.system.z_band, self.bias
        z_spare, u_spare = self.z_spare, self.u_spare
        m, B = self.units, Q.shape[0]
        P = torch.linalg.inv(Q)
        Ghat = P @ self.system.R  # (B, m) unscaled ĝ
        u = Q.T @ self.t
        Zcur = (self.WL @ Q) / u + bias[:, None]  # (m, B) current z (u_i ≈ 0 gives inf)

        def trial(us: torch.Tensor, i: torch.Tensor, a_i: torch.Tensor, ok: torch.Tensor,
                  ratio: torch.Tensor) -> torch.Tensor:
            # new ĝ_j = ĝ_j - ratio_j ĝ_i (j ≠ i), ĝ_i / a_i; scaled by the (unchanged) u_j
            Gi = Ghat[i]  # (p, m)
            G_new = Ghat[:, None, :] - ratio[:, :, None] * Gi[None]  # (B, p, m)
            inv_ai = (1.0 / torch.where(ok, a_i, torch.ones_like(a_i)))[0]  # (p,)
            p_idx = torch.arange(i.numel(), device=Q.device)
            G_new[i, p_idx] = Gi * inv_ai[:, None]
            u_new = u[:, None].expand(B, i.numel()).clone()
            u_new[i, p_idx] = u_spare[us]
            V = (u_new[:, :, None] * G_new).permute(2, 0, 1)  # (m, B, p)
            Z = Zcur[:, :, None].expand(m, B, i.numel()).clone()
            Z[:, i, p_idx] = z_spare[:, us] / u_spare[us] + bias[:, None]
            Vz = zero_mask(V.reshape(m, -1), rtol).reshape(m, B, -1)
            amb = ambiguous(V.reshape(m, -1), rtol).reshape(m, B, -1)
            agree = _agree(Z.reshape(m, -1), Vz.reshape(m, -1), band).reshape(m, B, -1) | amb
            total = agree.sum(dim=(0, 1)).to(torch.float64)
            total[u_spare[us] <= 0] = -1.0
            return total

        return P @ spare, trial

    def swapped(self, i: int, u: int, old: torch.Tensor) -> None:
        self.z_spare[:, u] = self.WL @ old
        self.u_spare[u] = old @ self.t


def _spares(pool: torch.Tensor, Q: torch.Tensor) -> torch.Tensor:
    """Pool columns that are not (up to sign) columns of ``Q``."""
    if pool.shape[1] == 0:
        return pool
    Qn = normalize_columns(Q)
    cos = (normalize_columns(pool).T @ Qn).abs()
    return pool[:, (cos < 1 - 1e-9).all(dim=1)]


def invert_inputs(layer: LayerUpdate, cfg: AttackConfig, seed: int,
                  clock: Clock) -> Reconstruction:
    """``sparse="input"``: recover the inputs of a layer preceded by a ReLU from ``Gᵀ``.

    Parameters
    ----------
    layer
        The validated update (``validation.load_layer``): ``weight_grad`` G (m, n).
    cfg, seed, clock
        The options, the search's seed, the budget and timings.

    Returns
    -------
    Reconstruction
        ``inputs`` the x_i (B, n), ``scales`` the norms of the recovered ``∂L/∂z_i``,
        ``column_match`` the per-sample λ and ``config.sparse == "input"``.

    Raises
    ------
    ValueError
        When the batch is not smaller than ``min(m, n)`` (the transposed problem is then not
        identifiable either): :class:`~fl_attack.errors.NotIdentifiable` with the rank read,
        as on the output side.
    """
    G, g = layer.weight_grad, layer.bias_grad
    generator = torch.Generator().manual_seed(seed)
    t0 = time.perf_counter()
    try:
        dec = decompose(G.T, batch_size=cfg.batch_size, rank_margin=cfg.rank_margin,
                        floor_rtol=rank_floor(layer.precision),
                        noise_floor=layer.rounding_edge)
    except NotIdentifiable as exc:  # the same rank as G's: keep why, for the caller
        raise NotIdentifiable(f"sparse='input' (inverting Gᵀ, inputs of dimension n = "
                              f"{G.shape[1]}): {exc}", reason=exc.reason, rank=exc.rank,
                              limit=exc.limit) from exc
    except ValueError as exc:
        raise ValueError(f"sparse='input' (inverting Gᵀ, inputs of dimension n = {G.shape[1]}): "
                         f"{exc}") from exc
    clock.tick("decompose", t0)
    B = dec.batch_size
    zero_rtol, z_band = tolerances(dec, cfg, layer.precision)
    # t' = (R'ᵀ)⁺ db: the bias gradient in the coordinates of the transposed factorisation
    t = torch.linalg.lstsq(dec.R.T, g[:, None]).solution[:, 0]
    system = LayerSystem(L=dec.L, R=dec.R, t=t, WR=None, bias=None, zero_rtol=zero_rtol,
                         weight=None, z_band=z_band)
    ctx = search_context(cfg, dec, system, generator, layer.device, clock, input_side=True)
    state, pool = SearchState(), CandidatePool(ctx)
    if B == 1:
        Q, n_found = torch.ones(1, 1, dtype=torch.float64, device=layer.device), 1
    else:
        Q, n_found = loop.search(ctx, state, pool)
    picked = _Picked(orient_nonnegative(dec.L, Q), n_found, None, 0, state.exhausted)
    if layer.weight is not None and layer.bias is not None:
        picked = _select_inputs(ctx, state, pool, picked, layer.weight, layer.bias)
    t0 = time.perf_counter()
    X, D, _ = input_factors(picked.Q, dec.L, dec.R, t)
    clock.tick("reconstruct", t0)
    m = picked.match
    return build_reconstruction(
        X, cfg=dataclasses.replace(cfg, sparse="input"), clock=clock, batch_size=B,
        n_found=picked.n_found, sparsity_match=m.value if m is not None else None,
        per_column=m.per_sample if m is not None else None, units=G.shape[0],
        chance_zeros=m.chance_zeros if m is not None else 0, noisy=ctx.noisy,
        precise=exact_possible(ctx.dec),
        noise_std=dec.noise_std, scales=D.norm(dim=1), rounds=state.rounds,
        n_candidates=len(pool), swaps=picked.swaps, exhausted=picked.exhausted,
        nonnegative=m is not None and bool(m.nonnegative.all()),
        stopped=state.stopped if B > 1 else "single",
    )


@dataclass
class _Picked:
    """The input side's current basis and what the final selection knows about it."""

    Q: torch.Tensor
    n_found: int
    match: InputMatch | None
    swaps: int
    exhausted: bool


def _select_inputs(ctx: SearchContext, state: SearchState, pool: CandidatePool,
                   picked: _Picked, W: torch.Tensor, b: torch.Tensor) -> _Picked:
    """Input-mode stage 2 with W and b: swap while λ < 1, and while it stays below 1 run more
    search passes that feed the pool (until the round cap or the budget), keeping the best
    basis by (directions found, λ)."""
    cfg, clock, system, L = ctx.cfg, ctx.clock, ctx.system, ctx.L
    t0 = time.perf_counter()
    picked.match = match = input_match(picked.Q, system, W, b, system.t)
    while ctx.B > 1:
        if match.value < 1.0 and cfg.greedy:
            spare = orient_nonnegative(L, _spares(pool.columns, picked.Q))
            picked.Q, match, k = greedy_swaps(picked.Q, spare, system, W, b, system.t,
                                              max_swaps=cfg.max_swaps,
                                              positions=cfg.swap_positions,
                                              deadline=clock.finish_deadline)
            picked.match, picked.swaps = match, picked.swaps + k
            picked.exhausted = picked.exhausted or passed(clock.finish_deadline)
        if match.value >= 1.0 or state.rounds >= cfg.round_cap(ctx.B):
            break
        if clock.expired():
            picked.exhausted = True
            break
        clock.tick("select", t0)
        Q_new, n_new = loop.search(ctx, state, pool)  # more rounds feed the pool
        picked.exhausted = picked.exhausted or state.exhausted
        Q_new = orient_nonnegative(L, Q_new)
        t0 = time.perf_counter()
        m_new = input_match(Q_new, system, W, b, system.t)
        if (n_new, m_new.value) > (picked.n_found, match.value):
            picked.Q, picked.n_found, picked.match = Q_new, n_new, m_new
            match = m_new
    clock.tick("select", t0)
    return picked
