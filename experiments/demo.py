"""``make demo``: a small audited federation on real data, then its verdict and report path.

Three clients train a ReLU MLP (3 hidden layers of width 200) on real photographs cut into
CIFAR-10-shaped 32x32 crops (``photos32``, offline) with FedSGD for two rounds, batch size 16;
the server wraps FedAvg in the privacy audit, inverts every update (SPEAR++, on a pool of worker
processes) and scores the reconstructions against the clients' true batches (audit mode). It
runs on Flower's simulation engine (Ray) in-process via ``flwr.simulation.run_simulation``: no
SuperLink, no ports, nothing left running afterwards, and it works offline.
``run_simulation`` passes an empty run config, so the configuration travels in
``$FL_ATTACK_RUN_CONFIG`` (see ``strategies/app/run_config.py``).

    .venv/bin/python -m experiments.demo                      # the default demo
    .venv/bin/python -m experiments.demo --set dataset=mnist --set protocol=fedavg
    .venv/bin/python -m experiments.demo --json               # machine-readable summary only
    .venv/bin/python -m experiments.demo --text               # make demo-text: SmolLM2, text
    .venv/bin/python -m experiments.demo --quiet              # the verdict and table only

The configuration is checked before anything runs: a bad setting exits with status 2 and a
message naming it. Exit status 0 when the run completed and wrote its summary, 1 otherwise,
and 3 when the privacy gate ``--set fail-on=certified`` (or ``readable``, ``reconstructed``)
trips: the run completed, and the clients leaked what the gate forbids.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from experiments import harness

ROOT = harness.ROOT

#: The demo's configuration (the rest comes from ``DEFAULT_RUN_CONFIG``).
DEMO_CONFIG: dict[str, Any] = {
    "num-server-rounds": 2,
    "num-clients": 3,
    "protocol": "fedsgd",
    "dataset": "photos32",
    "dataset-size": 1000,
    "batch-size": 16,
    "width": 200,
    "depth": 3,
    "audit": True,
    "max-seconds": 120.0,
    "attack-timeout": 600.0,
    "audit-executor": "pool",
    "output-dir": str(ROOT / "runs"),
}


#: ``--text`` (``make demo-text``): clients fine-tune SmolLM2-135M on WordNet's example sentences
#: with FedSGD (one SGD step on 8 sentences, lr 0.05, as Flower clients send it: their weights).
TEXT_DEMO_CONFIG: dict[str, Any] = {
    "task": "text",
    "text-model": "smollm2",
    "text-source": "wordnet",
    "max-tokens": 32,
    "batch-size": 8,
    "lr": 0.05,
    "fraction-evaluate": 0.0,
    "audit-executor": "process",
}


def checked_config(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` over the defaults, checked (``RunConfigError`` names every bad key)."""
    from fl_attack_flwr.app.run_config import CONFIG_ENV, check_run_config, resolve_run_config

    saved = os.environ.get(CONFIG_ENV)
    os.environ[CONFIG_ENV] = json.dumps(config)
    try:
        return check_run_config(resolve_run_config({}))
    finally:
        if saved is None:
            os.environ.pop(CONFIG_ENV, None)
        else:
            os.environ[CONFIG_ENV] = saved


def simulate(config: dict[str, Any], *, num_supernodes: int | None = None,
             num_cpus: int | None = None, verbose: bool = False) -> dict[str, Any]:
    """Run one audited simulation in this process and return its ``summary.json``.

    ``config`` overrides :data:`fl_attack_flwr.app.run_config.DEFAULT_RUN_CONFIG`; it is checked
    first (``RunConfigError``). A ``run-name`` is generated when missing so that the summary
    can be found afterwards.
    """
    from flwr.simulation import run_simulation

    from fl_attack_flwr.app.run_config import CONFIG_ENV
    from fl_attack_flwr.app.server_app import app as server_app
    from fl_attack_flwr.clients.client_app import app as client_app
    from fl_attack_flwr.output.privacy_gate import PrivacyGateError
    from fl_attack_flwr.output.store import new_run_name

    cfg = dict(config)
    cfg.setdefault("run-name", new_run_name())
    resolved = checked_config(cfg)
    nodes = int(num_supernodes or resolved["num-clients"])
    cpus = int(num_cpus or os.cpu_count() or 2)
    backend = {
        "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
        "init_args": {"num_cpus": cpus, "num_gpus": 0, "include_dashboard": False,
                      "logging_level": "ERROR", "log_to_driver": True},
    }
    run_dir = Path(str(resolved["output-dir"])).expanduser().absolute() / str(resolved["run-name"])
    os.environ[CONFIG_ENV] = json.dumps(cfg)
    try:
        run_simulation(server_app=server_app, client_app=client_app, num_supernodes=nodes,
                       backend_config=backend, verbose_logging=verbose)
    except PrivacyGateError:
        pass  # the run completed and wrote its summary; the caller applies the gate to it
    finally:
        os.environ.pop(CONFIG_ENV, None)
    summary_path = run_dir / "summary.json"
    if not summary_path.is_file():
        raise RuntimeError(f"the simulation wrote no summary ({summary_path}); see the log")
    return json.loads(summary_path.read_text())


