"""The one-call entry point: ``invert`` a linear layer's gradient (or weight update)."""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from fl_attack import (
    columns,
    completion,
    faces,
    feasibility,
    filtering,
    match,
    peel,
    polish,
    sampling,
    search,
    select,
)
from fl_attack.clock import passed
from fl_attack.config import FEDAVG_TAU, AttackConfig
from fl_attack.decompose import Decomposition, decompose
from fl_attack.scale import LayerSystem, make_system, reconstruct
from fl_attack.validation import as_tensor, check_layer, input_precision, resolve_device


@dataclass
class Reconstruction:
    """Result of an inversion. ``inputs`` rows are the layer's inputs, in arbitrary order."""

    inputs: torch.Tensor
    """(B, n) reconstructed inputs of the layer, float64 on the CPU."""
    batch_size: int
    """Detected (or given) batch size B."""
    sparsity_match: float | None
    """λ ∈ [0, 1]; None without ``weight`` and ``bias``. Active units whose ∂L/∂Z is
    indistinguishable from zero count as matches when they are the only mismatches and no
    more than chance explains (``chance_zeros``; ``match.sparsity_match``)."""
    exact: bool
    """True when λ = 1 with all B directions found and no noise detected: the reconstruction
    is certified without ground truth. Never under noise (DP-SGD): there λ counts agreement
    within a noise tolerance, and with ``update="fedavg"`` (which checks only that zero rows
    are inactive units) a noisy update reached λ = 1 at 35 dB; report PSNR there."""
    n_directions: int
    """Directions found by the search; < B means a partial reconstruction, in which *no* sample
    is guaranteed: every row of Q⁻¹ depends on all B columns (measured on a real batch, true
    columns with one missing and the rest completed: found samples off by 12% median)."""
    method: str
    seconds: float
    timings: dict[str, float] = field(default_factory=dict)
    rounds: int = 0
    n_candidates: int = 0
    swaps: int = 0
    noise_std: float = 0.0
    scales: torch.Tensor | None = None
    """Per-sample scale of ∂L/∂Z columns (sign tells nothing; magnitude ~ per-sample loss grad)."""
    column_match: torch.Tensor | None = None
    """Per-sample sparsity match (fraction of the m entries whose patterns agree)."""
    config: AttackConfig | None = None
    chance_zeros: int = 0
    """Entries counted as matches in λ although the paper's λ₊ term counts them as mismatches:
    an active unit whose ∂L/∂Z passed the zero test (its ∂L/∂A is that small; the ReLU law
    allows it). 0 when λ < 1."""
    peeled: int = 0
    """Samples recovered one by one through ``next_weight_grad`` (each verified on its own)
    and taken off the gradient before the rest of the batch was searched (``fl_attack.peel``)."""
    budget_exhausted: bool = False
    """True when the time budget (``AttackConfig.max_seconds``) ran out before the search
    ended by its own stop rule, or before the final selection finished: the result is the best
    selection found in the time given, and a larger budget may find more."""

    @property
    def partial(self) -> bool:
        """True when fewer than B directions were found (the rest of Q̄ was completed)."""
        return self.n_directions < self.batch_size

    def as_dict(self) -> dict[str, Any]:
        """JSON-safe summary (no tensors) for logs and metric records."""
        return {
            "method": self.method,
            "batch_size": self.batch_size,
            "n_directions": self.n_directions,
            "partial": self.partial,
            "sparsity_match": self.sparsity_match,
            "exact": self.exact,
            "seconds": round(self.seconds, 4),
            "rounds": self.rounds,
            "n_candidates": self.n_candidates,
            "swaps": self.swaps,
            "noise_std": self.noise_std,
            "chance_zeros": self.chance_zeros,
            "peeled": self.peeled,
            "budget_exhausted": self.budget_exhausted,
            "timings": {k: round(v, 4) for k, v in self.timings.items()},
        }


def invert(
    weight_grad: torch.Tensor | np.ndarray,
    bias_grad: torch.Tensor | np.ndarray,
    *,
    weight: torch.Tensor | np.ndarray | None = None,
    bias: torch.Tensor | np.ndarray | None = None,
    method: str = "spear++",
    seed: int = 0,
    device: str | torch.device | None = None,
    config: AttackConfig | None = None,
    next_weight_grad: torch.Tensor | np.ndarray | None = None,
    **options: Any,
) -> Reconstruction:
    """Recover the batch that produced a linear layer's gradient (SPEAR / SPEAR++).

    ``weight_grad`` (m, n) and ``bias_grad`` (m,) are ∂L/∂W and ∂L/∂b of ``nn.Linear(n, m)``, or a
    weight update ``W₀ - W_E``, ``b₀ - b_E`` (FedAvg; the learning rate cancels). ``weight`` and
    ``bias`` (the layer's parameters the client started from) enable the sparsity-matching
    certificate λ and the greedy selection; without them the result is never marked exact.
    Options are the fields of :class:`AttackConfig` (unknown names raise ``TypeError``).

    ``next_weight_grad`` (k, m), the weight gradient of the linear layer that this layer's ReLU
    feeds (same batch, same step), lets found samples be recovered and verified one by one and
    taken off the gradient, so the rest is searched as a smaller batch (``fl_attack.peel``;
    beyond the papers, which use one layer). Needs ``weight`` and ``bias``; clean FedSGD
    gradients only (not ``update="fedavg"``; ignored when noise is detected).
    """
    start = time.perf_counter()
    cfg = AttackConfig.from_options(config, method=method, **options)
    dev = resolve_device(device)
    precision = input_precision(weight_grad, bias_grad)
    G = as_tensor(weight_grad, "weight_grad", ndim=2, device=dev)
    g = as_tensor(bias_grad, "bias_grad", ndim=1, device=dev)
    W = as_tensor(weight, "weight", ndim=2, device=dev) if weight is not None else None
    b = as_tensor(bias, "bias", ndim=1, device=dev) if bias is not None else None
    check_layer(G, g, W, b)
    G2 = None
    if next_weight_grad is not None:
        G2 = as_tensor(next_weight_grad, "next_weight_grad", ndim=2, device=dev)
        _check_next_layer(G, G2, W, cfg)
    if cfg.sparse != "output":  # SPEC §8: the layer's inputs are the sparse factor (input_layer)
        from fl_attack import input_layer

        side = input_layer.invert_inputs if cfg.sparse == "input" else input_layer.invert_auto
        return side(G, g, W, b, cfg=cfg, precision=precision, seed=seed, device=dev, start=start)
    generator = torch.Generator().manual_seed(seed)
    timings: dict[str, float] = {}
    found = _solve(G, g, W, b, cfg, precision, generator, dev, start, timings, G2)
    run, system = found.run, found.system
    if found.peeled:  # the columns of every level, in this level's coordinates
        Q = columns.normalize_columns(found.dec.L.T @ found.columns)
        run.match = match.sparsity_match(Q, system)
    else:
        Q = found.Q
    t0 = time.perf_counter()
    X, s = reconstruct(Q, system)
    timings["reconstruct"] = time.perf_counter() - t0
    lam = run.match.value if run.match is not None else None
    col = None
    if run.match is not None:
        col = (run.match.per_column.double() / G.shape[0]).cpu()
    B = found.dec.batch_size
    return Reconstruction(
        inputs=X.cpu(),
        batch_size=B,
        sparsity_match=lam,
        exact=certified(lam, found.n_found, B, noisy=found.noisy),
        n_directions=found.n_found,
        method=cfg.method,
        seconds=time.perf_counter() - start,
        timings=timings,
        rounds=found.rounds,
        n_candidates=found.n_candidates,
        swaps=found.swaps,
        noise_std=found.dec.noise_std,
        scales=s.cpu(),
        column_match=col,
        config=cfg,
        chance_zeros=run.match.chance_zeros if run.match is not None else 0,
        peeled=found.peeled,
        budget_exhausted=found.exhausted,
    )


