"""``WrappingStrategy``: a Flower strategy that wraps another and delegates to it.

The way Flower's own DP wrappers are built: every ``Strategy`` method goes to the wrapped
strategy unless a subclass overrides it. The auditing strategy overrides the training half;
other wrappers (e.g. the defence matrix's) override what they change.
"""

from __future__ import annotations

from collections.abc import Iterable

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy


class WrappingStrategy(Strategy):
    """Delegate every step to ``strategy``."""

    def __init__(self, strategy: Strategy) -> None:
        super().__init__()
        self.strategy = strategy

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.strategy!r})"

    def summary(self) -> None:
        """The wrapped strategy's summary."""
        self.strategy.summary()

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """Delegate unchanged."""
        return self.strategy.configure_train(server_round, arrays, config, grid)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Delegate unchanged."""
        return self.strategy.aggregate_train(server_round, replies)

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        """Delegate unchanged."""
        return self.strategy.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(self, server_round: int,
                           replies: Iterable[Message]) -> MetricRecord | None:
        """Delegate unchanged."""
        return self.strategy.aggregate_evaluate(server_round, replies)
