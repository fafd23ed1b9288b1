"""Leakage as the model trains: each round's accuracy stored beside what the audit read, the
sentence and plot of the report, and the clients' held-out evaluation.

The sentence is checked against numbers recomputed here from the records, never against what an
attack happened to give: records are made by hand, and the one Flower test feeds hand-made
evaluate replies.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from flwr.app import ArrayRecord, Context, Message, Metadata, MetricRecord, RecordDict

from fl_attack_flwr import AuditingStrategy
from fl_attack_flwr.app.run_config import RunConfigError, check_run_config, resolve_run_config
from fl_attack_flwr.clients.partition import eval_split, iid_partition
from fl_attack_flwr.output.progress import by_round, progress_png, trend_sentence
from fl_attack_flwr.output.store import AuditStore
from fl_attack_flwr.output.summary import READABLE_DB
from fl_attack_flwr.results.records import ClientAudit
from tests.flower_fakes import FakeGrid, fedavg

B = 8
#: round -> (accuracy, PSNR of each sample of the round's two attacked updates, or a status)
ROUNDS: dict[int, tuple[float, list[object]]] = {
    1: (0.12, [[120.0] * B, [118.0] * B]),
    2: (0.30, [[110.0] * B, "certified"]),
    3: (0.55, [[30.0, 20.0] * 4, [12.0] * B]),
    4: (0.70, [[15.0] * B, "timeout"]),
    5: (0.78, [[26.0] + [10.0] * 7, "protected"]),
    6: (0.81, [[11.0] * B, [9.0] * B]),
}


def _record(rnd: int, pid: int, what: object) -> ClientAudit:
    if what == "certified":  # no ground truth: a certified batch counts whole
        return ClientAudit(rnd, pid, partition_id=pid, status="certified", batch_size=B,
                           num_examples=B, sparsity_match=1.0, exact=True, reads="inputs")
    if what in ("timeout", "protected"):
        return ClientAudit(rnd, pid, partition_id=pid, status=str(what), num_examples=B,
                           reason="hand-made")
    psnr = list(what)  # type: ignore[call-overload]
    return ClientAudit(rnd, pid, partition_id=pid, status="not-certified", batch_size=B,
                       num_examples=B, true_batch_size=B, sparsity_match=0.99, psnr=psnr,
                       psnr_mean=float(np.mean(psnr)), reading="fedavg", reads="inputs")


def _store(tmp_path: Path, name: str = "training") -> AuditStore:
    store = AuditStore(tmp_path, name, config={"protocol": "fedavg", "dataset": "mnist",
                                               "eval-held-out": True, "eval-size": 16},
                       reconstructions=False)
    for rnd, (acc, updates) in ROUNDS.items():
        for pid, what in enumerate(updates):
            store.add(_record(rnd, pid, what))
        store.add_round(rnd, {"audit-replies": 2})
        store.add_round(rnd, {"evaluate": {"eval-acc": acc, "eval-loss": 1.0}})
    return store


def _numbers(text: str) -> list[int]:
    return [int(n) for n in re.findall(r"\d+", text)]


def test_by_round_counts_what_the_server_read_beside_the_accuracy(tmp_path: Path) -> None:
    store = _store(tmp_path)
    rows = by_round(store.records, store.rounds, readable_db=READABLE_DB)
    assert [r["round"] for r in rows] == list(ROUNDS)
    for row, (acc, updates) in zip(rows, ROUNDS.values(), strict=True):
        answered = [u for u in updates if u != "timeout"]
        read = sum(B if u == "certified" else 0 if u == "protected" else
                   sum(p > READABLE_DB for p in u) for u in answered)  # type: ignore[union-attr]
        assert row["accuracy"] == acc and row["accuracy_from"] == "clients"
        assert row["attacked"] == len(answered) and row["samples"] == B * len(answered)
        assert row["read"] == read and row["certified"] == updates.count("certified")
        assert row["no_answer"] == updates.count("timeout")


def test_the_sentence_says_what_the_rows_say(tmp_path: Path) -> None:
    store = _store(tmp_path)
    rows = by_round(store.records, store.rounds, readable_db=READABLE_DB)
    sentence = trend_sentence(rows)
    assert sentence is not None
    early, late = rows[:2], rows[-2:]  # 6 audited rounds: windows of 6 // 3
    r1, n1 = sum(r["read"] for r in early), sum(r["samples"] for r in early)
    r2, n2 = sum(r["read"] for r in late), sum(r["samples"] for r in late)
    assert r2 / n2 < r1 / n1
    assert (f"fell: {r1} of {n1} ({100 * r1 / n1:.0f}%) in rounds 1-2, {r2} of {n2} "
            f"({100 * r2 / n2:.0f}%) in rounds 5-6") in sentence
    low = min(rows, key=lambda r: r["read"] / r["samples"])  # the first of the lowest
    assert low["round"] == 4 and low["read"] == 0
    assert f"the fewest in round 4 (0 of {low['samples']}, 0%)" in sentence
    c1, a1 = sum(r["certified"] for r in early), sum(r["attacked"] for r in early)
    c2, a2 = sum(r["certified"] for r in late), sum(r["attacked"] for r in late)
    assert (c1, a1, c2, a2) == (1, 4, 0, 4)
    assert f"certified exact: {c1} of {a1}, then {c2} of {a2}" in sentence
    assert "accuracy rose from 12% after round 1 to 81% after round 6" in sentence
    assert "1 attack gave no answer and is left out" in sentence


def test_the_sentence_follows_the_numbers_whichever_way_they_go() -> None:
    def row(rnd: int, read: int, acc: float | None) -> dict[str, object]:
        return {"round": rnd, "accuracy": acc, "accuracy_from": "clients", "attacked": 1,
                "certified": int(read == 10), "samples": 10, "read": read, "no_answer": 0}

    rising = trend_sentence([row(1, 2, 0.5), row(2, 10, 0.4)])
    assert rising is not None and "rose: 2 of 10 (20%) in round 1" in rising
    assert "10 of 10 (100%) in round 2" in rising and "accuracy fell from 50%" in rising
    same = trend_sentence([row(1, 5, 0.501), row(2, 5, 0.499)])
    assert same is not None and "read stayed the same" in same
    assert "accuracy stayed at 50%" in same  # equal as printed: no "rose from 50% to 50%"
    assert trend_sentence([row(1, 5, 0.5), {**row(2, 0, 0.6), "attacked": 0}]) is None
    skipped = [row(1, 5, None), {**row(2, 0, None), "attacked": 0}, row(3, 4, None)]
    gaps = trend_sentence(skipped)
    assert gaps is not None and "round 3" in gaps and "accuracy" not in gaps
    many = trend_sentence([row(r, 10 if r <= 5 else 0, r / 40) for r in range(1, 41)])
    assert many is not None and "in rounds 1-10" in many and "in rounds 31-40" in many


def test_the_report_puts_leakage_beside_accuracy(tmp_path: Path) -> None:
    summary = _store(tmp_path).finalize({"status": "completed"})
    assert summary["leakage_trend"] == trend_sentence(summary["by_round"])
    page = (Path(summary["run_dir"]) / "report.html").read_text()
    section = page.split("<h2>Leakage as the model trains</h2>")[1].split("<h2>")[0]
    assert summary["leakage_trend"].replace("'", "&#x27;") in section
    assert 'alt="leakage and accuracy per round"' in section
    assert "on 16 samples each that they never train on" in section
    assert "never certified" in section  # FedAvg readings: PSNR is what says
    table = page.split("<h2>Per round</h2>")[1].split("</table>")[0]
    assert "<th>accuracy</th>" in table and "<td>81.0%</td>" in table
    assert "model accuracy 81% after round 6." in page.split("<h2>")[0]  # under the verdict
    rows = summary["by_round"]
    assert f"<td>{rows[2]['read']} of {rows[2]['samples']}</td>" in table
    assert progress_png(rows)[:8] == b"\x89PNG\r\n\x1a\n"


def _evaluate_reply(node: int, acc: float, n: int) -> Message:
    md = Metadata(run_id=1, message_id=f"eval-{node}", src_node_id=node, dst_node_id=0,
                  reply_to_message_id=f"ins-{node}", group_id="1", created_at=time.time(),
                  ttl=3600.0, message_type="evaluate")
    metrics = MetricRecord({"num-examples": n, "eval-acc": acc, "eval-loss": 1.0})
    return Message(content=RecordDict({"metrics": metrics}), metadata=md)


class _SilentGrid(FakeGrid):
    """A grid whose clients never answer (enough to drive Flower's loop round by round)."""

    def send_and_receive(self, messages: object, timeout: float | None = None) -> list[Message]:
        list(messages)  # type: ignore[call-overload]
        return []


@pytest.mark.usefixtures("task_identity")
def test_the_strategy_stores_each_rounds_evaluation(tmp_path: Path) -> None:
    store = AuditStore(tmp_path, "evals")
    strategy = AuditingStrategy(fedavg(), store=store, enabled=False)
    metrics = strategy.aggregate_evaluate(3, [_evaluate_reply(11, 0.5, 10),
                                              _evaluate_reply(12, 1.0, 30)])
    assert metrics is not None and metrics["eval-acc"] == pytest.approx(0.875)  # FedAvg's
    assert store.rounds[3]["evaluate"]["eval-acc"] == pytest.approx(0.875)
    last = json.loads((store.run_dir / "rounds.jsonl").read_text().splitlines()[-1])
    assert last["round"] == 3 and last["evaluate"]["eval-acc"] == pytest.approx(0.875)
    assert 0 <= last["round-end-seconds"] <= time.time() - store.started

    seen: list[int] = []

    def central(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        seen.append(server_round)
        return MetricRecord({"accuracy": 0.25 * server_round})

    strategy.start(_SilentGrid([11]), ArrayRecord(), num_rounds=2, evaluate_fn=central)
    assert seen == [0, 1, 2]  # Flower evaluates the initial model too: not a round
    assert sorted(store.rounds) == [1, 2, 3]
    assert store.rounds[2]["evaluate-server"] == {"accuracy": 0.5}
    rows = store.finalize()["by_round"]
    assert [(r["round"], r["accuracy"], r["accuracy_from"]) for r in rows] == [
        (1, 0.25, "server"), (2, 0.5, "server"), (3, 0.875, "clients")]


def test_a_held_out_split_keeps_the_evaluation_samples_out_of_training() -> None:
    shard = iid_partition(100, 3, seed=0)[1]
    pool, evaluation = eval_split(shard, 10, held_out=True)
    assert len(evaluation) == 10 and not set(pool) & set(evaluation)
    assert sorted([*pool, *evaluation]) == sorted(shard)
    pool, evaluation = eval_split(shard, 10, held_out=False)
    assert np.array_equal(pool, shard) and np.array_equal(evaluation, shard[:10])
    with pytest.raises(ValueError, match="eval-held-out"):
        eval_split(shard, len(shard), held_out=True)


@pytest.mark.usefixtures("task_identity")
def test_held_out_clients_never_train_on_what_they_evaluate(tmp_path: Path) -> None:
    from fl_attack_flwr.app.server_app import client_config_record, initial_arrays
    from fl_attack_flwr.clients.client_app import evaluate, train

    cfg = check_run_config({**resolve_run_config({}), "dataset": "mnist", "dataset-size": 120,
                            "batch-size": 8, "width": 20, "eval-size": 16,
                            "eval-held-out": True, "output-dir": str(tmp_path)})
    arrays = initial_arrays(cfg)
    context = Context(1, 5, {"partition-id": 2, "num-partitions": 3}, RecordDict(), {})
    trained: set[int] = set()
    for rnd in range(1, 9):
        config = client_config_record({**cfg, "server-round": rnd})
        config["server-round"] = rnd
        msg = Message(content=RecordDict({"arrays": arrays, "config": config}),
                      dst_node_id=5, message_type="train")
        trained |= set(train(msg, context).content.config_records["client-info"][
            "sample-indices"])
    shard = iid_partition(120, 3, seed=0)[2]
    assert trained <= set(shard[16:].tolist()) and len(trained) > 16
    msg = Message(content=RecordDict({"arrays": arrays, "config": client_config_record(cfg)}),
                  dst_node_id=5, message_type="evaluate")
    metrics = evaluate(msg, context).content.metric_records["metrics"]
    assert metrics["num-examples"] == 16 and 0.0 <= metrics["eval-acc"] <= 1.0


def test_the_run_config_counts_the_held_out_samples(tmp_path: Path) -> None:
    base = {**resolve_run_config({}), "dataset": "mnist", "dataset-size": 150, "batch-size": 16,
            "eval-size": 40, "output-dir": str(tmp_path)}
    check_run_config({**base, "eval-held-out": False})  # shards of 50 hold a batch of 16
    with pytest.raises(RunConfigError, match="less the eval-size 40 held out"):
        check_run_config({**base, "eval-held-out": True})
    with pytest.raises(RunConfigError, match="eval-held-out must be bool"):
        check_run_config({**base, "eval-held-out": "yes"})


BROWSER = shutil.which("chromium") or shutil.which("chromium-browser")
NEEDS_BROWSER = pytest.mark.skipif(
    BROWSER is None and os.environ.get("FL_ATTACK_REQUIRE_BROWSER") != "1",
    reason="headless Chromium is not installed (apt-get install chromium)")


@NEEDS_BROWSER
def test_the_leakage_plot_loads_in_a_browser(tmp_path: Path) -> None:
    assert BROWSER is not None, "FL_ATTACK_REQUIRE_BROWSER=1 but no chromium on PATH"
    summary = _store(tmp_path).finalize({"status": "completed"})
    page = Path(summary["report"]).read_text()
    probe = tmp_path / "probe.html"
    probe.write_text(page.replace("</body>", (
        "<script>window.addEventListener('load', () => {const i = document.querySelector("
        "'img[alt=\"leakage and accuracy per round\"]'); document.body.setAttribute("
        "'data-plot', i && i.complete ? i.naturalWidth : 0); document.body.setAttribute("
        "'data-trend', document.getElementById('trend').innerText.length);});</script>"
        "</body>")))
    dom = subprocess.run([BROWSER, "--headless", "--no-sandbox", "--disable-gpu",
                          "--virtual-time-budget=5000", "--dump-dom", probe.as_uri()],
                         capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    width = re.search(r'data-plot="(\d+)"', dom.stdout)
    trend = re.search(r'data-trend="(\d+)"', dom.stdout)
    assert width is not None and int(width.group(1)) >= 800  # the 9-inch plot decoded
    assert trend is not None and int(trend.group(1)) == len(summary["leakage_trend"])
