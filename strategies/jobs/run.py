"""Running one attack job, wherever it runs (the server process, a worker process, a Ray actor,
the client's own ``LeakGuard``).

:func:`run_job` is the one function every executor and the guard call. It never raises for
what can happen to an attack: it returns an :class:`~fl_attack_flwr.jobs.outcome.AttackOutcome`
that says what the attack learned (:mod:`fl_attack_flwr.verdicts`): a reconstruction with its
verdict, ``protected`` when the update does not reveal its batch, ``out-of-memory`` under the
memory cap, ``attack-error`` with the exception otherwise. Where the layer's inputs are features
and the job carries a pixel task, the pictures are estimated here too (``jobs.pixels``).
"""

from __future__ import annotations

import contextlib
import resource
import time
from collections.abc import Iterator
from typing import Any

from fl_attack_flwr import verdicts
from fl_attack_flwr.jobs.build import AttackJob
from fl_attack_flwr.jobs.outcome import AttackOutcome, error_outcome
from fl_attack_flwr.jobs.text import TextJob, run_text_job

_GB = 1024**3


def run_job(job: AttackJob | TextJob, *, in_worker: bool = False) -> AttackOutcome:
    """Attack ``job`` under each of its readings until one is certified; keep the best (a
    language model's job: the text attack, ``jobs.text``).

    ``in_worker`` applies the job's memory cap (never in the server's own process).
    """
    if isinstance(job, TextJob):
        with _memory_cap(job.memory_limit_gb if in_worker else None):
            return run_text_job(job)
    t0 = time.perf_counter()
    best: AttackOutcome | None = None
    first_error: AttackOutcome | None = None
    cap = job.memory_limit_gb if in_worker else None
    for reading in job.readings:
        with _memory_cap(cap):
            out = _attack_once(job, reading, cap)
        if out.status == verdicts.PROTECTED:
            best = best or out  # the rank does not depend on the reading: no other can do better
            break
        if out.status in verdicts.ERRORS:
            first_error = first_error or out
            if out.status == verdicts.OUT_OF_MEMORY:
                break
            continue
        if best is None or _rank(out) > _rank(best):
            best = out
        if best.status == verdicts.CERTIFIED:
            break
    outcome = best or first_error or error_outcome(verdicts.ATTACK_ERROR, "no reading to try")
    return outcome.took(time.perf_counter() - t0)


def _rank(out: AttackOutcome) -> tuple[int, int, float]:
    """Order of outcomes: certified > complete > partial, then the directions found, then λ.

    Directions before λ: the two readings' λ test different things (a FedAvg sum's only that
    zero rows are inactive units, with completed columns counted as unmatched), so the
    directions found are what two partial readings share as a measure.
    """
    order = {verdicts.CERTIFIED: 2, verdicts.NOT_CERTIFIED: 1, verdicts.PARTIAL: 0}
    lam = out.reconstruction_field("sparsity_match")
    found = out.reconstruction_field("n_directions")
    return (order.get(out.status, -1), -1 if found is None else int(found),
            -1.0 if lam is None else float(lam))


def _attack_once(job: AttackJob, reading: str, cap: float | None = None) -> AttackOutcome:
    from fl_attack.errors import NotIdentifiable

    t0 = time.perf_counter()
    try:
        rec, known = _invert_reading(job, reading)
    except NotIdentifiable as exc:
        return _not_identifiable(job, reading, exc, time.perf_counter() - t0)
    except MemoryError as exc:
        return error_outcome(verdicts.OUT_OF_MEMORY, f"MemoryError: {exc}",
                             time.perf_counter() - t0)
    except Exception as exc:  # noqa: BLE001 - any fault becomes a recorded outcome
        error = f"{type(exc).__name__}: {exc}"
        if cap and _lost_allocation(exc):
            return error_outcome(verdicts.OUT_OF_MEMORY,
                                 f"{error} (under the memory cap of {cap:g} GB: an allocation "
                                 "failed inside a C extension, which reported no MemoryError)",
                                 time.perf_counter() - t0)
        status = verdicts.OUT_OF_MEMORY if _is_oom(exc) else verdicts.ATTACK_ERROR
        return error_outcome(status, error, time.perf_counter() - t0)
    facts = rec.as_dict()
    if known is not None:
        facts["batch_size_from"] = known
    status, reason = verdicts.reconstruction_verdict(facts)
    notes = [known] if known is not None else []
    if job.num_examples is not None and rec.batch_size < job.num_examples:
        facts["separated"] = verdicts.separated_reason(rec.batch_size, job.num_examples,
                                                       bool(facts.get("noisy")))
        notes.append(facts["separated"])
    if notes:
        reason = "; ".join([*notes, *([reason] if reason else [])])
    inputs = rec.inputs.detach().cpu().double().numpy()
    pixels = None
    if job.pixels is not None and rec.n_directions == rec.batch_size:
        from fl_attack_flwr.jobs.pixels import run_pixels  # torch, only for features

        # each sample's upstream gradient is known for one gradient step only
        pixels = run_pixels(job.pixels, inputs,
                            job.weight_grad if reading == "gradient" else None, job.weight)
    return AttackOutcome(status, reason=reason, reading=reading,
                         seconds=time.perf_counter() - t0, inputs=inputs, reconstruction=facts,
                         pixels=pixels)


