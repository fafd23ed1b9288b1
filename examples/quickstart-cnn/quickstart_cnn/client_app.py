"""The app's ClientApp: the quickstart's training on this round's images of the client.

It sends back what the quickstart's client sends (its weights and ``num-examples``) and, for
the audit's scores only, the indices of the images it trained on (``client-info``); a client of
a real deployment sends no such thing, and the audit works without it (no PSNR then).
"""

from __future__ import annotations

from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from quickstart_cnn.task import Net, load_partition, train

DEFAULTS: dict[str, Any] = {"local-epochs": 1, "batch-size": 32, "samples": 32, "lr": 0.1,
                            "source": "photos", "audit": True}


def make_client_app(config: dict[str, Any] | None = None) -> ClientApp:
    """A ClientApp with ``config`` over :data:`DEFAULTS` (and over the run config)."""
    app = ClientApp()

    @app.train()
    def fit(msg: Message, context: Context) -> Message:
        cfg = {**DEFAULTS, **dict(context.run_config), **(config or {})}
        net = Net()
        net.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        pid = int(context.node_config["partition-id"])
        rnd = int(msg.content["config"]["server-round"])
        x, y, idx = load_partition(pid, int(context.node_config["num-partitions"]),
                                   int(cfg["samples"]), rnd, str(cfg["source"]))
        loss = train(net, x, y, epochs=int(cfg["local-epochs"]),
                     batch_size=int(cfg["batch-size"]), lr=float(cfg["lr"]), seed=rnd)
        content = RecordDict({"arrays": ArrayRecord(net.state_dict()),
                              "metrics": MetricRecord({"train_loss": loss,
                                                       "num-examples": len(x)})})
        if cfg["audit"]:
            content["client-info"] = ConfigRecord({"partition-id": pid, "sample-indices": idx})
        return Message(content=content, reply_to=msg)

    return app


app = make_client_app()
