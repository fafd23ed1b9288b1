"""Benchmark of the attack on FedAvg weight updates (SPEAR App. F, SPEAR++ §5.3): PSNR, % exact, s.

Each client runs ``E`` local epochs of plain SGD (mini-batches of ``b_mini``, learning rate η) from
the global ``relu_mlp(3072, m, 3)`` on one real batch of B photo crops
(``fl_attack.testbed.simulate.local_update`` with ``protocol="fedavg"``) and sends back ``W_E``. The
server inverts ``(W0 − W_E, b0 − b_E)`` with ``weight=W0, bias=b0``: the same low-rank structure as
a gradient, with ∂L/∂Z replaced by the sum of the per-step output gradients (η cancels). The
target measured against: 5 local steps (E = 5, b_mini = B) at B = 20, m = 200 → ≥ 90% of batches
above 25 dB.

    python -m experiments.bench_fedavg --batches 3 --max-seconds 30
    python -m experiments.bench_fedavg --epochs 5 --minibatch B --lrs 0.01 --batches 20

Appends a section per run to experiments/results/fedavg.md (``--out`` to write elsewhere; rows
are appended as they finish). The attack and its score come from
:mod:`experiments.update_attack`, the options, header and file from :mod:`experiments.harness`.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from experiments import harness
from experiments.update_attack import (
    DATASET,
    PSNR_OK,
    TARGET_PCT,
    BatchOutcome,
    SettingSummary,
    attack_batch,
    load_note,
    print_batch,
    summarize,
    verdict,
)
from fl_attack.model import updates
from fl_attack.testbed import data, models, simulate

MODULE = "experiments.bench_fedavg"
RESULTS = harness.RESULTS_DIR / "fedavg.md"
DEFAULT_SETTINGS = "20x200"
DEFAULT_EPOCHS = "1,5,20,50"
DEFAULT_MINIBATCH = "B,5"
DEFAULT_LRS = "0.1,0.01,0.001"
TARGET = (20, 200, 5)  # (B, m, E) with b_mini = B: "5 local steps", ≥ 90% above 25 dB
PAPER_LR = 0.01  # SPEAR's FedAvg experiments use η = 0.01

FEDAVG_COLUMNS = (
    "B", "m", "E", "b_mini", "η", "local steps", "batches", "mean PSNR", "% > 25 dB",
    "% exact (λ=1)", "detected B", "median s", "max s", "median CPU s", "FedSGD: % > 25 dB",
    "FedSGD: median s", "FedSGD: max s", "FedSGD: median CPU s", "setting wall s",
    "papers (SPEAR App. F, SPEAR++ §5.3)",
)
"""The columns of a run's table: the same in every section of fedavg.md, so new rows fit."""


def parse_minibatch(text: str) -> list[int | None]:
    """``"B,5"`` → ``[None, 5]``: ``B`` (or ``full``) means full-batch steps."""
    out: list[int | None] = []
    for item in text.split(","):
        item = item.strip()
        if item.lower() in ("b", "full"):
            out.append(None)
            continue
        try:
            value = int(item)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"--minibatch: {item!r} is not B or an int") from exc
        if value < 1:
            raise argparse.ArgumentTypeError(f"--minibatch: {item!r} must be >= 1")
        out.append(value)
    return out


def paper_fedavg(B: int, epochs: int, b_mini: int | None, lr: float) -> str:
    """SPEAR's reference numbers for a row (App. F: TinyImageNet, B = 20, η = 0.01), else —."""
    if B != 20 or not math.isclose(lr, PAPER_LR):
        return "—"
    if b_mini is None or b_mini >= B:
        if epochs <= 20:
            return "SPEAR: ≈ 98–109 dB, 97–100% (E = 1…20)"
        if epochs == 50:
            return "SPEAR: 90%"
        return "—"
    if b_mini == 5 and epochs == 20:
        return "SPEAR: 97%"
    return "—"


