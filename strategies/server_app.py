"""The ``ServerApp``: FedAvg wrapped in the privacy audit, configured from the run config.

Configuration: :data:`DEFAULT_RUN_CONFIG` < ``context.run_config`` (``[tool.flwr.app.config]``
plus ``flwr run --run-config`` overrides) < the JSON object in ``$FL_ATTACK_RUN_CONFIG``.
The environment variable exists because ``flwr.simulation.run_simulation`` (used by
``make demo`` and the tests) hands the ServerApp an *empty* run config. The ServerApp forwards
the resolved configuration to the clients with every message, so both sides agree.

Attack options beyond the named keys: any run-config key ``attack.<field>`` (TOML:
``attack.steps = 200``) is passed to ``fl_attack.invert`` as ``<field>`` (dashes become
underscores), e.g. ``attack.n-init = 64``.

Relative ``output-dir`` paths resolve against the ServerApp process's working directory (for
``flwr run`` with a local SuperLink, the directory the SuperLink was started from); pass an
absolute path to be sure. Each run writes to a fresh ``<output-dir>/<run-name>/``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from logging import INFO, WARNING
from pathlib import Path
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.common import log
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from fl_attack_flwr.audit import AttackSettings, AuditingStrategy, GroundTruth
from fl_attack_flwr.clients.client_app import CLIENT_DEFAULTS
from fl_attack_flwr.store import AuditStore

__all__ = ["CONFIG_ENV", "DEFAULT_RUN_CONFIG", "app", "resolve_run_config", "run_audit"]

CONFIG_ENV = "FL_ATTACK_RUN_CONFIG"

#: Every key the app understands, with its default (mirrored in ``[tool.flwr.app.config]``).
DEFAULT_RUN_CONFIG: dict[str, Any] = {
    "num-server-rounds": 2,
    "num-clients": 3,
    "fraction-train": 1.0,
    "fraction-evaluate": 1.0,
    **CLIENT_DEFAULTS,
    "model-seed": 0,
    "attack-method": "spear++",
    "max-seconds": 120.0,
    "attack-timeout": 600.0,
    "attack-device": "auto",
    "attack-seed": 0,
    "attack-next-layer": True,
    "output-dir": "runs",
    "run-name": "",
    "audit-enabled": True,
}

_ATTACK_PREFIX = "attack."


def resolve_run_config(run_config: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Merge defaults, the Flower run config and ``$FL_ATTACK_RUN_CONFIG`` (JSON object)."""
    cfg = dict(DEFAULT_RUN_CONFIG)
    cfg.update(dict(run_config or {}))
    env = os.environ.get(CONFIG_ENV, "").strip()
    if env:
        extra = json.loads(env)
        if not isinstance(extra, dict):
            raise ValueError(f"${CONFIG_ENV} must hold a JSON object")
        cfg.update(extra)
    protocol = str(cfg["protocol"])
    if protocol not in ("fedsgd", "fedavg", "dpsgd"):
        raise ValueError(f"protocol must be fedsgd, fedavg or dpsgd, got {protocol!r}")
    return cfg


def attack_settings(cfg: Mapping[str, Any]) -> AttackSettings:
    """The attack part of the run config. A ``protocol = "fedavg"`` run attacks with
    ``update="fedavg"`` (its clients send sums over local steps) unless ``attack.update`` is
    set. A ``dpsgd`` run keeps ``"gradient"`` even over several local steps: under DP noise
    the FedAvg test stops discriminating (``AttackConfig.update``)."""
    options = {k[len(_ATTACK_PREFIX):].replace("-", "_"): v for k, v in cfg.items()
               if k.startswith(_ATTACK_PREFIX)}
    if cfg.get("protocol") == "fedavg":  # the clients send sums over local steps
        options.setdefault("update", "fedavg")
    timeout = float(cfg["attack-timeout"])
    max_seconds = float(cfg["max-seconds"])
    device = str(cfg["attack-device"])
    return AttackSettings(
        method=str(cfg["attack-method"]),
        max_seconds=max_seconds if max_seconds > 0 else None,
        timeout=timeout if timeout > 0 else None,
        device=None if device in ("", "auto") else device,
        seed=int(cfg["attack-seed"]),
        options=options,
        next_layer=bool(cfg["attack-next-layer"]),
    )


def client_config_record(cfg: Mapping[str, Any]) -> ConfigRecord:
    """The keys clients need, as the ConfigRecord sent with every train/evaluate message."""
    return ConfigRecord({k: cfg[k] for k in CLIENT_DEFAULTS if k in cfg})


def initial_arrays(cfg: Mapping[str, Any]) -> ArrayRecord:
    """The initial global model (seeded) as an ArrayRecord."""
    from fl_attack.data import image_shape
    from fl_attack.models import relu_mlp

    c, h, w = image_shape(str(cfg["dataset"]))
    model = relu_mlp(c * h * w, int(cfg["width"]), int(cfg["depth"]), 10,
                     seed=int(cfg["model-seed"]))
    return ArrayRecord(model.state_dict())


def run_audit(grid: Grid, cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Run the audited federation on ``grid`` and return the run's summary.

    The summary and report are written even when the run fails half-way (then the exception is
    re-raised), so whatever was reconstructed is never lost.
    """
    store = AuditStore(Path(str(cfg["output-dir"])).expanduser(),
                       str(cfg["run-name"]) or None, config=cfg)
    log(INFO, "[audit] writing to %s", store.run_dir)
    n = int(cfg["num-clients"])
    fedavg = FedAvg(
        fraction_train=float(cfg["fraction-train"]),
        fraction_evaluate=float(cfg["fraction-evaluate"]),
        min_train_nodes=min(n, 2) if float(cfg["fraction-train"]) > 0 else 0,
        min_evaluate_nodes=min(n, 2) if float(cfg["fraction-evaluate"]) > 0 else 0,
        min_available_nodes=n,
    )
    audit = bool(cfg["audit"])
    strategy = AuditingStrategy(
        fedavg,
        store=store,
        attack=attack_settings(cfg),
        ground_truth=(GroundTruth(str(cfg["dataset"]), int(cfg["dataset-size"]) or None,
                                  seed=int(cfg["data-seed"])) if audit else None),
        dataset=str(cfg["dataset"]),
        protocol=str(cfg["protocol"]),
        enabled=bool(cfg["audit-enabled"]),
    )
    train_config = client_config_record(cfg)
    summary: dict[str, Any] = {}
    try:
        result = strategy.start(
            grid=grid,
            initial_arrays=initial_arrays(cfg),
            num_rounds=int(cfg["num-server-rounds"]),
            train_config=train_config,
            evaluate_config=client_config_record(cfg),
        )
        extra = {"status": "completed",
                 "train_metrics": {str(k): dict(v) for k, v in
                                   result.train_metrics_clientapp.items()},
                 "evaluate_metrics": {str(k): dict(v) for k, v in
                                      result.evaluate_metrics_clientapp.items()}}
    except BaseException as exc:
        log(WARNING, "[audit] run failed: %s: %s", type(exc).__name__, exc)
        summary = store.finalize({"status": "failed", "error": f"{type(exc).__name__}: {exc}"})
        raise
    finally:
        strategy.close()
    summary = store.finalize(extra)
    log(INFO, "[audit] %d reconstructions (%d certified exact), mean PSNR %s, epsilon %s",
        summary["reconstructions"], summary["certified_exact"], summary["psnr_mean"],
        summary["epsilon"])
    log(INFO, "[audit] report: %s", summary["report"])
    return summary


app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Entry point Flower calls: resolve the configuration and run the audit."""
    run_audit(grid, resolve_run_config(context.run_config))
