"""Benchmark: inverting deeper layers (SPEAR §3.2, §6.2) through either sparse factor.

A hidden layer of a ReLU MLP sits between two ReLUs, so both factors of its weight gradient
``G = Σ_i g_i x_iᵀ`` are sparse: the output gradients g_i = ∂L/∂z_i (``sparse="output"``, the
SPEAR(++) attack) and the inputs x_i, which are the previous ReLU's outputs (``sparse="input"``,
:mod:`fl_attack.input_layer`). ``"auto"`` tries the output side and, if it is not certified, the
input side. The first layer sees normalised pixels (dense, signed): only the output side applies.

Protocol: real CIFAR-shaped photo crops (``data.sample_batch("photos32", B, seed=s)``), one
``relu_mlp(3072, width, depth, seed=s)`` per batch seed (default: SPEAR's 6-layer MLP, i.e. 5
hidden layers, of width 200; SPEAR's deeper-layer experiment used width 400), FedSGD float32
gradients of the mean cross-entropy of every attacked layer of the *same* batch and model,
``fl_attack.invert(G, g, weight=W, bias=b, sparse=side, seed=s, max_seconds=...)`` with default
options otherwise. Each reconstruction is scored against
the layer's true inputs (``models.layer_inputs``). Writes ``experiments/results/layers.md``
(overwritten: one run per file, with its machine, date and command).

    python -m experiments.bench_layers --batches 5 --max-seconds 60
    python -m experiments.bench_layers --batches 5 --sizes 10,20 --layers 1,2,3 --widths 200,400
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

import fl_attack
from experiments.common import cpu_name
from fl_attack.testbed import data, metrics, models

RESULTS = Path(__file__).parent / "results" / "layers.md"
SIDES = ("output", "input", "auto")
#: A recovered input counts as right below this relative error ‖x̂ − x‖/‖x‖ (float32 gradients
#: give ~1e-7..1e-5 on exact recoveries; a wrong or mixed row is off by 0.1 and more).
REL_TOL = 1e-3
PAPER = ("SPEAR (paper, §6.2, Table 4): attacks layers 1-5 of a 6-layer ReLU MLP of width 400 "
         "(output side, i.e. sparse ∂L/∂Z), noting that deeper layers are slower at "
         "initialisation because the biases dominate; its headline CIFAR-10 number, on the first "
         "layer of a 6-layer width-200 MLP at B = 20, is 99% of batches exact (PSNR 106.6), "
         "1.7 min per batch on a GPU; no per-layer numbers at this width to compare with.")


def code_version() -> str:
    """The commit the attack code comes from, and whether ``fl_attack/`` had local changes."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, check=True,
                              capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "fl_attack"], cwd=root,
                               check=True, capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    return f"commit {head}" + (" with uncommitted changes in fl_attack/" if dirty else "")


