"""The app's ServerApp: FedAvg, wrapped in fl-attack's audit, told the model (the marked lines).

The CNN's first linear layer (``fc1``) sees the conv layers' output, so the attack recovers
those *features*, exactly; given the model, the audit estimates the pictures behind them.
"""

from __future__ import annotations

from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from fl_attack_flwr import AttackSettings, AuditingStrategy, AuditStore, GroundTruth  # (1)
from quickstart_cnn.task import MEAN, POOL, STD, Net, dataset

DEFAULTS: dict[str, Any] = {"num-server-rounds": 1, "model-seed": 0, "output-dir": "runs",
                            "lr": 0.1, "source": "photos", "audit": True, "max-seconds": 120.0,
                            "pixel-seconds": 60.0}


def make_server_app(config: dict[str, Any] | None = None) -> ServerApp:
    """A ServerApp with ``config`` over :data:`DEFAULTS` (and over the run config)."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        cfg = {**DEFAULTS, **dict(context.run_config), **(config or {})}
        truth = GroundTruth(dataset(cfg["source"]), POOL, seed=7) if cfg["audit"] else None
        strategy = AuditingStrategy(                                           # (2) wrap
            FedAvg(fraction_evaluate=0.0),
            store=AuditStore(cfg["output-dir"], cfg.get("run-name")),          # (3) results
            attack=AttackSettings(max_seconds=float(cfg["max-seconds"])),      # (4) attack
            model=Net, input_shape=(3, 32, 32),                                # (5) the model
            input_transform=((MEAN,) * 3, (STD,) * 3),                         #     its inputs
            pixel_seconds=float(cfg["pixel-seconds"]), ground_truth=truth)
        torch.manual_seed(int(cfg["model-seed"]))  # a reproducible initial model
        strategy.start(grid=grid, initial_arrays=ArrayRecord(Net().state_dict()),
                       num_rounds=int(cfg["num-server-rounds"]),
                       train_config=ConfigRecord({"lr": float(cfg["lr"])}))
        strategy.store.finalize()                                              # (6) report

    return app


app = make_server_app()
