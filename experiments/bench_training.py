"""The attack as a federation trains: models trained K SGD steps on real labelled data, then the
first layer's update of fresh batches (SPEAR App. E.4 evaluates SPEAR so on MNIST, b = 10).

A global model that has trained is what a server holds after K local steps of its clients in
all. For each K on a log scale the model is trained centrally (SGD, batches of 64, lr 0.05)
on the source's training split, its test accuracy is measured, and fresh batches of the test
split (never trained on) give the update attacked with default settings:

* ``fedsgd``: one gradient step (mean cross-entropy), attacked as a gradient with the next
  layer's gradient beside it, as the Flower plugin attacks a FedSGD update by default (it
  peels verified samples off and reads nested pairs, docs/algorithm.md; ``--layer-alone``
  attacks the first layer alone, as the papers do); a batch counts as read above 90 dB;
* ``fedavg``: 5 (``--epochs``) full-batch local steps at lr 0.01, the float32 weight
  difference attacked with ``update="fedavg"`` and ``weights_dtype="float32"`` (as the plugin
  attacks a float32 reply); read above 25 dB; ``fedavg-mb``: the same with 5 epochs of
  mini-batches of 10 (a fresh shuffle per epoch: 2 steps per epoch at B = 20, as Flower's
  examples train locally);
* ``fedavg-step``: one full-batch local step at lr 0.01 read as the Flower plugin reads a
  reply by default: its ``gradient`` reading, with the next layer's float32 weight difference
  and that layer's sent weight beside it (``next_weight``) and ``weights_dtype="float32"``;
  read above 25 dB;
* ``dpsgd``: one Opacus step, clipping 1, noise std 0.05 (``--noise``) x the clipped mean
  gradient's median entry, the batch size given (as a Flower server reads it from
  ``num-examples``); read above 25 dB. For both, the least-squares ceiling from the true
  ∂L/∂Z (``bench_dp``).

The quickstart CNN's ``fc1`` (``--model quickstart``, photo sources only) is attacked on one
SGD step (lr 0.1) of 8 photos, the float32 weight difference with ``weights_dtype="float32"``:
its recovered *features* are scored, not pictures, over the samples whose least-squares
ceiling from the true ∂L/∂Z and that weight difference passes 90 dB (the weights' rounding
hides the others).

Per row: accuracy; batches read and certified; the median λ and directions found; seconds and
why the searches stopped; and what training does to the update, from the true ∂L/∂Z: the
spread of per-sample gradient norms, zeros per column, units active for every sample and for
none, the fewest units on which two samples' patterns differ, and samples the update holds
below the row's threshold: for ``fedsgd`` those whose least-squares reconstruction from the true
∂L/∂Z and the float32 update (the ceiling of any attack that solves X = Z⁺ ΔW, as SPEAR does)
is below 90 dB, because their contribution sits within a few orders of the float32 rounding;
otherwise those whose contribution is below the rounding itself. They are left out of the
batch's PSNR and counted. For ``fedsgd`` the ceiling column is the share of batches whose
every sample's ceiling passes 90 dB, and the span oracle's the share read (the same mean over
the same samples) by an attack that finds every column the update's span holds exactly: the
true columns of the strongest samples, as many as the rank the attack read, projected onto
that span. For FedAvg and DP-SGD the ceiling column is the share of batches whose least-squares
mean over all samples passes 25 dB; under noise that mean is no bound on an attack's (a weak
sample's row takes the noise amplified to a negative PSNR), so the next column counts samples:
those the least squares holds above the row's threshold, and how many of them the attack reads.
The last column checks what an uncertified record says of its rows against the truth: the
rows it names unproven (``Reconstruction.unproven``) and verified one by one
(``Reconstruction.verified``), and the worst true PSNR of a verified row and of a row it names
neither way.

    python -m experiments.bench_training --source mnist --settings 20x200 --protocols fedsgd
    python -m experiments.bench_training --source mixed32 --steps 0,100,1000,3000

Appends a section to ``experiments/results/training.md``, one row per (setting, protocol, K).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

import fl_attack
from experiments import harness, training_stats
from fl_attack.model import updates
from fl_attack.testbed import data, metrics, models, simulate

MODULE = "experiments.bench_training"
RESULTS = harness.RESULTS_DIR / "training.md"
TITLE = "The attack while the model trains"
INTRO = ("Models trained K SGD steps on real labelled data, then the first layer's update of "
         "fresh test batches; made with `python -m experiments.bench_training`.")
COLUMNS = ("source", "model", "B", "m", "protocol", "K", "test acc", "batches", "% read",
           "% certified", "median λ", "found (median)", "median s", "stopped",
           "grad-norm spread (median)", "zeros/column (min-median)", "always-on / off units",
           "closest pair differs on", "samples held below the threshold",
           "ceiling % (true ∂L/∂Z)", "samples read of those least squares holds",
           "span oracle % (true columns in the update's span)",
           "uncertified batches: rows named unproven / verified; worst other row, worst verified")
DEFAULT_STEPS = "0,30,100,300,1000,3000,10000"
READ_DB = {"fedsgd": 90.0, "fedavg": 25.0, "fedavg-mb": 25.0, "fedavg-step": 25.0,
           "dpsgd": 25.0}
FEDAVG_BATCH = {"fedavg": None, "fedavg-mb": 10}
"""Local mini-batch size of each FedAvg protocol (None: full batch)."""
CNN_LR = 0.1
"""The learning rate of the quickstart CNN's attacked step."""


