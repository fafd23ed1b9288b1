"""One audited simulation run as a user runs it: ``python -m experiments.demo --json`` in a
subprocess (Ray is started and torn down with it), for the tests that need a whole run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from fl_attack_flwr.output.private_files import records_from_jsonl

ROOT = Path(__file__).resolve().parents[1]


def run_demo(tmp_path: Path, name: str, config: dict[str, Any], *, rc: int = 0,
             env: dict[str, str] | None = None
             ) -> tuple[dict[str, Any], list[dict[str, Any]], Path, subprocess.CompletedProcess]:
    """Run the demo with ``config`` into ``tmp_path / name``; assert its exit status is ``rc``;
    return its summary, its ``metrics.jsonl`` lines, its directory and the process."""
    cfg = {**config, "output-dir": str(tmp_path), "run-name": name}
    args = [sys.executable, "-m", "experiments.demo", "--json"]
    for key, value in cfg.items():
        args += ["--set", f"{key}={json.dumps(value)}"]
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=420,
                          env={**os.environ, "PYTHONWARNINGS": "ignore", **(env or {})})
    assert proc.returncode == rc, proc.stdout[-3000:] + proc.stderr[-6000:]
    run_dir = tmp_path / name
    summary = json.loads((run_dir / "summary.json").read_text())
    return summary, records_from_jsonl(run_dir / "metrics.jsonl"), run_dir, proc