def certified(sparsity_match: float | None, n_found: int, batch_size: int, *,
              noisy: bool, nonnegative: bool = True) -> bool:
    """Whether a reconstruction may be marked exact without ground truth.

    Parameters
    ----------
    sparsity_match
        λ of the selected basis (None without the layer's weight and bias: no certificate).
    n_found, batch_size
        Directions found by the search, and B.
    noisy
        Whether noise was detected in the update (:func:`noisy_update`). Under noise λ counts
        agreement within a noise tolerance and can reach 1 for an inexact batch, so a noisy
        update is never certified.
    nonnegative
        The input side's extra condition (every recovered input a possible ReLU output).

    Returns
    -------
    bool
        λ = 1, all B directions found, no noise, and ``nonnegative``.
    """
    return (sparsity_match is not None and sparsity_match >= 1.0 and n_found == batch_size
            and not noisy and nonnegative)


def _check_next_layer(G: torch.Tensor, G2: torch.Tensor, W: torch.Tensor | None,
                      cfg: AttackConfig) -> None:
    """Errors for a ``next_weight_grad`` that cannot belong to this layer or this attack."""
    if G2.shape[1] != G.shape[0]:
        raise ValueError(f"next_weight_grad has shape {tuple(G2.shape)}: the next layer takes "
                         f"this layer's {G.shape[0]} outputs, so it must be (k, {G.shape[0]})")
    if W is None:
        raise ValueError("next_weight_grad needs weight and bias (the samples are solved from "
                         "W x + b)")
    if cfg.sparse != "output":
        raise ValueError(f"next_weight_grad applies to sparse='output' only, got {cfg.sparse!r}")
    if cfg.update == "fedavg":
        raise ValueError("next_weight_grad needs a single-step gradient: a FedAvg update's "
                         "next layer mixes each sample's activations from several steps")
    if not G2.abs().max() > 0:
        raise ValueError("next_weight_grad is identically zero")


@dataclass
class _Found:
    """The columns of one level of the search, with the levels peeled below it."""

    dec: Decomposition
    system: LayerSystem
    run: _Search
    Q: torch.Tensor
    """(B, B) this level's selected columns (without peeling)."""
    n_found: int
    columns: torch.Tensor | None = None
    """(m, B) every level's columns as ∂L/∂Z directions, when samples were peeled."""
    peeled: int = 0
    rounds: int = 0
    n_candidates: int = 0
    swaps: int = 0
    noisy: bool = False
    exhausted: bool = False