@dataclass
class Labelled:
    """A labelled source split into training and test rows, normalised."""

    name: str
    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    shape: tuple[int, int, int]


def load(name: str, n: int) -> Labelled:
    """``n`` images of ``name`` (MNIST digits, or photo crops labelled by their source
    photograph), normalised, the first 80% for training."""
    x, y = data.load_images(name, n, seed=0)
    xn = data.normalize(x, name)
    cut = int(0.8 * n)
    return Labelled(name, xn[:cut], y[:cut], xn[cut:], y[cut:], tuple(x.shape[1:]))


def train_to(model: nn.Module, src: Labelled, steps: int, done: int,
             gen: torch.Generator, lr: float = 0.05) -> None:
    """Continue SGD (batches of 64) from ``done`` to ``steps`` steps."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for _ in range(done, steps):
        idx = torch.randint(0, src.train_x.shape[0], (64,), generator=gen)
        opt.zero_grad()
        nn.functional.cross_entropy(model(src.train_x[idx]), src.train_y[idx]).backward()
        opt.step()


def accuracy(model: nn.Module, src: Labelled) -> float:
    """Test accuracy of ``model``."""
    with torch.no_grad():
        return float((model(src.test_x).argmax(1) == src.test_y).float().mean())


@dataclass
class BatchResult:
    """One attacked batch."""

    psnr: float
    """Mean PSNR over the samples above the rounding (dB)."""
    exact: bool
    lam: float | None
    found: int
    seconds: float
    stopped: str
    ceiling: float | None
    stats: training_stats.UpdateStats
    unheld: int
    """Samples the update holds below the row's threshold (left out of ``psnr``)."""
    held: int | None = None
    """Samples above the rounding whose least-squares reconstruction from the true ∂L/∂Z
    passes the row's threshold (:func:`_held_psnr`)."""
    read_held: int | None = None
    """Of those, the samples the attack reads above the threshold."""
    span_oracle: float | None = None
    """FedSGD: the batch's mean PSNR over the same samples from the update's span at the
    attack's rank reading with the true columns (:func:`_span_oracle`)."""
    proof: RowProof | None = None
    """What an uncertified record says of its rows, beside their true PSNR."""


@dataclass
class RowProof:
    """An uncertified reconstruction's rows as its record names them, scored: the rows named
    unproven (``Reconstruction.unproven``), those verified one by one through the next layer
    (``Reconstruction.verified``), and the worst true PSNR among the verified rows and among
    the rest, which the record names neither way."""

    named: int
    verified: int
    worst_other: float | None
    worst_verified: float | None


def _row_proof(rec: fl_attack.Reconstruction, score: metrics.MatchedScore) -> RowProof | None:
    """:class:`RowProof` of an uncertified ``rec`` (None when certified)."""
    if rec.exact:
        return None
    by_row = {int(r): float(p) for r, p in zip(score.perm, score.psnr, strict=True)
              if int(r) >= 0}
    named, verified = {r for r, _ in rec.unproven}, set(rec.verified)
    other = [p for r, p in by_row.items() if r not in named and r not in verified]
    ver = [p for r, p in by_row.items() if r in verified]
    return RowProof(len(named), len(verified), min(other) if other else None,
                    min(ver) if ver else None)


