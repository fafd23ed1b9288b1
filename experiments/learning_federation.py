"""``make demo-train``: a federation that learns, audited round after round.

The question an auditor asks of a real federation is whether the server can read its clients
*while the model trains*, not only at its initialisation. This runs the bundled app where its
model really learns (real MNIST digits, FedAvg with 5 local steps on each client's batch of
16, 30 rounds: accuracy on samples the clients never train on goes from about chance to above
80%), with the audit on every round, in the background (the aggregate leaves at once; the
attacks run on a pool of worker processes at niceness 19, off the round's critical path). The
same federation then runs again with ``audit-enabled = false``, so that the audit's cost per
round is measured against the plain round.

    .venv/bin/python -m experiments.learning_federation          # about 8 minutes on 2 cores
    .venv/bin/python -m experiments.learning_federation --rounds 50 --set audit-max-per-round=1

The audited run's ``report.html`` shows the per-round table and the plot of leakage and
accuracy against the round, with one sentence on how leakage changed as the model trained.
A section goes to ``experiments/results/training.md`` (``--out`` to write elsewhere): the
machine, date, commit and command, the per-round table, that sentence, the wall time of both
runs and the audit's overhead per round. ``--set`` changes any run-config key of both runs.
Exit status 2 on a bad setting, 1 when a run failed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from experiments import harness
from experiments.demo import DEMO_CONFIG, ROOT, checked_config

MODULE = "experiments.learning_federation"
OUT = harness.RESULTS_DIR / "training.md"
TITLE = "Leakage while the model trains: a learning federation, audited every round"
INTRO = ("The bundled app on data where its model learns, audited on every round in the "
         "background, beside the same federation without the audit; produced by "
         "`make demo-train` (`python -m experiments.learning_federation`).")

#: The learning federation (over the demo's settings): accuracy far above chance in 30 rounds.
LEARNING_CONFIG: dict[str, Any] = {
    **DEMO_CONFIG,
    "num-server-rounds": 30,
    "dataset": "mnist",
    "dataset-size": 2000,
    "protocol": "fedavg",
    "batch-size": 16,
    "mini-batch-size": 0,
    "local-epochs": 5,
    "lr": 0.1,
    "eval-size": 64,
    "eval-held-out": True,
    "max-seconds": 20.0,
    "attack-timeout": 120.0,
    "audit-mode": "background",
    "audit-executor": "pool",
}
#: What the plain run changes: no audit at all (the wrapper only delegates).
PLAIN: dict[str, Any] = {"audit-enabled": False, "audit": False}


def run_one(config: Mapping[str, Any], out_dir: Path, name: str) -> tuple[dict[str, Any], float]:
    """One simulation in a fresh process (Ray starts and stops with it): its summary and the
    process's wall time in seconds."""
    args = [sys.executable, "-m", "experiments.demo", "--json"]
    for key, value in {**config, "output-dir": str(out_dir), "run-name": name}.items():
        args += ["--set", f"{key}={json.dumps(value)}"]
    t0 = time.time()
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    seconds = time.time() - t0
    if proc.returncode not in (0, 3):  # 3: a privacy gate tripped; the run completed
        raise RuntimeError(f"the {name} run failed:\n{proc.stderr[-4000:]}")
    return json.loads((out_dir / name / "summary.json").read_text()), seconds


def timings(summary: Mapping[str, Any]) -> dict[str, Any]:
    """A run's clock: each round's wall time (from the end of the round before to the end of
    its evaluation), their mean over rounds 2..R (round 1 also starts Ray and the attack
    workers), when the federation ended and when the last audit result was stored."""
    per_round = summary["per_round"]
    ends = [float(per_round[k]["round-end-seconds"]) for k in sorted(per_round, key=int)]
    walls = [b - a for a, b in zip([0.0, *ends], ends, strict=False)]
    last = [float(ln["stored_at"]) for ln in _metrics(summary) if ln.get("stored_at")]
    return {"rounds": walls, "round_mean": statistics.mean(walls[1:] or walls),
            "federation": ends[-1] if ends else None,
            "audit_done": max(last) if last and summary["attacked"] else None,
            "wall": float(summary["wall_seconds"])}


def _metrics(summary: Mapping[str, Any]) -> list[dict[str, Any]]:
    from fl_attack_flwr.output.private_files import records_from_jsonl

    return records_from_jsonl(Path(summary["run_dir"]) / "metrics.jsonl")


def _f(v: float | None, digits: int = 1) -> str:
    return "–" if v is None else f"{v:.{digits}f}"


def round_table(summary: Mapping[str, Any], audited: Sequence[float],
                plain: Sequence[float]) -> list[str]:
    """The per-round table: accuracy, what the server read, both runs' round wall times."""
    rows = []
    for row, wall, base in zip(summary["by_round"], audited, plain, strict=False):
        acc = row["accuracy"]
        rows.append([row["round"], "–" if acc is None else f"{100 * acc:.1f}%",
                     f"{row['read']} of {row['samples']}" if row["attacked"] else "–",
                     f"{row['certified']} of {row['attacked']}", row["no_answer"],
                     _f(wall, 2), _f(base, 2)])
    return harness.markdown_table(
        ("round", "accuracy", "samples read", "updates certified", "no answer",
         "round s (audited)", "round s (plain)"), rows, "rrrrrrr")


