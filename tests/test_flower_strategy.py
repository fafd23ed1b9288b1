"""AuditingStrategy on hand-made Flower Messages, with the real attack and real local training.

Covers: the wrapped strategy's aggregate is unchanged by the audit; corrupt replies (NaN, wrong
shape, missing arrays, no num-examples) are recorded and withheld, error replies are recorded and
the round goes on; attack exceptions and hard timeouts are recorded; audit-mode scoring; the
ground truth never reaches the wrapped strategy.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Error,
    Message,
    Metadata,
    MetricRecord,
    RecordDict,
)
from flwr.serverapp.strategy import FedAvg

from fl_attack.data import load_images, normalize
from fl_attack.models import relu_mlp
from fl_attack.simulate import local_update
from fl_attack_flwr.audit import AttackSettings, AuditingStrategy, GroundTruth
from fl_attack_flwr.store import AuditStore

DATASET, SIZE, B, WIDTH = "mnist", 200, 8, 100


class _Grid:
    """The part of ``flwr.serverapp.Grid`` that FedAvg's configure_* use."""

    def __init__(self, node_ids: list[int]) -> None:
        self.node_ids = node_ids

    def get_node_ids(self) -> list[int]:
        return list(self.node_ids)


@pytest.fixture
def task_identity() -> Iterator[None]:
    """FedAvg creates instruction Messages, which read the (process-wide) task identity."""
    from flwr.supercore.task_identity import TaskIdentity

    saved = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    yield
    TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved


@pytest.fixture(scope="module")
def world() -> dict[str, object]:
    """A global model and three clients' real FedSGD updates on disjoint MNIST batches."""
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


def _reply(node: int, content: RecordDict | None = None, error: Error | None = None) -> Message:
    md = Metadata(run_id=1, message_id=f"reply-{node}", src_node_id=node, dst_node_id=0,
                  reply_to_message_id=f"ins-{node}", group_id="1", created_at=time.time(),
                  ttl=3600.0, message_type="train")
    if error is not None:
        return Message(error=error, metadata=md)
    return Message(content=content, metadata=md)


def _content(state: dict[str, torch.Tensor], pid: int, *, num: int | None = B,
             indices: np.ndarray | None = None) -> RecordDict:
    metrics = {"train-loss": 2.0 + pid} if num is None else {"num-examples": num,
                                                             "train-loss": 2.0 + pid}
    info: dict[str, object] = {"partition-id": pid}
    if indices is not None:
        info["sample-indices"] = [int(i) for i in indices]
    return RecordDict({"arrays": ArrayRecord(state), "metrics": MetricRecord(metrics),
                       "client-info": ConfigRecord(info)})


def _good_replies(world: dict, nodes: tuple[int, ...], *, gt: bool = False) -> list[Message]:
    out = []
    for node in nodes:
        state, idx = world["updates"][node]
        out.append(_reply(node, _content(state, node - 11, indices=idx if gt else None)))
    return out


def _arrays_equal(a: ArrayRecord, b: ArrayRecord) -> bool:
    return a.keys() == b.keys() and all(
        np.array_equal(a[k].numpy(), b[k].numpy()) for k in a.keys())


def _fedavg() -> FedAvg:
    """FedAvg that samples every node of the stub grid (its default waits for >= 2 nodes)."""
    return FedAvg(min_train_nodes=1, min_evaluate_nodes=1, min_available_nodes=1)


def _configure(strategy: AuditingStrategy, world: dict, nodes: list[int]) -> ArrayRecord:
    arrays = ArrayRecord(world["global"])
    msgs = list(strategy.configure_train(1, arrays, ConfigRecord(), _Grid(nodes)))
    assert sorted(m.metadata.dst_node_id for m in msgs) == sorted(nodes)
    return arrays


def test_audited_aggregate_equals_plain_fedavg(world: dict, task_identity: None,
                                               tmp_path) -> None:
    plain = FedAvg()
    audited = AuditingStrategy(_fedavg(), store=AuditStore(tmp_path, "eq"),
                               attack=AttackSettings(max_seconds=60), dataset=DATASET)
    _configure(audited, world, [11, 12])
    ref_arrays, ref_metrics = plain.aggregate_train(1, _good_replies(world, (11, 12)))
    arrays, metrics = audited.aggregate_train(1, _good_replies(world, (11, 12)))
    assert _arrays_equal(arrays, ref_arrays)
    for key, value in ref_metrics.items():
        assert metrics[key] == pytest.approx(value)
    assert metrics["audit-replies"] == 2
    assert metrics["audit-reconstructions"] == 2
    assert metrics["audit-certified-exact"] == 2  # FedSGD on a clean update: λ = 1
    assert metrics["audit-lambda-mean"] == pytest.approx(1.0)
    assert metrics["audit-attack-seconds"] > 0
    assert "audit-psnr-mean" not in metrics  # no ground truth given
    assert [r.status for r in audited.records] == ["ok", "ok"]
    assert {r.partition_id for r in audited.records} == {0, 1}


