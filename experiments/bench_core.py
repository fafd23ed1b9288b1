"""Benchmark of the SPEAR++ core: accuracy, PSNR, seconds and memory per (B, m).

Real CIFAR-shaped photo crops, first layer of a 3-hidden-layer ReLU MLP of width m (SPEAR++
protocol), FedSGD, default settings, next to the papers' numbers (SPEAR++ §5.1). Appends a
section per run to experiments/results/core.md (``--out`` to write elsewhere), one row per
setting as it finishes.

    python -m experiments.bench_core                 # all settings, 20 batches each
    python -m experiments.bench_core --settings 20x200,25x200 --batches 10
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
from collections.abc import Sequence
from typing import Any

import fl_attack
from experiments import harness
from fl_attack.testbed import data, metrics, models

MODULE = "experiments.bench_core"
PAPER = {  # SPEAR++ §5.1 (ℓ1, RAdam): PSNR / accuracy %
    (20, 200): (121.0, 95), (25, 200): (96.0, 77), (30, 200): (41.7, 25),
    (65, 1000): (125.2, 100), (100, 1000): (69.3, 41), (150, 1000): (10.4, 0),
    (100, 4000): (124.2, 100), (150, 4000): (120.9, 100), (210, 4000): (45.3, 7),
}
RESULTS = harness.RESULTS_DIR / "core.md"
COLUMNS = ("B", "m", "batches", "acc % (>90 dB)", "certified % (λ=1)", "mean PSNR",
           "median s/batch", "peak RSS MiB (process)", "paper acc % / PSNR")
"""The columns of a run's table: the same in every section of core.md, so new rows fit."""
INTRO = ("Real CIFAR-shaped photo crops, 3-hidden-layer ReLU MLP of width m, FedSGD, first layer, "
         "default `fl_attack.invert` settings. Produced by `python -m experiments.bench_core`.")


def run_setting(B: int, m: int, batches: int, dataset: str, max_seconds: float | None,
                options: dict[str, Any] | None = None, first: int = 0, next_layer: bool = False,
                device: str | None = None) -> dict[str, float]:
    """Invert ``batches`` real batches at (B, m), seeds ``first`` onwards.

    Parameters
    ----------
    B, m : int
        Batch size and width of the attacked layer.
    batches : int
        How many batches (consecutive seeds).
    dataset : str
        Where the batches come from (``fl_attack.testbed.data``).
    max_seconds : float, optional
        The attack's per-batch budget.
    options : dict, optional
        Further ``AttackConfig`` options for every ``invert`` call.
    first : int, default 0
        Seed of the first batch.
    next_layer : bool, default False
        Also pass the second layer's gradient (``next_weight_grad``: verified samples are
        peeled off).
    device : str, optional
        The attack's device (None: CUDA when available).

    Returns
    -------
    dict
        The table row's numbers: ``acc``, ``psnr``, ``certified``, ``median_s``, ``batches``.
    """
    psnrs, secs, exact = [], [], 0
    for seed in range(first, first + batches):
        x, y = data.sample_batch(dataset, B, seed=seed)
        xn = data.normalize(x, dataset)
        model = models.relu_mlp(xn[0].numel(), m, 3, seed=seed)
        G, g = models.first_layer_gradients(model, xn, y)
        G2 = models.layer_gradients(model, xn, y, 1)[0] if next_layer else None
        lin = models.linear_layers(model)[0]
        t0 = time.perf_counter()
        rec = fl_attack.invert(G, g, weight=lin.weight.detach(), bias=lin.bias.detach(),
                               seed=seed, max_seconds=max_seconds, next_weight_grad=G2,
                               device=device, **(options or {}))
        secs.append(time.perf_counter() - t0)
        images = data.denormalize(rec.inputs.float().reshape(-1, *x.shape[1:]), dataset)
        score = metrics.score_batch(images, x)
        psnrs.append(score.mean_psnr)
        exact += int(rec.exact)
        print(f"  B={B} m={m} batch {seed}: PSNR {score.mean_psnr:6.1f}  λ={rec.sparsity_match:.4f}"
              f"  found {rec.n_directions}/{rec.batch_size}  {secs[-1]:.1f}s"
              f"  {'certified' if rec.exact else 'not certified'}"
              + ("  (budget spent)" if rec.budget_exhausted else "")
              + (f"  ({rec.chance_zeros} chance zeros)" if rec.chance_zeros else "")
              + (f"  (peeled {rec.peeled})" if next_layer else ""), flush=True)
    return {
        "acc": metrics.batch_accuracy(psnrs, 90.0), "psnr": statistics.mean(psnrs),
        "certified": 100.0 * exact / batches, "median_s": statistics.median(secs),
        "batches": batches,
    }


def main(argv: Sequence[str] | None = None) -> None:
    """Run every setting and append its row to the results file as it finishes."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", type=harness.parse_settings,
                        default=",".join(f"{b}x{m}" for b, m in PAPER),
                        help="comma-separated BxM (default: every setting of the paper)")
    harness.add_batches(parser, 20)
    harness.add_first_seed(parser, "--first-batch")
    harness.add_dataset(parser)
    harness.add_max_seconds(parser)
    harness.add_device(parser)
    parser.add_argument("--next-layer", action="store_true",
                        help="also give the attack the second layer's weight gradient "
                             "(next_weight_grad: verified samples are peeled off)")
    parser.add_argument("--option", action="append", default=[], metavar="NAME=VALUE",
                        help="an AttackConfig option passed to every invert call, e.g. "
                             "slice_first=True (repeatable; recorded in the section header)")
    harness.add_out(parser, RESULTS)
    args = parser.parse_args(argv)
    harness.check_run_args(parser, args)
    options = harness.parse_assignments(parser, args.option, "--option", harness.python_value)
    fl_attack.AttackConfig.from_options(**options)  # unknown names / bad values fail here
    setup = (f"Dataset {args.dataset}, max_seconds {args.max_seconds}"
             f"{f', batches from seed {args.first_seed}' if args.first_seed else ''}"
             f"{', options ' + repr(options) if options else ''}"
             f"{', next layer (next_weight_grad)' if args.next_layer else ''}.")
    harness.start_section(args.out, "SPEAR++ core benchmark", INTRO, [
        harness.section_heading(MODULE, argv), "", harness.machine_line(args.device), "",
        setup, "", *harness.table_header(COLUMNS)])
    for B, m in args.settings:
        res = run_setting(B, m, args.batches, args.dataset, args.max_seconds, options,
                          first=args.first_seed, next_layer=args.next_layer, device=args.device)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        paper = PAPER.get((B, m), (float("nan"), float("nan")))
        row = harness.table_row([
            B, m, res["batches"], f"{res['acc']:.0f}", f"{res['certified']:.0f}",
            f"{res['psnr']:.1f}", f"{res['median_s']:.2f}", f"{peak:.0f}",
            f"{paper[1]} / {paper[0]}"])
        print(row, flush=True)
        harness.append_lines(args.out, row)  # one row at a time: a long run keeps what it did


if __name__ == "__main__":
    main()
