"""Exceptions that tell *why* a layer's update cannot be inverted.

They subclass ``ValueError`` (the bad-input contract of :func:`fl_attack.invert`) and carry a
machine-readable ``reason``, so that an auditing tool can tell "this update protects its batch"
from a fault without parsing messages.
"""

from __future__ import annotations

__all__ = ["NotIdentifiable"]


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
