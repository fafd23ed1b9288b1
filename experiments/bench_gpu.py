"""GPU benchmark of the SPEAR++ core: fixed batch counts at four settings on CUDA, the small
settings also on the CPU in the same call, within about five minutes on one GPU.

Real CIFAR-shaped photo crops, first layer of a 3-hidden-layer ReLU MLP of width m, FedSGD,
default ``fl_attack.invert`` settings with a per-batch budget: (20, 200) x 3, (100, 1000) x 2,
(150, 4000) x 2 and (210, 4000) x 1 with the next layer's weight gradient
(``next_weight_grad``). The device runs first, every setting in turn; then the CPU runs the
(20, 200) and (100, 1000) batches again, for the ratio. Each batch's line is appended to the
results file as it finishes (``experiments/results/core.md``, ``--out`` to write elsewhere),
the table at the end: per setting the device's name, batches, certified, mean PSNR, median
seconds, the CPU's median and their ratio.

A batch that fails (out of memory, an error) is recorded as such and the run goes on.
``--deadline`` (seconds since the start, default 280) stops starting batches once it has
passed, and caps each batch's budget to the time left; the table says what it left out.

    python -m experiments.bench_gpu                    # CUDA; fails clearly without it
    python -m experiments.bench_gpu --smoke            # tiny, CPU only, a temporary file
    python -m experiments.bench_gpu --smoke --out /tmp/gpu-smoke.md
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

import fl_attack
from experiments import harness
from fl_attack.testbed import data, metrics, models

MODULE = "experiments.bench_gpu"
RESULTS = harness.RESULTS_DIR / "core.md"
TITLE = "SPEAR++ core benchmark"
INTRO = ("Real CIFAR-shaped photo crops, 3-hidden-layer ReLU MLP of width m, FedSGD, first "
         "layer, default `fl_attack.invert` settings.")
COLUMNS = ("setting", "device", "batches", "certified (λ=1)", "> 90 dB", "mean PSNR",
           "median s", "CPU median s", "CPU / device")
"""The columns of the table at the end of a run's section."""
FINISH_SHARE = 1.25
"""An attack may run this many times its budget (``Tuning.finish_share`` past it): a batch's
budget is capped to the time left before ``--deadline`` divided by this."""


@dataclass(frozen=True)
class Setting:
    """One row of the plan: B, m, how many batches, each one's budget (seconds), whether the
    attack gets the next layer's gradient and whether the CPU runs the batches too."""

    B: int
    m: int
    batches: int
    budget: float
    next_layer: bool = False
    cpu_too: bool = False

    @property
    def label(self) -> str:
        """``"(210, 4000) + next layer"``."""
        return f"({self.B}, {self.m})" + (" + next layer" if self.next_layer else "")


PLAN = (Setting(20, 200, 3, 20.0, cpu_too=True), Setting(100, 1000, 2, 60.0, cpu_too=True),
        Setting(150, 4000, 2, 60.0), Setting(210, 4000, 1, 120.0, next_layer=True))
"""The full run. On 2 CPU cores a (100, 1000) batch takes ~30 s and a (210, 4000) one with the
next layer ~340 s; on an H100 the code of 2026-11-22 took 45 s at (150, 4000)."""
SMOKE = (Setting(8, 100, 1, 30.0), Setting(12, 200, 1, 30.0, next_layer=True))
"""``--smoke``: the same steps at two tiny settings, on the CPU only (seconds)."""


@dataclass
class Outcome:
    """What one batch gave: its numbers, or the error that stopped it, or None where it was
    not started (the deadline)."""

    setting: Setting
    seed: int
    device: str
    budget: float
    capped: bool = False
    seconds: float | None = None
    psnr: float = float("nan")
    certified: bool = False
    found: int = 0
    batch_size: int = 0
    lam: float | None = None
    peeled: int = 0
    exhausted: bool = False
    peak_mib: float | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        """Whether the batch ran to its end."""
        return self.seconds is not None and self.error is None


