"""Step 4b (beyond the papers): peel found samples off the gradient with the next layer's.

A sample's ReLU pattern sits on both sides of the ReLU that follows the attacked layer: its
column of ∂L/∂Z vanishes on the sample's inactive units, and so does its activation
h = ReLU(W x + b), which the next linear layer's weight gradient G₂ = Σ_j δ_j h_jᵀ holds in its
row space. So the zero rows of a column the search found pick h out of that row space (a
kernel), and on the active units h is W x + b up to a scale: a linear system that gives the
sample x itself, exactly, without the other columns (which ``scale.reconstruct`` needs). Its
pattern must then agree with the column's zeros, a per-sample certificate. With x and the
column's scale known, the sample's term g_k x_kᵀ comes off the gradient, leaving the same layer
with a smaller batch, which is far easier to search (``experiments/results/core.md``).

The honest-but-curious server has every layer's gradient, so this is the same threat model as
SPEAR(++); the papers use the attacked layer alone. Clean single-step gradients only: a FedAvg
sum or DP noise breaks the exact kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fl_attack.core.clock import passed
from fl_attack.core.columns import zero_mask
from fl_attack.errors import NotIdentifiable
from fl_attack.steps.decompose import Decomposition, decompose

KERNEL_RTOL = {torch.float32: 1e-5, torch.float64: 1e-12}
"""Largest σ_min/σ_max of the next layer's rows on a column's zero rows that counts as a kernel.
On the true zero sets of real photo batches (float32 gradients) it stays orders of magnitude
below this, and the next singular value far above. The float32 value is the pre-activation
band (``tolerances.Z_BAND``): a unit whose activation is that small cannot be told from an
inactive one anyway. The kernel test only picks h; the residual and pattern checks in
:func:`recover` certify the sample."""

KERNEL_GAP = 1e-3
"""A smallest singular value below this fraction of the next one also counts as a kernel: a
trained model's weaker samples have activations in the next layer's span only to 10⁻⁵-10⁻⁴
(their contribution is that close to the rounding), a clear gap above which the next
singular values stay at 0.1-0.3."""

SUPPORT_NOISE = 10.0
"""An activation's unit is active when its entry exceeds this many times the kernel vector's
noise, read off its entries on the zero rows (their 98th percentile: chance zeros aside)."""

TRIM_ROUNDS = 12
"""Times the zero rows are trimmed when they have no kernel: a column's zero test also passes
active units whose ∂L/∂Z is tiny (chance zeros), and one such row removes the kernel. Each
round drops the rows where the nearest vector is large."""

TRIM_LEVEL = 0.3
"""A zero row is trimmed when the nearest vector's entry there exceeds this fraction of its
largest entry over the zero rows."""

CLIFF = 1e-3
"""A spectrum counts as rank r when σ_{r+1} < CLIFF σ_r (float32 rounding sits ~1e-7 below
the signal); otherwise the full, noise-aware ``decompose`` decides."""

RESIDUAL_RTOL = {torch.float32: 1e-4, torch.float64: 1e-9}
"""Largest relative residual of the active units' system W x + b = t h that verifies a sample."""

READ_RTOL = {torch.float32: 1e-3, torch.float64: 1e-8}
"""Largest residual of that system at which :func:`recover` still *reads* a sample (every other
test passed) without verifying it: a trained model's middle-strength samples hold the next
layer's system only to 2-6·10⁻⁴, their contributions that close to the rounding. A read
sample is peeled off the gradient (or, where peeling leaves no clean rank, its coordinates join
the search's complement) and, in a basis that is not proven, its input replaces its row; it is
never reported as verified."""

UNIQUE_RTOL = {torch.float32: 1e-6, torch.float64: 1e-12}
"""Least σ_min/σ_max of the active units' system [W Rᵀ, -H] (columns scaled to unit norm) for
its solution to be the one
sample: below it the system is singular to the gradient's precision (two samples with the
same pattern on those units: every mixture of them solves it)."""

