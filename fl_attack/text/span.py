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

#: Singular values below this fraction of the largest are never counted as signal, whatever
#: the gap: float32 gradients leave a floor near 1e-8 (measured on SmolLM2: 2e-4 signal,
#: 4e-8 floor).
FLOOR = 1e-10
#: The smallest ratio between the last signal singular value and the first one below it that
#: counts as a gap (measured: 5000x on SmolLM2's first two blocks in float32).
MIN_GAP = 100.0


@dataclass(frozen=True)
class Span:
    """An orthonormal basis of a gradient's row space, with the spectrum it was read from.

    Attributes
    ----------
    basis : torch.Tensor
        (d, r) orthonormal columns, float64, on the attack's device.
    rank : int
        r, the numerical rank: the positions (distinct inputs) the gradient holds.
    width : int
        d, the layer's input width.
    gap : float
        Ratio of the last signal singular value to the next one (inf at full width).
    singular_values : torch.Tensor
        The spectrum, largest first, relative to the largest (CPU, float64).
    """

    basis: torch.Tensor
    rank: int
    width: int
    gap: float
    singular_values: torch.Tensor

    def distance(self, x: torch.Tensor) -> torch.Tensor:
        """Relative distance ``‖x − P x‖ / ‖x‖`` of each row of ``x`` (k, d) to the span.

        The residual is formed explicitly in float64 (two matrix products), not as
        ``1 − ‖Uᵀx‖²/‖x‖²``, whose cancellation would floor every distance near 1e-8.
        """
        x = x.to(self.basis.dtype)
        resid = x - (x @ self.basis) @ self.basis.T
        return resid.norm(dim=1) / x.norm(dim=1).clamp_min(torch.finfo(x.dtype).tiny)


def read_span(rows: torch.Tensor, *, what: str, rank: int | None = None) -> Span:
    """The span of a gradient's rows, its rank read at the spectrum's largest gap.

    Parameters
    ----------
    rows
        (k, d) gradient rows whose row space is the span of the layer's inputs (the stacked
        q/k/v gradients of a block, or a weight difference).
    what
        The layer's name, for errors.
    rank
        Take this rank instead of reading it (the caller knows the count of positions).

    Raises
    ------
    NotIdentifiable
        ``"no-signal"`` when the rows are zero; ``"full-rank"`` when no gap separates signal
        from rounding below the full width: the positions are at least as many as the width,
        and the span is the whole space.
    """
    rows = rows.to(torch.float64)
    width = rows.shape[1]
    _, s, vh = torch.linalg.svd(rows, full_matrices=False)
    if s.numel() == 0 or float(s[0]) == 0.0:
        raise NotIdentifiable(f"{what}: the gradient is zero", reason="no-signal", rank=0,
                              limit=width)
    rel = (s / s[0]).cpu()
    if rank is None:
        rank, gap = _gap_rank(rel)
    else:
        gap = float(rel[rank - 1] / rel[rank]) if rank < rel.numel() else float("inf")
    if rank >= width or gap < MIN_GAP:
        raise NotIdentifiable(
            f"{what}: no gap in the gradient's spectrum below the width {width} (largest gap "
            f"{gap:.3g}x at rank {rank}): the batch holds at least as many token positions "
            "as the layer is wide, so every vector lies in the span",
            reason="full-rank", rank=min(rank, width), limit=width)
    return Span(basis=vh[:rank].T.contiguous(), rank=rank, width=width, gap=gap,
                singular_values=rel)


def _gap_rank(rel: torch.Tensor) -> tuple[int, float]:
    """Rank at the largest ratio between consecutive singular values above ``FLOOR``."""
    keep = int((rel > FLOOR).sum())
    if keep <= 1:
        return keep, float("inf")
    ratios = rel[: keep - 1] / rel[1:keep]
    if keep < rel.numel():
        tail = float(rel[keep - 1] / rel[keep]) if float(rel[keep]) > 0 else float("inf")
        ratios = torch.cat([ratios, torch.tensor([tail], dtype=ratios.dtype)])
    i = int(torch.argmax(ratios))
    return i + 1, float(ratios[i])
