"""Where attacks run: the same job gives the same reconstruction inline, on a process pool and on
Ray; a killed worker, a hard timeout and a memory cap are outcomes, not crashes; the readings of
an update of unknown kind are tried in order and the best-certified one is kept."""

from __future__ import annotations

import dataclasses
import os
import signal
import time

import numpy as np
import pytest

from fl_attack.testbed.data import load_images, normalize
from fl_attack.testbed.models import relu_mlp
from fl_attack.testbed.simulate import local_update
from fl_attack_flwr import AttackSettings, verdicts
from fl_attack_flwr.executors.processes import InlineExecutor, PoolExecutor
from fl_attack_flwr.executors.ray_actors import RayExecutor
from fl_attack_flwr.jobs.build import AttackJob, build_job
from fl_attack_flwr.jobs.layers import choose_layer
from fl_attack_flwr.jobs.outcome import AttackOutcome
from fl_attack_flwr.jobs.run import run_job

DATASET, B, WIDTH = "mnist", 8, 100


@pytest.fixture(scope="module")
def job() -> AttackJob:
    """A real FedSGD update of 8 MNIST digits through a ReLU MLP of width 100."""
    images, labels = load_images(DATASET, 64, seed=3)
    model = relu_mlp(784, WIDTH, 2, 10, seed=3)
    sent = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    res = local_update(model, normalize(images[:B], DATASET), labels[:B], protocol="fedsgd",
                       lr=0.01)
    back = {k: v.detach().numpy().copy() for k, v in res.state_dict.items()}
    settings = AttackSettings(update="gradient", max_seconds=60.0, next_layer=False)
    return build_job(1, 11, "client-0", sent, back, choose_layer(sent), settings)


@pytest.fixture(scope="module")
def easy_job() -> AttackJob:
    """A FedSGD update of 4 MNIST digits through 100 units: a batch this small is read and
    certified by the attack (the situation the determinism test needs)."""
    images, labels = load_images(DATASET, 64, seed=3)
    model = relu_mlp(784, WIDTH, 2, 10, seed=3)
    sent = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    res = local_update(model, normalize(images[:4], DATASET), labels[:4], protocol="fedsgd",
                       lr=0.01)
    back = {k: v.detach().numpy().copy() for k, v in res.state_dict.items()}
    settings = AttackSettings(update="gradient", max_seconds=60.0, next_layer=False)
    return build_job(1, 11, "client-0", sent, back, choose_layer(sent), settings)


def _same_rows(a: np.ndarray, b: np.ndarray, tol: float = 1e-6) -> bool:
    """Whether two reconstructions hold the same rows (the order of rows is arbitrary)."""
    if a.shape != b.shape:
        return False
    d = np.abs(a[:, None, :] - b[None, :, :]).max(axis=2)
    return bool((d.min(axis=1) < tol).all() and (d.min(axis=0) < tol).all())


def test_inline_pool_and_ray_give_the_same_reconstruction(easy_job: AttackJob) -> None:
    job = easy_job
    inline = InlineExecutor()
    pool = PoolExecutor(2, timeout=300)
    ray_ex = RayExecutor()
    try:
        ref = inline.submit(job).result()
        outs = [f.result(timeout=600) for f in (pool.submit(job), pool.submit(job),
                                                ray_ex.submit(job))]
    finally:
        inline.close()
        pool.close()
        ray_ex.close()
    # a certified reconstruction is exact, so it is the same on every executor whatever the
    # float path of its threads
    assert ref.status == verdicts.CERTIFIED, f"setup: the job must be certified ({ref.reason})"
    for out in outs:
        assert out.status == verdicts.CERTIFIED
        assert out.reconstruction["batch_size"] == ref.reconstruction["batch_size"]
        assert _same_rows(out.inputs, ref.inputs)


def test_ray_runs_at_most_max_inflight_attacks_and_replaces_a_timed_out_actor(
        job: AttackJob) -> None:
    """Actors that reserve no CPU (a simulation's Ray holds them all) take one attack each;
    the rest wait. An attack past the hard timeout loses its actor, the next one runs."""
    ray_ex = RayExecutor(num_cpus=0.0, max_inflight=1, timeout=300.0)
    try:
        futures = [ray_ex.submit(job) for _ in range(3)]
        peak = 0
        while not all(f.done() for f in futures):
            peak = max(peak, ray_ex.running())
            time.sleep(0.01)
        outs = [f.result() for f in futures]
        assert peak == 1
        assert {o.status for o in outs} == {outs[0].status}
        assert outs[0].status in verdicts.RECONSTRUCTED
        ray_ex.timeout = 0.05  # the actor is warm: only the attack runs into it
        timed_out = ray_ex.submit(job).result(timeout=120)
        ray_ex.timeout = 300.0
        again = ray_ex.submit(job).result(timeout=300)
        queued = [ray_ex.submit(job) for _ in range(2)]
    finally:
        ray_ex.close()
    assert timed_out.status == verdicts.TIMEOUT and "hard timeout" in timed_out.error
    assert again.status == outs[0].status
    assert queued[-1].result(timeout=60).status in (verdicts.UNFINISHED, *verdicts.RECONSTRUCTED)


