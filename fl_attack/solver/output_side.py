"""The output side of the attack (∂L/∂Z sparse, any layer followed by a ReLU), level by level.

One level decomposes the gradient (SPEAR §3.1, SPEAR++ §4.1), builds the search's context and
runs the search loop (:mod:`fl_attack.solver.loop`). With the next layer's gradient, the
samples read through it are peeled off (:mod:`fl_attack.steps.peel`, beyond the papers) and the
smaller batch that is left is solved the same way, starting from the upper level's candidates:
the levels below. The final basis (every level's columns) is judged on the whole gradient.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from dataclasses import dataclass

import torch

from fl_attack.config import AttackConfig
from fl_attack.core.clock import Clock
from fl_attack.core.columns import normalize_columns, zero_mask
from fl_attack.result import Reconstruction, build_reconstruction
from fl_attack.solver import candidates, certify, loop, unproven
from fl_attack.solver.pool import CandidatePool
from fl_attack.solver.state import (
    SearchContext,
    SearchState,
    relaxed,
    search_context,
    system_has_weights,
)
from fl_attack.solver.untangle import untangle
from fl_attack.steps import batch_size, peel
from fl_attack.steps.decompose import Decomposition, decompose
from fl_attack.steps.match import Match, sparsity_match
from fl_attack.steps.peel import Peeled
from fl_attack.steps.scale import make_system, reconstruct
from fl_attack.steps.tolerances import exact_possible, output_tolerances, rank_floor
from fl_attack.validation import LayerUpdate


def invert_output(layer: LayerUpdate, cfg: AttackConfig, seed: int, clock: Clock,
                  dec: Decomposition | None = None) -> Reconstruction:
    """``sparse="output"``: recover the layer's inputs from the sparse columns of ∂L/∂Z.

    Under noise the spectrum may allow two batch sizes (``Decomposition.readings``: the
    singular values clear of the noise, and those merely above its edge, or fewer than an
    explicit ``batch_size``); each is attacked with its share of the budget and the reading
    whose reconstruction explains the update best is kept
    (:func:`fl_attack.steps.batch_size.choose`).
    A result with fewer samples than an explicit ``batch_size`` says how many the update did
    not separate (``Reconstruction.merged``).

    Parameters
    ----------
    layer
        The validated update (``validation.load_layer``).
    cfg
        The attack's options.
    seed
        Seeds the search's random generator.
    clock
        The call's budget and timings.
    dec
        The decomposition of ``layer.weight_grad``, when the caller already has it.

    Returns
    -------
    Reconstruction
        ``inputs`` (B, n); certified (``exact``) when λ = 1 with all B directions and no noise.

    Raises
    ------
    ValueError
        When the gradient's rank does not identify a batch (``decompose.decompose``).
    """
    if dec is None:
        t0 = time.perf_counter()
        dec = decompose(layer.weight_grad, batch_size=cfg.batch_size,
                        rank_margin=cfg.rank_margin, floor_rtol=rank_floor(layer.precision),
                        noise_floor=layer.rounding_edge)
        clock.tick("decompose", t0)
    values = dec.readings()
    if len(values) == 1:
        rec = _invert_at(layer, cfg, seed, clock, dec)
    else:
        recs = []
        for i, B in enumerate(values):
            left = None if clock.max_seconds is None else max(
                clock.max_seconds - clock.elapsed(), 0.0) / (len(values) - i)
            sub = Clock(left, timings=clock.timings)
            recs.append(_invert_at(layer, cfg, seed, sub, dec.at(B)))
        rec = batch_size.choose(recs, layer, clock)
    if cfg.batch_size is not None and rec.batch_size < cfg.batch_size:
        rec.merged = cfg.batch_size - rec.batch_size
        rec.exact = False  # the merged samples are read only as one another
    return rec


def _invert_at(layer: LayerUpdate, cfg: AttackConfig, seed: int, clock: Clock,
               dec: Decomposition) -> Reconstruction:
    """:func:`invert_output` at one reading of the batch size (``dec``)."""
    generator = torch.Generator().manual_seed(seed)
    found = solve(layer.weight_grad, layer.bias_grad, layer, cfg, generator, clock, dec=dec)
    ctx, state = found.ctx, found.state
    if found.peeled:  # the columns of every level, in this level's coordinates
        Q = normalize_columns(ctx.L.T @ found.columns)
        state.match = sparsity_match(Q, ctx.system)
    else:
        Q = found.Q
    got = _settle(layer, found, Q, clock)
    X, rows = _verified_rows(got.X, Q, _known(ctx, state, found), read=not got.proven)
    lam = _with_evidence(state.match, _found_mask(found), ctx.system.subset)
    errors = unproven.sample_errors(ctx.dec, got.Q, got.s, got.X)
    bound = ctx.tuning.noisy_ratio
    held = [i for i in range(ctx.B) if i not in rows]
    spectrum = exact_possible(ctx.dec)
    precise = spectrum and bool((errors[held] <= bound).all())
    rec = build_reconstruction(
        X, cfg=cfg, clock=clock, batch_size=ctx.B, n_found=found.n_found,
        sparsity_match=lam.value if lam is not None else None,
        per_column=lam.per_column if lam is not None else None,
        units=layer.weight_grad.shape[0],
        chance_zeros=lam.chance_zeros if lam is not None else 0, noisy=ctx.noisy,
        precise=precise,
        noise_std=ctx.dec.noise_std, scales=got.s, rounds=found.rounds,
        n_candidates=found.n_candidates, swaps=found.swaps, exhausted=found.exhausted,
        peeled=found.peeled, stopped=found.stopped, supported=got.proven, mixed=got.mixed,
        untangled=got.untangled,
    )
    rec.verified = rows
    rec.sample_errors = errors
    if not rec.exact:
        rec.unproven = unproven.reasons(
            batch_size=ctx.B, errors=errors, bound=bound, noisy=ctx.noisy,
            fedavg=ctx.system.subset, found=_found_mask(found), pinned=got.pinned, mixed=got.mixed,
            per_column=rec.column_match, verified=rows, weak_spectrum=not spectrum,
            weights=system_has_weights(ctx))
    return rec


@dataclass
class _Known:
    """Samples read on their own through the next layer, in the top level's coordinates."""

    columns: torch.Tensor
    """(B, F) their ∂L/∂Z columns."""
    inputs: torch.Tensor
    """(F, n) their inputs."""
    proven: torch.Tensor
    """(F,) bool: verified (``peel.RESIDUAL_RTOL``), else only read (``peel.READ_RTOL``)."""