def rel_errors(inputs: torch.Tensor, X: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per true input ``x`` (rows of ``X``): relative errors of the recovered rows.

    Returns ``(matched, nearest)``: after the optimal one-to-one assignment
    (:func:`fl_attack.testbed.metrics.match`, inf where a true input got no row), and to the closest
    recovered row. The second counts the right samples of a partial result, where the assignment
    may pair a spurious row with a true input and shift the displaced rows along.
    """
    R = inputs.double().reshape(inputs.shape[0], -1)
    norm = X.norm(dim=1).clamp_min(1e-300)
    perm = metrics.match(R, X)
    matched = (R[perm.clamp_min(0)] - X).norm(dim=1) / norm
    matched[perm < 0] = float("inf")
    nearest = torch.cdist(X, R).min(dim=1).values / norm if R.shape[0] else torch.full_like(norm,
                                                                                        torch.inf)
    return matched, nearest


def attack_layer(G: torch.Tensor, g: torch.Tensor, W: torch.Tensor, b: torch.Tensor,
                 X: torch.Tensor, side: str, seed: int, max_seconds: float | None) -> dict:
    """Invert one layer's gradient from ``side``; the result's certificate, scores and time."""
    t0 = time.perf_counter()
    try:
        rec = fl_attack.invert(G, g, weight=W, bias=b, sparse=side, seed=seed,
                               max_seconds=max_seconds)
    except (ValueError, RuntimeError) as exc:  # a failure of the attack is a failed batch
        return {"error": f"{type(exc).__name__}: {exc}"[:120], "seconds": time.perf_counter() - t0,
                "exact": False, "all_right": False, "right": 0, "lam": None, "found": 0,
                "used": side, "false_cert": False, "max_rel": float("inf")}
    seconds = time.perf_counter() - t0
    matched, nearest = rel_errors(rec.inputs, X)
    all_right = bool(matched.max() < REL_TOL)
    used = rec.config.sparse if rec.config is not None else side
    return {"seconds": seconds, "exact": rec.exact, "all_right": all_right,
            "right": int((nearest < REL_TOL).sum()), "lam": rec.sparsity_match,
            "found": rec.n_directions, "used": used, "false_cert": rec.exact and not all_right,
            "max_rel": float(matched.max()), "error": None}


def shared_zero_fraction(mask: torch.Tensor) -> float:
    """Median over samples of the share of a sample's zeros that its closest partner also has.

    ``mask`` (B, k) marks zero entries. Near 1, the samples' ReLU patterns nearly coincide: a
    difference of two samples is then almost as sparse as a sample, which is what makes deep
    layers at initialisation hard for a sparsity search (SPEAR §6.2: outputs of later layers are "dominated by their bias terms").
    """
    Z = mask.double()
    shared = Z @ Z.T
    shared.fill_diagonal_(0.0)
    return float((shared.max(dim=1).values / Z.sum(dim=1).clamp_min(1.0)).median())


def sides_for(layer: int) -> tuple[str, ...]:
    """Sides that apply to ``layer`` (1-based): the first layer's inputs are not ReLU outputs."""
    return ("output",) if layer == 1 else SIDES


def summarise(rows: list[dict], B: int) -> dict:
    """Aggregate one cell's per-batch rows into the table's numbers."""
    n = len(rows)
    return {
        "batches": n,
        "exact": 100.0 * sum(r["exact"] for r in rows) / n,
        "all_right": 100.0 * sum(r["all_right"] for r in rows) / n,
        "samples": 100.0 * sum(r["right"] for r in rows) / (n * B),
        "false_cert": sum(r["false_cert"] for r in rows),
        "median_s": statistics.median(r["seconds"] for r in rows),
        "max_s": max(r["seconds"] for r in rows),
        "input_used": sum(r["used"] == "input" for r in rows),
        "errors": sum(r["error"] is not None for r in rows),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=5, help="batch seeds per cell (0..N-1)")
    parser.add_argument("--sizes", default="20", help="batch sizes B, comma-separated")
    parser.add_argument("--layers", default="1,2,3,4,5",
                        help="1-based Linear layers to attack (hidden ones: 1..depth)")
    parser.add_argument("--sides", default=",".join(SIDES))
    parser.add_argument("--widths", default="200", help="MLP widths, comma-separated (SPEAR: 400)")
    parser.add_argument("--depth", type=int, default=5, help="hidden layers (SPEAR: 5)")
    parser.add_argument("--dataset", default="photos32")
    parser.add_argument("--max-seconds", type=float, default=60.0,
                        help="wall-clock budget per attack (0: none)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: shared CPU)")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sizes = [int(v) for v in args.sizes.split(",")]
    widths = [int(v) for v in args.widths.split(",")]
    layers = [int(v) for v in args.layers.split(",")]
    if any(not 1 <= k <= args.depth for k in layers):
        parser.error(f"--layers must lie in 1..{args.depth} (hidden layers followed by a ReLU)")
    sides = [s for s in args.sides.split(",") if s]
    if any(s not in SIDES for s in sides):
        parser.error(f"--sides must be among {SIDES}")
    budget = args.max_seconds or None
    command = "python -m experiments.bench_layers " + shlex.join(sys.argv[1:])
    version = code_version()  # the attack's modules are all imported by now
    started = dt.datetime.now()
    t_all = time.perf_counter()

    rows: dict[tuple[int, int, int, str], list[dict]] = {}
    patterns: dict[tuple[int, int, int], list[tuple[float, float, float]]] = {}
    per_batch: list[str] = []
    for width in widths:
        for B in sizes:
            for seed in range(args.batches):
                x, y = data.sample_batch(args.dataset, B, seed=seed)
                xn = data.normalize(x, args.dataset)
                model = models.relu_mlp(xn[0].numel(), width, args.depth, seed=seed)
                for layer in layers:
                    G, g = models.layer_gradients(model, xn, y, layer=layer - 1)
                    lin = models.linear_layers(model)[layer - 1]
                    W, b = lin.weight.detach(), lin.bias.detach()
                    X = models.layer_inputs(model, xn, layer=layer - 1).double()
                    Z = X @ W.double().T + b.double()
                    stats = (float((X == 0).double().mean()), shared_zero_fraction(X == 0),
                             shared_zero_fraction(Z <= 0))
                    patterns.setdefault((width, B, layer), []).append(stats)
                    for side in (s for s in sides_for(layer) if s in sides):
                        r = attack_layer(G, g, W, b, X, side, seed, budget)
                        rows.setdefault((width, B, layer, side), []).append(r)
                        lam = "-" if r["lam"] is None else f"{r['lam']:.4f}"
                        line = (f"| {width} | {B} | {layer} | {side} | {seed} | {r['used']} | "
                                f"{r['exact']} | {lam} | {r['found']}/{B} | {r['right']}/{B} | "
                                f"{r['max_rel']:.1e} | {r['seconds']:.2f} | {r['error'] or ''} |")
                        per_batch.append(line)
                        print(line, flush=True)

    minutes = (time.perf_counter() - t_all) / 60
    n_in = 3072 if args.dataset == "photos32" else 784
    out: list[str] = [
        "# Deeper layers: inverting through sparse outputs or sparse inputs (issue #3 item 4)",
        "",
        f"Measured {started:%Y-%m-%d %H:%M} with `{command}` ({minutes:.1f} min in all).",
        "",
        f"Machine: {cpu_name()}, {platform.platform()}, os.cpu_count() = {os.cpu_count()}, "
        f"torch {torch.__version__} on CPU with {torch.get_num_threads()} thread(s), "
        f"Python {platform.python_version()}. Code: {version}.",
        "",
        f"Setup: real `{args.dataset}` batches (seeds 0..{args.batches - 1}), one "
        f"`relu_mlp({n_in}, width, {args.depth}, seed=seed)` per seed ({args.depth} hidden "
        "Linear+ReLU layers and the output layer), FedSGD float32 gradients of the mean "
        "cross-entropy; every layer and side of a seed attacks the same batch and model. "
        "`fl_attack.invert(G, g, weight=W, bias=b, sparse=side, seed=seed, "
        f"max_seconds={budget})`, default options otherwise. Layer k is the k-th Linear layer "
        "(1 = first); layers ≥ 2 are preceded and followed by a ReLU, so both sides apply; the "
        "first layer's inputs are normalised pixels (dense), so only the output side is run.",
        "",
        "Columns: *exact* = % of batches certified (λ = 1, all B directions); *all < 1e-3* = % of "
        "batches whose recovered inputs all match the true layer inputs (`models.layer_inputs`) "
        "to a relative error ‖x̂ − x‖/‖x‖ < 1e-3 after the optimal assignment "
        "(`metrics.match`); *samples < 1e-3* = % of the true inputs with a recovered row within "
        "1e-3 (nearest row; counts the right samples of partial results); *false cert.* = "
        "batches certified but not all right (must be 0); *→ input* = batches where `auto` "
        "returned the input side; *errors* = attacks that raised.",
        "",
        "| width | B | layer | side | batches | exact % (λ=1) | all < 1e-3 % | "
        "samples < 1e-3 % | false cert. | median s | max s | → input | errors |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (width, B, layer, side), cell in rows.items():
        s = summarise(cell, B)
        used = f"{s['input_used']}/{s['batches']}" if side == "auto" else "—"
        out.append(f"| {width} | {B} | {layer} | {side} | {s['batches']} | {s['exact']:.0f} | "
                   f"{s['all_right']:.0f} | {s['samples']:.1f} | {s['false_cert']} | "
                   f"{s['median_s']:.2f} | {s['max_s']:.2f} | {used} | {s['errors']} |")
    out += [
        "",
        "Why deeper layers are harder: the ReLU patterns of the samples converge with depth at "
        "initialisation. Mean over the batches of each layer's input zero fraction, and of the "
        "median share of a sample's zeros that its closest partner in the batch also has, for the "
        "inputs (input side) and for ∂L/∂z, i.e. pre-activations ≤ 0 (output side):",
        "",
        "| width | B | layer | input zero fraction | shared zeros, inputs | shared zeros, ∂L/∂z |",
        "|---|---|---|---|---|---|",
    ]
    for (width, B, layer), st in patterns.items():
        mean = [statistics.mean(v[i] for v in st) for i in range(3)]
        shared_in = f"{mean[1]:.2f}" if mean[0] > 0 else "— (dense)"
        out.append(f"| {width} | {B} | {layer} | {mean[0]:.2f} | {shared_in} | {mean[2]:.2f} |")
    out += [
        "",
        PAPER,
        "",
        "<details><summary>Per batch</summary>",
        "",
        "| width | B | layer | side | seed | side returned | exact | λ | directions | "
        "right samples | max matched rel. err. | s | error |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        *per_batch,
        "",
        "</details>",
        "",
    ]
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text("\n".join(out), encoding="utf-8")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
