"""Attack one client's weight update and score it: what the DP-SGD and FedAvg benchmarks share.

Both :mod:`experiments.bench_dp` and :mod:`experiments.bench_fedavg` build a client's update
``(W0 − W1, b0 − b1)`` on a real batch, give it to ``fl_attack.invert`` with ``weight=W0,
bias=b0`` and score the reconstruction against the true batch. This module holds that attack and
score (:func:`attack_batch`), the per-batch outcome and per-setting summary a table row is made
of (:class:`BatchOutcome`, :func:`summarize`), the progress line (:func:`print_batch`) and the
verdict against the target both benchmarks are measured against: at least
:data:`TARGET_PCT` % of batches above :data:`PSNR_OK` dB (the papers' accuracy under DP and
FedAvg).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

import fl_attack
from fl_attack.testbed import data, metrics

DATASET = "photos32"
"""CIFAR-shaped crops of real photographs: the batches both benchmarks attack by default."""
PSNR_OK = 25.0
"""The papers' accuracy under DP / FedAvg: % of batches whose mean PSNR is above this (dB)."""
TARGET_PCT = 90.0
"""Target: at least this % of batches above :data:`PSNR_OK` at B = 20, m = 200."""


@dataclass
class BatchOutcome:
    """What one attacked batch gave: the numbers a table row aggregates."""

    psnr: float
    """Mean matched PSNR of the batch (dB); 0 when the attack raised."""
    detected_b: int | None
    """Batch size read off the update's rank (None when the attack raised)."""
    exact: bool
    """λ = 1 with all B directions found (certified without ground truth)."""
    seconds: float
    """Wall time of ``fl_attack.invert`` alone."""
    sparsity_match: float | None = None
    error: str | None = None
    """``Type: message`` when the attack raised instead of returning a reconstruction."""
    cpu_seconds: float = 0.0
    """CPU time of this process during ``fl_attack.invert`` (all its threads): what the
    attack cost, less sensitive than the wall time to other work on a shared machine."""
    readings: tuple[int, ...] = ()
    """The batch sizes the noisy spectrum allowed, when two were attacked
    (``Reconstruction.batch_size_readings``)."""
    stopped: str | None = None
    """Why the search ended (``Reconstruction.stopped``: certified, converged, budget, ...);
    None when the attack raised."""


@dataclass
class SettingSummary:
    """Aggregate of the batches of one setting, as printed and written to the markdown table."""

    batches: int
    mean_psnr: float
    pct_ok: float
    pct_exact: float
    detected: str
    median_s: float
    max_s: float
    errors: list[str] = field(default_factory=list)
    median_cpu_s: float = 0.0
    """Median of :attr:`BatchOutcome.cpu_seconds`."""
    mean_s: float = 0.0
    """Mean of :attr:`BatchOutcome.seconds`: what a federation of such clients costs."""
    stopped: str = "—"
    """How many batches ended for each reason (:func:`describe_stops`)."""
    oracle_pct: float | None = None
    """% of batches above 25 dB for the least-squares reconstruction from the true ∂L/∂Z."""


def attack_batch(dw: torch.Tensor, db: torch.Tensor, w0: torch.Tensor, b0: torch.Tensor,
                 x: torch.Tensor, *, seed: int, max_seconds: float | None,
                 device: str | None, dataset: str = DATASET,
                 **options: object) -> BatchOutcome:
    """Invert one update and score it against the true batch.

    A ``ValueError``/``RuntimeError`` from the attack (e.g. a noise level at which no rank below
    min(m, n) is detected, a failed linear solve) counts as a failed batch (0 dB) and is kept
    with its message, so one bad batch neither stops a long run nor disappears from the table.

    Parameters
    ----------
    dw, db : torch.Tensor
        The first layer's weight and bias update, ``W0 − W1`` and ``b0 − b1``.
    w0, b0 : torch.Tensor
        The first layer's weights before the update (the global model's).
    x : torch.Tensor
        The true batch, images in [0, 1].
    seed : int
        The attack's seed (the batch's).
    max_seconds : float, optional
        The attack's wall-clock budget.
    device : str, optional
        The attack's device.
    dataset : str, default :data:`DATASET`
        Whose statistics undo the normalisation of the reconstructed inputs.
    **options
        Further ``AttackConfig`` options (e.g. ``update="fedavg"``).

    Returns
    -------
    BatchOutcome
        PSNR, detected B, certificate and timing of the batch.
    """
    t0, c0 = time.perf_counter(), time.process_time()
    try:
        rec = fl_attack.invert(dw, db, weight=w0, bias=b0, seed=seed, max_seconds=max_seconds,
                               device=device, **options)
    except (ValueError, RuntimeError) as exc:
        return BatchOutcome(psnr=0.0, detected_b=None, exact=False,
                            seconds=time.perf_counter() - t0,
                            error=f"{type(exc).__name__}: {exc}",
                            cpu_seconds=time.process_time() - c0)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    images = data.denormalize(rec.inputs.float().reshape(-1, *x.shape[1:]), dataset)
    score = metrics.score_batch(images, x)
    return BatchOutcome(psnr=score.mean_psnr, detected_b=rec.batch_size, exact=rec.exact,
                        seconds=seconds, sparsity_match=rec.sparsity_match, cpu_seconds=cpu,
                        readings=rec.batch_size_readings, stopped=getattr(rec, "stopped", None))


