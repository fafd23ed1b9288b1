"""Private, crash-safe storage of an audit run, and its self-contained HTML report.

Reconstructions are the clients' private data, so everything here is owner-only (directories
``0700``, files ``0600``) and written atomically (temp file in the same directory, ``fsync``,
``os.replace``, ``fsync`` of the directory): a crash never leaves a half-written file, and a
reader never sees one. A run directory is created with ``exist_ok=False`` semantics, so a second
run can never overwrite the first.

Layout of ``<output-dir>/<run-name>/``::

    config.json                      the run configuration
    metrics.jsonl                    one JSON line per (round, client)
    round-<r>/client-<pid>/
        reconstruction.png           grid of the reconstructed images (denormalised)
        original.png                 grid of the client's true images (audit mode only)
        inputs.npz                   raw reconstructed layer inputs (+ matching, indices)
        metrics.json                 the client's line of metrics.jsonl
    summary.json                     totals (reconstructions, certified_exact, psnr_mean, epsilon)
    report.html                      images beside originals, metrics table, plot (base64 inline)

Nothing in this module imports Flower: the strategy hands it plain :class:`ClientAudit` records.
"""

from __future__ import annotations

import base64
import contextlib
import html
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

__all__ = [
    "AuditStore",
    "ClientAudit",
    "atomic_write_bytes",
    "image_grid",
    "jsonable",
    "new_run_name",
    "records_from_jsonl",
]

DIR_MODE = 0o700
FILE_MODE = 0o600
_RUN_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")

#: Status values of a :class:`ClientAudit`.
STATUSES = ("ok", "attack-error", "timeout", "corrupt", "client-error", "no-update")


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


def _make_private_dir(path: Path, *, exist_ok: bool) -> Path:
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


def _png_bytes(rgb: np.ndarray) -> bytes:
    """Encode an ``(H, W, 3)`` uint8 image as PNG (matplotlib's writer, no pyplot state)."""
    from matplotlib import image as mpimg

    buf = io.BytesIO()
    mpimg.imsave(buf, rgb, format="png")
    return buf.getvalue()


# --------------------------------------------------------------------------- records


@dataclass
class ClientAudit:
    """What the server learned about one client's update in one round.

    Array fields are optional and never go to ``metrics.jsonl`` (only to the client directory):
    ``inputs`` are the reconstructed layer inputs ``(B, n)``; ``recon_images`` / ``original_images``
    are ``(B, C, H, W)`` in ``[0, 1]``, the reconstructions put in the originals' order when the
    ground truth is known.
    """

    server_round: int
    node_id: int
    partition_id: int | None = None
    status: str = "ok"
    error: str | None = None
    protocol: str | None = None
    num_examples: int | None = None
    batch_size: int | None = None
    true_batch_size: int | None = None
    sparsity_match: float | None = None
    exact: bool | None = None
    n_directions: int | None = None
    attack_seconds: float | None = None
    psnr: list[float] | None = None
    psnr_mean: float | None = None
    ssim_mean: float | None = None
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

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"unknown status {self.status!r}; expected one of {STATUSES}")

    @property
    def client_label(self) -> str:
        """``client-<partition-id>``, or ``node-<node-id>`` when the client did not say."""
        if self.partition_id is not None:
            return f"client-{self.partition_id}"
        return f"node-{self.node_id}"

    def metrics(self) -> dict[str, Any]:
        """The JSON-safe line written to ``metrics.jsonl`` (no arrays, no sample indices)."""
        keys = (
            "server_round", "partition_id", "node_id", "status", "error", "protocol",
            "num_examples", "batch_size", "true_batch_size", "sparsity_match", "exact",
            "n_directions", "attack_seconds", "psnr_mean", "psnr", "ssim_mean", "epsilon",
            "epsilon_cumulative", "delta", "noise_std", "attack",
        )
        return jsonable({k: getattr(self, k) for k in keys})


# --------------------------------------------------------------------------- the store


