"""``LeakGuard``, the client mod that checks the client's own update before it leaves.

The policy logic is tested on hand-made Flower messages with the guard's check replaced by a
given finding (each situation built directly); the check itself is the server's attack, run on
real updates; and both policies run in real Flower simulations, where the server's records
must carry each client's finding and a refused update must leave the server nothing to read.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from flwr.app import Context, Message, RecordDict

from fl_attack_flwr import AttackSettings, AuditingStrategy, LeakGuard, verdicts
from fl_attack_flwr.clients.leak_guard import GuardFinding
from fl_attack_flwr.wire import GUARD_CODES, GUARD_KEYS
from tests.demo_runs import run_demo
from tests.flower_fakes import (
    arrays_equal,
    configure,
    content,
    fedavg,
    instruction,
    reply,
)

CERTIFIED = GuardFinding("certified", readable_samples=8, sparsity_match=1.0, seconds=0.5)
PROTECTED = GuardFinding("protected", seconds=0.1, reason="mixes at least min(m, n)")
TIMEOUT = GuardFinding("timeout", sparsity_match=0.91, seconds=30.0)


def _guarded(world: dict, guard: LeakGuard, node: int = 11,
             num: int = 8) -> tuple[Message, Message]:
    """The client's reply as its handler made it (``num`` samples), and as the guard lets it go."""
    state, _ = world["updates"][node]
    made = reply(node, content(state, node - 11, num=num))
    unguarded = reply(node, content(state, node - 11, num=num))
    sent = guard(instruction(node, world["global"]), Context(1, node, {}, RecordDict(), {}),
                 lambda _msg, _ctx: made)
    return unguarded, sent


def _metrics(msg: Message) -> dict[str, float]:
    return dict(next(iter(msg.content.metric_records.values())))


def _with_finding(monkeypatch: pytest.MonkeyPatch, guard: LeakGuard,
                  finding: GuardFinding) -> LeakGuard:
    monkeypatch.setattr(guard, "check", lambda sent, msg: finding)
    return guard


@pytest.mark.parametrize("finding", [CERTIFIED, PROTECTED, TIMEOUT])
def test_report_sends_the_update_unchanged_with_the_finding(
        world: dict, monkeypatch: pytest.MonkeyPatch, finding: GuardFinding) -> None:
    guard = _with_finding(monkeypatch, LeakGuard("report"), finding)
    unguarded, sent = _guarded(world, guard)
    assert arrays_equal(next(iter(sent.content.array_records.values())),
                        next(iter(unguarded.content.array_records.values())))
    metrics = _metrics(sent)
    assert set(GUARD_KEYS) <= set(metrics) and metrics["num-examples"] == 8
    assert GUARD_CODES[int(metrics["leak-guard-status"])] == finding.status
    assert metrics["leak-guard-refused"] == 0
    assert metrics["leak-guard-readable-samples"] == finding.readable_samples


