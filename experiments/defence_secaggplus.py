"""A real SecAgg+ run of the plugin's clients, audited where a SecAgg+ server can look.

Flower 1.41's SecAgg+ (``flwr.server.workflow.SecAggPlusWorkflow`` with the client mod
``flwr.client.mod.secaggplus_mod``) does not run with Message-API strategies and handlers as
they are:

* the workflow needs a ``LegacyContext`` and a legacy ``flwr.server.strategy.Strategy``
  (``configure_fit`` / ``aggregate_fit`` on ``FitIns`` / ``FitRes``); the Message-API strategies
  of ``flwr.serverapp.strategy`` (FedAvg, the DP wrappers, ``AuditingStrategy``) have no such
  methods;
* ``secaggplus_mod`` sends the wrapped train function the legacy ``fitins.*`` records and reads
  its reply with ``recorddict_to_fitres``: a Message-API train handler's reply (an ``arrays``
  ArrayRecord, a ``metrics`` MetricRecord) has no ``fitres.*`` records, so the mod fails.

So the SecAgg+ row adapts at both ends and changes nothing else: the ServerApp runs Flower's
``DefaultWorkflow(fit_workflow=SecAggPlusWorkflow(...))`` with a legacy FedAvg
(:class:`AuditedSecAggPlusFedAvg`) that hands what SecAgg+ reveals — the unmasked aggregate and
each client's plaintext ``FitRes`` metrics — to the plugin's ``AuditingStrategy`` with
``target="aggregate"``; the client's default train action is ``secaggplus_mod`` around
:func:`legacy_train`, which converts ``FitIns`` to the plugin's own ``train`` and its reply back
to ``FitRes``. SecAgg+ quantizes every client's weighted parameters (``max_weight``,
``clipping_range``, ``quantization_range``), so the aggregate the server unmasks carries
stochastic-rounding noise.

Audit ground truth: the client puts its sample indices into the ``FitRes`` metrics as a string
(legacy metrics hold scalars only); SecAgg+ masks parameters, not metrics.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    Metadata,
    MetricRecord,
    RecordDict,
)
from flwr.clientapp import ClientApp
from flwr.common import (
    Code,
    EvaluateRes,
    FitRes,
    Parameters,
    Status,
    ndarrays_to_parameters,
    parameters_to_ndarrays,
)
from flwr.compat.common import recorddict_compat as compat
from flwr.server.client_proxy import ClientProxy
from flwr.server.strategy import FedAvg as LegacyFedAvg
from flwr.serverapp import Grid

from experiments.defence_variants import Defence

__all__ = ["AuditedSecAggPlusFedAvg", "legacy_evaluate", "legacy_train", "register",
           "run_secaggplus"]

#: Legacy FitRes metric carrying the audit's ground truth (comma-separated sample indices).
INDICES_METRIC = "sample-indices"


def _names(cfg: dict[str, Any]) -> list[str]:
    """The model's state-dict names, in the order legacy ``Parameters`` list the arrays."""
    from fl_attack.testbed.data import image_shape
    from fl_attack.testbed.models import relu_mlp

    c, h, w = image_shape(str(cfg["dataset"]))
    return list(relu_mlp(c * h * w, int(cfg["width"]), int(cfg["depth"]), 10).state_dict())


def _named(names: list[str], arrays: list[np.ndarray]) -> ArrayRecord:
    if len(names) != len(arrays):
        raise ValueError(f"{len(arrays)} arrays for a model of {len(names)}")
    return ArrayRecord({k: Array(np.asarray(a)) for k, a in zip(names, arrays, strict=True)})


def _inner_message(msg: Message, prefix: str) -> tuple[Message, dict[str, Any]]:
    """The plugin's Message-API view of a legacy ``fitins`` / ``evaluateins`` message."""
    ins = (compat.recorddict_to_fitins if prefix == "fitins"
           else compat.recorddict_to_evaluateins)(msg.content, keep_input=True)
    cfg = dict(ins.config)
    content = RecordDict({"arrays": _named(_names(cfg), parameters_to_ndarrays(ins.parameters)),
                          "config": ConfigRecord(cfg)})
    return Message(content=content, metadata=msg.metadata), cfg