def _known(ctx: SearchContext, state: SearchState, found: _Found) -> _Known | None:
    """The samples the top level kept (``state.verified``) and those every level peeled."""
    parts = []
    got = state.verified
    if got is not None and got.inputs.shape[0]:
        parts.append((got.columns, got.inputs, got.proven_mask()))
    for cols, inputs, proven in found.samples:  # ∂L/∂Z directions: L is orthonormal
        parts.append((ctx.L.T @ cols.to(ctx.L), inputs, proven))
    if not parts:
        return None
    columns, inputs, proven = zip(*parts, strict=True)
    dev = columns[0].device
    return _Known(torch.cat([c.to(dev) for c in columns], dim=1),
                  torch.cat([x.to(dev) for x in inputs]),
                  torch.cat([p.to(dev) for p in proven]))


def _verified_rows(X: torch.Tensor, Q: torch.Tensor, known: _Known | None, *, read: bool
                   ) -> tuple[torch.Tensor, tuple[int, ...]]:
    """X with the rows of the basis' columns that match a verified sample (``known``, within
    10⁻⁶ in angle) replaced by that sample's input, and those rows; with ``read`` (a basis
    that is not proven) also the rows of samples only read (``peel.READ_RTOL``), which are
    not among the rows returned."""
    if known is None:
        return X, ()
    use = torch.ones_like(known.proven) if read else known.proven
    if not bool(use.any()):
        return X, ()
    columns, inputs, proven = known.columns[:, use], known.inputs[use], known.proven[use]
    Qn = normalize_columns(Q.to(columns))
    cos = (Qn.T @ normalize_columns(columns)).abs()  # (B, F)
    best, row = cos.max(dim=0)
    keep = torch.nonzero(best > 1 - 1e-6).squeeze(1).tolist()
    if not keep:
        return X, ()
    X = X.clone()
    rows = [int(row[k]) for k in keep]
    X[rows] = inputs[keep].to(X)
    return X, tuple(sorted({r for r, k in zip(rows, keep, strict=True) if bool(proven[k])}))


