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

and writes ``experiments/results/flower.md`` (machine and date included).

    .venv/bin/python -m experiments.bench_flower [--clients 3 10 30] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "experiments" / "results" / "flower.md"

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
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True,
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


def _machine() -> str:
    import flwr
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none (attack on CPU)"
    return (f"{cpu}, {os.cpu_count()} cores, {platform.system()} {platform.release()}; GPU: "
            f"{gpu}; Python {platform.python_version()}, torch {torch.__version__}, flwr "
            f"{flwr.__version__}")


def _f(v: float | None, digits: int = 1) -> str:
    return "–" if v is None else f"{v:.{digits}f}"


def write_report(rows: list[dict[str, Any]], rounds: int, seconds: float, note: str) -> str:
    """Markdown for ``experiments/results/flower.md``."""
    lines = [
        "# Flower: what the privacy audit costs a round, per executor and mode", "",
        f"Measured {time.strftime('%Y-%m-%d %H:%M %Z')} with `make bench-flower` "
        f"({seconds / 60:.1f} min in all). Machine: {_machine()}. {note}", "",
        f"Setup: FedSGD, photo crops shaped like CIFAR-10 (`{BASE['dataset']}`, IID partitions "
        f"of {BASE['dataset-size']}), B = {BASE['batch-size']} per client, ReLU MLP "
        f"{BASE['depth']} x {BASE['width']}, {rounds} rounds, Flower's simulation engine (Ray, "
        "1 CPU per ClientApp), FedAvg. Audited runs invert every client's first-layer update "
        f"with SPEAR++ (budget {BASE['max-seconds']:.0f} s), score it against the client's "
        "batch and store the pictures. Round = `configure_train` until the aggregate is "
        "returned (mean of rounds 2..R; round 1 also starts Ray's actors and the attack "
        "workers). Attacks/min (rounds 2..R) = attacked updates over the time from each round's replies to "
        "its last result. Last result = seconds from the start of the run.",
        "",
        "| clients | audit | round (s) | round 1 (s) | × plain round | attacks/min "
        "| last result (s) | certified | reconstructed | mean PSNR (dB) |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    plain = {r["clients"]: r["round"] for r in rows if r["config"] == "plain"}
    for r in rows:
        ratio = r["round"] / plain[r["clients"]] if plain.get(r["clients"]) else None
        audited = r["config"] != "plain"
        cert = f"{r['certified']}/{r['replies']}" if audited else "–"
        recon = f"{r['reconstructed']}/{r['replies']}" if audited else "–"
        lines.append(
            f"| {r['clients']} | {r['config']} | {_f(r['round'], 2)} | {_f(r['round1'])} "
            f"| {_f(ratio, 2)} | {_f(r['per_min']) if audited else '–'} "
            f"| {_f(r['last_result']) if audited else '–'} | {cert} | {recon} "
            f"| {_f(r['psnr'])} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and append its section to the results file."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[3, 10, 30])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--note", default="", help="said in the header (e.g. machine load)")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    t0 = time.time()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-flower-") as tmp:
        for clients in args.clients:
            for name in args.configs:
                rows.append(run_one(clients, args.rounds, name, Path(tmp)))
                print(json.dumps(rows[-1]), flush=True)
    text = write_report(rows, args.rounds, time.time() - t0, args.note)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    old = args.out.read_text() if args.out.is_file() else ""
    args.out.write_text(text + ("\n---\n\n" + old if old else ""))
    print(text)
    print(f"written {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
