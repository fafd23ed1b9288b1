"""Pieces every benchmark script shares: naming the machine and the per-run options."""

from __future__ import annotations

import argparse
import platform
from pathlib import Path


def cpu_name() -> str:
    """A readable CPU name: /proc/cpuinfo's model name, else ``platform.processor()``.

    ``platform.processor()`` is empty on many Linux systems; seconds measured on different
    machines must not be compared by mistake, so results files name the CPU model.
    """
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def add_run_args(parser: argparse.ArgumentParser, results: Path) -> None:
    """The options of one benchmark run: batches, first seed, budget, device, results file."""
    parser.add_argument("--batches", type=int, default=3, help="batches per setting (default 3)")
    parser.add_argument("--first-seed", type=int, default=0,
                        help="seed of the first batch (batches use consecutive seeds)")
    parser.add_argument("--max-seconds", type=float, default=None,
                        help="per-batch budget passed to fl_attack.invert (default: none)")
    parser.add_argument("--device", default=None, help="attack device (default: cuda if any)")
    parser.add_argument("--out", type=Path, default=results, help=f"results file ({results})")


def check_run_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Reject a non-positive batch count or budget with the parser's usage error."""
    if args.batches < 1:
        parser.error("--batches must be >= 1")
    if args.max_seconds is not None and args.max_seconds <= 0:
        parser.error("--max-seconds must be > 0")