@dataclass
class _Settled:
    """The final basis as the certificate judges it, and its inputs."""

    X: torch.Tensor
    """(B, n) the inputs."""
    s: torch.Tensor
    """(B,) the scales."""
    proven: bool
    """Every column pinned, or its sample read through the next layer."""
    mixed: tuple[tuple[int, ...], ...]
    """The groups still read only up to a mixture."""
    untangled: int
    Q: torch.Tensor
    """(B, B) the basis as judged (columns settled on their zero rows)."""
    pinned: torch.Tensor | None = None
    """(B,) bool, the columns their zero rows prove or that were read through the next
    layer (``certify.Pinning.pinned``); None when the basis was not judged."""


def _settle(layer: LayerUpdate, found: _Found, Q: torch.Tensor, clock: Clock) -> _Settled:
    """Steps 13 and 10b: settle and judge a full clean basis (``certify.prove``; a FedAvg
    basis is only judged, and never proven), reconstruct, and read the groups the certificate
    names through the next layer (``untangle``). Sets the state's match to the final basis'."""
    ctx, state = found.ctx, found.state
    pins = None
    if found.n_found == ctx.B and not ctx.noisy:
        t0 = time.perf_counter()
        if ctx.system.subset:
            pins = certify.pinning(ctx, Q, state.match)
        else:
            proof = certify.prove(ctx, Q)
            Q, state.match, pins = proof.Q, proof.lam, proof.pinning
        clock.tick("certify", t0)
    t0 = time.perf_counter()
    X, s = reconstruct(Q, ctx.system)
    clock.tick("reconstruct", t0)
    if pins is None:
        return _Settled(X, s, False, (), 0, Q)
    proven = pins.all and not ctx.system.subset
    mixed, untangled, pinned = pins.groups, 0, pins.pinned
    if mixed and found.rows2 is not None and not ctx.system.subset:
        t0 = time.perf_counter()
        read = untangle(ctx, Q, X, mixed, found.rows2, layer.precision, clock.finish_deadline)
        clock.tick("untangle", t0)
        if read.groups:
            X = X.clone()
            X[list(read.columns)] = read.inputs.to(X)
            mixed = tuple(g for g in mixed if g not in read.groups)
            untangled = len(read.columns)
            loose = torch.nonzero(~pins.pinned).squeeze(1).tolist()
            proven = set(loose) <= set(read.columns)
            pinned = pinned.clone()
            pinned[list(read.columns)] = True
    return _Settled(X, s, proven, mixed, untangled, Q, pinned)


@dataclass
class _Found:
    """The columns of one level of the search, with the levels peeled below it."""

    ctx: SearchContext
    state: SearchState
    Q: torch.Tensor
    """(B, B) this level's selected columns (without peeling)."""
    n_found: int
    columns: torch.Tensor | None = None
    """(m, B) every level's columns as ∂L/∂Z directions, when samples were peeled."""
    peeled: int = 0
    rounds: int = 0
    n_candidates: int = 0
    swaps: int = 0
    exhausted: bool = False
    stopped: str = ""
    """Why this level's search ended (``SearchState.stopped``; with peeling, the last level's,
    or ``"budget"`` when a level ran out of time)."""
    rows2: torch.Tensor | None = None
    """(B, m) the next layer's activation span (``peel.next_layer_rows``), when given."""
    found: torch.Tensor | None = None
    """(B,) bool, the columns the search found (the others were completed); None: the first
    ``n_found``."""
    samples: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = dataclasses.field(
        default_factory=list)
    """The peeled samples of every level: their ∂L/∂Z columns (m, F), inputs (F, n) and
    which are verified (F,) bool."""


