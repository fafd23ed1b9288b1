"""The options every benchmark shares, and the parsers of list-valued options."""

from __future__ import annotations

import argparse
import ast
import json
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from experiments.harness.paths import ROOT

__all__ = [
    "add_batches",
    "add_dataset",
    "add_device",
    "add_first_seed",
    "add_max_seconds",
    "add_out",
    "add_run_args",
    "check_run_args",
    "json_value",
    "list_of",
    "parse_assignments",
    "parse_list",
    "parse_settings",
    "python_value",
]


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