class AuditStore:
    """Owner-only directory of one audit run; see the module docstring for the layout.

    Args:
        output_dir: parent directory (created ``0700`` if missing; an existing one is left as is).
        run_name: the run's directory name; default :func:`new_run_name`. The directory must not
            exist: ``FileExistsError`` otherwise (a second run never overwrites the first).
        config: the run configuration, written to ``config.json`` and shown in the report.
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
        self.run_dir = _make_private_dir(self.root / name, exist_ok=False)
        self.config: dict[str, Any] = dict(config or {})
        self.records: list[ClientAudit] = []
        self.rounds: dict[int, dict[str, Any]] = {}
        self.started = time.time()
        atomic_write_bytes(self.run_dir / "config.json", _dumps(self.config, indent=2).encode())
        atomic_write_bytes(self.run_dir / "metrics.jsonl", b"")  # exists even with no record

    # ------------------------------------------------------------------ writing

    def client_dir(self, record: ClientAudit) -> Path:
        """Create (``0700``) and return a fresh directory for ``record``.

        A second record with the same round and label (e.g. two replies claiming one partition
        id) gets a ``-2``, ``-3``, ... suffix instead of overwriting the first.
        """
        round_dir = _make_private_dir(self.run_dir / f"round-{record.server_round}",
                                      exist_ok=True)
        base = record.client_label
        for k in range(1, 1000):
            path = round_dir / (base if k == 1 else f"{base}-{k}")
            try:
                return _make_private_dir(path, exist_ok=False)
            except FileExistsError:
                continue
        raise RuntimeError(f"too many records named {base} in round {record.server_round}")

    def add(self, record: ClientAudit) -> Path:
        """Store one client's result: its directory, and a line in ``metrics.jsonl``."""
        cdir = self.client_dir(record)
        line = record.metrics()
        line["dir"] = str(cdir.relative_to(self.run_dir))
        if record.recon_images is not None:
            atomic_write_bytes(cdir / "reconstruction.png",
                               _png_bytes(image_grid(record.recon_images)))
        if record.original_images is not None:
            atomic_write_bytes(cdir / "original.png",
                               _png_bytes(image_grid(record.original_images)))
        if record.inputs is not None:
            arrays: dict[str, np.ndarray] = {"inputs": np.asarray(record.inputs)}
            if record.matching is not None:
                arrays["matching"] = np.asarray(record.matching)
            if record.sample_indices is not None:
                arrays["sample_indices"] = np.asarray(record.sample_indices, dtype=np.int64)
            buf = io.BytesIO()
            np.savez_compressed(buf, **arrays)
            atomic_write_bytes(cdir / "inputs.npz", buf.getvalue())
        atomic_write_bytes(cdir / "metrics.json", _dumps(line, indent=2).encode())
        self.records.append(record)
        self._rewrite_jsonl()
        return cdir

    def add_round(self, server_round: int, info: Mapping[str, Any]) -> None:
        """Remember round-level facts (wall time, aggregated metrics) for the summary/report."""
        self.rounds.setdefault(int(server_round), {}).update(jsonable(dict(info)))

    def _rewrite_jsonl(self) -> None:
        lines = []
        for rec in self.records:
            line = rec.metrics()
            line["dir"] = f"round-{rec.server_round}/{rec.client_label}"
            lines.append(_dumps(line))
        text = "".join(line + "\n" for line in lines)
        atomic_write_bytes(self.run_dir / "metrics.jsonl", text.encode())

    # ------------------------------------------------------------------ summary + report

    def summary(self) -> dict[str, Any]:
        """Totals over the run (JSON-safe). ``psnr_mean`` is ``None`` without ground truth;
        ``epsilon`` is the largest cumulative ε any client reported (``None`` without DP)."""
        ok = [r for r in self.records if r.status == "ok"]
        psnrs = [r.psnr_mean for r in ok if r.psnr_mean is not None]
        lams = [r.sparsity_match for r in ok if r.sparsity_match is not None]
        eps_values = [
            r.epsilon_cumulative if r.epsilon_cumulative is not None else r.epsilon
            for r in self.records
        ]
        eps_values = [e for e in eps_values if e is not None]
        deltas = [r.delta for r in self.records if r.delta is not None]
        finite_psnr = [p for p in psnrs if math.isfinite(p)]
        summary: dict[str, Any] = {
            "run_name": self.run_name,
            "run_dir": str(self.run_dir),
            "rounds": len({r.server_round for r in self.records} | set(self.rounds)),
            "clients": len({r.client_label for r in self.records}),
            "replies": len(self.records),
            "reconstructions": len(ok),
            "certified_exact": sum(1 for r in ok if r.exact),
            "attack_failures": sum(1 for r in self.records
                                   if r.status in ("attack-error", "timeout", "no-update")),
            "corrupt_replies": sum(1 for r in self.records if r.status == "corrupt"),
            "client_errors": sum(1 for r in self.records if r.status == "client-error"),
            "psnr_mean": (float(np.mean(finite_psnr)) if finite_psnr else None),
            "psnr_min": (float(np.min(finite_psnr)) if finite_psnr else None),
            "lambda_mean": (float(np.mean(lams)) if lams else None),
            "attack_seconds_total": float(sum(r.attack_seconds or 0.0 for r in self.records)),
            "epsilon": (max(eps_values) if eps_values else None),
            "delta": (max(deltas) if deltas else None),
            "protocol": self.config.get("protocol"),
            "dataset": self.config.get("dataset"),
            "wall_seconds": time.time() - self.started,
            "per_round": {str(k): v for k, v in sorted(self.rounds.items())},
            "report": str(self.run_dir / "report.html"),
        }
        return jsonable(summary)

    def finalize(self, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Write ``summary.json`` and ``report.html``; return the summary."""
        summary = self.summary()
        if extra:
            summary.update(jsonable(dict(extra)))
        atomic_write_bytes(self.run_dir / "summary.json", _dumps(summary, indent=2).encode())
        atomic_write_bytes(self.run_dir / "report.html", self._report_html(summary).encode())
        return summary

    def _plot_png(self) -> bytes | None:
        """Per-round mean PSNR / λ / attack seconds (matplotlib Figure, no pyplot state)."""
        ok = [r for r in self.records if r.status == "ok"]
        if not ok:
            return None
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        rounds = sorted({r.server_round for r in ok})

        def per_round(attr: str) -> list[float]:
            out = []
            for rd in rounds:
                vals = [getattr(r, attr) for r in ok if r.server_round == rd
                        and getattr(r, attr) is not None and math.isfinite(getattr(r, attr))]
                out.append(float(np.mean(vals)) if vals else float("nan"))
            return out

        has_psnr = any(r.psnr_mean is not None for r in ok)
        panels = [("sparsity_match", "mean λ (1 = certified)"),
                  ("attack_seconds", "attack seconds per client")]
        if has_psnr:
            panels.insert(0, ("psnr_mean", "mean PSNR [dB]"))
        fig = Figure(figsize=(4.0 * len(panels), 3.0), dpi=100)
        FigureCanvasAgg(fig)
        for i, (attr, title) in enumerate(panels):
            ax = fig.add_subplot(1, len(panels), i + 1)
            for r in ok:  # every client as a dot, the round mean as a line
                v = getattr(r, attr)
                if v is not None and math.isfinite(v):
                    ax.plot(r.server_round, v, "o", color="tab:blue", alpha=0.4, ms=4)
            ax.plot(rounds, per_round(attr), "-", color="tab:red", lw=2)
            ax.set_title(title, fontsize=10)
            ax.set_xlabel("round")
            ax.set_xticks(rounds)
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format="png")
        return buf.getvalue()

    def _report_html(self, summary: Mapping[str, Any]) -> str:
        """A single self-contained HTML page (images inline as base64 data URIs)."""
        esc = html.escape

        def fmt(v: Any, digits: int = 2) -> str:
            if v is None:
                return "–"
            if isinstance(v, bool):
                return "yes" if v else "no"
            if isinstance(v, float):
                return f"{v:.{digits}f}" if math.isfinite(v) else ("∞" if v > 0 else "−∞")
            return esc(str(v))

        def img(png: bytes, alt: str) -> str:
            data = base64.b64encode(png).decode()
            return f'<img alt="{esc(alt)}" src="data:image/png;base64,{data}">'

        dp = any(r.epsilon is not None for r in self.records)
        gt = any(r.psnr_mean is not None for r in self.records)
        head = [
            ("run", summary.get("run_name")), ("protocol", summary.get("protocol")),
            ("dataset", summary.get("dataset")), ("rounds", summary.get("rounds")),
            ("clients", summary.get("clients")),
            ("reconstructions", summary.get("reconstructions")),
            ("certified exact (λ = 1)", summary.get("certified_exact")),
            ("mean λ", summary.get("lambda_mean")),
            ("mean PSNR [dB]", summary.get("psnr_mean") if gt else "no ground truth (audit off)"),
            ("attack failures", summary.get("attack_failures")),
            ("corrupt replies", summary.get("corrupt_replies")),
            ("client errors", summary.get("client_errors")),
            ("attack seconds (total)", summary.get("attack_seconds_total")),
        ]
        if dp:
            head.append(("DP ε (largest, cumulative)", summary.get("epsilon")))
            head.append(("DP δ", summary.get("delta")))
        parts = [
            "<!DOCTYPE html><html><head><meta charset='utf-8'>",
            f"<title>fl-attack audit {esc(str(summary.get('run_name')))}</title>",
            "<style>body{font-family:sans-serif;margin:2em;max-width:1200px}"
            "table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;"
            "padding:3px 8px;text-align:right}th{background:#eee}td.l,th.l{text-align:left}"
            "img{image-rendering:pixelated;max-width:100%}.pair{display:flex;gap:1.5em;"
            "align-items:flex-start}.pair div{text-align:center}.err{color:#b00}"
            ".warn{background:#fff3cd;padding:.6em;border:1px solid #e0c060}</style>",
            "</head><body>",
            f"<h1>Privacy audit: {esc(str(summary.get('run_name')))}</h1>",
            "<p class='warn'>This report contains reconstructions of clients' private training "
            "data. Keep it private (it is written with owner-only permissions).</p>",
            "<h2>Summary</h2><table>",
        ]
        parts += [f"<tr><th class='l'>{esc(k)}</th><td>{fmt(v)}</td></tr>" for k, v in head]
        parts.append("</table>")
        parts.append("<h2>Per round</h2>")
        round_cols = [("audit-replies", "replies", 0),
                      ("audit-reconstructions", "reconstructed", 0),
                      ("audit-certified-exact", "certified exact", 0),
                      ("audit-lambda-mean", "mean λ", 4), ("audit-psnr-mean", "mean PSNR [dB]", 1),
                      ("audit-attack-seconds", "attack s", 1), ("audit-seconds", "audit s", 1),
                      ("train-round-seconds", "round s", 1)]
        if self.rounds:
            parts.append("<table><tr><th>round</th>" + "".join(
                f"<th>{esc(title)}</th>" for _, title, _ in round_cols) + "</tr>")
            for rnd, info in sorted(self.rounds.items()):
                cells = [fmt(info.get(key), digits) if digits else fmt(info.get(key))
                         for key, _, digits in round_cols]
                parts.append(f"<tr><td>{rnd}</td>"
                             + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
            parts.append("</table>")
        plot = self._plot_png()
        if plot is not None:
            parts.append(img(plot, "per-round metrics"))
        cols = ["round", "client", "status", "B", "λ", "certified", "PSNR [dB]",
                "attack s", "examples"]
        if dp:
            cols += ["ε (round)", "ε (cumul.)", "noise std"]
        cols.append("error")
        parts.append("<h2>Clients</h2><table><tr>"
                     + "".join(f"<th>{esc(c)}</th>" for c in cols) + "</tr>")
        for r in sorted(self.records, key=lambda r: (r.server_round, r.client_label)):
            cells = [fmt(r.server_round), esc(r.client_label), esc(r.status), fmt(r.batch_size),
                     fmt(r.sparsity_match, 4), fmt(r.exact), fmt(r.psnr_mean, 1),
                     fmt(r.attack_seconds, 1), fmt(r.num_examples)]
            if dp:
                cells += [fmt(r.epsilon), fmt(r.epsilon_cumulative), fmt(r.noise_std, 6)]
            cells.append(f"<span class='err'>{esc(r.error or '')}</span>")
            parts.append("<tr>" + "".join(
                f"<td class='l'>{c}</td>" if i in (1, 2, len(cells) - 1) else f"<td>{c}</td>"
                for i, c in enumerate(cells)) + "</tr>")
        parts.append("</table>")
        parts.append("<h2>Reconstructions</h2>")
        if gt:
            parts.append("<p>Left: what the server reconstructed from the client's update "
                         "alone. Right: the client's true batch (audit ground truth), in the "
                         "same order (optimal matching).</p>")
        for r in sorted(self.records, key=lambda r: (r.server_round, r.client_label)):
            if r.recon_images is None:
                continue
            title = f"Round {r.server_round}, {r.client_label}"
            stats = [f"B = {r.batch_size}", f"λ = {fmt(r.sparsity_match, 4)}",
                     "certified exact" if r.exact else "not certified"]
            if r.psnr_mean is not None:
                stats.append(f"PSNR = {fmt(r.psnr_mean, 1)} dB")
            if r.epsilon is not None:
                stats.append(f"ε = {fmt(r.epsilon_cumulative or r.epsilon)}")
            parts.append(f"<h3>{esc(title)}</h3><p>{esc(', '.join(stats))}</p><div class='pair'>")
            parts.append("<div>" + img(_png_bytes(image_grid(r.recon_images)), "reconstruction")
                         + "<br>reconstruction</div>")
            if r.original_images is not None:
                parts.append("<div>" + img(_png_bytes(image_grid(r.original_images)), "original")
                             + "<br>original</div>")
            parts.append("</div>")
        parts.append("<h2>Configuration</h2><table>")
        parts += [f"<tr><th class='l'>{esc(str(k))}</th><td class='l'>{fmt(v)}</td></tr>"
                  for k, v in sorted(self.config.items())]
        parts.append("</table></body></html>")
        return "\n".join(parts)


def records_from_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Read back a ``metrics.jsonl`` (for tests and notebooks)."""
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]

