"""Pixels from a CNN's update: SPEAR on fc1, then feature inversion, against the baselines.

A Flower quickstart client (``QuickstartNet``, or the wider ``WideCNN``) takes one FedSGD step
(SGD lr 0.1, momentum 0.9: the update is lr x the gradient) on B real images normalised with
mean 0.5 / std 0.5. The server runs SPEAR on fc1's update (``fl_attack.invert`` with the
weights it sent) to recover fc1's input features, then ``fl_attack.pixels.invert_features``
turns them into images. Compared, with the same wall-clock budget and restarts, with Inverting
Gradients on the full update (``testbed.baselines.gradient_matching``, given the true labels)
and with the batch-mean image. Scores: matched PSNR and SSIM on images in [0, 1]
(``testbed.metrics.score_batch``).

Parts (``--parts``):

* ``ablation`` -- the objective's terms, each removed (or added) at the same budget, on
  photos32 (the tuning source; seeds from ``--first-seed``);
* ``main`` -- the settings of ``--settings`` (model / training epochs / B / source); photos32
  batches use seeds from ``--first-seed``, the held-out sources (greys32, hopper32) seeds from
  ``--held-out-seed``;
* ``certify`` -- the largest B at which SPEAR certifies QuickstartNet's fc1 (m = 120) on one
  step, with the update's numerical rank and the activation patterns behind a failure.

Writes a dated section to ``experiments/results/cnn.md`` (``--out``) and keeps the file's
"Current results" table (one row per setting, newest measurement) up to date.

    python -m experiments.bench_cnn                       # everything (about 2 h on 2 CPUs)
    python -m experiments.bench_cnn --parts main --settings quickstart/0/8/greys32
    python -m experiments.bench_cnn --smoke               # < 2 min, to /tmp/cnn_smoke.md
"""

from __future__ import annotations

import argparse
import fcntl
import re
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

import fl_attack
from experiments import harness
from fl_attack.errors import NotIdentifiable
from fl_attack.model.split import feature_extractor
from fl_attack.pixels import PixelConfig, feature_gradients, invert_features
from fl_attack.testbed import baselines, cnn, data, metrics

MODULE = "experiments.bench_cnn"
RESULTS = harness.RESULTS_DIR / "cnn.md"
TITLE = "Pixels from a CNN's update: SPEAR on fc1, then feature inversion"
INTRO = """One FedSGD step of Flower's quickstart CNN (`QuickstartNet`: conv 3->6 k5, pool,
conv 6->16 k5, pool, fc1 400->120, fc2, fc3; or `WideCNN`: conv 3->32->64 k3, fc1
4096->1024) on B real 32x32 images normalised to [-1, 1], SGD lr 0.1 (update = lr x gradient).
SPEAR on fc1's update recovers fc1's input features (*features*: PSNR of the recovered rows
against the true ones, peak = the largest true feature, and the share of batches certified
exact); `fl_attack.pixels.invert_features` turns them into images (*pixels*). Baselines at the
same wall-clock budget and restarts: Inverting Gradients (cosine distance on every layer's
update + TV, true labels given), and every sample replaced by the batch-mean image. PSNR / SSIM
are matched per sample on images in [0, 1] and averaged over the batches. *Training*: `init`
is the seeded initialisation; `N ep` is after `quickstart_train` for N epochs on 256 other
photo crops. photos32 is the tuning source; greys32 and hopper32 were never looked at while
tuning. `python -m experiments.bench_cnn`."""
CURRENT_START = "<!-- current results: start -->"
CURRENT_END = "<!-- current results: end -->"
CURRENT_COLUMNS = ("model", "training", "B", "source", "batches", "features PSNR / certified",
                   "pixels PSNR / SSIM / s", "gradient matching PSNR / SSIM",
                   "batch mean PSNR / SSIM", "date", "commit", "section")
