"""Kernels of L restricted to row sets: batched Gram algebra and the pattern-kernel test.

Every exact step of the attack reduces to the same question: on a set of rows of L (a candidate
zero pattern), does L have a kernel, and is it one-dimensional? The Gram matrices Lᵀ diag(mask) L
of many row sets are formed in chunks from gathered rows (:func:`gathered_rows`,
:func:`masked_grams`); their smallest eigenpairs come from full eigen-decompositions
(:func:`masked_gram_eigh`) or from shift-and-invert subspace iteration on Cholesky factors
(:func:`smallest_ritz_pairs`, :func:`masked_kernels`); :func:`pattern_kernels` screens thousands of
row sets in float32 and keeps the exactly one-dimensional kernels in float64. Used by polishing
(:mod:`fl_attack.steps.polish`), the completion of missing columns
(:mod:`fl_attack.steps.completion`) and face splitting (:mod:`fl_attack.steps.faces`).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from fl_attack.core.clock import passed


def default_chunk(device: torch.device) -> int:
    """Elements per chunk of the batched float64 work on ``device`` (Gram matrices, factors).

    On a CPU a chunk should stay cache-sized (large batches are bound by copies); on CUDA one
    large batch keeps the device busy.
    """
    return 2**22 if device.type == "cpu" else 2**25


def slow_batched_solves(t: torch.Tensor) -> bool:
    """Whether torch solves batched eigen- and singular-value problems larger than 32 x 32 on
    ``t``'s device one matrix after the other (CUDA), so that the attack takes batched Cholesky
    or QR factors there instead. On the CPU, LAPACK's loop over the matrices is as fast as it
    gets, and it is the path the attack was tuned on: its results stay as they were.
    """
    return t.is_cuda


def screen_chunk(device: torch.device) -> int:
    """Elements per chunk of the float32 screen of many row sets (gathered rows of a chunk of
    points, ``completion.nested_row_set_kernels``) on ``device``.

    The CPU value is the one the screen was tuned with; on CUDA a chunk four times larger
    means a quarter of the batches, and so of the reads of the device between its stages.
    """
    return 2**25 if device.type == "cpu" else 2**27


def take_rows(padded: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The rows ``rows`` (k, w) of ``padded`` (m + 1, B), as (k, w, B).

    ``index_select`` on the flattened index: the same values as ``padded[rows]``, and cheaper
    on the CPU than advanced indexing with a 2-d index (``experiments/results/tuning.md``).
    """
    return padded.index_select(0, rows.reshape(-1)).view(*rows.shape, padded.shape[1])


