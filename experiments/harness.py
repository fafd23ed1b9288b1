"""What every benchmark script shares: its common options, its header, its tables, its file.

A benchmark measures something, prints it, and appends a dated section to a Markdown results
file under ``experiments/results/``. The pieces of that which do not depend on what is measured
live here, so that the scripts agree on them and none borrows from another:

* **options** -- :func:`add_run_args` and the single-option helpers (batches, first seed,
  per-batch budget, device, dataset, results file) with the list parsers they use;
* **header** -- :func:`section_heading` (UTC date and time, the command) and
  :func:`machine_line` (CPU model, cores, torch threads, device, versions, commit), so that
  seconds measured on different machines or code are never compared by mistake;
* **tables** -- :func:`table_header`, :func:`table_row`, :func:`markdown_table`;
* **results** -- :func:`start_section` (create the file with its title and introduction,
  then open this run's section at the end of the file) and :func:`append_lines` (rows and
  notes, written as they finish so an interrupted run keeps what it measured).

Results files open with a summary maintained by hand, followed by the dated sections the
scripts append at the end.
"""

from __future__ import annotations

import argparse
import ast
import datetime as dt
import json
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
"""The repository root (the parent of ``experiments/``)."""
RESULTS_DIR = ROOT / "experiments" / "results"
"""Where the results files live."""

# ---------------------------------------------------------------------------------------------
# options
# ---------------------------------------------------------------------------------------------


def parse_list(text: str, kind: Callable[[str], Any], what: str) -> list:
    """Parse a comma-separated list of numbers for an option.

    Parameters
    ----------
    text : str
        The option's value, e.g. ``"0,0.1,1"``; empty items are skipped.
    kind : callable
        Converts one item (``int``, ``float``).
    what : str
        The option's name, for the error message.

    Returns
    -------
    list
        The converted items.

    Raises
    ------
    argparse.ArgumentTypeError
        When an item does not convert or the list is empty, so that argparse reports a usage
        error naming the option instead of a traceback.
    """
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{what}: cannot parse {text!r} ({exc})") from exc
    if not values:
        raise argparse.ArgumentTypeError(f"{what}: empty list")
    return values


def list_of(kind: Callable[[str], Any], what: str) -> Callable[[str], list]:
    """An argparse ``type`` that parses a comma-separated list with :func:`parse_list`.

    Parameters
    ----------
    kind : callable
        Converts one item (``int``, ``float``).
    what : str
        The option's name, for the error message.

    Returns
    -------
    callable
        ``text -> list``.
    """
    def parse(text: str) -> list:
        return parse_list(text, kind, what)

    return parse


def parse_settings(text: str) -> list[tuple[int, int]]:
    """Parse ``--settings``: ``"20x200,150x4000"`` gives ``[(20, 200), (150, 4000)]``.

    Parameters
    ----------
    text : str
        Comma-separated ``BxM`` items (batch size B, layer width m).

    Returns
    -------
    list of (int, int)
        The (B, m) pairs, in the order given.

    Raises
    ------
    argparse.ArgumentTypeError
        When an item is not ``BxM`` with B, m >= 1.
    """
    out = []
    for item in text.split(","):
        try:
            b, m = (int(v) for v in item.strip().lower().split("x"))
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"--settings: {item!r} is not BxM") from exc
        if b < 1 or m < 1:
            raise argparse.ArgumentTypeError(f"--settings: {item!r} needs B, m >= 1")
        out.append((b, m))
    return out


