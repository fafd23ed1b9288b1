"""Columns from the samples' activations: points of the layer's row space whose ReLU
activations lie in the next layer's activation span.

Each sample's input x_i lies in the row space of the layer's gradient G = L R, and its
activations a_i = relu(W x_i + b) lie in the row space of the next layer's weight gradient
(the next layer's inputs). For a point x of the row space the residual

    e(x) = ‖(I - A Aᵀ) relu(W x + b)‖² / ‖relu(W x + b)‖²

(A an orthonormal basis of the activation span) is zero at every sample and, the activation
span being B-dimensional in R^m, almost nowhere else. Gradient descent on e from points of
the row space the update itself suggests (the rows of G over the bias gradient: averages of
the samples that drive each unit) ends at or next to samples; a point's inactive units are
then the zero rows of its sample's column of ∂L/∂Z, whose direction is the kernel of L on
those rows. This is the step the sparsity search cannot make on a trained model at large B,
where the true columns are not minima of the ℓ1 objective (``docs/algorithm.md``, "Where the
attack stops").

Columns already found deflate the search: the other samples' points p (x = Rᵀ p) are
orthogonal to the found columns' directions q_k (``G = (L Q)(Q⁻¹ R)``, and the rows of Q⁻¹
are orthogonal to the other columns of Q), so later descents start and stay in that
complement and end at the samples still missing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fl_attack.core.clock import passed

__all__ = ["RowFrame", "columns_of_points", "consistent_columns",
           "consistent_points", "row_frame", "snap_points", "starts"]


@dataclass(frozen=True)
class RowFrame:
    """Orthonormal coordinates of the row space of ``G = L R``: x = V p, and the products the
    descent uses."""

    WV: torch.Tensor
    """(m, B) the layer's weight in the frame: W V."""
    to_L: torch.Tensor
    """(B, B) maps a column direction q (coordinates of L) to the frame's normal vector
    whose complement holds the other samples' points: S⁻¹ Uᵀ q, with R = U S Vᵀ."""
    from_L: torch.Tensor
    """(B, B) maps a row of L to the frame: S Uᵀ (the point of G's row, before its bias)."""


def row_frame(R: torch.Tensor, WR: torch.Tensor) -> RowFrame:
    """The :class:`RowFrame` of ``G = L R`` from R (B, n) and W Rᵀ (m, B)."""
    U, S, _ = torch.linalg.svd(R.double(), full_matrices=False)
    return RowFrame(WV=(WR.double() @ U) / S, to_L=U.T / S[:, None], from_L=S[:, None] * U.T)


def starts(L: torch.Tensor, t: torch.Tensor, frame: RowFrame, k: int, *,
           generator: torch.Generator) -> torch.Tensor:
    """(2k, B) starting points: the k rows of G with the largest bias gradient, each divided
    by it (the average of the samples that drive its unit, weighted by their ∂L/∂Z), and k
    Gaussian points with those rows' mean and spread.

    Parameters
    ----------
    L : (m, B), t : (B,)
        G's left factor and the bias gradient in its coordinates (g = L t).
    frame
        The row space's coordinates.
    k
        Starts of each kind (at most m).
    generator
        The search's random generator.
    """
    g = L.double() @ t.double()
    top = torch.argsort(g.abs(), descending=True)[:k]
    rows = (L.double()[top] / g[top, None]) @ frame.from_L.T
    noise = torch.randn(rows.shape, generator=generator, dtype=rows.dtype).to(rows.device)
    return torch.cat([rows, rows.mean(dim=0) + noise * rows.std(dim=0)])