def setup_line(config: Mapping[str, Any]) -> str:
    """The federation and the audit in one paragraph."""
    audited = ("every client's update" if float(config["audit-fraction"]) >= 1
               and not int(config.get("audit-max-per-round", 0)) else "a sample of the updates")
    return (f"Setup: {config['num-clients']} clients, {config['protocol']} "
            f"({config['local-epochs']} local epoch(s), mini-batch "
            f"{config['mini-batch-size'] or 'the whole batch'}, lr {config['lr']}), B = "
            f"{config['batch-size']} per client and round, ReLU MLP {config['depth']} x "
            f"{config['width']}, `{config['dataset']}` (IID shards of "
            f"{config['dataset-size']}), {config['num-server-rounds']} rounds, Flower's "
            f"simulation engine. Accuracy: the global model after the round on "
            f"{config['eval-size']} samples per client"
            f"{' that it never trains on' if config['eval-held-out'] else ''}. Audit: "
            f"{audited}, every round, {config['attack-method']} with a budget of "
            f"{config['max-seconds']:g} s, "
            f"{config['audit-mode']} on the {config['audit-executor']} executor; samples read "
            "= recognisable (PSNR > 25 dB) against the client's true batch. Round s = from the "
            "end of the round before to the end of the round's evaluation.")


def timing_lines(audited: Mapping[str, Any], plain: Mapping[str, Any], seconds: Sequence[float]
                 ) -> list[str]:
    """Both runs' wall times and the audit's overhead per round."""
    rows = []
    for name, t, s in (("plain", plain, seconds[1]), ("audited", audited, seconds[0])):
        rows.append([name, _f(s), _f(t["federation"]), _f(t["round_mean"], 2),
                     _f(t["audit_done"]), _f(t["wall"])])
    extra = audited["round_mean"] - plain["round_mean"]
    ratio = audited["round_mean"] / plain["round_mean"] if plain["round_mean"] else None
    return [*harness.markdown_table(
        ("run", "process wall (s)", "federation ended (s)", "round, mean of 2..R (s)",
         "last audit result (s)", "report written (s)"), rows, "lrrrrr"),
        "", f"Audit overhead per round (mean of rounds 2..R): {extra:+.2f} s, "
        f"{_f(ratio, 2)}× the plain round. Times in seconds from the start of the run."]


def main(argv: list[str] | None = None) -> int:
    """Run both federations and append the section (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a run-config key of both runs (repeatable)")
    parser.add_argument("--runs", default=str(ROOT / "runs"), help="where the runs go")
    parser.add_argument("--note", default="", help="said in the header (e.g. machine load)")
    harness.add_out(parser, OUT)
    args = parser.parse_args(argv)
    from fl_attack_flwr.app.run_config import RunConfigError
    from fl_attack_flwr.output.private_files import make_private_dir
    from fl_attack_flwr.output.store import new_run_name

    config = {**LEARNING_CONFIG, "num-server-rounds": args.rounds,
              **harness.parse_assignments(parser, args.set, "--set", metavar="KEY=VALUE")}
    try:
        resolved = checked_config(config)
        checked_config({**config, **PLAIN})
    except RunConfigError as exc:
        print(f"learning_federation: {exc}", file=sys.stderr)
        return 2
    Path(args.runs).mkdir(parents=True, exist_ok=True, mode=0o700)
    out_dir = make_private_dir(Path(args.runs).absolute() / f"train-{new_run_name()}",
                               exist_ok=False)
    heading = harness.section_heading(MODULE, argv)
    try:
        plain, plain_s = run_one({**config, **PLAIN}, out_dir, "plain")
        summary, audited_s = run_one(config, out_dir, "audited")
    except RuntimeError as exc:
        print(f"learning_federation: {exc}", file=sys.stderr)
        return 1
    t_audit, t_plain = timings(summary), timings(plain)
    harness.start_section(args.out, TITLE, INTRO, [
        heading, "", harness.machine_line() + (f" {args.note}" if args.note else ""), "",
        setup_line(resolved), "", f"Verdict: {summary['verdict']}", "",
        f"**{summary['leakage_trend'] or 'Fewer than two rounds were audited.'}**", "",
        *round_table(summary, t_audit["rounds"], t_plain["rounds"]), "",
        *timing_lines(t_audit, t_plain, (audited_s, plain_s)), "",
        f"Report: `{summary['report']}` (not kept in the repository: it holds the clients' "
        "reconstructed data)."])
    print(summary["leakage_trend"])
    print(f"Report: {summary['report']}")
    print(f"appended to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
