"""Benchmark: SPEAR (sampling) vs SPEAR++ (dictionary learning) on the same batches.

The target measured against: "SPEAR++ ≥ 20× faster than SPEAR at B = 20 with equal or better
accuracy".
Both methods attack the SAME real photos32 batches (CIFAR-shaped photo crops) through the first
layer of ``relu_mlp(3072, m, 3, seed=seed)`` (SPEAR++ protocol, as ``bench_core``), FedSGD, on the
same machine, interleaved per batch (same gradient, back to back, the order alternating from batch
to batch), so that a shared, fluctuating machine slows both alike and their ratio stays fair.

SPEAR's expected number of samples grows like ``B 2^(B-1)`` (SPEAR §5.2), so it gets a per-batch
wall-clock budget (``--max-seconds``, also given to SPEAR++) and a sampling cap high enough
(2·10⁹, the paper's) that the budget is what stops it. A batch that runs out of budget is
reported as such: its time is a lower bound, and so is any speed ratio that involves it.
Appends a section per run to ``experiments/results/spear_vs_spearpp.md`` (``--out`` to write
elsewhere): each B's two rows as soon as its batches are done, then the verdict and the
per-batch details.

    python -m experiments.bench_methods --batches 5 --max-seconds 240
    python -m experiments.bench_methods --sizes 20 --batches 10 --max-seconds 600
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Sequence

import torch

import fl_attack
from experiments import harness
from fl_attack.testbed import data, metrics, models

MODULE = "experiments.bench_methods"
METHODS = ("spear", "spear++")
RESULTS = harness.RESULTS_DIR / "spear_vs_spearpp.md"
TARGET_B, TARGET_RATIO = 20, 20.0
TARGET = (f"SPEAR++ ≥ {TARGET_RATIO:.0f}× faster than SPEAR at B = {TARGET_B} with equal or "
          "better accuracy")
"""The target measured against."""
PSNR_OK = 90.0
TITLE = "SPEAR vs SPEAR++"
INTRO = ("SPEAR (sampling) and SPEAR++ (dictionary learning) on the same real batches, "
         "interleaved per batch on the same machine; measured against the target: "
         f"{TARGET}. Produced by `python -m experiments.bench_methods`.")
COLUMNS = ("B", "m", "batches", "method", "median s/batch", "acc % (>90 dB)", "exact % (λ=1)",
           "mean PSNR", "out of budget", "speed ratio SPEAR/SPEAR++")
"""The columns of the per-B table (two rows per B)."""
BATCH_COLUMNS = ("B", "seed", "method", "s", "PSNR", "λ", "directions", "search steps",
                 "out of budget")
"""The columns of the per-batch table."""


def batch_problem(B: int, m: int, seed: int, dataset: str) -> tuple[torch.Tensor, dict]:
    """The client's real batch (images in [0, 1]) and what the server sees: gradient and layer."""
    x, y = data.sample_batch(dataset, B, seed=seed)
    xn = data.normalize(x, dataset)
    model = models.relu_mlp(xn[0].numel(), m, 3, seed=seed)
    G, g = models.first_layer_gradients(model, xn, y)
    lin = models.linear_layers(model)[0]
    return x, {"weight_grad": G, "bias_grad": g, "weight": lin.weight.detach(),
               "bias": lin.bias.detach()}


def run_method(x: torch.Tensor, server: dict, method: str, seed: int, dataset: str,
               max_seconds: float, max_samples: int) -> dict:
    """One attack of one batch: seconds, mean matched PSNR, λ, and whether the budget ran out."""
    t0 = time.perf_counter()
    rec = fl_attack.invert(**server, method=method, seed=seed, max_seconds=max_seconds,
                           max_samples=max_samples)
    seconds = time.perf_counter() - t0
    images = data.denormalize(rec.inputs.float().reshape(-1, *x.shape[1:]), dataset)
    score = metrics.score_batch(images, x)
    lam = rec.sparsity_match
    # the search only stops early when done (λ reaches its stop level) or out of budget
    out_of_budget = rec.seconds >= max_seconds and not rec.exact
    return {"method": method, "seconds": seconds, "psnr": score.mean_psnr,
            "exact": rec.exact, "lam": lam, "found": rec.n_directions, "B": rec.batch_size,
            "rounds": rec.rounds, "out_of_budget": out_of_budget}