def attack_mlp(model: nn.Module, src: Labelled, xb: torch.Tensor, yb: torch.Tensor,
               protocol: str, seed: int, max_seconds: float, next_layer: bool = True,
               epochs: int = 5, noise: float = 0.05) -> BatchResult:
    """The first layer's update of one batch under ``protocol``, attacked and scored; a FedSGD
    update with the second layer's gradient beside it unless ``next_layer`` is False; a FedAvg
    update of ``epochs`` local epochs; a DP-SGD update with noise std ``noise`` x the clipped
    mean gradient's median entry."""
    from experiments.bench_dp import dp_updates, least_squares_psnr, true_columns

    lin = models.linear_layers(model)[0]
    w0, b0 = lin.weight.detach(), lin.bias.detach()
    grads = training_stats.output_grad(model, xb, yb)
    stats = training_stats.update_stats(model, xb, yb, grads)
    ceiling, options, Z = None, {}, None
    if protocol == "fedsgd":
        dw, db = models.first_layer_gradients(model, xb, yb)
        if next_layer:
            options = {"next_weight_grad": models.layer_gradients(model, xb, yb, layer=1)[0]}
    elif protocol in FEDAVG_BATCH or protocol == "fedavg-step":
        step = protocol == "fedavg-step"
        res = simulate.local_update(model, xb, yb, protocol="fedavg", lr=0.01,
                                    epochs=1 if step else epochs,
                                    batch_size=FEDAVG_BATCH.get(protocol), seed=seed)
        before = model.state_dict()
        dw, db, _, _ = updates.weight_update_pair(before, res.state_dict)
        Z = dw.double() @ torch.linalg.pinv(xb.reshape(xb.shape[0], -1).double())
        options = {"update": "gradient" if step else "fedavg", "weights_dtype": "float32"}
        if step:
            key = [k for k in before if k.endswith("weight")][1]
            options["next_weight"] = before[key]
            options["next_weight_grad"] = updates.weight_update_pair(
                before, res.state_dict, weight_key=key)[0]
    else:
        u = dp_updates(model, xb, yb, clip=1.0, fracs=[noise], lr=0.1, delta=1e-5,
                       seed=seed, engine="opacus")[noise]
        dw, db, Z = u.dw, u.db, true_columns(u, xb)
        options = {"batch_size": xb.shape[0]}
    t0 = time.perf_counter()
    rec = fl_attack.invert(dw, db, weight=w0, bias=b0, seed=seed, max_seconds=max_seconds,
                           **options)
    seconds = time.perf_counter() - t0
    images = data.denormalize(rec.inputs.float().reshape(-1, *src.shape), src.name)
    score = metrics.score_batch(images, _images(xb, src), shared=rec.merged > 0)
    kept = ~stats.below_rounding
    if protocol == "fedsgd":
        D = grads[0]
        held = _held_psnr(D, dw, xb, src)
        kept, ceiling = held > READ_DB[protocol], float(held.min())
        span = _span_oracle(D, dw, db, xb, src, rec.batch_size)
        held_mask = kept
    else:
        ceiling = least_squares_psnr(Z, dw, _images(xb, src), src.name)
        held_mask = kept & (_held_psnr(Z, dw, xb, src) > READ_DB[protocol])
    return BatchResult(float(score.psnr[kept].mean()) if bool(kept.any()) else 0.0, rec.exact,
                       rec.sparsity_match, rec.n_directions, seconds, rec.stopped, ceiling,
                       stats, int((~kept).sum()), int(held_mask.sum()),
                       int((held_mask & (score.psnr > READ_DB[protocol])).sum()),
                       float(span[kept].mean()) if protocol == "fedsgd" and bool(kept.any())
                       else None, _row_proof(rec, score))


def _images(xn: torch.Tensor, src: Labelled) -> torch.Tensor:
    return data.denormalize(xn.reshape(-1, *src.shape), src.name)


def _least_squares(D: torch.Tensor, dw: torch.Tensor) -> torch.Tensor:
    """X = D⁺ ΔW (B, n): what the update ``dw`` holds of each sample, given the true ∂L/∂Z
    ``D`` (m, B), whatever finds the columns (scaled by the step's learning rate)."""
    return torch.linalg.pinv(D) @ dw.double()


