"""Deployments: ``make deploy-local`` end to end; docker-compose.yml, its generators and the
Dockerfiles (static checks: ``make compose-demo`` needs a Docker daemon and is not run here).

``test_deploy_local_end_to_end`` starts real Flower processes (a SuperLink and two SuperNodes on
free ports, a temporary FLWR_HOME) through ``scripts/deploy_local.sh``; select it alone with
``pytest -k deploy_local``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import ssl
import subprocess
import sys
import tomllib
import uuid
from pathlib import Path
from types import ModuleType

import pytest
import yaml
from packaging.specifiers import SpecifierSet

from fl_attack_flwr.app.run_config import DEFAULT_RUN_CONFIG

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


def _deploy(tmp_path: Path, run_config: str, timeout: int) -> tuple[str,
                                                                    subprocess.CompletedProcess]:
    """``scripts/deploy_local.sh`` with ``RUN_CONFIG``; the tag its processes inherit."""
    tag = uuid.uuid4().hex
    env = {**os.environ, "OUTPUT_DIR": str(tmp_path / "runs"), "TIMEOUT": str(timeout - 60),
           "RUN_CONFIG": run_config, "FL_ATTACK_TEST_TAG": tag}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "deploy_local.sh")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    return tag, proc


def _compose_summary_check() -> str:
    """The Python that ``scripts/compose_demo.sh`` runs on the run's ``summary.json``."""
    script = (ROOT / "scripts" / "compose_demo.sh").read_text()
    start = script.index("<<'EOF' || fail \"the audit summary")
    body = script[script.index("\n", start) + 1:]
    return body[:body.index("\nEOF\n")]