def describe_detected(values: Sequence[int | None], true_b: int, two: int = 0) -> str:
    """The batch sizes the attack kept, against the true one, for a table cell.

    Parameters
    ----------
    values : sequence of int or None
        The detected B of each batch (None where the attack raised).
    true_b : int
        The true batch size.
    two : int, default 0
        In how many batches the spectrum allowed two readings.

    Returns
    -------
    str
        ``"20 (3/3 = B)"`` or ``"19–21 (1/3 = B; 2 with two readings)"``.
    """
    found = [v for v in values if v is not None]
    hits = sum(v == true_b for v in found)
    if not found:
        return f"— (0/{len(values)} = B)"
    lo, hi = min(found), max(found)
    span = f"{lo}" if lo == hi else f"{lo}–{hi}"
    extra = f"; {two} with two readings" if two else ""
    return f"{span} ({hits}/{len(values)} = B{extra})"


def describe_stops(values: Sequence[str | None]) -> str:
    """How many batches ended for each reason, for a table cell: ``"converged 12, budget 8"``
    (— when the attack did not report its reasons).

    Parameters
    ----------
    values : sequence of str or None
        Each batch's ``Reconstruction.stopped`` (None where the attack raised or did not say).

    Returns
    -------
    str
        The reasons, most frequent first.
    """
    counts: dict[str, int] = {}
    for v in values:
        if v is not None:
            counts[v] = counts.get(v, 0) + 1
    if not counts:
        return "—"
    return ", ".join(f"{k} {n}" for k, n in sorted(counts.items(), key=lambda kv: -kv[1]))


def summarize(outcomes: Sequence[BatchOutcome], true_b: int) -> SettingSummary:
    """Aggregate one setting's batches: mean PSNR, % > 25 dB, % exact, detected B, seconds.

    Parameters
    ----------
    outcomes : sequence of BatchOutcome
        The setting's batches (at least one).
    true_b : int
        The true batch size.

    Returns
    -------
    SettingSummary
        The numbers of the setting's table row.
    """
    psnrs = [o.psnr for o in outcomes]
    secs = [o.seconds for o in outcomes]
    return SettingSummary(
        batches=len(outcomes),
        mean_psnr=statistics.mean(psnrs),
        pct_ok=metrics.batch_accuracy(psnrs, PSNR_OK),
        pct_exact=100.0 * sum(o.exact for o in outcomes) / len(outcomes),
        detected=describe_detected([o.detected_b for o in outcomes], true_b,
                                   sum(len(o.readings) > 1 for o in outcomes)),
        median_s=statistics.median(secs),
        max_s=max(secs),
        errors=[o.error for o in outcomes if o.error],
        median_cpu_s=statistics.median(o.cpu_seconds for o in outcomes),
        mean_s=statistics.mean(secs),
        stopped=describe_stops([o.stopped for o in outcomes]),
    )


def print_batch(label: str, seed: int, o: BatchOutcome, true_b: int) -> None:
    """Print one progress line per batch, so that a long run shows where it is.

    Parameters
    ----------
    label : str
        The setting, e.g. ``"B=20 m=200 C=1 f=0.1"``.
    seed : int
        The batch's seed.
    o : BatchOutcome
        What the batch gave.
    true_b : int
        The true batch size.
    """
    if o.error:
        print(f"  {label} batch {seed}: attack raised {o.error} ({o.seconds:.1f}s)", flush=True)
        return
    lam = "-" if o.sparsity_match is None else f"{o.sparsity_match:.4f}"
    read = f" of {o.readings}" if len(o.readings) > 1 else ""
    why = f"  stopped={o.stopped}" if o.stopped else ""
    print(f"  {label} batch {seed}: PSNR {o.psnr:6.1f}  B̂={o.detected_b}{read}/{true_b}  λ={lam}  "
          f"exact={o.exact}  {o.seconds:.1f}s ({o.cpu_seconds:.1f} CPU s){why}", flush=True)


def load_note(when: str) -> str:
    """The machine's load averages (1, 5, 15 min) for a results section: the attack's budget is
    wall time, so on a shared machine a loaded run gets less compute within it."""
    try:
        one, five, fifteen = os.getloadavg()
    except OSError:
        return f"Load average {when}: not available."
    return f"Load average {when}: {one:.1f} / {five:.1f} / {fifteen:.1f} (1 / 5 / 15 min)."


def verdict(pcts: Sequence[float]) -> str:
    """Whether the given rows meet the target of ≥ :data:`TARGET_PCT` % above 25 dB.

    Parameters
    ----------
    pcts : sequence of float
        The rows' % of batches above :data:`PSNR_OK`.

    Returns
    -------
    str
        ``"**met**"`` when every row reaches the target, else ``"**not met**"``.
    """
    return "**met**" if pcts and min(pcts) >= TARGET_PCT else "**not met**"
