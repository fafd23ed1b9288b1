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

from fl_attack_flwr.jobs.outcome import AttackOutcome

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


class RoundTimes:
    """When each round started (``configure_train``) and when its aggregate left."""

    def __init__(self) -> None:
        self._started: dict[int, float] = {}
        self._left: dict[int, float | None] = {}

    def start(self, server_round: int) -> None:
        """The round is configured now."""
        self._started[server_round] = time.perf_counter()

    def aggregate_left(self, server_round: int) -> None:
        """The round's aggregate was returned now (background mode, before its attacks end)."""
        self._left[server_round] = self._since_start(server_round)

    def finish(self, server_round: int) -> tuple[float | None, float | None]:
        """``(train-round seconds, audit-done seconds)`` of a round whose attacks are done:
        until its aggregate left (or now, in blocking mode), and until now."""
        done = self._since_start(server_round)
        self._started.pop(server_round, None)
        return self._left.pop(server_round, done), done

    def _since_start(self, server_round: int) -> float | None:
        started = self._started.get(server_round)
        return None if started is None else time.perf_counter() - started
