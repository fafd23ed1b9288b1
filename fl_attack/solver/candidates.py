"""The steps that produce candidates: one SPEAR++ round, one SPEAR round, face splitting, the
neighbour search and the completion of missing columns. Each adds what it finds to the pool.

Every step is a function of the search's context (read only), its state and its pool
(:mod:`fl_attack.solver.state`, :mod:`fl_attack.solver.pool`), and looks at the budget
(``ctx.clock``) between units of work.
"""

from __future__ import annotations

import logging
import time

import torch

from fl_attack.core.columns import dedupe, normalize_columns, pattern_keys, zero_mask
from fl_attack.solver.pool import CandidatePool
from fl_attack.solver.state import SearchContext, SearchState
from fl_attack.steps import activations, completion, faces, polish, sampling, search
from fl_attack.steps.peel import Peeled

log = logging.getLogger("fl_attack")


def spearpp_round(ctx: SearchContext, state: SearchState, pool: CandidatePool) -> None:
    """One SPEAR++ round (SPEAR++ §4.2, §4.4): optimise K random starts of φ(L q) on the sphere
    as one batch, round them to exact kernels, split the faces they reveal.

    Once columns are trusted, the starts lie in the complement of the deflated columns
    (``cfg.deflate``), where the missing columns' basins are. On wide layers every second
    round uses the other optimiser, and later rounds add IRLS rounding
    (``AttackConfig.wide_layer_search``).

    Parameters
    ----------
    ctx, state, pool
        The search; the round's candidates go to the pool, faces seen to the state.
    """
    cfg, B, clock = ctx.cfg, ctx.B, ctx.clock
    dtype = torch.float32 if cfg.search_dtype == "float32" else torch.float64
    t0 = time.perf_counter()
    use = cfg.deflate and ctx.complement_restarts and state.trusted is not None
    trusted = state.deflated if use else None
    deflate = trusted is not None and 0 < trusted.shape[1] < B
    sought = B - trusted.shape[1] if deflate and trusted is not None else B
    N = verified_complement(state, B)
    if N is not None:  # the missing columns lie in N's span: search there, from anywhere
        sought, deflate = N.shape[1], True
    K = cfg.n_init or max(ctx.tuning.starts_floor, ctx.tuning.starts_per_column * sought)
    if N is not None:
        init = search.random_sphere(K, N.shape[1], generator=ctx.generator, dtype=dtype,
                                    device=ctx.device)
    elif deflate:
        assert trusted is not None
        init = search.random_complement(trusted, K, generator=ctx.generator, dtype=dtype,
                                        device=ctx.device)
    else:
        init = search.random_sphere(K, B, generator=ctx.generator, dtype=dtype,
                                    device=ctx.device)
    optimizer = cfg.optimizer
    alternate, irls = cfg.wide_layer_search(ctx.L.shape[0])
    if alternate and state.rounds % 2 == 0:  # the other optimiser finds other minima
        optimizer = "pgd" if optimizer == "radam" else "radam"
    lr = cfg.lr if optimizer == cfg.optimizer else None
    L_search = ctx.L if N is None else ctx.L @ N.to(ctx.L)
    Qopt = search.optimise_on_sphere(
        L_search.to(dtype), init, loss=cfg.loss, optimizer=optimizer, steps=cfg.steps, lr=lr,
        milestones=cfg.lr_milestones, gamma=cfg.lr_gamma, alpha=cfg.logcosh_alpha,
        objective=ctx.objective(), deadline=clock.deadline,
    )
    if N is not None:
        Qopt = N.to(Qopt) @ Qopt
    Qopt = normalize_columns(Qopt.double())
    Qopt = Qopt[:, dedupe(Qopt, ctx.tuning.minima_dedupe)]  # most starts share a few minima
    clock.tick("search", t0)
    t0 = time.perf_counter()
    if cfg.polish and irls and deflate and not clock.expired():
        pick = _sparsest(ctx.L, Qopt, ctx.tuning.irls_per_column * sought)
        Qopt = torch.cat([Qopt, polish.irls_round(ctx.L, Qopt[:, pick], deadline=clock.deadline)],
                         dim=1)
        clock.tick("irls", t0)
        t0 = time.perf_counter()
    if not cfg.polish:
        Qp = Qopt.double()
        zeros = zero_mask(ctx.L @ Qp, ctx.zero_rtol).sum(dim=0)
        clock.tick("polish", t0)
        pool.add(Qp, zeros)
        return
    n_rows = ctx.n_rows()
    Qp, zeros, face_dim, lev = polish_within_budget(ctx, Qopt, n_rows)
    Qopt = Qopt[:, :Qp.shape[1]]
    pool.add(Qp, zeros, lev)
    sparse_vertex = (face_dim == 1) & (zeros >= ctx.min_zeros)
    if N is not None:
        verify_sparsest(ctx, state, pool, Qp[:, sparse_vertex], limit=2 * N.shape[1])
    in_face = torch.nonzero(face_dim > 1).squeeze(1)
    vertices = torch.nonzero(sparse_vertex & (lev >= cfg.max_leverage)).squeeze(1)
    clock.tick("polish", t0)
    t0 = time.perf_counter()
    split_faces(ctx, state, pool, Qopt.double()[:, in_face], n_rows)
    split_faces(ctx, state, pool, Qp[:, vertices], n_rows, vertex=True)
    clock.tick("faces", t0)


