"""The time budget of one attack and the seconds its steps took.

A deadline is a ``time.perf_counter()`` value or None (no limit). Every long step (search,
polishing, IRLS, slice sampling, LPs, the final selection) looks at it between units of work
(:func:`passed`), so the test lives in one place; :class:`Clock` turns ``max_seconds`` into
the deadlines of one call and accumulates the per-step timings reported in
``Reconstruction.timings``.
"""

from __future__ import annotations

import time

from fl_attack.core.tuning import TUNING


def passed(deadline: float | None) -> bool:
    """Whether ``deadline`` (a ``time.perf_counter()`` value; None: never) has passed."""
    return deadline is not None and time.perf_counter() > deadline


class Clock:
    """The budget and the step timings of one ``invert`` call (or one side of it).

    Parameters
    ----------
    max_seconds
        The budget (``AttackConfig.max_seconds``); None: no limit.
    start
        ``time.perf_counter()`` at which the budget started (default: now).
    timings
        The dict step seconds are added to (default: a new one).
    """

    def __init__(self, max_seconds: float | None, *, start: float | None = None,
                 timings: dict[str, float] | None = None) -> None:
        self.start = time.perf_counter() if start is None else start
        self.max_seconds = max_seconds
        self.timings: dict[str, float] = {} if timings is None else timings

    def at(self, share: float) -> float | None:
        """The deadline at ``share`` x ``max_seconds`` from the start (None: never)."""
        return None if self.max_seconds is None else self.start + self.max_seconds * share

    @property
    def deadline(self) -> float | None:
        """When ``max_seconds`` runs out: the search's deadline."""
        return self.at(1.0)

    @property
    def finish_deadline(self) -> float | None:
        """When the final selection stops improving (``Tuning.finish_share`` past the budget)."""
        return self.at(1.0 + TUNING.finish_share)

    def from_now(self, share: float) -> float | None:
        """The sooner of the search's deadline and ``share`` x ``max_seconds`` from now."""
        deadline = self.deadline
        if self.max_seconds is None or deadline is None:
            return None
        return min(deadline, time.perf_counter() + share * self.max_seconds)

    def expired(self, deadline: float | None = None) -> bool:
        """Whether ``deadline`` (by default the search's) has passed."""
        return passed(self.deadline if deadline is None else deadline)

    def elapsed(self) -> float:
        """Seconds since the start."""
        return time.perf_counter() - self.start

    def tick(self, key: str, t0: float) -> None:
        """Add the seconds since ``t0`` to step ``key``'s timing."""
        self.timings[key] = self.timings.get(key, 0.0) + time.perf_counter() - t0
