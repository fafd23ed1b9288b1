"""The app's ClientApp: trains on its partition and sends back its weights and num-examples.

With ``leak-guard`` set (``make_client_app({"leak-guard": "refuse"})``) the client first checks
its own update with fl-attack's ``LeakGuard``: the one line marked below.
"""

from __future__ import annotations

from typing import Any

from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fl_attack_flwr import LeakGuard
from photo_mlp.task import Net, load_partition, train

DEFAULTS: dict[str, Any] = {"local-epochs": 1, "batch-size": 16, "samples": 16, "lr": 0.05,
                            "leak-guard": "", "guard-seconds": 30}


def make_client_app(config: dict[str, Any] | None = None) -> ClientApp:
    """A ClientApp with ``config`` over :data:`DEFAULTS` (and over the run config)."""
    app = ClientApp()
    own = {**DEFAULTS, **(config or {})}
    policy, seconds = own["leak-guard"], float(own["guard-seconds"])
    mods = [LeakGuard(policy=policy, max_seconds=seconds)] if policy else []  # the client's check

    @app.train(mods=mods)
    def fit(msg: Message, context: Context) -> Message:
        cfg = {**DEFAULTS, **dict(context.run_config), **(config or {})}
        net = Net()
        net.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        x, y = load_partition(int(context.node_config["partition-id"]),
                              int(context.node_config["num-partitions"]), int(cfg["samples"]))
        train(net, x, y, epochs=int(cfg["local-epochs"]), batch_size=int(cfg["batch-size"]),
              lr=float(cfg["lr"]))
        content = RecordDict({"arrays": ArrayRecord(net.state_dict()),
                              "metrics": MetricRecord({"num-examples": len(x)})})
        return Message(content=content, reply_to=msg)

    return app


app = make_client_app()
