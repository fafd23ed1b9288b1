"""Hand-made Flower pieces for strategy tests: a grid, training replies, a FedSGD world.

The strategy tests drive ``AuditingStrategy`` with Flower's real ``Message`` / record types but
without a SuperLink: :class:`FakeGrid` is the part of ``flwr.serverapp.Grid`` that FedAvg's
``configure_*`` use; :func:`reply` and :func:`content` build what a client would send back;
:func:`fedsgd_world` makes real FedSGD updates of three clients on disjoint MNIST batches.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Error, Message, Metadata, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAvg

from fl_attack.testbed.data import load_images, normalize
from fl_attack.testbed.models import relu_mlp
from fl_attack.testbed.simulate import local_update

DATASET, SIZE, B, WIDTH = "mnist", 200, 8, 100


class FakeGrid:
    """The part of ``flwr.serverapp.Grid`` that FedAvg's configure_* use."""

    def __init__(self, node_ids: list[int]) -> None:
        self.node_ids = node_ids

    def get_node_ids(self) -> list[int]:
        return list(self.node_ids)


def fedsgd_world() -> dict[str, object]:
    """A global model and three clients' (nodes 11-13) real FedSGD updates on disjoint MNIST
    batches of ``B``."""
    images, labels = load_images(DATASET, SIZE, seed=0)
    model = relu_mlp(784, WIDTH, 3, 10, seed=0)
    global_state = {k: v.clone() for k, v in model.state_dict().items()}
    updates = {}
    for node in (11, 12, 13):
        idx = np.arange((node - 11) * B, (node - 10) * B)
        res = local_update(model, normalize(images[idx], DATASET), labels[idx],
                           protocol="fedsgd", lr=0.01)
        updates[node] = (res.state_dict, idx)
    return {"global": global_state, "updates": updates, "images": images}


def reply(node: int, content: RecordDict | None = None, error: Error | None = None) -> Message:
    md = Metadata(run_id=1, message_id=f"reply-{node}", src_node_id=node, dst_node_id=0,
                  reply_to_message_id=f"ins-{node}", group_id="1", created_at=time.time(),
                  ttl=3600.0, message_type="train")
    if error is not None:
        return Message(error=error, metadata=md)
    return Message(content=content, metadata=md)


def content(state: dict[str, torch.Tensor], pid: int, *, num: int | None = B,
             indices: np.ndarray | None = None) -> RecordDict:
    metrics = {"train-loss": 2.0 + pid} if num is None else {"num-examples": num,
                                                             "train-loss": 2.0 + pid}
    info: dict[str, object] = {"partition-id": pid}
    if indices is not None:
        info["sample-indices"] = [int(i) for i in indices]
    return RecordDict({"arrays": ArrayRecord(state), "metrics": MetricRecord(metrics),
                       "client-info": ConfigRecord(info)})


def good_replies(world: dict, nodes: tuple[int, ...], *, gt: bool = False) -> list[Message]:
    out = []
    for node in nodes:
        state, idx = world["updates"][node]
        out.append(reply(node, content(state, node - 11, indices=idx if gt else None)))
    return out


def arrays_equal(a: ArrayRecord, b: ArrayRecord) -> bool:
    return a.keys() == b.keys() and all(
        np.array_equal(a[k].numpy(), b[k].numpy()) for k in a.keys())


def fedavg() -> FedAvg:
    """FedAvg that samples every node of the stub grid (its default waits for >= 2 nodes)."""
    return FedAvg(min_train_nodes=1, min_evaluate_nodes=1, min_available_nodes=1)


def configure(strategy: Any, world: dict, nodes: list[int]) -> ArrayRecord:
    """Run ``strategy.configure_train`` for round 1 on ``nodes``; the arrays it sent."""
    arrays = ArrayRecord(world["global"])
    msgs = list(strategy.configure_train(1, arrays, ConfigRecord(), FakeGrid(nodes)))
    assert sorted(m.metadata.dst_node_id for m in msgs) == sorted(nodes)
    return arrays


def instruction(node: int, arrays: dict[str, torch.Tensor], kind: str = "train") -> Message:
    """The message a server sends ``node``: the global arrays, for ``kind`` (train/evaluate)."""
    md = Metadata(run_id=1, message_id=f"ins-{node}", src_node_id=0, dst_node_id=node,
                  reply_to_message_id="", group_id="1", created_at=time.time(), ttl=3600.0,
                  message_type=kind)
    return Message(content=RecordDict({"arrays": ArrayRecord(arrays)}), metadata=md)
