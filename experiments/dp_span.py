"""Under DP noise, is each sample's ∂L/∂Z column still in the update's top-B span?

SPEAR-type attacks search for the batch's ∂L/∂Z columns inside the span of the update's top B
left singular vectors (SPEAR §4, step 1). Under heavy DP noise one may suspect that the weakest
samples' columns have left that span, and that a search in a wider span (the top B + k vectors)
would find them. This study measures that with the ground truth: for each batch it projects the
*true* columns onto the top B + k span of the *noisy* update and reports

* the share of the weakest column's energy that the span holds, and
* the least-squares reconstruction X = Ẑ⁺ ΔW from those projected columns (mean PSNR), next to
  the ceiling X = Z⁺ ΔW from the true columns.

If the top-B projection already reaches the ceiling, widening the span cannot help an attacker:
what is left to gain is finding the columns inside the span. Appends a section to
``experiments/results/dp.md`` (``--out`` to write elsewhere).

    python -m experiments.dp_span --dataset hopper32 --fracs 0.3,0.5 --batches 20 --first-seed 100
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence

import torch

from experiments import harness
from experiments.bench_dp import RESULTS, TITLE, dp_updates, least_squares_psnr, true_columns
from fl_attack.testbed import data, dpsgd, models

MODULE = "experiments.dp_span"
EXTRA = (0, 10, 40)
"""How many directions beyond B each wider span adds."""
COLUMNS = ("source", "f", "batches", "weakest column's share in the top-B span: median (min)",
           *(f"PSNR from the top B+{k} span: mean / % > 25 dB" for k in EXTRA),
           "ceiling (true ∂L/∂Z): mean / % > 25 dB")


def one_batch(dataset: str, seed: int, f: float, B: int, m: int,
              clip: float = 1.0) -> dict[str, object]:
    """The span measurements of one DP-SGD batch (one step, clipping norm ``clip``)."""
    x, y = data.sample_batch(dataset, B, seed=seed)
    xn = data.normalize(x, dataset)
    model = models.relu_mlp(xn[0].numel(), m, 3, seed=seed)
    engine = dpsgd.choose_engine(model, B, "auto")  # Opacus where its per-sample grads fit
    u = dp_updates(model, xn, y, clip=clip, fracs=[f], lr=0.1, delta=1e-5, seed=seed,
                   engine=engine)[f]
    Z, dw = true_columns(u, xn), u.dw.double()
    U = torch.linalg.svd(dw, full_matrices=False)[0]
    share = ((U[:, :B].T @ Z).norm(dim=0) ** 2 / Z.norm(dim=0) ** 2).min().item()
    wide = {k: least_squares_psnr(U[:, :B + k] @ (U[:, :B + k].T @ Z), dw, x, dataset)
            for k in EXTRA}
    return {"share": share, "wide": wide, "ceiling": least_squares_psnr(Z, dw, x, dataset)}


def _cell(values: Sequence[float]) -> str:
    ok = 100.0 * sum(v > 25.0 for v in values) / len(values)
    return f"{statistics.mean(values):.1f} / {ok:.0f}"


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    harness.add_dataset(p, "hopper32")
    p.add_argument("--fracs", type=harness.list_of(float, "noise fraction"), default=[0.3, 0.5],
                   help="noise std as a fraction of the clipped mean gradient's median |entry|")
    p.add_argument("--batch-size", type=int, default=20)
    p.add_argument("--width", type=int, default=200)
    p.add_argument("--clip", type=float, default=1.0, help="DP-SGD clipping norm C")
    harness.add_batches(p, 20)
    harness.add_first_seed(p)
    harness.add_out(p, RESULTS)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    t0 = time.time()
    harness.start_section(args.out, TITLE, "What the attack reads from DP-SGD updates.", [
        harness.section_heading(MODULE, argv) + ": is the top-B span where the columns are?",
        "",
        harness.machine_line(),
        "",
        f"B = {args.batch_size}, m = {args.width}, one DP-SGD step (engine: "
        f"`dpsgd.choose_engine`), C = {args.clip:g}, σ = f · median |entry|; "
        f"batches from `{args.dataset}`, seeds {args.first_seed}.."
        f"{args.first_seed + args.batches - 1}. The true ∂L/∂Z columns are projected onto the "
        "noisy update's top B + k left singular vectors; no attack runs.",
        "",
        *harness.table_header(COLUMNS),
    ])
    for f in args.fracs:
        rows = [one_batch(args.dataset, s, f, args.batch_size, args.width, args.clip)
                for s in range(args.first_seed, args.first_seed + args.batches)]
        shares = [float(r["share"]) for r in rows]
        line = harness.table_row([
            f"`{args.dataset}`", f, len(rows),
            f"{statistics.median(shares):.3f} ({min(shares):.3f})",
            *(_cell([r["wide"][k] for r in rows]) for k in EXTRA),  # type: ignore[index]
            _cell([float(r["ceiling"]) for r in rows])])
        print(line, flush=True)
        harness.append_lines(args.out, line)
    harness.append_lines(args.out, "", f"Run wall time {time.time() - t0:.0f} s.")
    print(f"appended to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
