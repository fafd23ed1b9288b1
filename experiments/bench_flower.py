"""``make bench-flower``: what the privacy audit costs a Flower round, per executor and mode.

For 3, 10 and 30 clients, runs the same federation (FedSGD, real photo crops shaped like
CIFAR-10 (``photos32``), B = 16, MLP 3 x 200, 3 rounds, Flower's simulation engine) without the
audit and audited on each executor: ``blocking`` on one worker process, on a pool of worker
processes and on Ray actors, and ``background`` on the pool. Per run it records

* the round's wall time (``configure_train`` until the aggregate is returned: sampling, client
  training, communication, and, when blocking, the attacks), as the mean of rounds 2..R (round 1
  also starts Ray's actors and the workers) and round 1 alone;
* attacks per minute: the attacked updates over the time from each round's replies to its last
  result, summed over rounds;
* the time from the start of the run until the last result was stored,

and appends a section (machine, date, command) to ``experiments/results/flower.md`` (``--out``
to write elsewhere), one row per run as it finishes; each client count's plain run goes first,
so that the audited rows can be given as multiples of its round.

    .venv/bin/python -m experiments.bench_flower [--clients 3 10 30] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from experiments import harness

MODULE = "experiments.bench_flower"
OUT = harness.RESULTS_DIR / "flower.md"
TITLE = "Flower: what the privacy audit costs a round, per executor and mode"
INTRO = ("The same federation without the privacy audit and audited on each executor and mode; "
         "produced by `make bench-flower` (`python -m experiments.bench_flower`).")
COLUMNS = ("clients", "audit", "round (s)", "round 1 (s)", "× plain round", "attacks/min",
           "last result (s)", "certified", "reconstructed", "mean PSNR (dB)")
"""The columns of a run's table."""
ALIGN = "rlrrrrrrrr"
"""Numbers right-aligned, the audit's name left."""

BASE: dict[str, Any] = {
    "protocol": "fedsgd", "dataset": "photos32", "dataset-size": 2000, "batch-size": 16,
    "width": 200, "depth": 3, "audit": True, "fraction-evaluate": 0.0, "max-seconds": 60.0,
    "attack-timeout": 600.0,
}
#: name -> run-config overrides
CONFIGS: dict[str, dict[str, Any]] = {
    "plain": {"audit-enabled": False, "audit": False},
    "blocking, process": {"audit-executor": "process"},
    "blocking, pool": {"audit-executor": "pool"},
    "background, pool": {"audit-executor": "pool", "audit-mode": "background"},
    "blocking, ray": {"audit-executor": "ray"},
}


def run_one(clients: int, rounds: int, name: str, workdir: Path) -> dict[str, Any]:
    """One simulation in a fresh process (Ray starts and stops with it): its measurements."""
    run = f"{clients}c-{name.replace(', ', '-')}"
    cfg = {**BASE, **CONFIGS[name], "num-clients": clients, "num-server-rounds": rounds,
           "output-dir": str(workdir), "run-name": run}
    args = [sys.executable, "-m", "experiments.demo", "--json"]
    for key, value in cfg.items():
        args += ["--set", f"{key}={json.dumps(value)}"]
    t0 = time.time()
    proc = subprocess.run(args, cwd=harness.ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if proc.returncode != 0:
        raise RuntimeError(f"simulation failed ({clients} clients, {name}):\n"
                           + proc.stderr[-4000:])
    summary = json.loads((workdir / run / "summary.json").read_text())
    lines = [json.loads(x) for x in (workdir / run / "metrics.jsonl").read_text().splitlines()]
    rounds = sorted(summary["per_round"], key=int)
    walls = [float(summary["per_round"][k]["train-round-seconds"]) for k in rounds]
    steady = rounds[1:] or rounds  # round 1 also starts the workers
    attacked = sum(1 for ln in lines if ln.get("attack_seconds") is not None
                   and str(ln["server_round"]) in steady)
    window = sum(float(summary["per_round"][k].get("audit-seconds", 0.0)) for k in steady)
    return {
        "clients": clients, "config": name, "process_s": time.time() - t0,
        "round1": walls[0], "round": statistics.mean(walls[1:] or walls),
        "attacks": attacked, "per_min": 60.0 * attacked / window if window else None,
        "last_result": max((ln.get("stored_at") or 0.0 for ln in lines), default=None),
        "certified": summary["certified"], "reconstructed": summary["reconstructions"],
        "replies": summary["replies"], "psnr": summary["psnr_mean"],
        "failures": summary["attack_failures"],
    }


def _f(v: float | None, digits: int = 1) -> str:
    return "–" if v is None else f"{v:.{digits}f}"


def setup_lines(rounds: int, note: str, argv: Sequence[str] | None) -> list[str]:
    """The section's opening: heading, machine, the federation's setup, the table header."""
    import flwr

    return [
        harness.section_heading(MODULE, argv),
        "",
        harness.machine_line(versions={"flwr": flwr.__version__}) + (f" {note}" if note else ""),
        "",
        f"Setup: FedSGD, photo crops shaped like CIFAR-10 (`{BASE['dataset']}`, IID partitions "
        f"of {BASE['dataset-size']}), B = {BASE['batch-size']} per client, ReLU MLP "
        f"{BASE['depth']} x {BASE['width']}, {rounds} rounds, Flower's simulation engine (Ray, "
        "1 CPU per ClientApp), FedAvg. Audited runs invert every client's first-layer update "
        f"with SPEAR++ (budget {BASE['max-seconds']:.0f} s), score it against the client's "
        "batch and store the pictures. Round = `configure_train` until the aggregate is "
        "returned (mean of rounds 2..R; round 1 also starts Ray's actors and the attack "
        "workers). Attacks/min (rounds 2..R) = attacked updates over the time from each "
        "round's replies to its last result. Last result = seconds from the start of the run.",
        "",
        *harness.table_header(COLUMNS, ALIGN),
    ]


def report_row(r: dict[str, Any], plain: float | None) -> str:
    """One run's table row; ``plain`` is the round time of the same clients without audit."""
    ratio = r["round"] / plain if plain else None
    audited = r["config"] != "plain"
    cert = f"{r['certified']}/{r['replies']}" if audited else "–"
    recon = f"{r['reconstructed']}/{r['replies']}" if audited else "–"
    return harness.table_row([
        r["clients"], r["config"], _f(r["round"], 2), _f(r["round1"]), _f(ratio, 2),
        _f(r["per_min"]) if audited else "–", _f(r["last_result"]) if audited else "–",
        cert, recon, _f(r["psnr"])])


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and append its section to the results file."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[3, 10, 30])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--note", default="", help="said in the header (e.g. machine load)")
    harness.add_out(parser, OUT)
    args = parser.parse_args(argv)
    configs = sorted(args.configs, key=lambda name: name != "plain")  # plain first
    t0 = time.time()
    harness.start_section(args.out, TITLE, INTRO, setup_lines(args.rounds, args.note, argv))
    with tempfile.TemporaryDirectory(prefix="bench-flower-") as tmp:
        for clients in args.clients:
            plain: float | None = None
            for name in configs:
                row = run_one(clients, args.rounds, name, Path(tmp))
                print(json.dumps(row), flush=True)
                if name == "plain":
                    plain = row["round"]
                line = report_row(row, plain)
                print(line, flush=True)
                harness.append_lines(args.out, line)
    harness.append_lines(args.out, "", f"Run wall time {(time.time() - t0) / 60:.1f} min.")
    print(f"appended to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
