"""The ``ray`` executor on a real multi-node Ray cluster.

Ray's own test harness (``ray.cluster_utils.Cluster``) starts a head node and a second node as
separate Ray processes on this machine, as ``ray start --head`` and ``ray start --address`` do
on two machines. Only the second node has the custom resource ``fl-attack``: attacks that ask
for it must run there, and each outcome names the node it ran on. The audit's records, written
by the server, carry that node id.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import ray
from ray.cluster_utils import Cluster

from fl_attack_flwr import AttackSettings, AuditingStrategy, AuditStore, verdicts
from fl_attack_flwr.executors.ray_actors import RayExecutor
from fl_attack_flwr.jobs.build import AttackJob, build_job
from fl_attack_flwr.jobs.layers import choose_layer
from fl_attack_flwr.output.private_files import records_from_jsonl
from tests.flower_fakes import configure, fedavg, good_replies

ATTACK_NODE = {"fl-attack": 1.0}


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[Cluster, str]]:
    """A head node (1 CPU) and an attack node (1 CPU, resource ``fl-attack``); the attack
    node's id. This process is connected to the cluster as its driver."""
    if ray.is_initialized():
        ray.shutdown()
    c = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "include_dashboard": False, "object_store_memory": 200 * 1024**2})
    node = c.add_node(num_cpus=1, resources=ATTACK_NODE, object_store_memory=200 * 1024**2)
    c.wait_for_nodes()
    try:
        yield c, node.node_id
    finally:
        ray.shutdown()
        c.shutdown()


def _job(world: dict) -> AttackJob:
    sent = {k: v.numpy() for k, v in world["global"].items()}
    state, _ = world["updates"][11]
    back = {k: v.numpy() for k, v in state.items()}
    settings = AttackSettings(update="gradient", max_seconds=60.0, next_layer=False)
    return build_job(1, 11, "client-0", sent, back, choose_layer(sent), settings)


def test_attacks_run_on_the_node_that_has_the_resource(cluster: tuple[Cluster, str],
                                                       world: dict) -> None:
    c, attack_node = cluster
    ex = RayExecutor(c.address, num_cpus=1.0, num_gpus=0.0, resources=ATTACK_NODE,
                     timeout=300.0)
    try:
        outs = [f.result(timeout=300) for f in [ex.submit(_job(world)) for _ in range(2)]]
    finally:
        ex.close()
    assert ex.max_inflight == 1  # the cluster holds one `fl-attack`: one attack at a time
    for out in outs:
        assert out.status in verdicts.RECONSTRUCTED, out.error
        assert out.ran_on == f"ray-node:{attack_node}"
    head = {n["NodeID"] for n in ray.nodes() if n["Alive"]} - {attack_node}
    assert len(head) == 1 and all(out.ran_on != f"ray-node:{h}" for h in head for out in outs)


@pytest.mark.usefixtures("task_identity")
def test_the_audit_stores_what_the_cluster_computed(cluster: tuple[Cluster, str], world: dict,
                                                    tmp_path) -> None:
    c, attack_node = cluster
    settings = AttackSettings(executor="ray", ray_address=c.address, ray_num_cpus=1.0,
                              ray_num_gpus=0.0, ray_resources=ATTACK_NODE, max_seconds=60.0,
                              update="gradient")
    store = AuditStore(tmp_path, "cluster")
    strategy = AuditingStrategy(fedavg(), store=store, attack=settings)
    configure(strategy, world, [11, 12])
    try:
        strategy.aggregate_train(1, good_replies(world, (11, 12)))
    finally:
        strategy.close()
    lines = records_from_jsonl(store.run_dir / "metrics.jsonl")
    assert len(lines) == 2
    assert all(ln["status"] in verdicts.RECONSTRUCTED for ln in lines), lines
    assert {ln["ran_on"] for ln in lines} == {f"ray-node:{attack_node}"}


def test_another_address_than_the_running_ray_fails_naming_it(
        cluster: tuple[Cluster, str]) -> None:
    """This process is the cluster's driver; a different address cannot be honoured."""
    ex = RayExecutor("127.0.0.1:1", num_cpus=1.0, num_gpus=0.0)
    with pytest.raises(ValueError, match=r"ray_address '127\.0\.0\.1:1'"):
        ex.start()
    ex.close()
