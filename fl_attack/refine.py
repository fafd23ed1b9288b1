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

from fl_attack.filtering import dedupe, zero_mask
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


def face_basis(
    L: torch.Tensor, q: torch.Tensor, n_rows: int, zero_rtol: float
) -> torch.Tensor:
    """Orthonormal basis of the kernel of L on the ``n_rows`` rows where |L q| is smallest."""
    V = (L @ q).abs()
    idx = V.topk(n_rows, largest=False).indices
    Ls = L[idx]
    vals, vecs = torch.linalg.eigh(Ls.T @ Ls)
    tol = n_rows * zero_rtol**2 / L.shape[0]
    k = max(int((vals <= tol).sum()), 1)
    return vecs[:, :k]


def conditional_directions(
    L: torch.Tensor,
    found: torch.Tensor,
    *,
    zero_rtol: float,
    generator: torch.Generator,
    n_init: int = 32,
    steps: int = 200,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Seeds for columns hidden next to found ones (B, F * n_init), to be split as faces.

    A sample whose ReLU pattern is close to that of a found column q_f is nearly all zero on the
    zero rows Z_f of q_f, far sparser there than any other sample. So the ℓ1 search is re-run
    on L restricted to Z_f, with q_f (invisible there) projected out; all F found columns are
    solved as one zero-padded batch. The result vanishes on Z_f ∩ Z_j: a point of the face
    {q_f, q_j}, which :func:`split_face` resolves.
    """
    m, B = L.shape
    F = found.shape[1]
    if F == 0 or B < 3:
        return torch.empty(B, 0, dtype=L.dtype, device=L.device)
    zmask = zero_mask(L @ found, zero_rtol)  # (m, F)
    zmax = int(zmask.sum(dim=0).max())
    order = torch.argsort((~zmask).to(torch.int8), dim=0, stable=True)[:zmax]  # zero rows first
    rows_ok = zmask.gather(0, order)  # (zmax, F)
    Lz = L[order] * rows_ok[..., None]  # (zmax, F, B), padded with zero rows
    Lz = Lz.permute(1, 0, 2)  # (F, zmax, B)
    q = found.T / found.norm(dim=0)[:, None]  # (F, B)
    proj = torch.eye(B, dtype=L.dtype, device=L.device) - q[:, :, None] * q[:, None, :]
    _, S, Vh = torch.linalg.svd(Lz @ proj, full_matrices=False)  # rank B-1 per problem
    V = Vh[:, : B - 1].transpose(1, 2)  # (F, B, B-1)
    Sinv = 1.0 / S[:, : B - 1].clamp_min(torch.finfo(L.dtype).eps)
    U = Lz @ V * Sinv[:, None, :]  # (F, zmax, B-1) orthonormal columns
    init = torch.randn(F, n_init, B - 1, generator=generator, dtype=torch.float64)
    init = (init / init.norm(dim=-1, keepdim=True)).to(device=L.device, dtype=dtype)
    C = optimise_on_sphere(U.to(dtype), init, steps=steps)  # (F, B-1, K)
    Qs = V @ (Sinv[:, :, None] * C.to(L.dtype))  # (F, B, K)
    Qs = Qs.permute(1, 0, 2).reshape(B, F * n_init)
    return Qs / Qs.norm(dim=0, keepdim=True)
