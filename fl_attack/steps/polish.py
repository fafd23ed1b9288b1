"""Step 2b (SPEAR++ §4.4, "rounding"): snap approximate sparse directions to exact kernels.

An optimised q is close to a true column when the smallest entries of L q are its true zeros;
the exact direction is then in the kernel of L restricted to those rows. Least squares over many
rows (not just B-1) makes it stable, and a second pass over all predicted zeros reaches float
precision. When several samples share those zeros the kernel has dimension k > 1: q is then
projected onto it (keeping what the optimiser found) and the dimension is reported, so the
caller can split that small subspace (see :mod:`fl_attack.steps.faces`).
"""

from __future__ import annotations

import torch

from fl_attack.core.clock import passed
from fl_attack.core.columns import zero_mask
from fl_attack.core.kernels import (
    default_chunk,
    gathered_rows,
    masked_gram_eigh,
    masked_grams,
    masked_kernels,
    plus_diagonal,
    project_to_kernel,
)
from fl_attack.steps.filtering import noise_scales, noisy_sparsity

EIGH_UP_TO = 32
"""Polishing uses full eigen-decompositions up to this B and :func:`masked_kernels` above it.

Batched B x B ``eigh`` is fast on CPUs and, for B <= 32, on CUDA (cuSOLVER batches it); above
that CUDA loops over the matrices, which made polishing most of the attack's time. The two
give the same kernels up to rounding (unit-tested); the exact decomposition is kept where it
costs nothing.
"""

EXTRA_PASSES = 2
"""Passes after the second for the columns whose zero rows still changed. A first pass on
the smallest rows can leave a column off by 1e-4 of its largest entry, enough to admit a
non-zero row into the second pass's zeros (or drop a zero one); that column is then off by as
much, and its wrong zero breaks λ = 1 at (150, 4000). One more pass on the corrected zeros
reaches float precision."""


def max_leverage(L: torch.Tensor, Q: torch.Tensor, mask: torch.Tensor,
                 chunk_elems: int | None = None) -> torch.Tensor:
    """Largest leverage of a zero row of each candidate (K,), in [0, 1].

    A row has leverage 1 when dropping it from the zero set enlarges the kernel: the direction
    then owes its zeros to a coincidence of B-1 rows (a generic kernel, or a vertex of a face
    whose extra zeros are cancellations) rather than to a sample's ReLU pattern, where every
    zero row is redundant. True columns have all leverages well below 1.
    """
    out = torch.empty(Q.shape[1], dtype=L.dtype, device=L.device)
    chunks = gathered_rows(L, mask, chunk_elems or default_chunk(L.device))
    for cols, Lg in chunks:  # (k, w, B), zero rows padded
        q = Q[:, cols].T  # (k, B)
        gram = Lg.transpose(1, 2) @ Lg + q[:, :, None] * q[:, None, :]  # definite unless singular
        chol, info = torch.linalg.cholesky_ex(gram)  # leverage lᵀ (C Cᵀ)⁻¹ l = |C⁻¹ l|²
        sol = torch.linalg.solve_triangular(chol, Lg.transpose(1, 2), upper=False)  # (k, B, w)
        lev = sol.square().sum(dim=1).amax(dim=1)  # padding rows give 0
        lev[(info != 0) | ~torch.isfinite(lev)] = 1.0  # singular: the kernel is not unique
        out[cols] = lev
    return out