def gathered_rows(
    L: torch.Tensor, mask: torch.Tensor, chunk_elems: int = 2**25, *, sort: bool = True
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The rows of L selected by each boolean column of ``mask`` (m, K), gathered and zero-padded
    in chunks of at most ``chunk_elems`` elements (or one column): (column indices (k,), rows
    (k, w, B)), w the chunk's largest selection.

    Columns go in order of selection size so each chunk is padded only to its own largest one;
    with ``sort=False`` in the given order, and each column's rows in row order (for callers
    that stop at a deadline and rank their columns; the row order changes float32 sums, and so
    which minimum a non-convex search reaches). A zero set holds 40-50% of the m rows, so
    products over the gathered rows cost about half of those over all m rows with the others
    masked to zero (and a quarter in the first polishing pass, which uses 0.75 x the smallest
    zero count).
    """
    m, B = L.shape
    K = mask.shape[1]
    counts = mask.sum(dim=0).cpu()
    order = torch.argsort(counts) if sort else torch.arange(K)
    padded = torch.cat([L, L.new_zeros(1, B)])  # row m is the padding
    start = 0
    while start < K:
        widths = torch.cummax(counts[order[start:]].clamp_min(1), dim=0).values
        fits = torch.arange(1, K - start + 1) * widths * B <= chunk_elems  # a prefix
        end = start + max(int(fits.sum()), 1)
        cols = order[start:end].to(mask.device)
        w = int(widths[end - start - 1])
        sub = mask[:, cols].T  # (k, m)
        if sort:
            rows = torch.topk(sub.to(torch.int8), w, dim=1, sorted=False).indices  # selected first
        else:  # selected first, in row order
            rows = torch.argsort((~sub).to(torch.int8), dim=1, stable=True)[:, :w]
        yield cols, take_rows(padded, torch.where(sub.gather(1, rows), rows, m))
        start = end


def plus_diagonal(gram: torch.Tensor, shift: torch.Tensor, *, inplace: bool = False
                  ) -> torch.Tensor:
    """``gram + shift_k I`` for each matrix of ``gram`` (k, B, B), ``shift`` (k,).

    Shifting only the diagonal (of a copy unless ``inplace``) instead of broadcasting a
    (k, B, B) multiple of the identity: no (k, B, B) temporary, one add per diagonal entry,
    which matters where every sampled row set's Gram matrix is shifted before a Cholesky screen.
    """
    out = gram if inplace else gram.clone()
    out.diagonal(dim1=-2, dim2=-1).add_(shift[:, None].to(gram.dtype))
    return out


def masked_grams(
    L: torch.Tensor, mask: torch.Tensor, chunk_elems: int = 2**25
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Lᵀ diag(mask_k) L for the columns k of ``mask`` (m, K), in chunks: (column indices (k,),
    (k, B, B)).

    ``mask`` is boolean (row subsets: the rows are gathered, :func:`gathered_rows`) or real (row
    weights). Chunks keep the products under ``chunk_elems`` elements.
    """
    m, B = L.shape
    K = mask.shape[1]
    if mask.dtype == torch.bool:
        for cols, Lg in gathered_rows(L, mask, chunk_elems):
            yield cols, Lg.transpose(1, 2) @ Lg
        return
    per = max(1, chunk_elems // (m * B))
    Lt = L.T
    for start in range(0, K, per):
        cols = torch.arange(start, min(start + per, K), device=mask.device)
        msk = mask[:, cols].T.to(L.dtype)  # (k, m)
        yield cols, (Lt[None] * msk[:, None, :]) @ L


def masked_gram_eigh(
    L: torch.Tensor, mask: torch.Tensor, chunk_elems: int = 2**25
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigen-decompositions of Lᵀ diag(mask_k) L for each column k of ``mask`` (m, K).

    ``mask`` is boolean (row subsets) or real (row weights). Returns (eigenvalues (K, B)
    ascending, eigenvectors (K, B, B)) in L's dtype.
    """
    B, K = L.shape[1], mask.shape[1]
    vals = torch.empty(K, B, dtype=L.dtype, device=L.device)
    vecs = torch.empty(K, B, B, dtype=L.dtype, device=L.device)
    for cols, gram in masked_grams(L, mask, chunk_elems):
        vals[cols], vecs[cols] = torch.linalg.eigh(gram)
    return vals, vecs


def masked_kernels(
    L: torch.Tensor,
    mask: torch.Tensor,
    Q: torch.Tensor,
    eig_tol: torch.Tensor,
    *,
    block: int = 10,
    iters: int = 2,
    chunk_elems: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Project each q (column of ``Q``) onto the numerical kernel of L on its rows ``mask[:, k]``.

    The same answer as a full eigen-decomposition of each masked Gram matrix
    (:func:`masked_gram_eigh` + :func:`project_to_kernel`), but from a batched Cholesky factor
    instead: two steps of shift-and-invert subspace iteration on the block [q, ``block``-1 random
    vectors], then Rayleigh-Ritz in that block. Kernel dimensions above ``block`` are reported as
    ``block``. Why: batched B x B eigen-solves for B > 32 are a sequential loop on CUDA, three
    orders of magnitude slower than their Cholesky factors.
    Returns (unit columns (B, K), kernel dimensions (K,)).
    """
    m, B = L.shape
    K = Q.shape[1]
    r = min(block, B)
    out = torch.empty_like(Q)
    kdim = torch.empty(K, dtype=torch.long, device=L.device)
    gen = torch.Generator().manual_seed(0)
    omega = torch.randn(B, r - 1, generator=gen, dtype=L.dtype).to(L.device)
    for cols, gram in masked_grams(L, mask, chunk_elems or default_chunk(L.device)):
        k = gram.shape[0]
        q = Q[:, cols].T  # (k, B)
        Y = torch.cat([q[:, :, None], omega[None].expand(k, -1, -1)], dim=2)  # (k, B, r)
        theta, V = smallest_ritz_pairs(gram, Y, iters)
        out[:, cols], kdim[cols] = project_to_kernel(q.T, theta, V, eig_tol[cols])
    return out, kdim


def smallest_ritz_pairs(
    gram: torch.Tensor, Y: torch.Tensor, iters: int = 2
) -> tuple[torch.Tensor, torch.Tensor]:
    """Approximate smallest eigenpairs of symmetric PSD matrices ``gram`` (k, B, B) from a
    starting block ``Y`` (k, B, r): (Ritz values (k, r) ascending, Ritz vectors (k, B, r)).

    ``iters`` steps of shift-and-invert subspace iteration with a Cholesky factor of
    ``gram + 1e-12 max(diag)``, then Rayleigh-Ritz in the block: the kernel is amplified by
    1/shift² against the rest of the spectrum. Matrices without that factor get the r smallest
    pairs of a full ``eigh`` instead. Why not ``eigh`` for all: batched B x B eigen-solves for
    B > 32 are a sequential loop on CUDA.
    """
    B, r = gram.shape[-1], Y.shape[-1]
    shift = 1e-12 * gram.diagonal(dim1=1, dim2=2).amax(dim=1)
    chol, info = torch.linalg.cholesky_ex(plus_diagonal(gram, shift))
    bad = info != 0
    any_bad = bool(bad.any())  # the one read of the device
    if any_bad:  # keep the batch finite; these take the eigh fallback below
        chol[bad] = torch.eye(B, dtype=gram.dtype, device=gram.device)
    for _ in range(iters):
        Y = torch.linalg.qr(torch.cholesky_solve(Y, chol)).Q
    T = Y.transpose(1, 2) @ gram @ Y  # (k, r, r)
    theta, S = torch.linalg.eigh(0.5 * (T + T.transpose(1, 2)))
    V = Y @ S  # Ritz vectors, ascending Ritz values
    if any_bad:  # not positive definite after the shift: fall back to eigh
        vals, vecs = torch.linalg.eigh(gram[bad])
        theta[bad], V[bad] = vals[:, :r], vecs[:, :, :r]
    return theta, V


def project_to_kernel(
    Q: torch.Tensor, vals: torch.Tensor, vecs: torch.Tensor, eig_tol: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Project each q onto its numerical kernel; returns (unit columns, kernel dimensions).

    ``vals`` (K, r) ascending and ``vecs`` (K, B, r) are eigenpairs of each masked Gram matrix:
    all of them (full eigen-decompositions, what ``polish`` uses up to ``polish.EIGH_UP_TO``), or
    the Ritz pairs of :func:`masked_kernels`.
    """
    in_kernel = vals <= eig_tol[:, None]  # (K, B)
    in_kernel[:, 0] = True
    coeff = torch.einsum("kbj,bk->kj", vecs, Q) * in_kernel  # (K, B)
    P = torch.einsum("kbj,kj->bk", vecs, coeff)
    weak = P.norm(dim=0) < 1e-6  # q orthogonal to its kernel: take the smallest eigenvector
    if bool(weak.any()):
        P[:, weak] = vecs[weak, :, 0].T
    return P / P.norm(dim=0, keepdim=True), in_kernel.sum(dim=1)


# Batched B x B factorisations on the CPU are bound by memory traffic (copies, ``tril``) once a
# batch outgrows the cache, so they run in blocks; on CUDA one call per batch is best.
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
    from a small random block (:func:`smallest_ritz_pairs`), whose two
    smallest values tell one- from higher-dimensional kernels (batched B x B ``eigh`` is far
    slower).
    """
    B = gram.shape[-1]
    gen = torch.Generator().manual_seed(0)
    Y = torch.randn(B, block, generator=gen, dtype=gram.dtype).to(gram.device)
    out = [torch.empty(0, B, dtype=gram.dtype, device=gram.device)]
    for blk in _blocks(gram.shape[0], gram.device):
        g, t = gram[blk], tol[blk]
        _, info = torch.linalg.cholesky_ex(plus_diagonal(g, -t))
        singular = torch.nonzero(info != 0).squeeze(1)  # one read of the device
        if not singular.numel():
            continue
        g, t = g.index_select(0, singular), t[singular]
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
(``filtering.noise_scales``) in root mean square: true columns with their exact patterns stay
well within it, the next eigenvalue is orders of magnitude above."""


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
    the patterns that fail get their float64 Gram and the exact test.
    Past ``deadline`` (a ``time.perf_counter()`` value, checked between chunks of patterns)
    the patterns not yet screened are skipped. Under noise (``row_noise`` = ν / s, see
    ``filtering.noise_scales``) a kernel is least-squares: its vector v may leave entries of
    L v of :data:`KERNEL_NOISE_SD` noise stds (the exact test's tolerance alone rejects many
    true patterns of a float32 weight difference).
    """
    out = [torch.empty(L.shape[1], 0, dtype=L.dtype, device=L.device)]
    for cols, gram in masked_grams(L.float(), mask):
        if passed(deadline):
            break
        near = cols[may_have_kernel(gram, mask[:, cols].sum(dim=0), zero_rtol, L.shape[0],
                                     row_noise)]
        if near.numel():
            out.append(exact_pattern_kernels(L, mask[:, near], zero_rtol, row_noise))
    return torch.cat(out, dim=1).contiguous()


def may_have_kernel(gram: torch.Tensor, n_rows: torch.Tensor, zero_rtol: float,
                     m: int, row_noise: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 screen of :func:`pattern_kernels`: which Gram matrices (k, B, B) of
    ``n_rows`` (k,) rows each may have a kernel the exact test would keep (k,)."""
    tol, _ = _kernel_tols(n_rows.to(gram.dtype), zero_rtol, m, row_noise)
    shift = tol + 1e-4 * gram.diagonal(dim1=1, dim2=2).mean(dim=1)
    info = [torch.linalg.cholesky_ex(plus_diagonal(gram[blk], -shift[blk]))[1]
            for blk in _blocks(gram.shape[0], gram.device)]
    return torch.cat(info) != 0 if info else torch.zeros(0, dtype=torch.bool, device=gram.device)


def known_free(L: torch.Tensor, mask: torch.Tensor, known: torch.Tensor, zero_rtol: float,
               row_noise: torch.Tensor | None = None, chunk_elems: int = 2**24) -> torch.Tensor:
    """Which row sets ``mask`` (m, P) none of the ``known`` columns (B, F) vanishes on (P,).

    A known column q with ‖L_S q‖² within the exact test's tolerance lies in the kernel of L on
    the rows S, so that kernel is q itself or at least two-dimensional: the set can give no
    column but q, and the exact test need not see it. Under noise q's tolerance is the one its
    own Ritz vector would get (``row_noise``, :func:`_one_dim_kernels`). The sets are tested
    ``chunk_elems`` / m at a time.
    """
    m, P = mask.shape
    free = torch.ones(P, dtype=torch.bool, device=mask.device)
    if known.shape[1] == 0:
        return free
    known = known / known.norm(dim=0, keepdim=True)
    energy = (L @ known).float().square()  # (m, F)
    weights = known.float().square()  # (B, F): under noise, q's tolerance per coordinate
    per = max(1, chunk_elems // m)
    for start in range(0, P, per):
        sets = mask[:, start:start + per].T.float()  # (p, m)
        resid = sets @ energy  # (p, F): ‖L_S q‖² per set and column
        tol, noise_tol = _kernel_tols(sets.sum(dim=1), zero_rtol, m, row_noise)
        limit = tol[:, None] if noise_tol is None else noise_tol @ weights
        free[start:start + per] = ~(resid <= limit).any(dim=1)
    return free


def exact_pattern_kernels(L: torch.Tensor, mask: torch.Tensor, zero_rtol: float,
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