def _sparsest(L: torch.Tensor, Q: torch.Tensor, count: int) -> torch.Tensor:
    """Indices of the ``count`` directions of ``Q`` (B, K) whose ``L q`` has the lowest
    ℓ1/ℓ2 ratio, sparsest first: those IRLS turns into columns.

    The columns IRLS finds come from the optimiser's sparsest minima: in five rounds on two
    batches at B = 100, m = 1000 (MNIST, ``greys32``) every direction IRLS turned into a new
    column ranked among the 28 sparsest of 630-1637 (``experiments/results/tuning.md``).
    """
    if Q.shape[1] <= count:
        return torch.arange(Q.shape[1], device=Q.device)
    V = L.to(Q) @ Q
    ratio = V.abs().sum(dim=0) / V.norm(dim=0).clamp_min(torch.finfo(V.dtype).tiny)
    return ratio.topk(count, largest=False).indices


def activation_round(ctx: SearchContext, state: SearchState, pool: CandidatePool) -> None:
    """One activation round (:mod:`fl_attack.steps.activations`): descents from the rows of G
    and Gaussian starts to points of the row space whose activations lie in the next layer's
    activation span. The kernels of L on each point's inactive units are polished and pooled;
    the exact ones (``activations.consistent_columns``) join ``state.activation_found``, and
    the next descent searches outside them and the trusted columns, for the samples still
    missing. Up to ``Tuning.activation_descents`` descents, while each finds new columns.

    Parameters
    ----------
    ctx, state, pool
        The search (``ctx.activation_span`` and the layer's weight and bias are set); the
        round's candidates go to the pool.
    """
    span, system, clock, tuning, L = (ctx.activation_span, ctx.system, ctx.clock, ctx.tuning,
                                      ctx.L)
    assert span is not None and system.WR is not None and system.bias is not None
    frame = activations.row_frame(system.R, system.WR)
    for _ in range(tuning.activation_descents):
        t0 = time.perf_counter()
        known = [c for c in (state.activation_found, state.deflated) if c is not None]
        P0 = activations.starts(L, system.t, frame, min(tuning.activation_starts, L.shape[0]),
                                generator=ctx.generator)
        P, _ = activations.consistent_points(
            frame, system.bias, span.to(P0.device), P0,
            found=torch.cat(known, dim=1) if known else None, steps=tuning.activation_steps,
            lr=tuning.activation_lr, deadline=clock.deadline)
        Q, inactive = activations.columns_of_points(L, frame, system.bias, P)
        keep = dedupe(Q, tuning.minima_dedupe)
        Q, inactive = Q[:, keep], inactive[:, keep]
        ok = activations.consistent_columns(L, Q, inactive, ctx.zero_rtol)
        exact, points = Q[:, ok], P[keep][ok]
        fresh = _new_columns(exact, state.activation_found, ctx.span_tol)
        new = exact[:, fresh]
        if new.shape[1]:
            state.activation_found = (new if state.activation_found is None
                                      else torch.cat([state.activation_found, new], dim=1))
            snapped = activations.snap_points(frame, system.bias, span, points[fresh])
            coords = snapped @ frame.to_L  # (k, B): x = V p = Rᵀ (U S⁻¹ p)
            state.activation_coords = (coords if state.activation_coords is None
                                       else torch.cat([state.activation_coords, coords]))
            _verify(ctx, state, *activations.columns_of_points(L, frame, system.bias, snapped),
                    pool)
        clock.tick("activations", t0)
        t0 = time.perf_counter()
        Qp, zeros, _, lev = polish_within_budget(ctx, Q, ctx.n_rows())
        pool.add(Qp, zeros, lev)
        if exact.shape[1]:  # proven by their points: kept with any zero count
            pool.add(exact, zero_mask(L @ exact, ctx.zero_rtol).sum(dim=0),
                     least_zeros=ctx.B - 1)
        clock.tick("polish", t0)
        total = 0 if state.activation_found is None else state.activation_found.shape[1]
        log.log(logging.INFO if ctx.cfg.progress else logging.DEBUG,
                "%.1fs: activation descent: %d exact columns (%d new, %d in all)",
                clock.elapsed(), exact.shape[1], new.shape[1], total)
        if new.shape[1] < tuning.activation_min_new or clock.expired():
            break


