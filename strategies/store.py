"""Private, crash-safe storage of an audit run.

Reconstructions are the clients' private data, so everything here is owner-only (directories
``0700``, files ``0600``). Files are written atomically (temp file in the same directory,
``fsync``, ``os.replace``, ``fsync`` of the directory): a crash never leaves a half-written file,
and a reader never sees one. ``metrics.jsonl`` is appended one whole line per ``write`` and
``fsync``-ed, so a long run costs the same per record; a reader skips an incomplete last line
(:func:`records_from_jsonl`). A run directory is created with ``exist_ok=False`` semantics, so a
second run can never overwrite the first. The report is rendered by ``strategies/report.py``.

Layout of ``<output-dir>/<run-name>/``::

    config.json                      the run configuration
    metrics.jsonl                    one JSON line per (round, client), appended as results land
    round-<r>/<client label>/
        reconstruction.png           grid of the reconstructed images (denormalised)
        original.png                 grid of the client's true images (audit mode only)
        inputs.npz                   raw reconstructed layer inputs (+ matching, indices)
        metrics.json                 the client's line of metrics.jsonl
    rounds.jsonl                     one JSON line per round (timings, aggregated metrics)
    summary.json                     totals and the verdict
    report.html                      verdict, images beside originals, tables, plots (inline)

Nothing in this module imports Flower: the strategy hands it plain :class:`ClientAudit` records.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import re
import secrets
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fl_attack_flwr import verdicts

__all__ = [
    "AuditStore",
    "ClientAudit",
    "atomic_write_bytes",
    "image_grid",
    "jsonable",
    "make_private_dir",
    "new_run_name",
    "png_bytes",
    "records_from_jsonl",
]

DIR_MODE = 0o700
FILE_MODE = 0o600
_RUN_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")



# --------------------------------------------------------------------------- low-level I/O


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


def _dumps(obj: Any, **kw: Any) -> str:
    return json.dumps(jsonable(obj), allow_nan=False, **kw)


def new_run_name() -> str:
    """A unique, sortable run name: UTC timestamp plus a random short id."""
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + secrets.token_hex(3)


# --------------------------------------------------------------------------- images


def image_grid(images: np.ndarray, *, ncols: int | None = None, pad: int = 2,
               min_side: int = 256) -> np.ndarray:
    """Tile ``(B, C, H, W)`` images in ``[0, 1]`` into one ``uint8`` RGB grid.

    Values are clipped to ``[0, 1]``; one-channel images are shown as grey. The grid is upscaled
    by an integer factor (nearest neighbour) so that it is at least ``min_side`` pixels wide:
    32x32 reconstructions are unreadable at their native size.
    """
    x = np.asarray(images, dtype=np.float64)
    if x.ndim != 4 or x.shape[0] == 0:
        raise ValueError(f"expected a non-empty (B, C, H, W) array, got shape {x.shape}")
    b, c, h, w = x.shape
    if c == 1:
        x = np.repeat(x, 3, axis=1)
    elif c != 3:
        raise ValueError(f"images must have 1 or 3 channels, got {c}")
    x = np.nan_to_num(np.clip(x, 0.0, 1.0), nan=0.0)
    cols = ncols or int(math.ceil(math.sqrt(b)))
    rows = int(math.ceil(b / cols))
    grid = np.ones((rows * (h + pad) + pad, cols * (w + pad) + pad, 3))
    for i in range(b):
        r, k = divmod(i, cols)
        y0, x0 = pad + r * (h + pad), pad + k * (w + pad)
        grid[y0 : y0 + h, x0 : x0 + w] = x[i].transpose(1, 2, 0)
    scale = max(1, int(math.ceil(min_side / grid.shape[1])))
    if scale > 1:
        grid = grid.repeat(scale, axis=0).repeat(scale, axis=1)
    return (grid * 255.0 + 0.5).astype(np.uint8)


def png_bytes(rgb: np.ndarray) -> bytes:
    """Encode an ``(H, W, 3)`` uint8 image as PNG (matplotlib's writer, no pyplot state)."""
    from matplotlib import image as mpimg

    buf = io.BytesIO()
    mpimg.imsave(buf, rgb, format="png")
    return buf.getvalue()


# --------------------------------------------------------------------------- records


@dataclass
class ClientAudit:
    """What the server learned about one client's update in one round.

    ``status`` is one of ``verdicts.STATUSES``, with ``reason`` in plain words where the status
    needs one. Array fields never go to ``metrics.jsonl`` (only to the client directory):
    ``inputs`` are the reconstructed layer inputs ``(B, n)``; ``recon_images`` /
    ``original_images`` are ``(B, C, H, W)`` in ``[0, 1]``, the reconstructions put in the
    originals' order when the ground truth is known.
    """

    server_round: int
    node_id: int
    partition_id: int | None = None
    label: str | None = None
    status: str = verdicts.PENDING
    reason: str | None = None
    error: str | None = None
    protocol: str | None = None
    reading: str | None = None
    layer: str | None = None
    layer_shape: list[int] | None = None
    inputs_are: str | None = None
    num_examples: int | None = None
    batch_size: int | None = None
    true_batch_size: int | None = None
    sparsity_match: float | None = None
    exact: bool | None = None
    n_directions: int | None = None
    attack_seconds: float | None = None
    psnr: list[float] | None = None
    psnr_mean: float | None = None
    epsilon: float | None = None
    epsilon_cumulative: float | None = None
    delta: float | None = None
    noise_std: float | None = None
    attack: dict[str, Any] | None = None
    sample_indices: list[int] | None = None
    inputs: np.ndarray | None = field(default=None, repr=False)
    recon_images: np.ndarray | None = field(default=None, repr=False)
    original_images: np.ndarray | None = field(default=None, repr=False)
    matching: np.ndarray | None = field(default=None, repr=False)
    dir: str | None = None
    stored_at: float | None = None
    """Seconds from the start of the run until the record was stored."""

    def __post_init__(self) -> None:
        if self.status not in verdicts.STATUSES:
            raise ValueError(f"unknown status {self.status!r}; expected one of "
                             f"{verdicts.STATUSES}")

    @property
    def client_label(self) -> str:
        """``client-<partition-id>``, the label the strategy gave, or ``node-<node-id>``."""
        if self.partition_id is not None:
            return f"client-{self.partition_id}"
        return self.label or f"node-{self.node_id}"

    @property
    def reconstructed(self) -> bool:
        """Whether the record holds a reconstruction (certified, not certified or partial)."""
        return self.status in verdicts.RECONSTRUCTED

    def metrics(self) -> dict[str, Any]:
        """The JSON-safe line written to ``metrics.jsonl`` (no arrays, no sample indices)."""
        keys = (
            "server_round", "partition_id", "node_id", "status", "reason", "error", "protocol",
            "reading", "layer", "layer_shape", "inputs_are", "num_examples", "batch_size",
            "true_batch_size", "sparsity_match", "exact", "n_directions", "attack_seconds",
            "psnr_mean", "psnr", "epsilon", "epsilon_cumulative", "delta", "noise_std", "attack",
            "dir", "stored_at",
        )
        line = {k: getattr(self, k) for k in keys}
        line["client"] = self.client_label
        return jsonable(line)


# --------------------------------------------------------------------------- the store


class AuditStore:
    """Owner-only directory of one audit run; see the module docstring for the layout.

    Parameters
    ----------
    output_dir : path
        Parent directory (created ``0700`` if missing; an existing one is left as it is).
    run_name : str, optional
        The run's directory name; default :func:`new_run_name`. The directory must not exist:
        ``FileExistsError`` otherwise (a second run never overwrites the first).
    config : mapping, optional
        The run configuration, written to ``config.json`` and shown in the report.
    """

    def __init__(self, output_dir: str | os.PathLike[str] = "runs", run_name: str | None = None,
                 *, config: Mapping[str, Any] | None = None) -> None:
        name = run_name or new_run_name()
        if not _RUN_NAME_RE.match(name) or name in (".", ".."):
            raise ValueError(f"invalid run name {name!r} (letters, digits, '.', '_', '-')")
        self.root = Path(output_dir).expanduser().absolute()
        if not self.root.exists():
            self.root.mkdir(parents=True, mode=DIR_MODE, exist_ok=True)
            os.chmod(self.root, DIR_MODE)
        self.run_name = name
        self.run_dir = make_private_dir(self.root / name, exist_ok=False)
        self.config: dict[str, Any] = dict(config or {})
        self.records: list[ClientAudit] = []
        self.rounds: dict[int, dict[str, Any]] = {}
        self.notes: list[str] = []
        """Plain-words warnings for the report (e.g. from the strategy about its setup)."""
        self.started = time.time()
        atomic_write_bytes(self.run_dir / "config.json", _dumps(self.config, indent=2).encode())
        for name in ("metrics.jsonl", "rounds.jsonl"):  # exist even with no line
            atomic_write_bytes(self.run_dir / name, b"")

    def client_dir(self, record: ClientAudit) -> Path:
        """Create (``0700``) and return a fresh directory for ``record``.

        A second record with the same round and label (e.g. two replies claiming one partition
        id) gets a ``-2``, ``-3``, ... suffix instead of overwriting the first.
        """
        round_dir = make_private_dir(self.run_dir / f"round-{record.server_round}",
                                      exist_ok=True)
        base = record.client_label
        for k in range(1, 1000):
            path = round_dir / (base if k == 1 else f"{base}-{k}")
            try:
                return make_private_dir(path, exist_ok=False)
            except FileExistsError:
                continue
        raise RuntimeError(f"too many records named {base} in round {record.server_round}")

    def add(self, record: ClientAudit) -> Path:
        """Store one client's result: its directory, and a line appended to ``metrics.jsonl``.

        The line's ``dir`` is the directory actually written (``client-3-2`` when ``client-3``
        was taken).
        """
        cdir = self.client_dir(record)
        record.dir = str(cdir.relative_to(self.run_dir))
        record.stored_at = time.time() - self.started
        if record.recon_images is not None:
            atomic_write_bytes(cdir / "reconstruction.png",
                               png_bytes(image_grid(record.recon_images)))
        if record.original_images is not None:
            atomic_write_bytes(cdir / "original.png",
                               png_bytes(image_grid(record.original_images)))
        if record.inputs is not None:
            arrays: dict[str, np.ndarray] = {"inputs": np.asarray(record.inputs)}
            if record.matching is not None:
                arrays["matching"] = np.asarray(record.matching)
            if record.sample_indices is not None:
                arrays["sample_indices"] = np.asarray(record.sample_indices, dtype=np.int64)
            buf = io.BytesIO()
            np.savez_compressed(buf, **arrays)
            atomic_write_bytes(cdir / "inputs.npz", buf.getvalue())
        line = record.metrics()
        atomic_write_bytes(cdir / "metrics.json", _dumps(line, indent=2).encode())
        self.records.append(record)
        append_line(self.run_dir / "metrics.jsonl", _dumps(line))
        return cdir

    def add_round(self, server_round: int, info: Mapping[str, Any]) -> None:
        """Record round-level facts (wall time, aggregated metrics) and append them."""
        entry = self.rounds.setdefault(int(server_round), {})
        entry.update(jsonable(dict(info)))
        append_line(self.run_dir / "rounds.jsonl", _dumps({"round": int(server_round), **entry}))

    def finalize(self, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Write ``summary.json`` and ``report.html``; return the summary."""
        from fl_attack_flwr.report import render_report, summarize

        summary = summarize(self.records, self.rounds, self.config, run_name=self.run_name,
                            run_dir=self.run_dir, wall_seconds=time.time() - self.started)
        summary["notes"] = [*self.notes, *summary.get("notes", [])]
        if extra:
            summary.update(jsonable(dict(extra)))
        atomic_write_bytes(self.run_dir / "summary.json", _dumps(summary, indent=2).encode())
        page = render_report(summary, self.records, self.rounds, self.config)
        atomic_write_bytes(self.run_dir / "report.html", page.encode())
        return summary


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
