"""The defence matrix (``python -m experiments.defences``) and the pieces it adds to Flower.

* The matrix at its smallest size, end to end in one Flower simulation: every row completes,
  the Markdown section and the HTML page are written, and the numbers obey what the defences
  and the attack promise (no defence: the server reconstructs; central DP: the server still
  receives every client's update; local DP whose noise swamps the update: nothing certified;
  secure aggregation: only the aggregate is attacked; the clients' guard withholds exactly
  the updates it proves readable; certified: above 90 dB).
* The SecAgg+ server strategy on a constructed round: the unmasked aggregate of three clients'
  real updates is attacked as one batch of all their samples, the model is left as SecAgg+
  aggregated it.
* The SecAgg+ client adapter trains exactly what the plugin's client trains.
* The named train action and the per-row reset of a node's state.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.common import Code, FitIns, FitRes, Status, ndarrays_to_parameters
from flwr.compat.common import recorddict_compat as compat
from flwr.serverapp.strategy import FedAvg

from experiments.defence_apps import NamedAction, fresh_state_mod, row_config
from experiments.defence_report import collect, markdown_table, sentence
from experiments.defence_secaggplus import AuditedSecAggPlusFedAvg, legacy_train
from experiments.defence_variants import Defence
from fl_attack.testbed.data import load_images, normalize
from fl_attack.testbed.models import relu_mlp
from fl_attack.testbed.simulate import local_update
from fl_attack_flwr import AttackSettings, AuditingStrategy, AuditStore, GroundTruth
from fl_attack_flwr.output.private_files import records_from_jsonl
from tests.flower_fakes import FakeGrid

ROOT = Path(__file__).resolve().parents[1]
DATASET, SIZE, B, WIDTH = "mnist", 200, 8, 100


@pytest.fixture(scope="module")
def matrix_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """``python -m experiments.defences`` at its default (smallest) size, in a subprocess."""
    tmp = tmp_path_factory.mktemp("defences")
    md, html = tmp / "defences.md", tmp / "defences.html"
    args = [sys.executable, "-m", "experiments.defences", "--out-dir", str(tmp / "runs"),
            "--md", str(md), "--html", str(html)]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    (run_dir,) = list((tmp / "runs").iterdir())
    rows = {r["key"]: r for r in json.loads((run_dir / "rows.json").read_text())}
    lines = {key: records_from_jsonl(run_dir / key / "metrics.jsonl") for key in rows}
    return {"md": md.read_text(), "html": html.read_text(), "rows": rows, "lines": lines,
            "html_path": str(html)}


def test_matrix_writes_its_results(matrix_run: dict) -> None:
    rows, md, html = matrix_run["rows"], matrix_run["md"], matrix_run["html"]
    assert all(r["status"] == "completed" for r in rows.values()), rows
    families = {r["family"] for r in rows.values()}
    assert families == {"none", "fedavg", "central-dp-server", "central-dp-client", "local-dp",
                        "dp-sgd", "leak-guard", "secagg", "secagg+"}
    assert "Machine:" in md and "python -m experiments.defences" in md
    for r in rows.values():  # one table line and one sentence per row
        assert f"| {r['label']} |" in md and f"- {r['label']}:" in md
    assert html.count("<img") == 1 and "<table>" in html and "Which defence" in html
    links = re.findall(r"href='([^']*)'", html)  # each row's own report, relative to the page
    assert len(links) == len(rows) and not any(os.path.isabs(link) for link in links)
    page_dir = Path(matrix_run["html_path"]).parent
    assert all((page_dir / link).is_file() for link in links)


def test_matrix_numbers_keep_the_defences_promises(matrix_run: dict) -> None:
    rows, lines = matrix_run["rows"], matrix_run["lines"]
    clients = rows["none"]["clients"]
    assert rows["none"]["reconstructed"] >= 1  # no defence: the server reads something
    for key in ("central_dp_server", "central_dp_client"):  # noise only after aggregation:
        assert rows[key]["attacked"] == clients  # the server saw every client's own update
    for r in rows.values():
        if r["family"] == "local-dp":  # ε = 1 at the small size: noise swamps the update
            assert r["certified"] == 0
        if r["family"] in ("secagg", "secagg+"):  # only the aggregate is attacked
            assert r["attacked"] == 1 and r["samples"] == sum(
                ln["num_examples"] for ln in lines[r["key"]]
                if ln["server_round"] == 1 and ln["status"] == "skipped")
        if r["family"] == "dp-sgd":
            assert r["epsilon"] not in ("–", "∞")
        replies = [ln for ln in lines[r["key"]] if not ln["client"].startswith("aggregate")]
        if r["family"] == "leak-guard":  # every reply carries its client's finding
            assert r["guarded"] == len(replies) and r["refused"] <= r["guarded"]
            for ln in replies:  # withheld exactly when the check proved samples readable
                assert (ln["status"] == "refused") == ln["guard"]["refused"]
                assert ln["guard"]["refused"] == (ln["guard"]["readable_samples"] > 0)
                if ln["status"] == "refused":
                    assert not ln.get("psnr")  # nothing reached the server to read
        else:
            assert r["guarded"] == 0 and r["refused"] == 0
        assert 0 <= r["exact"] <= r["readable"] <= r["samples"]
    certified = [ln for ls in lines.values() for ln in ls if ln["status"] == "certified"]
    assert certified and all(ln["psnr_mean"] > 90.0 for ln in certified)  # soundness


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """The initial model of a 3-client row and the clients' real FedSGD updates."""
    out = str(tmp_path_factory.mktemp("rows"))
    cfg = row_config({"num-clients": 3, "dataset": DATASET, "dataset-size": SIZE,
                      "batch-size": B, "width": WIDTH, "output-dir": out},
                     Defence("secaggplus", "secagg+", "SecAgg+"))
    from fl_attack_flwr.app.server_app import initial_arrays

    state = {k: torch.from_numpy(v.numpy()) for k, v in initial_arrays(cfg).items()}
    model = relu_mlp(784, WIDTH, 3, 10)
    model.load_state_dict(state)
    images, labels = load_images(DATASET, SIZE, seed=0)
    updates = []
    for i in range(3):
        idx = np.arange(i * B, (i + 1) * B)
        res = local_update(model, normalize(images[idx], DATASET), labels[idx],
                           protocol="fedsgd", lr=0.01)
        updates.append((res.state_dict, idx))
    return {"cfg": cfg, "state": state, "updates": updates}


