"""Benchmark: inverting deeper layers (SPEAR §3.2, §6.2) through either sparse factor.

A hidden layer of a ReLU MLP sits between two ReLUs, so both factors of its weight gradient
``G = Σ_i g_i x_iᵀ`` are sparse: the output gradients g_i = ∂L/∂z_i (``sparse="output"``, the
SPEAR(++) attack) and the inputs x_i, which are the previous ReLU's outputs (``sparse="input"``,
:mod:`fl_attack.solver.input_side`). ``"auto"`` tries the output side and, if it is not certified, the
input side. The first layer sees normalised pixels (dense, signed): only the output side applies.

Protocol: real CIFAR-shaped photo crops (``data.sample_batch("photos32", B, seed=s)``), one
``relu_mlp(3072, width, depth, seed=s)`` per batch seed (default: SPEAR's 6-layer MLP, i.e. 5
hidden layers, of width 200; SPEAR's deeper-layer experiment used width 400), FedSGD float32
gradients of the mean cross-entropy of every attacked layer of the *same* batch and model,
``fl_attack.invert(G, g, weight=W, bias=b, sparse=side, seed=s, max_seconds=...)`` with default
options otherwise. Each reconstruction is scored against the layer's true inputs
(``models.layer_inputs``). Appends a section per run (machine, date, command) to
``experiments/results/layers.md`` (``--out`` to write elsewhere); each (width, B)'s rows are
written as soon as its batches are done.

    python -m experiments.bench_layers --batches 5 --max-seconds 60
    python -m experiments.bench_layers --batches 5 --sizes 10,20 --layers 1,2,3 --widths 200,400
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence

import torch

import fl_attack
from experiments import harness
from fl_attack.testbed import data, metrics, models

MODULE = "experiments.bench_layers"
RESULTS = harness.RESULTS_DIR / "layers.md"
SIDES = ("output", "input", "auto")
#: A recovered input counts as right below this relative error ‖x̂ − x‖/‖x‖ (float32 gradients
#: give ~1e-7..1e-5 on exact recoveries; a wrong or mixed row is off by 0.1 and more).
REL_TOL = 1e-3
PAPER = ("SPEAR (paper, §6.2, Table 4): attacks layers 1-5 of a 6-layer ReLU MLP of width 400 "
         "(output side, i.e. sparse ∂L/∂Z), noting that deeper layers are slower at "
         "initialisation because the biases dominate; its headline CIFAR-10 number, on the first "
         "layer of a 6-layer width-200 MLP at B = 20, is 99% of batches exact (PSNR 106.6), "
         "1.7 min per batch on a GPU; no per-layer numbers at this width to compare with.")
TITLE = "Deeper layers: inverting through sparse outputs or sparse inputs"
INTRO = ("Inverting hidden layers of a ReLU MLP through either sparse factor of the weight "
         "gradient: the output gradients (`sparse=\"output\"`) or the inputs, which are the "
         "previous ReLU's outputs (`sparse=\"input\"`); `\"auto\"` tries the output side, then "
         "the input side. Produced by `python -m experiments.bench_layers`.")
COLUMNS = ("width", "B", "layer", "side", "batches", "exact % (λ=1)", "all < 1e-3 %",
           "samples < 1e-3 %", "false cert.", "median s", "max s", "→ input", "errors")
"""The per-cell table's columns."""
PATTERN_COLUMNS = ("width", "B", "layer", "input zero fraction", "shared zeros, inputs",
                   "shared zeros, ∂L/∂z")
"""The columns of the table of ReLU patterns per layer."""
BATCH_COLUMNS = ("width", "B", "layer", "side", "seed", "side returned", "exact", "λ",
                 "directions", "right samples", "max matched rel. err.", "s", "error")
"""The columns of the per-batch table."""


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


def cell_row(width: int, B: int, layer: int, side: str, cell: list[dict]) -> str:
    """The table row of one (width, B, layer, side) cell, from its batches' results."""
    s = summarise(cell, B)
    used = f"{s['input_used']}/{s['batches']}" if side == "auto" else "—"
    return harness.table_row([
        width, B, layer, side, s["batches"], f"{s['exact']:.0f}", f"{s['all_right']:.0f}",
        f"{s['samples']:.1f}", s["false_cert"], f"{s['median_s']:.2f}", f"{s['max_s']:.2f}",
        used, s["errors"]])


