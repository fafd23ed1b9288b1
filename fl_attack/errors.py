"""Exceptions that tell *why* a layer's update cannot be inverted.

They subclass ``ValueError`` (the bad-input contract of :func:`fl_attack.invert`) and carry
machine-readable attributes, so that a caller (an auditing tool) can tell "this update protects
its batch" or "this update is empty" from a fault by the exception's type, never by its message.
"""

from __future__ import annotations


class NotIdentifiable(ValueError):
    """The batch cannot be read off this layer's update, whatever the attack does.

    Attributes
    ----------
    reason : str
        ``"full-rank"``: the update's numerical rank reaches min(m, n), so the batch mixes at
        least as many samples as the layer can separate (or noise swamps the signal);
        ``"no-signal"``: numerical rank 0, the noise hides every sample.
    rank : int
        The numerical rank read off the spectrum.
    limit : int
        min(m, n) over the rows and columns that carry any signal.
    """

    def __init__(self, message: str, *, reason: str, rank: int, limit: int) -> None:
        super().__init__(message)
        self.reason, self.rank, self.limit = reason, rank, limit


class ZeroUpdate(ValueError):
    """What the attack reads is identically zero: the update carries nothing to invert.

    Attributes
    ----------
    part : str
        What is zero: ``"update"`` (the weight and the bias: the client sent back the model it
        was sent), ``"weight"`` (the weight gradient or update), ``"bias"`` (the bias gradient,
        without which the samples' scales cannot be fixed) or ``"next-weight"`` (the next
        layer's weight gradient).
    """

    def __init__(self, message: str, *, part: str) -> None:
        super().__init__(message)
        self.part = part
