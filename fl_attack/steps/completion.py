"""Completing the columns missing from a partial basis, from W and b alone.

Once F of the B columns are found, the k = B - F missing samples' dual rows lie on a
(k-1)-dimensional affine slice (:func:`dual_slice`), on which their pre-activations W x + b are
affine (:func:`missing_slice`). A cell of that sign arrangement fixes a missing column's zero
rows, whose kernel is the column: :func:`complete_missing` enumerates the cells for k ≤ 3;
:func:`sample_missing` samples points of the slice for any k and takes the most negative rows of
each point as row sets (:func:`slice_row_sets`, screened together by
:func:`nested_row_set_kernels`). Beyond the papers, which search for every column.
"""

from __future__ import annotations

import math

import torch

from fl_attack.core import kernels
from fl_attack.core.clock import passed
from fl_attack.core.columns import dedupe
from fl_attack.core.kernels import (
    exact_pattern_kernels,
    known_free,
    may_have_kernel,
    pattern_kernels,
    screen_chunk,
    take_rows,
)
from fl_attack.steps.scale import LayerSystem


def _cells_1d(slope: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """ReLU patterns (m, cells) "offset + w·slope ≤ 0" of every cell of a line (w ∈ R)."""
    tiny = torch.full_like(slope, torch.finfo(slope.dtype).tiny)
    safe = torch.where(slope.abs() > 0, slope, tiny)
    breaks = torch.sort(-offset / safe).values
    gaps = breaks[1:] - breaks[:-1]
    span = (breaks[-1] - breaks[0]).abs().clamp_min(1.0)
    ws = torch.cat([breaks[:1] - span, 0.5 * (breaks[1:] + breaks[:-1]), breaks[-1:] + span])
    one = torch.ones(1, dtype=torch.bool, device=ws.device)
    ws = ws[torch.cat([one, gaps > 0, one])]
    return ws[None, :] * slope[:, None] + offset[:, None] <= 0


def _cells_2d(A: torch.Tensor, offset: torch.Tensor, max_vertices: int) -> torch.Tensor | None:
    """ReLU patterns of the bounded cells of the arrangement "offset + A w ≤ 0", w ∈ R² (m, c).

    Every bounded cell touches a vertex (the crossing of lines j and k); the four cells
    around a vertex share all signs but those of rows j and k. None when the m(m-1)/2
    vertices exceed ``max_vertices``.
    """
    m = A.shape[0]
    j, k = torch.triu_indices(m, m, offset=1, device=A.device)
    if j.numel() > max_vertices:
        return None
    M = torch.stack([A[j], A[k]], dim=1)  # (P, 2, 2)
    rhs = -torch.stack([offset[j], offset[k]], dim=1)[..., None]
    v, info = torch.linalg.solve_ex(M, rhs)
    good = info == 0
    v, j, k = v[good, :, 0], j[good], k[good]
    base = A @ v.T + offset[:, None] <= 0  # (m, P)
    cols = torch.arange(base.shape[1], device=A.device)
    masks = []
    for sj in (False, True):
        for sk in (False, True):
            msk = base.clone()
            msk[j, cols] = sj
            msk[k, cols] = sk
            masks.append(msk)
    return torch.cat(masks, dim=1)


def missing_slice(
    system: LayerSystem, found: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, float] | None:
    """Pre-activations of the missing samples as an affine map of k - 1 free coordinates.

    The missing sample i has xᵢᵀ = pᵢᵀ R with pᵢ the i-th row of Q⁻¹: orthogonal to every found
    column, so pᵢ lies in their k-dim complement; and pᵢᵀ t = 1 (t = L⁺ g = Q 1, the scale
    fix), so it lies on a (k-1)-dim affine slice of it, the affine hull of the k missing
    samples. Returns (offset (m,), slope (m, k-1), norm of the slice's closest point to 0)
    with W x(w) + b = offset + slope w; None when the found columns leave no such slice.
    """
    dual = dual_slice(found, system.t)
    if dual is None:
        return None
    N, v0, U = dual
    A = system.weight @ (system.R.T @ N)  # (m, k): pre-activation slope in v
    return A @ v0 + system.bias, A @ U, float(v0.norm())


def dual_slice(
    found: torch.Tensor, t: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The rows p of Q⁻¹ left for the samples missing from ``found`` (B, F): p ⊥ every found
    column and pᵀ t = 1. Returns (N (B, k), v0 (k,), U (k, k-1)) with p = N (v0 + U w),
    w ∈ R^(k-1), v0 the point closest to 0; None when t is orthogonal to the complement.
    Shared by :func:`missing_slice` and :func:`fl_attack.steps.feasibility.pattern_margins`.
    """
    N = _complement(found)  # (B, k) complement of the found columns
    c = N.T @ t  # p = N v with cᵀ v = 1
    if bool(c.norm() <= torch.finfo(t.dtype).eps * t.norm()):  # one read of the device
        return None
    return N, c / c.square().sum(), _complement(c[:, None])


def _complement(A: torch.Tensor) -> torch.Tensor:
    """Orthonormal basis (n, n - r) of the orthogonal complement of the r columns of ``A``
    (n, r): the last left singular vectors, or, where ``kernels.slow_batched_solves`` (CUDA:
    one factorisation per partial basis and per LP, where an SVD costs several times a QR),
    the last columns of the complete QR factor. Either basis gives the same slice: the LPs'
    optima do not depend on it, and the sampled points only through a rotation of their
    isotropic draw.
    """
    n, r = A.shape
    if kernels.slow_batched_solves(A):
        if r == 0:  # nothing found yet: the whole space
            return torch.eye(n, dtype=A.dtype, device=A.device)
        return torch.linalg.qr(A, mode="complete").Q[:, r:]
    U, _, _ = torch.linalg.svd(A, full_matrices=True)
    return U[:, r:]


def complete_missing(
    system: LayerSystem,
    found: torch.Tensor,
    *,
    max_vertices: int = 40000,
    row_noise: torch.Tensor | None = None,
    deadline: float | None = None,
) -> torch.Tensor:
    """Candidates for the k = B - F columns missing from ``found`` (B, F), k ≤ 3 (B, c).

    An exact, search-free completion from what the server knows. The missing samples'
    pre-activations W xᵢ + b are affine on the (k-1)-dim slice of :func:`missing_slice`, and
    each cell of their sign arrangement fixes the zero rows of the missing column, whose kernel
    (when one exists) is the column. k = 1 is a single point, k = 2 a line (m + 1 cells), k = 3
    a plane (O(m²) cells, skipped when the m(m-1)/2 vertices exceed ``max_vertices``).

    Parameters
    ----------
    system
        The layer's products (L, R, W, b, t = L⁺ g and the zero test).
    found : (B, F)
        The trusted columns.
    max_vertices
        Cap on the plane's vertices (k = 3).
    row_noise : (B,), optional
        ν / s under noise: least-squares kernels (``kernels.pattern_kernels``).
    deadline
        As in ``kernels.pattern_kernels`` (the caller's budget).

    Returns
    -------
    torch.Tensor
        (B, c) unit candidate columns (none when k is not 1-3).
    """
    L, zero_rtol = system.L, system.zero_rtol
    B = L.shape[1]
    mask = _slice_cells(system, found, max_vertices)
    if mask is None:
        return torch.empty(B, 0, dtype=L.dtype, device=L.device)
    mask = mask[:, mask.sum(dim=0) >= B - 1]
    return pattern_kernels(L, mask, zero_rtol, deadline=deadline, row_noise=row_noise)


def _slice_cells(system: LayerSystem, found: torch.Tensor,
                 max_vertices: int) -> torch.Tensor | None:
    """The distinct inactive patterns (m, c) of the cells of the missing samples' slice
    (:func:`missing_slice`) for k = B - F in 1-3, or None (another k, no slice, too many
    vertices)."""
    k = system.L.shape[1] - found.shape[1]
    affine = missing_slice(system, found) if 1 <= k <= 3 else None
    if affine is None:
        return None
    offset, Aw, _ = affine
    if k == 1:
        mask = (offset <= 0)[:, None]
    elif k == 2:
        mask = _cells_1d(Aw[:, 0], offset)
    else:
        mask = _cells_2d(Aw, offset, max_vertices)
        if mask is None:
            return None
    return torch.unique(mask, dim=1) if mask.shape[1] > 1 else mask


def missing_face(system: LayerSystem, found: torch.Tensor, *,
                 max_vertices: int = 40000) -> torch.Tensor | None:
    """(B, k) orthonormal basis of the span of the k = B - F columns missing from ``found``
    (B, F), 2 ≤ k ≤ 3, when their samples' ReLU patterns nest; None otherwise.

    Every mixture of such samples' columns vanishes on the inactive units they share, so no
    cell of :func:`missing_slice` has a one-dimensional kernel for the first of them and
    :func:`complete_missing` finds nothing; but the cell of the shared units has a kernel of
    exactly k dimensions, which holds no found column: the span of the missing ones. Completed
    with it (a basis of it as pool candidates), the found samples are read exactly, and the
    certificate names the group read only up to a mixture (``certify.Pinning``).
    """
    L = system.L
    m, B = L.shape
    k = B - found.shape[1]
    mask = _slice_cells(system, found, max_vertices) if k >= 2 else None
    if mask is None:
        return None
    mask = mask[:, mask.sum(dim=0) >= B - k]
    counts = mask.sum(dim=0)
    for j in torch.argsort(counts, descending=True).tolist():
        rows = L[mask[:, j]]
        vals, vecs = torch.linalg.eigh(rows.T @ rows)
        tol = float(counts[j]) * system.zero_rtol**2 / m
        if int((vals <= tol).sum()) != k or not bool(vals[k] > tol):
            continue
        face = vecs[:, :k]
        if int(torch.linalg.matrix_rank(torch.cat([found, face], dim=1))) == B:
            return face
    return None


def slice_row_sets(h: torch.Tensor, B: int,
                   fractions: tuple[float, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """The row sets of :func:`sample_missing` at pre-activations ``h`` (m, S): each point's rows
    ordered most negative first (``idx`` (w, S)) and, per row rule, how many of them the set
    takes (``lengths`` (1 + len(fractions), S), non-decreasing down the rules): its B most
    negative rows, then ``fractions`` of its negative rows (at least B), never a row with
    h > 0. The sets of a point are prefixes of one order, hence nested.
    """
    if list(fractions) != sorted(fractions):
        raise ValueError(f"fractions must be non-decreasing (nested row sets), got {fractions}")
    m = h.shape[0]
    negative = (h <= 0).sum(dim=0)
    sizes = [torch.full_like(negative, B)]
    sizes += [(f * negative).ceil().long().clamp(B, m - 1) for f in fractions]
    lengths = torch.stack([torch.minimum(n, negative) for n in sizes])
    top = max(int(lengths.max()), 1)
    idx = h.topk(top, dim=0, largest=False).indices  # (top, S), most negative first
    return idx, lengths


def nested_row_set_kernels(L: torch.Tensor, idx: torch.Tensor, lengths: torch.Tensor,
                           zero_rtol: float, chunk_elems: int | None = None,
                           deadline: float | None = None,
                           prune_at: tuple[float, ...] = (2.0, 3.0, 5.0),
                           row_noise: torch.Tensor | None = None,
                           known: torch.Tensor | None = None) -> torch.Tensor:
    """``kernels.pattern_kernels`` of the nested row sets of :func:`slice_row_sets` (B, c).

    Row set r of point p is ``idx[:lengths[r, p], p]``; sets with fewer than B - 1 rows are
    skipped and each rule's sets are deduplicated, as the mask form would. The float32 screen's
    Gram matrices are accumulated along the nesting: each rule adds only the rows beyond the
    previous one, so a point's three sets cost its largest set once.

    A point is dropped as soon as a prefix of its rows is clearly full rank: adding rows only
    raises the smallest eigenvalue, so if the prefix's Gram passes the screen at the largest
    set's tolerance, none of the point's later sets can have a kernel the exact test keeps.
    Besides at each rule this is checked after ``prune_at`` x B rows (many points are full rank
    long before their largest set). Sets of at most B rows skip the screen and go to the exact
    test as they are, and no point is dropped on B rows: a point's B most negative rows are rows
    where most samples are inactive, so their Gram matrices are singular or nearly so and the
    screen would pass almost all of them (``experiments/results/tuning.md``).
    Sets on which a ``known`` column (B, F) vanishes skip the exact test
    (:func:`fl_attack.core.kernels.known_free`): their kernel can only give that column back.
    Past ``deadline`` no further chunk of points starts. Points go in chunks of at most
    ``chunk_elems`` gathered elements (default ``kernels.screen_chunk``).
    """
    m, B = L.shape
    n_rules, S = lengths.shape
    out = [torch.empty(B, 0, dtype=L.dtype, device=L.device)]
    if S == 0:
        return out[0]
    padded = torch.cat([L.float(), L.new_zeros(1, B, dtype=torch.float32)])  # row m: padding
    chunk_elems = chunk_elems or screen_chunk(L.device)
    per = max(1, chunk_elems // (max(int(lengths[-1].max()), 1) * B))
    near: list[list[torch.Tensor]] = [[] for _ in range(n_rules)]
    ranks = torch.arange(idx.shape[0], device=idx.device)[:, None]
    checks = torch.tensor([math.ceil(f * B) for f in prune_at], device=idx.device,
                          dtype=lengths.dtype)
    for start in range(0, S, per):
        if passed(deadline):
            break
        cols = torch.arange(start, min(start + per, S), device=idx.device)
        _screen_points(padded, idx, lengths, cols, checks, ranks, near, zero_rtol, row_noise)
    for r in range(n_rules):
        pts = torch.cat(near[r]) if near[r] else ranks[:0, 0]
        pts = pts[pts >= 0]  # the screen's marks: -1 where a point is not in this rule's sets
        if not pts.numel():
            continue
        mask = ranks < lengths[r, pts][None, :]  # (top, k) prefix of each point's order
        rows = torch.where(mask, idx[:, pts], m)
        sets = torch.zeros(m + 1, pts.numel(), dtype=torch.bool, device=L.device)
        sets = sets.scatter_(0, rows, True)[:m]
        if sets.shape[1] > 1:
            sets = torch.unique(sets, dim=1)
        if known is not None:
            sets = sets[:, known_free(L, sets, known, zero_rtol, row_noise)]
        out.append(exact_pattern_kernels(L, sets, zero_rtol, row_noise))
    return torch.cat(out, dim=1).contiguous()


def _screen_points(padded: torch.Tensor, idx: torch.Tensor, lengths: torch.Tensor,
                   cols: torch.Tensor, checks: torch.Tensor, ranks: torch.Tensor,
                   near: list[list[torch.Tensor]], zero_rtol: float,
                   row_noise: torch.Tensor | None) -> None:
    """The float32 screen of :func:`nested_row_set_kernels` for the points ``cols`` (k,):
    accumulate each point's Gram matrix along its nested row sets and append, per rule, the
    points whose set may have a kernel to ``near[rule]`` (as ``cols`` with -1 for the others,
    compacted once by the caller); drop a point once a prefix of its rows is clearly full rank.
    ``padded`` is L in float32 with a zero row m appended. A stage reads the device twice,
    and once per rule."""
    m, B = padded.shape[0] - 1, padded.shape[1]
    n_rules = lengths.shape[0]
    # each point's stages: its rule lengths and the checkpoints below its largest set
    stops = torch.cat([lengths[:, cols],
                       torch.minimum(checks[:, None], lengths[-1, cols][None, :])])
    stops = torch.sort(stops, dim=0).values  # (stages, k)
    gram = torch.zeros(cols.numel(), B, B, dtype=torch.float32, device=padded.device)
    lo = torch.zeros_like(cols)
    seen = torch.zeros(n_rules, cols.numel(), dtype=torch.bool, device=idx.device)
    for stage in range(stops.shape[0]):
        hi = stops[stage]
        w, top = torch.stack([(hi - lo).max(), hi.max()]).tolist()  # one read
        if w > 0:
            offs = lo[None, :] + ranks[:w]  # (w, k)
            inside = offs < hi[None, :]
            rows = torch.where(inside, idx[offs.clamp_max(idx.shape[0] - 1), cols[None, :]], m)
            Lg = take_rows(padded, rows.T)  # (k, w, B)
            gram = gram.baddbmm_(Lg.transpose(1, 2), Lg)
        lo = hi
        for r in range(n_rules):
            at = (lengths[r, cols] == hi) & ~seen[r]
            seen[r] |= at
            sel = at & (hi >= B - 1)
            # at most B rows: straight to the exact test; the others are screened (one read)
            screen = torch.nonzero(sel & (hi > B)).squeeze(1)
            if screen.numel():
                sel[screen] = may_have_kernel(gram.index_select(0, screen), hi[screen],
                                              zero_rtol, m, row_noise)
            near[r].append(torch.where(sel, cols, -1))
        if stage == stops.shape[0] - 1:
            break
        if top <= B:  # the screen keeps nearly every point on B rows
            continue
        alive = torch.nonzero(may_have_kernel(gram, lengths[-1, cols], zero_rtol, m, row_noise)
                              & ~seen[-1]).squeeze(1)  # one read
        if alive.numel() < cols.numel():
            cols, gram, lo = cols[alive], gram.index_select(0, alive), lo[alive]
            stops, seen = stops[:, alive], seen[:, alive]
            if cols.numel() == 0:
                break


def sample_missing(
    system: LayerSystem,
    found: torch.Tensor,
    *,
    generator: torch.Generator,
    n_samples: int = 2048,
    radius: tuple[float, float] = (1.0, 100.0),
    fractions: tuple[float, ...] = (0.6, 0.75),
    deadline: float | None = None,
    row_noise: torch.Tensor | None = None,
) -> torch.Tensor:
    """Candidates for any number k ≥ 1 of columns missing from ``found`` (B, F) (B, c), unique.

    The randomised form of :func:`complete_missing`, for k too large to enumerate cells. At a
    point of the slice dominated by the missing sample i, the *most negative* pre-activations
    are rows where sample i is surely inactive: a subset of the zero rows of column i, so the
    kernel of L on such a row set is that column exactly once the set is large enough to
    exclude the samples whose patterns are like i's. Each point gives three row sets: its B
    most negative rows, and the most negative ``fractions`` of its negative rows (for a cluster
    of similar samples the B-row sets only give their common faces; the larger sets exclude the
    similar samples).
    Most other row sets have no kernel and are dropped; some vanish on a mixture of samples,
    which is why the caller polishes, filters and selects the candidates like any others.
    Points are drawn uniformly in balls of radii log-uniform in ``radius`` x the slice's
    distance to 0 (far points are as good as near ones: what matters is which sample
    dominates). The caller repeats it as the found set grows. ``deadline``: as in
    ``kernels.pattern_kernels`` (the caller's budget).
    At k = 1 the slice is a single point (the missing sample's W₀ pattern): its most negative
    rows are what a FedAvg sum keeps as zeros (``AttackConfig.update``), where the exact
    completion's full pattern has no kernel.

    Parameters
    ----------
    system, found, row_noise, deadline
        As for :func:`complete_missing`.
    generator
        Draws the points.
    n_samples, radius, fractions
        Points per call, their distance range (in units of the slice's distance to 0) and the
        row rules (shares of each point's negative rows).

    Returns
    -------
    torch.Tensor
        (B, c) unit candidates, deduplicated.
    """
    L, zero_rtol = system.L, system.zero_rtol
    m, B = L.shape
    k = B - found.shape[1]
    empty = torch.empty(B, 0, dtype=L.dtype, device=L.device)
    if k < 1:
        return empty
    affine = missing_slice(system, found)
    if affine is None:
        return empty
    offset, Aw, dist = affine
    if k == 1:  # the slice is one point: the missing sample itself
        w = torch.zeros(1, 0, dtype=L.dtype, device=L.device)
    else:
        lo, hi = math.log(radius[0]), math.log(radius[1])
        u = torch.randn(n_samples, k - 1, generator=generator, dtype=torch.float64)
        r = torch.rand(n_samples, 1, generator=generator, dtype=torch.float64) ** (1.0 / (k - 1))
        s = torch.exp(lo + (hi - lo) * torch.rand(n_samples, 1, generator=generator,
                                                  dtype=torch.float64))
        w = (u / u.norm(dim=1, keepdim=True) * r * s * dist).to(device=L.device, dtype=L.dtype)
    h = offset[:, None] + Aw @ w.T  # (m, S) pre-activations at the sampled points
    idx, lengths = slice_row_sets(h, B, fractions)
    Q = nested_row_set_kernels(L, idx, lengths, zero_rtol, deadline=deadline, row_noise=row_noise,
                               known=found)
    return Q[:, dedupe(Q, 1e-6)] if Q.shape[1] > 1 else Q