def fedavg_update(B: int, m: int, seed: int, epochs: int, b_mini: int | None, lr: float,
                  dataset: str = DATASET,
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                             torch.Tensor, int]:
    """One client's FedAvg update on batch ``seed`` of ``dataset``:
    ``(x, dW, db, W0, b0, steps)``."""
    x, y = data.sample_batch(dataset, B, seed=seed)
    xn = data.normalize(x, dataset)
    model = models.relu_mlp(xn[0].numel(), m, 3, seed=seed)
    res = simulate.local_update(model, xn, y, protocol="fedavg", lr=lr, epochs=epochs,
                                batch_size=b_mini, seed=seed)
    dw, db, w0, b0 = updates.weight_update_pair(model.state_dict(), res.state_dict)
    return x, dw, db, w0, b0, res.steps


def fedsgd_update(B: int, m: int, seed: int, dataset: str = DATASET,
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The FedSGD gradient of the same batch and model as :func:`fedavg_update`'s:
    ``(dW, db, W0, b0)`` of one full-batch step (η cancels)."""
    x, y = data.sample_batch(dataset, B, seed=seed)
    xn = data.normalize(x, dataset)
    model = models.relu_mlp(xn[0].numel(), m, 3, seed=seed)
    res = simulate.local_update(model, xn, y, protocol="fedsgd", lr=PAPER_LR, seed=seed)
    return updates.weight_update_pair(model.state_dict(), res.state_dict)


def fedsgd_cells(B: int, m: int, seeds: Sequence[int], max_seconds: float | None,
                 device: str | None, dataset: str = DATASET) -> list[str]:
    """The FedSGD cells of a row: the same batches' one-step gradients attacked as
    gradients (``update="gradient"``): % > 25 dB, median s, max s, median CPU s."""
    outcomes = []
    for seed in seeds:
        x, _ = data.sample_batch(dataset, B, seed=seed)
        dw, db, w0, b0 = fedsgd_update(B, m, seed, dataset)
        o = attack_batch(dw, db, w0, b0, x, seed=seed, max_seconds=max_seconds, device=device,
                         dataset=dataset)
        print_batch(f"B={B} m={m} FedSGD", seed, o, B)
        outcomes.append(o)
    s = summarize(outcomes, B)
    return [f"{s.pct_ok:.0f}", f"{s.median_s:.1f}", f"{s.max_s:.1f}", f"{s.median_cpu_s:.1f}"]


def run_fedavg(settings: Sequence[tuple[int, int]], epochs_list: Sequence[int],
               minibatches: Sequence[int | None], lrs: Sequence[float], batches: int,
               first_seed: int, max_seconds: float | None, device: str | None,
               out: Path, update: str = "fedavg", fedsgd: bool = True,
               dataset: str = DATASET,
               ) -> list[tuple[int, int, int, int | None, float, SettingSummary]]:
    """Run the grid, printing and appending one row per (B, m, E, b_mini, η); with
    ``fedsgd`` each (B, m) first attacks the FedSGD gradients of the same batches, whose
    columns every row of that (B, m) repeats (— without). Batches come from ``dataset``."""
    rows = []
    for B, m in settings:
        seeds = range(first_seed, first_seed + batches)
        sgd = (fedsgd_cells(B, m, seeds, max_seconds, device, dataset) if fedsgd
               else ["—"] * 4)
        for b_mini in minibatches:
            for epochs in epochs_list:
                for lr in lrs:
                    outcomes: list[BatchOutcome] = []
                    steps = 0
                    t0 = time.perf_counter()
                    bm = "B" if b_mini is None or b_mini >= B else str(b_mini)
                    label = f"B={B} m={m} E={epochs} b_mini={bm} η={lr:g}"
                    for seed in range(first_seed, first_seed + batches):
                        try:
                            x, dw, db, w0, b0, steps = fedavg_update(B, m, seed, epochs, b_mini,
                                                                     lr, dataset)
                        except ValueError as exc:  # e.g. an identically zero update
                            o = BatchOutcome(psnr=0.0, detected_b=None, exact=False, seconds=0.0,
                                             error=f"update: ValueError: {exc}")
                        else:
                            o = attack_batch(dw, db, w0, b0, x, seed=seed,
                                             max_seconds=max_seconds, device=device,
                                             update=update, dataset=dataset)
                        outcomes.append(o)
                        print_batch(label, seed, o, B)
                    wall = time.perf_counter() - t0
                    s = summarize(outcomes, B)
                    row = harness.table_row([
                        B, m, epochs, bm, f"{lr:g}", steps, s.batches, f"{s.mean_psnr:.1f}",
                        f"{s.pct_ok:.0f}", f"{s.pct_exact:.0f}", s.detected, f"{s.median_s:.1f}",
                        f"{s.max_s:.1f}", f"{s.median_cpu_s:.1f}", *sgd, f"{wall:.0f}",
                        paper_fedavg(B, epochs, b_mini, lr),
                    ])
                    print(row, flush=True)
                    harness.append_lines(out, row)
                    for err in s.errors:
                        print(f"  error: {err}", flush=True)
                    rows.append((B, m, epochs, b_mini, lr, s))
    return rows


def fedavg_conclusion(rows: Sequence[tuple[int, int, int, int | None, float, SettingSummary]],
                      max_seconds: float | None) -> list[str]:
    """The notes under a run's table: errors, and the target met or not."""
    lines = [""]
    for B, m, e, bm, lr, s in rows:
        for err in s.errors:
            lines.append(f"- attack raised at B={B}, m={m}, E={e}, b_mini={bm or 'B'}, η={lr:g}: "
                         f"`{err}` (scored 0 dB)")
    tb, tm, te = TARGET
    hits = [(lr, s.pct_ok) for B, m, e, bm, lr, s in rows
            if (B, m, e) == (tb, tm, te) and (bm is None or bm >= B)]
    if not hits:
        lines.append(f"- Target (B = {tb}, m = {tm}, 5 local steps: E = {te}, "
                     "b_mini = B): **not measured** in this run.")
        return lines
    detail = ", ".join(f"η = {lr:g}: {p:.0f}%" for lr, p in hits)
    main_rows = [p for lr, p in hits if math.isclose(lr, PAPER_LR)]
    if main_rows:
        head = (f"{verdict(main_rows)} at the papers' η = {PAPER_LR:g}; over all η measured "
                f"{verdict([p for _, p in hits])}")
    else:
        head = f"{verdict([p for _, p in hits])} (η = {PAPER_LR:g} not measured)"
    lines.append(f"- Target, B = {tb}, m = {tm}, FedAvg 5 local steps (E = {te}, "
                 f"b_mini = B) → ≥ {TARGET_PCT:.0f}% of batches above {PSNR_OK:.0f} dB: {head} "
                 f"({detail}; max_seconds {max_seconds}).")
    return lines


def main(argv: Sequence[str] | None = None) -> None:
    """Parse the grid, run it and append its section to the results file."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", type=harness.parse_settings,
                        default=harness.parse_settings(DEFAULT_SETTINGS),
                        help=f"comma-separated BxM (default {DEFAULT_SETTINGS})")
    parser.add_argument("--epochs", type=harness.list_of(int, "--epochs"),
                        default=harness.parse_list(DEFAULT_EPOCHS, int, "--epochs"),
                        help=f"local epochs E (default {DEFAULT_EPOCHS})")
    parser.add_argument("--minibatch", type=parse_minibatch,
                        default=parse_minibatch(DEFAULT_MINIBATCH),
                        help=f"mini-batch sizes, B = full batch (default {DEFAULT_MINIBATCH})")
    parser.add_argument("--lrs", type=harness.list_of(float, "--lrs"),
                        default=harness.parse_list(DEFAULT_LRS, float, "--lrs"),
                        help=f"local learning rates η (default {DEFAULT_LRS})")
    parser.add_argument("--update", choices=("fedavg", "gradient"), default="fedavg",
                        help="the attack's `update` option (default fedavg: λ checks that each "
                             "column's zeros are inactive units at W0; gradient: the "
                             "single-step test of a FedSGD gradient)")
    parser.add_argument("--no-fedsgd", action="store_true",
                        help="skip the FedSGD columns (by default the same batches' one-step "
                             "gradients are attacked too, for the seconds beside FedAvg's)")
    harness.add_run_args(parser, RESULTS)
    harness.add_dataset(parser, DATASET, choices=("photos32", "greys32", "hopper32"),
                        help="photos32: crops of the photographs the attack was tuned on "
                             "(default); greys32, hopper32: crops of photographs it was not "
                             "tuned on")
    args = parser.parse_args(argv)
    harness.check_run_args(parser, args)
    if any(e < 1 for e in args.epochs) or any(lr <= 0 for lr in args.lrs):
        parser.error("--epochs must be >= 1 and --lrs > 0")

    section = [
        harness.section_heading(MODULE, argv),
        "",
        harness.machine_line(args.device),
        "",
        (f"Batches from `{args.dataset}`. " if args.dataset != DATASET else "")
        + f"Attack: `fl_attack.invert(..., update={args.update!r})`, otherwise default, "
        f"max_seconds {args.max_seconds} per batch; "
        f"{args.batches} batch(es) per setting (seeds {args.first_seed}.."
        f"{args.first_seed + args.batches - 1}). {load_note('at the start')}",
        "",
        *harness.table_header(FEDAVG_COLUMNS),
    ]
    intro = (
        "Attack on FedAvg client updates (SPEAR App. F, SPEAR++ §5.3). Real CIFAR-shaped photo "
        "crops (`photos32`), first layer of `relu_mlp(3072, m, 3)`; the client runs E local "
        "epochs of SGD (mini-batches of b_mini from a seeded shuffle, learning rate η; `local "
        "steps` = E · ⌈B / b_mini⌉) and sends back float32 weights; the server inverts "
        "(W0 − W_E, b0 − b_E) with weight = W0, bias = b0. Columns: mean matched PSNR (dB) of "
        "the denormalised images; % of batches with mean PSNR > 25 dB (the papers' accuracy); "
        "% certified exact (λ = 1); detected B (range, and how many batches gave the true B); "
        "seconds of `invert` per batch (wall, and the process's CPU time: the attack's cost on "
        "a shared machine); the same for the FedSGD gradient of the same batches and model "
        "(one full-batch step, attacked as a gradient); the setting's wall time (local training "
        "+ FedAvg attacks). Produced by `python -m experiments.bench_fedavg`.\n\n"
        "Papers (SPEAR App. F, SPEAR++ §5.3): SPEAR (TinyImageNet, B = 20, η = 0.01): "
        "E = 1…20 → ≈ 98–109 dB, 97–100% of batches above 25 dB; E = 50 → 90%; b_mini = 5, "
        "E = 20 → 97%. SPEAR++ (CIFAR-10): B = 20, m = 200 → 67.8 dB, 75% (E, b_mini, η lost).")
    harness.start_section(args.out, "FedAvg benchmark", intro, section)
    t0 = time.perf_counter()
    rows = run_fedavg(args.settings, args.epochs, args.minibatch, args.lrs, args.batches,
                      args.first_seed, args.max_seconds, args.device, args.out,
                      update=args.update, fedsgd=not args.no_fedsgd, dataset=args.dataset)
    notes = fedavg_conclusion(rows, args.max_seconds)
    notes.append(f"- Run wall time {time.perf_counter() - t0:.0f} s; {load_note('at the end')}")
    for line in notes:
        print(line)
    harness.append_lines(args.out, *notes)


if __name__ == "__main__":
    main()
