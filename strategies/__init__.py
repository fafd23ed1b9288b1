"""fl_attack_flwr: audit a Flower federation with exact gradient inversion (SPEAR, SPEAR++).

Wrap your strategy and the server attacks every client update it receives::

    from fl_attack_flwr import AttackSettings, AuditingStrategy, AuditStore

    strategy = AuditingStrategy(FedAvg(), store=AuditStore("runs"),
                                attack=AttackSettings(max_seconds=60))

Audit saved weights, the model a server sent and the models clients returned (the same run
directory; ``fl-attack audit SENT RETURNED`` on the command line)::

    from fl_attack_flwr import audit_update

    result = audit_update("sent.pt", "returned.pt", num_examples=16)
    print(result.verdict)

Let each client check its own update before it leaves (a Flower client mod)::

    from fl_attack_flwr import LeakGuard

    @app.train(mods=[LeakGuard(policy="refuse")])

The names are loaded on first use, so that attack worker processes, which import this package,
do not pay for Flower's imports.

Beside these names, a reply's way through the plugin has a folder per stage
(``docs/architecture.md`` maps them): ``intake`` (the reply read, from a Message or from
files), ``jobs`` (the attack job, shared with ``LeakGuard``), ``executors`` (where jobs run),
``results`` (records and scores), ``output`` (store, summary, report, privacy gate,
TensorBoard scalars); ``app`` is the bundled ServerApp and the ``fl-attack`` command. At the
top: the strategies (``audit.AuditingStrategy``, ``wrapper``, ``evaluations``,
``background``), the audit of saved weights (``saved_audit.audit_update``), their
``settings``, the status words (``verdicts``) and the keys a reply carries (``wire``).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["AttackSettings", "AuditStore", "AuditingStrategy", "ClientAudit", "GroundTruth",
           "InputView", "LeakGuard", "PrivacyGateError", "SavedAudit", "audit_update",
           "verdicts"]

_WHERE = {"AttackSettings": "settings", "AuditStore": "output.store", "AuditingStrategy": "audit",
          "ClientAudit": "results.records", "GroundTruth": "results.pictures",
          "InputView": "results.pictures", "LeakGuard": "clients.leak_guard",
          "PrivacyGateError": "output.privacy_gate", "SavedAudit": "saved_audit",
          "audit_update": "saved_audit"}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"fl_attack_flwr.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'fl_attack_flwr' has no attribute {name!r}")