MAX_CHANCE_ZEROS = 0.002
"""Share of the m units (at least one unit) that may be zero in the column although the
recovered sample keeps them active (chance zeros: ∂L/∂Z tiny at an active unit); more and the
column is not verified. Counted on the recovered sample, not as the rows the kernel search
trimmed: trimming also drops true zero rows next to a chance zero."""


@dataclass
class Peeled:
    """Samples recovered from found columns with the next layer's gradient."""

    inputs: torch.Tensor
    """(F, n) the verified samples' inputs x_k."""
    coords: torch.Tensor
    """(F, B) their coordinates c_k in R's rows: x_kᵀ = c_kᵀ R."""
    columns: torch.Tensor
    """(B, F) their columns of ∂L/∂Z in L's coordinates, at the true scale (c_k · a_k = 1)."""
    verified: torch.Tensor
    """(K,) bool over the columns tried: which gave a sample (verified or only read)."""
    proven: torch.Tensor | None = None
    """(F,) bool: which of the samples hold the system to :data:`RESIDUAL_RTOL` (verified);
    the others only to :data:`READ_RTOL` (read). None: all verified."""

    def proven_mask(self) -> torch.Tensor:
        """(F,) bool: the verified samples (:attr:`proven`; all of them when it is None)."""
        if self.proven is None:
            return torch.ones(self.coords.shape[0], dtype=torch.bool, device=self.coords.device)
        return self.proven

    def take(self, keep: torch.Tensor) -> Peeled:
        """The samples of the (F,) mask ``keep`` (``verified`` cleared for the others)."""
        tried = self.verified.clone()
        tried[torch.nonzero(tried).squeeze(1)[~keep.to(tried.device)]] = False
        return Peeled(inputs=self.inputs[keep], coords=self.coords[keep],
                      columns=self.columns[:, keep], verified=tried,
                      proven=self.proven_mask()[keep])


