"""The row span of a linear layer's weight gradient: the span of the layer's inputs.

For ``Y = X Wᵀ`` over every token position of a batch, ``∂L/∂W = (∂L/∂Y)ᵀ X``: when fewer
positions carry a loss gradient than the layer is wide, the gradient's row space is the span of
those positions' inputs (DAGER §3, the fact SPEAR §3.1 rests on). A vector is one of the
inputs only if it lies in that span; this module reads the span off the gradient and measures
how far candidates lie from it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fl_attack.errors import NotIdentifiable

#: A singular value counts as signal above this many times the rounding floor (see
#: :func:`rounding_floor`). Measured on SmolLM2's float32 gradients (WordNet, B = 16): the
#: rounding's largest singular value sits at 6-22x the estimate, the weakest true input at 92x.
NOISE_FACTOR = 40.0
#: With a weight difference ``W₀ − W₁`` (``invert_text(weights_dtype=...)``), a singular value
#: counts as signal above this many times the spectral edge of the storage rounding
#: (:func:`storage_floor`). Measured on SmolLM2 (float32, WordNet, B = 4 and 16, lr 1e-3 to
#: 0.1): the rounding's largest singular value sits at 0.9-1.9x the edge, the weakest true input
#: of a B = 16 batch at lr 0.01 at 9.4x.
STORAGE_FACTOR = 4.0
#: A candidate is kept when its distance is below this many times its tilt (plus
#: ``ROUNDING``). Measured (WordNet, B = 16): true tokens and prefixes at most 0.71x their
#: tilt, wrong tokens at least 6.6x, wrong prefixes at least 13x at block 0's MLP input.
ACCEPT = 3.0
#: Distance that the server's own float32 forward pass may add (it recomputes the inputs in
#: another order than the client): always accepted below ``ACCEPT`` times this.
ROUNDING = 3e-6


@dataclass(frozen=True)
class Span:
    """An orthonormal basis of a gradient's row space, with what rounding does to it.

    Attributes
    ----------
    basis : torch.Tensor
        (d, r) orthonormal columns, float64, on the attack's device.
    rank : int
        r, the numerical rank: the positions (distinct inputs) the gradient holds.
    inv_sigma : torch.Tensor
        (r,) the inverse singular values of the basis directions, relative to the largest,
        float64 on the basis's device.
    noise : float
        The first singular value below the signal, relative: the size of the rounding that
        tilts the estimated span (0 at full precision).
    """

    basis: torch.Tensor
    rank: int
    inv_sigma: torch.Tensor
    noise: float = 0.0

    def score(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's distance to the span and its score ``distance / (tilt + ROUNDING)``: an
        input of the batch scores below ``ACCEPT``, whatever the strength of its direction.

        The tilt is how far rounding alone can move a row of ``x`` that lies in the span off
        the estimated span, ``noise · ‖Σ⁻¹ Uᵀ x‖ / ‖x‖`` (first-order perturbation of the
        singular subspaces: a direction of singular value σ tilts by about noise / σ). Both
        come from one projection ``Uᵀ x``.
        """
        x = x.to(self.basis.dtype)
        coef = x @ self.basis
        norm = x.norm(dim=1).clamp_min(torch.finfo(x.dtype).tiny)
        d = (x - coef @ self.basis.T).norm(dim=1) / norm
        tilt = self.noise * (coef * self.inv_sigma).norm(dim=1) / norm
        return d, d / (tilt + ROUNDING)

    def relative_residual(self, m: torch.Tensor) -> torch.Tensor:
        """Squared relative distance ``‖m − P m‖² / ‖m‖²`` of each row (..., d), in ``m``'s
        dtype: a cheap, differentiable float32 measure for ranking and for the encoder's
        relaxation (decisions use :meth:`score`, float64)."""
        basis = self.basis.to(m.dtype)
        r = m - (m @ basis) @ basis.T
        return (r.norm(dim=-1) / m.norm(dim=-1).clamp_min(1e-30)) ** 2

    def distance(self, x: torch.Tensor) -> torch.Tensor:
        """Relative distance ``‖x − P x‖ / ‖x‖`` of each row of ``x`` (k, d) to the span.

        The residual is formed explicitly in float64 (two matrix products), not as
        ``1 − ‖Uᵀx‖²/‖x‖²``, whose cancellation would floor every distance near 1e-8.
        """
        return self.score(x)[0]


