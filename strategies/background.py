"""Background audits: attacks in flight, by round, while the federation goes on.

:class:`InFlight` remembers each round's submitted attacks, calls back when one lands and when
a round's last one has, counts what is still queued (for the bounded queue) and, at the end of
a run, waits up to a drain timeout and hands back the attacks that did not finish.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from fl_attack_flwr.outcome import AttackOutcome

__all__ = ["InFlight"]

Item = tuple[Any, Future[AttackOutcome]]


class InFlight:
    """Attacks submitted in background mode, grouped by round."""

    def __init__(self) -> None:
        self._rounds: dict[int, list[Item]] = {}
        self._lock = threading.Lock()

    def track(self, server_round: int, items: list[Item],
              landed: Callable[[Any, Future[AttackOutcome]], None],
              round_done: Callable[[], None]) -> None:
        """Call ``landed(record, future)`` as each attack lands, then ``round_done()`` once,
        after the round's last (at once when the round has none)."""
        if not items:
            round_done()
            return
        with self._lock:
            self._rounds[server_round] = list(items)
        left = [len(items)]

        def done(record: Any, fut: Future[AttackOutcome]) -> None:
            landed(record, fut)
            with self._lock:
                left[0] -= 1
                last = left[0] == 0
                if last:
                    self._rounds.pop(server_round, None)
            if last:
                round_done()

        for record, fut in items:
            fut.add_done_callback(lambda f, r=record: done(r, f))

    def queued(self) -> int:
        """Attacks submitted and not finished yet."""
        with self._lock:
            return sum(1 for items in self._rounds.values() for _, f in items if not f.done())

    def drain(self, timeout: float) -> list[Any]:
        """Wait up to ``timeout`` seconds in all; the records whose attacks are still running."""
        deadline = time.monotonic() + timeout
        with self._lock:
            items = [it for rnd in sorted(self._rounds) for it in self._rounds[rnd]]
        for _, fut in items:
            try:
                fut.result(timeout=max(0.0, deadline - time.monotonic()))
            except Exception:  # noqa: BLE001 - a timeout: reported by the caller
                pass
        return [record for record, fut in items if not fut.done()]
