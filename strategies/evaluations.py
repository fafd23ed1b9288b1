"""``EvaluationLog``: a wrapping strategy that stores each round's evaluation with the round.

The model's accuracy belongs beside what the audit read in the same round: an auditor asks
whether the server can read the clients *while the model trains*. Flower hands a strategy the
clients' evaluate replies (``aggregate_evaluate``) and, where the ServerApp gives one, calls a
server-side ``evaluate_fn``; this wrapper lets the wrapped strategy do both unchanged and adds
their results to the run's store (``rounds.jsonl``: ``evaluate``, ``evaluate-server``) with the
time each round ended (``round-end-seconds``, since the store was created), so the report can
put accuracy and leakage side by side and a benchmark can time whole rounds.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from fl_attack_flwr.wrapper import WrappingStrategy

if TYPE_CHECKING:
    from fl_attack_flwr.output.store import AuditStore


class EvaluationLog(WrappingStrategy):
    """Delegate every step to ``strategy``; store each round's evaluation in ``store``.

    Parameters
    ----------
    strategy : Strategy
        The wrapped strategy (it samples, aggregates and evaluates, unchanged).
    store : AuditStore, optional
        Where the rounds' evaluations go; ``None`` stores nothing. Writes to it hold
        ``self._lock``, the lock a subclass holds for its own writes from other threads.
    """

    def __init__(self, strategy: Strategy, store: AuditStore | None = None) -> None:
        super().__init__(strategy)
        self.store = store
        self._lock = threading.RLock()

    def _add_round(self, server_round: int, info: dict[str, object]) -> None:
        if self.store is not None:
            with self._lock:
                self.store.add_round(server_round, info)

    def aggregate_evaluate(self, server_round: int,
                           replies: Iterable[Message]) -> MetricRecord | None:
        """Delegate; store the aggregated evaluation and when the round ended."""
        metrics = self.strategy.aggregate_evaluate(server_round, replies)
        if self.store is not None:
            self._add_round(server_round, {
                "evaluate": dict(metrics or {}),
                "round-end-seconds": time.time() - self.store.started})
        return metrics

    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int = 3,
              timeout: float = 3600, train_config: ConfigRecord | None = None,
              evaluate_config: ConfigRecord | None = None,
              evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None
              ) -> Result:
        """Flower's loop, with the results of a server-side ``evaluate_fn`` stored per round
        (round 0, the initial model, is logged by Flower only)."""
        recorded = evaluate_fn
        if evaluate_fn is not None:
            def recorded(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
                res = evaluate_fn(server_round, arrays)
                if res is not None and server_round > 0:
                    self._add_round(server_round, {"evaluate-server": dict(res)})
                return res
        return super().start(grid, initial_arrays, num_rounds, timeout, train_config,
                             evaluate_config, recorded)
