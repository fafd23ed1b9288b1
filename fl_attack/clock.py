"""Deadlines shared by the attack's long steps.

A deadline is a ``time.perf_counter()`` value or None (no limit). Every long step (search,
polishing, IRLS, slice sampling, the final selection) looks at it between units of work, so
the test lives in one place.
"""

from __future__ import annotations

import time


def passed(deadline: float | None) -> bool:
    """Whether ``deadline`` (a ``time.perf_counter()`` value; None: never) has passed."""
    return deadline is not None and time.perf_counter() > deadline
