"""Auditing a user's own Flower app: ``examples/photo-mlp`` (its own model with its own layer
names, its own training loop, clients that send only weights and num-examples) in a real Flower
simulation, and the plugin's import from a directory with its own ``clients/`` and
``strategies/`` packages after a regular (non-editable) install."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

from fl_attack_flwr.output.private_files import records_from_jsonl

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "photo-mlp"

_RUN = textwrap.dedent("""
    import json, sys
    from flwr.simulation import run_simulation
    from photo_mlp.client_app import make_client_app
    from photo_mlp.server_app import make_server_app
    out, name = sys.argv[1], sys.argv[2]
    client, server = json.loads(sys.argv[3]), json.loads(sys.argv[4])
    run_simulation(
        server_app=make_server_app({"output-dir": out, "run-name": name, **server}),
        client_app=make_client_app(client), num_supernodes=2,
        backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                        "init_args": {"num_cpus": 2, "num_gpus": 0, "include_dashboard": False,
                                      "logging_level": "ERROR"}})
""")


def _run_example(tmp_path: Path, name: str, client: dict, server: dict | None = None
                 ) -> tuple[dict, list[dict]]:
    env = {**os.environ, "PYTHONPATH": str(EXAMPLE), "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-c", _RUN, str(tmp_path), name, json.dumps(client),
                           json.dumps(server or {})],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    run_dir = tmp_path / name
    assert (run_dir / "summary.json").is_file(), proc.stdout[-3000:] + proc.stderr[-6000:]
    return (json.loads((run_dir / "summary.json").read_text()),
            records_from_jsonl(run_dir / "metrics.jsonl"))


def test_one_step_clients_are_certified_with_pictures_of_an_inferred_shape(tmp_path: Path) -> None:
    """The clients run LeakGuard(policy="report"): their updates go out unchanged and the
    server's records carry each client's own finding."""
    summary, lines = _run_example(tmp_path, "one-step", {"samples": 16, "batch-size": 16,
                                                          "leak-guard": "report"})
    assert len(lines) == 2 and {ln["client"] for ln in lines} == {"node-1", "node-2"}
    for ln in lines:
        assert ln["layer"] == "fc1.weight" and ln["layer_shape"] == [128, 3072]
        assert ln["status"] in ("certified", "not-certified", "partial")  # never an error
        assert ln["batch_size"] == 16 and ln["reading"] == "gradient"
        assert "inferred" in ln["inputs_are"]
    assert summary["certified"] >= 1  # one SGD step on 16 photos: the server reads them
    page = (tmp_path / "one-step" / "report.html").read_text()
    assert page.count("alt=\"reconstruction\"") == 2 and "audit off" not in page
    assert "Input shape (3, 32, 32) inferred" in page
    assert "client&#x27;s LeakGuard" in page or "client's LeakGuard" in page
    for ln in lines:
        assert ln["guard"] is not None and ln["guard"]["refused"] is False
    for ln in lines:
        assert (tmp_path / "one-step" / ln["dir"] / "reconstruction.png").is_file()


def test_ordinary_fedavg_clients_are_read_at_the_replys_size_not_errors(tmp_path: Path) -> None:
    """Under LeakGuard(policy="refuse") too: 96 samples over 6 local steps in a 128-unit layer
    (rank at most 96: not beyond what the layer separates) are attacked at the 96 the reply
    reports; no record is an error or claims more samples than that, and the update is sent.
    Such a sum is never certified, so both searches run to their budgets: shorter ones than
    the example's (60 s, 30 s) check the same contract."""
    summary, lines = _run_example(tmp_path, "fedavg", {"samples": 96, "batch-size": 32,
                                                        "local-epochs": 2, "leak-guard": "refuse",
                                                        "guard-seconds": 10},
                                  server={"attack-seconds": 20})
    assert len(lines) == 2 and summary["attack_failures"] == 0
    for ln in lines:
        assert ln["status"] in ("protected", "partial", "not-certified") and ln["error"] is None
        said = [int(n) for n in re.findall(r"(\d+) samples", ln["reason"] or "")]
        assert all(n <= 96 for n in said), ln["reason"]
        assert ln["guard"]["status"] != "certified" and not ln["guard"]["refused"]


def test_refusing_clients_leave_the_server_nothing_to_read(tmp_path: Path) -> None:
    """LeakGuard(policy="refuse") on one SGD step of 16 photos: what a client's check proves
    readable never reaches the server, and the round completes."""
    summary, lines = _run_example(tmp_path, "refuse", {"samples": 16, "batch-size": 16,
                                                        "leak-guard": "refuse"})
    assert len(lines) == 2 and summary["refused"] == sum(ln["guard"]["refused"] for ln in lines)
    for ln in lines:
        guard = ln["guard"]
        assert guard["refused"] == (guard["readable_samples"] > 0)
        assert (ln["status"] == "refused") == guard["refused"]
        if guard["refused"]:
            assert ln["files"] == [] and ln["batch_size"] is None
    assert summary["certified"] <= sum(not ln["guard"]["certified"] for ln in lines)
    assert ("refused to send a readable update" in summary["verdict"]) == bool(summary["refused"])