def _solve(G: torch.Tensor, g: torch.Tensor, W: torch.Tensor | None, b: torch.Tensor | None,
           cfg: AttackConfig, precision: torch.dtype, generator: torch.Generator,
           device: torch.device, start: float, timings: dict[str, float],
           G2: torch.Tensor | None, rows2: torch.Tensor | None = None,
           dec: Decomposition | None = None, seeds: torch.Tensor | None = None) -> _Found:
    """Search the columns of (G, g); with the next layer, peel the verified samples off and
    solve the smaller batch that is left the same way (recursively), starting from the upper
    level's candidates (``seeds``, (m, P) ∂L/∂Z directions) that belong to the rest."""
    t0 = time.perf_counter()
    floor = 1e-6 if precision == torch.float32 else 1e-13
    if dec is None:
        dec = decompose(G, batch_size=cfg.batch_size, rank_margin=cfg.rank_margin,
                        floor_rtol=floor)
    timings["decompose"] = timings.get("decompose", 0.0) + time.perf_counter() - t0
    zero_rtol, z_band = tolerances(dec, cfg, precision)
    system = make_system(dec.L, dec.R, g, W, b, zero_rtol, z_band,
                         subset=cfg.update == "fedavg")
    run = _Search(cfg, dec, system, generator, device, timings, start)
    B = dec.batch_size
    if G2 is not None and rows2 is None and not run.noisy and B > 1:
        t0 = time.perf_counter()
        rows2 = peel.next_layer_rows(G2, B, floor, generator)
        timings["peel"] = timings.get("peel", 0.0) + time.perf_counter() - t0
        if rows2 is None:
            warnings.warn(f"next_weight_grad does not have rank {B} (the batch size): samples "
                          "are not peeled", stacklevel=3)
    if rows2 is not None and not run.noisy:
        run.peeler = lambda cols, deadline: peel.recover(
            cols, dec.L, dec.R, rows2, system.WR, system.bias, zero_rtol=zero_rtol,
            z_band=z_band, precision=precision, deadline=deadline)
    if seeds is not None and B > 1:
        run.seed(seeds)
    if B == 1:  # one sample: G = d xᵀ, nothing to disentangle
        Q = torch.ones(1, 1, dtype=torch.float64, device=device)
        run.match = match.sparsity_match(Q, system)
        return _Found(dec, system, run, Q, 1, noisy=run.noisy)
    while True:
        Q, n_found = run.find()
        here = _Found(dec, system, run, Q, n_found, rounds=run.rounds,
                      n_candidates=run.n_candidates, swaps=run.swaps, noisy=run.noisy,
                      exhausted=run.exhausted)
        peeled, run.peeled = run.peeled, None
        if peeled is None:
            return here
        t0 = time.perf_counter()
        F = int(peeled.verified.sum())
        Gr, gr = peel.peel_off(G, g, dec.L, peeled)
        sub_dec = peel.reduced(dec, peeled) if F < B else None
        timings["peel"] = timings.get("peel", 0.0) + time.perf_counter() - t0
        if F < B and sub_dec is None:
            warnings.warn(f"peeling {F} samples did not leave a clean rank {B - F}: the search "
                          "goes on without peeling", stacklevel=3)
            run.peeler = None
            continue
        if cfg.progress:
            print(f"[fl_attack] {time.perf_counter() - start:.1f}s: peeled {F} verified samples "
                  f"through the next layer, {B - F} left", flush=True)
        cols = dec.L @ peeled.columns
        here.columns, here.peeled, here.n_found = cols, F, F
        if sub_dec is None:
            return here
        sub_cfg = cfg if cfg.batch_size is None else dataclasses.replace(cfg, batch_size=B - F)
        sub = _solve(Gr, gr, W, b, sub_cfg, precision, generator, device, start, timings, G2,
                     rows2=rows2, dec=sub_dec, seeds=dec.L.to(run.pool) @ run.pool)
        sub_cols = sub.columns if sub.columns is not None else sub.dec.L @ sub.Q
        here.columns = torch.cat([cols, sub_cols], dim=1)
        here.peeled += sub.peeled
        here.n_found += sub.n_found
        here.rounds += sub.rounds
        here.n_candidates += sub.n_candidates
        here.swaps += sub.swaps
        here.exhausted = here.exhausted or sub.exhausted
        return here


def tolerances(dec: Decomposition, cfg: AttackConfig,
               precision: torch.dtype) -> tuple[float, float]:
    """(zero tolerance, pre-activation band) for a decomposition of an m x n gradient.

    A known noise level (``cfg.noise``) replaces the spectral estimate in ``dec``; float64
    storage of float32-precision numbers (a noise floor above float64 rounding) counts as
    float32. Shared by both sides of the attack (``fl_attack.input_layer``).
    """
    if cfg.noise != "auto":
        m, n = dec.L.shape[0], dec.R.shape[1]
        dec.noise_std = float(cfg.noise)
        dec.noise_edge = float(cfg.noise) * (m**0.5 + n**0.5)
    S, B = dec.singular_values, dec.batch_size
    if precision == torch.float64 and B < S.numel() and S[B] > 1e-11 * S[0]:
        precision = torch.float32
    zero_rtol = cfg.zero_rtol or _default_zero_rtol(precision, dec)
    z_band = 1e-5 if precision == torch.float32 else 1e-10
    return zero_rtol, z_band


def _noise_ratio(dec: Decomposition) -> float:
    """Estimated noise edge over the smallest signal singular value (≈ relative error of L)."""
    sigma_b = float(dec.singular_values[dec.batch_size - 1])
    return dec.noise_edge / sigma_b if sigma_b > 0 else float("inf")


def noisy_update(dec: Decomposition) -> bool:
    """Whether the decomposed update carries noise that voids exact certification: its
    estimated noise edge exceeds :data:`NOISY_RATIO` x the smallest signal singular value."""
    return _noise_ratio(dec) > NOISY_RATIO


def _default_zero_rtol(precision: torch.dtype, dec: Decomposition) -> float:
    """Numerical-zero tolerance for entries of L q, relative to the column's largest entry.

    The floor comes from the float precision; under noise (DP-SGD, float32 weight updates) the
    entries of a true zero row scatter like the perturbation of L, about noise edge / σ_B.
    For float64 the floor is 1e-7, not 1e-13: kernels taken from Gram matrices (polishing, face
    splitting) are only accurate to about sqrt(eps) ≈ 1.5e-8, and a tighter floor makes the
    face splitting miss every sample of a face (measured: 15/20 instead of 20/20 on photos).
    """
    base = 1e-7 if precision == torch.float64 else 1e-4
    return min(max(base, 0.12 * _noise_ratio(dec)), 0.1)


STALE_ROUNDS = 3
"""SPEAR++ rounds without a new candidate after which a full basis with λ < 1 is returned."""

SLICE_PATIENCE = 3
"""Slice-sampling calls on one found set (per round) before the search takes over. Each call
draws new points, and its yield is random: at B = 210, m = 4000, once ~70 columns are found,
calls of 2048 points add 1-7 columns and some none; a call there costs ~15 s on 2 cores, a
search round in the complement ~330 s (of which IRLS 220 s) and that round added none."""

PEEL_SHARE = 0.5
"""With a next layer, samples are peeled off during the completions once this share of B new
trusted columns is there, otherwise after them. Peeling right after a round's search is too
early at B = 210, m = 4000: that search alone gives ~8 columns, the completions (slice sampling)
~120, and every peel costs a new search round on the smaller batch (measured: peeling 6 after
the search left 204 for a round that found 9)."""