def test_corrupt_and_failed_replies_do_not_stop_the_round(world: dict, task_identity: None,
                                                          tmp_path) -> None:
    nodes = [11, 21, 22, 23, 24, 25, 26]
    audited = AuditingStrategy(_fedavg(), store=AuditStore(tmp_path, "faults"),
                               attack=AttackSettings(max_seconds=60), dataset=DATASET)
    global_arrays = _configure(audited, world, nodes)
    good_state, _ = world["updates"][11]
    nan_state = {k: v.clone() for k, v in good_state.items()}
    nan_state["1.weight"][0, 0] = float("nan")
    shape_state = dict(good_state)
    shape_state["1.weight"] = torch.zeros(3, 3)
    missing_state = {k: v for k, v in good_state.items() if k != "3.bias"}
    two_arrays = _content(good_state, 6)
    two_arrays["more-arrays"] = ArrayRecord(good_state)
    replies = [
        *_good_replies(world, (11,)),
        _reply(21, _content(nan_state, 1)),
        _reply(22, _content(shape_state, 2)),
        _reply(23, _content(missing_state, 3)),
        _reply(24, _content(good_state, 4, num=None)),  # no num-examples
        _reply(25, error=Error(code=0, reason="client crashed: injected")),
        _reply(26, two_arrays),
    ]
    arrays, metrics = audited.aggregate_train(1, replies)

    by_node = {r.node_id: r for r in audited.records}
    assert by_node[11].status == "ok" and by_node[11].exact
    assert by_node[21].status == "corrupt" and "NaN" in by_node[21].error
    assert by_node[22].status == "corrupt" and "shape" in by_node[22].error
    assert by_node[23].status == "corrupt" and "missing" in by_node[23].error
    assert by_node[24].status == "corrupt" and "num-examples" in by_node[24].error
    assert by_node[25].status == "client-error" and "injected" in by_node[25].error
    assert by_node[26].status == "corrupt" and "ArrayRecord" in by_node[26].error
    # only the good reply was aggregated: the new global model is exactly that client's
    ref, _ = FedAvg().aggregate_train(1, _good_replies(world, (11,)))
    assert _arrays_equal(arrays, ref)
    assert not _arrays_equal(arrays, global_arrays)
    assert metrics["audit-corrupt"] == 5 and metrics["audit-client-errors"] == 1
    assert metrics["audit-reconstructions"] == 1
    lines = (audited.store.run_dir / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 7


def test_attack_exception_is_recorded_and_aggregation_goes_on(world: dict, task_identity: None,
                                                              tmp_path) -> None:
    bad = AttackSettings(max_seconds=10, options={"no_such_option": 1})  # invert raises
    audited = AuditingStrategy(_fedavg(), store=AuditStore(tmp_path, "fail"), attack=bad)
    _configure(audited, world, [11, 12])
    zero = _reply(12, _content(world["global"], 1))  # the global model sent back unchanged
    arrays, metrics = audited.aggregate_train(1, [*_good_replies(world, (11,)), zero])
    rec11, rec12 = audited.records
    assert rec11.status == "attack-error" and "no_such_option" in rec11.error
    assert rec12.status == "no-update" and "identically zero" in rec12.error
    ref, _ = FedAvg().aggregate_train(1, [*_good_replies(world, (11,)),
                                          _reply(12, _content(world["global"], 1))])
    assert _arrays_equal(arrays, ref)  # both were still aggregated
    assert metrics["audit-failures"] == 2 and metrics["audit-reconstructions"] == 0
    line = (audited.store.run_dir / "round-1/client-0/metrics.json").read_text()
    assert "no_such_option" in line


def test_hard_timeout_kills_the_worker_and_it_restarts(world: dict, task_identity: None) -> None:
    settings = AttackSettings(max_seconds=None, timeout=0.05, startup_timeout=300)
    audited = AuditingStrategy(_fedavg(), attack=settings)
    try:
        _configure(audited, world, [11])
        audited._worker.ensure_ready()  # startup is not attack time
        arrays, metrics = audited.aggregate_train(1, _good_replies(world, (11,)))
        (rec,) = audited.records
        assert rec.status == "timeout" and "hard timeout" in rec.error
        assert metrics["audit-failures"] == 1
        assert not audited._worker.alive  # killed
        assert arrays is not None  # the round went on
        # a generous limit: the worker is restarted and the attack succeeds
        audited.attack.timeout = 300.0
        _configure(audited, world, [12])
        audited.aggregate_train(2, _good_replies(world, (12,)))
        assert audited.records[-1].status == "ok" and audited.records[-1].exact
    finally:
        audited.close()
    assert not audited._worker.alive


def test_audit_mode_scores_and_strips_ground_truth(world: dict, task_identity: None,
                                                   tmp_path) -> None:
    seen: list[Message] = []

    class Spy(FedAvg):
        def aggregate_train(self, server_round, replies):
            replies = list(replies)
            seen.extend(replies)
            return super().aggregate_train(server_round, replies)

    audited = AuditingStrategy(Spy(min_train_nodes=1, min_available_nodes=1),
                               store=AuditStore(tmp_path, "gt"),
                               ground_truth=GroundTruth(DATASET, SIZE, seed=0), dataset=DATASET,
                               attack=AttackSettings(max_seconds=60))
    _configure(audited, world, [13])
    _, metrics = audited.aggregate_train(1, _good_replies(world, (13,), gt=True))
    (rec,) = audited.records
    assert rec.status == "ok" and rec.exact
    assert rec.psnr_mean > 90.0  # exact up to float error (papers' threshold)
    assert metrics["audit-psnr-mean"] == pytest.approx(rec.psnr_mean)
    assert rec.original_images.shape == (B, 1, 28, 28)
    _, idx = world["updates"][13]
    assert np.allclose(rec.original_images, world["images"][idx].double().numpy())
    # the reconstruction is shown in the originals' order after matching
    assert np.abs(rec.recon_images - rec.original_images).max() < 1e-3
    assert "sample-indices" not in seen[0].content["client-info"]  # stripped
    assert seen[0].content["client-info"]["partition-id"] == 2
    assert (audited.store.run_dir / "round-1/client-2/original.png").is_file()


def test_disabled_audit_is_a_pure_pass_through(world: dict, task_identity: None) -> None:
    audited = AuditingStrategy(_fedavg(), enabled=False)
    _configure(audited, world, [11, 12])
    arrays, metrics = audited.aggregate_train(1, _good_replies(world, (11, 12)))
    ref_arrays, ref_metrics = FedAvg().aggregate_train(1, _good_replies(world, (11, 12)))
    assert _arrays_equal(arrays, ref_arrays) and dict(metrics) == dict(ref_metrics)
    assert audited.records == []



def test_fedavg_runs_attack_sums_over_local_steps() -> None:
    """The ServerApp's run config: a FedAvg federation attacks with ``update="fedavg"`` (its
    clients send sums over local steps) unless the run config names another update."""
    from fl_attack_flwr.server_app import attack_settings, resolve_run_config

    assert attack_settings(resolve_run_config({"protocol": "fedavg"})).options == {
        "update": "fedavg"}
    assert "update" not in attack_settings(resolve_run_config({"protocol": "fedsgd"})).options
    explicit = resolve_run_config({"protocol": "fedavg", "attack.update": "gradient"})
    assert attack_settings(explicit).options == {"update": "gradient"}


def test_next_layer_update_is_the_layer_the_attacked_one_feeds() -> None:
    """The strategy gives the attack the update of the linear layer after the attacked one
    (``next_weight_grad``), none after the last layer, and none for FedAvg sums."""
    from fl_attack_flwr.audit import _next_layer_update

    model = relu_mlp(784, WIDTH, 3, seed=0)
    g_state = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    n_state = {k: v + 0.5 for k, v in g_state.items()}
    first = _next_layer_update(g_state, n_state, None, WIDTH)
    assert first is not None and first.shape == (WIDTH, WIDTH)
    assert np.allclose(first, -0.5)
    assert _next_layer_update(g_state, n_state, "3.weight", WIDTH) is not None
    assert _next_layer_update(g_state, n_state, "7.weight", 10) is None  # the output layer
    assert _next_layer_update(g_state, n_state, None, WIDTH + 1) is None  # does not take them
    assert AttackSettings().uses_next_layer()
    assert not AttackSettings(options={"update": "fedavg"}).uses_next_layer()
    assert not AttackSettings(next_layer=False).uses_next_layer()