def _not_identifiable(job: AttackJob, reading: str, exc: Any, seconds: float) -> AttackOutcome:
    """``protected`` for an update whose batch the attacked layer cannot separate.

    An update whose reply reports fewer samples than the layer's limit is attacked at the
    reported size (:func:`_invert_reading`), which never raises this; a ``full-rank`` past that
    point is another matrix's (not the attacked layer's) and is a fault, not a verdict.
    """
    n = job.num_examples
    if exc.reason == "full-rank" and n is not None and n < exc.limit:
        return error_outcome(verdicts.ATTACK_ERROR, (
            f"NotIdentifiable: {exc} (raised for a matrix of numerical rank {exc.rank}, although "
            f"the reply reports {n} samples and the attacked layer is read at that size: not a "
            "verdict on this update)"), seconds)
    return AttackOutcome(verdicts.PROTECTED,
                         reason=verdicts.protected_reason(exc.reason, exc.rank, exc.limit, n),
                         reading=reading, seconds=seconds, protected_by=exc.reason)


def _invert_reading(job: AttackJob, reading: str) -> tuple[Any, str | None]:
    """``fl_attack.invert`` of the job under one reading, and what set B when not the spectrum.

    The reply says how many samples the client trained on (``num-examples``), and an update
    that is a sum of those samples' gradient steps has rank at most that many. When the
    spectrum reads more (float32 rounding of ``W0 - W_E``, noise, an optimizer that rescales
    gradients), or reads the full rank of the layer while the reply counts fewer samples, the
    batch is attacked at the size the reply states, with the time left.
    """
    from fl_attack.errors import NotIdentifiable

    t0 = time.perf_counter()
    kwargs = dict(job.invert_kwargs)
    limit = job.num_examples if "batch_size" not in kwargs else None
    try:
        rec = _invert(job, reading, kwargs)
        if limit is None or rec.batch_size <= limit:
            return rec, None
        read = f"the spectrum reads B = {rec.batch_size}"
    except NotIdentifiable as exc:
        if exc.reason != "full-rank" or limit is None or limit >= exc.limit:
            raise
        read = f"the update has the layer's full numerical rank {exc.rank}"
    budget = kwargs.get("max_seconds")
    if budget is not None:
        kwargs["max_seconds"] = max(float(budget) - (time.perf_counter() - t0), 0.25 * budget)
    known = (f"{read}, more than the {limit} samples the reply reports (num-examples): "
             f"rounding of the float32 weights, noise, or an optimizer that rescales the "
             f"gradient fills the rest of the spectrum; attacked at B = {limit}")
    return _invert(job, reading, {**kwargs, "batch_size": limit}), known


def _invert(job: AttackJob, reading: str, kwargs: dict[str, Any]) -> Any:
    import torch

    from fl_attack import invert

    nexts = {}
    if reading == "gradient" and job.next_weight_grad is not None:
        nexts["next_weight_grad"] = torch.tensor(job.next_weight_grad)
        if job.next_weight is not None:
            nexts["next_weight"] = torch.tensor(job.next_weight)
    # torch.tensor copies: arrays that come through Ray's object store are read-only
    return invert(
        torch.tensor(job.weight_grad), torch.tensor(job.bias_grad),
        weight=torch.tensor(job.weight), bias=torch.tensor(job.bias), update=reading,
        **nexts, **kwargs)


_OOM_WORDS = ("allocate memory", "out of memory", "bad_alloc", "not enough memory")


def _is_oom(exc: Exception) -> bool:
    """Whether ``exc`` is a failed allocation, whichever layer reported it (torch's CPU
    allocator, CUDA, the C++ runtime, or the OS: ``[Errno 12] Cannot allocate memory``).

    By type where there is one (CUDA's ``OutOfMemoryError``, an ``OSError`` with errno 12);
    torch's CPU allocator raises a plain ``RuntimeError`` whose words are the only sign, so
    for that foreign exception its message is read."""
    text = str(exc).lower()
    return (type(exc).__name__ == "OutOfMemoryError" or getattr(exc, "errno", None) == 12
            or any(word in text for word in _OOM_WORDS))


def _lost_allocation(exc: Exception) -> bool:
    """Whether an exception under a memory cap is an allocation a C extension failed without
    raising: CPython's ``SystemError`` (an internal error, "error return without exception
    set", seen from numpy or torch when the cap refuses their memory)."""
    return isinstance(exc, SystemError)


@contextlib.contextmanager
def _memory_cap(limit_gb: float | None) -> Iterator[None]:
    """Cap the address space this process may *add* by ``limit_gb`` while the block runs."""
    if not limit_gb:
        yield
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = _address_space() + int(limit_gb * _GB)
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _address_space() -> int:
    """This process's virtual memory size in bytes (Linux ``/proc/self/statm``)."""
    with open("/proc/self/statm", encoding="ascii") as fh:
        pages = int(fh.read().split()[0])
    return pages * resource.getpagesize()