def _held_psnr(D: torch.Tensor, dw: torch.Tensor, xb: torch.Tensor,
               src: Labelled) -> torch.Tensor:
    """Per-sample PSNR (B,) of X = D⁺ ΔW from the true columns ``D`` (m, B, float64: the true
    ∂L/∂Z of ``training_stats.output_grad``, or a FedAvg / DP-SGD update's true columns) and
    the float32 update: what the update holds of each sample, whatever finds the columns.

    Under noise the batch's mean of these (the FedAvg / DP-SGD ceiling column) is no bound on
    an attack's mean: a weak sample's row takes the noise amplified by its small column, often
    to a negative PSNR, where an attack that reads fewer columns scores it at its nearest
    reconstruction; counting the samples each passes the threshold on compares like with
    like."""
    Xh = _least_squares(D, dw)
    images = data.denormalize(Xh.float().reshape(-1, *src.shape), src.name)
    truth = _images(xb, src)
    return metrics.psnr(images, truth)


def _span_oracle(D: torch.Tensor, dw: torch.Tensor, db: torch.Tensor, xb: torch.Tensor,
                 src: Labelled, rank: int) -> torch.Tensor:
    """Per-sample PSNR (B,) read from the update's span as SPEAR reads it (X = Q⁻¹ Lᵀ ΔW over
    the scales Q⁻¹ Lᵀ Δb), with Q the exact projections of the ``rank`` strongest samples'
    true ∂L/∂Z columns onto the top-``rank`` left singular vectors; the others score 0.

    An attack that finds every column its span holds reads this much: the weak samples'
    contributions inside the span, unknown to the strong ones' columns, bound it below the
    ceiling (:func:`_held_psnr`, which knows every column)."""
    X = xb.reshape(xb.shape[0], -1).double()
    top = torch.argsort(D.norm(dim=0) * X.norm(dim=1), descending=True)[:rank]
    U = torch.linalg.svd(dw.double(), full_matrices=False)[0][:, :rank]
    Q = U.T @ D[:, top]
    s = torch.linalg.solve(Q, U.T @ db.double())
    Xh = torch.linalg.solve(Q, U.T @ dw.double()) / s[:, None]
    out = torch.zeros(xb.shape[0], dtype=torch.float32)
    images = data.denormalize(Xh.float().reshape(-1, *src.shape), src.name)
    out[top] = metrics.psnr(images, _images(xb, src)[top]).float()
    return out


def row(src: Labelled, label: str, B: int, m: int, protocol: str, K: int, acc: float,
        results: list[BatchResult]) -> list[object]:
    """The table row of one (setting, protocol, K)."""
    n = len(results)
    read = sum(r.psnr > READ_DB[protocol] for r in results)
    lams = [r.lam for r in results if r.lam is not None]
    st = [r.stats for r in results]
    ceilings = [r.ceiling for r in results if r.ceiling is not None]
    spans = [r.span_oracle for r in results if r.span_oracle is not None]
    stops = Counter(r.stopped for r in results)
    return [src.name, label, B, m, protocol, K, f"{100 * acc:.0f}%", n,
            f"{100 * read / n:.0f}", f"{100 * sum(r.exact for r in results) / n:.0f}",
            f"{statistics.median(lams):.4f}" if lams else "—",
            f"{statistics.median(r.found for r in results):.0f}/{B}",
            f"{statistics.median(r.seconds for r in results):.1f}",
            ", ".join(f"{k} {v}" for k, v in stops.most_common()),
            f"{statistics.median(s.spread for s in st):.0f}x",
            f"{min(s.zeros_min for s in st)}-{statistics.median(s.zeros_median for s in st):.0f}",
            f"{statistics.median(s.always_on for s in st):.0f} / "
            f"{statistics.median(s.always_off for s in st):.0f}",
            min(s.closest for s in st), sum(r.unheld for r in results),
            f"{100 * sum(c > READ_DB[protocol] for c in ceilings) / len(ceilings):.0f}"
            if ceilings else "—",
            f"{sum(r.read_held or 0 for r in results)} of {sum(r.held or 0 for r in results)}"
            if any(r.held is not None for r in results) else "—",
            f"{100 * sum(s > READ_DB[protocol] for s in spans) / len(spans):.0f}"
            if spans else "—", _proof_cell(results)]


def _proof_cell(results: list[BatchResult]) -> str:
    """The row's uncertified batches: rows named and verified, in all, and the worst true
    PSNR of a row named neither way and of a verified row."""
    proofs = [r.proof for r in results if r.proof is not None]
    if not proofs:
        return "—"
    worst = lambda vals: f"{min(vals):.1f} dB" if vals else "—"  # noqa: E731
    return (f"{len(proofs)}: {sum(p.named for p in proofs)} / "
            f"{sum(p.verified for p in proofs)}; "
            f"{worst([p.worst_other for p in proofs if p.worst_other is not None])}, "
            f"{worst([p.worst_verified for p in proofs if p.worst_verified is not None])}")