def test_pool_workers_run_at_the_niceness_asked_for() -> None:
    """Attack workers yield the shared cores to the federation (Unix niceness)."""
    pool = PoolExecutor(1, timeout=60, niceness=7)
    try:
        pool.start()
        deadline = time.monotonic() + 120
        while not pool.worker_pids() and time.monotonic() < deadline:
            time.sleep(0.05)
        (pid,) = pool.worker_pids()
        while os.getpriority(os.PRIO_PROCESS, pid) < 7 and time.monotonic() < deadline:
            time.sleep(0.05)  # the worker lowers its priority first thing after the spawn
        assert os.getpriority(os.PRIO_PROCESS, pid) == max(7, os.getpriority(os.PRIO_PROCESS, 0))
    finally:
        pool.close()


def test_a_killed_worker_is_recorded_and_replaced(job: AttackJob) -> None:
    slow = AttackJob(**{**job.__dict__, "invert_kwargs": {**job.invert_kwargs,
                                                          "method": "spear", "max_seconds": 60}})
    pool = PoolExecutor(1, timeout=300)
    try:
        pool.start()
        future = pool.submit(slow)
        deadline = time.monotonic() + 120
        while not pool.busy_pids() and time.monotonic() < deadline:
            time.sleep(0.05)
        (pid,) = pool.busy_pids()
        os.kill(pid, signal.SIGKILL)
        out = future.result(timeout=60)
        assert out.status == verdicts.WORKER_DIED and "died" in out.error
        again = pool.submit(job).result(timeout=300)  # a fresh worker took its place
        assert again.status in verdicts.RECONSTRUCTED
        assert pid not in pool.worker_pids()
    finally:
        pool.close()


def test_a_hard_timeout_kills_the_attack_and_the_pool_goes_on(job: AttackJob) -> None:
    pool = PoolExecutor(1, timeout=0.05)
    try:
        pool.start()
        deadline = time.monotonic() + 120
        while not all(w.ready for w in pool._workers) and time.monotonic() < deadline:
            time.sleep(0.05)  # startup (importing torch) is not attack time
        out = pool.submit(job).result(timeout=120)
        assert out.status == verdicts.TIMEOUT and "hard timeout" in out.error
        pool.timeout = 300.0
        assert pool.submit(job).result(timeout=300).status in verdicts.RECONSTRUCTED
    finally:
        pool.close()


def test_a_memory_cap_gives_out_of_memory_and_the_pool_goes_on(job: AttackJob) -> None:
    # 3 million starts: the B x K search matrices need ~1.2 GB, far over a 0.5 GB cap
    greedy = {**job.invert_kwargs, "n_init": 3_000_000, "steps": 2}
    capped = AttackJob(**{**job.__dict__, "memory_limit_gb": 0.5, "invert_kwargs": greedy})
    pool = PoolExecutor(1, timeout=300)
    try:
        out = pool.submit(capped).result(timeout=300)
        assert out.status == verdicts.OUT_OF_MEMORY, out.error
        # the worker reported it and was replaced by a fresh one, which runs the next attack
        assert pool.submit(job).result(timeout=300).status in verdicts.RECONSTRUCTED
    finally:
        pool.close()