PEEL_TIME_SHARE = 0.5
"""Past this share of ``max_seconds``, a tenth of B new trusted columns is enough to peel
during the completions (the levels below need the time). Measured at (210,4000) seed 6:
completions until 395 s of 400 for 100 trusted columns, so the half-batch share never
triggered and the level below had no time. After the search's deadline the found samples are
still peeled (within the final selection's extra time): they come back verified and exact
even when the batch is not."""

SEED_TOL = 1e-4
"""A direction counts as inside a level's column space when its projection keeps this much
of its unit norm (float32 factors: ~1e-7 off; a peeled sample's direction falls far outside
or, if nearly inside, loses its zeros and fails the candidate filter anyway)."""

POLISH_CHUNK = 256
"""Directions polished at once under a time budget (``AttackConfig.max_seconds``): ~4 s at
B = 210, m = 4000 on 2 cores, where polishing a first round's ~4000 minima took 150 s."""

NOISY_RATIO = 1e-3
"""Noise edge over σ_B above which an update counts as noisy (DP-SGD; float32 rounding of a
large layer's weight difference can reach it): λ then stops the search below 1 and no result
is marked exact."""

NOISY_TRUST = 0.75
"""Under noise a selected column is trusted (completions and peeling start from it, and a search
ends only with all B trusted) when its ``filtering.noisy_sparsity`` is at least this share of
the least zero count of a true column.
Measured at B = 150, m = 4000, DP noise f = 0.01: the 150 true columns score 0.78-1.05 x
(1441-1949 of 1850), the 18 wrong ones of the first round's selection at most 0.71 x (the
19th, 0.78 x, lies at cosine 0.985 from a true column)."""

NEIGHBOUR_SHARE = 0.25
"""Share of ``AttackConfig.max_seconds`` the neighbour search after round 1
(``faces.conditional_directions``) may take. Clean runs at (210,4000) spent 40-80 s of 400
there; under DP noise at (150,4000) (f = 0.01) the first round's pool held 2738 columns and the
search took 314 s of the 400, leaving none for the completions and selection."""

FINISH_SHARE = 0.25
"""Share of ``AttackConfig.max_seconds`` that the final selection (greedy swaps, repair) may
take past the search's budget, so a run ends within about 1.25 x ``max_seconds``. The
selection is not skipped when the search used the whole budget: each swap raises λ, and at
B = 150, m = 4000 the swaps are what turns a pool with the right columns into the right basis."""