def next_layer_rows(next_weight_grad: torch.Tensor, batch_size: int, floor_rtol: float,
                    generator: torch.Generator | None = None, *,
                    any_rank: bool = False, noise_floor: float = 0.0) -> torch.Tensor | None:
    """(B, m) orthonormal basis of the next layer's activations' span, or None when the next
    layer's gradient does not have rank B (a sample with a zero loss gradient there, or two
    with the same activations: then no kernel is trustworthy). With ``any_rank``, the span at
    the next layer's own rank reading (r, m) where that differs from B (None only when the
    rank is not identified): a trained model's weakest samples fall below float32 rounding at
    a different rank in each layer, and each sample is verified on its own.

    A randomised range finder with one power step (O(k m B) instead of an SVD of the whole
    k x m matrix) when its spectrum shows a clean cliff after B values; ``decompose`` otherwise,
    above ``noise_floor`` (the next layer's stored weights' rounding,
    ``tolerances.rounding_edge``, for a weight difference): without it that rounding, a full
    rank of values at 1e-6 of the largest, reads as no rank at all.
    """
    G2 = next_weight_grad
    k, m = G2.shape
    B = batch_size
    width = min(B + max(10, B // 4), k, m)
    if width > B:
        omega = torch.randn(k, width, generator=generator, dtype=G2.dtype).to(G2.device)
        Y = torch.linalg.qr(G2.T @ omega).Q  # (m, width)
        Y = torch.linalg.qr(G2.T @ (G2 @ Y)).Q  # one power step
        U, sv, Vh = torch.linalg.svd(G2 @ Y, full_matrices=False)
        if sv[B - 1] > 0 and sv[B] < CLIFF * sv[B - 1]:
            return (Y @ Vh[:B].T).T.contiguous()
    try:
        dec = decompose(G2, floor_rtol=floor_rtol, noise_floor=noise_floor)
    except NotIdentifiable:  # the next layer's rank is full or zero: not B either
        return None
    if dec.batch_size != B and not any_rank:
        return None
    return torch.linalg.qr(dec.R.T).Q.T  # the row space, orthonormal


def _kernel(rows2: torch.Tensor, zero: torch.Tensor, tol: float
            ) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Basis (m, r) of the vectors in ``rows2``'s span that vanish on ``zero`` (trimmed of
    chance zeros), and the zero rows kept; None when there is none."""
    zero = zero.clone()
    for _ in range(TRIM_ROUNDS + 1):
        if int(zero.sum()) < rows2.shape[0]:
            return None, zero
        _, sv, Vh = torch.linalg.svd(rows2[:, zero].T, full_matrices=False)
        r = int((sv <= tol * sv[0]).sum())
        if not r and sv.numel() > 1 and sv[-1] <= KERNEL_GAP * sv[-2]:
            r = 1  # a weaker sample's activation, in the span to its own precision
        if r:
            return rows2.T @ Vh[-r:].T, zero
        h = rows2.T @ Vh[-1]
        hz = h[zero].abs()
        zero &= ~(h.abs() > TRIM_LEVEL * hz.max())
    return None, zero


def recover_sample(zero: torch.Tensor, rows2: torch.Tensor, WR: torch.Tensor,
                   bias: torch.Tensor, *, z_band: float,
                   precision: torch.dtype) -> torch.Tensor | None:
    """The coordinates c (B,) of the one sample, x = cᵀ R, whose inactive units are the rows
    ``zero`` (m,) up to chance zeros, verified against the next layer; None when there is no
    such sample or more than one.

    The activations of the next layer's span ``rows2`` (B, m) that vanish on ``zero`` (less
    chance zeros, :func:`_kernel`) give h; on the active units W x + b = H t. The sample is
    verified when that system has one solution (:data:`UNIQUE_RTOL`: two samples with the same
    pattern make it singular, every mixture of them solving it), holds to
    :data:`RESIDUAL_RTOL`, every unit the kernel leaves at zero is inactive, every inactive
    unit is in ``zero``, and at most :data:`MAX_CHANCE_ZEROS` x m rows of ``zero`` stay active.
    """
    got = _solve_sample(zero, rows2, WR, bias, z_band=z_band, precision=precision)
    return None if got is None or got[1] > RESIDUAL_RTOL[precision] else got[0]


def _solve_sample(zero: torch.Tensor, rows2: torch.Tensor, WR: torch.Tensor,
                  bias: torch.Tensor, *, z_band: float, precision: torch.dtype
                  ) -> tuple[torch.Tensor, float] | None:
    """:func:`recover_sample`'s coordinates and the system's relative residual, for a
    residual up to :data:`READ_RTOL`; None when a test fails."""
    m, B = WR.shape
    tol, res_tol = KERNEL_RTOL[precision], READ_RTOL[precision]
    H, kept = _kernel(rows2, zero, tol)
    if H is None:
        return None
    active = ~kept
    if H.shape[1] == 1:  # the activation itself: its support (above its noise) is the active set
        h = H[:, 0].abs()
        noise = float(torch.quantile(h[kept], 0.98)) if bool(kept.any()) else 0.0
        active = h > max(1e-5 * float(h.max()), SUPPORT_NOISE * noise)
    A = torch.cat([WR[active], -H[active]], dim=1)
    sv = torch.linalg.svdvals(A / A.norm(dim=0).clamp_min(torch.finfo(A.dtype).tiny))
    if not float(sv[-1]) > UNIQUE_RTOL[precision] * float(sv[0]):
        return None
    sol = torch.linalg.lstsq(A, -bias[active, None]).solution[:, 0]
    resid = float((A @ sol + bias[active]).norm() / bias[active].norm().clamp_min(1e-300))
    c = sol[:B]
    z = WR @ c + bias
    band = z_band * float(z.abs().max())
    inactive = z < -band
    chance = int((zero & (z > band)).sum())  # zero rows the sample keeps active
    if (resid > res_tol or bool((z[~active] > band).any())
            or bool((inactive & ~zero).any()) or chance > max(1.0, MAX_CHANCE_ZEROS * m)):
        return None
    return c, resid


def recover(
    columns: torch.Tensor,
    L: torch.Tensor,
    R: torch.Tensor,
    rows2: torch.Tensor,
    WR: torch.Tensor,
    bias: torch.Tensor,
    *,
    zero_rtol: float,
    z_band: float,
    precision: torch.dtype,
    deadline: float | None = None,
    zeros: torch.Tensor | None = None,
) -> Peeled:
    """The samples behind ``columns`` (B, K), each read on its own through the next layer
    (:func:`recover_sample`'s tests on the column's zero rows, the system's residual up to
    :data:`READ_RTOL`) and verified where it holds to :data:`RESIDUAL_RTOL`.

    Past ``deadline`` (a ``time.perf_counter()`` value, checked between columns) the
    remaining columns are not tried (reported as not verified).

    Parameters
    ----------
    columns : (B, K)
        Found columns in L's coordinates.
    L : (m, B), R : (B, n)
        The decomposition.
    rows2 : (B, m)
        The next layer's activation span (:func:`next_layer_rows`).
    WR : (m, B), bias : (m,)
        The layer's products (``LayerSystem.WR`` = W Rᵀ).
    zero_rtol, z_band, precision
        The tolerances and the gradient's precision.
    zeros : (m, K) bool, optional
        Each column's inactive units where they are known otherwise (the points of
        ``activations``); by default the column's zero rows (``zero_mask``: under a
        per-column tolerance, the strong columns' own tighter test, so their small true
        entries are not taken for zeros).

    Returns
    -------
    Peeled
        The samples read (to :data:`READ_RTOL`), their coordinates and columns, which
        columns gave one, and which of them are verified (to :data:`RESIDUAL_RTOL`).
    """
    B = L.shape[1]
    V = L @ columns
    zero_rows = zero_mask(V, zero_rtol) if zeros is None else zeros
    coords, kept, proven = [], [], []
    for k in range(V.shape[1]):
        if k > 0 and passed(deadline):
            break
        got = _solve_sample(zero_rows[:, k], rows2, WR, bias, z_band=z_band,
                            precision=precision)
        if got is not None:
            coords.append(got[0])
            kept.append(k)
            proven.append(got[1] <= RESIDUAL_RTOL[precision])
    verified = torch.zeros(V.shape[1], dtype=torch.bool, device=L.device)
    if not kept:
        empty = torch.empty(0, B, dtype=L.dtype, device=L.device)
        return Peeled(inputs=empty @ R, coords=empty, columns=empty.T, verified=verified)
    verified[kept] = True
    C = torch.stack(coords)
    cols = columns[:, kept]
    cols = cols / (C * cols.T).sum(dim=1)  # the scale with c_k · a_k = 1
    return Peeled(inputs=C @ R, coords=C, columns=cols, verified=verified,
                  proven=torch.tensor(proven, dtype=torch.bool, device=L.device))


def reduced(dec: Decomposition, peeled: Peeled) -> Decomposition | None:
    """The decomposition of the gradient without the peeled samples, from ``dec``'s factors:
    G - Σ g_k x_kᵀ = L (I - A_F C_F) R, so only the (B, n) factor is decomposed again. None
    when that factor is not cleanly of rank B - F (then the peeled samples are not right)."""
    B, F = dec.batch_size, peeled.coords.shape[0]
    r = B - F
    if r < 1:
        return None
    P = torch.eye(B, dtype=dec.R.dtype, device=dec.R.device) - peeled.columns @ peeled.coords
    U, sv, Vh = torch.linalg.svd(P @ dec.R, full_matrices=False)
    if not (sv[r - 1] > 0 and (r == B or sv[r] < CLIFF * sv[r - 1])):
        return None
    return Decomposition(L=(dec.L @ U[:, :r]).contiguous(), R=(sv[:r, None] * Vh[:r]).contiguous(),
                         singular_values=torch.cat([sv[:r], dec.singular_values[B:]]),
                         batch_size=r, noise_std=dec.noise_std, noise_edge=dec.noise_edge)


def peel_off(weight_grad: torch.Tensor, bias_grad: torch.Tensor, L: torch.Tensor,
             peeled: Peeled) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradient (G, g) of the batch without the peeled samples: G - Σ g_k x_kᵀ, g - Σ g_k."""
    Gk = L @ peeled.columns  # (m, F) the samples' ∂L/∂Z columns at their true scale
    return weight_grad - Gk @ peeled.inputs, bias_grad - Gk.sum(dim=1)
