"""Benchmark of the certificate and the attack on batches that hold near-duplicate samples.

Real client batches hold near-duplicates (augmented views, video frames, bursts of photos,
repeated records). Each batch of ``B`` photo crops gets ``--pairs`` pairs: sample 2i + 1 is an
overlapping crop of sample 2i (``testbed.views``: a fraction of a pixel further, brightness
within 2%) or its copy (``--kind repeat``); ``--pairs 0`` keeps the batch as drawn. The first
layer of ``relu_mlp(3072, m, 3)`` is attacked from one update:

* ``fedsgd``: the clean gradient. What matters is that no certificate is false: the table
  counts batches certified with a sample under 90 dB (must be 0), the certified ones, the
  batches over 90 dB, and the groups the attack names as read only up to a mixture.
* ``dpsgd``: one Opacus DP-SGD step (clipping ``C`` = 1, noise std ``f`` x the clipped mean
  gradient's median entry, as ``experiments.bench_dp``). ``f = 0`` is clipping alone.

Both are attacked with the true batch size given (as the Flower server reads it from
``num-examples``); a reconstruction may stand for samples the update did not separate
(``Reconstruction.merged``, scored with ``metrics.score_batch(shared=True)``).

    python -m experiments.bench_duplicates --dataset mixed32 --first-seed 300 --batches 20
    python -m experiments.bench_duplicates --protocol dpsgd --fracs 0.05,0.1 --max-seconds 30

Appends a section to ``experiments/results/duplicates.md``, a row per setting as it finishes.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

import fl_attack
from experiments import harness
from fl_attack.testbed import data, dpsgd, metrics, models, views

MODULE = "experiments.bench_duplicates"
RESULTS = harness.RESULTS_DIR / "duplicates.md"
TITLE = "Near-duplicate samples: the certificate and the attack"
INTRO = ("Batches of photo crops holding near-duplicate pairs (``fl_attack.testbed.views``), "
         "the first layer of a 3-hidden-layer ReLU MLP; made with `python -m "
         "experiments.bench_duplicates`.")
COLUMNS = ("protocol", "f", "B", "m", "pairs", "kind", "batches", "pair cosine (median)",
           "certified", "false certificates (a sample < 90 dB)", "% > 90 dB", "% > 25 dB",
           "pair's worse sample > 25 dB", "named mixed groups", "merged (batches)",
           "median s", "max s")


@dataclass
class Outcome:
    """One batch's result."""

    psnr: torch.Tensor
    """(B,) per original sample, after matching (shared where the update merged samples)."""
    exact: bool
    mixed: int
    merged: int
    seconds: float


def _update(protocol: str, f: float, model: torch.nn.Module, xn: torch.Tensor,
            y: torch.Tensor, seed: int) -> tuple[torch.Tensor, ...]:
    """``(dw, db, w0, b0)`` of the first layer: the clean gradient, or one DP-SGD step."""
    lin = models.linear_layers(model)[0]
    w0, b0 = lin.weight.detach(), lin.bias.detach()
    if protocol == "fedsgd":
        G, g = models.first_layer_gradients(model, xn, y)
        return G, g, w0, b0
    from experiments.bench_dp import dp_updates

    engine = dpsgd.choose_engine(model, xn.shape[0], "auto")
    u = dp_updates(model, xn, y, clip=1.0, fracs=[f], lr=0.1, delta=1e-5, seed=seed,
                   engine=engine)[f]
    return u.dw, u.db, u.w0, u.b0


def attack(protocol: str, f: float, x: torch.Tensor, y: torch.Tensor, m: int, seed: int,
           dataset: str, max_seconds: float | None) -> Outcome:
    """Attack one batch ``x`` (B, C, H, W) in [0, 1] and score it."""
    xn = data.normalize(x, dataset)
    model = models.relu_mlp(xn[0].numel(), m, 3, seed=seed)
    dw, db, w0, b0 = _update(protocol, f, model, xn, y, seed)
    t0 = time.perf_counter()
    rec = fl_attack.invert(dw, db, weight=w0, bias=b0, seed=seed, max_seconds=max_seconds,
                           batch_size=x.shape[0])
    seconds = time.perf_counter() - t0
    images = data.denormalize(rec.inputs.float().reshape(-1, *x.shape[1:]), dataset)
    score = metrics.score_batch(images, x, shared=rec.merged > 0)
    return Outcome(psnr=score.psnr, exact=rec.exact, mixed=len(rec.mixed),
                   merged=rec.merged, seconds=seconds)


