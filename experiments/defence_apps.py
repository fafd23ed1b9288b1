"""The ServerApp and ClientApp of the defence matrix: every defence in one Flower simulation.

One simulation runs all rows one after the other, so Ray and the clients' data load once. Each
row is its own federation (fresh initial model, round 1 again, a fresh audit store):

* the ClientApp registers the plugin's own ``train`` once per row as a named train action
  (``train.<row key>``) with that row's Flower mods — ``fixedclipping_mod`` for central DP with
  client-side clipping, ``LocalDpMod`` for local DP — attached to the train handler only; the
  default train action is the SecAgg+ client (``experiments.defence_secaggplus``);
* the ServerApp wraps FedAvg in the row's Flower DP wrapper (if any), in :class:`NamedAction`
  (which sends the row's train action), and in the plugin's ``AuditingStrategy``, outermost: the
  audit reads each reply as the server process receives it, before any wrapper clips it, exactly
  what an honest-but-curious server can read.

A node's ``context.state`` lives for the whole simulation; :func:`fresh_state_mod` clears it at
a row's round 1 so that, e.g., the DP-SGD clients' ε history starts anew in each row.

The client-side guard row runs the plugin's ``LeakGuard`` from the run config (``leak-guard``),
inside the plugin's ``train`` (the guard checks named train actions, ``train.<row key>``, too).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Iterable
from logging import INFO, WARNING
from pathlib import Path
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Context, Message
from flwr.clientapp import ClientApp
from flwr.clientapp.typing import ClientAppCallable
from flwr.common import log
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import (
    DifferentialPrivacyClientSideFixedClipping,
    DifferentialPrivacyServerSideFixedClipping,
    FedAvg,
    Strategy,
)

from experiments.defence_variants import Defence
from fl_attack_flwr.wrapper import WrappingStrategy

__all__ = ["NamedAction", "client_app", "fresh_state_mod", "server_app"]

#: What the ServerApp writes per row next to the audit's own files.
ROW_FILE = "defence.json"


class NamedAction(WrappingStrategy):
    """Delegate everything to ``strategy``; send its train messages as ``train.<action>``.

    Flower routes a message of type ``train.<action>`` to the ClientApp function registered
    with ``@app.train("<action>")``, so one ClientApp can serve several differently configured
    federations.
    """

    def __init__(self, strategy: Strategy, action: str) -> None:
        super().__init__(strategy)
        if not action.isidentifier():
            raise ValueError(f"train action {action!r} must be a Python identifier")
        self.action = action

    def summary(self) -> None:
        """Log the action, then the wrapped strategy's summary."""
        log(INFO, "\t├──> Train action: train.%s", self.action)
        self.strategy.summary()

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """The wrapped strategy's messages, re-addressed to the named train action."""
        return [Message(content=m.content, dst_node_id=m.metadata.dst_node_id,
                        message_type=f"train.{self.action}", group_id=m.metadata.group_id)
                for m in self.strategy.configure_train(server_round, arrays, config, grid)]


def fresh_state_mod(msg: Message, ctx: Context, call_next: ClientAppCallable) -> Message:
    """At a row's round 1, forget what this node kept from earlier rows (``context.state``)."""
    rounds = [r.get("server-round") for r in msg.content.config_records.values()]
    if 1 in rounds:
        for key in list(ctx.state.keys()):
            del ctx.state[key]
    return call_next(msg, ctx)


def client_app(defences: Iterable[Defence]) -> ClientApp:
    """The ClientApp of the matrix (see the module docstring)."""
    from flwr.clientapp.mod import LocalDpMod, fixedclipping_mod

    from experiments import defence_secaggplus
    from fl_attack_flwr.clients.client_app import train

    app = ClientApp()
    for d in defences:
        if d.family == "secagg+":
            continue
        mods: list[Callable[..., Message]] = [fresh_state_mod]
        if d.family == "central-dp-client":
            mods.append(fixedclipping_mod)
        if d.local_dp is not None:
            mods.append(LocalDpMod(*d.local_dp))
        app.train(d.key, mods=mods)(train)
    defence_secaggplus.register(app)
    return app


