"""The contract between the plugin's server side and its simulated clients.

Both ``fl_attack_flwr`` (the ServerApp and :class:`~fl_attack_flwr.AuditingStrategy`) and
``fl_attack_flwr.clients`` (the ClientApp) import these names, so a reply key or a default is
defined once.

What a client sends is what an unmodified Flower client sends: one ``ArrayRecord`` with all the
model's weights and one ``MetricRecord`` with ``num-examples``. The plugin's own clients add a
``client-info`` ConfigRecord with their ``partition-id`` (node ids are random per run) and, only
in audit mode (simulations, where the server may see the ground truth), the ``sample-indices``
they trained on. The auditing strategy strips ``sample-indices`` before the wrapped strategy sees
the reply. A user's own clients send none of these keys, and the audit works without them.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "CLIENT_DEFAULTS",
    "CLIENT_INFO_KEY",
    "DELTA_KEY",
    "EPSILON_CUMULATIVE_KEY",
    "EPSILON_KEY",
    "FAULT_MODES",
    "GUARD_CODES",
    "GUARD_KEYS",
    "NOISE_STD_KEY",
    "NUM_EXAMPLES_KEY",
    "PARTITION_ID_KEY",
    "PARTITIONINGS",
    "PROTOCOLS",
    "SAMPLE_INDICES_KEY",
    "UPDATE_OF_PROTOCOL",
    "parse_faults",
]

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

#: Local training protocols of the plugin's clients.
PROTOCOLS = ("fedsgd", "fedavg", "dpsgd")
#: What each protocol sends, as ``fl_attack.AttackConfig.update`` names it: one gradient step
#: (FedSGD; DP-SGD is attacked as a gradient even over several steps, because under noise the
#: FedAvg test stops telling candidates apart) or a sum over local steps (FedAvg).
UPDATE_OF_PROTOCOL = {"fedsgd": "gradient", "fedavg": "fedavg", "dpsgd": "gradient"}
PARTITIONINGS = ("iid", "dirichlet")
#: Misbehaviours the plugin's clients can be told to show (``inject-faults``), to test that the
#: audit and the round survive them.
FAULT_MODES = ("raise", "nan", "shape", "missing", "zero")

#: Client-side settings and their defaults (the ServerApp sends all of them with each message).
CLIENT_DEFAULTS: dict[str, Any] = {
    "protocol": "fedsgd",
    "dataset": "photos32",
    "dataset-size": 1000,
    "data-seed": 0,
    "partitioning": "iid",
    "dirichlet-alpha": 0.5,
    "batch-size": 16,
    "mini-batch-size": 0,
    "local-epochs": 1,
    "lr": 0.01,
    "width": 200,
    "depth": 3,
    "clip": 1.0,
    "noise-multiplier": 0.0,
    "delta": 1e-5,
    "audit": True,
    "eval-size": 64,
    "eval-held-out": False,
    "client-threads": 1,
    "inject-faults": "",
    "leak-guard": "",
    "leak-guard-seconds": 30.0,
    "leak-guard-epsilon": 1.0,
}


def parse_faults(spec: str) -> dict[int, str]:
    """``"1:raise 2:nan"`` -> ``{1: "raise", 2: "nan"}`` (``ValueError`` on bad syntax)."""
    faults: dict[int, str] = {}
    for item in str(spec or "").replace(",", " ").split():
        pid, _, mode = item.partition(":")
        if not pid.strip().isdigit() or mode not in FAULT_MODES:
            raise ValueError(f"bad inject-faults item {item!r}; use '<partition>:<mode>' with "
                             f"mode in {FAULT_MODES}")
        faults[int(pid)] = mode
    return faults