def _new_columns(Q: torch.Tensor, known: torch.Tensor | None, tol: float) -> torch.Tensor:
    """(k,) bool: the columns of ``Q`` (unit, B x k) farther than ``tol`` from the span of
    ``known``."""
    if known is None or not known.shape[1] or not Q.shape[1]:
        return torch.ones(Q.shape[1], dtype=torch.bool, device=Q.device)
    basis = torch.linalg.qr(known).Q
    return (Q - basis @ (basis.T @ Q)).norm(dim=0) > tol


def _verify(ctx: SearchContext, state: SearchState, Q: torch.Tensor,
            inactive: torch.Tensor, pool: CandidatePool) -> None:
    """Recover the samples of the exact columns ``Q`` (B, k) through the next layer, each on
    its point's inactive units (``inactive``, m x k), and keep the verified ones
    (:func:`keep_verified`)."""
    if state.recover is not None:
        keep_verified(state, state.recover(Q, ctx.clock.deadline, zeros=inactive), pool)


def verify_sparsest(ctx: SearchContext, state: SearchState, pool: CandidatePool,
                    Q: torch.Tensor, *, limit: int) -> None:
    """Try to verify the samples of the ``limit`` sparsest columns of ``Q`` (B, k) whose zero
    patterns were not tried yet, on their own zero rows (``state.recover``), and keep the
    samples verified or read (:func:`keep_verified`)."""
    if state.recover is None or not Q.shape[1] or ctx.clock.expired():
        return
    t0 = time.perf_counter()
    mask = zero_mask(ctx.L @ Q.to(ctx.L), ctx.zero_rtol)
    keys = pattern_keys(mask)
    todo = [j for j in torch.argsort(mask.sum(dim=0), descending=True).tolist()
            if keys[j] not in state.peel_tried][:limit]
    state.peel_tried.update(keys[j] for j in todo)
    if todo:
        keep_verified(state, state.recover(Q[:, todo], ctx.clock.deadline), pool)
    ctx.clock.tick("peel", t0)


def keep_verified(state: SearchState, got: Peeled, pool: CandidatePool | None = None) -> None:
    """Add the samples of ``got`` (verified or only read, ``Peeled.proven``) that are new
    (their columns more than 10⁻⁶ in angle from those kept) to ``state.verified``, and their
    columns to ``pool`` as proven (selected before any other candidate)."""
    if not bool(got.verified.any()):
        return
    old = state.verified
    F = 0 if old is None else old.columns.shape[1]
    both = got.columns if old is None else torch.cat([old.columns.to(got.columns),
                                                       got.columns], dim=1)
    idx = dedupe(both)  # the first of each group within 10⁻⁶: the kept ones come first
    new = torch.zeros(got.columns.shape[1], dtype=torch.bool, device=got.columns.device)
    new[idx[idx >= F] - F] = True
    if not bool(new.any()):
        return
    got = got.take(new)
    if pool is not None:
        pool.add(got.columns, torch.zeros(got.columns.shape[1], dtype=torch.long), proven=True)
    if old is not None:
        got = Peeled(inputs=torch.cat([old.inputs, got.inputs]),
                     coords=torch.cat([old.coords, got.coords]),
                     columns=torch.cat([old.columns, got.columns], dim=1),
                     verified=torch.cat([old.verified, got.verified]),
                     proven=torch.cat([old.proven_mask(), got.proven_mask()]))
    state.verified = got


