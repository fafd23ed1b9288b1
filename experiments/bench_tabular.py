"""Benchmark: SPEAR / SPEAR++ on the real UCI Adult table, next to SPEAR's paper.

SPEAR's tabular protocol: batches of B = 16 Adult rows (6 standardised continuous features, 8
one-hot categorical ones), the first layer of a 6-layer ReLU MLP of width 200, FedSGD gradients.
Reported per method: discrete accuracy (argmax category right, after optimally matching rows),
continuous MAE in original units (``fl_attack.testbed.tabular.score_tabular``: mean over the 6 continuous
features of the absolute error in the feature's own unit — years, dollars, fnlwgt, hours), the
share of batches certified exact (λ = 1) and the seconds per batch. Appends a section per run
(machine, date, command) to ``experiments/results/tabular.md`` (``--out`` to write elsewhere)
when the run is done.

    python -m experiments.bench_tabular --batches 20
    python -m experiments.bench_tabular --batches 20 --methods spear++ --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence

import torch

import fl_attack
from experiments import harness
from fl_attack.testbed import models, tabular

MODULE = "experiments.bench_tabular"
PAPER = {"discrete_acc": 100.0, "mae": 20.4, "minutes": 0.4}  # SPEAR §6.1, Adult B = 16
RESULTS = harness.RESULTS_DIR / "tabular.md"
TITLE = "SPEAR / SPEAR++ on UCI Adult"
INTRO = ("SPEAR's tabular protocol on the real UCI Adult table, next to SPEAR's paper (§6.1). "
         "Produced by `python -m experiments.bench_tabular`.")
COLUMNS = ("method", "batches", "discrete acc %", "batches with 100% discrete",
           "continuous MAE (mean / median / max)", "exact % (λ=1)", "median s/batch",
           "max s/batch")
"""The columns of the summary table."""
BATCH_COLUMNS = ("seed", "method", "s", "discrete acc %", "continuous MAE", "λ", "directions")
"""The columns of the per-batch table."""


def attack_batch(data: tabular.AdultData, seed: int, method: str, batch_size: int, width: int,
                 hidden: int, max_seconds: float | None) -> dict:
    """Invert one seeded Adult batch with ``method``; the batch's scores and timing."""
    x, y = tabular.sample_adult_batch(batch_size, seed=seed)
    model = models.relu_mlp(data.num_features, width, hidden, num_classes=2, seed=seed)
    G, g = models.first_layer_gradients(model, x, y)
    lin = models.linear_layers(model)[0]
    t0 = time.perf_counter()
    rec = fl_attack.invert(G, g, weight=lin.weight.detach(), bias=lin.bias.detach(),
                           method=method, seed=seed, max_seconds=max_seconds)
    seconds = time.perf_counter() - t0
    if rec.inputs.shape[0] == batch_size:
        score = tabular.score_tabular(rec.inputs.float(), x, data)
        acc, mae, feat = score.discrete_accuracy, score.continuous_mae, score.feature_mae
    else:  # B misread: count the batch as a failure rather than crash
        acc, mae, feat = 0.0, float("nan"), {}
    return {"seed": seed, "method": method, "seconds": seconds, "acc": 100.0 * acc, "mae": mae,
            "feature_mae": feat, "exact": rec.exact, "lam": rec.sparsity_match,
            "found": rec.n_directions, "B": rec.batch_size}


def summarise(rows: list[dict]) -> dict:
    """Aggregate one method's per-batch rows into the table's numbers."""
    maes = [r["mae"] for r in rows]
    return {
        "batches": len(rows),
        "acc": statistics.mean(r["acc"] for r in rows),
        "perfect": 100.0 * sum(r["acc"] == 100.0 for r in rows) / len(rows),
        "mae": statistics.mean(maes),
        "median_mae": statistics.median(maes),
        "max_mae": max(maes),
        "exact": 100.0 * sum(r["exact"] for r in rows) / len(rows),
        "median_s": statistics.median(r["seconds"] for r in rows),
        "max_s": max(r["seconds"] for r in rows),
    }


