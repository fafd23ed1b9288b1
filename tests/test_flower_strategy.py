"""AuditingStrategy on hand-made Flower Messages, with the real attack and real local training.

Covers: the wrapped strategy's aggregate is unchanged by the audit; corrupt replies (NaN, wrong
shape, missing arrays, no num-examples) are recorded and withheld, error replies are recorded and
the round goes on; attack exceptions are recorded; statuses that are verdicts (certified,
protected, no-update); audit-mode scoring; the ground truth never reaches the wrapped strategy;
background mode and reply sampling.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Error,
    Message,
)
from flwr.serverapp.strategy import FedAvg

from fl_attack.testbed.data import load_images, normalize
from fl_attack.testbed.models import relu_mlp
from fl_attack.testbed.simulate import local_update
from fl_attack_flwr import AttackSettings, AuditingStrategy, AuditStore, GroundTruth, verdicts
from tests.flower_fakes import (
    DATASET,
    SIZE,
    WIDTH,
    B,
    FakeGrid,
    arrays_equal,
    configure,
    content,
    fedavg,
    good_replies,
    reply,
)

INLINE = {"executor": "inline", "max_seconds": 60.0}


def test_audited_aggregate_equals_plain_fedavg(world: dict, task_identity: None,
                                               tmp_path) -> None:
    plain = FedAvg()
    audited = AuditingStrategy(fedavg(), store=AuditStore(tmp_path, "eq"),
                               attack=AttackSettings(**INLINE), dataset=DATASET,
                               protocol="fedsgd")
    configure(audited, world, [11, 12])
    ref_arrays, ref_metrics = plain.aggregate_train(1, good_replies(world, (11, 12)))
    arrays, metrics = audited.aggregate_train(1, good_replies(world, (11, 12)))
    audited.close()
    assert arrays_equal(arrays, ref_arrays)
    for key, value in ref_metrics.items():
        assert metrics[key] == pytest.approx(value)
    assert metrics["audit-replies"] == 2 and metrics["audit-attack-seconds"] > 0
    assert "audit-psnr-mean" not in metrics  # no ground truth given
    statuses = [r.status for r in audited.records]
    assert metrics["audit-certified"] == statuses.count("certified")
    assert metrics["audit-reconstructions"] == 2  # a clean gradient is always reconstructed
    assert {r.partition_id for r in audited.records} == {0, 1}
    assert {r.layer for r in audited.records} == {"1.weight"}
    assert all(r.reading == "gradient" for r in audited.records)  # FedSGD: read as a gradient


def test_corrupt_and_failed_replies_do_not_stop_the_round(world: dict, task_identity: None,
                                                          tmp_path) -> None:
    nodes = [11, 21, 22, 23, 24, 25, 26]
    audited = AuditingStrategy(fedavg(), store=AuditStore(tmp_path, "faults"),
                               attack=AttackSettings(**INLINE), dataset=DATASET)
    global_arrays = configure(audited, world, nodes)
    good_state, _ = world["updates"][11]
    nan_state = {k: v.clone() for k, v in good_state.items()}
    nan_state["1.weight"][0, 0] = float("nan")
    shape_state = dict(good_state)
    shape_state["1.weight"] = torch.zeros(3, 3)
    missing_state = {k: v for k, v in good_state.items() if k != "3.bias"}
    two_arrays = content(good_state, 6)
    two_arrays["more-arrays"] = ArrayRecord(good_state)
    replies = [
        *good_replies(world, (11,)),
        reply(21, content(nan_state, 1)),
        reply(22, content(shape_state, 2)),
        reply(23, content(missing_state, 3)),
        reply(24, content(good_state, 4, num=None)),  # no num-examples
        reply(25, error=Error(code=0, reason="client crashed: injected")),
        reply(26, two_arrays),
    ]
    arrays, metrics = audited.aggregate_train(1, replies)
    audited.close()
    by_node = {r.node_id: r for r in audited.records}
    assert by_node[11].reconstructed
    assert by_node[21].status == "corrupt" and "NaN" in by_node[21].error
    assert by_node[22].status == "corrupt" and "shape" in by_node[22].error
    assert by_node[23].status == "corrupt" and "missing" in by_node[23].error
    assert by_node[24].status == "corrupt" and "num-examples" in by_node[24].error
    assert by_node[25].status == "client-error" and "injected" in by_node[25].error
    assert by_node[26].status == "corrupt" and "ArrayRecord" in by_node[26].error
    # only the good reply was aggregated: the new global model is exactly that client's
    ref, _ = FedAvg().aggregate_train(1, good_replies(world, (11,)))
    assert arrays_equal(arrays, ref)
    assert not arrays_equal(arrays, global_arrays)
    assert metrics["audit-corrupt"] == 5 and metrics["audit-client-errors"] == 1
    assert metrics["audit-reconstructions"] == 1
    lines = (audited.store.run_dir / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 7


def test_attack_exception_is_recorded_and_aggregation_goes_on(
        world: dict, task_identity: None, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    import fl_attack

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("boom in the attack")

    monkeypatch.setattr(fl_attack, "invert", broken)
    audited = AuditingStrategy(fedavg(), store=AuditStore(tmp_path, "fail"),
                               attack=AttackSettings(**INLINE))
    configure(audited, world, [11, 12])
    zero = reply(12, content(world["global"], 1))  # the global model sent back unchanged
    arrays, metrics = audited.aggregate_train(1, [*good_replies(world, (11,)), zero])
    audited.close()
    rec11, rec12 = sorted(audited.records, key=lambda r: r.node_id)
    assert rec11.status == "attack-error" and "boom in the attack" in rec11.error
    assert rec12.status == "no-update" and "identically zero" in rec12.reason
    ref, _ = FedAvg().aggregate_train(1, [*good_replies(world, (11,)),
                                          reply(12, content(world["global"], 1))])
    assert arrays_equal(arrays, ref)  # both were still aggregated
    assert metrics["audit-failures"] == 1 and metrics["audit-reconstructions"] == 0
    line = (audited.store.run_dir / "round-1/client-0/metrics.json").read_text()
    assert "boom in the attack" in line


def test_bad_attack_settings_fail_when_built_naming_the_setting() -> None:
    with pytest.raises(ValueError, match="no_such_option"):
        AttackSettings(options={"no_such_option": 1})
    for bad, name in (({"executor": "gpu"}, "executor"), ({"fraction": 0.0}, "fraction"),
                      ({"rounds": "1,x"}, "rounds"), ({"timeout": -1.0}, "timeout"),
                      ({"update": "sum"}, "update"), ({"workers": 0}, "workers"),
                      ({"niceness": 20}, "niceness"), ({"niceness": 1.5}, "niceness")):
        with pytest.raises(ValueError, match=name):
            AttackSettings(**bad)


def test_a_batch_larger_than_the_layer_is_reported_protected(task_identity: None) -> None:
    """B >= min(m, n): no attack can read the batch off the layer; the verdict says so."""
    images, labels = load_images(DATASET, SIZE, seed=0)
    model = relu_mlp(784, 24, 2, 10, seed=0)  # m = 24 units < B = 40 samples
    g_state = {k: v.clone() for k, v in model.state_dict().items()}
    res = local_update(model, normalize(images[:40], DATASET), labels[:40], protocol="fedsgd",
                       lr=0.01)
    audited = AuditingStrategy(fedavg(), attack=AttackSettings(**INLINE), dataset=DATASET)
    list(audited.configure_train(1, ArrayRecord(g_state), ConfigRecord(), FakeGrid([11])))
    _, metrics = audited.aggregate_train(1, [reply(11, content(res.state_dict, 0, num=40))])
    audited.close()
    (rec,) = audited.records
    assert rec.status == "protected" and rec.error is None and rec.protected_by == "full-rank"
    assert "mixes at least min(m, n) = 24 samples" in rec.reason
    assert metrics["audit-protected"] == 1 and metrics["audit-failures"] == 0


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
                               attack=AttackSettings(**INLINE), protocol="fedsgd")
    configure(audited, world, [13])
    _, metrics = audited.aggregate_train(1, good_replies(world, (13,), gt=True))
    audited.close()
    (rec,) = audited.records
    assert rec.reconstructed and rec.psnr_mean is not None
    assert (rec.status == "certified") == bool(rec.exact)  # the verdict is the library's flag
    assert metrics["audit-psnr-mean"] == pytest.approx(rec.psnr_mean)
    assert rec.original_images.shape == (B, 1, 28, 28)
    _, idx = world["updates"][13]
    assert np.allclose(rec.original_images, world["images"][idx].double().numpy())
    assert "sample-indices" not in seen[0].content["client-info"]  # stripped
    assert seen[0].content["client-info"]["partition-id"] == 2
    assert (audited.store.run_dir / "round-1/client-2/original.png").is_file()


def test_disabled_audit_is_a_pure_pass_through(world: dict, task_identity: None) -> None:
    audited = AuditingStrategy(fedavg(), enabled=False)
    configure(audited, world, [11, 12])
    arrays, metrics = audited.aggregate_train(1, good_replies(world, (11, 12)))
    ref_arrays, ref_metrics = FedAvg().aggregate_train(1, good_replies(world, (11, 12)))
    assert arrays_equal(arrays, ref_arrays) and dict(metrics) == dict(ref_metrics)
    assert audited.records == []


def test_background_mode_returns_the_aggregate_and_stores_every_result(
        world: dict, task_identity: None, tmp_path) -> None:
    audited = AuditingStrategy(fedavg(), store=AuditStore(tmp_path, "bg"), dataset=DATASET,
                               attack=AttackSettings(**INLINE, mode="background"))
    configure(audited, world, [11, 12, 13])
    arrays, metrics = audited.aggregate_train(1, good_replies(world, (11, 12, 13)))
    ref, _ = FedAvg().aggregate_train(1, good_replies(world, (11, 12, 13)))
    assert arrays_equal(arrays, ref)  # the aggregate never depends on the audit
    assert metrics["audit-submitted"] == 3 and "audit-certified" not in metrics
    audited.close()  # drains
    assert len(audited.records) == 3 and all(r.reconstructed for r in audited.records)
    assert 1 in audited.round_stats and audited.round_stats[1]["audit-replies"] == 3
    assert len((audited.store.run_dir / "metrics.jsonl").read_text().splitlines()) == 3
    rounds = (audited.store.run_dir / "rounds.jsonl").read_text().splitlines()
    assert len(rounds) == 1


def test_drain_timeout_marks_unfinished_attacks(world: dict, task_identity: None) -> None:
    settings = AttackSettings(executor="process", mode="background", drain_timeout=0.0,
                              max_seconds=60.0)
    audited = AuditingStrategy(fedavg(), attack=settings, dataset=DATASET)
    configure(audited, world, [11])
    audited.aggregate_train(1, good_replies(world, (11,)))
    audited.close()  # no time to drain: the worker is still importing torch
    (rec,) = audited.records
    assert rec.status == "unfinished" and "drain timeout" in rec.error


def test_sampling_is_seeded_and_skipped_replies_say_why(world: dict, task_identity: None) -> None:
    from fl_attack_flwr.intake.reply import sample_replies

    def picked(seed: int) -> list[int]:
        settings = AttackSettings(**INLINE, fraction=0.5, sample_seed=seed, rounds="1,3")
        rng = random.Random(seed)
        chosen = sample_replies(settings, rng, 1, good_replies(world, (11, 12, 13)))
        assert sample_replies(settings, rng, 2, good_replies(world, (11,))) == {
            0: "round 2 is not audited (rounds = '1,3')"}
        return [i for i, why in chosen.items() if why is None]

    assert len(picked(0)) == 2  # ceil(0.5 * 3)
    assert picked(0) == picked(0)  # reproducible with a seed
    assert {tuple(picked(s)) for s in range(8)} != {tuple(picked(0))}  # the seed matters


def test_the_protocol_fixes_the_reading_and_auto_tries_both() -> None:
    assert AuditingStrategy(protocol="fedavg").attack.readings() == ("fedavg",)
    assert AuditingStrategy(protocol="dpsgd").attack.readings() == ("gradient",)
    assert AuditingStrategy().attack.readings() == ("gradient", "fedavg")
    forced = AttackSettings(options={"update": "gradient"})
    assert AuditingStrategy(attack=forced, protocol="fedavg").attack.readings() == ("gradient",)
    with pytest.raises(ValueError, match="protocol"):
        AuditingStrategy(protocol="fedprox")


def test_the_layer_is_chosen_by_name_or_first_linear_with_a_bias() -> None:
    from fl_attack_flwr.jobs.layers import choose_layer

    model = relu_mlp(784, WIDTH, 3, seed=0)
    state = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    first = choose_layer(state)
    assert (first.weight_key, first.shape, first.next_weight_key) == ("1.weight", (WIDTH, 784),
                                                                      "3.weight")
    assert first.first_is_linear
    assert choose_layer(state, "5.weight").next_weight_key == "7.weight"
    assert choose_layer(state, "7.weight").next_weight_key is None  # the output layer
    with pytest.raises(ValueError, match="fc9.weight"):
        choose_layer(state, "fc9.weight")
    cnn = {"conv.weight": np.zeros((4, 3, 3, 3)), "conv.bias": np.zeros(4),
           "head.weight": np.zeros((10, 64)), "head.bias": np.zeros(10)}
    head = choose_layer(cnn)
    assert head.weight_key == "head.weight" and not head.first_is_linear


def test_next_layer_update_goes_with_gradient_readings_only() -> None:
    from fl_attack_flwr.jobs.build import build_job
    from fl_attack_flwr.jobs.layers import choose_layer

    model = relu_mlp(784, WIDTH, 3, seed=0)
    g_state = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    n_state = {k: v + 0.5 for k, v in g_state.items()}
    layer = choose_layer(g_state)
    job = build_job(1, 11, "client-0", g_state, n_state, layer, AttackSettings())
    assert job.next_weight_grad is not None and job.next_weight_grad.shape == (WIDTH, WIDTH)
    assert np.allclose(job.next_weight_grad, -0.5)
    fedavg = build_job(1, 11, "c", g_state, n_state, layer, AttackSettings(update="fedavg"))
    assert fedavg.next_weight_grad is None and fedavg.readings == ("fedavg",)
    off = build_job(1, 11, "c", g_state, n_state, layer, AttackSettings(next_layer=False))
    assert off.next_weight_grad is None


def test_secure_aggregation_target_attacks_the_rounds_aggregate(world: dict, task_identity: None,
                                                                tmp_path) -> None:
    """What a SecAgg server sees, the aggregate of 3 clients' updates, is a batch of their 24
    samples; the ground truth is the union of the clients' samples."""
    audited = AuditingStrategy(fedavg(), store=AuditStore(tmp_path, "secagg"),
                               ground_truth=GroundTruth(DATASET, SIZE, seed=0), dataset=DATASET,
                               attack=AttackSettings(**INLINE, target="aggregate"),
                               protocol="fedsgd")
    configure(audited, world, [11, 12, 13])
    arrays, metrics = audited.aggregate_train(1, good_replies(world, (11, 12, 13), gt=True))
    audited.close()
    ref, _ = FedAvg().aggregate_train(1, good_replies(world, (11, 12, 13)))
    assert arrays_equal(arrays, ref)
    clients = [r for r in audited.records if r.node_id != 0]
    assert [r.status for r in clients] == ["skipped"] * 3
    assert all("secure aggregation" in r.reason for r in clients)
    (agg,) = [r for r in audited.records if r.node_id == 0]
    assert agg.client_label == "aggregate-of-3" and len(agg.sample_indices) == 3 * B
    assert agg.reconstructed and agg.batch_size == 3 * B  # one batch of all their samples
    assert agg.true_batch_size == 3 * B and agg.psnr_mean is not None
    assert (agg.status == "certified") == bool(agg.exact)
    assert metrics["audit-reconstructions"] == 1 and metrics["audit-skipped"] == 3