def _with_evidence(lam: Match | None, found: torch.Tensor, subset: bool) -> Match | None:
    """λ of a FedAvg sum (``subset``) with its completed columns counted as unmatched.

    A FedAvg sum's λ tests only that a column's zero rows are inactive units; a completed
    column (the search did not find it; ``found`` is False) is dense, has no zero row and so
    would pass vacuously: λ = 1 with no direction found. It carries no evidence, so its
    entries count as mismatches. A single step's λ also tests the non-zero rows and needs
    nothing of the kind.
    """
    if lam is None or not subset or bool(found.all()):
        return lam
    kept = torch.where(found.to(lam.per_column.device), lam.per_column,
                       torch.zeros_like(lam.per_column))
    total = float(lam.per_column.sum())
    value = lam.value * float(kept.sum()) / total if total > 0 else 0.0
    return dataclasses.replace(lam, value=value, per_column=kept)


def _found_mask(found: _Found) -> torch.Tensor:
    """(B,) bool on the CPU: the columns of ``found`` that the search found."""
    if found.found is not None:
        return found.found.cpu()
    return torch.arange(found.ctx.B) < found.n_found


def solve(G: torch.Tensor, g: torch.Tensor, layer: LayerUpdate, cfg: AttackConfig,
          generator: torch.Generator, clock: Clock, *, dec: Decomposition,
          rows2: torch.Tensor | None = None, seeds: torch.Tensor | None = None) -> _Found:
    """Search the columns of (G, g); with the next layer, peel the samples read through it off
    and solve the smaller batch that is left the same way (recursively).

    Parameters
    ----------
    G : (m, n), g : (m,)
        This level's gradient (the layer's, less the samples peeled above).
    layer
        The layer (weight, bias, next layer's gradient, precision, device).
    dec
        This level's decomposition: the gradient's (``invert_output``, at one batch-size
        reading) or, below the first level, the one the level above derived (``peel.reduced``).
    rows2 : (r, m), optional
        The next layer's activation span (computed at the first level; r = B unless the
        next layer's rank reading differs). On a clean gradient with the layer's weight and
        bias, the search adds activation rounds in it (``candidates.activation_round``).
    seeds : (m, P), optional
        The upper level's candidates as ∂L/∂Z directions; those in this level's column space
        start its pool.
    """
    zero_rtol, z_band = output_tolerances(dec, cfg, layer.precision, layer.device)
    system = make_system(dec.L, dec.R, g, layer.weight, layer.bias, zero_rtol, z_band,
                         subset=cfg.update == "fedavg")
    ctx = search_context(cfg, dec, system, generator, layer.device, clock)
    state = SearchState()
    B = dec.batch_size
    rows2 = _next_layer(ctx, state, layer, rows2)
    if (rows2 is not None and cfg.update == "gradient" and not ctx.noisy
            and system_has_weights(ctx)):
        ctx = dataclasses.replace(ctx, activation_span=rows2.T)
    pool = CandidatePool(ctx)
    if seeds is not None and B > 1:
        pool.seed(seeds)
    if B == 1:  # one sample: G = d xᵀ, nothing to disentangle
        Q = torch.ones(1, 1, dtype=torch.float64, device=layer.device)
        state.match = sparsity_match(Q, system)
        return _Found(ctx, state, Q, 1, stopped="single")
    while True:
        ctx, pool, Q, n_found = _search(ctx, state, pool)
        here = _Found(ctx, state, Q, n_found, rounds=state.rounds, n_candidates=len(pool),
                      swaps=state.swaps, exhausted=state.exhausted, stopped=state.stopped,
                      rows2=rows2)
        peeled, state.peeled = state.peeled, None
        if peeled is None:
            return here
        t0 = time.perf_counter()
        taken, sub_dec = _peelable(dec, peeled)
        clock.tick("peel", t0)
        if taken is None:
            n = peeled.coords.shape[0]
            loop.progress(ctx, "%.1fs: peeling %d samples would not leave a clean rank %d: the "
                          "search goes on without peeling (their rows keep the verified "
                          "inputs)", clock.elapsed(), n, B - n)
            state.peeler = None
            candidates.keep_verified(state, peeled, pool)
            continue
        if taken.coords.shape[0] < peeled.coords.shape[0]:  # the read ones are kept instead
            candidates.keep_verified(state, peeled.take(~peeled.proven_mask()), pool)
        F = taken.coords.shape[0]
        Gr, gr = peel.peel_off(G, g, dec.L, taken)
        proven = taken.proven_mask()
        loop.progress(ctx, "%.1fs: peeled %d samples through the next layer (%d verified, %d "
                      "read), %d left", clock.elapsed(), F, int(proven.sum()),
                      F - int(proven.sum()), B - F)
        here.columns, here.peeled, here.n_found = dec.L @ taken.columns, F, F
        here.found = torch.ones(F, dtype=torch.bool)
        here.samples.append((here.columns, taken.inputs, proven))
        if sub_dec is not None:
            sub_cfg = (cfg if cfg.batch_size is None
                       else dataclasses.replace(cfg, batch_size=B - F))
            sub = solve(Gr, gr, layer, sub_cfg, generator, clock, rows2=rows2, dec=sub_dec,
                        seeds=dec.L.to(pool.columns) @ pool.columns)
            _merge(here, sub)
        return here


