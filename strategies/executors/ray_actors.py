"""The ``ray`` executor: attacks on long-lived Ray actors, one attack per actor at a time.

An actor is the Ray counterpart of a pool worker: it imports torch and the attack once and is
reused, so an attack costs what the attack costs. A Ray task would not: on a Flower
simulation's instance, whose ClientApp actors fill Ray's worker pool, Ray stops idle task
workers soon after their task, and each attack would pay a fresh interpreter and torch import.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from fl_attack_flwr import verdicts
from fl_attack_flwr.executors.base import Executor, cores_share, prepare_worker
from fl_attack_flwr.jobs.build import AttackJob
from fl_attack_flwr.jobs.outcome import AttackOutcome, error_outcome
from fl_attack_flwr.jobs.run import run_job
from fl_attack_flwr.settings import usable_cores

log = logging.getLogger("fl_attack")

SHARED_RAY_WAIT = 10.0
"""Seconds the Ray executor waits for a Flower simulation engine in this process to start Ray
(it does so while the first round is configured) before starting one itself."""


def _simulation_ray(wait: float) -> bool:
    """Whether Ray runs in this process (a Flower simulation's), waiting up to ``wait`` s for
    it when a simulation engine thread is about to start it."""
    import ray

    # flwr.simulation.run_simulation runs the engine (which starts Ray) in this process
    simulating = "flwr.server.superlink.fleet.vce.vce_api" in sys.modules
    deadline = time.monotonic() + (wait if simulating else 0.0)
    while not ray.is_initialized() and time.monotonic() < deadline:
        time.sleep(0.1)
    return bool(ray.is_initialized())


def _check_same_cluster(address: str) -> None:
    """``ValueError`` unless the Ray this process runs is the cluster at ``address``."""
    import ray

    if address == "auto":
        return
    here = ray.get_runtime_context().gcs_address
    wanted = address.removeprefix("ray://")
    if wanted != here:
        raise ValueError(
            f"ray_address {address!r} was given, but this process already runs Ray connected to "
            f"{here!r} (a Flower simulation starts its own Ray instance in the ServerApp's "
            "process). Ray connects a process to one cluster: leave ray_address empty to run the "
            "attacks on the simulation's Ray, or run the ServerApp in a deployment (not a "
            "simulation) to attach it to your cluster.")


def _cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


class AttackActor:
    """Body of one Ray actor: warm imports, then one attack per :meth:`run` call."""

    def __init__(self, threads: int, niceness: int) -> None:
        prepare_worker(threads, niceness)

    def run(self, job: AttackJob) -> AttackOutcome:
        """Run ``job``; the outcome names the Ray node it ran on."""
        import ray

        node = ray.get_runtime_context().get_node_id()
        return dataclasses.replace(run_job(job, in_worker=True), ran_on=f"ray-node:{node}")


@dataclass
class _Slot:
    """One actor and the attack it runs (``ref`` is ``None`` while idle)."""

    actor: Any
    ref: Any = None
    future: Future[AttackOutcome] | None = None
    started: float = 0.0


class RayExecutor(Executor):
    """Attacks on ``max_inflight`` Ray actors (``num_cpus`` / ``num_gpus`` resources each).

    Ray is the one the process already runs (``flwr.simulation`` starts it in-process), else
    ``address`` (a cluster; ``"auto"`` finds a local one), else a new local instance. On the
    simulation's own instance, whose ClientApp actors hold every CPU, the attack actors reserve
    none; ``max_inflight`` (default: the usable cores, on a cluster its CPUs over ``num_cpus``)
    bounds how many attacks run at once, each with its share of the cores as torch threads.
    An attack past ``timeout`` has its actor killed and replaced (``timeout``); an actor that
    dies is ``worker-died``, one killed by Ray's memory monitor ``out-of-memory``.
    """

    name = "ray"

    def __init__(self, address: str | None = None, *, num_cpus: float | None = None,
                 num_gpus: float | None = None, resources: dict[str, float] | None = None,
                 timeout: float | None = None, max_inflight: int | None = None,
                 niceness: int = 0) -> None:
        self.address, self.num_cpus, self.num_gpus, self.timeout = (address, num_cpus,
                                                                    num_gpus, timeout)
        self.resources = dict(resources or {})
        self.max_inflight, self.niceness, self._threads = max_inflight, niceness, 1
        self._queue: list[tuple[AttackJob, Future[AttackOutcome]]] = []
        self._slots: list[_Slot] = []
        self._actor_class: Any = None
        self._started_ray = False
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    # ------------------------------------------------------------------ set-up

    def start(self) -> None:
        with self._lock:
            if self._actor_class is not None:
                return
            shared = self._connect()
            self._size(shared)
            import ray

            self._actor_class = ray.remote(max_restarts=0)(AttackActor)
            self._slots = [_Slot(self._new_actor()) for _ in range(self.max_inflight or 1)]
            self._thread = threading.Thread(target=self._dispatch, name="fl-attack-ray",
                                            daemon=True)
            self._thread.start()

    def _connect(self) -> bool:
        """Join or start Ray; whether it is a simulation's instance in this process.

        A given ``address`` is the cluster the attacks run on, or a ``ValueError`` naming it:
        Ray connects a process to one cluster, so when this process already runs another one
        (a Flower simulation's) the address cannot be honoured.
        """
        import ray

        shared = self.address is None and _simulation_ray(SHARED_RAY_WAIT)
        if self.address and ray.is_initialized():
            _check_same_cluster(self.address)
        if not ray.is_initialized():
            os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
            kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False,
                                      "logging_level": "ERROR", "ignore_reinit_error": True}
            if self.address:
                try:
                    ray.init(address=self.address, **kwargs)
                except (ConnectionError, RuntimeError, ValueError) as exc:
                    raise ValueError(f"ray_address {self.address!r}: cannot connect to that "
                                     f"Ray cluster ({exc})") from exc
            else:
                ray.init(num_cpus=usable_cores(), **kwargs)
                self._started_ray = True
        return shared

    def _size(self, shared: bool) -> None:
        """Resources per actor, number of actors and torch threads per attack."""
        import ray

        if self.num_cpus is None:
            self.num_cpus = 0.0 if shared and not self.address else 1.0
        if self.num_gpus is None:
            self.num_gpus = 1.0 if _cuda_available() else 0.0
        if self.max_inflight is None:
            total = ray.cluster_resources()
            fits = [int(float(total.get(name, 0.0)) // need)
                    for name, need in self.resources.items() if need > 0]
            if self.num_cpus != 0:
                fits.append(int(float(total.get("CPU", usable_cores())) // self.num_cpus))
            self.max_inflight = max(1, min(fits)) if fits else usable_cores()
        self._threads = (cores_share(self.max_inflight) if self.num_cpus == 0
                         else max(1, int(self.num_cpus)))

    def _new_actor(self) -> Any:
        return self._actor_class.options(num_cpus=self.num_cpus, num_gpus=self.num_gpus,
                                         resources=self.resources or None).remote(
            self._threads, self.niceness)

    # ------------------------------------------------------------------ jobs

    def submit(self, job: AttackJob) -> Future[AttackOutcome]:
        self.start()
        future: Future[AttackOutcome] = Future()
        future.set_running_or_notify_cancel()
        with self._lock:
            self._queue.append((job, future))
        return future

    def running(self) -> int:
        """Attacks running on an actor now (at most ``max_inflight``)."""
        with self._lock:
            return sum(1 for s in self._slots if s.ref is not None)

    def _assign(self) -> None:
        """Hand queued jobs to idle actors."""
        with self._lock:
            for slot in self._slots:
                if not self._queue:
                    return
                if slot.ref is None:
                    job, slot.future = self._queue.pop(0)
                    slot.ref, slot.started = slot.actor.run.remote(job), time.perf_counter()

    def _dispatch(self) -> None:
        import ray

        while not self._stop.is_set():
            self._assign()
            with self._lock:
                busy = [s for s in self._slots if s.ref is not None]
            if not busy:
                time.sleep(0.05)
                continue
            done, _ = ray.wait([s.ref for s in busy], num_returns=1, timeout=0.1)
            now = time.perf_counter()
            for slot in busy:
                if slot.ref in done:
                    self._finish(slot, self._result(slot.ref, now - slot.started))
                elif self.timeout and now - slot.started > self.timeout:
                    self._finish(slot, error_outcome(
                        verdicts.TIMEOUT, f"attack exceeded its hard timeout of "
                        f"{self.timeout:g}s (Ray actor killed)", now - slot.started))

    def _finish(self, slot: _Slot, outcome: AttackOutcome) -> None:
        """Deliver ``outcome``; replace the actor unless it finished its attack normally."""
        import ray

        healthy = outcome.status not in (verdicts.TIMEOUT, verdicts.WORKER_DIED,
                                             verdicts.OUT_OF_MEMORY)
        future = slot.future
        with self._lock:
            if not healthy:
                ray.kill(slot.actor, no_restart=True)
                slot.actor = self._new_actor()
                log.info("fl-attack: Ray attack actor replaced (%s)", outcome.status)
            slot.ref, slot.future = None, None
        if future is not None:
            future.set_result(outcome)

    @staticmethod
    def _result(ref: Any, seconds: float) -> AttackOutcome:
        import ray
        from ray import exceptions as rex

        try:
            return ray.get(ref)
        except rex.OutOfMemoryError as exc:
            return error_outcome(verdicts.OUT_OF_MEMORY, f"Ray: {exc}", seconds)
        except (rex.RayActorError, rex.WorkerCrashedError, rex.NodeDiedError) as exc:
            status = (verdicts.OUT_OF_MEMORY if "memory monitor" in str(exc).lower()
                      else verdicts.WORKER_DIED)
            return error_outcome(status, f"Ray: {type(exc).__name__}", seconds)
        except Exception as exc:  # noqa: BLE001
            return error_outcome(verdicts.ATTACK_ERROR, f"Ray: {type(exc).__name__}: {exc}",
                                 seconds)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with self._lock:
            slots, self._slots = self._slots, []
            queued, self._queue = self._queue, []
        futures = [f for _, f in queued] + [s.future for s in slots if s.future is not None]
        for future in futures:
            future.set_result(error_outcome(verdicts.UNFINISHED, "executor closed"))
        if slots:
            import ray

            for slot in slots:
                ray.kill(slot.actor, no_restart=True)
        if self._started_ray:
            import ray

            ray.shutdown()
            self._started_ray = False
        self._actor_class = None