def test_a_full_background_queue_skips_replies_and_says_why(world: dict,
                                                           task_identity: None) -> None:
    settings = AttackSettings(**INLINE, mode="background", max_queue=1)
    audited = AuditingStrategy(fedavg(), attack=settings, dataset=DATASET)
    configure(audited, world, [11, 12, 13])
    _, metrics = audited.aggregate_train(1, good_replies(world, (11, 12, 13)))
    audited.close()
    statuses = sorted(r.status for r in audited.records)
    assert metrics["audit-submitted"] == 1 and statuses.count("skipped") == 2
    assert all("queue is full" in r.reason for r in audited.records if r.status == "skipped")


def test_a_noisy_verdict_names_the_batch_size_readings() -> None:
    """Under noise the attack may try two batch sizes (``fl_attack.steps.batch_size``): the recorded
    reason says which ones and which was kept, so an auditor can tell why B differs from the
    client's batch; with one reading the reason is unchanged."""
    summary = {"batch_size": 20, "n_directions": 20, "exact": False,
               "sparsity_match": 0.9731, "batch_size_readings": [17, 20]}
    status, reason = verdicts.reconstruction_verdict(summary)
    assert status == verdicts.NOT_CERTIFIED
    assert reason is not None and "B = 17 or 20" in reason and "B = 20 explained" in reason
    _, plain = verdicts.reconstruction_verdict({**summary, "batch_size_readings": []})
    assert plain is not None and "readings" not in plain and "17" not in plain