SETTINGS = ("quickstart/0/8/photos32", "quickstart/0/8/greys32", "quickstart/0/8/hopper32",
            "quickstart/2/8/photos32", "quickstart/2/8/greys32", "quickstart/2/8/hopper32",
            "wide/0/8/photos32", "wide/0/8/greys32", "wide/0/8/hopper32",
            "quickstart/0/16/photos32", "quickstart/0/32/photos32")
HELD_OUT = ("greys32", "hopper32")


@dataclass(frozen=True)
class Setting:
    """One row: the model, its training before the attacked step, B, the image source."""

    model: str
    trained: int
    batch: int
    source: str

    @classmethod
    def parse(cls, text: str) -> Setting:
        """``"quickstart/0/8/photos32"`` -> Setting."""
        model, trained, batch, source = text.strip().split("/")
        return cls(model, int(trained), int(batch), source)

    @property
    def training(self) -> str:
        return "init" if not self.trained else f"{self.trained} ep"


@dataclass
class Case:
    """One attacked batch: the truth, what the server holds, and SPEAR's features."""

    images: torch.Tensor
    labels: torch.Tensor
    model: torch.nn.Module
    view: cnn.ServerView
    rec: fl_attack.Reconstruction
    true_features: torch.Tensor
    spear_seconds: float


def client_step(setting: Setting, seed: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.nn.Module, cnn.ServerView]:
    """The batch, the model (seeded by the batch seed, optionally trained) and one step."""
    x01, y = data.sample_batch(setting.source, setting.batch, seed=seed)
    model = cnn.build(setting.model, seed=seed)
    if setting.trained:
        xt, yt = data.sample_batch("photos32", 256, seed=seed, pool_seed=1)
        state = cnn.quickstart_train(model, cnn.quickstart_normalize(xt), yt,
                                     epochs=setting.trained, seed=seed)
        model.load_state_dict(state)
    view = cnn.fedsgd_step(model, cnn.quickstart_normalize(x01), y, lr=0.1)
    return x01, y, model, view


def make_case(setting: Setting, seed: int, spear_seconds: float) -> Case:
    """One client step, then SPEAR on fc1's update with the weights the server sent.

    Raises ``fl_attack.errors.NotIdentifiable`` when the update's rank reading rules SPEAR out.
    """
    x01, y, model, view = client_step(setting, seed)
    t0 = time.perf_counter()
    rec = fl_attack.invert(view.update("fc1.weight"), view.update("fc1.bias"),
                           weight=view.before["fc1.weight"], bias=view.before["fc1.bias"],
                           seed=0, max_seconds=spear_seconds, device="cpu")
    spear = time.perf_counter() - t0
    with torch.no_grad():
        true = feature_extractor(model, "fc1.weight")(cnn.quickstart_normalize(x01)).double()
    return Case(x01, y, model, view, rec, true, spear)


def features_psnr(case: Case) -> float:
    """Matched PSNR of SPEAR's rows against the true features, peak = largest true feature."""
    peak = float(case.true_features.abs().max())
    return metrics.score_batch(case.rec.inputs, case.true_features, data_range=peak).mean_psnr


def score(images_model_space: torch.Tensor, case: Case) -> tuple[float, float]:
    """Mean matched PSNR and SSIM of images (model space) against the batch, in [0, 1]."""
    rec01 = cnn.quickstart_denormalize(images_model_space).clamp(0, 1).double()
    s = metrics.score_batch(rec01, case.images.double(), with_ssim=True)
    assert s.ssim is not None
    return s.mean_psnr, float(s.ssim.mean())


