"""Owner-only, crash-safe files: what every file of an audit run is written with.

Reconstructions are the clients' private data, so everything is owner-only (directories
``0700``, files ``0600``). Files are written atomically (temp file in the same directory,
``fsync``, ``os.replace``, ``fsync`` of the directory): a crash never leaves a half-written file,
and a reader never sees one. JSON-lines files are appended one whole line per ``write`` and
``fsync``-ed; a reader skips an incomplete last line (:func:`records_from_jsonl`).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

DIR_MODE = 0o700
FILE_MODE = 0o600


def _fsync_dir(path: Path) -> None:
    """Persist a directory entry (rename / create); best effort where unsupported."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically with mode ``0600``.

    The bytes go to a temporary file created (``0600``, by ``mkstemp``) in the same directory,
    which is flushed and fsynced, then renamed over ``path`` with ``os.replace``; the directory is
    fsynced so the rename survives a crash.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, FILE_MODE)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)
    return path


def make_private_dir(path: Path, *, exist_ok: bool) -> Path:
    """Create ``path`` with mode ``0700`` (parents must exist); ``FileExistsError`` if it exists
    and ``exist_ok`` is false. The mode is forced with ``chmod`` (the umask may not clear it)."""
    try:
        os.mkdir(path, DIR_MODE)
    except FileExistsError:
        if not exist_ok:
            raise
        if not path.is_dir():
            raise
        return path
    os.chmod(path, DIR_MODE)
    _fsync_dir(path.parent)
    return path


def jsonable(value: Any) -> Any:
    """Convert ``value`` to strict JSON types: numpy scalars/arrays to Python, NaN to ``None``,
    ``±inf`` to the strings ``"inf"`` / ``"-inf"`` (an infinite ε is meaningful: no privacy)."""
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return jsonable(value.tolist())
    if isinstance(value, (np.bool_, bool)):
        return bool(value)
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, (float, np.floating)):
        v = float(value)
        if math.isnan(v):
            return None
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return v
    if isinstance(value, (int, str)) or value is None:
        return value
    if isinstance(value, Path):
        return str(value)
    return str(value)


def dumps(obj: Any, **kw: Any) -> str:
    """Strict JSON of ``obj`` after :func:`jsonable` (no NaN, no numpy types)."""
    return json.dumps(jsonable(obj), allow_nan=False, **kw)


def append_line(path: Path, line: str) -> None:
    """Append ``line`` and a newline to ``path`` in one ``write``, then ``fsync``."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, FILE_MODE)
    try:
        os.write(fd, (line + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def records_from_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Read back a ``metrics.jsonl`` (an incomplete last line, from a crash, is skipped)."""
    out = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            if not line.endswith("\n"):
                break
            if line.strip():
                out.append(json.loads(line))
    return out