def device_name(device: str) -> str:
    """The device's name for the table: the CUDA model (``torch.cuda.get_device_name``) or
    ``"cpu"``."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev.index or 0)
    return dev.type


def make_batch(setting: Setting, seed: int, dataset: str
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor | None]]:
    """A real batch and its layer's gradients (on the CPU): (images, ``invert``'s tensors)."""
    x, y = data.sample_batch(dataset, setting.B, seed=seed)
    xn = data.normalize(x, dataset)
    model = models.relu_mlp(xn[0].numel(), setting.m, 3, seed=seed)
    G, g = models.first_layer_gradients(model, xn, y)
    lin = models.linear_layers(model)[0]
    G2 = models.layer_gradients(model, xn, y, 1)[0] if setting.next_layer else None
    return x, {"weight_grad": G, "bias_grad": g, "weight": lin.weight.detach(),
               "bias": lin.bias.detach(), "next_weight_grad": G2}


def run_batch(setting: Setting, seed: int, device: str, budget: float, dataset: str,
              capped: bool = False) -> Outcome:
    """Invert one batch on ``device`` within ``budget`` seconds.

    Parameters
    ----------
    setting : Setting
        B, m and whether the next layer's gradient is given.
    seed : int
        The batch's seed (data, model and attack).
    device : str
        Where the attack runs.
    budget : float
        ``max_seconds`` of the attack.
    dataset : str
        Where the batch comes from.
    capped : bool, default False
        Whether ``budget`` was cut to the time left before the deadline (recorded).

    Returns
    -------
    Outcome
        The batch's numbers, or the error that stopped it: any exception is recorded instead
        of raised (after an out-of-memory error the CUDA cache is emptied).
    """
    out = Outcome(setting, seed, device, budget, capped)
    cuda = torch.device(device).type == "cuda"
    try:
        x, tensors = make_batch(setting, seed, dataset)
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        rec = fl_attack.invert(**tensors, seed=seed, device=device, max_seconds=budget)
        if cuda:
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - t0
        images = data.denormalize(rec.inputs.float().reshape(-1, *x.shape[1:]), dataset)
        out.psnr = metrics.score_batch(images, x).mean_psnr
    except Exception as exc:  # recorded in the table; the run goes on
        if cuda and isinstance(exc, torch.OutOfMemoryError):
            torch.cuda.empty_cache()
        first = (str(exc).strip().splitlines() or [""])[0][:160]
        out.error = f"{type(exc).__name__}: {first}"
        return out
    out.seconds, out.certified, out.lam = seconds, bool(rec.exact), rec.sparsity_match
    out.found, out.batch_size = rec.n_directions, rec.batch_size
    out.peeled, out.exhausted = rec.peeled, rec.budget_exhausted
    if cuda:
        out.peak_mib = torch.cuda.max_memory_allocated(device) / 2**20
    return out


def batch_line(o: Outcome) -> str:
    """One batch's line for the results file."""
    head = f"- {o.setting.label} seed {o.seed} on {o.device}, budget {o.budget:.0f} s"
    head += " (cut to the time before --deadline)" if o.capped else ""
    if o.error is not None:
        return f"{head}: failed, {o.error}"
    if o.seconds is None:
        return f"{head}: not started (--deadline passed)"
    lam = "-" if o.lam is None else f"{o.lam:.4f}"
    line = (f"{head}: {o.seconds:.1f} s, PSNR {o.psnr:.1f} dB, λ={lam}, found "
            f"{o.found}/{o.batch_size}, {'certified' if o.certified else 'not certified'}")
    line += ", budget spent" if o.exhausted else ""
    line += f", peeled {o.peeled}" if o.setting.next_layer else ""
    line += f", peak GPU memory {o.peak_mib:.0f} MiB" if o.peak_mib is not None else ""
    return line