def test_deploy_local_end_to_end(tmp_path: Path) -> None:
    tag, proc = _deploy(tmp_path, "", 480)
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
    # the compose demo's check of a run's summary accepts this real one
    check = subprocess.run([sys.executable, "-c", _compose_summary_check(),
                            str(run_dir / "summary.json")], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    # everything it started is gone (zombies reparented to init aside)
    assert _flower_processes(tag) == set()


def test_deploy_local_rejects_a_bad_setting_before_starting_anything(tmp_path: Path) -> None:
    tag, proc = _deploy(tmp_path, "protocol='nonsense' batch-size=0", 120)
    assert proc.returncode == 2
    assert "protocol must be one of" in proc.stderr and "batch-size must be >= 1" in proc.stderr
    assert "nothing was started" in proc.stderr and "SuperLink on" not in proc.stderr
    assert _flower_processes(tag) == set()


def test_deploy_local_fails_when_the_server_fails(tmp_path: Path) -> None:
    """A valid setting the federation cannot meet (3 clients, 2 SuperNodes) fails the run on
    the server; the script must exit non-zero and say why, and stop everything it started."""
    tag, proc = _deploy(tmp_path, "num-clients=3 node-wait=3.0", 360)
    assert proc.returncode != 0
    assert "finished:failed" in proc.stderr or "did not complete" in proc.stderr
    assert "only 2 node(s) connected" in proc.stderr
    assert _flower_processes(tag) == set()


FLWR_VERSION = "1.41.0"  # the Flower of the Makefile's venv and of the images


def _compose_override() -> ModuleType:
    """``scripts/compose_override.py`` as a module (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location(
        "compose_override", ROOT / "scripts" / "compose_override.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _arg(cmd: list[str], flag: str) -> str:
    """Value of ``flag`` in a command list, in either ``--flag value`` or ``--flag=value`` form."""
    for i, item in enumerate(cmd):
        if item == flag:
            return cmd[i + 1]
        if item.startswith(flag + "="):
            return item.split("=", 1)[1]
    raise AssertionError(f"{flag} not in {cmd}")


def test_docker_compose_parses_and_names_the_services() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    # compose v1 (1.29) rejects unknown top-level keys such as `name:`
    assert {k for k in compose if not k.startswith("x-")} <= {"services", "networks",
                                                              "volumes", "secrets"}
    services = compose["services"]
    assert set(services) == {"superlink", "superexec-serverapp", "supernode-0",
                             "superexec-clientapp-0", "supernode-1", "superexec-clientapp-1"}
    link = services["superlink"]
    assert link["image"] == "${FLWR_REPOSITORY:-flwr}/superlink:" + FLWR_VERSION
    assert _arg(link["command"], "--isolation") == "process"
    # published on the loopback interface unless the user says otherwise
    assert link["ports"] == ["${SUPERLINK_BIND:-127.0.0.1}:${SUPERLINK_PORT:-8000}:8000"]
    for name, service in services.items():
        assert name == "superlink" or "ports" not in service, name
    server = services["superexec-serverapp"]
    assert server["build"]["dockerfile"] == "Dockerfile"
    assert server["volumes"] == ["${FL_ATTACK_RUNS_DIR:-./runs/compose}:/app/runs"]
    assert _arg(server["command"], "--runtime-api-address") == "superlink:8000"
    for i in (0, 1):
        node = services[f"supernode-{i}"]
        assert node["image"] == "${FLWR_REPOSITORY:-flwr}/supernode:" + FLWR_VERSION
        assert _arg(node["command"], "--node-config") == f"partition-id={i} num-partitions=2"
        exe = services[f"superexec-clientapp-{i}"]["command"]
        port = _arg(node["command"], "--port")
        assert _arg(exe, "--runtime-api-address") == f"supernode-{i}:{port}"
    assert "# deploy:" in (ROOT / "docker-compose.yml").read_text()  # GPU reservation, documented


def test_compose_client_services_are_the_generated_ones() -> None:
    """The two clients of docker-compose.yml are what the generator writes for N = 2."""
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    generated = _compose_override().client_services(2)
    assert generated == {k: v for k, v in services.items() if k in generated}


def test_compose_override_for_n_clients(tmp_path: Path) -> None:
    out = tmp_path / "override.yml"
    proc = subprocess.run(["python3", str(ROOT / "scripts" / "compose_override.py"),
                           "--clients", "3", "-o", str(out)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    services = yaml.safe_load(out.read_text())["services"]
    assert set(services) == {f"{kind}-{i}" for kind in ("supernode", "superexec-clientapp")
                             for i in range(3)}
    for i in range(3):
        node = services[f"supernode-{i}"]["command"]
        assert _arg(node, "--node-config") == f"partition-id={i} num-partitions=3"
        assert "--insecure" in node
        exe = services[f"superexec-clientapp-{i}"]
        assert exe["depends_on"] == [f"supernode-{i}"]
        assert _arg(exe["command"], "--runtime-api-address") == f"supernode-{i}:9094"
    bad = subprocess.run(["python3", str(ROOT / "scripts" / "compose_override.py"),
                          "--clients", "0"], capture_output=True, text=True)
    assert bad.returncode == 2 and "at least 1" in bad.stderr


def test_compose_override_with_tls_mounts_only_what_each_service_serves_with() -> None:
    doc = _compose_override().override(2, "./certs")
    services = doc["services"]
    assert {"superlink", "superexec-serverapp"} <= set(services)
    for name, service in services.items():
        assert "--insecure" not in service["command"], name
        mounts = service["volumes"]
        assert all(m.startswith("./certs/") and m.endswith(":ro") for m in mounts), name
        keys = [m for m in mounts if ".key:" in m]
        if name == "superlink" or name.startswith("supernode-"):
            assert keys == [f"./certs/{name}.key:/app/certificates/{name}.key:ro"]
        else:
            assert keys == [], name
    link = services["superlink"]["command"]
    assert _arg(link, "--ssl-certfile") == "/app/certificates/superlink.pem"
    assert _arg(link, "--ssl-ca-certfile") == "/app/certificates/ca.crt"
    for name in ("superexec-serverapp", "supernode-0", "superexec-clientapp-1"):
        assert _arg(services[name]["command"], "--root-certificates") == \
            "/app/certificates/ca.crt"
    assert _arg(services["supernode-1"]["command"], "--ssl-keyfile") == \
        "/app/certificates/supernode-1.key"
    with pytest.raises(ValueError, match="at least 1"):
        _compose_override().client_services(0)


def _tls_handshake(certs: Path, server: str, hostname: str) -> None:
    """TLS handshake in memory: a server with ``server``.pem/.key, a client trusting ca.crt."""
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(certs / f"{server}.pem", certs / f"{server}.key")
    client_ctx = ssl.create_default_context(cafile=str(certs / "ca.crt"))
    c_in, c_out, s_in, s_out = (ssl.MemoryBIO() for _ in range(4))
    client = client_ctx.wrap_bio(c_in, c_out, server_hostname=hostname)
    srv = server_ctx.wrap_bio(s_in, s_out, server_side=True)
    for _ in range(10):
        done = 0
        for side in (client, srv):
            try:
                side.do_handshake()
                done += 1
            except ssl.SSLWantReadError:
                pass
        s_in.write(c_out.read())
        c_in.write(s_out.read())
        if done == 2:
            return
    raise AssertionError("handshake did not finish")


def test_generate_certs_makes_a_verifiable_chain(tmp_path: Path) -> None:
    certs = tmp_path / "certs"
    script = str(ROOT / "scripts" / "generate_certs.sh")
    proc = subprocess.run(["bash", script, "--clients", "1", str(certs)], capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr
    _tls_handshake(certs, "superlink", "superlink")  # the compose service name
    _tls_handshake(certs, "superlink", "127.0.0.1")  # the flwr CLI on the host
    _tls_handshake(certs, "supernode-0", "supernode-0")
    with pytest.raises(ssl.SSLCertVerificationError):
        _tls_handshake(certs, "supernode-0", "superlink")  # a node cannot pose as the SuperLink
    assert certs.stat().st_mode & 0o777 == 0o700
    assert all(k.stat().st_mode & 0o777 == 0o600 for k in certs.glob("*.key"))
    before = (certs / "superlink.pem").read_bytes()
    proc = subprocess.run(["bash", script, "--clients", "2", str(certs)], capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr
    assert (certs / "superlink.pem").read_bytes() == before  # existing files are kept
    _tls_handshake(certs, "supernode-1", "supernode-1")


def _requirements(path: Path) -> list[str]:
    lines = (line.split("#")[0].strip() for line in path.read_text().splitlines())
    return [line for line in lines if line]


def test_image_requirements_mirror_pyproject() -> None:
    """docker/requirements.txt lists pyproject's dependencies; Flower is pinned there to one
    release of pyproject's range (without the Ray extra, with the dp extra's dp-accounting)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = {re.sub(r"\[[^]]*\]", "", dep).replace(" ", "") for dep in project["dependencies"]}
    have = _requirements(ROOT / "docker" / "requirements.txt")
    names = {re.split(r"[<>=!~]", r)[0] for r in have}
    for dep in wanted:
        name = re.split(r"[<>=!~]", dep)[0]
        assert name in names, f"{name} missing from docker/requirements.txt"
        if name == "flwr":
            assert SpecifierSet(dep[len(name):]).contains(FLWR_VERSION), dep
        elif name not in ("torch", "torchvision"):  # pinned there to the Makefile's pair
            assert dep in have, f"{dep}: docker/requirements.txt differs"
    makefile = (ROOT / "Makefile").read_text()
    for pin in (r for r in have if r.startswith(("torch==", "torchvision=="))):
        assert pin in makefile
    assert f"flwr=={FLWR_VERSION}" in have
    assert f"FLWR_VERSION ?= {FLWR_VERSION}" in makefile
    assert "dp-accounting" in names  # Flower's `dp` extra (its privacy accountant)
    nodeps = _requirements(ROOT / "docker" / "requirements-nodeps.txt")
    assert all(pin in makefile for pin in nodeps) and nodeps