def test_a_noisy_verdict_says_why_the_search_ended() -> None:
    """The reason names what ended a search that did not certify: the budget, or the search
    itself when more rounds stopped improving it (``Reconstruction.stopped``)."""
    summary = {"batch_size": 20, "n_directions": 20, "exact": False,
               "sparsity_match": 0.9731, "stopped": "converged", "budget_exhausted": False}
    _, reason = verdicts.reconstruction_verdict(summary)
    assert reason is not None and "stopped improving" in reason and "budget" not in reason
    _, timed = verdicts.reconstruction_verdict({**summary, "stopped": "budget",
                                                "budget_exhausted": True})
    assert timed is not None and "time budget ended" in timed and "improving" not in timed


def test_a_verdict_counts_the_samples_verified_one_by_one() -> None:
    """Samples verified on their own through the next layer (``Reconstruction.verified``) are
    read exactly even when the batch is partial or not certified: the reason says how many,
    and never that no sample is guaranteed."""
    partial = {"batch_size": 100, "n_directions": 80, "exact": False, "verified": [3, 7, 9]}
    status, reason = verdicts.reconstruction_verdict(partial)
    assert status == verdicts.PARTIAL and reason is not None
    assert "3 sample(s) verified" in reason and "no sample is guaranteed" not in reason
    _, plain = verdicts.reconstruction_verdict({**partial, "verified": []})
    assert plain is not None and "no sample is guaranteed" in plain
    full = {"batch_size": 100, "n_directions": 100, "exact": False, "sparsity_match": 0.9,
            "verified": [1, 2]}
    status, reason = verdicts.reconstruction_verdict(full)
    assert status == verdicts.NOT_CERTIFIED and reason is not None
    assert "λ = 0.9000" in reason and "2 sample(s) verified" in reason