def summarise(rows: list[dict]) -> dict:
    """Aggregate one (method, B)'s batches."""
    secs = [r["seconds"] for r in rows]
    psnrs = [r["psnr"] for r in rows]
    return {
        "batches": len(rows),
        "median_s": statistics.median(secs),
        "acc": metrics.batch_accuracy(psnrs, PSNR_OK),
        "exact": 100.0 * sum(r["exact"] for r in rows) / len(rows),
        "psnr": statistics.mean(psnrs),
        "out_of_budget": sum(r["out_of_budget"] for r in rows),
        # a median over times some of which were cut short is itself only a lower bound
        "censored": sum(r["out_of_budget"] for r in rows) > len(rows) // 2,
    }


def ratio_text(spear: dict, spearpp: dict) -> tuple[float, str]:
    """Median SPEAR seconds / median SPEAR++ seconds, marked '≥' when SPEAR's is censored."""
    ratio = spear["median_s"] / spearpp["median_s"]
    mark = "≥ " if spear["censored"] else ""
    if spearpp["censored"] and not spear["censored"]:
        mark = "≤ "  # SPEAR++'s own median hit the budget: the ratio is an upper bound
    return ratio, f"{mark}{ratio:.1f}×"


def verdict(results: dict[int, dict[str, list[dict]]], max_seconds: float) -> str:
    """State the target (:data:`TARGET`) as met, not met, or undecided at this budget, with
    the numbers."""
    if TARGET_B not in results:
        return f"Not measured: B = {TARGET_B} was not part of this run."
    sp, spp = summarise(results[TARGET_B]["spear"]), summarise(results[TARGET_B]["spear++"])
    ratio, text = ratio_text(sp, spp)
    acc_ok = spp["acc"] >= sp["acc"]
    acc = (f"accuracy SPEAR++ {spp['acc']:.0f}% vs SPEAR {sp['acc']:.0f}% "
           f"(exact {spp['exact']:.0f}% vs {sp['exact']:.0f}%)")
    if not acc_ok:
        return f"**Not met** at B = {TARGET_B}: {acc}; speed ratio {text}."
    if ratio >= TARGET_RATIO:
        how = ("a lower bound, since SPEAR ran out of its budget on most batches"
               if sp["censored"] else "measured")
        return (f"**Met** at B = {TARGET_B}: SPEAR++ is {text} faster (median over batches, "
                f"{how}) with {acc}.")
    if sp["censored"]:
        return (f"**Undecided** at B = {TARGET_B}: SPEAR ran out of its {max_seconds:.0f} s "
                f"budget on most batches, so the ratio is only known to be {text} (< "
                f"{TARGET_RATIO:.0f}×); {acc}. A larger budget would tell.")
    return (f"**Not met** at B = {TARGET_B}: SPEAR++ is only {text} faster (target "
            f"{TARGET_RATIO:.0f}×); {acc}.")


def setup_lines(args: argparse.Namespace, load: float) -> list[str]:
    """The section's opening: heading, machine and load, setup, the per-B table's header."""
    return [
        harness.section_heading(MODULE, args.argv),
        "",
        harness.machine_line(),
        "",
        f"Load: 1-min load average {load:.1f} at the start on {os.cpu_count()} cores (the end's "
        "is under the table). On a shared machine absolute seconds are inflated and noisy; the "
        "two methods ran interleaved on each batch (same gradient, back to back, order "
        "alternating), so both saw the same load and the ratio is fair.",
        "",
        f"Setup: real `{args.dataset}` batches (CIFAR-shaped crops of real photographs), "
        f"{args.batches} batches per B (seeds 0..{args.batches - 1}), first layer of "
        f"`relu_mlp(3072, {args.width}, 3, seed=seed)`, FedSGD float32 gradients. Both methods "
        f"with default options, a wall-clock budget of {args.max_seconds:.0f} s per batch "
        f"(`max_seconds`, checked between search steps, so a batch can overrun it a little) "
        f"and SPEAR's sampling cap raised to {args.max_samples:.0e} so that the budget is what "
        "stops it. Accuracy = % of batches with mean matched PSNR > 90 dB; exact = % certified "
        "by λ = 1; *out of budget* = batches stopped by the budget without a certified result. "
        "Speed ratio = median SPEAR seconds / median SPEAR++ seconds (`≥`: SPEAR's median hit "
        "the budget, so its true time and the ratio are larger).",
        "",
        *harness.table_header(COLUMNS),
    ]


