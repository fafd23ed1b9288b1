"""The bundled ClientApp's run-config keys with their defaults, and the faults it can inject.

The ServerApp forwards these keys with every message (``fl_attack_flwr.app.server_app``), and
the run config checks them (``fl_attack_flwr.app.run_config``), so both sides agree.
"""

from __future__ import annotations

from typing import Any

#: Misbehaviours the plugin's clients can be told to show (``inject-faults``), to test that the
#: audit and the round survive them.
FAULT_MODES = ("raise", "nan", "shape", "missing", "zero")

#: Client-side settings and their defaults (the ServerApp sends all of them with each message).
CLIENT_DEFAULTS: dict[str, Any] = {
    "task": "image",
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
    "text-model": "smollm2",
    "text-source": "wordnet",
    "max-tokens": 32,
    "train-blocks": 0,
    "lora-rank": 8,
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
