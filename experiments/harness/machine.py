"""The header of a results section: when, which command, on which machine and code."""

from __future__ import annotations

import datetime as dt
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Mapping, Sequence

from experiments.harness.paths import ROOT

__all__ = [
    "code_version",
    "command_line",
    "cpu_name",
    "machine_line",
    "resolve_device",
    "section_heading",
    "utc_now",
]


def cpu_name() -> str:
    """A readable CPU name: /proc/cpuinfo's model name, else ``platform.processor()``.

    ``platform.processor()`` is empty on many Linux systems; seconds measured on different
    machines must not be compared by mistake, so results files name the CPU model.

    Returns
    -------
    str
        E.g. ``"AMD EPYC 9654 96-Core Processor"``, or ``"x86_64"`` when nothing better is known.
    """
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def code_version() -> str:
    """The commit the measured code comes from, and whether ``fl_attack/`` had local changes.

    Returns
    -------
    str
        ``"commit abc1234"``, with ``" (uncommitted changes in fl_attack/)"`` when the attack
        code differs from that commit, or ``"commit unknown"`` outside a git checkout.
    """
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, check=True,
                              capture_output=True, text=True, timeout=30).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "fl_attack"], cwd=ROOT,
                               check=True, capture_output=True, text=True,
                               timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "commit unknown"
    return f"commit {head}" + (" (uncommitted changes in fl_attack/)" if dirty else "")


def resolve_device(device: str | None) -> str:
    """The device an attack runs on: ``device``, else ``"cuda"`` when available, else CPU.

    Parameters
    ----------
    device : str, optional
        What the user asked for (``--device``).

    Returns
    -------
    str
        A torch device name.
    """
    if device:
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def machine_line(device: str | None = None, versions: Mapping[str, str] | None = None) -> str:
    """One line naming the machine and the code, for a results section.

    Parameters
    ----------
    device : str, optional
        The attack's device (None: CUDA when available, else CPU); a CUDA device is named by
        its model.
    versions : mapping of str to str, optional
        Further packages' versions to name (e.g. ``{"Opacus": "1.5.4"}``).

    Returns
    -------
    str
        ``"Machine: <CPU model>, <n> cores; torch <v> with <t> thread(s); device <d>; Python
        <v>, ...; commit <hash>."``
    """
    import torch

    used = resolve_device(device)
    if used.startswith("cuda") and torch.cuda.is_available():
        index = torch.device(used).index or 0
        where = f"CUDA ({torch.cuda.get_device_name(index)})"
    else:
        where = used
    extra = "".join(f", {name} {v}" for name, v in (versions or {}).items())
    return (f"Machine: {cpu_name()}, {os.cpu_count()} cores; torch {torch.__version__} with "
            f"{torch.get_num_threads()} thread(s); device {where}; Python "
            f"{platform.python_version()}{extra}; {code_version()}.")


def utc_now() -> dt.datetime:
    """The current time in UTC (results sections are dated in UTC)."""
    return dt.datetime.now(dt.UTC)


def command_line(module: str, argv: Sequence[str] | None = None) -> str:
    """The command that reproduces this run, for the section heading.

    Parameters
    ----------
    module : str
        The script's module, e.g. ``"experiments.bench_core"``.
    argv : sequence of str, optional
        The arguments given (None: ``sys.argv[1:]``).

    Returns
    -------
    str
        ``"python -m <module> <args>"``, shell-quoted.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    return shlex.join(["python", "-m", module, *args])


def section_heading(module: str, argv: Sequence[str] | None = None,
                    started: dt.datetime | None = None) -> str:
    """The heading of one run's section: its UTC date and time and its command.

    Parameters
    ----------
    module : str
        The script's module, e.g. ``"experiments.bench_core"``.
    argv : sequence of str, optional
        The arguments given (None: ``sys.argv[1:]``).
    started : datetime, optional
        When the run started (None: now).

    Returns
    -------
    str
        ``"## 2026-11-26 14:03 UTC — `python -m experiments.bench_core --batches 1`"``.
    """
    when = (started or utc_now()).astimezone(dt.UTC)
    return f"## {when:%Y-%m-%d %H:%M} UTC — `{command_line(module, argv)}`"