def _peelable(dec: Decomposition, peeled: Peeled
              ) -> tuple[Peeled | None, Decomposition | None]:
    """The samples to peel off and the decomposition of the batch left (None when none is
    left): all of ``peeled`` when the rest keeps a clean rank, else only its verified ones
    (a read sample's residual error can blur the cliff), else (None, None)."""
    B = dec.batch_size
    tries, proven = [peeled], peeled.proven_mask()
    if bool(proven.any()) and not bool(proven.all()):
        tries.append(peeled.take(proven))
    for got in tries:
        if got.coords.shape[0] == B:
            return got, None
        sub = peel.reduced(dec, got)
        if sub is not None:
            return got, sub
    return None, None


def _search(ctx: SearchContext, state: SearchState, pool: CandidatePool
            ) -> tuple[SearchContext, CandidatePool, torch.Tensor, int]:
    """``loop.search``, then, when a clean search ends without its B columns (at the round
    cap, or starved) with budget left, a second pass with a lower zero threshold
    (``state.relaxed``: a trained model's columns keep fewer zeros than the papers' threshold
    asks), its pool seeded with the first's; an explicit ``AttackConfig.max_rounds`` caps
    both passes together. Under a time budget, a pass that ends at the round cap without its
    B columns but with more than the one before it (columns selected, samples read through
    the next layer, or λ) is followed by another, until one gains nothing. Returns the
    context and pool of the last pass, the basis and the columns found."""
    Q, n_found = loop.search(ctx, state, pool)
    cap = ctx.cfg.max_rounds
    if (state.peeled is not None or state.stopped not in ("rounds", "starved")
            or n_found == ctx.B or ctx.clock.expired()
            or (cap is not None and state.rounds >= cap)):
        return ctx, pool, Q, n_found
    low = relaxed(ctx)
    if low is None:
        return ctx, pool, Q, n_found
    loop.progress(ctx, "%.1fs: %d/%d directions; the search goes on with columns of %d zeros "
                  "or more (was %d)", ctx.clock.elapsed(), n_found, ctx.B, low.min_zeros,
                  ctx.min_zeros)
    wide = CandidatePool(low)
    wide.add(pool.columns, zero_mask(ctx.L @ pool.columns.to(ctx.L), ctx.zero_rtol).sum(dim=0))
    before = _gains(state, n_found)
    Q, n_found = loop.search(low, state, wide)
    while (state.peeled is None and state.stopped == "rounds" and n_found < low.B
           and cap is None and low.clock.deadline is not None and not low.clock.expired()):
        now = _gains(state, n_found)
        if not any(a > b for a, b in zip(now, before, strict=True)):
            break
        before = now
        loop.progress(low, "%.1fs: %d/%d directions at the round cap, more than the pass "
                      "before: the search goes on", low.clock.elapsed(), n_found, low.B)
        Q, n_found = loop.search(low, state, wide)
    return low, wide, Q, n_found


