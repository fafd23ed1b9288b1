"""What the server read off one training reply before any attack: :class:`ReplyFacts`.

The intake (:mod:`fl_attack_flwr.intake.reply`) fills them in; the record of the reply
(:func:`fl_attack_flwr.results.records.build_record`) takes them over beside the attack's
outcome and its pictures.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


def client_label(partition_id: int | None, label: str | None, node_id: int) -> str:
    """``client-<partition-id>``, else the label the strategy gave, else ``node-<node-id>``."""
    if partition_id is not None:
        return f"client-{partition_id}"
    return label or f"node-{node_id}"


@dataclass(frozen=True, eq=False)
class ReplyFacts:
    """What the server knows of one reply (or of the round's aggregate) before attacking it.

    Compared and hashed by identity: each reply has its own facts, which the strategy uses as
    the key of that reply's record.
    """

    server_round: int
    node_id: int
    label: str | None = None
    partition_id: int | None = None
    protocol: str | None = None
    num_examples: int | None = None
    epsilon: float | None = None
    epsilon_cumulative: float | None = None
    delta: float | None = None
    noise_std: float | None = None
    sample_indices: list[int] | None = None
    layer: str | None = None
    layer_shape: list[int] | None = None
    inputs_are: str | None = None
    """A note on what the reconstructed inputs are (features of a later layer, an aggregate)."""
    guard: dict[str, Any] | None = None
    """The client's own ``LeakGuard`` finding, when its reply carries one
    (:func:`fl_attack_flwr.intake.reply.guard_of`)."""
    reads: str | None = None
    """What a reconstruction is: ``"inputs"`` (the model's own inputs: the attacked layer is
    the first) or ``"features"`` (a later layer's inputs)."""
    passed_over: list[dict[str, str]] | None = None
    """The linear layers before the attacked one that the attack does not cover, each with its
    status (``not-covered``) and reason (``jobs.layers.Passed.as_dict``)."""

    @property
    def client_label(self) -> str:
        """The label records and logs name this reply by (see :func:`client_label`)."""
        return client_label(self.partition_id, self.label, self.node_id)
