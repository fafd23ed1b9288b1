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
from fl_attack.columns import dedupe, zero_mask
from fl_attack.kernels import gathered_rows
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
    of the samples; shared rows are redundant (leverage < 1), so dropping the others restores
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
