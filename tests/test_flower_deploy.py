"""Deployments: ``make deploy-local`` end to end, docker-compose.yml / Dockerfile / pyproject.

``test_deploy_local_end_to_end`` starts real Flower processes (a SuperLink and two SuperNodes on
free ports, a temporary FLWR_HOME) through ``scripts/deploy_local.sh``; select it alone with
``pytest -k deploy_local``.
"""

from __future__ import annotations

import json
import os
import subprocess
import tomllib
import uuid
from pathlib import Path

import yaml

from fl_attack_flwr.run_config import DEFAULT_RUN_CONFIG

ROOT = Path(__file__).resolve().parents[1]


def _flower_processes(tag: str) -> set[int]:
    """PIDs of running (not zombie) Flower processes started with ``FL_ATTACK_TEST_TAG=tag``.

    The tag is inherited by every process the deployment script starts, so processes of other
    runs on the same machine (another test, a user's own federation) never count.
    """
    pids = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if (state != "Z" and f"FL_ATTACK_TEST_TAG={tag}".encode() in env
                and any(k in cmd for k in ("flower-super", "flwr-serverapp", "flwr-clientapp"))):
            pids.add(int(entry.name))
    return pids


def test_deploy_local_end_to_end(tmp_path: Path) -> None:
    tag = uuid.uuid4().hex
    env = {**os.environ, "OUTPUT_DIR": str(tmp_path / "runs"), "TIMEOUT": "420",
           "RUN_CONFIG": "", "FL_ATTACK_TEST_TAG": tag}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "deploy_local.sh")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=480)
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert "run status: finished:completed" in proc.stderr
    run_dir = Path(proc.stdout.strip().splitlines()[-1])
    assert run_dir.parent == tmp_path / "runs" and run_dir.name.startswith("deploy-")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed"
    assert summary["replies"] == 2 and summary["clients"] == 2  # one reply per SuperNode
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert sorted(ln["partition_id"] for ln in lines) == [0, 1]  # partitions via --node-config
    assert summary["reconstructions"] == 2 and summary["certified"] == 2
    assert (run_dir / "report.html").is_file()
    # everything it started is gone (zombies reparented to init aside)
    assert _flower_processes(tag) == set()


def test_deploy_local_rejects_a_bad_setting_before_starting_anything(tmp_path: Path) -> None:
    tag = uuid.uuid4().hex
    env = {**os.environ, "OUTPUT_DIR": str(tmp_path / "runs"), "TIMEOUT": "300",
           "RUN_CONFIG": "protocol='nonsense' batch-size=0", "FL_ATTACK_TEST_TAG": tag}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "deploy_local.sh")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "protocol must be one of" in proc.stderr and "batch-size must be >= 1" in proc.stderr
    assert "nothing was started" in proc.stderr and "SuperLink on" not in proc.stderr
    assert _flower_processes(tag) == set()


def test_deploy_local_fails_when_the_server_fails(tmp_path: Path) -> None:
    """A valid setting the federation cannot meet (3 clients, 2 SuperNodes) fails the run on
    the server; the script must exit non-zero and say why, and stop everything it started."""
    tag = uuid.uuid4().hex
    env = {**os.environ, "OUTPUT_DIR": str(tmp_path / "runs"), "TIMEOUT": "300",
           "RUN_CONFIG": "num-clients=3 node-wait=3.0", "FL_ATTACK_TEST_TAG": tag}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "deploy_local.sh")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=360)
    assert proc.returncode != 0
    assert "finished:failed" in proc.stderr or "did not complete" in proc.stderr
    assert "only 2 node(s) connected" in proc.stderr
    assert _flower_processes(tag) == set()


def test_docker_compose_parses_and_names_the_services() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert set(services) == {"superlink", "superexec-serverapp", "supernode-0",
                             "superexec-clientapp-0", "supernode-1", "superexec-clientapp-1"}
    assert services["superlink"]["image"].startswith("flwr/superlink:")
    assert "--isolation" in services["superlink"]["command"]
    server = services["superexec-serverapp"]
    assert server["build"]["dockerfile"] == "Dockerfile"
    assert any(v.endswith(":/app/runs") for v in server["volumes"])
    assert "superlink:8000" in server["command"]
    for i in (0, 1):
        node = services[f"supernode-{i}"]
        assert node["image"].startswith("flwr/supernode:")
        cmd = node["command"]
        assert cmd[cmd.index("--node-config") + 1] == f"partition-id={i} num-partitions=2"
        port = cmd[cmd.index("--port") + 1]
        exe = services[f"superexec-clientapp-{i}"]["command"]
        assert exe[exe.index("--runtime-api-address") + 1] == f"supernode-{i}:{port}"
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "FROM flwr/superexec:" in dockerfile
    assert 'ENTRYPOINT ["flower-superexec"]' in dockerfile


def test_pyproject_run_config_matches_the_app_defaults() -> None:
    flwr = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]
    assert flwr["components"] == {"serverapp": "fl_attack_flwr.server_app:app",
                                  "clientapp": "fl_attack_flwr.clients.client_app:app"}
    assert flwr["config"] == DEFAULT_RUN_CONFIG

