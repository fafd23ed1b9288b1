"""Privacy against utility: the same audited federation at several DP-SGD noise levels.

For an auditor deciding how much noise a federation needs: each noise multiplier gets one run of
the demo's federation (3 clients, photos, ReLU MLP, Opacus DP-SGD with per-sample clipping),
audited in audit mode, and one report puts side by side the privacy spent (ε at δ), the model's
accuracy, and what the server reconstructed (certified batches, PSNR against the true photos,
share of recognisable samples), with the privacy-utility plot.

    .venv/bin/python -m experiments.audit_sweep                        # noise 0, 0.3, 1, 3
    .venv/bin/python -m experiments.audit_sweep --noise 0,1 --rounds 5 --set lr=0.05

The demo's federation with three rounds and a learning rate of 0.1, so that the model learns
something to trade against; ``--set`` changes any run-config key.

Writes ``runs/sweep-<time>/`` (each run's own directory and report inside, plus ``sweep.json``
and ``report.html``) and prints the table. Exit status 2 on a bad setting, 1 when a run failed.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from experiments import harness
from experiments.demo import DEMO_CONFIG, ROOT, checked_config, quiet_logging, simulate

READABLE_DB = 25.0


def sweep_row(noise: float, summary: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """One row of the sweep: privacy spent, accuracy, and what the server read."""
    from fl_attack_flwr.output.private_files import records_from_jsonl

    lines = records_from_jsonl(run_dir / "metrics.jsonl")
    samples = [p for ln in lines for p in (ln.get("psnr") or [])]
    evaluate = summary.get("evaluate_metrics") or {}
    last = evaluate[max(evaluate, key=int)] if evaluate else {}
    eps = summary.get("epsilon")
    return {
        "noise": noise,
        "epsilon": math.inf if eps in (None, "inf") else float(eps),
        "delta": summary.get("delta"),
        "accuracy": last.get("eval-acc"),
        "psnr_mean": summary.get("psnr_mean"),
        "readable_share": (sum(p > READABLE_DB for p in samples) / len(samples)
                           if samples else None),
        "samples": len(samples),
        "certified": summary.get("certified"),
        "protected": summary.get("protected"),
        "attacked": summary.get("attacked"),
        "verdict": summary.get("verdict"),
        "verdict_level": summary.get("verdict_level"),
        "report": str(Path(summary["report"]).relative_to(run_dir.parent)),
    }


def plot_png(rows: list[dict[str, Any]]) -> bytes:
    """Leakage and accuracy against ε (ε = ∞, no noise, drawn at the right edge)."""
    import io

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    finite = [r["epsilon"] for r in rows if math.isfinite(r["epsilon"])]
    inf_x = 10 * max(finite) if finite else 1.0
    xs = [r["epsilon"] if math.isfinite(r["epsilon"]) else inf_x for r in rows]
    lo, hi = min(xs) / 2, max(xs) * 2
    leak = [100 * (r["readable_share"] or 0.0) for r in rows]  # protected: nothing read
    cert = [100 * (r["certified"] or 0) / max(1, r["attacked"] or 0) for r in rows]
    acc = [None if r["accuracy"] is None else 100 * r["accuracy"] for r in rows]
    fig = Figure(figsize=(10, 3.6), dpi=100)
    FigureCanvasAgg(fig)
    for i, (title, series) in enumerate((
            ("leakage: what the server read", [("samples recognisable (> 25 dB)", leak, "o-"),
                                              ("batches certified exact", cert, "s--")]),
            ("utility: model accuracy", [("accuracy", acc, "o-")]))):
        ax = fig.add_subplot(1, 2, i + 1)
        for label, ys, style in series:
            pts = [(x, y) for x, y in zip(xs, ys, strict=True) if y is not None]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=label)
        for x, r in zip(xs, rows, strict=True):
            ax.annotate(f"σ={r['noise']:g}", (x, 0), fontsize=8, textcoords="offset points",
                        xytext=(-10, -28), annotation_clip=False)
        ax.set_xscale("log")
        ax.set_xlim(lo, hi)
        ax.set_ylim(-5, 105)
        ax.set_ylabel("%")
        ax.set_xlabel("ε (right edge: ε = ∞, no noise)", labelpad=16)
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8, loc="center left")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def render(rows: list[dict[str, Any]], config: dict[str, Any]) -> str:
    """The sweep's HTML report: what each noise level buys, in one table and one plot."""
    from fl_attack_flwr.output.report import fmt, html_table, inline_png

    def pct(v: float | None) -> str:
        return "–" if v is None else f"{100 * v:.0f}%"

    table = html_table(
        ["noise multiplier σ", "ε", "δ", "accuracy", "mean PSNR [dB]",
         f"samples > {READABLE_DB:.0f} dB", "certified", "protected", "verdict", "run"],
        [[fmt(r["noise"]), fmt(r["epsilon"]), fmt(r["delta"]), pct(r["accuracy"]),
          fmt(r["psnr_mean"], 1), pct(r["readable_share"]),
          f"{r['certified']} of {r['attacked']}", f"{r['protected']} of {r['attacked']}",
          fmt(r["verdict"]), f"<a href='{r['report']}'>report</a>"] for r in rows],
        left=(8,))
    safe = [r for r in rows if (r["readable_share"] or 0) == 0 and r["certified"] == 0]
    headline = (f"The smallest noise that kept every sample unrecognisable to this attack in "
                f"this run: "
                f"σ = {min(r['noise'] for r in safe):g}." if safe else
                "At every noise level tried, the server recognised some of the clients' data.")
    settings = ", ".join(f"{k} = {v}" for k, v in sorted(config.items())
                         if k not in ("noise-multiplier", "run-name", "output-dir"))
    return ("<!DOCTYPE html><html><head><meta charset='utf-8'><title>fl-attack DP sweep"
            "</title><style>body{font-family:sans-serif;margin:2em;max-width:1200px}"
            "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:3px 8px;"
            "text-align:right}td.l{text-align:left}.v{font-size:1.15em;padding:1em;"
            "background:#fff3cd;border:2px solid #d4a017}</style></head><body>"
            "<h1>Privacy against utility: DP-SGD noise sweep</h1>"
            f"<div class='v' id='verdict'>{fmt(headline)}</div>"
            "<p>Each row is one run of the same federation with the clients' DP-SGD noise "
            "multiplier σ; ε is the privacy each client spent (Opacus' RDP accountant), the "
            "accuracy is the clients' evaluation after the last round, and PSNR compares the "
            "server's reconstructions with the clients' true photos (&gt; 90 dB exact, "
            f"&gt; {READABLE_DB:.0f} dB recognisable).</p>{table}"
            f"{inline_png(plot_png(rows), 'privacy against utility')}"
            f"<h2>Settings</h2><p>{fmt(settings)}</p></body></html>")