def size_rows(B: int, width: int, by_method: dict[str, list[dict]]) -> list[str]:
    """The two table rows (SPEAR, SPEAR++) of one batch size B."""
    sp, spp = summarise(by_method["spear"]), summarise(by_method["spear++"])
    _, text = ratio_text(sp, spp)
    return [harness.table_row([
        B, width, s["batches"], name, f"{s['median_s']:.1f}", f"{s['acc']:.0f}",
        f"{s['exact']:.0f}", f"{s['psnr']:.1f}", f"{s['out_of_budget']}/{s['batches']}",
        text if name == "SPEAR++" else ""])
        for name, s in (("SPEAR", sp), ("SPEAR++", spp))]


def closing_lines(args: argparse.Namespace, results: dict[int, dict[str, list[dict]]],
                  elapsed: float, load: float) -> list[str]:
    """The section's end: the verdict, the per-batch details, the load and wall time."""
    lines = ["", f"Target — {TARGET}: " + verdict(results, args.max_seconds), "",
             "<details><summary>Per batch</summary>", "", *harness.table_header(BATCH_COLUMNS)]
    for B, by_method in results.items():
        for seed in range(len(by_method["spear"])):
            for method in METHODS:
                r = by_method[method][seed]
                lam = f"{r['lam']:.4f}" if r["lam"] is not None else "—"
                lines.append(harness.table_row([
                    B, seed, method, f"{r['seconds']:.1f}", f"{r['psnr']:.1f}", lam,
                    f"{r['found']}/{r['B']}", r["rounds"], "yes" if r["out_of_budget"] else ""]))
    lines += ["", "</details>", "",
              f"1-min load average at the end {load:.1f}; run wall time {elapsed / 60:.1f} min."]
    return lines


def main(argv: Sequence[str] | None = None) -> None:
    """Run the comparison and append its section to the results file (see the module
    docstring)."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=harness.list_of(int, "--sizes"), default="10,15,20,25",
                        help="batch sizes B, comma-separated")
    parser.add_argument("--width", type=int, default=200, help="layer width m")
    harness.add_batches(parser, 5, help="batches per B (default 5)")
    harness.add_max_seconds(parser, 240.0, help="per-batch wall-clock budget of each method "
                                                "(default 240)")
    parser.add_argument("--max-samples", type=int, default=2_000_000_000,
                        help="SPEAR's sampling cap (the paper's 2e9)")
    harness.add_dataset(parser)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1 is far more stable on a shared 2-core machine)")
    harness.add_out(parser, RESULTS)
    args = parser.parse_args(argv)
    harness.check_run_args(parser, args)
    args.argv = argv
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    results: dict[int, dict[str, list[dict]]] = {}
    x, server = batch_problem(4, args.width, 10_000, args.dataset)
    for method in METHODS:  # one-time initialisation (~6 s for SPEAR++'s optimiser) off the clock
        run_method(x, server, method, 0, args.dataset, args.max_seconds, args.max_samples)
    harness.start_section(args.out, TITLE, INTRO, setup_lines(args, os.getloadavg()[0]))
    for B in args.sizes:
        results[B] = {m: [] for m in METHODS}
        for seed in range(args.batches):
            x, server = batch_problem(B, args.width, seed, args.dataset)
            order = METHODS if seed % 2 == 0 else METHODS[::-1]
            for method in order:
                r = run_method(x, server, method, seed, args.dataset, args.max_seconds,
                               args.max_samples)
                results[B][method].append(r)
                lam = f"{r['lam']:.4f}" if r["lam"] is not None else "-"
                print(f"B={B} batch {seed} {method:8s} {r['seconds']:7.1f}s  PSNR "
                      f"{r['psnr']:6.1f}  λ={lam}  {r['found']}/{r['B']}  steps {r['rounds']}"
                      f"{'  OUT OF BUDGET' if r['out_of_budget'] else ''}", flush=True)
        # append after every B: a long run keeps what it finished
        harness.append_lines(args.out, *size_rows(B, args.width, results[B]))
    harness.append_lines(args.out, *closing_lines(args, results, time.perf_counter() - start,
                                                  os.getloadavg()[0]))
    print(verdict(results, args.max_seconds))
    print(f"appended to {args.out}")


if __name__ == "__main__":
    main()