def row_config(base: dict[str, Any], defence: Defence) -> dict[str, Any]:
    """The checked run config of one row (``RunConfigError`` names a bad key)."""
    from fl_attack_flwr.app.run_config import DEFAULT_RUN_CONFIG, check_run_config

    return check_run_config({**DEFAULT_RUN_CONFIG, **base, **defence.config,
                             "run-name": defence.key})


def _strategy(defence: Defence, cfg: dict[str, Any], store: Any) -> Any:
    """FedAvg in the row's DP wrapper, its train action and the audit (outermost)."""
    from fl_attack_flwr.app.run_config import attack_settings
    from fl_attack_flwr.audit import AuditingStrategy
    from fl_attack_flwr.results.pictures import GroundTruth

    n = int(cfg["num-clients"])
    inner: Strategy = FedAvg(min_train_nodes=n, min_evaluate_nodes=n, min_available_nodes=n)
    if defence.central is not None:
        wrapper = (DifferentialPrivacyServerSideFixedClipping
                   if defence.family == "central-dp-server"
                   else DifferentialPrivacyClientSideFixedClipping)
        inner = wrapper(inner, defence.central[0], defence.central[1], n)
    attack = dataclasses.replace(attack_settings(cfg), target=defence.target)
    return AuditingStrategy(
        NamedAction(inner, defence.key), store=store, attack=attack,
        ground_truth=GroundTruth(str(cfg["dataset"]), int(cfg["dataset-size"]) or None,
                                 seed=int(cfg["data-seed"])),
        dataset=str(cfg["dataset"]), protocol=str(cfg["protocol"]))


def run_row(grid: Grid, context: Context, defence: Defence, cfg: dict[str, Any]) -> None:
    """Run one row's federation to the end and write its summary (never raises: a failed
    row is recorded as failed and the matrix goes on)."""
    from fl_attack_flwr.app.server_app import client_config_record, initial_arrays, wait_for_nodes
    from fl_attack_flwr.output.private_files import atomic_write_bytes
    from fl_attack_flwr.output.store import AuditStore

    wait_for_nodes(grid, int(cfg["num-clients"]), float(cfg["node-wait"]))
    store = AuditStore(Path(str(cfg["output-dir"])), defence.key, config=cfg)
    t0 = time.perf_counter()
    extra: dict[str, Any] = {"status": "completed"}
    try:
        if defence.family == "secagg+":
            from experiments.defence_secaggplus import run_secaggplus

            extra["evaluate_metrics"] = run_secaggplus(grid, context, defence, cfg, store)
        else:
            strategy = _strategy(defence, cfg, store)
            result = strategy.start(grid=grid, initial_arrays=initial_arrays(cfg),
                                    num_rounds=int(cfg["num-server-rounds"]),
                                    train_config=client_config_record(cfg),
                                    evaluate_config=client_config_record(cfg))
            extra["evaluate_metrics"] = {str(k): dict(v) for k, v in
                                         result.evaluate_metrics_clientapp.items()}
    except Exception as exc:  # noqa: BLE001 - one failed row must not stop the matrix
        log(WARNING, "[defences] %s failed: %s: %s", defence.key, type(exc).__name__, exc)
        extra = {"status": "failed", "error": f"{type(exc).__name__}: {exc}"}
    extra["row_seconds"] = time.perf_counter() - t0
    summary = store.finalize(extra)
    atomic_write_bytes(store.run_dir / ROW_FILE, json.dumps(
        {"key": defence.key, "summary": summary}, default=str).encode())
    log(INFO, "[defences] %s: %s", defence.key, summary.get("verdict"))


def server_app(defences: list[Defence], base: dict[str, Any]) -> ServerApp:
    """A ServerApp that runs every row of ``defences`` in turn on the same nodes."""
    configs = [row_config(base, d) for d in defences]  # every row checked before round 1
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        for defence, cfg in zip(defences, configs, strict=True):
            log(INFO, "[defences] row %s: %s", defence.key, defence.label)
            run_row(grid, context, defence, cfg)

    return app