def run_pixels(case: Case, cfg: PixelConfig, budget: float, restarts: int
               ) -> tuple[float, float, float, int]:
    """``invert_features`` on SPEAR's features; (PSNR, SSIM, seconds, steps)."""
    extractor = feature_extractor(case.model, "fc1.weight")
    upstream = param_grads = None
    if cfg.gradient > 0:
        upstream = feature_gradients(case.view.update("fc1.weight"), case.rec.inputs,
                                     case.view.before["fc1.weight"]).float()
        param_grads = {k: case.view.update(k).float() for k in case.view.before
                       if k.startswith(("conv1.", "conv2."))}
    out = invert_features(case.rec.inputs.float(), extractor, input_shape=(3, 32, 32),
                          bounds=cnn.QUICKSTART_BOUNDS, upstream=upstream,
                          param_grads=param_grads, max_seconds=budget, restarts=restarts,
                          seed=0, device="cpu", config=cfg)
    return (*score(out.images, case), out.seconds, out.steps)


def run_baselines(case: Case, budget: float, restarts: int) -> dict[str, tuple[float, float]]:
    """Gradient matching (same budget, restarts) and the batch-mean image."""
    update = {k: case.view.update(k).float() for k in case.view.before}
    gm = baselines.gradient_matching(case.model, update, case.labels, input_shape=(3, 32, 32),
                                     bounds=cnn.QUICKSTART_BOUNDS, max_seconds=budget,
                                     restarts=restarts, seed=0)
    mean01 = baselines.batch_mean(case.images).double()
    s = metrics.score_batch(mean01, case.images.double(), with_ssim=True)
    assert s.ssim is not None
    return {"gm": score(gm.images, case), "mean": (s.mean_psnr, float(s.ssim.mean()))}


def seeds_for(source: str, args: argparse.Namespace) -> list[int]:
    first = args.held_out_seed if source in HELD_OUT else args.first_seed
    return list(range(first, first + args.batches))


