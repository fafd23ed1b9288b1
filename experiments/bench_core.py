"""Benchmark of the SPEAR++ core (issue #2): accuracy, PSNR, seconds and memory per (B, m).

Real CIFAR-shaped photo crops, first layer of a 3-hidden-layer ReLU MLP of width m (SPEAR++
protocol), FedSGD, default settings. Writes experiments/results/core.md (appends the rows it ran).

    python -m experiments.bench_core                 # all settings, 20 batches each
    python -m experiments.bench_core --settings 20x200,25x200 --batches 10
"""

from __future__ import annotations

import argparse
import ast
import datetime as dt
import platform
import resource
import statistics
import time
from pathlib import Path

import torch

import fl_attack
from fl_attack.testbed import data, metrics, models

PAPER = {  # SPEAR++ §5.1 (ℓ1, RAdam): PSNR / accuracy %
    (20, 200): (121.0, 95), (25, 200): (96.0, 77), (30, 200): (41.7, 25),
    (65, 1000): (125.2, 100), (100, 1000): (69.3, 41), (150, 1000): (10.4, 0),
    (100, 4000): (124.2, 100), (150, 4000): (120.9, 100), (210, 4000): (45.3, 7),
}
RESULTS = Path(__file__).parent / "results" / "core.md"


def run_setting(B: int, m: int, batches: int, dataset: str, max_seconds: float | None,
                options: dict | None = None, first: int = 0, next_layer: bool = False) -> dict:
    """Invert ``batches`` real batches at (B, m), seeds ``first`` onwards; returns the table
    row's numbers. ``next_layer`` also passes the second layer's gradient (``fl_attack.peel``)."""
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
                               **(options or {}))
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--settings", default=",".join(f"{b}x{m}" for b, m in PAPER))
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--first-batch", type=int, default=0,
                        help="seed of the first batch (to extend an earlier run with new batches)")
    parser.add_argument("--dataset", default="photos32")
    parser.add_argument("--max-seconds", type=float, default=None)
    parser.add_argument("--next-layer", action="store_true",
                        help="also give the attack the second layer's weight gradient "
                             "(next_weight_grad: verified samples are peeled off)")
    parser.add_argument("--option", action="append", default=[], metavar="NAME=VALUE",
                        help="an AttackConfig option passed to every invert call, e.g. "
                             "slice_first=True (repeatable; recorded in the section header)")
    args = parser.parse_args()
    options = {}
    for item in args.option:
        name, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--option takes NAME=VALUE, got {item!r}")
        try:
            options[name] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            options[name] = value
    fl_attack.AttackConfig.from_options(**options)  # unknown names / bad values fail here
    torch.set_num_threads(max(1, torch.get_num_threads()))
    device = "cuda" if torch.cuda.is_available() else f"cpu ({torch.get_num_threads()} threads)"
    cpu = platform.processor() or platform.machine()
    header = (f"\n## {dt.date.today().isoformat()} — {platform.node()}, {cpu}, "
              f"device {device}, dataset {args.dataset}, max_seconds {args.max_seconds}"
              f"{f', batches from seed {args.first_batch}' if args.first_batch else ''}"
              f"{', options ' + repr(options) if options else ''}"
              f"{', next layer (next_weight_grad)' if args.next_layer else ''}\n\n"
              "| B | m | batches | acc % (>90 dB) | certified % (λ=1) | mean PSNR | median s/batch | "
              "peak RSS MiB (process) | paper acc % / PSNR |\n|---|---|---|---|---|---|---|---|---|\n")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    with RESULTS.open("a") as fh:
        if fh.tell() == 0:
            fh.write("# SPEAR++ core benchmark (issue #2)\n\nReal CIFAR-shaped photo crops, "
                     "3-hidden-layer ReLU MLP of width m, FedSGD, first layer, default "
                     "`fl_attack.invert` settings. Produced by `python -m experiments.bench_core`.\n")
        fh.write(header)
    for item in args.settings.split(","):
        B, m = (int(v) for v in item.split("x"))
        res = run_setting(B, m, args.batches, args.dataset, args.max_seconds, options,
                          first=args.first_batch, next_layer=args.next_layer)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        paper = PAPER.get((B, m), (float("nan"), float("nan")))
        row = (f"| {B} | {m} | {res['batches']} | {res['acc']:.0f} | {res['certified']:.0f} | "
               f"{res['psnr']:.1f} | {res['median_s']:.2f} | {peak:.0f} | {paper[1]} / {paper[0]} |")
        print(row, flush=True)
        with RESULTS.open("a") as fh:  # one row at a time: a long run keeps what it finished
            fh.write(row + "\n")


if __name__ == "__main__":
    main()
