"""SPEAR's sampling step (SPEAR §3.3), batched: kernels of random (k-1)-row submatrices.

Used twice: as the SPEAR baseline on the whole k = B problem, and inside SPEAR++ to split a
small "face" (a k-dimensional subspace spanned by similar samples, see
:mod:`fl_attack.steps.faces`).
"""

from __future__ import annotations

import torch


def random_row_subsets(
    n_rows: int, size: int, n_samples: int, *, generator: torch.Generator,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """``n_samples`` random subsets of ``size`` distinct rows out of ``n_rows`` (S, size)."""
    if size > n_rows:
        raise ValueError(f"cannot draw {size} distinct rows out of {n_rows}")
    keys = torch.rand(n_samples, n_rows, generator=generator, dtype=torch.float32)
    if weights is not None:
        keys = keys.pow(1.0 / weights.float().clamp_min(1e-6)[None])
        return keys.topk(size, dim=1).indices
    return keys.topk(size, dim=1, largest=False).indices


def submatrix_kernels(A: torch.Tensor, rows: torch.Tensor, *, lstsq: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Unit kernel directions of A[rows_s] for each sample s; returns (C (k, S), rank_ok (S,)).

    With ``lstsq`` the subsets may have more than k-1 rows (least-squares kernel, more stable
    under noise). ``rank_ok`` is False where the submatrix lacks rank k-1 (kernel not unique).
    """
    k = A.shape[1]
    sub = A[rows]  # (S, r, k)
    gram = sub.transpose(1, 2) @ sub  # (S, k, k)
    vals, vecs = torch.linalg.eigh(gram)
    scale = vals[:, -1].clamp_min(torch.finfo(A.dtype).tiny)
    rank_ok = vals[:, 1] > 1e-10 * scale if k > 1 else torch.ones_like(scale, dtype=torch.bool)
    return vecs[:, :, 0].T.contiguous(), rank_ok
