"""End-to-end audited simulations on Flower's simulation engine (Ray), one per protocol.

Each runs ``python -m experiments.demo`` in a subprocess (Ray is started and torn down with it),
tiny on purpose: 1 round, B = 8, MLP width 100, real MNIST digits, audit mode on. The FedSGD run
also carries misbehaving clients (one raises, one sends NaN weights, one a wrongly shaped array)
to show that they neither stop the round nor reach the aggregate.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.demo_runs import run_demo

ROOT = Path(__file__).resolve().parents[1]
BASE = {
    "num-server-rounds": 1,
    "dataset": "mnist",
    "dataset-size": 200,
    "batch-size": 8,
    "width": 100,
    "audit": True,
    "fraction-evaluate": 0.0,
    "max-seconds": 60.0,
    "audit-executor": "inline",  # no worker process to spawn in these short runs
}


def _simulate(tmp_path: Path, name: str, rc: int = 0,
              **config: object) -> tuple[dict, list[dict], Path]:
    """Run one simulation (exit status ``rc``); return its summary, its metrics.jsonl lines and
    its directory."""
    summary, lines, run_dir, proc = run_demo(tmp_path, name, {**BASE, **config}, rc=rc,
                                             env={"RAY_DEDUP_LOGS": "0"})
    summary["stderr"] = proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {
        k: v for k, v in summary.items() if k != "stderr"}
    return summary, lines, run_dir


def _private(run_dir: Path) -> None:
    for p in [run_dir, *run_dir.rglob("*")]:
        mode = stat.S_IMODE(p.stat().st_mode)
        assert mode == (0o700 if p.is_dir() else 0o600), (p, oct(mode))


def test_fedsgd_certified_exact_despite_faulty_clients(tmp_path: Path) -> None:
    summary, lines, run_dir = _simulate(
        tmp_path, "fedsgd", protocol="fedsgd", **{"num-clients": 4},
        **{"inject-faults": "1:raise 2:nan 3:shape"},
    )
    assert summary["status"] == "completed"
    by_pid = {ln["partition_id"]: ln for ln in lines if ln["partition_id"] is not None}
    assert by_pid[0]["status"] == "certified" and by_pid[0]["reading"] == "gradient"
    assert by_pid[0]["exact"] is True and by_pid[0]["sparsity_match"] == pytest.approx(1.0)
    assert by_pid[0]["psnr_mean"] > 90.0
    assert by_pid[0]["layer"] == "1.weight" and by_pid[0]["layer_shape"] == [100, 784]
    assert by_pid[2]["status"] == "corrupt" and "NaN" in by_pid[2]["error"]
    assert by_pid[3]["status"] == "corrupt" and "shape" in by_pid[3]["error"]
    errors = [ln for ln in lines if ln["status"] == "client-error"]
    assert len(errors) == 1 and "injected fault" in errors[0]["error"]
    assert summary["reconstructions"] == 1 and summary["certified"] == 1
    assert summary["corrupt_replies"] == 2 and summary["client_errors"] == 1
    assert summary["epsilon"] is None  # no DP
    agg = summary["train_metrics"]["1"]
    assert agg["audit-certified"] == 1 and agg["audit-corrupt"] == 2
    assert agg["audit-psnr-mean"] > 90.0
    for name in ("reconstruction.png", "original.png", "inputs.npz", "metrics.json"):
        assert (run_dir / "round-1" / "client-0" / name).is_file()
    assert "data:image/png;base64," in (run_dir / "report.html").read_text()
    _private(run_dir)


def test_metrics_only_run_gated_on_certified_exits_3_and_stores_no_data(tmp_path: Path) -> None:
    """``store-reconstructions=false``: verdicts and scores, no picture or raw input anywhere;
    ``fail-on=certified``: the run completes, then exits non-zero naming the gate."""
    summary, lines, run_dir = _simulate(
        tmp_path, "gated", rc=3, protocol="fedsgd", **{"num-clients": 2},
        **{"store-reconstructions": False, "fail-on": "certified"})
    assert summary["status"] == "completed" and summary["certified"] >= 1
    assert "privacy gate fail-on='certified'" in summary["stderr"]
    assert f"{summary['certified']} of {summary['attacked']}" in summary["stderr"]
    assert summary["reconstructions_kept"] == "none (metrics only)"
    assert all(ln["files"] == [] and ln["psnr_mean"] is not None for ln in lines)
    written = {p.name for p in run_dir.rglob("*") if p.is_file()}
    assert not {n for n in written if n.endswith((".png", ".npz"))}, written
    page = (run_dir / "report.html").read_text()
    assert 'alt="reconstruction"' not in page and 'alt="original"' not in page
    assert "Metrics-only run" in page
    _private(run_dir)


def test_fedavg_scored_by_psnr(tmp_path: Path) -> None:
    summary, lines, _ = _simulate(
        tmp_path, "fedavg", protocol="fedavg", **{"num-clients": 2},
        **{"local-epochs": 2, "mini-batch-size": 4},
        # stop the search at λ = 0.98 instead of spending the whole budget (also checks that
        # attack-options reach fl_attack.invert)
        **{"attack-options": "lambda_stop=0.98", "max-seconds": 90.0},
    )
    assert summary["status"] == "completed"
    assert all(ln["status"] in ("certified", "not-certified", "partial") for ln in lines)
    assert all(ln["protocol"] == "fedavg" and ln["reading"] == "fedavg" for ln in lines)
    assert all(0.0 < ln["attack"]["sparsity_match"] <= 1.0 for ln in lines)
    assert all(ln["psnr_mean"] is not None and ln["true_batch_size"] == 8 for ln in lines)
    assert summary["psnr_mean"] > 25.0  # recognisable (papers' FedAvg threshold)


def test_dpsgd_scored_and_epsilon_reported(tmp_path: Path) -> None:
    summary, lines, _ = _simulate(
        tmp_path, "dpsgd", protocol="dpsgd", **{"num-clients": 2},
        clip=1.0, **{"noise-multiplier": 8e-4},  # noise std 1e-4 on the mean gradient
    )
    assert summary["status"] == "completed"
    assert all(ln["status"] in ("not-certified", "partial") for ln in lines)  # noisy
    for ln in lines:
        assert ln["epsilon"] is not None and ln["epsilon"] != "inf" and ln["epsilon"] > 0
        assert ln["epsilon_cumulative"] == pytest.approx(ln["epsilon"], rel=1e-6)
        assert ln["noise_std"] == pytest.approx(8e-4 * 1.0 / 8)
        assert ln["psnr_mean"] is not None
    assert summary["epsilon"] == pytest.approx(max(ln["epsilon"] for ln in lines))
    assert summary["delta"] == pytest.approx(1e-5)
    assert summary["psnr_mean"] > 20.0
    assert "epsilon" in summary["train_metrics"]["1"]  # the clients' metrics reach Flower


@pytest.mark.parametrize(("setting", "message"), [
    ("batch-size=0", "batch-size must be >= 1"),
    ("batch-size=5000", "batch-size 5000 exceeds the smallest client shard"),
    ("num-clients=0", "num-clients must be >= 1"),
    ("attack-options=max_secondz=5", "unknown attack option(s) ['max_secondz']"),
    ("protocol=fedprox", "protocol must be one of"),
    ("audit-niceness=25", "audit-niceness must be in 0..19"),
    ("attack.steps=200", "unknown key 'attack.steps'"),
    ("fail-on=leaky", "fail-on must be one of"),
    ("audit-ray-resources=fl-attack", "audit-ray-resources item 'fl-attack' is not name=amount"),
])
def test_a_bad_setting_exits_2_before_anything_runs(tmp_path: Path, setting: str,
                                                    message: str) -> None:
    args = [sys.executable, "-m", "experiments.demo", "--set", f"output-dir={tmp_path}",
            "--set", setting]
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr
    assert list(tmp_path.iterdir()) == []  # nothing half-written


@pytest.mark.parametrize(("args", "message"), [
    (["--run-config", "audit-niceness=30"], "audit-niceness must be in 0..19"),
    (["-c", "batch-size=0", "protocol='fedprox'"], "protocol must be one of"),
    (["--stream"], "unknown option --stream"),
])
def test_flwr_run_local_checks_every_override_before_starting(tmp_path: Path, args: list[str],
                                                              message: str) -> None:
    """The script's overrides, given as ``flwr run`` takes them or bare, are all checked."""
    venv = Path(sys.executable).parent.parent
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "flwr_run_local.sh"), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OUTPUT_DIR": str(tmp_path / "runs"),
                               "VENV": str(venv), "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr
    assert "Starting local SuperLink" not in proc.stdout + proc.stderr
    assert list((tmp_path / "runs").iterdir()) == []
