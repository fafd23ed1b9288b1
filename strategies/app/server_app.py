"""The ``ServerApp``: FedAvg wrapped in the privacy audit, configured from the run config.

``flwr run .`` starts it (``[tool.flwr.app.components]`` in ``pyproject.toml``); ``make demo``
runs it in-process with ``flwr.simulation.run_simulation``. The run config is resolved and
checked before anything is trained or written (``app/run_config.py``): a bad setting
fails the run at once with a message naming it. The ServerApp then waits up to ``node-wait``
seconds for ``num-clients`` nodes (and says how many it found if they never come), and forwards
the client-side settings to the clients with every message, so both sides agree.

Relative ``output-dir`` paths resolve against the ServerApp process's working directory (for
``flwr run .`` with a local SuperLink: the directory the SuperLink was started from); the
absolute path is logged at the start and the report's path at the end. Each run writes to a
fresh ``<output-dir>/<run-name>/``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from logging import ERROR, INFO, WARNING
from pathlib import Path
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.common import log
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from fl_attack_flwr.app.run_config import (
    RunConfigError,
    attack_settings,
    check_run_config,
    model_factory,
    resolve_run_config,
)
from fl_attack_flwr.audit import AuditingStrategy
from fl_attack_flwr.clients.defaults import CLIENT_DEFAULTS
from fl_attack_flwr.output.privacy_gate import PrivacyGateError, gate_failure
from fl_attack_flwr.output.store import AuditStore
from fl_attack_flwr.results.pictures import GroundTruth


def client_config_record(cfg: Mapping[str, Any]) -> ConfigRecord:
    """The keys clients need, as the ConfigRecord sent with every train/evaluate message."""
    return ConfigRecord({k: cfg[k] for k in CLIENT_DEFAULTS if k in cfg})


def initial_arrays(cfg: Mapping[str, Any]) -> ArrayRecord:
    """The initial global model (seeded) as an ArrayRecord."""
    if cfg["task"] == "text":
        from fl_attack_flwr.clients.text_task import initial_text_model

        return ArrayRecord(initial_text_model(
            str(cfg["text-model"]), int(cfg["model-seed"]),
            int(cfg["lora-rank"]) if cfg["protocol"] == "lora" else 0).state_dict())
    from fl_attack.testbed.data import image_shape
    from fl_attack.testbed.models import relu_mlp

    c, h, w = image_shape(str(cfg["dataset"]))
    model = relu_mlp(c * h * w, int(cfg["width"]), int(cfg["depth"]), 10,
                     seed=int(cfg["model-seed"]))
    return ArrayRecord(model.state_dict())


def wait_for_nodes(grid: Grid, wanted: int, timeout: float) -> int:
    """Wait until ``wanted`` nodes are connected; ``RuntimeError`` naming both counts if not."""
    deadline = time.monotonic() + timeout
    while True:
        have = len(list(grid.get_node_ids()))
        if have >= wanted:
            return have
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"num-clients = {wanted} but only {have} node(s) connected within node-wait = "
                f"{timeout:g} s: start the federation with {wanted} SuperNodes (local "
                f"simulation: flwr run . --federation-config 'num-supernodes={wanted}') or run "
                f"with --run-config 'num-clients={have}'")
        time.sleep(1.0)


def run_audit(grid: Grid, cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Run the audited federation on ``grid`` (``cfg`` already checked); return its summary.

    The summary and report are written even when the run fails half-way (then the exception is
    re-raised), so whatever was reconstructed is never lost. With ``fail-on`` set, a run whose
    clients leaked what it names raises
    :class:`~fl_attack_flwr.output.privacy_gate.PrivacyGateError` after the report is written
    (``flwr run`` then records the run as failed).
    """
    n = int(cfg["num-clients"])
    wait_for_nodes(grid, n, float(cfg["node-wait"]))
    store = AuditStore(Path(str(cfg["output-dir"])).expanduser(),
                       str(cfg["run-name"]) or None, config=cfg,
                       reconstructions=bool(cfg["store-reconstructions"]),
                       retain_rounds=int(cfg["retain-rounds"]) or None,
                       tensorboard=bool(cfg["tensorboard"]))
    log(INFO, "[audit] writing to %s", store.run_dir)
    fedavg = FedAvg(fraction_train=float(cfg["fraction-train"]),
                    fraction_evaluate=float(cfg["fraction-evaluate"]),
                    min_train_nodes=1, min_evaluate_nodes=1, min_available_nodes=n)
    strategy = AuditingStrategy(
        fedavg, store=store, attack=attack_settings(cfg), protocol=str(cfg["protocol"]),
        pixel_seconds=float(cfg["audit-pixel-seconds"]), enabled=bool(cfg["audit-enabled"]),
        **(_text_audit(cfg) if cfg["task"] == "text" else _image_audit(cfg)))
    try:
        result = strategy.start(grid=grid, initial_arrays=initial_arrays(cfg),
                                num_rounds=int(cfg["num-server-rounds"]),
                                train_config=client_config_record(cfg),
                                evaluate_config=client_config_record(cfg))
    except BaseException as exc:
        log(WARNING, "[audit] run failed: %s: %s", type(exc).__name__, exc)
        store.finalize({"status": "failed", "error": f"{type(exc).__name__}: {exc}"})
        raise
    finally:
        strategy.close()
    summary = store.finalize({
        "status": "completed",
        "train_metrics": {str(k): dict(v) for k, v in result.train_metrics_clientapp.items()},
        "evaluate_metrics": {str(k): dict(v)
                             for k, v in result.evaluate_metrics_clientapp.items()}})
    log(INFO, "[audit] %s", summary["verdict"])
    log(INFO, "[audit] report: %s", summary["report"])
    failure = gate_failure(summary, str(cfg["fail-on"]))
    if failure is not None:
        log(ERROR, "[audit] %s", failure)
        raise PrivacyGateError(failure)
    return summary


def _image_audit(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The strategy's ground truth, dataset and model for the image task."""
    return {"ground_truth": (GroundTruth(str(cfg["dataset"]), int(cfg["dataset-size"]) or None,
                                         seed=int(cfg["data-seed"])) if cfg["audit"] else None),
            "dataset": str(cfg["dataset"]), "model": model_factory(str(cfg["audit-model"]))}


def _text_audit(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The text task's: the model's architecture, its tokenizer, the clients' sentences."""
    from fl_attack_flwr.clients.text_task import text_architecture, text_tokenizer
    from fl_attack_flwr.results.text import TextTruth

    tokenizer = text_tokenizer()
    return {"model": text_architecture(cfg), "tokenizer": tokenizer,
            "ground_truth": (TextTruth(str(cfg["text-source"]), tokenizer) if cfg["audit"]
                             else None)}


app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Entry point Flower calls: resolve and check the configuration, then run the audit."""
    try:
        cfg = check_run_config(resolve_run_config(context.run_config))
    except RunConfigError as exc:
        log(ERROR, "[audit] %s", exc)
        raise
    run_audit(grid, cfg)