def run_setting(args: argparse.Namespace, f: float) -> list[object]:
    """Every batch of one setting; the table row."""
    outs, cosines, worse = [], [], []
    for seed in range(args.first_seed, args.first_seed + args.batches):
        x, y = data.sample_batch(args.dataset, args.batch_size, seed=seed)
        x, y, pairs = views.with_near_duplicates(x, y, pairs=args.pairs, kind=args.kind,
                                                 seed=seed, max_shift=args.max_shift)
        xn = data.normalize(x, args.dataset).flatten(1)
        cosines += [float(torch.nn.functional.cosine_similarity(xn[a], xn[b], dim=0))
                    for a, b in pairs]
        o = attack(args.protocol, f, x, y, args.width, seed, args.dataset, args.max_seconds)
        outs.append(o)
        worse += [float(min(o.psnr[a], o.psnr[b])) for a, b in pairs]
        print(f"  seed {seed}: mean {float(o.psnr.mean()):6.1f} dB, worst "
              f"{float(o.psnr.min()):6.1f}, {'certified' if o.exact else 'not certified'}"
              f"{f', {o.mixed} mixed group(s)' if o.mixed else ''}"
              f"{f', {o.merged} merged' if o.merged else ''}, {o.seconds:.1f} s", flush=True)
    n = len(outs)
    pct = lambda k: f"{100.0 * k / n:.0f}"  # noqa: E731 - a table cell
    false = sum(o.exact and float(o.psnr.min()) <= 90.0 for o in outs)
    return [args.protocol, f if args.protocol == "dpsgd" else "—", args.batch_size,
            args.width, args.pairs, args.kind if args.pairs else "—", n,
            f"{statistics.median(cosines):.4f}" if cosines else "—",
            f"{sum(o.exact for o in outs)} / {n}", false,
            pct(sum(float(o.psnr.mean()) > 90.0 for o in outs)),
            pct(sum(float(o.psnr.mean()) > 25.0 for o in outs)),
            f"{sum(w > 25.0 for w in worse)} / {len(worse)}" if worse else "—",
            sum(o.mixed for o in outs), sum(o.merged > 0 for o in outs),
            f"{statistics.median(o.seconds for o in outs):.1f}",
            f"{max(o.seconds for o in outs):.1f}"]


def main(argv: Sequence[str] | None = None) -> None:
    """Run the settings and append their rows to the results file."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    harness.add_run_args(parser, RESULTS, batches=20, max_seconds=120.0)
    harness.add_dataset(parser, "mixed32")
    parser.add_argument("--protocol", choices=("fedsgd", "dpsgd"), default="fedsgd")
    parser.add_argument("--fracs", type=harness.list_of(float, "--fracs"), default=[0.05],
                        help="dpsgd: noise std as a fraction of the median entry")
    parser.add_argument("--batch-size", type=int, default=20)
    parser.add_argument("--width", type=int, default=200, help="the attacked layer's m")
    parser.add_argument("--pairs", type=int, default=1, help="near-duplicate pairs per batch")
    parser.add_argument("--kind", choices=views.KINDS, default="view")
    parser.add_argument("--max-shift", type=float, default=0.3,
                        help="views: the largest shift in pixels along each axis")
    args = parser.parse_args(argv)
    harness.check_run_args(parser, args)
    if not 0 <= args.pairs <= args.batch_size // 2:
        parser.error(f"--pairs must be in [0, {args.batch_size // 2}]")
    setup = (f"Dataset {args.dataset}, batches from seed {args.first_seed}, max_seconds "
             f"{args.max_seconds}, views shifted by up to {args.max_shift} px.")
    harness.start_section(args.out, TITLE, INTRO, [
        harness.section_heading(MODULE, argv), "", harness.machine_line(args.device), "",
        setup, "", *harness.table_header(COLUMNS)])
    t0 = time.perf_counter()
    for f in (args.fracs if args.protocol == "dpsgd" else [0.0]):
        row = harness.table_row(run_setting(args, f))
        print(row, flush=True)
        harness.append_lines(args.out, row)
    harness.append_lines(args.out, "", f"Wall time {time.perf_counter() - t0:.0f} s.")


if __name__ == "__main__":
    main()