def test_central_dp_epsilon_is_taken_from_flowers_own_accountant(tmp_path) -> None:
    """A wrapped central-DP strategy with ``accountant=``: the report states its ε, naming the
    accountant, beside the warning that central DP does not protect the updates read."""
    from flwr.serverapp import GaussianPrivacyEvent, PrivacyConfig, RdpAccountant
    from flwr.serverapp.strategy import DifferentialPrivacyServerSideFixedClipping
    from flwr.supercore.privacy_accounting import NeighboringRelation, SamplingMethod

    accountant = RdpAccountant(PrivacyConfig(
        target_delta=1e-5, population_size=3,
        neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE,
        sampling_method=SamplingMethod.NO_AMPLIFICATION))
    central = DifferentialPrivacyServerSideFixedClipping(
        fedavg(), noise_multiplier=1.0, clipping_norm=1.0, num_sampled_clients=3,
        accountant=accountant)
    accountant.compose(GaussianPrivacyEvent(noise_multiplier=1.0, sample_size=3,
                                            population_size=3), count=20)
    store = AuditStore(tmp_path, "central")
    AuditingStrategy(central, store=store, attack=AttackSettings(**INLINE)).close()
    summary = store.finalize()
    eps = accountant.get_privacy_spent().epsilon
    note = next(n for n in summary["notes"] if "Flower's accountant, RDP" in n)
    assert f"ε = {eps:.3g} at δ = 1e-05 after 20 release(s)" in note
    assert any("clips and noises the aggregate only" in n for n in summary["notes"])