def report_lines(args: argparse.Namespace, results: dict[str, list[dict]],
                 continuous: list[str], elapsed: float) -> list[str]:
    """The run's section: heading, machine, setup, summary next to the paper, details."""
    lines = [
        harness.section_heading(MODULE, args.argv),
        "",
        harness.machine_line(),
        "",
        f"Setup: real UCI Adult training rows (`fl_attack.testbed.tabular`, 104 encoded columns), "
        f"{args.batches} batches of B = {args.batch_size} (seeds 0..{args.batches - 1}; the "
        f"same batches and models for every method), first layer of `relu_mlp(104, "
        f"{args.width}, {args.hidden}, num_classes=2)` (SPEAR's 6-layer MLP of width 200), "
        "FedSGD float32 gradients of the mean cross-entropy, `fl_attack.invert(G, g, weight=W, "
        f"bias=b, method=..., max_seconds={args.max_seconds})` with default options.",
        "",
        "Metrics (`fl_attack.testbed.tabular.score_tabular`, rows matched to the originals by the "
        "Hungarian algorithm): *discrete acc* = % of (row, categorical feature) pairs whose "
        "argmax category is right, averaged over batches; *continuous MAE* = mean absolute "
        "error in original units, averaged over the 6 continuous features (age, fnlwgt, "
        "education-num, capital-gain, capital-loss, hours-per-week), then over batches; "
        "*exact* = % of batches certified by λ = 1.",
        "",
        *harness.table_header(COLUMNS),
    ]
    for method, rows in results.items():
        s = summarise(rows)
        lines.append(harness.table_row([
            method, s["batches"], f"{s['acc']:.2f}", f"{s['perfect']:.0f}%",
            f"{s['mae']:.3g} / {s['median_mae']:.3g} / {s['max_mae']:.3g}", f"{s['exact']:.0f}",
            f"{s['median_s']:.2f}", f"{s['max_s']:.2f}"]))
    lines.append(harness.table_row([
        "SPEAR paper (GPU)", "—", f"{PAPER['discrete_acc']:.0f}", "—", PAPER["mae"], "—",
        f"{PAPER['minutes'] * 60:.0f} (0.4 min)", "—"]))
    lines += ["", "Mean absolute error per continuous feature (original units, mean over "
              "batches):", "", *harness.table_header(["method", *continuous])]
    for method, rows in results.items():
        cells = []
        for f in continuous:
            vals = [r["feature_mae"][f] for r in rows if f in r["feature_mae"]]
            cells.append(f"{statistics.mean(vals):.2g}" if vals else "—")
        lines.append(harness.table_row([method, *cells]))
    lines += ["", "<details><summary>Per batch</summary>", "",
              *harness.table_header(BATCH_COLUMNS)]
    for method, rows in results.items():
        for r in rows:
            lam = f"{r['lam']:.4f}" if r["lam"] is not None else "—"
            lines.append(harness.table_row([
                r["seed"], method, f"{r['seconds']:.2f}", f"{r['acc']:.1f}", f"{r['mae']:.3g}",
                lam, f"{r['found']}/{r['B']}"]))
    lines += ["", "</details>", "", f"Run wall time {elapsed / 60:.1f} min."]
    return lines


def main(argv: Sequence[str] | None = None) -> None:
    """Run the benchmark and append its section to the results file (see the module
    docstring)."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    harness.add_batches(parser, 20)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--width", type=int, default=200)
    parser.add_argument("--hidden", type=int, default=5,
                        help="hidden layers (5 + the output layer = SPEAR's 6-layer MLP)")
    parser.add_argument("--methods", default="spear++,spear")
    harness.add_max_seconds(parser, 300.0)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1 is far more stable on a shared 2-core machine)")
    harness.add_out(parser, RESULTS)
    args = parser.parse_args(argv)
    harness.check_run_args(parser, args)
    args.argv = argv
    torch.set_num_threads(args.threads)
    data = tabular.load_adult("train")
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    results: dict[str, list[dict]] = {m: [] for m in methods}
    for method in methods:  # one-time initialisation (~6 s for SPEAR++'s optimiser) off the clock
        attack_batch(data, 10_000, method, 4, args.width, args.hidden, args.max_seconds)
    start = time.perf_counter()
    for seed in range(args.batches):
        for method in methods:
            r = attack_batch(data, seed, method, args.batch_size, args.width, args.hidden,
                             args.max_seconds)
            results[method].append(r)
            print(f"batch {seed} {method:8s} acc {r['acc']:6.2f}%  MAE {r['mae']:.3g}  "
                  f"exact {r['exact']}  {r['found']}/{r['B']}  {r['seconds']:.2f}s", flush=True)
    harness.start_section(args.out, TITLE, INTRO,
                          report_lines(args, results, data.continuous,
                                       time.perf_counter() - start))
    for method, rows in results.items():
        print(method, summarise(rows), flush=True)
    print(f"appended to {args.out}")


if __name__ == "__main__":
    main()