def test_the_plugin_import_cannot_collide_with_a_users_packages(tmp_path: Path) -> None:
    """After a regular install, ``from fl_attack_flwr import AuditingStrategy`` works from a
    directory holding the user's own ``clients`` and ``strategies`` packages, and theirs stay
    theirs."""
    site = tmp_path / "site"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                           "--target", str(site), str(ROOT)], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PIP_NO_WARN_SCRIPT_LOCATION": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    user = tmp_path / "user-app"
    for pkg in ("clients", "strategies"):
        (user / pkg).mkdir(parents=True)
        (user / pkg / "__init__.py").write_text(f"OWNER = 'user-{pkg}'\n")
    probe = textwrap.dedent("""
        import clients, strategies
        from fl_attack_flwr import AttackSettings, AuditingStrategy, AuditStore
        from fl_attack_flwr.app.server_app import app
        import fl_attack_flwr.clients.client_app as ours
        print(clients.OWNER, strategies.OWNER, ours.__file__, AuditingStrategy.__module__)
    """)
    out = subprocess.run([sys.executable, "-c", probe], cwd=user, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(site), "PYTHONWARNINGS": "ignore"},
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    user_clients, user_strategies, ours, module = out.stdout.split()
    assert (user_clients, user_strategies) == ("user-clients", "user-strategies")
    assert ours.startswith(str(site)) and module == "fl_attack_flwr.audit"
    assert not (site / "clients").exists() and not (site / "strategies").exists()
    assert not (site / "experiments").exists()
    # every package of the source tree is in the install (a subpackage left out of
    # pyproject's list would be missing only for users)
    for src, dst in (("fl_attack", "fl_attack"), ("strategies", "fl_attack_flwr"),
                     ("clients", "fl_attack_flwr/clients")):
        for init in (ROOT / src).rglob("__init__.py"):
            rel = init.relative_to(ROOT / src)
            assert (site / dst / rel).is_file(), f"{src}/{rel} is not installed"


CNN = ROOT / "examples" / "quickstart-cnn"

_RUN_CNN = _RUN.replace("photo_mlp", "quickstart_cnn")


def _run_cnn(tmp_path: Path, name: str, server: dict, client: dict) -> tuple[dict, list[dict]]:
    env = {**os.environ, "PYTHONPATH": str(CNN), "PYTHONWARNINGS": "ignore"}
    code = _RUN_CNN.replace('make_server_app({"output-dir": out, "run-name": name})',
                            'make_server_app({"output-dir": out, "run-name": name, '
                            '**json.loads(sys.argv[4])})')
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path), name, json.dumps(client),
                           json.dumps(server)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=900)
    run_dir = tmp_path / name
    assert (run_dir / "summary.json").is_file(), proc.stdout[-3000:] + proc.stderr[-6000:]
    return (json.loads((run_dir / "summary.json").read_text()),
            records_from_jsonl(run_dir / "metrics.jsonl"))


def test_quickstart_cnn_features_and_pictures_are_told_apart(tmp_path: Path) -> None:
    """Flower's quickstart CNN, one step on 8 photos per client: what the attack certifies are
    fc1's input features; the pictures estimated from them are scored on their own, and the
    verdict never calls a batch readable on the strength of its features."""
    summary, lines = _run_cnn(tmp_path, "cnn", {"max-seconds": 60.0, "pixel-seconds": 10.0},
                              {"samples": 8, "batch-size": 8})
    assert len(lines) == 2 and summary["inputs_certified"] == 0
    for ln in lines:
        assert ln["layer"] == "fc1.weight" and ln["reads"] == "features"
        assert "input features" in ln["inputs_are"]
        # 8 samples through 120 units: always a reconstruction, never more samples than sent
        assert ln["status"] in ("certified", "not-certified", "partial")
        assert ln["attack"]["batch_size"] <= ln["num_examples"] == 8
    certified = sum(ln["status"] == "certified" for ln in lines)
    assert summary["features_certified"] == certified
    assert ("fc1 input features of" in summary["verdict"]) == bool(certified)
    assert "every sample of" not in summary["verdict"]  # only inputs make samples readable
    pictured = [ln for ln in lines if ln["pixels"] and not ln["pixels"]["error"]]
    assert all(ln["psnr_mean"] is not None and ln["ssim_mean"] is not None for ln in pictured)
    assert all(("pixels.npz" in ln["files"]) == (ln in pictured) for ln in lines)
    assert summary["pictures_scored"] == len(pictured)
    assert (summary["verdict_level"] == "leak") == bool(summary["pictures_readable"])
    page = (tmp_path / "cnn" / "report.html").read_text()
    assert "Pictures from features" in page and "pictures estimated from the features" in page


def test_quickstart_cnn_256_photos_in_8_steps_is_protected_for_its_true_reason(
        tmp_path: Path) -> None:
    summary, lines = _run_cnn(tmp_path, "cnn-epoch", {"max-seconds": 60.0},
                              {"samples": 256, "batch-size": 32})
    assert [ln["status"] for ln in lines] == ["protected", "protected"]
    for ln in lines:
        # 256 samples over 8 steps through fc1's units: more than the layer can separate
        assert ln["num_examples"] == 256 and "mixes at least min(m, n)" in ln["reason"]
        assert "the reply reports 256 samples" in ln["reason"]
    assert summary["verdict_level"] == "safe"