class _Clients:
    """The part of a legacy ClientManager that FedAvg's configure_fit uses."""

    def __init__(self, proxies: list[SimpleNamespace]) -> None:
        self.proxies = proxies

    def num_available(self) -> int:
        return len(self.proxies)

    def sample(self, num_clients: int, min_num_clients: int | None = None) -> list:
        return self.proxies[:num_clients]


@pytest.mark.usefixtures("task_identity")
def test_secaggplus_strategy_attacks_the_unmasked_aggregate(world: dict, tmp_path: Path) -> None:
    cfg, names = world["cfg"], list(world["state"])
    audit = AuditingStrategy(
        FedAvg(min_train_nodes=1, min_evaluate_nodes=1, min_available_nodes=1),
        store=AuditStore(tmp_path, "secaggplus"), ground_truth=GroundTruth(DATASET, SIZE),
        attack=AttackSettings(executor="inline", max_seconds=60.0, target="aggregate"),
        dataset=DATASET, protocol="fedsgd")
    strategy = AuditedSecAggPlusFedAvg(audit, FakeGrid([11, 12, 13]), cfg)
    proxies = [SimpleNamespace(node_id=n) for n in (11, 12, 13)]
    params = ndarrays_to_parameters([world["state"][k].numpy() for k in names])
    assert len(strategy.configure_fit(1, params, _Clients(proxies))) == 3
    mean = [np.mean([u[k].numpy() for u, _ in world["updates"]], axis=0, dtype=np.float64)
            for k in names]
    unmasked = ndarrays_to_parameters(mean)  # what SecAgg+ gives every FitRes
    results = [(p, FitRes(Status(Code.OK, ""), unmasked, B,
                          {"partition-id": i, "sample-indices": ",".join(map(str, idx))}))
               for i, (p, (_, idx)) in enumerate(zip(proxies, world["updates"], strict=True))]
    aggregated, _ = strategy.aggregate_fit(1, results, [])
    audit.close()
    from flwr.common import parameters_to_ndarrays

    for got, want in zip(parameters_to_ndarrays(aggregated), mean, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-9)
    clients = [r for r in audit.records if r.node_id != 0]
    assert sorted(r.partition_id for r in clients) == [0, 1, 2]
    assert all(r.status == "skipped" and "secure aggregation" in r.reason for r in clients)
    (agg,) = [r for r in audit.records if r.node_id == 0]
    assert sorted(agg.sample_indices) == list(range(3 * B))  # the union of their batches
    assert agg.reconstructed and agg.batch_size == 3 * B
    assert (agg.status == "certified") == bool(agg.exact)