def consistent_points(frame: RowFrame, bias: torch.Tensor, span: torch.Tensor,
                      P0: torch.Tensor, *, found: torch.Tensor | None = None, steps: int,
                      lr: float, deadline: float | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Minimise e(V p) from each start (rows of ``P0``) with Adam in float32, within the
    complement of the found columns.

    Parameters
    ----------
    frame
        The row space's coordinates (:func:`row_frame`).
    bias : (m,)
        The layer's bias.
    span : (m, r)
        The next layer's activation span, orthonormal columns
        (``peel.next_layer_rows(..., any_rank=True)`` transposed).
    P0 : (K, B)
        The starts (:func:`starts`).
    found : (B, F), optional
        Columns already found (coordinates of L); the points stay orthogonal to their
        normals (``frame.to_L @ found``).
    steps, lr
        Adam's iterations and step size.
    deadline
        ``time.perf_counter()`` value past which the descent stops (checked every 50 steps).

    Returns
    -------
    P : (K, B) float64
        The points, in the frame's coordinates.
    residual : (K,)
        e at each point (its share of activation outside the span).
    """
    B = frame.WV.shape[1]
    C = torch.eye(B, dtype=torch.float64, device=P0.device)
    if found is not None and found.shape[1]:
        U, sv, _ = torch.linalg.svd(frame.to_L @ found.double())
        C = U[:, int((sv > 1e-8 * sv[0]).sum()):]
    WC = (frame.WV @ C).float()
    A, b = span.float(), bias.float()
    U = (P0.double() @ C).float().requires_grad_(True)
    opt = torch.optim.Adam([U], lr=lr)
    def residual(U: torch.Tensor) -> torch.Tensor:
        act = torch.relu(U @ WC.T + b)
        out = act - (act @ A) @ A.T
        return out.pow(2).sum(dim=1) / act.pow(2).sum(dim=1).clamp_min(1e-30)

    for step in range(steps):
        if step % 50 == 0 and passed(deadline):
            break
        opt.zero_grad()
        residual(U).sum().backward()
        opt.step()
    with torch.no_grad():
        return U.detach().double() @ C.T, residual(U).double()


def snap_points(frame: RowFrame, bias: torch.Tensor, span: torch.Tensor, P: torch.Tensor,
                rounds: int = 8) -> torch.Tensor:
    """(K, B) the points moved to the exact solutions of their activation patterns: with a
    point's active units S fixed, ``W V p + b = A c`` on S and ``A c = 0`` off it is linear
    in (p, c), solved in float64 by least squares; the pattern of the solution is the next
    S, until it no longer changes (a descent ends within a few units of its sample's pattern,
    and the units next to their threshold are the ones it gets wrong).

    Parameters
    ----------
    frame, bias, span
        As in :func:`consistent_points`.
    P : (K, B)
        The points (:func:`consistent_points`).
    rounds
        Most least-squares solves per point.
    """
    WV, b, A = frame.WV, bias.double(), span.double()
    B = WV.shape[1]
    out = P.clone()
    for k in range(P.shape[0]):
        active = (out[k] @ WV.T + b) > 0
        for _ in range(rounds):
            S = active.double()
            M = torch.cat([S[:, None] * WV, -A], dim=1)
            p = torch.linalg.lstsq(M, -(S * b)[:, None]).solution[:B, 0]
            now = (p @ WV.T + b) > 0
            out[k] = p
            if torch.equal(now, active):
                break
            active = now
    return out


def columns_of_points(L: torch.Tensor, frame: RowFrame, bias: torch.Tensor,
                      P: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unit column directions: for each point, the kernel of L on the units the point leaves
    inactive (its smallest eigenvector of Lᵀ diag(inactive) L).

    Parameters
    ----------
    L : (m, B)
        G's left factor (orthonormal columns).
    frame, bias, P : (K, B)
        The row space's coordinates, the layer's bias and the points.

    Returns
    -------
    Q : (B, K)
        The directions, in the coordinates of L.
    inactive : (m, K) bool
        Each point's inactive units.
    """
    inactive = (P @ frame.WV.T + bias.double()) <= 0  # (K, m)
    Ld = L.double()
    out = []
    for part in inactive.double().split(64):  # (64, m, B) at a time
        grams = Ld.T[None] @ (part[:, :, None] * Ld[None])
        out.append(torch.linalg.eigh(grams)[1][:, :, 0])
    return torch.cat(out).T.contiguous(), inactive.T


def consistent_columns(L: torch.Tensor, Q: torch.Tensor, inactive: torch.Tensor,
                       zero_rtol: float) -> torch.Tensor:
    """(K,) bool: the columns L q that vanish (below ``zero_rtol`` of their largest entry) on
    every unit their point leaves inactive, with at least B - 1 such units: the exact
    kernels, whose points are samples up to the update's rounding."""
    V = (L.double() @ Q).abs()
    small = V <= zero_rtol * V.amax(dim=0, keepdim=True)
    return (small | ~inactive).all(dim=0) & (inactive.sum(dim=0) >= Q.shape[0] - 1)
