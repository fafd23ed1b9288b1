"""What a training reply carries between a client and the auditing server: its keys, and how
the server reads its numbers back.

Both sides use these names (the server's intake, the client's ``LeakGuard`` and the bundled
ClientApp), so a key is defined once. What a client sends is what an unmodified Flower client
sends: one ``ArrayRecord`` with all the model's weights and one ``MetricRecord`` with
``num-examples``. The plugin's own clients add a ``client-info`` ConfigRecord with their
``partition-id`` (node ids are random per run) and, only in audit mode (simulations, where the
server may see the ground truth), the ``sample-indices`` they trained on. The auditing strategy
strips ``sample-indices`` before the wrapped strategy sees the reply. A user's own clients send
none of these keys, and the audit works without them.

Nothing here imports Flower: a reply is read through its own methods.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from flwr.app import Message

#: ConfigRecord of a reply with the client's partition id (and, in audit mode, sample indices).
CLIENT_INFO_KEY = "client-info"
PARTITION_ID_KEY = "partition-id"
SAMPLE_INDICES_KEY = "sample-indices"
#: The weight FedAvg aggregates by (Flower's default ``weighted_by_key``).
NUM_EXAMPLES_KEY = "num-examples"
#: DP-SGD clients report the privacy they spent (Opacus' RDP accountant).
EPSILON_KEY = "epsilon"
EPSILON_CUMULATIVE_KEY = "epsilon-cumulative"
DELTA_KEY = "delta"
NOISE_STD_KEY = "noise-std"

#: The finding of a client's ``LeakGuard`` (``fl_attack_flwr.clients.leak_guard``), in the
#: reply's MetricRecord. MetricRecord holds numbers only, so the status is a code
#: (:data:`GUARD_CODES`); a missing value (no λ without a reconstruction) is ``-1``. Every reply
#: of a guarded client carries all of these keys, failures included: Flower's FedAvg averages
#: the replies' metrics key by key and rejects replies whose keys differ.
GUARD_KEYS = ("leak-guard-status", "leak-guard-refused", "leak-guard-escalated",
              "leak-guard-certified", "leak-guard-readable-samples", "leak-guard-lambda",
              "leak-guard-seconds")
#: ``leak-guard-status`` code -> the plugin's status word for what the guard's own check found.
#: ``timeout`` is the guard's budget ending the check before it proved anything.
GUARD_CODES: dict[int, str] = {0: "not-checked", 1: "certified", 2: "not-certified",
                               3: "partial", 4: "protected", 5: "no-update", 6: "timeout",
                               7: "out-of-memory", 8: "attack-error", 9: "not-covered"}


def metric(reply: Message, key: str) -> float | None:
    """A numeric metric of the reply (its first MetricRecord that holds ``key``), or ``None``."""
    if not reply.has_content():
        return None
    for record in reply.content.metric_records.values():
        value = record.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return None


def num_examples(reply: Message, key: str = NUM_EXAMPLES_KEY) -> int | None:
    """The samples the reply says the client trained on: its weight ``key`` as a whole number,
    ``None`` when the reply has no positive finite one."""
    value = metric(reply, key)
    return int(value) if value is not None and math.isfinite(value) and value > 0 else None