def test_refuse_withholds_a_provably_readable_update(world: dict,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    guard = _with_finding(monkeypatch, LeakGuard("refuse"), CERTIFIED)
    _, sent = _guarded(world, guard)
    back = next(iter(sent.content.array_records.values()))
    assert all(np.array_equal(back[k].numpy(), v.numpy()) for k, v in world["global"].items())
    metrics = _metrics(sent)
    assert metrics["leak-guard-refused"] == 1 and metrics["leak-guard-certified"] == 1
    assert 0 < metrics["num-examples"] < 1e-6  # FedAvg's average ignores it


@pytest.mark.parametrize(("finding", "on_unknown", "withheld"), [
    (PROTECTED, "send", False), (PROTECTED, "refuse", False),
    (TIMEOUT, "send", False), (TIMEOUT, "refuse", True),
    (GuardFinding("not-certified", sparsity_match=0.97), "refuse", False),
    (GuardFinding("partial", readable_samples=3), "send", True),  # 3 verified one by one
])
def test_refuse_acts_on_proof_and_on_the_unknown_policy_only(
        world: dict, monkeypatch: pytest.MonkeyPatch, finding: GuardFinding, on_unknown: str,
        withheld: bool) -> None:
    guard = _with_finding(monkeypatch, LeakGuard("refuse", on_unknown=on_unknown), finding)
    unguarded, sent = _guarded(world, guard)
    same = arrays_equal(next(iter(sent.content.array_records.values())),
                        next(iter(unguarded.content.array_records.values())))
    assert same is not withheld
    assert _metrics(sent)["leak-guard-refused"] == int(withheld)


def test_every_guarded_reply_carries_the_same_keys_so_fedavg_aggregates(
        world: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """A refused and a passed reply (and a failed check) aggregate together; a round in which
    every client refuses aggregates to the global model."""
    findings = {11: CERTIFIED, 12: PROTECTED, 13: GuardFinding("attack-error", reason="boom")}
    sent = []
    for node, finding in findings.items():
        guard = _with_finding(monkeypatch, LeakGuard("refuse"), finding)
        sent.append(_guarded(world, guard, node)[1])
    assert len({frozenset(_metrics(m)) for m in sent}) == 1
    arrays, metrics = fedavg().aggregate_train(1, sent)
    assert arrays is not None and metrics is not None and "leak-guard-refused" in metrics
    everyone = [_guarded(world, _with_finding(monkeypatch, LeakGuard("refuse"), CERTIFIED),
                         node)[1] for node in (11, 12)]
    arrays, _ = fedavg().aggregate_train(1, everyone)
    assert all(np.allclose(arrays[k].numpy(), v.numpy()) for k, v in world["global"].items())


def test_named_train_actions_are_checked_too(world: dict,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """``@app.train("action")`` handlers get ``train.action`` messages: the guard checks them."""
    guard = _with_finding(monkeypatch, LeakGuard("refuse"), CERTIFIED)
    state, _ = world["updates"][11]
    sent = guard(instruction(11, world["global"], "train.action"),
                 Context(1, 11, {}, RecordDict(), {}), lambda _m, _c: reply(11, content(state, 0)))
    assert _metrics(sent)["leak-guard-refused"] == 1


def test_the_check_shares_one_budget_among_its_readings() -> None:
    assert LeakGuard(max_seconds=30.0).settings.max_seconds == 15.0  # gradient, then fedavg
    assert LeakGuard(max_seconds=30.0, update="gradient").settings.max_seconds == 30.0


def test_evaluate_messages_pass_through(world: dict) -> None:
    made = Message(content=RecordDict({}), reply_to=instruction(11, world["global"], "evaluate"))
    guard = LeakGuard("refuse")
    out = guard(instruction(11, world["global"], "evaluate"),
                Context(1, 11, {}, RecordDict(), {}), lambda _m, _c: made)
    assert out is made and not out.content.metric_records


def test_the_check_is_the_servers_attack_and_never_raises(world: dict) -> None:
    """On a real FedSGD update the guard's finding agrees with what its outcome says; on a
    reply that cannot be an update of the sent model it reports a failed check."""
    guard = LeakGuard("report", max_seconds=60.0)
    state, _ = world["updates"][11]
    sent = {k: v.numpy() for k, v in world["global"].items()}
    finding = guard.check(sent, reply(11, content(state, 0)))
    assert finding.status in GUARD_CODES.values() and finding.seconds > 0
    assert finding.certified == (finding.readable_samples == 8)
    if finding.sparsity_match is not None:
        assert 0.0 <= finding.sparsity_match <= 1.0
    broken = {k: v[..., :1] for k, v in state.items()}
    bad = guard.check(sent, reply(11, content(broken, 0)))
    assert bad.status == verdicts.ATTACK_ERROR and bad.reason


def test_a_protected_update_is_sent_unchanged_under_refuse(world: dict) -> None:
    """B = 96 samples over 6 FedAvg steps through a layer of 50 units: the update has full
    rank, so no exact attack can read it (protected, by construction); the guard sends it."""
    from fl_attack.testbed.data import load_images, normalize
    from fl_attack.testbed.models import relu_mlp
    from fl_attack.testbed.simulate import local_update

    images, labels = load_images("mnist", 96, seed=1)
    model = relu_mlp(784, 50, 2, 10, seed=1)
    res = local_update(model, normalize(images, "mnist"), labels, protocol="fedavg", lr=0.01,
                       epochs=2, batch_size=32)
    world2 = {"global": model.state_dict(), "updates": {11: (res.state_dict, None)}}
    unguarded, sent = _guarded(world2, LeakGuard("refuse", max_seconds=30.0), num=96)
    assert GUARD_CODES[int(_metrics(sent)["leak-guard-status"])] == "protected"
    assert arrays_equal(next(iter(sent.content.array_records.values())),
                        next(iter(unguarded.content.array_records.values())))


@pytest.mark.usefixtures("task_identity")
def test_the_server_records_the_guard_and_never_reads_a_refused_update(
        world: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    strategy = AuditingStrategy(fedavg(), attack=AttackSettings(executor="inline",
                                                                max_seconds=60.0))
    configure(strategy, world, [11, 12])
    replies = [_guarded(world, _with_finding(monkeypatch, LeakGuard("refuse"), f), node)[1]
               for node, f in ((11, CERTIFIED), (12, PROTECTED))]
    strategy.aggregate_train(1, replies)
    by_node = {r.node_id: r for r in strategy.records}
    assert by_node[11].status == verdicts.REFUSED and by_node[11].inputs is None
    assert by_node[11].guard["refused"] and by_node[11].guard["status"] == "certified"
    assert by_node[12].status != verdicts.REFUSED and not by_node[12].guard["refused"]


def _simulate(tmp_path: Path, name: str, **config: object) -> tuple[dict, list[dict]]:
    cfg = {"num-server-rounds": 1, "num-clients": 2, "dataset": "mnist", "dataset-size": 200,
           "batch-size": 8, "width": 100, "audit": True, "fraction-evaluate": 0.0,
           "max-seconds": 60.0, "audit-executor": "inline", **config}
    summary, lines, _, _ = run_demo(tmp_path, name, cfg)
    return summary, lines


def test_report_with_a_guard_that_runs_out_of_time(tmp_path: Path) -> None:
    """A budget far too small for the guard's check: whatever it found, ``report`` sends the
    updates unchanged, and the server attacks them as it would without the guard."""
    summary, lines = _simulate(tmp_path, "report", **{"leak-guard": "report",
                                                     "leak-guard-seconds": 1e-3})
    assert summary["status"] == "completed" and summary["refused"] == 0
    for ln in lines:
        assert ln["guard"] is not None and not ln["guard"]["refused"]
        assert ln["status"] in verdicts.RECONSTRUCTED  # the server still attacked the update


def test_a_partial_finding_counts_only_the_samples_verified_one_by_one() -> None:
    """Samples peeled off but only read (``peel.READ_RTOL``) are not proven readable: the
    finding counts the verified rows, B only when certified."""
    from fl_attack_flwr.clients.leak_guard import _finding
    from fl_attack_flwr.jobs.outcome import AttackOutcome

    rec = {"batch_size": 8, "peeled": 5, "verified": [0, 2], "sparsity_match": 0.9}
    partial = _finding(AttackOutcome(verdicts.PARTIAL, reconstruction=rec), 1.0)
    assert partial.readable_samples == 2 and not partial.certified
    whole = _finding(AttackOutcome(verdicts.CERTIFIED, reconstruction=dict(rec, verified=[])),
                     1.0)
    assert whole.readable_samples == 8
