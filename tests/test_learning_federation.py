"""The learning federation's command at its smallest: both runs (audited in the background, and
plain), the section it appends to its results file, and the audited run's report."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_learning_federation_writes_its_table_timings_and_report(tmp_path: Path) -> None:
    out = tmp_path / "training.md"
    args = [sys.executable, "-m", "experiments.learning_federation", "--rounds", "3",
            "--out", str(out), "--runs", str(tmp_path / "runs"), "--set", "dataset-size=300",
            "--set", "width=50", "--set", "batch-size=8", "--set", "eval-size=16",
            "--set", "max-seconds=10.0", "--set", "audit-workers=1"]
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    (runs,) = list((tmp_path / "runs").iterdir())
    summary = json.loads((runs / "audited" / "summary.json").read_text())
    plain = json.loads((runs / "plain" / "summary.json").read_text())
    assert plain["attacked"] == 0 and summary["attacked"] + summary["skipped"] == 9
    for run in (summary, plain):  # every round's accuracy and end time, on held-out samples
        assert sorted(run["per_round"], key=int) == ["1", "2", "3"]
        assert all(0 <= r["accuracy"] <= 1 for r in run["by_round"])
        ends = [run["per_round"][k]["round-end-seconds"] for k in ("1", "2", "3")]
        assert ends == sorted(ends)

    text = out.read_text()
    assert text.startswith("# Leakage while the model trains")
    assert "`python -m experiments.learning_federation --rounds 3 --out" in text
    assert "commit " in text and "that it never trains on" in text
    assert f"**{summary['leakage_trend']}**" in text
    table = [ln for ln in text.splitlines() if ln.startswith("| ") and ln[2].isdigit()]
    assert len(table) == 3
    for line, row in zip(table, summary["by_round"], strict=True):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[:4] == [str(row["round"]), f"{100 * row['accuracy']:.1f}%",
                             f"{row['read']} of {row['samples']}",
                             f"{row['certified']} of {row['attacked']}"]
    assert "Audit overhead per round (mean of rounds 2..R): " in text
    assert "| plain |" in text and "| audited |" in text

    page = (runs / "audited" / "report.html").read_text()
    assert 'alt="leakage and accuracy per round"' in page
    assert summary["leakage_trend"].replace("'", "&#x27;") in page
    for path in [runs, *runs.rglob("*")]:  # the runs hold the clients' data: owner-only
        assert stat.S_IMODE(path.stat().st_mode) == (0o700 if path.is_dir() else 0o600), path