def main(argv: list[str] | None = None) -> int:
    """CLI entry point (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--noise", default="0,0.3,1,3", help="noise multipliers, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-seconds", type=float, default=30.0, help="budget per attack")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--out", default=str(ROOT / "runs"))
    args = parser.parse_args(argv)
    from fl_attack_flwr.app.run_config import RunConfigError
    from fl_attack_flwr.output.private_files import (
        atomic_write_bytes,
        jsonable,
        make_private_dir,
    )

    try:
        levels = [float(v) for v in args.noise.split(",") if v.strip()]
    except ValueError:
        parser.error(f"--noise must be numbers, got {args.noise!r}")
    config = {**DEMO_CONFIG, "protocol": "dpsgd", "num-server-rounds": args.rounds,
              "max-seconds": args.max_seconds, "lr": 0.1,
              **harness.parse_assignments(parser, args.set, "--set", metavar="KEY=VALUE")}
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    try:
        for z in levels:  # every setting checked before the first run
            checked_config({**config, "noise-multiplier": z, "output-dir": args.out})
    except RunConfigError as exc:
        print(f"audit_sweep: {exc}", file=sys.stderr)
        return 2
    Path(args.out).mkdir(parents=True, exist_ok=True, mode=0o700)
    out = make_private_dir(Path(args.out).absolute() / f"sweep-{stamp}", exist_ok=False)
    quiet_logging()
    rows = []
    for z in levels:
        summary = simulate({**config, "noise-multiplier": z, "output-dir": str(out),
                            "run-name": f"noise-{z:g}"})
        if summary.get("status") != "completed":
            print(f"audit_sweep: the run at noise {z:g} failed", file=sys.stderr)
            return 1
        rows.append(sweep_row(z, summary, out / f"noise-{z:g}"))
        print(f"σ={z:g}: ε={rows[-1]['epsilon']:.3g}, accuracy {rows[-1]['accuracy']}, "
              f"PSNR {rows[-1]['psnr_mean']}, {rows[-1]['verdict']}", flush=True)
    atomic_write_bytes(out / "sweep.json", json.dumps(jsonable(rows), indent=2).encode())
    atomic_write_bytes(out / "report.html", render(rows, config).encode())
    print(f"Report: {out / 'report.html'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