def test_an_allocation_a_c_extension_fails_silently_under_the_cap_is_out_of_memory(
        job: AttackJob, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under the memory cap a refused allocation can surface as CPython's "SystemError: error
    return without exception set" (numpy or torch failing without raising MemoryError): the
    outcome is out-of-memory and says why; without a cap the same error stays an attack error."""
    import fl_attack_flwr.jobs.run as running

    def lost(_job: AttackJob, _reading: str) -> None:
        raise SystemError("error return without exception set")

    monkeypatch.setattr(running, "_invert_reading", lost)
    capped = AttackJob(**{**job.__dict__, "memory_limit_gb": 0.5})
    out = run_job(capped, in_worker=True)
    assert out.status == verdicts.OUT_OF_MEMORY and "memory cap of 0.5 GB" in out.error
    assert run_job(job, in_worker=True).status == verdicts.ATTACK_ERROR


def test_closing_a_pool_marks_queued_jobs_unfinished(job: AttackJob) -> None:
    pool = PoolExecutor(1, timeout=300)
    futures = [pool.submit(job) for _ in range(3)]
    pool.close()
    assert all(f.done() for f in futures)
    assert {f.result().status for f in futures} <= {verdicts.UNFINISHED,
                                                        *verdicts.RECONSTRUCTED}
    assert futures[-1].result().status == verdicts.UNFINISHED


def _fake(outcomes: dict[str, dict]):
    calls: list[str] = []

    def attack_once(job: AttackJob, reading: str, cap: float | None = None) -> AttackOutcome:
        calls.append(reading)
        return dataclasses.replace(outcomes[reading], reading=reading, seconds=0.0)

    return attack_once, calls


def _res(status: str, lam: float | None = None, found: int | None = None) -> AttackOutcome:
    facts = None if lam is None else {"sparsity_match": lam}
    if facts is not None and found is not None:
        facts["n_directions"] = found
    return AttackOutcome(status, reconstruction=facts)


@pytest.mark.parametrize(("outcomes", "want", "tried"), [
    ({"gradient": _res("certified", 1.0), "fedavg": _res("certified", 1.0)}, "gradient",
     ["gradient"]),
    ({"gradient": _res("not-certified", 0.95), "fedavg": _res("certified", 1.0)}, "fedavg",
     ["gradient", "fedavg"]),
    ({"gradient": _res("not-certified", 0.97), "fedavg": _res("not-certified", 0.93)},
     "gradient", ["gradient", "fedavg"]),
    ({"gradient": _res("partial", 0.99), "fedavg": _res("not-certified", 0.5)}, "fedavg",
     ["gradient", "fedavg"]),
    # two partial bases: the directions found decide, not the FedAvg λ of a completed basis
    ({"gradient": _res("partial", 0.6, found=40), "fedavg": _res("partial", 1.0, found=0)},
     "gradient", ["gradient", "fedavg"]),
    ({"gradient": _res("protected"), "fedavg": _res("certified", 1.0)}, "gradient",
     ["gradient"]),
    ({"gradient": _res("attack-error"), "fedavg": _res("not-certified", 0.9)}, "fedavg",
     ["gradient", "fedavg"]),
])
def test_readings_are_tried_until_one_is_certified_and_the_best_is_kept(
        job: AttackJob, monkeypatch: pytest.MonkeyPatch, outcomes: dict, want: str,
        tried: list[str]) -> None:
    from fl_attack_flwr.jobs import run

    fake, calls = _fake(outcomes)
    monkeypatch.setattr(run, "_attack_once", fake)
    auto = AttackJob(**{**job.__dict__, "readings": ("gradient", "fedavg")})
    out = run_job(auto)
    assert out.reading == want and calls == tried


def test_the_batch_size_is_read_against_the_replys_num_examples(
        job: AttackJob, monkeypatch: pytest.MonkeyPatch) -> None:
    """An update of N samples has rank at most N: when the spectrum reads more, or the full
    rank of the layer, the attack runs again at the N the reply reports, and says why."""
    from fl_attack.errors import NotIdentifiable
    from fl_attack_flwr.jobs import run

    calls: list[dict] = []
    real = run._invert

    def fake_invert(job_, reading, kwargs):
        calls.append(kwargs)
        if "batch_size" not in kwargs:
            raise NotIdentifiable("full rank", reason="full-rank", rank=100, limit=100)
        return real(job_, reading, kwargs)

    monkeypatch.setattr(run, "_invert", fake_invert)
    told = dataclasses.replace(job, num_examples=B, readings=("gradient",),
                               invert_kwargs={**job.invert_kwargs, "max_seconds": 5.0})
    out = run_job(told)
    assert [c.get("batch_size") for c in calls] == [None, B]
    assert out.status in verdicts.RECONSTRUCTED and out.reconstruction["batch_size"] == B
    assert "more than the 8 samples the reply reports" in out.reconstruction["batch_size_from"]
    calls.clear()
    # a reply that counts as many samples as the layer has units: the full rank is the truth
    assert run_job(dataclasses.replace(told, num_examples=100)).status == verdicts.PROTECTED
    assert [c.get("batch_size") for c in calls] == [None]