@pytest.mark.usefixtures("task_identity")
def test_secaggplus_client_trains_what_the_plugin_client_trains(world: dict) -> None:
    from fl_attack_flwr.app.server_app import client_config_record
    from fl_attack_flwr.clients.client_app import train

    names = list(world["state"])
    config = {**dict(client_config_record(world["cfg"])), "server-round": 1}
    params = ndarrays_to_parameters([world["state"][k].numpy() for k in names])

    def context() -> Context:
        return Context(1, 5, {"partition-id": 1, "num-partitions": 3}, RecordDict(), {})

    legacy = Message(content=compat.fitins_to_recorddict(FitIns(params, config), True),
                     dst_node_id=5, message_type="train")
    res = compat.recorddict_to_fitres(legacy_train(legacy, context()).content, False)
    plain = Message(content=RecordDict({"arrays": ArrayRecord(world["state"]),
                                        "config": ConfigRecord(config)}),
                    dst_node_id=5, message_type="train")
    reply = train(plain, context())
    from flwr.common import parameters_to_ndarrays

    want = next(iter(reply.content.array_records.values()))
    for name, got in zip(names, parameters_to_ndarrays(res.parameters), strict=True):
        np.testing.assert_array_equal(got, want[name].numpy())
    info = reply.content.config_records["client-info"]
    assert res.num_examples == B and res.metrics["partition-id"] == 1
    assert res.metrics["sample-indices"] == ",".join(str(i) for i in info["sample-indices"])


@pytest.mark.usefixtures("task_identity")
def test_named_action_readdresses_train_messages_only(world: dict) -> None:
    inner = FedAvg(min_train_nodes=1, min_evaluate_nodes=1, min_available_nodes=1)
    named = NamedAction(inner, "local_dp_1")
    arrays = ArrayRecord(world["state"])
    msgs = list(named.configure_train(1, arrays, ConfigRecord(), FakeGrid([11, 12])))
    assert {m.metadata.message_type for m in msgs} == {"train.local_dp_1"}
    assert sorted(m.metadata.dst_node_id for m in msgs) == [11, 12]
    assert all(m.content.array_records["arrays"] is arrays for m in msgs)
    evals = list(named.configure_evaluate(1, arrays, ConfigRecord(), FakeGrid([11, 12])))
    assert {m.metadata.message_type for m in evals} == {"evaluate"}
    with pytest.raises(ValueError, match="identifier"):
        NamedAction(inner, "local-dp")


@pytest.mark.usefixtures("task_identity")
def test_fresh_state_mod_forgets_earlier_rows_at_round_1_only() -> None:
    ctx = Context(1, 5, {}, RecordDict({"dp-history": ConfigRecord({"noise": [1.0]})}), {})

    def msg(server_round: int) -> Message:
        return Message(content=RecordDict({"config": ConfigRecord(
            {"server-round": server_round})}), dst_node_id=5, message_type="train")

    seen = []
    fresh_state_mod(msg(2), ctx, lambda m, c: seen.append(len(c.state)) or m)
    fresh_state_mod(msg(1), ctx, lambda m, c: seen.append(len(c.state)) or m)
    assert seen == [1, 0]


def test_a_row_that_did_not_run_is_reported_not_invented(tmp_path: Path) -> None:
    d = Defence("none", "none", "no defence (FedSGD)")
    (row,) = collect(tmp_path, [d], rounds=2)
    assert row["status"] == "missing"
    assert "did not complete" in sentence(row, None)
    assert "| no defence (FedSGD) | missing |" in markdown_table([row])