def mean(values: Sequence[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


def run_setting(setting: Setting, args: argparse.Namespace, cfg: PixelConfig) -> list[object]:
    """All batches of one setting; returns its row of the main table."""
    rows: dict[str, list[float]] = {k: [] for k in ("fp", "cert", "pp", "ps", "pt", "gp", "gs",
                                                    "mp", "ms", "spear")}
    errors = 0
    for seed in seeds_for(setting.source, args):
        try:
            case = make_case(setting, seed, args.spear_seconds)
        except NotIdentifiable as exc:
            errors += 1
            print(f"  {setting} seed {seed}: not identifiable ({exc.reason})", flush=True)
            continue
        pp, ps, pt, _ = run_pixels(case, cfg, args.max_seconds, args.restarts)
        base = run_baselines(case, args.max_seconds, args.restarts)
        for key, value in (("fp", features_psnr(case)), ("cert", float(case.rec.exact)),
                           ("pp", pp), ("ps", ps), ("pt", pt), ("gp", base["gm"][0]),
                           ("gs", base["gm"][1]), ("mp", base["mean"][0]),
                           ("ms", base["mean"][1]), ("spear", case.spear_seconds)):
            rows[key].append(value)
        print(f"  {setting} seed {seed}: exact {case.rec.exact}, pixels {pp:.2f} dB / {ps:.3f}, "
              f"GM {base['gm'][0]:.2f} / {base['gm'][1]:.3f}, mean {base['mean'][0]:.2f}",
              flush=True)
    m = {k: mean(v) for k, v in rows.items()}
    n = len(rows["fp"])
    return [setting.model, setting.training, setting.batch, setting.source, n,
            f"{m['fp']:.1f} / {int(sum(rows['cert']))} of {n}"
            + (f" ({errors} more not identifiable)" if errors else ""),
            f"{m['pp']:.2f} / {m['ps']:.3f} / {m['pt']:.0f}",
            f"{m['gp']:.2f} / {m['gs']:.3f}", f"{m['mp']:.2f} / {m['ms']:.3f}",
            f"{m['spear']:.1f}"]


MAIN_COLUMNS = ("model", "training", "B", "source", "batches", "features PSNR / certified",
                "pixels PSNR / SSIM / s", "gradient matching PSNR / SSIM",
                "batch mean PSNR / SSIM", "SPEAR s")


def part_main(args: argparse.Namespace, cfg: PixelConfig, anchor: str) -> list[str]:
    """The main table, one row per setting; each row also goes into the current table."""
    lines = ["### Settings", "", *harness.table_header(MAIN_COLUMNS)]
    for text in args.settings:
        row = run_setting(Setting.parse(text), args, cfg)
        lines.append(harness.table_row(row))
        update_current(args.out, row[:9], anchor, args.commit)
    return lines


ABLATIONS: dict[str, dict[str, object]] = {
    "all terms (default)": {},
    "no TV": {"tv": 0.0, "tv_end": 0.0},
    "TV without the colour weighting": {"chroma": 1.0},
    "single scale (no coarse-to-fine)": {"scales": (1,)},
    "features only (no TV, single scale)": {"tv": 0.0, "tv_end": 0.0, "scales": (1,)},
    "+ gradient consistency (0.1, stages 2-3)": {"gradient": 0.1, "gradient_from": 1},
    "+ gradient consistency (1.0, stages 2-3)": {"gradient": 1.0, "gradient_from": 1},
}


def part_ablation(args: argparse.Namespace, cfg: PixelConfig) -> list[str]:
    """Each term removed or added, same budget, QuickstartNet at init, B = 8, photos32."""
    setting = Setting("quickstart", 0, 8, "photos32")
    cases = [make_case(setting, s, args.spear_seconds) for s in seeds_for("photos32", args)]
    lines = [f"### Ablation: QuickstartNet at init, B = 8, photos32, {len(cases)} batches "
             f"({sum(c.rec.exact for c in cases)} certified), {args.max_seconds:g} s, "
             f"{args.restarts} restarts", "",
             *harness.table_header(("objective", "PSNR", "SSIM", "seconds", "steps"), "lrrrr")]
    variants = list(ABLATIONS.items())[: args.ablations]
    for name, change in variants:
        variant = replace(cfg, **change)  # type: ignore[arg-type]
        out = [run_pixels(c, variant, args.max_seconds, args.restarts) for c in cases]
        lines.append(harness.table_row(
            [name, f"{mean([o[0] for o in out]):.2f}", f"{mean([o[1] for o in out]):.3f}",
             f"{mean([o[2] for o in out]):.1f}", f"{mean([o[3] for o in out]):.0f}"]))
        print(f"  ablation {name}: {mean([o[0] for o in out]):.2f} dB", flush=True)
    base = [run_baselines(c, args.max_seconds, args.restarts) for c in cases]
    for key, name in (("gm", "gradient matching alone (baseline)"), ("mean", "batch mean")):
        lines.append(harness.table_row(
            [name, f"{mean([b[key][0] for b in base]):.2f}",
             f"{mean([b[key][1] for b in base]):.3f}", "-", "-"]))
    return lines


def patterns(model: torch.nn.Module, x01: torch.Tensor, view: cnn.ServerView
             ) -> dict[str, float]:
    """fc1's activation patterns on the batch (ground truth, for explaining a failure) and
    the spectrum of its update."""
    with torch.no_grad():
        feats = feature_extractor(model, "fc1.weight")(cnn.quickstart_normalize(x01)).double()
    w, b = view.before["fc1.weight"].double(), view.before["fc1.bias"].double()
    active = (feats @ w.T + b) > 0  # (B, m)
    diff = (active[:, None, :] != active[None, :, :]).sum(-1).double()
    diff.fill_diagonal_(float("inf"))
    update = view.update("fc1.weight")
    sv = torch.linalg.svdvals(update)
    bsz = active.shape[0]
    return {"on_all": int(active.all(0).sum()), "dead": int((~active).all(0).sum()),
            "varying": int((active.any(0) & ~active.all(0)).sum()),
            "hamming": float(diff.min()), "rows": int(update.abs().sum(1).gt(0).sum()),
            "gap": float(sv[bsz - 1] / sv[bsz]) if sv.numel() > bsz else float("inf")}


CERTIFY_COLUMNS = ("B", "batches", "certified", "not identifiable", "mean λ", "features PSNR",
                   "numerical rank (SPEAR's reading)", "σ_B / σ_B+1", "non-zero rows",
                   "units on for all", "units off for all", "units that vary",
                   "min Hamming distance", "SPEAR s")


def certify_batch(bsz: int, seed: int, spear_seconds: float) -> dict[str, object]:
    """SPEAR on one batch of size ``bsz``, with the patterns behind its outcome."""
    setting = Setting("quickstart", 0, bsz, "photos32")
    x01, _, model, view = client_step(setting, seed)
    out: dict[str, object] = dict(patterns(model, x01, view))
    try:
        case = make_case(setting, seed, spear_seconds)
    except NotIdentifiable as exc:
        out.update(exact=False, error=True, rank=exc.rank)
        return out
    out.update(exact=case.rec.exact, error=False, rank=case.rec.batch_size,
               lam=case.rec.sparsity_match or 0.0, fpsnr=features_psnr(case),
               seconds=case.spear_seconds)
    return out


def part_certify(args: argparse.Namespace) -> list[str]:
    """The largest B SPEAR certifies on QuickstartNet's fc1 (m = 120), one FedSGD step."""
    lines = ["### Largest certified B: QuickstartNet fc1 (m = 120), at init, photos32, SPEAR "
             f"budget {args.spear_seconds:g} s", "", *harness.table_header(CERTIFY_COLUMNS)]
    for bsz in args.certify_batches:
        res = [certify_batch(bsz, s, args.spear_seconds)
               for s in range(args.first_seed, args.first_seed + args.certify_seeds)]
        ran = [r for r in res if not r["error"]]
        row = [bsz, len(res), sum(bool(r["exact"]) for r in res), sum(bool(r["error"]) for r in res),
               f"{mean([r['lam'] for r in ran]):.3f}", f"{mean([r['fpsnr'] for r in ran]):.1f}",
               "/".join(str(r["rank"]) for r in res),
               f"{statistics.median(float(r['gap']) for r in res):.2g}"]
        row += [f"{mean([float(r[k]) for r in res]):.1f}"
                for k in ("rows", "on_all", "dead", "varying", "hamming")]
        row.append(f"{mean([r['seconds'] for r in ran]):.1f}")
        lines.append(harness.table_row(row))
        print(f"  certify B={bsz}: {row}", flush=True)
    return lines


def short_commit() -> str:
    """The measured code's commit hash alone (``harness.code_version`` without the words)."""
    return re.sub(r"^commit ", "", harness.code_version()).split()[0].rstrip(",;.")


def update_current(path: Path, cells: Sequence[object], anchor: str, commit: str) -> None:
    """Put this setting's newest row into the file's "Current results" table."""
    date = time.strftime("%Y-%m-%d", time.gmtime())
    row = harness.table_row([*cells, date, commit, f"[{anchor}](#{anchor})"])
    key = harness.table_row(cells[:4])[:-1]
    with path.open("r+", encoding="utf-8") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        text = fh.read()
        head, rest = text.split(CURRENT_START, 1)
        table, tail = rest.split(CURRENT_END, 1)
        lines = [ln for ln in table.strip().splitlines() if ln.startswith("|")]
        body = [ln for ln in lines[2:] if not ln.startswith(key)] + [row]
        order = {s: i for i, s in enumerate(SETTINGS)}
        body.sort(key=lambda ln: order.get("/".join(c.strip() for c in ln.split("|")[1:5])
                                          .replace(" ep", "").replace("init", "0"), 99))
        block = "\n".join([*harness.table_header(CURRENT_COLUMNS), *body])
        fh.seek(0)
        fh.write(f"{head}{CURRENT_START}\n{block}\n{CURRENT_END}{tail}")
        fh.truncate()


def write_section(path: Path, heading: str, setup: str, lines: Sequence[str]) -> None:
    """Append one part's whole section (heading, machine, setup, table) under a file lock, so
    that runs of different parts at the same time never interleave; a new file first gets its
    title, introduction and an empty current table."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        if fh.tell() == 0:
            table = "\n".join(harness.table_header(CURRENT_COLUMNS))
            fh.write(f"# {TITLE}\n\n{INTRO}\n\n## Current results\n\n{CURRENT_START}\n{table}\n"
                     f"{CURRENT_END}\n\n## History (oldest first)\n")
        if heading:
            fh.write("\n" + "\n".join([heading, "", setup, "", *lines]) + "\n")
        fh.flush()


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=MODULE, description=__doc__.splitlines()[0])
    harness.add_batches(parser, 5)
    harness.add_first_seed(parser)
    harness.add_out(parser, RESULTS)
    parser.add_argument("--held-out-seed", type=int, default=100,
                        help="seed of the first greys32 / hopper32 batch (default 100)")
    parser.add_argument("--max-seconds", type=float, default=30.0,
                        help="budget of the pixels and of gradient matching, each (default 30)")
    parser.add_argument("--spear-seconds", type=float, default=60.0,
                        help="SPEAR's budget on fc1 (default 60)")
    parser.add_argument("--restarts", type=int, default=4, help="restarts of both (default 4)")
    parser.add_argument("--parts", type=harness.list_of(str, "--parts"),
                        default=["ablation", "main", "certify"])
    parser.add_argument("--settings", type=harness.list_of(str, "--settings"),
                        default=list(SETTINGS), help="model/epochs/B/source items")
    parser.add_argument("--ablations", type=int, default=len(ABLATIONS),
                        help="how many ablation variants to run, in order")
    parser.add_argument("--certify-batches", type=harness.list_of(int, "--certify-batches"),
                        default=[8, 16, 24, 32, 40, 48, 64])
    parser.add_argument("--certify-seeds", type=int, default=3)
    parser.add_argument("--smoke", action="store_true",
                        help="a tiny run (< 2 min on a CPU) to /tmp/cnn_smoke.md")
    args = parser.parse_args(argv)
    if args.smoke:
        args.batches, args.max_seconds, args.spear_seconds, args.restarts = 1, 4.0, 20.0, 2
        args.settings, args.ablations = ["quickstart/0/8/photos32"], 2
        args.certify_batches, args.certify_seeds = [8, 120], 1
        if args.out == RESULTS:
            args.out = Path("/tmp/cnn_smoke.md")
    for part in args.parts:
        if part not in ("ablation", "main", "certify"):
            parser.error(f"--parts: unknown part {part!r} (ablation, main, certify)")
    for text in args.settings:
        try:
            Setting.parse(text)
        except ValueError:
            parser.error(f"--settings: {text!r} is not model/epochs/B/source")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    torch.set_num_threads(1)
    args = parse_args(argv)
    started = harness.utc_now()
    args.commit = short_commit()  # once: the checkout may move during a long run
    setup = (f"{harness.machine_line('cpu')}\n\nBudget {args.max_seconds:g} s and "
             f"{args.restarts} restarts for the pixels and for gradient matching; SPEAR budget "
             f"{args.spear_seconds:g} s; photos32 seeds from {args.first_seed}, held-out seeds "
             f"from {args.held_out_seed}.")
    cfg = PixelConfig()
    parts = {"ablation": lambda _a: part_ablation(args, cfg),
             "main": lambda a: part_main(args, cfg, a),
             "certify": lambda _a: part_certify(args)}
    write_section(args.out, "", "", [])  # the file and its current table exist from here on
    for name in args.parts:
        t0 = time.perf_counter()
        anchor = f"cnn-{started:%Y-%m-%d-%H%M}-{name}"
        lines = parts[name](anchor)
        heading = (f'<a id="{anchor}"></a>\n\n' + harness.section_heading(MODULE, argv, started)
                   + f" — part `{name}`")
        write_section(args.out, heading, setup, [*lines, "", f"({(time.perf_counter() - t0) / 60:.1f} min)"])
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