def legacy_train(msg: Message, context: Context) -> Message:
    """The plugin's ``train`` behind a legacy ``FitIns`` -> ``FitRes`` interface."""
    from fl_attack_flwr.clients.client_app import train

    inner, _ = _inner_message(msg, "fitins")
    reply = train(inner, context)
    arrays = next(iter(reply.content.array_records.values()))
    metrics = dict(next(iter(reply.content.metric_records.values())))
    info = dict(reply.content.config_records.get("client-info", {}))
    legacy_metrics: dict[str, Any] = {k: v for k, v in metrics.items() if k != "num-examples"}
    if "partition-id" in info:
        legacy_metrics["partition-id"] = int(info["partition-id"])
    if info.get(INDICES_METRIC):
        legacy_metrics[INDICES_METRIC] = ",".join(str(int(i)) for i in info[INDICES_METRIC])
    fitres = FitRes(Status(Code.OK, ""), ndarrays_to_parameters([a.numpy() for a in
                                                                 arrays.values()]),
                    int(metrics["num-examples"]), legacy_metrics)
    return Message(content=compat.fitres_to_recorddict(fitres, keep_input=False), reply_to=msg)


def legacy_evaluate(msg: Message, context: Context) -> Message:
    """The plugin's ``evaluate`` for both message formats (legacy ``evaluateins`` from the
    SecAgg+ row's DefaultWorkflow, Message API from every other row)."""
    from fl_attack_flwr.clients.client_app import evaluate

    if "evaluateins.parameters" not in msg.content.array_records:
        return evaluate(msg, context)
    inner, _ = _inner_message(msg, "evaluateins")
    metrics = dict(next(iter(evaluate(inner, context).content.metric_records.values())))
    res = EvaluateRes(Status(Code.OK, ""), float(metrics["eval-loss"]),
                      int(metrics["num-examples"]), {"eval-acc": float(metrics["eval-acc"])})
    return Message(content=compat.evaluateres_to_recorddict(res), reply_to=msg)


def register(app: ClientApp) -> None:
    """Register the SecAgg+ client (default train action) and the evaluate of both formats."""
    from flwr.client.mod import secaggplus_mod

    app.train(mods=[secaggplus_mod])(legacy_train)
    app.evaluate()(legacy_evaluate)