def main(argv: Sequence[str] | None = None) -> None:
    """Attack every layer and side of each batch; append the section to the results file."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    harness.add_batches(parser, 5, help="batch seeds per cell (0..N-1; default 5)")
    parser.add_argument("--sizes", type=harness.list_of(int, "--sizes"), default="20",
                        help="batch sizes B, comma-separated")
    parser.add_argument("--layers", type=harness.list_of(int, "--layers"), default="1,2,3,4,5",
                        help="1-based Linear layers to attack (hidden ones: 1..depth)")
    parser.add_argument("--sides", default=",".join(SIDES))
    parser.add_argument("--widths", type=harness.list_of(int, "--widths"), default="200",
                        help="MLP widths, comma-separated (SPEAR: 400)")
    parser.add_argument("--depth", type=int, default=5, help="hidden layers (SPEAR: 5)")
    harness.add_dataset(parser)
    harness.add_max_seconds(parser, 60.0, help="wall-clock budget per attack (0: none)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: shared CPU)")
    harness.add_out(parser, RESULTS, "--output")
    args = parser.parse_args(argv)
    args.max_seconds = args.max_seconds or None
    harness.check_run_args(parser, args)
    torch.set_num_threads(args.threads)
    sizes, widths, layers = args.sizes, args.widths, args.layers
    if any(not 1 <= k <= args.depth for k in layers):
        parser.error(f"--layers must lie in 1..{args.depth} (hidden layers followed by a ReLU)")
    sides = [s for s in args.sides.split(",") if s]
    if any(s not in SIDES for s in sides):
        parser.error(f"--sides must be among {SIDES}")
    budget = args.max_seconds
    n_in = 3072 if args.dataset == "photos32" else 784
    harness.start_section(args.out, TITLE, INTRO, [
        harness.section_heading(MODULE, argv),
        "",
        harness.machine_line(),
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
        *harness.table_header(COLUMNS),
    ])
    t_all = time.perf_counter()

    patterns: dict[tuple[int, int, int], list[tuple[float, float, float]]] = {}
    per_batch: list[str] = []
    for width in widths:
        for B in sizes:
            rows: dict[tuple[int, str], list[dict]] = {}
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
                        rows.setdefault((layer, side), []).append(r)
                        lam = "-" if r["lam"] is None else f"{r['lam']:.4f}"
                        line = harness.table_row([
                            width, B, layer, side, seed, r["used"], r["exact"], lam,
                            f"{r['found']}/{B}", f"{r['right']}/{B}", f"{r['max_rel']:.1e}",
                            f"{r['seconds']:.2f}", r["error"] or ""])
                        per_batch.append(line)
                        print(line, flush=True)
            # this (width, B)'s cells are complete: write them now, so an interrupted run
            # keeps them
            harness.append_lines(args.out, *(cell_row(width, B, layer, side, cell)
                                             for (layer, side), cell in rows.items()))

    minutes = (time.perf_counter() - t_all) / 60
    out: list[str] = [
        "",
        "Why deeper layers are harder: the ReLU patterns of the samples converge with depth at "
        "initialisation. Mean over the batches of each layer's input zero fraction, and of the "
        "median share of a sample's zeros that its closest partner in the batch also has, for the "
        "inputs (input side) and for ∂L/∂z, i.e. pre-activations ≤ 0 (output side):",
        "",
        *harness.table_header(PATTERN_COLUMNS),
    ]
    for (width, B, layer), st in patterns.items():
        mean = [statistics.mean(v[i] for v in st) for i in range(3)]
        shared_in = f"{mean[1]:.2f}" if mean[0] > 0 else "— (dense)"
        out.append(harness.table_row([width, B, layer, f"{mean[0]:.2f}", shared_in,
                                      f"{mean[2]:.2f}"]))
    out += [
        "",
        PAPER,
        "",
        "<details><summary>Per batch</summary>",
        "",
        *harness.table_header(BATCH_COLUMNS),
        *per_batch,
        "",
        "</details>",
        "",
        f"Run wall time {minutes:.1f} min.",
    ]
    harness.append_lines(args.out, *out)
    print(f"appended to {args.out}")


if __name__ == "__main__":
    main()
