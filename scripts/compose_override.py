#!/usr/bin/env python3
"""Write a docker-compose override file for N clients, optionally with TLS.

``docker-compose.yml`` defines the SuperLink, the ServerApp's SuperExec and two clients. This
script writes the client services for any N (``supernode-<i>`` and ``superexec-clientapp-<i>``,
``i = 0 .. N-1``, each SuperNode with ``partition-id=i num-partitions=N``), so that nobody copies
service blocks by hand::

    scripts/compose_override.py --clients 5 -o .compose/override.yml
    docker-compose -p fl-attack -f docker-compose.yml -f .compose/override.yml up -d

With ``--tls CERT_DIR`` (certificates from ``scripts/generate_certs.sh --clients N CERT_DIR``)
every connection is TLS, as Flower documents it: the SuperLink serves its Fleet, Control and
Runtime APIs with ``--ssl-ca-certfile/--ssl-certfile/--ssl-keyfile``; SuperNodes and the
ServerApp's SuperExec verify it with ``--root-certificates``; each SuperNode serves its Runtime
API (for its ClientApp's SuperExec) with its own certificate. Certificates are bind-mounted
read-only, one file at a time, so that a service sees only the keys it serves with.

The client services of ``docker-compose.yml`` are exactly what ``--clients 2`` writes (a test
checks). Standard library only: runs with any ``python3``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

FLWR_VERSION = "1.41.0"
SUPERLINK = "superlink:8000"
RUNTIME_PORT = 9094  # each SuperNode's Runtime API, inside its own container
CERT_MOUNT = "/app/certificates"
SUPEREXEC_IMAGE = "fl-attack-superexec:latest"
SUPERNODE_IMAGE = "${FLWR_REPOSITORY:-flwr}/supernode:" + FLWR_VERSION


def _tls_files(cert_dir: str, *names: str) -> list[str]:
    """Read-only bind mounts of ``cert_dir/<name>`` at ``/app/certificates/<name>``."""
    return [f"{cert_dir}/{name}:{CERT_MOUNT}/{name}:ro" for name in names]


def client_services(n: int, cert_dir: str | None = None) -> dict[str, dict]:
    """Services ``supernode-<i>`` / ``superexec-clientapp-<i>`` for ``i < n``.

    Parameters
    ----------
    n : int
        Number of clients (SuperNodes), at least 1.
    cert_dir : str or None
        Directory of ``scripts/generate_certs.sh`` output for TLS; ``None``: ``--insecure``.

    Returns
    -------
    dict
        Compose service definitions by name.

    Raises
    ------
    ValueError
        If ``n < 1``.
    """
    if n < 1:
        raise ValueError(f"the number of clients must be at least 1, got {n}")
    services: dict[str, dict] = {}
    for i in range(n):
        node, runtime = f"supernode-{i}", f"supernode-{i}:{RUNTIME_PORT}"
        node_cmd = ["--superlink", SUPERLINK, "--isolation", "process", "--host", "0.0.0.0",
                    "--port", str(RUNTIME_PORT),
                    "--node-config", f"partition-id={i} num-partitions={n}"]
        exec_cmd = ["--runtime-api-address", runtime]
        if cert_dir is None:
            node_cmd, exec_cmd = ["--insecure", *node_cmd], ["--insecure", *exec_cmd]
        else:
            node_cmd += [f"--root-certificates={CERT_MOUNT}/ca.crt",
                         f"--ssl-ca-certfile={CERT_MOUNT}/ca.crt",
                         f"--ssl-certfile={CERT_MOUNT}/{node}.pem",
                         f"--ssl-keyfile={CERT_MOUNT}/{node}.key"]
            exec_cmd += [f"--root-certificates={CERT_MOUNT}/ca.crt"]
        services[node] = {"image": SUPERNODE_IMAGE, "command": node_cmd,
                          "depends_on": ["superlink"], "restart": "on-failure"}
        services[f"superexec-clientapp-{i}"] = {
            "build": {"context": ".", "dockerfile": "Dockerfile",
                      "args": {"FLWR_REPOSITORY": "${FLWR_REPOSITORY:-flwr}"}},
            "image": SUPEREXEC_IMAGE,
            "environment": {"FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1"},
            "restart": "on-failure",
            "command": exec_cmd,
            "depends_on": [node],
        }
        if cert_dir is not None:
            services[node]["volumes"] = _tls_files(cert_dir, "ca.crt", f"{node}.pem",
                                                   f"{node}.key")
            services[f"superexec-clientapp-{i}"]["volumes"] = _tls_files(cert_dir, "ca.crt")
    return services


def server_tls_services(cert_dir: str) -> dict[str, dict]:
    """TLS versions of the ``superlink`` and ``superexec-serverapp`` commands and mounts."""
    return {
        "superlink": {
            "command": ["--isolation", "process", "--host", "0.0.0.0", "--port", "8000",
                        "--disable-runtime-dependency-installation",
                        f"--ssl-ca-certfile={CERT_MOUNT}/ca.crt",
                        f"--ssl-certfile={CERT_MOUNT}/superlink.pem",
                        f"--ssl-keyfile={CERT_MOUNT}/superlink.key"],
            "volumes": _tls_files(cert_dir, "ca.crt", "superlink.pem", "superlink.key"),
        },
        "superexec-serverapp": {
            "command": ["--runtime-api-address", SUPERLINK,
                        f"--root-certificates={CERT_MOUNT}/ca.crt"],
            "volumes": _tls_files(cert_dir, "ca.crt"),
        },
    }


def override(n: int, cert_dir: str | None = None) -> dict:
    """The whole override document (``services:``) for ``n`` clients."""
    services = server_tls_services(cert_dir) if cert_dir is not None else {}
    services.update(client_services(n, cert_dir))
    return {"services": services}


def to_yaml(value: object, indent: int = 0) -> str:
    """Block-style YAML of nested dicts/lists of strings (scalars JSON-quoted, valid YAML)."""
    pad = "  " * indent
    lines: list[str] = []
    if isinstance(value, dict):
        for key, item in value.items():
            if isinstance(item, (dict, list)):
                lines.append(f"{pad}{key}:")
                lines.append(to_yaml(item, indent + 1))
            else:
                lines.append(f"{pad}{key}: {json.dumps(item)}")
    elif isinstance(value, list):
        for item in value:
            if isinstance(item, (dict, list)):
                raise TypeError("lists of containers are not used in compose overrides here")
            lines.append(f"{pad}- {json.dumps(item)}")
    else:
        raise TypeError(f"unsupported value {value!r}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=2, help="number of clients N (default 2)")
    parser.add_argument("--tls", metavar="CERT_DIR", default=None,
                        help="certificate directory (relative to the repository root, e.g. "
                             "./.compose/certs); default: no TLS (--insecure, local demo only)")
    parser.add_argument("-o", "--output", type=Path, default=None,
                        help="file to write (default: standard output)")
    args = parser.parse_args(argv)
    if args.clients < 1:
        parser.error(f"--clients must be at least 1, got {args.clients}")
    cert_dir = args.tls.rstrip("/") if args.tls else None
    mode = f"TLS, certificates in {cert_dir}" if cert_dir else "no TLS (--insecure)"
    text = (f"# Written by scripts/compose_override.py --clients {args.clients}"
            f"{' --tls ' + cert_dir if cert_dir else ''}: {args.clients} clients, {mode}.\n"
            + to_yaml(override(args.clients, cert_dir)) + "\n")
    if args.output is None:
        sys.stdout.write(text)
    else:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