def run_mlp(args: argparse.Namespace, src: Labelled, B: int, m: int) -> None:
    """Every K of one MLP setting, every protocol: train, attack, append rows."""
    model = models.relu_mlp(src.test_x[0].numel(), m, 3, seed=args.model_seed)
    gen = torch.Generator().manual_seed(args.model_seed)
    done = 0
    for K in args.steps:
        train_to(model, src, K, done, gen)
        done = K
        acc = accuracy(model, src)
        for protocol in args.protocols:
            results = []
            for b in range(args.batches):
                lo = (args.first_seed + b) * B
                xb, yb = src.test_x[lo:lo + B], src.test_y[lo:lo + B]
                r = attack_mlp(model, src, xb, yb, protocol, seed=b, max_seconds=args.max_seconds,
                               next_layer=not args.layer_alone, epochs=args.epochs,
                               noise=args.noise)
                results.append(r)
                print(f"  {src.name} {B}x{m} {protocol} K={K} acc {acc:.2f} batch {b}: "
                      f"{r.psnr:.1f} dB, {'certified' if r.exact else 'not certified'}, "
                      f"found {r.found}/{B}, {r.seconds:.1f} s, {r.stopped}"
                      + (f", ceiling {r.ceiling:.1f} dB" if r.ceiling is not None else "")
                      + (" (its weakest sample)" if protocol == "fedsgd" else ""),
                      flush=True)
            line = harness.table_row(row(src, "MLP", B, m, protocol, K, acc, results))
            print(line, flush=True)
            harness.append_lines(args.out, line)


def attack_cnn(model: nn.Module, xb: torch.Tensor, yb: torch.Tensor, seed: int,
               max_seconds: float, next_layer: bool = True) -> BatchResult:
    """One quickstart SGD step (lr 0.1) of ``xb`` (photos in the model's space); ``fc1``'s
    update attacked (with ``fc2``'s beside it unless ``next_layer`` is False), its recovered
    input *features* scored against the true ones."""
    from fl_attack.testbed import cnn

    view = cnn.fedsgd_step(model, xb, yb, lr=CNN_LR)
    dw, db = view.update("fc1.weight"), view.update("fc1.bias")
    w0, b0 = view.before["fc1.weight"], view.before["fc1.bias"]
    grads = training_stats.output_grad(model, xb, yb)
    stats = training_stats.update_stats(model, xb, yb, grads)
    dw2 = view.update("fc2.weight").float() if next_layer else None
    t0 = time.perf_counter()
    rec = fl_attack.invert(dw.float(), db.float(), weight=w0, bias=b0, seed=seed,
                           max_seconds=max_seconds, next_weight_grad=dw2,
                           weights_dtype="float32")
    seconds = time.perf_counter() - t0
    features = models.layer_inputs(model, xb).double()
    scale = float(features.abs().max())
    score = metrics.score_batch(rec.inputs / scale, features / scale, shared=rec.merged > 0)
    held = metrics.psnr(_least_squares(grads[0], dw) / CNN_LR / scale, features / scale)
    kept = held > READ_DB["fedsgd"]
    return BatchResult(float(score.psnr[kept].mean()) if bool(kept.any()) else 0.0,
                       rec.exact, rec.sparsity_match, rec.n_directions, seconds, rec.stopped,
                       float(held.min()), stats, int((~kept).sum()),
                       proof=_row_proof(rec, score))