class AuditedSecAggPlusFedAvg(LegacyFedAvg):
    """Legacy FedAvg whose ``aggregate_fit`` shows the audit what SecAgg+ revealed.

    Under SecAgg+ every ``FitRes`` this strategy receives carries the same parameters, the
    unmasked aggregate; the clients' metrics are plaintext. Each becomes a reply Message for the
    wrapped ``AuditingStrategy`` (``target="aggregate"``), which attacks the aggregate once as a
    batch of all the round's samples.
    """

    def __init__(self, audit: Any, grid: Grid, cfg: dict[str, Any]) -> None:
        from fl_attack_flwr.app.server_app import client_config_record, initial_arrays

        n = int(cfg["num-clients"])
        self.audit, self.grid, self.names = audit, grid, _names(cfg)
        client_cfg = dict(client_config_record(cfg))
        init = initial_arrays(cfg)
        super().__init__(
            min_fit_clients=n, min_evaluate_clients=n, min_available_clients=n,
            initial_parameters=ndarrays_to_parameters([a.numpy() for a in init.values()]),
            on_fit_config_fn=lambda rnd: {**client_cfg, "server-round": rnd},
            on_evaluate_config_fn=lambda rnd: {**client_cfg, "server-round": rnd},
            evaluate_metrics_aggregation_fn=_weighted_mean)

    def configure_fit(self, server_round: int, parameters: Parameters,
                      client_manager: Any) -> list[tuple[ClientProxy, Any]]:
        """Tell the audit which model the round starts from (its ``W0``), then sample."""
        arrays = _named(self.names, parameters_to_ndarrays(parameters))
        list(self.audit.configure_train(server_round, arrays, ConfigRecord(), self.grid))
        return super().configure_fit(server_round, parameters, client_manager)

    def aggregate_fit(self, server_round: int, results: list[tuple[ClientProxy, FitRes]],
                      failures: list[Any]) -> tuple[Parameters | None, dict[str, Any]]:
        """The audit's aggregate of the SecAgg+ replies (FedAvg of identical arrays)."""
        if not results:
            return None, {}
        replies = [self._reply(server_round, proxy, res) for proxy, res in results]
        arrays, metrics = self.audit.aggregate_train(server_round, replies)
        if arrays is None:
            return None, {}
        params = ndarrays_to_parameters([arrays[k].numpy() for k in self.names])
        return params, {k: v for k, v in dict(metrics or {}).items()
                        if isinstance(v, (int, float))}

    def _reply(self, server_round: int, proxy: ClientProxy, res: FitRes) -> Message:
        metrics = dict(res.metrics)
        info: dict[str, Any] = {}
        if "partition-id" in metrics:
            info["partition-id"] = int(metrics.pop("partition-id"))
        indices = metrics.pop(INDICES_METRIC, None)
        if indices:
            info[INDICES_METRIC] = [int(i) for i in str(indices).split(",")]
        content = RecordDict({
            "arrays": _named(self.names, parameters_to_ndarrays(res.parameters)),
            "metrics": MetricRecord({"num-examples": int(res.num_examples),
                                     **{k: v for k, v in metrics.items()
                                        if isinstance(v, (int, float))}}),
            "client-info": ConfigRecord(info)})
        md = Metadata(run_id=0, message_id=f"secaggplus-{server_round}-{proxy.node_id}",
                      src_node_id=int(proxy.node_id), dst_node_id=0, reply_to_message_id="",
                      group_id=str(server_round), created_at=time.time(), ttl=3600.0,
                      message_type="train")
        return Message(content=content, metadata=md)


def _weighted_mean(results: list[tuple[int, dict[str, Any]]]) -> dict[str, Any]:
    total = sum(n for n, _ in results)
    keys = set.intersection(*(set(m) for _, m in results)) if results else set()
    return {k: sum(n * float(m[k]) for n, m in results) / total for k in keys} if total else {}


def run_secaggplus(grid: Grid, context: Context, defence: Defence, cfg: dict[str, Any],
                   store: Any) -> dict[str, dict[str, float]]:
    """Run the SecAgg+ row; return the clients' evaluate metrics per round."""
    import dataclasses

    from flwr.server import LegacyContext, ServerConfig
    from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow
    from flwr.serverapp.strategy import FedAvg

    from fl_attack_flwr.app.run_config import attack_settings
    from fl_attack_flwr.audit import AuditingStrategy
    from fl_attack_flwr.results.pictures import GroundTruth

    n = int(cfg["num-clients"])
    audit = AuditingStrategy(
        FedAvg(min_train_nodes=n, min_evaluate_nodes=n, min_available_nodes=n), store=store,
        attack=dataclasses.replace(attack_settings(cfg), target="aggregate"),
        ground_truth=GroundTruth(str(cfg["dataset"]), int(cfg["dataset-size"]) or None,
                                 seed=int(cfg["data-seed"])),
        dataset=str(cfg["dataset"]), protocol=str(cfg["protocol"]))
    strategy = AuditedSecAggPlusFedAvg(audit, grid, cfg)
    legacy = LegacyContext(context, config=ServerConfig(num_rounds=int(cfg["num-server-rounds"])),
                           strategy=strategy)
    try:
        DefaultWorkflow(fit_workflow=SecAggPlusWorkflow(**(defence.secaggplus or {})))(grid,
                                                                                    legacy)
    finally:
        audit.close()
    out: dict[str, dict[str, float]] = {}
    for key, series in legacy.history.metrics_distributed.items():
        for rnd, value in series:
            out.setdefault(str(rnd), {})[key] = float(value)
    return out
