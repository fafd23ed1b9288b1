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
from collections.abc import Iterator

import torch

from fl_attack.core import batched_lu, kernels
from fl_attack.core.clock import passed
from fl_attack.core.columns import dedupe, pattern_keys, zero_mask
from fl_attack.core.kernels import default_chunk, gathered_rows, plus_diagonal
from fl_attack.steps.sampling import random_row_subsets, submatrix_kernels
from fl_attack.steps.search import optimise_on_sphere


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

    Parameters
    ----------
    L : (m, B)
        The decomposition's left factor.
    N : (B, k)
        Orthonormal basis of the face.
    zero_rtol, generator
        The zero test; the random generator of the row samples.
    max_samples, per_column
        Caps on the (k-1)-row subsets drawn.

    Returns
    -------
    (Q (B, c), zeros (c,))
        Unit candidates and their zero counts, only directions with more zeros than a generic
        vertex of the face (shared zeros + k - 1).

    Notes
    -----
    Three reads of the device per face (the free rows, the kept subsets, the duplicates): the
    subsets whose rows lack rank k - 1 are masked out of the ranking instead of removed.
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
    zeros = zero_mask(A @ C, zero_rtol).sum(dim=0)  # (S,)
    vertex = L.shape[0] - n_free + k - 1  # the shared zeros and k - 1 cancellations
    valid = ok & (zeros > vertex)
    # most zeros first, ties in subset order: the valid subsets lead the order
    order = torch.argsort(torch.where(valid, zeros, -1), descending=True, stable=True)[: 4 * k]
    keep = order[valid[order]]
    C, zeros = C[:, keep], zeros[keep]
    uniq = dedupe(C, 1e-6)
    Q = N @ C[:, uniq]
    return Q / Q.norm(dim=0, keepdim=True), zeros[uniq]


def vertex_face_basis(
    L: torch.Tensor, q: torch.Tensor, zero_rtol: float, max_leverage: float = 0.99
) -> torch.Tensor:
    """The face a vertex sits in: the kernel of L on its zero rows minus the coincidental ones
    (B, k); :func:`vertex_face_bases` for one vertex."""
    vecs, dims = vertex_face_bases(L, q[:, None], zero_rtol, max_leverage)
    return vecs[0, :, : int(dims[0])]


def face_basis(
    L: torch.Tensor, q: torch.Tensor, n_rows: int, zero_rtol: float,
    max_leverage: float = 0.99,
) -> torch.Tensor:
    """Orthonormal basis of the face of a mixture q (B, k); :func:`face_bases` for one
    direction."""
    vecs, dims = face_bases(L, q[:, None], n_rows, zero_rtol, max_leverage)
    return vecs[0, :, : int(dims[0])]


def _range_leverage(Ls: torch.Tensor, vals: torch.Tensor, vecs: torch.Tensor,
                    dims: torch.Tensor) -> torch.Tensor:
    """Leverage of each row of ``Ls`` (K, n, B) within the range of its Gram matrix (K, n):
    the eigenpairs ``vals`` (K, B), ``vecs`` (K, B, B) past the first ``dims`` (K,)."""
    in_range = torch.arange(Ls.shape[-1], device=Ls.device)[None, :] >= dims[:, None]
    lam = torch.where(in_range, vals, torch.ones_like(vals))
    P = (Ls @ vecs).square() / lam[:, None, :]
    return torch.where(in_range[:, None, :], P, torch.zeros_like(P)).sum(dim=2)


def _compact_rows(Ls: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """The rows ``keep`` (K, n) of each ``Ls`` (K, n, B), in their order, zero-padded to the
    largest count (K, w, B)."""
    counts = keep.sum(dim=1)
    w = max(int(counts.max()), 1) if keep.numel() else 1
    order = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)[:, :w]
    rows = Ls.gather(1, order[:, :, None].expand(-1, -1, Ls.shape[-1]))
    real = torch.arange(w, device=Ls.device)[None, :] < counts[:, None]
    return torch.where(real[:, :, None], rows, torch.zeros_like(rows))


