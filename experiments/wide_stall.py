"""Which samples a stalled wide search finds, and what the batches it stalls on look like.

At B = 210, m = 4000 with the attacked layer alone the search finds part of the batch's ∂L/∂Z
columns and stalls (``experiments/results/core.md``). This study measures, per batch, what the
batch is like (the statistics a reader might suspect: texture, how alike the crops are, the
ReLU sparsity of ∂L/∂Z) and, with ``--max-seconds``, runs the attack and says *which* samples'
columns it found: each true column is matched to the columns the search returned
(|cos| > 0.999), and found and missing samples are compared by the norm of their input and by
their nearest neighbour in the batch (the largest Jaccard overlap of two samples' sets of
inactive units).

The search's columns are read by wrapping ``fl_attack.solver.loop.search`` for the run (the
attack is not changed). Appends a section to ``experiments/results/core.md`` (``--out`` to write
elsewhere).

    python -m experiments.wide_stall --datasets photos32,mixed32 --first-seed 110 --batches 1
    python -m experiments.wide_stall --datasets photos32 --first-seed 110 --max-seconds 600
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

import fl_attack
from experiments import harness
from experiments.bench_core import INTRO, RESULTS
from fl_attack.solver import loop
from fl_attack.testbed import data, metrics, models, photos

MODULE = "experiments.wide_stall"
COLUMNS = ("source", "seed", "texture", "mean cos of two inputs", "inactive share of ∂L/∂Z",
           "nearest neighbour's Jaccard: median", "found columns", "mean PSNR", "s",
           "found by input-norm quartile (low → high)", "found by neighbour's Jaccard quartile")


def batch(dataset: str, B: int, m: int, seed: int) -> dict[str, Any]:
    """One batch, its model, its true ∂L/∂Z (B, m) and the per-sample statistics."""
    x, y = data.sample_batch(dataset, B, seed=seed)
    xn = data.normalize(x, dataset)
    model = models.relu_mlp(xn[0].numel(), m, 3, seed=seed)
    lin = models.linear_layers(model)[0]
    seen: dict[str, torch.Tensor] = {}

    def keep(_mod: torch.nn.Module, _args: object, out: torch.Tensor) -> None:
        out.retain_grad()
        seen["z"] = out

    hook = lin.register_forward_hook(keep)
    torch.nn.functional.cross_entropy(model(xn), y).backward()
    hook.remove()
    D = seen["z"].grad.double()
    X = xn.flatten(1).double()
    off = ~torch.eye(B, dtype=torch.bool)
    unit = X / X.norm(dim=1, keepdim=True)
    zero = (D == 0).double()
    both = zero @ zero.T
    jac = both / (zero.sum(1)[:, None] + zero.sum(1)[None, :] - both)
    return {"x": x, "xn": xn, "y": y, "model": model, "D": D,
            "texture": float(photos.texture(x)), "cos": float((unit @ unit.T)[off].mean()),
            "inactive": float(zero.mean()), "nn_jaccard": jac.masked_fill(~off, 0).max(1).values,
            "norm": X.norm(dim=1)}


def attack(b: dict[str, Any], dataset: str, seed: int, max_seconds: float) -> dict[str, Any]:
    """Run the attack on the batch; which samples' columns the search returned."""
    found: dict[str, torch.Tensor] = {}
    search = loop.search

    def recording(ctx: Any, state: Any, pool: Any) -> tuple[torch.Tensor, int]:
        Q, n = search(ctx, state, pool)
        found["columns"] = (ctx.dec.L.double() @ Q[:, :n].double()).cpu()
        return Q, n

    G, g = models.first_layer_gradients(b["model"], b["xn"], b["y"])
    lin = models.linear_layers(b["model"])[0]
    loop.search = recording
    try:
        t0 = time.perf_counter()
        rec = fl_attack.invert(G, g, weight=lin.weight.detach(), bias=lin.bias.detach(),
                               seed=seed, max_seconds=max_seconds)
        secs = time.perf_counter() - t0
    finally:
        loop.search = search
    cols = found["columns"]
    if cols.shape[0] != b["D"].shape[1]:
        raise RuntimeError("the search ran on the input side; this study reads ∂L/∂Z columns")
    true = b["D"].T / b["D"].T.norm(dim=0)
    hit = ((true.T @ (cols / cols.norm(dim=0))).abs().max(1).values > 0.999
           if cols.shape[1] else torch.zeros(true.shape[1], dtype=torch.bool))
    images = data.denormalize(rec.inputs.float().reshape(-1, *b["x"].shape[1:]), dataset)
    return {"hit": hit, "psnr": metrics.score_batch(images, b["x"]).mean_psnr, "seconds": secs,
            "exact": rec.exact, "n_found": cols.shape[1]}


def by_quartile(values: torch.Tensor, hit: torch.Tensor) -> str:
    """``found/all`` in each quartile of ``values``, lowest first."""
    cuts = torch.quantile(values.double(), torch.tensor([0.25, 0.5, 0.75], dtype=torch.float64))
    q = torch.bucketize(values.double(), cuts)
    return ", ".join(f"{int(hit[q == i].sum())}/{int((q == i).sum())}" for i in range(4))


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--datasets", type=harness.list_of(str, "dataset"), default=["photos32"])
    p.add_argument("--batch-size", type=int, default=210)
    p.add_argument("--width", type=int, default=4000)
    harness.add_batches(p, 1)
    harness.add_first_seed(p)
    harness.add_max_seconds(p, None)
    harness.add_out(p, RESULTS)
    args = p.parse_args(argv)
    harness.check_run_args(p, args)
    t0 = time.time()
    harness.start_section(args.out, "SPEAR++ core benchmark", INTRO, [
        harness.section_heading(MODULE, argv) + ": the wide batches' statistics"
        + (" and which samples the search found" if args.max_seconds else ""),
        "",
        harness.machine_line(),
        "",
        f"B = {args.batch_size}, m = {args.width}, first layer of `relu_mlp(n, m, 3)`, FedSGD, "
        "the attacked layer alone" + (f", budget {args.max_seconds:g} s" if args.max_seconds
                                      else "; statistics only, no attack") + ".",
        "",
        *harness.table_header(COLUMNS),
    ])
    for dataset in args.datasets:
        for seed in range(args.first_seed, args.first_seed + args.batches):
            b = batch(dataset, args.batch_size, args.width, seed)
            cells: list[object] = [f"`{dataset}`", seed, f"{b['texture']:.3f}", f"{b['cos']:.3f}",
                                   f"{b['inactive']:.3f}",
                                   f"{statistics.median(b['nn_jaccard'].tolist()):.3f}"]
            if args.max_seconds:
                r = attack(b, dataset, seed, args.max_seconds)
                cells += [f"{int(r['hit'].sum())}/{args.batch_size}", f"{r['psnr']:.1f}",
                          f"{r['seconds']:.0f}", by_quartile(b["norm"], r["hit"]),
                          by_quartile(b["nn_jaccard"], r["hit"])]
            else:
                cells += ["—"] * 5
            line = harness.table_row(cells)
            print(line, flush=True)
            harness.append_lines(args.out, line)
    harness.append_lines(args.out, "", f"Run wall time {time.time() - t0:.0f} s.")
    print(f"appended to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