def _gains(state: SearchState, n_found: int) -> tuple[int, int, float]:
    """What a search pass can gain: columns selected, samples read through the next layer
    (kept in ``state.verified``; peeled ones end the pass), and λ."""
    known = 0 if state.verified is None else state.verified.coords.shape[0]
    return n_found, known, state.match.value if state.match is not None else -1.0


def _next_layer(ctx: SearchContext, state: SearchState, layer: LayerUpdate,
                rows2: torch.Tensor | None) -> torch.Tensor | None:
    """The next layer's activation span (computed once, at the first level) and the peeler
    that uses it; nothing on noisy updates or without a next layer.

    The span is read at rank B, above the next layer's stored weights' rounding for a weight
    difference (``LayerUpdate.next_rounding_edge``); where its own rank reading differs (a trained
    model's weakest samples fall below float32 rounding at a different rank in each layer),
    at that reading: each peeled sample is verified on its own, so a span missing the
    weakest samples' activations still peels the others."""
    B = ctx.B
    if layer.next_weight_grad is not None and rows2 is None and not ctx.noisy and B > 1:
        t0 = time.perf_counter()
        rows2 = peel.next_layer_rows(layer.next_weight_grad, B, rank_floor(layer.precision),
                                     ctx.generator, any_rank=True,
                                     noise_floor=layer.next_rounding_edge)
        ctx.clock.tick("peel", t0)
        if rows2 is None:
            hint = ("" if layer.rounding_edge == 0 or layer.next_rounding_edge > 0 else
                    " (a weight difference: pass next_weight= for its stored weights' rounding)")
            warnings.warn(f"next_weight_grad has no rank reading: samples are not peeled{hint}",
                          stacklevel=5)
    if rows2 is not None and not ctx.noisy:
        dec, system, found_rows = ctx.dec, ctx.system, rows2
        assert system.WR is not None and system.bias is not None
        state.peeler = state.recover = lambda cols, deadline, zeros=None: peel.recover(
            cols, dec.L, dec.R, found_rows, system.WR, system.bias, zero_rtol=system.zero_rtol,
            z_band=system.z_band, precision=layer.precision, deadline=deadline, zeros=zeros)
    return rows2


def _merge(here: _Found, sub: _Found) -> None:
    """Add a lower level's columns and counters to this level's."""
    assert here.columns is not None
    sub_cols = sub.columns if sub.columns is not None else sub.ctx.L @ sub.Q
    here.columns = torch.cat([here.columns, sub_cols], dim=1)
    assert here.found is not None
    here.found = torch.cat([here.found, _found_mask(sub)])
    here.peeled += sub.peeled
    here.samples += sub.samples
    here.n_found += sub.n_found
    here.rounds += sub.rounds
    here.n_candidates += sub.n_candidates
    here.swaps += sub.swaps
    here.exhausted = here.exhausted or sub.exhausted
    here.stopped = "budget" if "budget" in (here.stopped, sub.stopped) else sub.stopped
