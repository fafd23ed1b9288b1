"""Markdown tables and results files: open a dated section, append rows as they finish."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

__all__ = [
    "append_lines",
    "markdown_table",
    "start_section",
    "table_header",
    "table_row",
]


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