def json_value(text: str) -> Any:
    """A ``KEY=VALUE`` value as JSON when it parses (numbers, ``true``), else the string.

    Parameters
    ----------
    text : str
        The text after ``=``.

    Returns
    -------
    Any
        The JSON value, or ``text`` itself.
    """
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def python_value(text: str) -> Any:
    """A ``NAME=VALUE`` value as a Python literal when it parses (``True``, ``0.5``), else the
    string.

    Parameters
    ----------
    text : str
        The text after ``=``.

    Returns
    -------
    Any
        The literal, or ``text`` itself.
    """
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def parse_assignments(parser: argparse.ArgumentParser, items: Iterable[str], option: str,
                      value: Callable[[str], Any] = json_value,
                      metavar: str = "NAME=VALUE") -> dict[str, Any]:
    """Turn repeated ``NAME=VALUE`` options into a dict, rejecting an item without ``=``.

    Parameters
    ----------
    parser : argparse.ArgumentParser
        Reports a malformed item as a usage error (exit status 2).
    items : iterable of str
        The option's values, in order (a later name overrides an earlier one).
    option : str
        The option's name, for the error message.
    value : callable, default :func:`json_value`
        Converts the text after ``=``.
    metavar : str, default ``"NAME=VALUE"``
        How the error message spells the expected form.

    Returns
    -------
    dict
        Name (stripped) to converted value.
    """
    out: dict[str, Any] = {}
    for item in items:
        name, sep, text = item.partition("=")
        if not sep:
            parser.error(f"{option} expects {metavar}, got {item!r}")
        out[name.strip()] = value(text.strip())
    return out


def add_batches(parser: argparse.ArgumentParser, default: int = 3,
                help: str | None = None) -> None:
    """Add ``--batches``: how many batches each setting attacks.

    Parameters
    ----------
    parser : argparse.ArgumentParser
        The script's parser.
    default : int, default 3
        The script's default.
    help : str, optional
        Replaces the standard help text.
    """
    parser.add_argument("--batches", type=int, default=default,
                        help=help or f"batches per setting (default {default})")


def add_first_seed(parser: argparse.ArgumentParser, *aliases: str) -> None:
    """Add ``--first-seed`` (and ``aliases``): the seed of the first batch, stored as
    ``first_seed``. Batches use consecutive seeds, so a later run can extend an earlier one
    with new batches.

    Parameters
    ----------
    parser : argparse.ArgumentParser
        The script's parser.
    *aliases : str
        Further spellings a script has accepted (e.g. ``--first-batch``).
    """
    parser.add_argument("--first-seed", *aliases, dest="first_seed", type=int, default=0,
                        help="seed of the first batch (batches use consecutive seeds)")


def add_max_seconds(parser: argparse.ArgumentParser, default: float | None = None,
                    help: str | None = None) -> None:
    """Add ``--max-seconds``: the wall-clock budget of one attack.

    Parameters
    ----------
    parser : argparse.ArgumentParser
        The script's parser.
    default : float, optional
        The script's default (None: no budget).
    help : str, optional
        Replaces the standard help text.
    """
    parser.add_argument("--max-seconds", type=float, default=default,
                        help=help or f"per-batch budget passed to fl_attack.invert "
                                     f"(default: {default or 'none'})")


def add_device(parser: argparse.ArgumentParser) -> None:
    """Add ``--device``: where the attack runs (default: CUDA when available)."""
    parser.add_argument("--device", default=None, help="attack device (default: cuda if any)")


def add_dataset(parser: argparse.ArgumentParser, default: str = "photos32",
                choices: Sequence[str] | None = None, help: str | None = None) -> None:
    """Add ``--dataset``: where the batches come from (``fl_attack.testbed.data``).

    Parameters
    ----------
    parser : argparse.ArgumentParser
        The script's parser.
    default : str, default ``"photos32"``
        CIFAR-shaped crops of real photographs.
    choices : sequence of str, optional
        The datasets the script supports (None: any name ``data.sample_batch`` knows).
    help : str, optional
        Replaces the standard help text.
    """
    parser.add_argument("--dataset", default=default, choices=choices,
                        help=help or f"dataset of the batches (default {default})")


def add_out(parser: argparse.ArgumentParser, default: Path, *aliases: str) -> None:
    """Add ``--out`` (and ``aliases``): the results file this run appends its section to,
    stored as ``out``. Pointing it elsewhere (e.g. under /tmp) leaves the real results alone.

    Parameters
    ----------
    parser : argparse.ArgumentParser
        The script's parser.
    default : Path
        The script's results file under ``experiments/results/``.
    *aliases : str
        Further spellings a script has accepted (e.g. ``--output``, ``--md``).
    """
    shown = default.relative_to(ROOT) if default.is_relative_to(ROOT) else default
    parser.add_argument("--out", *aliases, dest="out", type=Path, default=default,
                        help=f"results file (default {shown})")