def _count(outs: Sequence[Outcome], planned: int) -> str:
    """The table's batches cell: how many ran of the plan, and why not the others."""
    done = sum(o.ok for o in outs)
    failed = sum(o.error is not None for o in outs)
    skipped = planned - done - failed
    notes = [f"{failed} failed"] * bool(failed) + [f"{skipped} not started: deadline"] * bool(
        skipped)
    return f"{done} of {planned}" + (f" ({', '.join(notes)})" if notes else "")


def _median(outs: Sequence[Outcome]) -> float | None:
    """Median seconds of the batches that ran, or None."""
    secs = [o.seconds for o in outs if o.ok and o.seconds is not None]
    return statistics.median(secs) if secs else None


def summary_row(setting: Setting, name: str, outs: Sequence[Outcome],
                cpu: Sequence[Outcome] | None) -> list[str]:
    """The table row of one setting.

    Parameters
    ----------
    setting : Setting
        The row's setting (its planned batch count).
    name : str
        The device's name (:func:`device_name`).
    outs : sequence of Outcome
        The device's outcomes, one per planned batch.
    cpu : sequence of Outcome, optional
        The CPU's outcomes where the CPU ran the setting too.

    Returns
    -------
    list of str
        The cells, in the order of :data:`COLUMNS`; the ratio is the CPU's median over the
        device's.
    """
    ran = [o for o in outs if o.ok]
    med, cpu_med = _median(outs), _median(cpu) if cpu is not None else None
    psnr = f"{statistics.mean(o.psnr for o in ran):.1f}" if ran else "—"
    cpu_cell = "—" if cpu is None else (
        f"{cpu_med:.2f}" if cpu_med is not None else f"— ({_count(cpu, setting.batches)})")
    ratio = f"{cpu_med / med:.2f}" if med and cpu_med is not None else "—"
    return [setting.label, name, _count(outs, setting.batches), str(sum(o.certified for o in ran)),
            str(sum(o.psnr > 90.0 for o in ran)), psnr, "—" if med is None else f"{med:.2f}",
            cpu_cell, ratio]


class Schedule:
    """The global deadline: how much budget a batch may still get, if any."""

    def __init__(self, deadline: float) -> None:
        self.start = time.perf_counter()
        self.deadline = deadline

    def elapsed(self) -> float:
        """Seconds since the run started."""
        return time.perf_counter() - self.start

    def budget(self, planned: float) -> tuple[float, bool] | None:
        """(budget, capped) for a batch that starts now, or None once the deadline passed."""
        left = self.deadline - self.elapsed()
        if left <= 0:
            return None
        cap = left / FINISH_SHARE
        return (cap, True) if cap < planned else (planned, False)


Outcomes = dict[Setting, list[Outcome]]