def verified_complement(state: SearchState, B: int) -> torch.Tensor | None:
    """(B, B - F) orthonormal basis of the directions orthogonal to the coordinates of the F
    samples known, or None when there are none: the samples verified or read through the
    next layer (``state.verified``) and the exact points of the activation rounds
    (``state.activation_coords``, those whose columns are not verified ones).

    G = (L Q)(Q⁻¹ R): a sample's coordinates c (x = cᵀ R) are its row of Q⁻¹, which is
    orthogonal to every other sample's column. So the columns still missing lie in this
    complement, exactly up to the coordinates' precision (the columns found there polish
    back to exact kernels of L), and the search there is a search at batch size B - F,
    without the re-decomposition a peel needs (``peel.reduced``), which a trained model's
    gradual spectrum can refuse.
    """
    rows = []
    got = state.verified
    if got is not None and got.coords.shape[0]:
        rows.append(got.coords.double())
    if state.activation_coords is not None and state.activation_found is not None:
        keep = torch.ones(state.activation_coords.shape[0], dtype=torch.bool)
        if got is not None and got.columns.shape[1]:
            cos = (normalize_columns(got.columns.double()).T
                   @ normalize_columns(state.activation_found.double())).abs()
            keep = (cos.amax(dim=0) <= 1 - 1e-6).cpu()
        rows.append(state.activation_coords.double()[keep.to(state.activation_coords.device)])
    if not rows:
        return None
    C = torch.cat(rows)
    if not C.shape[0] or C.shape[0] >= B - 1:
        return None
    C = C / C.norm(dim=1, keepdim=True)
    _, sv, Vh = torch.linalg.svd(C, full_matrices=True)
    r = int((sv > 1e-6 * sv[0]).sum())
    return Vh[r:].T.contiguous() if r < B - 1 else None


