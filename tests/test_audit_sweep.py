"""The DP noise sweep for auditors, at its smallest size: two noise levels, one round each,
one report with the table and the privacy-utility plot."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_sweep_writes_one_report_with_every_noise_level(tmp_path: Path) -> None:
    args = [sys.executable, "-m", "experiments.audit_sweep", "--noise", "0,3", "--rounds", "1",
            "--out", str(tmp_path), "--set", "dataset=mnist", "--set", "width=100",
            "--set", "batch-size=8", "--set", "dataset-size=200", "--set", "num-clients=2",
            "--set", "audit-executor=inline"]
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    (sweep,) = list(tmp_path.glob("sweep-*"))
    rows = json.loads((sweep / "sweep.json").read_text())
    assert [r["noise"] for r in rows] == [0.0, 3.0]
    assert rows[0]["epsilon"] == "inf"  # no noise: no privacy guarantee
    assert math.isfinite(float(rows[1]["epsilon"])) and float(rows[1]["epsilon"]) > 0
    assert all(0.0 <= r["accuracy"] <= 1.0 for r in rows)
    assert rows[0]["certified"] + rows[0]["protected"] <= rows[0]["attacked"] == 2
    page = (sweep / "report.html").read_text()
    assert page.count("<img ") == 1 and "id='verdict'" in page
    for r in rows:  # each run's own report is linked and exists
        assert f"href='{r['report']}'" in page and (sweep / r["report"]).is_file()


def test_a_bad_sweep_setting_exits_2_before_any_run(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "experiments.audit_sweep", "--noise", "0,-1",
                           "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 2 and "noise-multiplier must be >= 0" in proc.stderr
    assert list(tmp_path.iterdir()) == []