def rounding_floor(rows: torch.Tensor, unit_roundoff: float) -> float:
    """The largest singular value rounding alone gives a (k, d) matrix: ``u · rms · (√k + √d)``,
    the edge of the spectrum of k x d independent errors of the entries' size times ``u``."""
    k, d = rows.shape
    return unit_roundoff * float(rows.pow(2).mean().sqrt()) * (k ** 0.5 + d ** 0.5)


def storage_floor(rounding_std: torch.Tensor) -> float:
    """The largest singular value that storing ``W₁`` alone gives a weight difference
    ``W₀ − W₁`` (k, d): ``rms(σ) · (√k + √d)`` for independent errors of standard deviations
    ``rounding_std`` (:func:`storage_rounding`)."""
    k, d = rounding_std.shape
    return float(rounding_std.pow(2).mean().sqrt()) * (k ** 0.5 + d ** 0.5)


def storage_rounding(weight: torch.Tensor, update: torch.Tensor, dtype: torch.dtype
                     ) -> torch.Tensor:
    """Per entry, the standard deviation of the error that storing ``W₁ = W₀ − update`` in
    ``dtype`` adds to the update: ``ulp(W₁) / √12`` (round to nearest, uniform error).

    ``W₁`` is rebuilt from the weights the server sent and the update: both are known exactly
    to the server, so the size of the rounding is known entry by entry.
    """
    w1 = (weight.detach().double() - update.double()).to(dtype)
    mag = w1.abs()
    ulp = torch.nextafter(mag, torch.full_like(mag, float("inf"))) - mag
    return ulp.double() / 12 ** 0.5


def read_span(rows: torch.Tensor, *, what: str, unit_roundoff: float = 2.0 ** -24,
              stored: torch.Tensor | None = None) -> Span:
    """The span of a gradient's rows, its rank read above the rounding floor.

    Parameters
    ----------
    rows
        (k, d) gradient rows whose row space is the span of the layer's inputs (the stacked
        q/k/v gradients of a block, or a weight difference).
    what
        The layer's name, for errors.
    unit_roundoff
        Of the dtype the gradient was computed in (float32: 2⁻²⁴).
    stored
        For a weight difference: per entry of ``rows``, the standard deviation of the storage
        rounding (:func:`storage_rounding`); the rank is read above ``STORAGE_FACTOR`` times its
        edge too.

    Raises
    ------
    NotIdentifiable
        ``"no-signal"`` when the rows are zero; ``"full-rank"`` when every direction of the
        width is above the floor: the batch holds at least as many token positions as the
        layer is wide (or noise fills the spectrum), and every vector lies in the span.
    """
    rows = rows.to(torch.float64)
    width = rows.shape[1]
    _, s, vh = torch.linalg.svd(rows, full_matrices=False)
    if s.numel() == 0 or float(s[0]) == 0.0:
        raise NotIdentifiable(f"{what}: the gradient is zero", reason="no-signal", rank=0,
                              limit=width)
    floor = NOISE_FACTOR * rounding_floor(rows, unit_roundoff)
    if stored is not None:
        floor = max(floor, STORAGE_FACTOR * storage_floor(stored))
    rank = int((s > floor).sum())
    if rank >= width:
        raise NotIdentifiable(
            f"{what}: all {width} directions of the gradient lie above float rounding: the "
            f"batch holds at least as many token positions as the layer's width {width} (or "
            "noise fills the spectrum), so every vector lies in the span",
            reason="full-rank", rank=rank, limit=width)
    rel = s / s[0]
    noise = float(rel[rank]) if rank < rel.numel() else 0.0
    return Span(basis=vh[:rank].T.contiguous(), rank=rank, inv_sigma=1.0 / rel[:rank],
                noise=noise)
