"""The app's ServerApp: FedAvg, wrapped in fl-attack's audit (the five lines marked below)."""

from __future__ import annotations

from typing import Any

import torch
from flwr.app import ArrayRecord, Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from fl_attack_flwr import AttackSettings, AuditingStrategy, AuditStore  # (1) import
from photo_mlp.task import Net

DEFAULTS: dict[str, Any] = {"num-server-rounds": 1, "model-seed": 0, "output-dir": "runs",
                            "attack-seconds": 60}


def make_server_app(config: dict[str, Any] | None = None) -> ServerApp:
    """A ServerApp with ``config`` over :data:`DEFAULTS` (and over the run config)."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        cfg = {**DEFAULTS, **dict(context.run_config), **(config or {})}
        strategy = AuditingStrategy(                                   # (2) wrap the strategy
            FedAvg(fraction_evaluate=0.0),
            store=AuditStore(cfg["output-dir"], cfg.get("run-name")),  # (3) where results go
            attack=AttackSettings(max_seconds=float(cfg["attack-seconds"])),  # (4) how to attack
        )
        torch.manual_seed(int(cfg["model-seed"]))  # a reproducible initial model
        strategy.start(grid=grid, initial_arrays=ArrayRecord(Net().state_dict()),
                       num_rounds=int(cfg["num-server-rounds"]))
        strategy.store.finalize()                                      # (5) summary + report

    return app


app = make_server_app()
