"""The executor interface, and the set-up of a process that runs attacks.

Every executor (:mod:`fl_attack_flwr.executors.processes`: inline, a pool of worker processes;
:mod:`fl_attack_flwr.executors.ray_actors`: Ray actors) takes
:class:`~fl_attack_flwr.jobs.build.AttackJob` s and returns ``concurrent.futures.Future`` s
of :class:`~fl_attack_flwr.jobs.outcome.AttackOutcome` s; a future never fails: what happens to
an attack (a hard timeout, a dead worker, a memory cap) is its outcome, and
:func:`outcome_of` reads a finished future the same way whichever executor gave it.
"""

from __future__ import annotations

import os
from concurrent.futures import Future

from fl_attack_flwr import verdicts
from fl_attack_flwr.jobs.build import AttackJob
from fl_attack_flwr.jobs.outcome import AttackOutcome, error_outcome
from fl_attack_flwr.settings import usable_cores


class Executor:
    """Interface: ``submit`` a job, get a future of its outcome; ``start`` warms up early."""

    name = "executor"

    def start(self) -> None:
        """Prepare workers ahead of the first job (e.g. while the clients train)."""

    def submit(self, job: AttackJob) -> Future[AttackOutcome]:
        """Queue ``job``; the future's result is its outcome."""
        raise NotImplementedError

    def close(self) -> None:
        """Stop every worker; unfinished futures get an ``unfinished`` outcome."""


def outcome_of(fut: Future[AttackOutcome]) -> AttackOutcome:
    """A finished future's outcome; a cancelled or failed one becomes an error outcome."""
    try:
        return fut.result()
    except Exception as exc:  # noqa: BLE001 - CancelledError included
        status = verdicts.UNFINISHED if fut.cancelled() else verdicts.ATTACK_ERROR
        return error_outcome(status, f"{type(exc).__name__}: {exc}")


def lower_priority(niceness: int) -> None:
    """Run this process at least at Unix ``niceness`` (a no-op where the OS has none).

    Attack workers share the cores with the federation (the server, simulated clients): at a
    higher niceness the scheduler serves the federation first and gives the attacks what is
    left. Niceness only ever rises here, so a repeated call (a reused Ray worker) is harmless.
    """
    if niceness <= 0 or not hasattr(os, "setpriority"):
        return
    try:
        now = os.getpriority(os.PRIO_PROCESS, 0)
        if niceness > now:
            os.setpriority(os.PRIO_PROCESS, 0, min(niceness, 19))
    except OSError:
        pass


def cores_share(workers: int) -> int:
    """Torch threads of one of ``workers`` attack workers: its share of the usable cores
    (workers that each took every core would oversubscribe them)."""
    return max(1, usable_cores() // workers)


def prepare_worker(threads: int, niceness: int) -> None:
    """Set up a process that runs attacks (a pool worker, a Ray actor): its priority
    (:func:`lower_priority`), torch's intra-op ``threads``, and the imports warmed once."""
    lower_priority(niceness)
    import torch

    import fl_attack  # noqa: F401  (warm the imports before the first job)

    torch.set_num_threads(threads)