def polish(
    L: torch.Tensor,
    Q: torch.Tensor,
    *,
    n_rows: int,
    zero_rtol: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round directions ``Q`` (B, K) to exact kernel directions (SPEAR++ §4.4).

    The face dimension is the dimension of the kernel on the rows where the optimised q was
    smallest. Above 1, those rows are shared by several samples and q sits in their face (a
    mixture unless it is split, see :mod:`fl_attack.steps.faces`).

    Parameters
    ----------
    L : (m, B)
        The decomposition's left factor.
    Q : (B, K)
        Approximate sparse directions.
    n_rows
        Rows of the first pass (the smallest entries of L q).
    zero_rtol
        The zero test of the second pass (all predicted zeros).

    Returns
    -------
    (Q_polished (B, K), zero counts (K,), face dimensions (K,), max leverages (K,))
        Unit kernel directions in float64; leverages as in :func:`max_leverage`, 1 where the
        final zero set still has a kernel of dimension > 1.
    """
    L = L.double()
    Q = Q.to(L.dtype)
    m, B = L.shape
    V = L @ Q
    n_rows = max(min(n_rows, m - 1), B - 1)
    idx = V.abs().topk(n_rows, dim=0, largest=False).indices
    mask = torch.zeros_like(V, dtype=torch.bool).scatter_(0, idx, True)
    Q, face_dim = _kernel_pass(L, mask, Q, zero_rtol)
    kdim = face_dim.clone()
    new_mask = torch.empty_like(mask)  # the zeros of each column's latest fit
    cols = torch.arange(Q.shape[1], device=L.device)
    for extra in range(EXTRA_PASSES + 2):  # the second pass for all, then while zeros change
        new_mask[:, cols] = zeros = zero_mask(L @ Q[:, cols], zero_rtol)
        enough = zeros.sum(dim=0) >= B - 1
        changed = enough & (zeros != mask[:, cols]).any(dim=0)
        mask[:, cols[enough]] = zeros[:, enough]
        if extra:
            cols = cols[changed]
        if not cols.numel() or extra > EXTRA_PASSES:
            break
        Q[:, cols], kdim[cols] = _kernel_pass(L, mask[:, cols], Q[:, cols], zero_rtol)
    lev = max_leverage(L, Q, mask)
    lev[kdim > 1] = 1.0  # still inside a face: a mixture of samples, not a column
    # the zeros the rounded direction has, not the rows it was fitted on: a least-squares
    # fit to rows that are no sample's zeros (n_rows can exceed a narrow layer's τ m) has none
    return Q, new_mask.sum(dim=0), face_dim, lev


def _kernel_pass(L: torch.Tensor, mask: torch.Tensor, Q: torch.Tensor,
                 zero_rtol: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Each column of ``Q`` projected onto the kernel of L on its rows ``mask``: (unit
    columns, kernel dimensions)."""
    eig_tol = mask.sum(dim=0).to(L.dtype) * (zero_rtol**2) / L.shape[0]
    if L.shape[1] > EIGH_UP_TO:
        return masked_kernels(L, mask, Q, eig_tol)
    vals, vecs = masked_gram_eigh(L, mask)
    return project_to_kernel(Q, vals, vecs, eig_tol)


def irls_round(
    L: torch.Tensor,
    Q: torch.Tensor,
    *,
    iters: int = 12,
    exact_iters: int = 4,
    eps0: float = 0.3,
    decay: float = 0.6,
    chunk_elems: int | None = None,
    deadline: float | None = None,
) -> torch.Tensor:
    """Push approximate directions ``Q`` (B, K) to the sparsest direction nearby (B, K'), unit.

    On real data a true column is often *not* a local minimum of ℓ1: a sample with a similar
    ReLU pattern offers a descent direction, so the optimiser stops a few degrees away (cos
    0.97-0.997) and its smallest entries include rows that are not zeros, which defeats the
    rounding by kernels. Iteratively reweighted least squares for ℓ0 (weights 1/(v² + ε²) with
    ε shrinking from ``eps0`` x the column's median |entry|) drives each direction to the nearby
    direction with the most exact zeros instead.
    Each iteration is one inverse-iteration step per direction, q ← (Lᵀ W L)⁻¹ q (a batched
    Cholesky solve, O(K m B²)), warm-started from the previous q. The first ``iters`` -
    ``exact_iters`` run in float32, the last ``exact_iters`` in float64: once ε is small the
    weights span six orders and float32 solves leave some columns 1e-4-1e-3 off, which the
    rounding cannot repair, while the early steps only need to move towards the column
    (MNIST, B = 100, m = 1000: the same candidates as all in float64, in 0.73 of the time).
    Past ``deadline`` (a ``time.perf_counter()`` value, checked between chunks of directions)
    only the first K' ≤ K directions, those done, are returned (a chunk is a fraction of a
    second, all of them can be minutes on a large layer).
    """
    L = L.double()
    Q = Q.to(L.dtype)
    Q = Q / Q.norm(dim=0, keepdim=True).clamp_min(torch.finfo(L.dtype).tiny)
    m, B = L.shape
    K = Q.shape[1]
    out = torch.empty_like(Q)
    per = max(1, (chunk_elems or default_chunk(L.device)) // (m * B))
    rough = max(iters - exact_iters, 0)
    L32 = L.float()
    done = K
    for start in range(0, K, per):
        if start > 0 and passed(deadline):
            done = start
            break
        q = Q[:, start:start + per].T.float()  # (k, B)
        q = _irls_steps(L32, q, range(rough), eps0, decay).double()
        out[:, start:start + per] = _irls_steps(L, q, range(rough, iters), eps0, decay).T
    return out[:, :done]


def _irls_steps(L: torch.Tensor, q: torch.Tensor, steps: range, eps0: float,
                decay: float) -> torch.Tensor:
    """The IRLS iterations ``steps`` of :func:`irls_round` on directions ``q`` (k, B), in
    L's dtype."""
    tiny = torch.finfo(L.dtype).tiny
    for t in steps:
        V = q @ L.T  # (k, m)
        med = V.abs().median(dim=1).values.clamp_min(tiny)
        eps = (eps0 * decay**t) * med
        w = 1.0 / (V.square() + eps[:, None].square())
        w = w / w.amax(dim=1, keepdim=True)
        gram = (L.T[None] * w[:, None, :]) @ L  # (k, B, B)
        jitter = 1e-12 * gram.diagonal(dim1=1, dim2=2).amax(dim=1)
        gram = plus_diagonal(gram, jitter, inplace=True)
        chol, info = torch.linalg.cholesky_ex(gram)
        z = torch.cholesky_solve(q[:, :, None], chol)[:, :, 0]
        bad = (info != 0) | ~torch.isfinite(z).all(dim=1)
        z = torch.where(bad[:, None], q, z)
        z = z / z.norm(dim=1, keepdim=True).clamp_min(tiny)
        q = z * torch.sign((z * q).sum(dim=1, keepdim=True) + 1e-30)
    return q


REFIT_ZERO_SD = 3.0
""":func:`noisy_refit` counts an entry of L q within this many noise stds as a zero row."""


def noisy_refit(L: torch.Tensor, Q: torch.Tensor, row_noise: torch.Tensor, *,
                iters: int = 3, chunk_elems: int | None = None) -> torch.Tensor:
    """Re-estimate noisy columns ``Q`` (B, K) from all their zero rows (B, K), unit, same signs.

    Under noise every found column is a kernel of a few hundred to a few thousand rows taken
    at some point of the search, and each carries its own small error; the reconstruction
    inverts all B of them, so these errors add up over the batch. Here each column's zero
    rows are the entries within :data:`REFIT_ZERO_SD` noise stds (``filtering.noise_scales``)
    and the column becomes their least-squares kernel in the metric of the noise on q
    (``row_noise`` = ν / s: the generalised eigenvector of (L_zᵀ L_z, diag(row_noise²))), then
    again from its new zero rows.
    """
    L = L.double()
    Q = Q.to(L.dtype)
    w = row_noise.to(L)
    B = L.shape[1]
    for _ in range(iters):
        V, scale = L @ Q, noise_scales(Q, w)
        mask = V.abs() <= REFIT_ZERO_SD * scale[None, :]
        live = torch.nonzero(mask.sum(dim=0) >= B).squeeze(1)  # enough rows for a kernel
        new = Q.clone()
        for cols, gram in masked_grams(L, mask[:, live], chunk_elems or default_chunk(L.device)):
            _, vecs = torch.linalg.eigh(gram / (w[:, None] * w[None, :]))
            new[:, live[cols]] = (vecs[:, :, 0] / w).T
        new = new / new.norm(dim=0, keepdim=True)
        new = new * torch.where((new * Q).sum(dim=0) < 0, -1.0, 1.0)
        # a column that is no sample's (a wrong batch size under heavy noise) has no zero rows
        # to fit: keep a step only where it makes the column more clearly sparse
        better = noisy_sparsity(L @ new, noise_scales(new, w)) >= noisy_sparsity(V, scale)
        Q = torch.where(better[None, :], new, Q)
    return Q