def run_cnn(args: argparse.Namespace, src: Labelled, B: int = 8) -> None:
    """The quickstart CNN trained K steps (SGD lr 0.01, momentum 0.9, batches of 32) on
    photos labelled by their source photograph; ``fc1``'s features attacked at every K."""
    from fl_attack.testbed import cnn

    images = lambda x: cnn.quickstart_normalize(_images(x, src))  # noqa: E731
    train = Labelled(src.name, images(src.train_x), src.train_y, images(src.test_x),
                     src.test_y, src.shape)
    model = cnn.build("quickstart", seed=args.model_seed)
    gen = torch.Generator().manual_seed(args.model_seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    done = 0
    for K in args.steps:
        for _ in range(done, K):
            idx = torch.randint(0, train.train_x.shape[0], (32,), generator=gen)
            opt.zero_grad()
            nn.functional.cross_entropy(model(train.train_x[idx]), train.train_y[idx]).backward()
            opt.step()
        done = K
        acc = accuracy(model, train)
        results = []
        for b in range(args.batches):
            lo = (args.first_seed + b) * B
            r = attack_cnn(model, train.test_x[lo:lo + B], train.test_y[lo:lo + B], b,
                           args.max_seconds, next_layer=not args.layer_alone)
            results.append(r)
            print(f"  quickstart fc1 K={K} acc {acc:.2f} batch {b}: features {r.psnr:.1f} dB, "
                  f"{'certified' if r.exact else 'not certified'}, {r.seconds:.1f} s",
                  flush=True)
        line = harness.table_row(row(src, "quickstart fc1 (features)", B, 120, "fedsgd", K,
                                     acc, results))
        print(line, flush=True)
        harness.append_lines(args.out, line)


def main(argv: Sequence[str] | None = None) -> None:
    """Train, attack and append one row per (setting, protocol, K)."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    harness.add_run_args(parser, RESULTS, batches=5, max_seconds=60.0)
    parser.add_argument("--source", choices=("mnist", "photos32", "mixed32", "greys32", "ink28"),
                        default="mnist", help="labelled data (photos: the source photograph)")
    parser.add_argument("--size", type=int, default=2000, help="images loaded (80%% train)")
    parser.add_argument("--settings", type=harness.parse_settings, default="10x200,20x200")
    parser.add_argument("--protocols", type=harness.list_of(str, "--protocols"),
                        default=["fedsgd"], help="fedsgd, fedavg, fedavg-mb, fedavg-step, dpsgd")
    parser.add_argument("--steps", type=harness.list_of(int, "--steps"),
                        default=[int(k) for k in DEFAULT_STEPS.split(",")])
    parser.add_argument("--model", choices=("mlp", "quickstart"), default="mlp")
    parser.add_argument("--model-seed", type=int, default=0)
    parser.add_argument("--layer-alone", action="store_true",
                        help="attack a FedSGD update's first layer without the next layer's "
                             "gradient (the papers' setting; the plugin passes it by default)")
    parser.add_argument("--epochs", type=int, default=5,
                        help="local epochs of the FedAvg protocols (default 5)")
    parser.add_argument("--noise", type=float, default=0.05,
                        help="DP-SGD noise std as a fraction of the clipped mean gradient's "
                             "median entry (default 0.05)")
    args = parser.parse_args(argv)
    harness.check_run_args(parser, args)
    if args.epochs < 1:
        parser.error(f"--epochs must be at least 1, got {args.epochs}")
    if not args.noise > 0:
        parser.error(f"--noise must be positive, got {args.noise}")
    bad = sorted(set(args.protocols) - set(READ_DB))
    if bad:
        parser.error(f"--protocols: unknown {bad}; expected some of {sorted(READ_DB)}")
    if args.steps != sorted(args.steps) or args.steps[0] < 0:
        parser.error("--steps must be non-negative and ascending")
    if args.model == "quickstart" and data.image_shape(args.source) != (3, 32, 32):
        parser.error("--model quickstart needs 3x32x32 photos (--source photos32/mixed32)")
    src = load(args.source, args.size)
    largest = max([B for B, _ in args.settings] + [8]) * (args.first_seed + args.batches)
    if largest > src.test_x.shape[0]:
        parser.error(f"{args.batches} batches from seed {args.first_seed} need {largest} test "
                     f"images; the source has {src.test_x.shape[0]} (raise --size)")
    setup = (f"Source {args.source} ({args.size} images, 80% train), {args.model}, steps "
             f"{args.steps}, max_seconds {args.max_seconds}, test batches from "
             f"{args.first_seed}; FedAvg E = {args.epochs}; DP-SGD f = {args.noise}; "
             f"FedSGD attacked "
             f"{'layer alone' if args.layer_alone else 'with the next layer'}.")
    harness.start_section(args.out, TITLE, INTRO, [
        harness.section_heading(MODULE, argv), "", harness.machine_line(args.device), "",
        setup, "", *harness.table_header(COLUMNS)])
    t0 = time.perf_counter()
    if args.model == "quickstart":
        run_cnn(args, src)
    else:
        for B, m in args.settings:
            run_mlp(args, src, B, m)
    harness.append_lines(args.out, "", f"Wall time {time.perf_counter() - t0:.0f} s.")


if __name__ == "__main__":
    main()