def add_run_args(parser: argparse.ArgumentParser, results: Path, *, batches: int = 3,
                 max_seconds: float | None = None) -> None:
    """Add the options of one benchmark run: batches, first seed, budget, device, results file.

    Parameters
    ----------
    parser : argparse.ArgumentParser
        The script's parser.
    results : Path
        The script's default results file.
    batches : int, default 3
        Default of ``--batches``.
    max_seconds : float, optional
        Default of ``--max-seconds`` (None: no budget).
    """
    add_batches(parser, batches)
    add_first_seed(parser)
    add_max_seconds(parser, max_seconds)
    add_device(parser)
    add_out(parser, results)


def check_run_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Reject a non-positive batch count or budget with the parser's usage error.

    Parameters
    ----------
    parser : argparse.ArgumentParser
        Reports the error (exit status 2).
    args : argparse.Namespace
        Parsed options; ``batches`` and ``max_seconds`` are checked where present.
    """
    if getattr(args, "batches", 1) < 1:
        parser.error("--batches must be >= 1")
    budget = getattr(args, "max_seconds", None)
    if budget is not None and budget <= 0:
        parser.error("--max-seconds must be > 0")


# ---------------------------------------------------------------------------------------------
# header: when, what, on which machine and code
# ---------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------
# Markdown tables
# ---------------------------------------------------------------------------------------------


def table_row(cells: Sequence[object]) -> str:
    """One Markdown table row: ``| a | b | c |``.

    Parameters
    ----------
    cells : sequence
        The cells, formatted with ``str``; a ``|`` inside a cell must be escaped (``\\|``).

    Returns
    -------
    str
        The row.
    """
    return "| " + " | ".join(str(c) for c in cells) + " |"


def table_header(columns: Sequence[str], align: Sequence[str] | None = None) -> list[str]:
    """A Markdown table's header row and rule.

    Parameters
    ----------
    columns : sequence of str
        Column titles.
    align : sequence of str, optional
        Per column ``"l"`` (``---``) or ``"r"`` (``---:``); None: all ``---``.

    Returns
    -------
    list of str
        ``[header, rule]``.
    """
    if align is not None and len(align) != len(columns):
        raise ValueError(f"{len(align)} alignments for {len(columns)} columns")
    rule = "|" + "".join("---:|" if a == "r" else "---|" for a in (align or "l" * len(columns)))
    return [table_row(columns), rule]


def markdown_table(columns: Sequence[str], rows: Iterable[Sequence[object]],
                   align: Sequence[str] | None = None) -> list[str]:
    """A whole Markdown table: header, rule and rows.

    Parameters
    ----------
    columns : sequence of str
        Column titles.
    rows : iterable of sequences
        The rows' cells (see :func:`table_row`).
    align : sequence of str, optional
        See :func:`table_header`.

    Returns
    -------
    list of str
        One line per table line.
    """
    return [*table_header(columns, align), *(table_row(r) for r in rows)]


# ---------------------------------------------------------------------------------------------
# results files
# ---------------------------------------------------------------------------------------------


def start_section(path: Path, title: str, intro: str, lines: Iterable[str]) -> None:
    """Open this run's section at the end of the results file ``path``.

    A new file starts with ``# title`` and ``intro`` (what the file's tables measure); an
    existing one is kept as it is and the section goes after its last line.

    Parameters
    ----------
    path : Path
        The results file (its folder is created when missing).
    title : str
        The file's title, without ``#``.
    intro : str
        The paragraphs under the title.
    lines : iterable of str
        The section's first lines: its heading (:func:`section_heading`), the machine line,
        the setup, a table header.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as fh:
        if fh.tell() == 0:
            fh.write(f"# {title}\n\n{intro.strip()}\n")
        fh.write("\n" + "\n".join(lines) + "\n")


def append_lines(path: Path, *lines: str) -> None:
    """Append lines (table rows, notes) to the results file right away.

    Writing each row as it finishes means an interrupted long run keeps what it measured.

    Parameters
    ----------
    path : Path
        The results file; its section was opened with :func:`start_section`.
    *lines : str
        The lines, each written with a newline.
    """
    with path.open("a", encoding="utf-8") as fh:
        fh.write("".join(line + "\n" for line in lines))
