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
