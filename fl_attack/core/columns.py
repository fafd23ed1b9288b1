"""Column utilities shared by every step: numerical zeros, unit columns, duplicates, patterns.

A candidate direction q is judged by the column ``L q``; these helpers work on a matrix of such
columns (m, K) or of directions (B, K) at once.
"""

from __future__ import annotations

import torch


class ColumnNoiseRtol(float):
    """A zero tolerance relative to each column's largest entry (the float's value) that also
    knows the noise on each column of ``V = L q``, and tightens the test column by column.

    A trained model's update holds samples whose contributions differ by 10⁴ or more; the
    weakest are known only to the rounding's precision, so the batch-wide tolerance must be
    loose (``tolerances.default_zero_rtol``). Applied to a strong column, that loose test takes
    its small true entries for zeros, and a mixture of it with weak columns then passes as
    sparse. The noise on the entries of ``L q`` is ``‖q ⊙ ν/s‖`` (``filtering.noise_scales``),
    small for a strong column and large for a weak one, so an entry counts as zero below
    ``sd`` such noise stds, kept between ``floor`` and the batch-wide value.

    Arithmetic on it gives a plain float: derived tolerances (the ambiguous band, eigenvalue
    tolerances) keep the batch-wide value.
    """

    basis: torch.Tensor
    """(m, B) the orthonormal L of the decomposition."""
    row_noise: torch.Tensor
    """(B,) ν / s_j, the noise on each column of L."""
    floor: float
    """The least relative tolerance (the float precision's)."""
    sd: float
    """Noise stds within which an entry counts as zero."""

    def __new__(cls, rtol: float, basis: torch.Tensor, row_noise: torch.Tensor, floor: float,
                sd: float) -> ColumnNoiseRtol:
        self = super().__new__(cls, rtol)
        self.basis, self.row_noise, self.floor, self.sd = basis, row_noise, floor, sd
        return self

    def thresholds(self, V: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """(1, K) the absolute zero threshold of each column of ``V`` = L Q (maxima ``scale``)."""
        Q = self.basis.to(V).T @ V
        noise = (Q * self.row_noise.to(V)[:, None]).norm(dim=0, keepdim=True)
        loose = torch.minimum(self.sd * noise, float(self) * scale)
        return torch.maximum(self.floor * scale, loose)


def zero_mask(V: torch.Tensor, rtol: float) -> torch.Tensor:
    """Entries of each column of ``V`` (m, K) that are numerically zero relative to its max
    (per column under a :class:`ColumnNoiseRtol`, when ``V`` has its basis' rows)."""
    scale = V.abs().amax(dim=0, keepdim=True).clamp_min(torch.finfo(V.dtype).tiny)
    if isinstance(rtol, ColumnNoiseRtol) and V.shape[0] == rtol.basis.shape[0]:
        return V.abs() <= rtol.thresholds(V, scale)
    return V.abs() <= rtol * scale


def normalize_columns(Q: torch.Tensor) -> torch.Tensor:
    """Unit-norm columns with a canonical sign (largest-magnitude entry positive)."""
    Q = Q / Q.norm(dim=0, keepdim=True).clamp_min(torch.finfo(Q.dtype).tiny)
    idx = Q.abs().argmax(dim=0)
    sign = torch.sign(Q.gather(0, idx[None])).squeeze(0)
    sign[sign == 0] = 1
    return Q * sign


def dedupe(Q: torch.Tensor, tol: float = 1e-6) -> torch.Tensor:
    """Indices of the columns of ``Q`` to keep: the first of each group of ± duplicates."""
    K = Q.shape[1]
    if K <= 1:
        return torch.arange(K, device=Q.device)
    Qn = normalize_columns(Q)
    cos = (Qn.T @ Qn).abs()
    dup = torch.triu(cos > 1 - tol, diagonal=1).any(dim=0)
    return torch.nonzero(~dup).squeeze(1)


def span_distances(Q: torch.Tensor) -> torch.Tensor | None:
    """(B,) each unit column's distance to the span of the other columns of the square ``Q``:
    1 / ‖row i of Q⁻¹‖. None when ``Q`` is singular (or its inverse overflows)."""
    inv, info = torch.linalg.inv_ex(Q)
    if int(info) != 0 or not bool(torch.isfinite(inv).all()):
        return None
    return 1.0 / inv.norm(dim=1)


def pattern_keys(mask: torch.Tensor) -> list[bytes]:
    """Hashable keys of the boolean columns of ``mask`` (m, K), one per column: the zero
    pattern of a candidate, to remember what was already tried for it."""
    mask = mask.cpu()
    return [mask[:, j].numpy().tobytes() for j in range(mask.shape[1])]
