"""Splitting faces: the step that makes SPEAR++ work on real data with similar samples.

Samples with almost the same ReLU pattern share most of their zero rows. Every combination of
such a group vanishes on the shared rows, so the group spans a k-dimensional "face" on which the
ℓ1 search stalls at mixtures (vertices with only k-1 extra zeros) instead of the true columns.
Polishing reveals the face (the kernel of L on the shared rows has dimension k > 1). Inside it
the true columns are the directions with the most extra zeros, which SPEAR-style sampling of
(k-1)-row subsets finds cheaply because k is small.
"""

from __future__ import annotations

import math

import torch

from fl_attack.clock import passed
from fl_attack.filtering import dedupe, zero_mask
from fl_attack.polish import (
    default_chunk,
    gathered_rows,
    masked_grams,
    plus_diagonal,
    smallest_ritz_pairs,
)
from fl_attack.sampling import random_row_subsets, submatrix_kernels
from fl_attack.search import optimise_on_sphere


def split_face(
    L: torch.Tensor,
    N: torch.Tensor,
    *,
    zero_rtol: float,
    generator: torch.Generator,
    max_samples: int = 20000,
    per_column: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparsest directions inside the face span(N) (N: (B, k) orthonormal).

    Returns (Q (B, c) unit candidates, zero counts (c,)), keeping only directions with more zeros
    than a generic vertex of the face (shared zeros + k - 1).
    """
    k = N.shape[1]
    A = L @ N  # (m, k)
    row_norm = A.norm(dim=1)
    shared = row_norm <= zero_rtol * row_norm.max()
    free = torch.nonzero(~shared).squeeze(1)
    n_free = free.numel()
    if n_free < k - 1 or k < 2:
        empty = torch.empty(L.shape[1], 0, dtype=L.dtype, device=L.device)
        return empty, torch.empty(0, dtype=torch.long, device=L.device)
    total = math.comb(n_free, k - 1)
    S = int(min(max_samples, total, per_column * k * max(1, 2 ** (k - 1)) * 8))
    if total <= max_samples:  # small faces: enumerate every subset exactly once
        rows = torch.combinations(torch.arange(n_free, device=L.device), k - 1)
    else:
        rows = random_row_subsets(n_free, k - 1, S, generator=generator).to(L.device)
    C, ok = submatrix_kernels(A[free], rows)
    C = C[:, ok]
    V = A @ C  # (m, S)
    zeros = zero_mask(V, zero_rtol).sum(dim=0)
    vertex = int(shared.sum()) + k - 1
    keep = torch.nonzero(zeros > vertex).squeeze(1)
    keep = keep[torch.argsort(zeros[keep], descending=True, stable=True)][: 4 * k]
    C, zeros = C[:, keep], zeros[keep]
    uniq = dedupe(C, 1e-6)
    Q = N @ C[:, uniq]
    return Q / Q.norm(dim=0, keepdim=True), zeros[uniq]


def vertex_face_basis(
    L: torch.Tensor, q: torch.Tensor, zero_rtol: float, max_leverage: float = 0.99
) -> torch.Tensor:
    """The face a vertex sits in: the kernel of L on its zero rows minus the coincidental ones.

    A vertex of a face owes k-1 of its zeros to cancellations; those rows have leverage 1, and
    dropping them leaves the rows the face's samples share, whose kernel is the face.
    """
    v = L @ q
    Z = zero_mask(v[:, None], zero_rtol)[:, 0]
    Lz = L[Z]
    gram = Lz.T @ Lz + q[:, None] * q[None, :]
    sol, info = torch.linalg.solve_ex(gram, Lz.T)
    if int(info) != 0:
        return q[:, None]
    lev = (sol * Lz.T).sum(dim=0)
    Ls = Lz[lev < max_leverage]
    vals, vecs = torch.linalg.eigh(Ls.T @ Ls)
    tol = Ls.shape[0] * zero_rtol**2 / L.shape[0]
    k = max(int((vals <= tol).sum()), 1)
    return vecs[:, :k]


def face_basis(
    L: torch.Tensor, q: torch.Tensor, n_rows: int, zero_rtol: float,
    max_leverage: float = 0.99,
) -> torch.Tensor:
    """Orthonormal basis of the face of a mixture q: the kernel of L on the ``n_rows`` rows where
    |L q| is smallest, minus the rows that q owes to cancellation.

    An ℓ1 optimum inside a face of k samples is a vertex: besides the rows the samples share it
    vanishes on up to k-1 rows by cancellation, often as small as the shared ones. Each such
    row cuts the kernel by one dimension (leverage 1), leaving a subspace that contains none
    of the samples (measured on a FedAvg update: a 6-sample face seen as 5-dimensional, no
    column inside); shared rows are redundant (leverage < 1), so dropping the others restores
    the face.
    """
    V = (L @ q).abs()
    idx = V.topk(n_rows, largest=False).indices
    Ls = L[idx]
    tol = n_rows * zero_rtol**2 / L.shape[0]
    for _ in range(2):
        vals, vecs = torch.linalg.eigh(Ls.T @ Ls)
        k = max(int((vals <= tol).sum()), 1)
        rng, lam = vecs[:, k:], vals[k:]
        lev = ((Ls @ rng) ** 2 / lam).sum(dim=1)  # leverage of each row within the range
        keep = lev < max_leverage
        if bool(keep.all()) or int(keep.sum()) < L.shape[1]:
            break
        Ls = Ls[keep]
    return vecs[:, :k]


CONDITIONAL_CHUNK = 2**25
"""Elements of one block of the zero-padded restricted problems (found columns x zero rows x B)
in :func:`conditional_directions`. Under DP noise the first round's pool at B = 150, m = 4000
held 2738 columns with up to 2412 zero rows: as one block that asked for 7.9 GB and, with its
SVD, took the process past 24 GB (killed by the OOM killer)."""


def conditional_directions(
    L: torch.Tensor,
    found: torch.Tensor,
    *,
    zero_rtol: float,
    generator: torch.Generator,
    n_init: int = 32,
    steps: int = 200,
    dtype: torch.dtype = torch.float32,
    deadline: float | None = None,
    chunk_elems: int = CONDITIONAL_CHUNK,
) -> torch.Tensor:
    """Seeds for columns hidden next to found ones (B, F * n_init), to be split as faces.

    A sample whose ReLU pattern is close to that of a found column q_f is nearly all zero on the
    zero rows Z_f of q_f, far sparser there than any other sample. So the ℓ1 search is re-run
    on L restricted to Z_f, with q_f (invisible there) projected out; the F found columns are
    solved as zero-padded batches of at most ``chunk_elems`` elements, in the given order (the
    pool's: sparsest first), until ``deadline`` (as in
    :func:`~fl_attack.search.optimise_on_sphere`, the caller's time budget), so memory stays
    bounded however large the pool. The result vanishes on Z_f ∩ Z_j: a point of the face
    {q_f, q_j}, which :func:`split_face` resolves.
    """
    m, B = L.shape
    empty = torch.empty(B, 0, dtype=L.dtype, device=L.device)
    if found.shape[1] == 0 or B < 3:
        return empty
    zmask = zero_mask(L @ found, zero_rtol)  # (m, F)
    # the restricted problem needs B-1 zero rows to have a (B-1)-dim range (narrow layers can
    # have pool columns with fewer zeros)
    enough = zmask.sum(dim=0) >= B - 1
    if not bool(enough.any()):
        return empty
    found, zmask = found[:, enough], zmask[:, enough]
    out = [empty]
    for cols, Lz in gathered_rows(L, zmask, chunk_elems, sort=False):
        if len(out) > 1 and passed(deadline):  # at least one block
            break
        out.append(_conditional_block(Lz, found[:, cols], generator=generator, n_init=n_init,
                                      steps=steps, dtype=dtype, deadline=deadline))
    return torch.cat(out, dim=1)


def _conditional_block(Lz: torch.Tensor, found: torch.Tensor, *, generator: torch.Generator,
                       n_init: int, steps: int, dtype: torch.dtype,
                       deadline: float | None) -> torch.Tensor:
    """:func:`conditional_directions` for one block of found columns (B, F) and their zero rows
    of L, zero-padded (F, w, B)."""
    F, _, B = Lz.shape
    q = found.T / found.norm(dim=0)[:, None]  # (F, B)
    proj = torch.eye(B, dtype=Lz.dtype, device=Lz.device) - q[:, :, None] * q[:, None, :]
    _, S, Vh = torch.linalg.svd(Lz @ proj, full_matrices=False)  # rank B-1 per problem
    V = Vh[:, : B - 1].transpose(1, 2)  # (F, B, B-1)
    Sinv = 1.0 / S[:, : B - 1].clamp_min(torch.finfo(Lz.dtype).eps)
    U = Lz @ V * Sinv[:, None, :]  # (F, w, B-1) orthonormal columns
    init = torch.randn(F, n_init, B - 1, generator=generator, dtype=torch.float64)
    init = (init / init.norm(dim=-1, keepdim=True)).to(device=Lz.device, dtype=dtype)
    C = optimise_on_sphere(U.to(dtype), init, steps=steps, deadline=deadline)  # (F, B-1, K)
    Qs = V @ (Sinv[:, :, None] * C.to(Lz.dtype))  # (F, B, K)
    Qs = Qs.permute(1, 0, 2).reshape(B, F * n_init)
    return Qs / Qs.norm(dim=0, keepdim=True)


# Batched B x B factorisations on the CPU are bound by memory traffic (copies, ``tril``) once a
# batch outgrows the cache: at B = 150, 1500 float64 Gram matrices took 1.5 s in one call and
# 0.5-0.6 s in blocks of 8-32 (one thread). On CUDA one call per batch is best.
_CPU_BLOCK = 32


def _blocks(n: int, device: torch.device) -> list[slice]:
    """The blocks a batch of ``n`` matrices on ``device`` is factorised in."""
    step = _CPU_BLOCK if device.type == "cpu" else max(n, 1)
    return [slice(i, i + step) for i in range(0, n, step)]


def _one_dim_kernels(gram: torch.Tensor, tol: torch.Tensor, block: int = 3,
                     noise_tol: torch.Tensor | None = None) -> torch.Tensor:
    """Unit kernel vectors (B, c) of the Gram matrices (k, B, B) whose numerical kernel (below
    ``tol`` (k,)) is exactly one-dimensional.

    ``noise_tol`` (k, B), under noise: the eigenvalue a kernel vector v may have per unit of
    (row_noise ⊙ v)², i.e. n_rows x :data:`KERNEL_NOISE_SD`², with ``tol`` then the largest
    such value (the screen's). Each Ritz pair is judged against its own vector's noise: kept
    when the smallest is within it and the second is not.

    Most candidate row sets have no kernel; a Cholesky factor of the Gram matrix minus the
    tolerance exists exactly then, so those are dropped at once. The others get Ritz pairs
    from a small random block (:func:`fl_attack.polish.smallest_ritz_pairs`), whose two
    smallest values tell one- from higher-dimensional kernels. (Batched B x B ``eigh`` instead
    took half of the time on a 2-core CPU at B = 100.)
    """
    B = gram.shape[-1]
    gen = torch.Generator().manual_seed(0)
    Y = torch.randn(B, block, generator=gen, dtype=gram.dtype).to(gram.device)
    out = [torch.empty(0, B, dtype=gram.dtype, device=gram.device)]
    for blk in _blocks(gram.shape[0], gram.device):
        g, t = gram[blk], tol[blk]
        _, info = torch.linalg.cholesky_ex(plus_diagonal(g, -t))
        singular = info != 0
        if not bool(singular.any()):
            continue
        g, t = g[singular], t[singular]
        theta, V = smallest_ritz_pairs(g, Y[None].expand(g.shape[0], -1, -1))
        t0 = t1 = t
        if noise_tol is not None:  # tol of each Ritz vector from its own noise
            per = noise_tol[blk][singular]  # (k, B)
            t0 = (V[:, :, 0].square() * per).sum(dim=1)
            t1 = (V[:, :, 1].square() * per).sum(dim=1)
        out.append(V[:, :, 0][(theta[:, 0] <= t0) & (theta[:, 1] > t1)])
    vec = torch.cat(out)
    return (vec / vec.norm(dim=1, keepdim=True)).T


KERNEL_NOISE_SD = 2.0
"""Under noise a row set's kernel vector v may leave entries of L v up to this many noise stds
(``filtering.noise_scales``) in root mean square. Measured on a (150, 4000) weight difference
whose only noise is float32 rounding, true columns with their exact patterns: the smallest
eigenvalue was 2.2-2.5 x the predicted n_rows x std² (1.5-1.6 stds), the next 10⁶ x above."""


def _kernel_tols(n_rows: torch.Tensor, zero_rtol: float, m: int,
                 row_noise: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Eigenvalue tolerances of Gram matrices of ``n_rows`` (k,) rows of L: (one per matrix
    (k,), per coordinate of a unit vector (k, B) or None). The zero test's, or under noise
    (``row_noise`` = ν / s, ``filtering.noise_scales``) :data:`KERNEL_NOISE_SD` noise stds per
    coordinate, whichever is larger; the per-matrix one is then the largest of those (what any
    unit vector may reach, the screen's)."""
    floor = zero_rtol**2 / m
    if row_noise is None:
        return n_rows * floor, None
    per = torch.clamp_min((KERNEL_NOISE_SD * row_noise.to(n_rows)) ** 2, floor)  # (B,)
    return n_rows * per.max(), n_rows[:, None] * per[None, :]


def pattern_kernels(L: torch.Tensor, mask: torch.Tensor, zero_rtol: float,
                    deadline: float | None = None,
                    row_noise: torch.Tensor | None = None) -> torch.Tensor:
    """Unit columns whose zero rows are exactly a candidate ReLU pattern (B, c).

    For each column of ``mask`` (m, P) keep the kernel of L on those rows when it is exactly
    one-dimensional: that pattern then determines a column. Almost no pattern has a kernel, so
    every Gram matrix is first formed in float32 and screened with a Cholesky factor shifted by
    the exact test's tolerance plus 1e-4 x its mean eigenvalue (a true kernel's eigenvalue stays
    within ~1e-6 of 0 in float32; the other patterns' smallest ones are ~1e-2), so no pattern
    the exact test would keep is dropped, also under noise where the tolerance is large. Only
    the patterns that fail get their float64 Gram and the exact test. (At B = 210, m = 4000 the
    float64 Grams of every row set of a slice-sampling call took 22 s of 31 s on 2 cores.)
    Past ``deadline`` (a ``time.perf_counter()`` value, checked between chunks of patterns)
    the patterns not yet screened are skipped. Under noise (``row_noise`` = ν / s, see
    ``filtering.noise_scales``) a kernel is least-squares: its vector v may leave entries of
    L v of :data:`KERNEL_NOISE_SD` noise stds (the exact test's tolerance alone rejected the
    true patterns of 64 of 150 samples of a float32 weight difference, each within 1.6 stds).
    """
    out = [torch.empty(L.shape[1], 0, dtype=L.dtype, device=L.device)]
    for cols, gram in masked_grams(L.float(), mask):
        if passed(deadline):
            break
        near = cols[_may_have_kernel(gram, mask[:, cols].sum(dim=0), zero_rtol, L.shape[0],
                                     row_noise)]
        if near.numel():
            out.append(_exact_pattern_kernels(L, mask[:, near], zero_rtol, row_noise))
    return torch.cat(out, dim=1).contiguous()


def _may_have_kernel(gram: torch.Tensor, n_rows: torch.Tensor, zero_rtol: float,
                     m: int, row_noise: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 screen of :func:`pattern_kernels`: which Gram matrices (k, B, B) of
    ``n_rows`` (k,) rows each may have a kernel the exact test would keep (k,)."""
    tol, _ = _kernel_tols(n_rows.to(gram.dtype), zero_rtol, m, row_noise)
    shift = tol + 1e-4 * gram.diagonal(dim1=1, dim2=2).mean(dim=1)
    info = [torch.linalg.cholesky_ex(plus_diagonal(gram[blk], -shift[blk]))[1]
            for blk in _blocks(gram.shape[0], gram.device)]
    return torch.cat(info) != 0 if info else torch.zeros(0, dtype=torch.bool, device=gram.device)


def _exact_pattern_kernels(L: torch.Tensor, mask: torch.Tensor, zero_rtol: float,
                           row_noise: torch.Tensor | None = None) -> torch.Tensor:
    """The exact test of :func:`pattern_kernels` on the row sets ``mask`` (m, P) that passed
    the screen: their exactly one-dimensional kernels (B, c), from float64 Grams."""
    m = L.shape[0]
    out = [torch.empty(L.shape[1], 0, dtype=L.dtype, device=L.device)]
    for sub, exact in masked_grams(L, mask, default_chunk(L.device)):
        tol, noise_tol = _kernel_tols(mask[:, sub].sum(dim=0).to(L.dtype), zero_rtol, m,
                                      row_noise)
        out.append(_one_dim_kernels(exact, tol, noise_tol=noise_tol))
    return torch.cat(out, dim=1)


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


def _missing_slice(
    L: torch.Tensor,
    R: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    found: torch.Tensor,
    t: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, float] | None:
    """Pre-activations of the missing samples as an affine map of k - 1 free coordinates.

    The missing sample i has xᵢᵀ = pᵢᵀ R with pᵢ the i-th row of Q⁻¹: orthogonal to every found
    column, so pᵢ lies in their k-dim complement; and pᵢᵀ t = 1 (t = L⁺ g = Q 1, the scale
    fix), so it lies on a (k-1)-dim affine slice of it, the affine hull of the k missing
    samples. Returns (offset (m,), slope (m, k-1), norm of the slice's closest point to 0)
    with W x(w) + b = offset + slope w; None when the found columns leave no such slice.
    """
    dual = dual_slice(found, t)
    if dual is None:
        return None
    N, v0, U = dual
    A = weight @ (R.T @ N)  # (m, k): pre-activation slope in v
    return A @ v0 + bias, A @ U, float(v0.norm())


def dual_slice(
    found: torch.Tensor, t: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The rows p of Q⁻¹ left for the samples missing from ``found`` (B, F): p ⊥ every found
    column and pᵀ t = 1. Returns (N (B, k), v0 (k,), U (k, k-1)) with p = N (v0 + U w),
    w ∈ R^(k-1), v0 the point closest to 0; None when t is orthogonal to the complement.
    Shared by :func:`_missing_slice` and :func:`fl_attack.feasibility.pattern_margins`.
    """
    B = found.shape[0]
    k = B - found.shape[1]
    U, _, _ = torch.linalg.svd(found, full_matrices=True)
    N = U[:, B - k:]  # (B, k) complement of the found columns
    c = N.T @ t  # p = N v with cᵀ v = 1
    if float(c.norm()) <= torch.finfo(t.dtype).eps * float(t.norm()):
        return None
    Uc, _, _ = torch.linalg.svd(c[:, None], full_matrices=True)
    return N, c / c.square().sum(), Uc[:, 1:]


def complete_missing(
    L: torch.Tensor,
    R: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    found: torch.Tensor,
    t: torch.Tensor,
    *,
    zero_rtol: float,
    max_vertices: int = 40000,
    row_noise: torch.Tensor | None = None,
    deadline: float | None = None,
) -> torch.Tensor:
    """Candidates for the k = B - F columns missing from ``found`` (B, F), k ≤ 3 (B, c).

    An exact, search-free completion from what the server knows. The missing samples'
    pre-activations W xᵢ + b are affine on the (k-1)-dim slice of :func:`_missing_slice`, and
    each cell of their sign arrangement fixes the zero rows of the missing column, whose kernel
    (when one exists) is the column. k = 1 is a single point, k = 2 a line (m + 1 cells), k = 3
    a plane (O(m²) cells, skipped when the m(m-1)/2 vertices exceed ``max_vertices``).
    ``row_noise``: the least-squares kernels of a noisy update (:func:`pattern_kernels`);
    ``deadline``: as in :func:`pattern_kernels` (the caller's budget).
    """
    m, B = L.shape
    k = B - found.shape[1]
    empty = torch.empty(B, 0, dtype=L.dtype, device=L.device)
    if k < 1 or k > 3:
        return empty
    affine = _missing_slice(L, R, weight, bias, found, t)
    if affine is None:
        return empty
    offset, Aw, _ = affine
    if k == 1:
        mask = (offset <= 0)[:, None]
    elif k == 2:
        mask = _cells_1d(Aw[:, 0], offset)
    else:
        cells = _cells_2d(Aw, offset, max_vertices)
        if cells is None:
            return empty
        mask = cells
    mask = mask[:, mask.sum(dim=0) >= B - 1]
    if mask.shape[1] > 1:
        mask = torch.unique(mask, dim=1)
    return pattern_kernels(L, mask, zero_rtol, deadline=deadline, row_noise=row_noise)


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
                           zero_rtol: float, chunk_elems: int = 2**25,
                           deadline: float | None = None,
                           prune_at: tuple[float, ...] = (2.0, 3.0, 5.0),
                           row_noise: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`pattern_kernels` of the nested row sets of :func:`slice_row_sets` (B, c).

    Row set r of point p is ``idx[:lengths[r, p], p]``; sets with fewer than B - 1 rows are
    skipped and each rule's sets are deduplicated, as the mask form would. The float32 screen's
    Gram matrices are accumulated along the nesting: each rule adds only the rows beyond the
    previous one, so a point's three sets cost its largest set once (at B = 150, m = 4000 the
    separate Grams of the three rules were half of a slice-sampling call on 2 cores).

    A point is dropped as soon as a prefix of its rows is clearly full rank: adding rows only
    raises the smallest eigenvalue, so if the prefix's Gram passes the screen at the largest
    set's tolerance, none of the point's later sets can have a kernel the exact test keeps.
    Besides at each rule this is checked after ``prune_at`` x B rows. (At B = 150, m = 4000
    the largest sets have ~1500 rows but a quarter of the points are full rank by 160 rows
    and half by ~400.) Past ``deadline`` no further chunk of points starts.
    """
    m, B = L.shape
    n_rules, S = lengths.shape
    out = [torch.empty(B, 0, dtype=L.dtype, device=L.device)]
    if S == 0:
        return out[0]
    padded = torch.cat([L.float(), L.new_zeros(1, B, dtype=torch.float32)])  # row m: padding
    per = max(1, chunk_elems // (max(int(lengths[-1].max()), 1) * B))
    near: list[list[torch.Tensor]] = [[] for _ in range(n_rules)]
    ranks = torch.arange(idx.shape[0], device=idx.device)[:, None]
    checks = torch.tensor([math.ceil(f * B) for f in prune_at], device=idx.device,
                          dtype=lengths.dtype)
    for start in range(0, S, per):
        if passed(deadline):
            break
        cols = torch.arange(start, min(start + per, S), device=idx.device)
        # each point's stages: its rule lengths and the checkpoints below its largest set
        stops = torch.cat([lengths[:, cols],
                           torch.minimum(checks[:, None], lengths[-1, cols][None, :])])
        stops = torch.sort(stops, dim=0).values  # (stages, k)
        gram = torch.zeros(cols.numel(), B, B, dtype=torch.float32, device=L.device)
        lo = torch.zeros_like(cols)
        seen = torch.zeros(n_rules, cols.numel(), dtype=torch.bool, device=idx.device)
        for stage in range(stops.shape[0]):
            hi = stops[stage]
            w = int((hi - lo).max())
            if w > 0:
                offs = lo[None, :] + ranks[:w]  # (w, k)
                inside = offs < hi[None, :]
                rows = torch.where(inside, idx[offs.clamp_max(idx.shape[0] - 1), cols[None, :]], m)
                Lg = padded[rows.T]  # (k, w, B)
                gram = gram.baddbmm_(Lg.transpose(1, 2), Lg)
            lo = hi
            for r in range(n_rules):
                at = (lengths[r, cols] == hi) & ~seen[r]
                if bool(at.any()):
                    seen[r] |= at
                    sel = at & (hi >= B - 1)
                    if bool(sel.any()):
                        sel[sel.clone()] = _may_have_kernel(gram[sel], hi[sel], zero_rtol, m,
                                                            row_noise)
                        near[r].append(cols[sel])
            if stage == stops.shape[0] - 1:
                break
            alive = (_may_have_kernel(gram, lengths[-1, cols], zero_rtol, m, row_noise)
                     & ~seen[-1])
            if not bool(alive.all()):
                cols, gram, lo = cols[alive], gram[alive], lo[alive]
                stops, seen = stops[:, alive], seen[:, alive]
                if cols.numel() == 0:
                    break
    for r in range(n_rules):
        if not near[r]:
            continue
        pts = torch.cat(near[r])
        mask = ranks < lengths[r, pts][None, :]  # (top, k) prefix of each point's order
        rows = torch.where(mask, idx[:, pts], m)
        sets = torch.zeros(m + 1, pts.numel(), dtype=torch.bool, device=L.device)
        sets = sets.scatter_(0, rows, True)[:m]
        if sets.shape[1] > 1:
            sets = torch.unique(sets, dim=1)
        out.append(_exact_pattern_kernels(L, sets, zero_rtol, row_noise))
    return torch.cat(out, dim=1).contiguous()


def sample_missing(
    L: torch.Tensor,
    R: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    found: torch.Tensor,
    t: torch.Tensor,
    *,
    zero_rtol: float,
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
    most negative rows, and the most negative ``fractions`` of its negative rows (a cluster of
    13 similar samples missing at B = 100, m = 1000 shared 470-487 zero rows pairwise: the
    B-row sets only gave their common faces; 70% of the negative rows gave all 13 columns).
    Most other row sets have no kernel and are dropped; some vanish on a mixture of samples,
    which is why the caller polishes, filters and selects the candidates like any others.
    Points are drawn uniformly in balls of radii log-uniform in ``radius`` x the slice's
    distance to 0 (far points are as good as near ones: what matters is which sample
    dominates, see the measurements in ``core.md``). Measured on real photo batches with true
    columns dropped: (30, 200), 1024 points: 4/4, 7-8/8, 11-15/16, 16-17/24 in 0.1 s;
    (100, 1000), 2048 points: 7/10, 18/30, 16/60 in 3-4 s (2 threads). The caller repeats it
    as the found set grows. ``deadline``: as in :func:`pattern_kernels` (the caller's budget).
    At k = 1 the slice is a single point (the missing sample's W₀ pattern): its most negative
    rows are what a FedAvg sum keeps as zeros (``AttackConfig.update``), where the exact
    completion's full pattern has no kernel.
    """
    m, B = L.shape
    k = B - found.shape[1]
    empty = torch.empty(B, 0, dtype=L.dtype, device=L.device)
    if k < 1:
        return empty
    affine = _missing_slice(L, R, weight, bias, found, t)
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
    Q = nested_row_set_kernels(L, idx, lengths, zero_rtol, deadline=deadline, row_noise=row_noise)
    return Q[:, dedupe(Q, 1e-6)] if Q.shape[1] > 1 else Q

