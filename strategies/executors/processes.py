"""Where attacks run: the server process, spawned worker processes, or Ray actors.

Every executor takes :class:`~fl_attack_flwr.jobs.build.AttackJob` s and returns
``concurrent.futures.Future`` s of :class:`~fl_attack_flwr.jobs.outcome.AttackOutcome` s; a
future never fails: what happens to an attack (a hard timeout, a dead worker, a memory cap) is
its outcome.

* :class:`InlineExecutor`: one thread of the server process; no hard timeout, no memory cap.
* :class:`PoolExecutor`: ``n`` persistent ``spawn`` worker processes (``process`` is a pool of
  one). Each attack has its own hard timeout; a killed or crashed worker is replaced and only
  its attack is lost; a worker that ran out of memory is replaced after reporting it (a failed
  allocation can leave the process half-initialised). Spawn, not fork, keeps CUDA and Ray safe.
* ``RayExecutor`` (:mod:`fl_attack_flwr.executors.ray_actors`): long-lived Ray actors with CPU/GPU
  resources, on the Ray instance this process already has (the simulation engine's), on a given
  cluster address, or on a new local instance.

The interface and the worker set-up they share are in :mod:`fl_attack_flwr.executors.base`.

The same job and seed give the same reconstruction under every executor.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import os
import queue
import socket
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing.connection import wait as wait_connections
from typing import Any

from fl_attack_flwr import verdicts
from fl_attack_flwr.executors.base import Executor, cores_share, prepare_worker
from fl_attack_flwr.jobs.build import AttackJob
from fl_attack_flwr.jobs.outcome import AttackOutcome, error_outcome
from fl_attack_flwr.jobs.run import run_job
from fl_attack_flwr.settings import AttackSettings, usable_cores

log = logging.getLogger("fl_attack")


def make_executor(settings: AttackSettings) -> Executor:
    """The executor ``settings.executor`` names, configured from ``settings``."""
    if settings.executor == "inline":
        return InlineExecutor()
    if settings.executor == "ray":
        from fl_attack_flwr.executors.ray_actors import RayExecutor

        return RayExecutor(settings.ray_address, num_cpus=settings.ray_num_cpus,
                           num_gpus=settings.ray_num_gpus, resources=settings.ray_resources,
                           timeout=settings.timeout,
                           max_inflight=settings.workers, niceness=settings.niceness)
    workers = 1 if settings.executor == "process" else settings.workers or usable_cores()
    return PoolExecutor(workers, timeout=settings.timeout, startup_timeout=settings.startup_timeout,
                        name=settings.executor, niceness=settings.niceness)


def _run_here(job: AttackJob) -> AttackOutcome:
    return dataclasses.replace(run_job(job), ran_on="server")


class InlineExecutor(Executor):
    """Attacks one after another in a thread of the server process."""

    name = "inline"

    def __init__(self) -> None:
        self._threads = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fl-attack")

    def submit(self, job: AttackJob) -> Future[AttackOutcome]:
        return self._threads.submit(_run_here, job)

    def close(self) -> None:
        self._threads.shutdown(wait=True, cancel_futures=True)


def _worker_main(conn: Any, threads: int, niceness: int = 0) -> None:
    """Body of a worker process: set up (:func:`prepare_worker`), say ready, then run jobs
    until told to stop."""
    try:
        prepare_worker(threads, niceness)
        where = f"pid:{os.getpid()}@{socket.gethostname()}"
        conn.send(("ready", None))
        while True:
            try:
                job = conn.recv()
            except (EOFError, OSError):
                return
            if job is None:
                return
            outcome = dataclasses.replace(run_job(job, in_worker=True), ran_on=where)
            conn.send(("done", outcome))
            if outcome.status == verdicts.OUT_OF_MEMORY:
                return  # a failed allocation can leave half-imported modules: start afresh
    except KeyboardInterrupt:
        return


@dataclass
class _Worker:
    """One spawned worker process and the job it runs."""

    proc: Any
    conn: Any
    started: float
    ready: bool = False
    job: tuple[AttackJob, Future[AttackOutcome]] | None = None
    job_started: float = 0.0
    dead_reason: str = field(default="")

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=10)
        try:
            self.conn.close()
        except OSError:
            pass


class PoolExecutor(Executor):
    """``n`` persistent spawned worker processes, each attack with its own hard timeout.

    A dispatcher thread hands queued jobs to ready workers, collects their outcomes, kills a
    worker whose attack passed ``timeout`` (outcome ``timeout``) and replaces a worker that died
    (outcome ``worker-died``). Workers import torch once and are reused across attacks, and run
    at Unix ``niceness`` (:func:`lower_priority`).
    """

    def __init__(self, n: int, *, timeout: float | None = None, startup_timeout: float = 300.0,
                 name: str = "pool", niceness: int = 0) -> None:
        if n < 1:
            raise ValueError(f"a pool needs at least one worker, got {n}")
        self.n, self.timeout, self.startup_timeout, self.name = n, timeout, startup_timeout, name
        self.niceness = niceness
        self._queue: queue.SimpleQueue[tuple[AttackJob, Future[AttackOutcome]] | None] = (
            queue.SimpleQueue())
        self._workers: list[_Worker] = []
        self._pending: list[tuple[AttackJob, Future[AttackOutcome]]] = []
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def start(self) -> None:
        with self._lock:
            if self._thread is not None:
                return
            self._stop.clear()
            self._workers = [self._spawn() for _ in range(self.n)]
            self._thread = threading.Thread(target=self._dispatch, name="fl-attack-dispatch",
                                            daemon=True)
            self._thread.start()

    def submit(self, job: AttackJob) -> Future[AttackOutcome]:
        self.start()
        future: Future[AttackOutcome] = Future()
        self._queue.put((job, future))
        return future

    def worker_pids(self) -> list[int]:
        """PIDs of the live worker processes (for monitoring and tests)."""
        return [w.proc.pid for w in self._workers if w.proc.is_alive()]

    def busy_pids(self) -> list[int]:
        """PIDs of the workers running an attack now."""
        return [w.proc.pid for w in self._workers if w.job is not None and w.proc.is_alive()]

    def close(self) -> None:
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is None:
            return
        self._stop.set()
        self._queue.put(None)
        thread.join()
        for w in self._workers:
            if w.job is not None:
                w.job[1].set_result(error_outcome(verdicts.UNFINISHED, "executor closed"))
            if w.proc.is_alive():
                try:
                    w.conn.send(None)
                    w.proc.join(timeout=5)
                except (OSError, ValueError):
                    pass
            w.kill()
        self._workers = []
        leftovers = self._pending + self._drain_queue()
        for _, future in leftovers:
            future.set_result(error_outcome(verdicts.UNFINISHED, "executor closed"))
        self._pending = []

    # ------------------------------------------------------------------ dispatcher

    def _spawn(self) -> _Worker:
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe(duplex=True)
        proc = ctx.Process(target=_worker_main, args=(child, cores_share(self.n), self.niceness),
                           daemon=True,
                           name="fl-attack-worker")
        proc.start()
        child.close()
        return _Worker(proc, parent, time.perf_counter())

    def _drain_queue(self) -> list[tuple[AttackJob, Future[AttackOutcome]]]:
        items = []
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return items
            if item is not None:
                items.append(item)

    def _dispatch(self) -> None:
        while not self._stop.is_set():
            self._pending += self._drain_queue()
            self._assign()
            conns = [w.conn for w in self._workers if w.proc.is_alive()]
            ready = wait_connections(conns, timeout=0.1) if conns else []
            for w in list(self._workers):
                if w.conn in ready:
                    self._receive(w)
            self._check_deadlines()

    def _assign(self) -> None:
        for w in self._workers:
            if not self._pending:
                return
            if w.ready and w.job is None and w.proc.is_alive():
                job, future = self._pending.pop(0)
                if not future.set_running_or_notify_cancel():
                    continue
                try:
                    w.conn.send(job)
                except (OSError, ValueError):  # the worker is gone: the job waits for another
                    self._pending.insert(0, (job, _requeued(future)))
                    self._replace(w)
                    continue
                w.job, w.job_started = (job, future), time.perf_counter()

    def _receive(self, w: _Worker) -> None:
        try:
            kind, payload = w.conn.recv()
        except (EOFError, OSError):
            self._worker_died(w)
            return
        if kind == "ready":
            w.ready = True
        elif kind == "done" and w.job is not None:
            w.job[1].set_result(payload)
            w.job = None
            if payload.status == verdicts.OUT_OF_MEMORY:  # it exits: do not reuse it
                self._replace(w)

    def _check_deadlines(self) -> None:
        now = time.perf_counter()
        for w in list(self._workers):
            if not w.proc.is_alive():
                self._worker_died(w)
            elif w.job is not None and self.timeout and now - w.job_started > self.timeout:
                w.job[1].set_result(error_outcome(
                    verdicts.TIMEOUT, f"attack exceeded its hard timeout of {self.timeout:g}s "
                    "(worker process killed)", now - w.job_started))
                w.job = None
                self._replace(w)
            elif not w.ready and now - w.started > self.startup_timeout:
                log.warning("attack worker did not start within %.0fs; restarting it",
                            self.startup_timeout)
                self._replace(w)

    def _worker_died(self, w: _Worker) -> None:
        code = w.proc.exitcode
        if w.job is not None:
            job, future = w.job
            status, why = verdicts.WORKER_DIED, f"attack worker died (exit code {code})"
            if job.memory_limit_gb and code != -9:  # not killed from outside: a failed alloc
                status = verdicts.OUT_OF_MEMORY
                why += f" under its memory cap of {job.memory_limit_gb:g} GB"
            future.set_result(error_outcome(status, why, time.perf_counter() - w.job_started))
            w.job = None
        self._replace(w)

    def _replace(self, w: _Worker) -> None:
        w.kill()
        if w in self._workers and not self._stop.is_set():
            self._workers[self._workers.index(w)] = self._spawn()


def _requeued(future: Future[AttackOutcome]) -> Future[AttackOutcome]:
    """A running future handed back to the queue: a fresh one that completes it."""
    fresh: Future[AttackOutcome] = Future()
    fresh.add_done_callback(lambda f: future.set_result(f.result()))
    return fresh