class _Search:
    """Rounds of search (SPEAR++ optimisation or SPEAR sampling) feeding a candidate pool."""

    complement_restarts = True
    """Whether ``cfg.deflate`` applies (later rounds start orthogonal to the found columns)."""

    def __init__(self, cfg: AttackConfig, dec: Decomposition, system: LayerSystem,
                 generator: torch.Generator, device: torch.device, timings: dict[str, float],
                 start: float) -> None:
        self.cfg, self.dec, self.system = cfg, dec, system
        self.generator, self.device, self.timings, self.start = generator, device, timings, start
        self.B = dec.batch_size
        m = dec.L.shape[0]
        tau = cfg.tau if cfg.tau is not None or not system.subset else FEDAVG_TAU
        self.min_zeros = max(filtering.min_zero_count(m, cfg.p_false_reject, tau), self.B)
        self.pool = torch.empty(self.B, 0, dtype=torch.float64, device=device)
        self.pool_score = torch.empty(0, dtype=torch.long, device=device)
        """Sparsity of each pool column, the pool's order: its zero count, under noise
        ``filtering.noisy_sparsity``."""
        self.match: match.Match | None = None
        self.rounds = self.swaps = self.n_candidates = 0
        self.noisy = noisy_update(dec)
        S = dec.singular_values[:self.B].to(device=device, dtype=torch.float64)
        self.row_noise = (dec.noise_std / S.clamp_min(torch.finfo(S.dtype).tiny)
                          if self.noisy else None)
        """ν / s_j: the noise on L's columns (``filtering.noise_scales``), when noisy."""
        self.lambda_stop = cfg.lambda_stop or (0.98 if self.noisy else 1.0)
        self.faces_seen: set[bytes] = set()
        self.samples = 0
        self.trusted: torch.Tensor | None = None
        """Columns believed right so far; completions and peeling start from them."""
        self.deflated: torch.Tensor | None = None
        """Columns whose complement later rounds search: the trusted ones, under noise all of
        a partial selection (also the columns that are not clearly sparse: the wrong ones are
        directions dominated by the noisiest singular vectors, and starting the search outside
        them kept it off those minima; with only the 44 clearly sparse of 62 deflated, round 2
        at B = 150, m = 4000 found 65 true columns instead of 120)."""
        self.verdicts: dict[bytes, tuple[bool, int]] = {}
        """Feasibility of a column's zero pattern -> (feasible, missing columns when checked)."""
        self.peeler: Callable[[torch.Tensor, float | None], peel.Peeled] | None = None
        """Recovers and verifies the samples of found columns (``fl_attack.peel``), if given."""
        self.peeled: peel.Peeled | None = None
        """Set when ``find`` stopped to let verified samples be peeled off."""
        self.peel_tried: set[bytes] = set()
        self.exhausted = False
        """Set when the budget ran out before the search or the final selection ended."""

    def seed(self, directions: torch.Tensor) -> None:
        """Start the pool with the unit ∂L/∂Z directions (m, P) that lie in this gradient's
        column space: after a peel, the columns already found for the samples left over (the
        peeled ones' directions fall outside it and are dropped)."""
        L = self.dec.L.to(self.pool)
        q = L.T @ directions.to(self.pool)
        q = columns.normalize_columns(q[:, q.norm(dim=0) > 1 - SEED_TOL])
        if q.shape[1]:
            self._add(q, columns.zero_mask(L @ q, self.system.zero_rtol).sum(dim=0))

    def _objective(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """The loss of the SPEAR++ search; None: the configured sparsity loss φ."""
        return None

    def _tick(self, key: str, t0: float) -> None:
        self.timings[key] = self.timings.get(key, 0.0) + time.perf_counter() - t0

    def _time_limit(self, share: float) -> float | None:
        """The ``time.perf_counter()`` value at ``share`` x ``max_seconds`` (None: never)."""
        budget = self.cfg.max_seconds
        return None if budget is None else self.start + budget * share

    def _from_now(self, share: float) -> float | None:
        """The sooner of the search's deadline and ``share`` x ``max_seconds`` from now."""
        budget, deadline = self.cfg.max_seconds, self.deadline
        if budget is None or deadline is None:
            return None
        return min(deadline, time.perf_counter() + share * budget)

    @property
    def deadline(self) -> float | None:
        """The ``time.perf_counter()`` value at which ``max_seconds`` runs out (None: never)."""
        return self._time_limit(1.0)

    @property
    def finish_deadline(self) -> float | None:
        """The ``time.perf_counter()`` value at which the final selection stops improving (see
        :data:`FINISH_SHARE`; None: never)."""
        return self._time_limit(1.0 + FINISH_SHARE)

    def _out_of_time(self, deadline: float | None = None) -> bool:
        """Whether ``deadline`` (by default the search's) has passed."""
        deadline = self.deadline if deadline is None else deadline
        return passed(deadline)

    def _add(self, Q: torch.Tensor, zeros: torch.Tensor,
             leverage: torch.Tensor | None = None) -> None:
        keep = zeros >= self.min_zeros
        if leverage is not None:
            keep &= leverage < self.cfg.max_leverage
        Q, score = Q[:, keep].to(self.pool), zeros[keep]
        if self.row_noise is not None and Q.shape[1]:
            score = filtering.noisy_sparsity(
                self.dec.L.to(self.pool) @ Q, filtering.noise_scales(Q, self.row_noise))
        pool = torch.cat([self.pool, Q], dim=1)
        pz = torch.cat([self.pool_score, score.to(self.pool_score)])
        order = torch.argsort(pz, descending=True, stable=True)
        pool, pz = pool[:, order], pz[order]
        idx = columns.dedupe(pool, self.cfg.dedupe_tol)
        self.pool = columns.normalize_columns(pool[:, idx])
        self.pool_score = pz[idx]
        self.n_candidates = self.pool.shape[1]

    def _select(self) -> tuple[torch.Tensor, int, torch.Tensor, torch.Tensor]:
        """(Q, count of pool columns in it, the other pool columns, their pool indices
        (count,)): Q's first ``count`` columns are pool columns, the rest completes a basis."""
        # directions closer than this to the span of chosen ones are the same up to noise
        idx, count = select.stage1(self.pool, self.B, tol=max(1e-8, 10 * self.system.zero_rtol))
        Q = select.complete_basis(self.pool[:, idx], self.B)
        rest = torch.ones(self.pool.shape[1], dtype=torch.bool, device=self.pool.device)
        rest[idx] = False
        return Q, count, self.pool[:, rest], idx

    def _round_spearpp(self) -> None:
        cfg, B = self.cfg, self.B
        dtype = torch.float32 if cfg.search_dtype == "float32" else torch.float64
        L = self.dec.L.to(dtype)
        t0 = time.perf_counter()
        # once columns are found, start only orthogonal to them
        use = cfg.deflate and self.complement_restarts and self.trusted is not None
        trusted = self.deflated if use else None
        deflate = trusted is not None and 0 < trusted.shape[1] < B
        # 20 starts per column sought: all B at first, then the missing ones in the complement
        K = cfg.n_init or max(256, 20 * (B - trusted.shape[1] if deflate else B))
        if deflate:
            assert trusted is not None
            init = search.random_complement(trusted, K, generator=self.generator, dtype=dtype,
                                            device=self.device)
        else:
            init = search.random_sphere(K, B, generator=self.generator, dtype=dtype,
                                        device=self.device)
        optimizer = cfg.optimizer
        alternate, irls = cfg.wide_layer_search(self.dec.L.shape[0])
        if alternate and self.rounds % 2 == 0:  # the other optimiser finds other minima
            optimizer = "pgd" if optimizer == "radam" else "radam"
        lr = cfg.lr if optimizer == cfg.optimizer else None
        Qopt = search.optimise_on_sphere(
            L, init, loss=cfg.loss, optimizer=optimizer, steps=cfg.steps, lr=lr,
            milestones=cfg.lr_milestones, gamma=cfg.lr_gamma, alpha=cfg.logcosh_alpha,
            objective=self._objective(), deadline=self.deadline,
        )
        Qopt = columns.normalize_columns(Qopt.double())
        Qopt = Qopt[:, columns.dedupe(Qopt, 1e-4)]  # most starts share a few minima
        self._tick("search", t0)
        t0 = time.perf_counter()
        if cfg.polish and irls and deflate and not self._out_of_time():
            Qopt = torch.cat([Qopt, polish.irls_round(self.dec.L, Qopt, deadline=self.deadline)],
                             dim=1)
            self._tick("irls", t0)
            t0 = time.perf_counter()
        if cfg.polish:
            n_rows = self._n_rows()
            Qp, zeros, face_dim, lev = self._polish(Qopt, n_rows)
            Qopt = Qopt[:, :Qp.shape[1]]
            self._add(Qp, zeros, lev)
            faces = torch.nonzero(face_dim > 1).squeeze(1)
            vertices = torch.nonzero((face_dim == 1) & (zeros >= self.min_zeros)
                                     & (lev >= cfg.max_leverage)).squeeze(1)
            self._tick("polish", t0)
            t0 = time.perf_counter()
            self._split_faces(Qopt.double()[:, faces], n_rows)
            self._split_faces(Qp[:, vertices], n_rows, vertex=True)
            self._tick("faces", t0)
            return
        else:
            Qp = Qopt.double()
            zeros = columns.zero_mask(self.dec.L @ Qp, self.system.zero_rtol).sum(dim=0)
        self._tick("polish", t0)
        self._add(Qp, zeros)

    def _polish(self, Q: torch.Tensor, n_rows: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``polish.polish`` of the first columns of ``Q`` that the time budget allows.

        Without ``max_seconds`` all at once; with it in chunks of :data:`POLISH_CHUNK` columns,
        each column being polished on its own, until the budget runs out (at least one chunk).
        Unpolished directions are no candidates, so the rest is dropped.
        """
        if self.deadline is None:
            return polish.polish(self.dec.L, Q, n_rows=n_rows, zero_rtol=self.system.zero_rtol)
        parts = []
        for start in range(0, Q.shape[1], POLISH_CHUNK):
            if start > 0 and self._out_of_time():
                break
            parts.append(polish.polish(self.dec.L, Q[:, start:start + POLISH_CHUNK],
                                       n_rows=n_rows, zero_rtol=self.system.zero_rtol))
        if not parts:
            return polish.polish(self.dec.L, Q, n_rows=n_rows, zero_rtol=self.system.zero_rtol)
        Qp, zeros, face_dim, lev = (torch.cat(xs, dim=-1) for xs in zip(*parts, strict=True))
        return Qp, zeros, face_dim, lev

    def _round_spear(self) -> None:
        """SPEAR (SPEC §3): kernels of random (B-1)-row submatrices, batched."""
        cfg, B, L = self.cfg, self.B, self.dec.L
        t0 = time.perf_counter()
        S = min(cfg.samples_per_step, cfg.max_samples - self.samples)
        rows = sampling.random_row_subsets(L.shape[0], B - 1, S, generator=self.generator)
        C, rank_ok = sampling.submatrix_kernels(L, rows.to(L.device))
        self.samples += S
        zeros = columns.zero_mask(L @ C, self.system.zero_rtol).sum(dim=0)
        keep = rank_ok & (zeros >= self.min_zeros)
        self._tick("search", t0)
        if bool(keep.any()):
            t0 = time.perf_counter()
            Qp, zeros, _, lev = polish.polish(L, C[:, keep], n_rows=self._n_rows(),
                                              zero_rtol=self.system.zero_rtol)
            self._add(Qp, zeros, lev)
            self._tick("polish", t0)

    def _n_rows(self) -> int:
        """Rows used by the first polishing pass: well inside any true column's zero set."""
        m = self.dec.L.shape[0]
        return min(max(int(0.75 * self.min_zeros), self.B + 2), m - 1)

    def _split_faces(self, Q: torch.Tensor, n_rows: int, vertex: bool = False,
                     deadline: float | None = None) -> None:
        """Split each new face (kernel of dimension > 1) into its sparsest directions, until
        ``deadline`` (by default the search's)."""
        L, rtol = self.dec.L, self.system.zero_rtol
        found, counts = [], []
        budget = self.cfg.max_faces or (128 if self.B <= 32 else 16)
        for j in range(Q.shape[1]):
            if budget <= 0 or self._out_of_time(deadline):
                break
            if vertex:
                N = faces.vertex_face_basis(L, Q[:, j], rtol, self.cfg.max_leverage)
            else:
                N = faces.face_basis(L, Q[:, j], n_rows, rtol)
            if N.shape[1] < 2 or N.shape[1] > self.cfg.max_face_dim:
                continue
            shared = (L @ N).norm(dim=1)
            key = (shared <= rtol * shared.max()).cpu().numpy().tobytes()
            if key in self.faces_seen:
                continue
            self.faces_seen.add(key)
            budget -= 1
            Qf, zf = faces.split_face(L, N, zero_rtol=rtol, generator=self.generator)
            if Qf.shape[1]:
                found.append(Qf)
                counts.append(zf)
        if found:
            Qc = torch.cat(found, dim=1)
            n_rows_c = n_rows
            Qp, zeros, _, lev = polish.polish(L, Qc, n_rows=n_rows_c, zero_rtol=rtol)
            self._add(Qp, zeros, lev)

    def _complete(self, found: torch.Tensor) -> bool:
        """Complete the columns missing from ``found`` (B, F) from W and b (see refine); False
        when nothing is left to try for this found set.

        The exact completion runs once per found set of 1-3 missing columns (it gives up on
        3 when the cells are too many: m ≥ 284); the sampled one up to :data:`SLICE_PATIENCE`
        times per found set and round when 2 or more are missing. For FedAvg sums, where the
        exact one does not apply, the sampled one also runs once for a single missing column;
        under noise both run once for 1-3 missing columns (least-squares kernels).
        """
        count = found.shape[1]
        missing = self.B - count
        if missing < 1 or self.system.WR is None or not self.cfg.polish:
            return False
        exact, sampled = (missing, count, -1), (missing, count, self.rounds)
        t0 = time.perf_counter()
        # a FedAvg sum keeps only part of a sample's W₀ pattern as zeros: the exact
        # completion's full patterns have no kernel there, the sampled one's negative rows do;
        # with one column missing the sampled one is a single point, so it runs once too
        exact_ok = not self.system.subset
        once = missing <= 3 if exact_ok else missing == 1 and bool(self.cfg.slice_samples)
        if once and exact not in self.completed:
            self.completed[exact] = 1
            Qc = self._missing_candidates(found, sampled=not exact_ok)
            if exact_ok and self.row_noise is not None and self.cfg.slice_samples:
                # under noise a pre-activation near 0 may take the wrong sign: the most negative
                # rows' kernels avoid those (at (150, 4000), true others, float32 rounding: the
                # exact completion missed 6 of 150 samples, these got all 6)
                Qc = torch.cat([Qc, self._missing_candidates(found, sampled=True)], dim=1)
        elif (missing >= 2 and self.cfg.slice_samples
              and self.completed.get(sampled, 0) < SLICE_PATIENCE):
            self.completed[sampled] = self.completed.get(sampled, 0) + 1
            Qc = self._missing_candidates(found, sampled=True)
        else:
            return False
        if Qc.shape[1]:
            Qp, zeros, _, lev = polish.polish(self.dec.L, Qc, n_rows=self._n_rows(),
                                              zero_rtol=self.system.zero_rtol)
            self._add(Qp, zeros, lev)
        self._tick("complete", t0)
        return True

    def _missing_candidates(self, found: torch.Tensor, *, sampled: bool,
                            deadline: float | None = None) -> torch.Tensor:
        """Candidates for the columns missing from ``found`` from W and b: the exact completion
        (``completion.complete_missing``) or slice sampling (``completion.sample_missing``, until
        ``deadline``, by default the search's)."""
        if not sampled:
            return completion.complete_missing(self.system, found, row_noise=self.row_noise,
                                               deadline=self.deadline if deadline is None
                                               else deadline)
        return completion.sample_missing(self.system, found, row_noise=self.row_noise,
                                     generator=self.generator,
                                     n_samples=self.cfg.slice_samples or 2048,
                                     deadline=self.deadline if deadline is None else deadline)

    def _feasible(self, cols: torch.Tensor) -> torch.Tensor:
        """Mask of the found columns (B, F) whose ReLU pattern is feasible given the others.

        One LP per column (``feasibility.pattern_margins``) once at most ``verify_dim`` columns
        are missing; a verdict is kept until the number missing has halved (the test tightens
        as columns are added). Clean single-step updates with weight and bias only (a FedAvg
        column's zero rows are only part of its W₀ pattern, which the LP cannot test).
        """
        F = cols.shape[1]
        missing = self.B - F
        keep = torch.ones(F, dtype=torch.bool, device=cols.device)
        if (self.noisy or self.system.WR is None or self.system.subset
                or not self.cfg.verify_dim or missing > self.cfg.verify_dim):
            return keep
        t0 = time.perf_counter()
        zero = columns.zero_mask(self.dec.L @ cols, self.system.zero_rtol).cpu()
        keys = [zero[:, j].numpy().tobytes() for j in range(F)]
        todo = [j for j, key in enumerate(keys)
                if key not in self.verdicts or missing <= self.verdicts[key][1] // 2]
        if todo:
            margins = feasibility.pattern_margins(cols, self.system, torch.tensor(todo),
                                                  deadline=self.deadline)
            late = self._out_of_time()  # LPs after the deadline were skipped (NaN): not cached
            for j, margin in zip(todo, margins.tolist(), strict=True):  # NaN: feasible
                if not (late and margin != margin):
                    self.verdicts[keys[j]] = (not margin < feasibility.FAIL_MARGIN, missing)
        for j, key in enumerate(keys):
            keep[j] = self.verdicts[key][0] if key in self.verdicts else True
        self._tick("verify", t0)
        return keep

    def _done(self) -> tuple[torch.Tensor, int, bool]:
        """Select and check whether the selection is complete and certified enough."""
        t0 = time.perf_counter()
        Q, count, _, idx = self._select()
        self.match = match.sparsity_match(Q, self.system) if count == self.B else None
        self.trusted = Q[:, :count]
        if self.row_noise is not None:  # under noise no pattern matches on every unit
            self.trusted = self.trusted[:, self.pool_score[idx] >= NOISY_TRUST * self.min_zeros]
        elif self.match is not None:  # with a full basis, trust the columns whose patterns match
            self.trusted = Q[:, self.match.per_column >= self.dec.L.shape[0]]
        self._tick("select", t0)
        if self.match is None and 0 < count < self.B:
            self.trusted = self.trusted[:, self._feasible(self.trusted)]
        noisy_partial = self.row_noise is not None and count < self.B
        self.deflated = Q[:, :count] if noisy_partial else self.trusted
        done = count == self.B and (self.match is None or self.match.value >= self.lambda_stop)
        if self.row_noise is not None:  # λ ≥ 0.98 held for a basis with 22 of 150 wrong
            done = done and self.trusted.shape[1] == self.B
        return Q, count, done

    def _completions(self, Q: torch.Tensor, count: int,
                     done: bool) -> tuple[torch.Tensor, int, bool]:
        """Complete from the trusted columns while each completion may enable the next; the
        selection state (``_done``'s result) after the last one. With a peeler, the trusted
        columns' samples are then peeled off (``self.peeled``), or earlier, once half a batch
        of new trusted columns is there (:data:`PEEL_SHARE`)."""
        while (not done and self.trusted is not None and not self._out_of_time()
               and self._complete(self.trusted)):
            Q, count, done = self._done()
            late = passed(self._time_limit(PEEL_TIME_SHARE))
            min_new = max(1, self.B // 10 if late else int(PEEL_SHARE * self.B))
            if not done and self._peel(min_new=min_new):
                return Q, count, done
        if not done:
            self._peel(deadline=self.finish_deadline)
        return Q, count, done

    def find(self) -> tuple[torch.Tensor, int]:
        """Search until B directions with λ ≥ the stop level, the round cap or the time budget."""
        spear = self.cfg.method == "spear"
        max_rounds = self.cfg.round_cap(self.B)
        max_rounds = max_rounds if not spear else 1 << 62
        self.completed: dict[tuple[int, int, int], int] = {}  # completion calls per found set
        last, stale = None, 0
        if not spear and self.cfg.slice_first:
            # complete from nothing (the empty pool selects no column): the slice of all B
            # samples (completion.sample_missing)
            Q, count, done = self._completions(*self._done())
            if self.cfg.progress:
                print(f"[fl_attack] slice sampling before the search: {count}/{self.B} "
                      f"directions", flush=True)
            if done:
                self.exhausted = self._out_of_time()
                return self._finish()
            if self.peeled is not None:
                return Q, count
        for _ in range(max_rounds):
            self.rounds += 1
            if spear:
                self._round_spear()
            else:
                self._round_spearpp()
            Q, count, done = self._completions(*self._done())
            if self.cfg.progress:
                lam = f"{self.match.value:.4f}" if self.match else "-"
                trusted = self.trusted.shape[1] if self.trusted is not None else 0
                print(f"[fl_attack] {time.perf_counter() - self.start:.1f}s: round {self.rounds}: "
                      f"{self.n_candidates} candidates, "
                      f"{count}/{self.B} directions ({trusted} trusted), λ={lam}", flush=True)
            # a full basis whose pool no round changes any more: λ < 1 is final (λ forgives a
            # few chance zeros at active units, match.sparsity_match, but not every true basis
            # reaches 1: e.g. a sample with a tiny loss gradient has a column at the noise level)
            if self.peeled is not None:
                return Q, count
            state = (self.n_candidates, count, self.match.value if self.match else None)
            stale, last = (stale + 1 if state == last else 0), state
            if (done or self._out_of_time() or (spear and self.samples >= self.cfg.max_samples)
                    or (not spear and count == self.B and stale >= STALE_ROUNDS)):
                break
            if (not spear and self.cfg.polish and self.rounds == 1 and self.n_candidates
                    and not self._out_of_time()):
                t0 = time.perf_counter()
                limit = self._from_now(NEIGHBOUR_SHARE)  # half of it for the seeds
                seeds = faces.conditional_directions(
                    self.dec.L, self.pool, zero_rtol=self.system.zero_rtol,
                    generator=self.generator, deadline=self._from_now(NEIGHBOUR_SHARE / 2))
                self._split_faces(seeds, self._n_rows(), deadline=limit)
                self._tick("neighbours", t0)
        self.exhausted = self._out_of_time()
        return self._finish()

    def _peel(self, min_new: int = 1, deadline: float | None = None) -> bool:
        """Recover the trusted columns' samples not tried yet (when at least ``min_new``,
        before ``deadline``, by default the search's); True when some were verified
        (``self.peeled``), so that the caller peels them off."""
        if self.peeler is None or self.trusted is None or self._out_of_time(deadline):
            return False
        zero = columns.zero_mask(self.dec.L @ self.trusted, self.system.zero_rtol).cpu()
        keys = [zero[:, j].numpy().tobytes() for j in range(zero.shape[1])]
        todo = [j for j, key in enumerate(keys) if key not in self.peel_tried]
        if len(todo) < min_new:
            return False
        t0 = time.perf_counter()
        self.peel_tried.update(keys[j] for j in todo)
        peeled = self.peeler(self.trusted[:, todo], deadline if deadline is not None
                             else self.deadline)
        self._tick("peel", t0)
        if not bool(peeled.verified.any()):
            return False
        self.peeled = peeled
        return True

    def _finish(self) -> tuple[torch.Tensor, int]:
        """Final selection (stage 2 swaps), the repair of 1-3 mismatching columns and, under
        noise, the found columns re-estimated from all their zero rows (``polish.noisy_refit``)."""
        t0 = time.perf_counter()
        Q, count, spare, _ = self._select()
        if self.cfg.greedy and self.system.WR is not None:
            Q, self.match, self.swaps = select.greedy_swaps(
                Q, spare, self.system, max_swaps=self.cfg.max_swaps,
                positions=self.cfg.swap_positions, deadline=self.finish_deadline,
            )
        else:
            self.match = match.sparsity_match(Q, self.system)
        self._tick("select", t0)
        if count == self.B and self.match is not None and self.match.value < 1.0:
            Q = self._repair(Q)
        if self.row_noise is not None and count:  # each found column from all its zero rows
            t0 = time.perf_counter()
            Q = Q.clone()
            Q[:, :count] = polish.noisy_refit(self.dec.L, Q[:, :count], self.row_noise)
            if self.match is not None:
                self.match = match.sparsity_match(Q, self.system)
            self._tick("refit", t0)
        self.exhausted = self.exhausted or self._out_of_time(self.finish_deadline)
        return Q, count

    def _repair(self, Q: torch.Tensor) -> torch.Tensor:
        """Replace the 1-3 columns whose patterns mismatch by the exact completion.

        Mixing up two samples of a face corrupts only those two reconstructions (every other
        row of Q⁻¹ is orthogonal to their span), so the mismatching columns are the wrong ones.
        """
        assert self.match is not None
        m = self.dec.L.shape[0]
        bad = torch.nonzero(self.match.per_column < m).squeeze(1)
        if bad.numel() not in (1, 2, 3) or not self.cfg.polish:
            return Q
        t0 = time.perf_counter()
        good = torch.ones(self.B, dtype=torch.bool, device=Q.device)
        good[bad] = False
        deadline = self.finish_deadline
        Qc = self._missing_candidates(Q[:, good], sampled=self.system.subset, deadline=deadline)
        best_Q, best = Q, self.match
        if Qc.shape[1]:
            Qc, zeros, _, _ = polish.polish(self.dec.L, Qc, n_rows=self._n_rows(),
                                            zero_rtol=self.system.zero_rtol)
            # no leverage cut here: every trial basis must raise λ to be kept, and a true
            # column can have a leverage above max_leverage (measured 0.9925 at (30, 200),
            # a sample whose 96 zero rows share 93 with another's: cut, it was never found)
            keep = zeros >= self.min_zeros
            Qc, zeros = Qc[:, keep], zeros[keep]
            Qc = Qc[:, torch.argsort(zeros, descending=True, stable=True)]
            r = bad.numel()
            # the sparsest candidates; C(24, 3) = 2024 trials for three columns
            Qc = Qc[:, columns.dedupe(Qc, self.cfg.dedupe_tol)][:, :64 if r < 3 else 24]
            combos = (torch.arange(Qc.shape[1])[:, None] if r == 1
                      else torch.combinations(torch.arange(Qc.shape[1]), r))
            for combo in combos.tolist():
                if self._out_of_time(deadline):
                    break
                trial = torch.cat([Q[:, good], Qc[:, combo]], dim=1)
                if torch.linalg.matrix_rank(trial) < self.B:
                    continue
                got = match.sparsity_match(trial, self.system)
                if got is not None and got.value > best.value:
                    best_Q, best = trial, got
        self.match = best
        self._tick("repair", t0)
        return best_Q