def run_plan(plan: Sequence[Setting], device: str, cpu: bool, args: argparse.Namespace,
             schedule: Schedule) -> tuple[Outcomes, Outcomes]:
    """Every batch of ``plan`` on ``device``, then, with ``cpu``, the settings marked
    ``cpu_too`` on the CPU; each batch's line printed and appended as it finishes.

    Parameters
    ----------
    plan : sequence of Setting
        What to run, in order.
    device : str
        The attack's device.
    cpu : bool
        Whether the CPU runs the ``cpu_too`` settings afterwards.
    args : argparse.Namespace
        ``first_seed``, ``dataset`` and ``out``.
    schedule : Schedule
        The global deadline.

    Returns
    -------
    (device outcomes, CPU outcomes)
        Per setting, one outcome per planned batch (not started ones included).
    """
    on_device: Outcomes = {}
    on_cpu: Outcomes = {}
    runs = [(s, device, on_device) for s in plan]
    runs += [(s, "cpu", on_cpu) for s in plan if cpu and s.cpu_too]
    for setting, dev, found in runs:
        outs = found.setdefault(setting, [])
        for seed in range(args.first_seed, args.first_seed + setting.batches):
            slot = schedule.budget(setting.budget)
            if slot is None:
                outs.append(Outcome(setting, seed, dev, setting.budget))
            else:
                outs.append(run_batch(setting, seed, dev, slot[0], args.dataset, slot[1]))
            line = batch_line(outs[-1])
            print(line, flush=True)
            harness.append_lines(args.out, line)
    return on_device, on_cpu


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line; ``--device cuda`` (the default without ``--smoke``) needs CUDA."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default=None,
                        help="the attack's device (default: cuda; cpu with --smoke)")
    parser.add_argument("--smoke", action="store_true",
                        help="(8, 100) and (12, 200) x 1 on the CPU only, into a temporary "
                             "file unless --out is given: a check that the bench still runs")
    parser.add_argument("--deadline", type=float, default=280.0,
                        help="seconds after the start past which no batch starts; budgets "
                             "are capped to the time left (default 280)")
    harness.add_first_seed(parser)
    harness.add_dataset(parser)
    harness.add_out(parser, RESULTS)
    args = parser.parse_args(argv)
    args.device = args.device or ("cpu" if args.smoke else "cuda")
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: CUDA is not available here (torch "
                     f"{torch.__version__}, torch.cuda.is_available() is False); --smoke "
                     "runs the quick check on the CPU, --device cpu the full plan")
    if args.deadline <= 0:
        parser.error("--deadline must be > 0")
    if args.smoke and args.out == RESULTS:  # a smoke run stays out of the results
        args.out = Path(tempfile.mkstemp(prefix="bench_gpu_smoke_", suffix=".md")[1])
        args.out.unlink()  # start_section writes the title into a new file
    return args


def warm_up(device: str, dataset: str) -> float:
    """One small untimed attack on ``device`` (CUDA context, libraries, kernels); seconds."""
    t0 = time.perf_counter()
    run_batch(Setting(8, 100, 1, 30.0), 0, device, 30.0, dataset)
    return time.perf_counter() - t0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the plan (or the smoke plan), then print and append the table; exit status 0."""
    args = parse_args(argv)
    plan = SMOKE if args.smoke else PLAN
    on_cpu = torch.device(args.device).type == "cpu"
    schedule = Schedule(args.deadline)
    warm = 0.0 if on_cpu else warm_up(args.device, args.dataset)
    setup = (f"Dataset {args.dataset}, batches from seed {args.first_seed}, per-batch budgets "
             + ", ".join(f"{s.label} {s.budget:.0f} s" for s in plan)
             + f"; --deadline {args.deadline:.0f} s"
             + (f"; warm-up on {args.device} {warm:.1f} s (not timed)" if warm else "")
             + (f"; the CPU ({torch.get_num_threads()} threads) runs "
                + ", ".join(s.label for s in plan if s.cpu_too) + " again" if not on_cpu
                else "") + ". Per batch, as they finished:")
    harness.start_section(args.out, TITLE, INTRO, [
        harness.section_heading(MODULE, argv), "", harness.machine_line(args.device), "",
        setup, ""])
    dev, cpu = run_plan(plan, args.device, not on_cpu, args, schedule)
    name = device_name(args.device)
    rows = [summary_row(s, name, dev[s], cpu.get(s) if s.cpu_too and not on_cpu else None)
            for s in plan]
    table = harness.markdown_table(COLUMNS, rows, align="llrrrrrrr")
    skipped = sum(o.seconds is None and o.error is None for outs in (dev, cpu)
                  for os_ in outs.values() for o in os_)
    note = (f"Whole run {schedule.elapsed():.0f} s"
            + (f"; --deadline ({args.deadline:.0f} s) passed: {skipped} batch(es) not started"
               if skipped else "") + ".")
    print("\n".join(["", *table, "", note]), flush=True)
    harness.append_lines(args.out, "", *table, "", note)
    print(f"written to {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
