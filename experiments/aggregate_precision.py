"""Secure aggregation, by the arithmetic of the aggregate: float64 sum versus Flower's FedAvg.

A server under secure aggregation sees only the round's aggregate: for N FedSGD clients of B
samples each, one batch of N·B samples. Whether the attack *certifies* that batch depends on how
precisely the aggregate was computed. Flower's FedAvg (``aggregate_arrayrecords``) averages the
clients' float32 weights in float32, and ``W0 − W_avg`` then carries rounding errors of the
weights' magnitude, large next to a small update; the same weights averaged in float64 (as a
SecAgg+ server's dequantization computes) keep the update exact.

For each batch seed, N clients' real FedSGD updates (photo crops, ReLU MLP), inverted as one batch
under both arithmetics; appends a section to ``experiments/results/defences.md`` (``--out`` to
write elsewhere), one row per attack as it finishes.

    .venv/bin/python -m experiments.aggregate_precision [--seeds 3] [--max-seconds 30]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

import numpy as np
import torch

from experiments import harness
from experiments.defences import INTRO, RESULTS_MD, TITLE

MODULE = "experiments.aggregate_precision"
COLUMNS = ("seed", "aggregate computed", "certified", "λ", "noise std (estimate)", "detected B",
           "mean PSNR", "> 25 dB", "> 90 dB", "attack s")
"""The columns of a run's table."""


def aggregates(clients: int, batch: int, width: int, seed: int) -> tuple[dict, dict, dict,
                                                                            torch.Tensor]:
    """Initial weights, the float64 and Flower FedAvg averages, and the clients' samples."""
    from flwr.app import ArrayRecord, MetricRecord, RecordDict
    from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

    from fl_attack.testbed.data import load_images, normalize
    from fl_attack.testbed.models import relu_mlp
    from fl_attack.testbed.simulate import local_update

    images, labels = load_images("photos32", 1000, seed=0)
    idx = torch.randperm(1000, generator=torch.Generator().manual_seed(seed))[:clients * batch]
    model = relu_mlp(3 * 32 * 32, width, 3, 10, seed=0)
    w0 = {k: v.clone() for k, v in model.state_dict().items()}
    states = [local_update(model, normalize(images[i], "photos32"), labels[i],
                           protocol="fedsgd", lr=0.01).state_dict
              for i in idx.reshape(clients, batch)]
    f64 = {k: sum(s[k].double() for s in states) / clients for k in w0}
    flower = aggregate_arrayrecords(
        [RecordDict({"arrays": ArrayRecord(s), "metrics": MetricRecord({"num-examples": batch})})
         for s in states], "num-examples")
    f32 = {k: torch.from_numpy(flower[k].numpy()) for k in w0}
    return w0, f64, f32, images[idx]


def attack(w0: dict, avg: dict, originals: torch.Tensor, max_seconds: float) -> dict:
    """Invert ``W0 − avg`` of the first layer as one batch; certificate and PSNR per sample."""
    from fl_attack import invert
    from fl_attack.testbed.data import denormalize
    from fl_attack.testbed.metrics import score_batch

    wk, bk = list(w0)[:2]
    rec = invert(w0[wk].double() - avg[wk].double(), w0[bk].double() - avg[bk].double(),
                 weight=w0[wk], bias=w0[bk], update="gradient", max_seconds=max_seconds)
    images = denormalize(rec.inputs.float().reshape(-1, 3, 32, 32), "photos32").clamp(0, 1)
    psnr = np.array([float(v) for v in score_batch(images.double(), originals.double(),
                                                   data_range=1.0).psnr])
    return {"exact": rec.exact, "lam": rec.sparsity_match, "B": rec.batch_size,
            "noise": rec.noise_std,
            "mean": float(psnr.mean()), "readable": int((psnr > 25).sum()),
            "exact_psnr": int((psnr > 90).sum()), "seconds": rec.seconds}


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--width", type=int, default=200)
    p.add_argument("--seeds", type=int, default=3, help="batch seeds 0..seeds-1")
    harness.add_max_seconds(p, 30.0)
    harness.add_out(p, RESULTS_MD, "--md")
    args = p.parse_args(argv)
    harness.check_run_args(p, args)
    t0 = time.time()
    harness.start_section(args.out, TITLE, INTRO, [
        harness.section_heading(MODULE, argv) + ": the aggregate's arithmetic",
        "",
        harness.machine_line(),
        "",
        f"{args.clients} FedSGD clients x B = {args.batch_size} photos32 crops (random "
        f"batches, seed per row), ReLU MLP 3 x {args.width}, lr 0.01; the average of "
        "their weights inverted as one batch (first layer, SPEAR++, budget "
        f"{args.max_seconds:g} s).",
        "",
        *harness.table_header(COLUMNS),
    ])
    n = args.clients * args.batch_size
    for seed in range(args.seeds):
        w0, f64, f32, originals = aggregates(args.clients, args.batch_size, args.width, seed)
        for name, avg in (("float64 mean", f64), ("Flower FedAvg (float32)", f32)):
            r = attack(w0, avg, originals, args.max_seconds)
            row = harness.table_row([
                seed, name, "yes" if r["exact"] else "no", f"{r['lam']:.4f}",
                f"{r['noise'] or 0:.2g}", r["B"], f"{r['mean']:.1f}", f"{r['readable']}/{n}",
                f"{r['exact_psnr']}/{n}", f"{r['seconds']:.1f}"])
            print(row, flush=True)
            harness.append_lines(args.out, row)
    harness.append_lines(args.out, "", f"Run wall time {(time.time() - t0) / 60:.1f} min.")
    print(f"appended to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