def _print_summary(summary: dict[str, Any], seconds: float) -> None:
    from rich.console import Console
    from rich.table import Table

    from fl_attack_flwr.output.private_files import records_from_jsonl

    console = Console()
    table = Table(title=f"Privacy audit {summary['run_name']} ({seconds:.0f} s)")
    records = records_from_jsonl(Path(summary["run_dir"]) / "metrics.jsonl")
    if summary.get("text_read") or any(r.get("text") for r in records):
        _text_rows(table, records)
        records = []
    else:
        for name, justify in (("round", "left"), ("client", "left"), ("status", "left"),
                              ("B", "right"), ("λ", "right"), ("PSNR dB", "right"),
                              ("attack s", "right")):
            table.add_column(name, justify=justify)
    for rec in records:
        lam, psnr, secs = rec.get("sparsity_match"), rec.get("psnr_mean"), rec.get("attack_seconds")
        table.add_row(str(rec["server_round"]), str(rec.get("client")), rec["status"],
                      str(rec.get("batch_size") or "–"), "–" if lam is None else f"{lam:.4f}",
                      "–" if psnr is None else f"{psnr:.1f}",
                      "–" if secs is None else f"{secs:.1f}")
    console.print(table)
    colour = {"leak": "red", "some": "yellow", "safe": "green"}.get(summary["verdict_level"],
                                                                    "white")
    console.print(f"[bold {colour}]Verdict:[/] {summary['verdict']}")
    console.print(f"[bold]Report:[/bold] {summary['report']}")


def _text_rows(table: Any, records: list[dict[str, Any]]) -> None:
    """The demo's table for a language model's updates: sentences, not pictures."""
    for name in ("round", "client", "status", "sentences read", "exact", "ROUGE-1", "attack s"):
        table.add_column(name, justify="left" if name in ("client", "status") else "right")
    for rec in records:
        t, secs = rec.get("text") or {}, rec.get("attack_seconds")
        table.add_row(str(rec["server_round"]), str(rec.get("client")), rec["status"],
                      str(t.get("sentences_read", "–")),
                      f"{t['sentences_exact']} of {t['sentences_true']}"
                      if "sentences_true" in t else "–",
                      f"{t['rouge1']:.3f}" if "rouge1" in t else "–",
                      "–" if secs is None else f"{secs:.1f}")


def quiet_logging() -> None:
    """Log only warnings from Flower, Ray and the attack: no per-round progress.

    For scripts that run simulations and print their own summary (``--quiet``, ``--json``,
    :mod:`experiments.audit_sweep`, :mod:`experiments.defences`).
    """
    from flwr.supercore.logger import update_console_handler

    update_console_handler(level=logging.WARNING)
    for name in ("fl_attack", "ray"):
        logging.getLogger(name).setLevel(logging.WARNING)


def main(argv: list[str] | None = None) -> int:
    """CLI entry point (see module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a run-config key (repeatable), e.g. --set protocol=fedavg")
    parser.add_argument("--text", action="store_true",
                        help="the text demo: clients fine-tune SmolLM2-135M on sentences")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON only")
    parser.add_argument("--quiet", action="store_true", help="print the verdict and table only")
    parser.add_argument("--verbose", action="store_true", help="Flower debug logging")
    args = parser.parse_args(argv)
    config = {**DEMO_CONFIG, **(TEXT_DEMO_CONFIG if args.text else {}),
              **harness.parse_assignments(parser, args.set, "--set", metavar="KEY=VALUE")}
    from fl_attack_flwr.app.run_config import RunConfigError

    if args.quiet or args.json:
        quiet_logging()
    t0 = time.time()
    try:
        summary = simulate(config, verbose=args.verbose)
    except RunConfigError as exc:
        print(f"demo: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - report and exit non-zero
        print(f"demo failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(summary))
    else:
        _print_summary(summary, time.time() - t0)
    if summary.get("status") != "completed":
        return 1
    from fl_attack_flwr.output.privacy_gate import gate_failure

    failure = gate_failure(summary, str(config.get("fail-on", "")))
    if failure is not None:
        print(f"demo: {failure}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