def polish_within_budget(ctx: SearchContext, Q: torch.Tensor, n_rows: int
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``polish.polish`` of the first columns of ``Q`` (B, K) that the time budget allows.

    Without ``max_seconds`` all at once; with it in chunks of ``Tuning.polish_chunk`` columns,
    each column being polished on its own, until the budget runs out (at least one chunk).
    Unpolished directions are no candidates, so the rest is dropped. Returns what
    ``polish.polish`` returns, for the first K' ≤ K columns.
    """
    L, rtol, clock = ctx.L, ctx.zero_rtol, ctx.clock
    if clock.deadline is None:
        return polish.polish(L, Q, n_rows=n_rows, zero_rtol=rtol)
    chunk = ctx.tuning.polish_chunk
    parts = []
    for start in range(0, Q.shape[1], chunk):
        if start > 0 and clock.expired():
            break
        parts.append(polish.polish(L, Q[:, start:start + chunk], n_rows=n_rows, zero_rtol=rtol))
    if not parts:
        return polish.polish(L, Q, n_rows=n_rows, zero_rtol=rtol)
    Qp, zeros, face_dim, lev = (torch.cat(xs, dim=-1) for xs in zip(*parts, strict=True))
    return Qp, zeros, face_dim, lev


def spear_round(ctx: SearchContext, state: SearchState, pool: CandidatePool) -> None:
    """One SPEAR sampling step (SPEAR §3.3, §5.1): kernels of ``cfg.samples_per_step`` random
    (B-1)-row submatrices of L, batched; the sparse ones are polished and pooled.

    Parameters
    ----------
    ctx, state, pool
        The search; ``state.samples`` counts the submatrices drawn.
    """
    cfg, B, L, clock = ctx.cfg, ctx.B, ctx.L, ctx.clock
    t0 = time.perf_counter()
    S = min(cfg.samples_per_step, cfg.max_samples - state.samples)
    rows = sampling.random_row_subsets(L.shape[0], B - 1, S, generator=ctx.generator)
    C, rank_ok = sampling.submatrix_kernels(L, rows.to(L.device))
    state.samples += S
    zeros = zero_mask(L @ C, ctx.zero_rtol).sum(dim=0)
    keep = rank_ok & (zeros >= ctx.min_zeros)
    clock.tick("search", t0)
    if bool(keep.any()):
        t0 = time.perf_counter()
        Qp, zeros, _, lev = polish.polish(L, C[:, keep], n_rows=ctx.n_rows(),
                                          zero_rtol=ctx.zero_rtol)
        pool.add(Qp, zeros, lev)
        clock.tick("polish", t0)


def split_faces(ctx: SearchContext, state: SearchState, pool: CandidatePool, Q: torch.Tensor,
                n_rows: int, vertex: bool = False, deadline: float | None = None) -> None:
    """Split each new face among ``Q`` (B, k) into its sparsest directions (``faces``).

    ``Q`` are directions inside a face (a kernel of dimension > 1 on their smallest rows) or,
    with ``vertex``, vertices of one (single kernels with a zero row of leverage 1). At most
    ``cfg.max_faces`` new faces (by default ``Tuning.faces_small`` for B ≤
    ``Tuning.small_batch``, else ``Tuning.faces_large``), until ``deadline`` (by default the
    search's).

    Parameters
    ----------
    ctx, state, pool
        The search; the faces seen are remembered in ``state.faces_seen``.
    Q : (B, k)
        Directions in faces or, with ``vertex``, vertices of faces.
    n_rows
        Rows of the first polishing pass (``SearchContext.n_rows``).
    vertex
        Whether ``Q`` are vertices.
    deadline
        A ``time.perf_counter()`` value, or None for the search's deadline.
    """
    cfg, L, rtol, tuning = ctx.cfg, ctx.L, ctx.zero_rtol, ctx.tuning
    found = []
    budget = cfg.max_faces or (tuning.faces_small if ctx.B <= tuning.small_batch
                               else tuning.faces_large)
    if budget > 0 and Q.shape[1] and not ctx.clock.expired(deadline):
        # bases and keys come in batches (faces.candidate_faces), the faces in column order
        for N, key in faces.candidate_faces(L, Q, n_rows=n_rows, zero_rtol=rtol,
                                            max_leverage=cfg.max_leverage,
                                            max_dim=cfg.max_face_dim, vertex=vertex):
            if budget <= 0 or ctx.clock.expired(deadline):
                break
            if key in state.faces_seen:
                continue
            state.faces_seen.add(key)
            budget -= 1
            Qf, _ = faces.split_face(L, N, zero_rtol=rtol, generator=ctx.generator)
            if Qf.shape[1]:
                found.append(Qf)
    if found:
        Qp, zeros, _, lev = polish.polish(L, torch.cat(found, dim=1), n_rows=n_rows,
                                          zero_rtol=rtol)
        pool.add(Qp, zeros, lev)


def neighbour_search(ctx: SearchContext, state: SearchState, pool: CandidatePool) -> None:
    """After round 1: seeds for columns hidden next to the pool's (their zero rows restricted
    search, ``faces.conditional_directions``), split as faces; within
    ``Tuning.neighbour_share`` of the budget (half of it for the seeds).

    Parameters
    ----------
    ctx, state, pool
        The search; the seeds come from the pool's columns.
    """
    clock, share = ctx.clock, ctx.tuning.neighbour_share
    t0 = time.perf_counter()
    limit = clock.from_now(share)
    seeds = faces.conditional_directions(ctx.L, pool.columns, zero_rtol=ctx.zero_rtol,
                                         generator=ctx.generator,
                                         deadline=clock.from_now(share / 2))
    split_faces(ctx, state, pool, seeds, ctx.n_rows(), deadline=limit)
    clock.tick("neighbours", t0)


def complete(ctx: SearchContext, state: SearchState, pool: CandidatePool,
             found: torch.Tensor) -> bool:
    """Complete the columns missing from ``found`` (B, F) from W and b (``completion``) and
    pool the candidates; False when nothing is left to try for this found set.

    The exact completion runs once per found set of 1-3 missing columns (it gives up on 3 when
    the cells are too many), with the span of 2-3 missing columns whose samples' patterns nest
    (``completion.missing_face``); the sampled one up to ``Tuning.slice_patience`` times per found
    set and round when 2 or more are missing. For FedAvg sums, where the exact one does not
    apply (a sum keeps only part of a sample's W₀ pattern as zeros), the sampled one also runs
    once for a single missing column; under noise both run once for 1-3 missing columns (a
    pre-activation near 0 may take the wrong sign, the most negative rows avoid those).

    Parameters
    ----------
    ctx, state, pool
        The search; ``state.completed`` counts the calls per found set.
    found : (B, F)
        The trusted columns.

    Returns
    -------
    bool
        Whether a completion ran (False: nothing left to try for this found set).
    """
    count = found.shape[1]
    missing = ctx.B - count
    cfg = ctx.cfg
    if missing < 1 or ctx.system.WR is None or not cfg.polish:
        return False
    exact, sampled = (missing, count, -1), (missing, count, state.rounds)
    t0 = time.perf_counter()
    exact_ok = not ctx.system.subset
    once = missing <= 3 if exact_ok else missing == 1 and bool(cfg.slice_samples)
    if once and exact not in state.completed:
        state.completed[exact] = 1
        Qc = missing_candidates(ctx, found, sampled=not exact_ok)
        if exact_ok and ctx.row_noise is not None and cfg.slice_samples:
            Qc = torch.cat([Qc, missing_candidates(ctx, found, sampled=True)], dim=1)
        face = None if not exact_ok or ctx.noisy else completion.missing_face(ctx.system, found)
        if face is not None:  # samples whose patterns nest: their span, as candidates
            pool.add(face, zero_mask(ctx.L @ face, ctx.zero_rtol).sum(dim=0))
    elif (missing >= 2 and cfg.slice_samples
          and state.completed.get(sampled, 0) < ctx.tuning.slice_patience):
        state.completed[sampled] = state.completed.get(sampled, 0) + 1
        Qc = missing_candidates(ctx, found, sampled=True)
    else:
        return False
    Qc = _promising(ctx, Qc)
    if Qc.shape[1]:
        Qp, zeros, _, lev = polish.polish(ctx.L, Qc, n_rows=ctx.n_rows(), zero_rtol=ctx.zero_rtol)
        pool.add(Qp, zeros, lev)
    ctx.clock.tick("complete", t0)
    return True


def _promising(ctx: SearchContext, Qc: torch.Tensor) -> torch.Tensor:
    """The completion's candidates (B, c) worth rounding: those with at least half of
    ``ctx.min_zeros`` zeros already.

    Each candidate is the exact kernel of a row set, so its zeros are there before rounding:
    a sample's column has about half of m zeros, most row sets' kernels little more than
    their set's B rows (MNIST, B = 100, m = 1000: at most 113 against 483-533 for the
    columns found, with ``min_zeros`` 433). Rounding those costs as much as sampling them
    and none passes the pool's filter; half of ``min_zeros`` leaves rounding a wide margin
    to add zeros.
    """
    if not Qc.shape[1]:
        return Qc
    zeros = zero_mask(ctx.L @ Qc.to(ctx.L.dtype), ctx.zero_rtol).sum(dim=0)
    return Qc[:, zeros >= ctx.min_zeros // 2]


def missing_candidates(ctx: SearchContext, found: torch.Tensor, *, sampled: bool,
                       deadline: float | None = None) -> torch.Tensor:
    """Candidates (B, c) for the columns missing from ``found`` (B, F): the exact completion
    (``completion.complete_missing``) or slice sampling (``completion.sample_missing``),
    until ``deadline`` (by default the search's)."""
    deadline = ctx.clock.deadline if deadline is None else deadline
    if not sampled:
        return completion.complete_missing(ctx.system, found, row_noise=ctx.row_noise,
                                           deadline=deadline)
    return completion.sample_missing(ctx.system, found, row_noise=ctx.row_noise,
                                     generator=ctx.generator,
                                     n_samples=ctx.cfg.slice_samples or 2048,
                                     deadline=deadline)