def face_bases(
    L: torch.Tensor, Q: torch.Tensor, n_rows: int, zero_rtol: float,
    max_leverage: float = 0.99,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The faces of the mixtures ``Q`` (B, K), all at once: each one's kernel of L on the
    ``n_rows`` rows where |L q| is smallest, minus the rows that q owes to cancellation.

    An ℓ1 optimum inside a face of k samples is a vertex: besides the rows the samples share it
    vanishes on up to k-1 rows by cancellation, often as small as the shared ones. Each such
    row cuts the kernel by one dimension (leverage 1), leaving a subspace that contains none
    of the samples; shared rows are redundant (leverage < 1), so dropping the others restores
    the face. The K Gram matrices are one batch (one batched ``eigh``, one more for the faces
    that drop rows): no loop over the directions, at most two reads of the device per batch.

    Parameters
    ----------
    L : (m, B)
        The decomposition's left factor.
    Q : (B, K)
        Unit directions, each a mixture inside a face.
    n_rows
        Rows of each kernel (the smallest entries of L q).
    zero_rtol
        The zero test; the kernel's eigenvalue tolerance is ``n_rows`` x its square / m.
    max_leverage
        Rows at or above this leverage are coincidental.

    Returns
    -------
    (vecs (K, B, B), dims (K,))
        Eigenvectors of each Gram matrix, ascending: the first ``dims[j]`` (at least 1) of
        ``vecs[j]`` are face j's orthonormal basis.
    """
    m, B = L.shape
    idx = (L @ Q).abs().topk(n_rows, dim=0, largest=False).indices.T  # (K, n_rows)
    Ls = L.index_select(0, idx.reshape(-1)).view(*idx.shape, B)
    tol = n_rows * zero_rtol**2 / m
    vals, vecs = torch.linalg.eigh(Ls.transpose(1, 2) @ Ls)
    dims = (vals <= tol).sum(dim=1).clamp_min(1)
    keep = _range_leverage(Ls, vals, vecs, dims) < max_leverage
    count = keep.sum(dim=1)
    redo = torch.nonzero((count < n_rows) & (count >= B)).squeeze(1)  # drop rows, once more
    if redo.numel():
        Lk = _compact_rows(Ls[redo], keep[redo])
        vals2, vecs[redo] = torch.linalg.eigh(Lk.transpose(1, 2) @ Lk)
        dims[redo] = (vals2 <= tol).sum(dim=1).clamp_min(1)
    return vecs, dims


def vertex_face_bases(
    L: torch.Tensor, Q: torch.Tensor, zero_rtol: float, max_leverage: float = 0.99,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The faces the vertices ``Q`` (B, K) sit in, all at once: each one's kernel of L on its
    zero rows minus the coincidental ones.

    A vertex of a face owes k-1 of its zeros to cancellations; those rows have leverage 1, and
    dropping them leaves the rows the face's samples share, whose kernel is the face. The
    zero rows are gathered and zero-padded (:func:`~fl_attack.core.kernels.gathered_rows`, in
    column order), the leverages come from one batched solve and the kernels from one batched
    ``eigh``.

    Parameters
    ----------
    L : (m, B)
        The decomposition's left factor.
    Q : (B, K)
        Unit directions, each a vertex of a face.
    zero_rtol
        The zero test.
    max_leverage
        Rows at or above this leverage are coincidental.

    Returns
    -------
    (vecs (K, B, B), dims (K,))
        As :func:`face_bases`; dimension 1 (the vertex alone) where its zero rows leave no
        unique solve.
    """
    m, B = L.shape
    K = Q.shape[1]
    vecs = torch.empty(K, B, B, dtype=L.dtype, device=L.device)
    dims = torch.ones(K, dtype=torch.long, device=L.device)
    zeros = zero_mask(L @ Q, zero_rtol)
    counts = zeros.sum(dim=0)
    for cols, Lz in gathered_rows(L, zeros, default_chunk(L.device), sort=False):
        q, LzT = Q[:, cols].T, Lz.transpose(1, 2)
        sol, info = batched_lu.solve_ex(LzT @ Lz + q[:, :, None] * q[:, None, :], LzT)
        lev = (sol * LzT).sum(dim=1)  # (k, w)
        real = torch.arange(Lz.shape[1], device=L.device)[None, :] < counts[cols][:, None]
        keep = real & (lev < max_leverage)  # padding rows are not the vertex's
        Ls = _compact_rows(Lz, keep)
        vals, vecs[cols] = torch.linalg.eigh(Ls.transpose(1, 2) @ Ls)
        tol = keep.sum(dim=1).to(L.dtype) * zero_rtol**2 / m
        found = (vals <= tol[:, None]).sum(dim=1).clamp_min(1)
        dims[cols] = torch.where(info == 0, found, torch.ones_like(found))
    return vecs, dims


def face_keys(L: torch.Tensor, vecs: torch.Tensor, dims: torch.Tensor,
              zero_rtol: float) -> list[bytes]:
    """Keys of the faces ``vecs[j, :, :dims[j]]``, so that a face is split once.

    Parameters
    ----------
    L : (m, B)
        The decomposition's left factor.
    vecs : (K, B, B), dims : (K,)
        Face bases as :func:`face_bases` gives them.
    zero_rtol
        The zero test of the rows the whole face vanishes on.

    Returns
    -------
    list of bytes
        ``columns.pattern_keys`` of each face's shared zero rows, read off the device at once.
    """
    width = int(dims.max()) if dims.numel() else 1
    A = torch.matmul(L, vecs[:, :, :width])  # (K, m, width)
    inside = torch.arange(width, device=L.device)[None, None, :] < dims[:, None, None]
    norm = torch.where(inside, A, torch.zeros_like(A)).norm(dim=2)  # (K, m)
    shared = norm <= zero_rtol * norm.amax(dim=1, keepdim=True)
    return pattern_keys(shared.T)


def candidate_faces(
    L: torch.Tensor, Q: torch.Tensor, *, n_rows: int, zero_rtol: float,
    max_leverage: float = 0.99, max_dim: int = 8, vertex: bool = False,
    chunk_elems: int | None = None,
) -> Iterator[tuple[torch.Tensor, bytes]]:
    """The faces of the directions ``Q`` (B, K), in column order, for face splitting.

    Bases come from :func:`face_bases` (or, with ``vertex``, :func:`vertex_face_bases`) in
    batches of at most ``chunk_elems`` gathered elements (``kernels.default_chunk``), each
    batch computed when the caller asks past the previous one; the dimensions and keys of a
    batch are read off the device once. A caller that stops early (its budget of faces) leaves
    the later batches uncomputed.

    Parameters
    ----------
    L : (m, B)
        The decomposition's left factor.
    Q : (B, K)
        Directions inside faces or, with ``vertex``, vertices of faces.
    n_rows, zero_rtol, max_leverage
        As for :func:`face_bases` (``n_rows`` is not used for vertices).
    max_dim
        Faces of more dimensions are left out (``AttackConfig.max_face_dim``).
    vertex
        Whether ``Q`` are vertices.
    chunk_elems
        Elements of one batch's gathered rows (default ``kernels.default_chunk``).

    Yields
    ------
    (N (B, k), key)
        The orthonormal basis of each face of dimension 2 to ``max_dim`` and its key
        (:func:`face_keys`).
    """
    m, B = L.shape
    K = Q.shape[1]
    width = m if vertex else n_rows  # rows gathered per direction (at most)
    per = max(1, (chunk_elems or default_chunk(L.device)) // (width * B))
    for start in range(0, K, per):
        part = Q[:, start:start + per]
        if vertex:
            vecs, dims = vertex_face_bases(L, part, zero_rtol, max_leverage)
        else:
            vecs, dims = face_bases(L, part, n_rows, zero_rtol, max_leverage)
        ok = torch.nonzero((dims >= 2) & (dims <= max_dim)).squeeze(1)
        if not ok.numel():
            continue
        vecs, dims = vecs[ok], dims[ok]
        for N, k, key in zip(vecs, dims.tolist(), face_keys(L, vecs, dims, zero_rtol),
                             strict=True):
            yield N[:, :k], key


CONDITIONAL_CHUNK = 2**25
"""Elements of one block of the zero-padded restricted problems (found columns x zero rows x B)
in :func:`conditional_directions`: a noisy update's pool can hold thousands of columns with
thousands of zero rows, far more than memory as one block."""


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
    :func:`~fl_attack.steps.search.optimise_on_sphere`, the caller's time budget), so memory stays
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
    U, V, scale = _restricted_ranges(Lz, q)
    init = torch.randn(F, n_init, B - 1, generator=generator, dtype=torch.float64)
    init = (init / init.norm(dim=-1, keepdim=True)).to(device=Lz.device, dtype=dtype)
    C = optimise_on_sphere(U.to(dtype), init, steps=steps, deadline=deadline)  # (F, B-1, K)
    Qs = V @ (scale[:, :, None] * C.to(Lz.dtype))  # (F, B, K)
    Qs = Qs.permute(1, 0, 2).reshape(B, F * n_init)
    return Qs / Qs.norm(dim=0, keepdim=True)


def _restricted_ranges(Lz: torch.Tensor, q: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Orthonormal bases of the ranges of ``Lz`` (F, w, B) on the complements of the unit
    rows of ``q`` (F, B): (U (F, w, B-1), V (F, B, B-1), scale (F, B-1)) with
    U = Lz V diag(scale) and V ⊥ q.

    By SVD of Lz (I - q qᵀ) (rank B-1 per problem; V its right singular vectors, scale the
    inverse singular values), or, where ``kernels.slow_batched_solves`` (CUDA: a block of a
    hundred found columns would be a hundred SVDs, one after the other), by a Cholesky factor
    C of AᵀA for A = Lz T, T the Householder complement of q: U = A C⁻ᵀ, V = T C⁻ᵀ, scale 1.
    Either U spans the same range with orthonormal columns, so the sphere searched is the same
    up to a rotation (the random starts are rotation invariant).
    """
    F, _, B = Lz.shape
    if not kernels.slow_batched_solves(Lz):
        proj = torch.eye(B, dtype=Lz.dtype, device=Lz.device) - q[:, :, None] * q[:, None, :]
        _, S, Vh = torch.linalg.svd(Lz @ proj, full_matrices=False)  # rank B-1 per problem
        V = Vh[:, : B - 1].transpose(1, 2)  # (F, B, B-1)
        Sinv = 1.0 / S[:, : B - 1].clamp_min(torch.finfo(Lz.dtype).eps)
        return Lz @ V * Sinv[:, None, :], V, Sinv
    eye = torch.eye(B, dtype=Lz.dtype, device=Lz.device)
    v = q + torch.where(q[:, :1] >= 0, 1.0, -1.0) * eye[0]  # H q = ∓e₁ for H = I - 2vvᵀ/vᵀv
    H = eye - 2.0 * v[:, :, None] * v[:, None, :] / v.square().sum(dim=1)[:, None, None]
    T = H[:, :, 1:]  # (F, B, B-1) orthonormal columns ⊥ q
    A = Lz @ T
    gram = A.transpose(1, 2) @ A
    shift = 1e-12 * gram.diagonal(dim1=1, dim2=2).amax(dim=1)
    chol, info = torch.linalg.cholesky_ex(plus_diagonal(gram, shift))
    chol = torch.where((info != 0)[:, None, None], eye[1:, 1:], chol)  # degenerate: finite
    U = torch.linalg.solve_triangular(chol, A.transpose(1, 2), upper=False).transpose(1, 2)
    V = torch.linalg.solve_triangular(chol, T.transpose(1, 2), upper=False).transpose(1, 2)
    return U, V, torch.ones(F, B - 1, dtype=Lz.dtype, device=Lz.device)