def test_dockerfiles_match_the_official_images() -> None:
    project = (ROOT / "Dockerfile").read_text()
    assert "FROM ${FLWR_REPOSITORY}/superexec:${FLWR_VERSION}" in project
    assert f"ARG FLWR_VERSION={FLWR_VERSION}" in project
    assert "ARG FLWR_REPOSITORY=flwr" in project  # connected hosts: the official images
    assert 'ENTRYPOINT ["flower-superexec"]' in project
    assert "USER root" not in project
    local = (ROOT / "docker" / "flwr.Dockerfile").read_text()
    assert f"ARG FLWR_VERSION={FLWR_VERSION}" in local
    # the official images' user, home and virtualenv
    assert "--uid 49999 app" in local and "USER app" in local and "WORKDIR /app" in local
    assert "ENV PATH=/python/venv/bin:$PATH" in local
    targets = dict(re.findall(r"FROM base AS (\w+)\nENTRYPOINT \[\"([\w-]+)\"\]", local))
    assert targets == {"superlink": "flower-superlink", "supernode": "flower-supernode",
                       "superexec": "flower-superexec"}
    ignore = [line for line in (ROOT / ".dockerignore").read_text().splitlines()
              if line and not line.startswith("#")]
    assert ignore[0] == "*"  # an allow-list: nothing enters the build context unless named
    assert not any(line.startswith("!") and (".venv" in line or ".compose" in line
                                              or "runs" in line) for line in ignore)


def test_compose_demo_run_config_uses_declared_keys() -> None:
    """The demo's run config (one place in the script) only uses keys the app declares."""
    script = (ROOT / "scripts" / "compose_demo.sh").read_text()
    body = script[script.index("demo_run_config() {"):]
    body = body[:body.index("\n}\n")]
    keys = set(re.findall(r"([a-z][a-z0-9-]*)=", body))
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]
    assert {"num-clients", "protocol", "dataset", "output-dir", "run-name"} <= keys
    assert keys <= set(declared["config"]), keys - set(declared["config"])
    for name in ("compose_demo.sh", "generate_certs.sh"):
        proc = subprocess.run(["bash", "-n", str(ROOT / "scripts" / name)], capture_output=True,
                              text=True)
        assert proc.returncode == 0, proc.stderr
    for name in ("make_base_image.sh", "make_wheelhouse.sh"):
        proc = subprocess.run(["bash", "-n", str(ROOT / "docker" / name)], capture_output=True,
                              text=True)
        assert proc.returncode == 0, proc.stderr


def test_pyproject_run_config_matches_the_app_defaults() -> None:
    flwr = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]
    assert flwr["components"] == {"serverapp": "fl_attack_flwr.app.server_app:app",
                                  "clientapp": "fl_attack_flwr.clients.client_app:app"}
    assert flwr["config"] == DEFAULT_RUN_CONFIG

