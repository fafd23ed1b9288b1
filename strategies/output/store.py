"""The audit run's directory: one writer for every file of a run.

Reconstructions are the clients' private data: every directory is ``0700``, every file ``0600``
and written atomically (:mod:`fl_attack_flwr.output.private_files`); ``metrics.jsonl`` is
appended one whole line per record. A run directory is created with ``exist_ok=False``
semantics, so a second run can never overwrite the first. The report is rendered by
:mod:`fl_attack_flwr.output.report`.

Layout of ``<output-dir>/<run-name>/``::

    config.json                      the run configuration
    metrics.jsonl                    one JSON line per (round, client), appended as results land
    round-<r>/<client label>/
        reconstruction.png           grid of the reconstructed images (denormalised)
        original.png                 grid of the client's true images (audit mode only)
        inputs.npz                   raw reconstructed layer inputs (+ matching, indices)
        pixels.npz                   pictures estimated from features, one per row of inputs:
                                     ``images`` in [0, 1], ``model_inputs`` in the model's
                                     input space (the record's ``pixels["arrays"]`` says how)
        text.jsonl                   a language model's update: one JSON line per sentence
                                     read (``text``, ``token_ids``; in audit mode the
                                     ``original`` matched to it and ``exact``), then one per
                                     client sentence no sentence read matched (``missed``)
        metrics.json                 the client's line of metrics.jsonl
    rounds.jsonl                     a JSON line per round as its facts land (timings, audit
                                     and evaluation metrics); a round's last line holds all
    summary.json                     totals and the verdict
    report.html                      verdict, images beside originals, tables, plots (inline)
    tensorboard/                     with ``tensorboard=True``: each round's audit numbers as
                                     TensorBoard scalars (:mod:`fl_attack_flwr.output.tensorboard`)

Nothing in this module imports Flower: the strategy hands it plain
:class:`~fl_attack_flwr.results.records.ClientAudit` records.
"""

from __future__ import annotations

import dataclasses
import io
import os
import re
import secrets
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from fl_attack_flwr.output.png import image_grid, png_bytes
from fl_attack_flwr.output.private_files import (
    DIR_MODE,
    append_line,
    atomic_write_bytes,
    dumps,
    jsonable,
    make_private_dir,
)
from fl_attack_flwr.output.report import render_report
from fl_attack_flwr.output.summary import summarize
from fl_attack_flwr.output.tensorboard import (
    ROUND_KEY,
    RoundScalars,
    require_tensorboard,
    round_scalars,
)
from fl_attack_flwr.results.records import ClientAudit

_RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def is_run_name(name: str) -> bool:
    """Whether ``name`` may name a run's directory: letters, digits, ``.``, ``_``, ``-``, up
    to 128 characters, starting with a letter or digit."""
    return bool(_RUN_NAME.match(name))


def _without_arrays(record: ClientAudit) -> ClientAudit:
    """``record`` without its reconstruction, pictures and raw inputs."""
    return dataclasses.replace(record, inputs=None, recon_images=None, original_images=None,
                               matching=None, pixel_images=None, pixel_inputs=None,
                               sentences=None, missed_sentences=None)


def _npz(arrays: Mapping[str, np.ndarray]) -> bytes:
    """``arrays`` as the bytes of a compressed ``.npz`` file."""
    buf = io.BytesIO()
    np.savez_compressed(buf, **arrays)
    return buf.getvalue()


def new_run_name() -> str:
    """A unique, sortable run name: UTC timestamp plus a random short id."""
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + secrets.token_hex(3)


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
    reconstructions : bool
        ``False``: metrics only. Verdicts, λ, statuses and scores are written, but no
        reconstruction, original or raw input (no PNG, no ``inputs.npz`` or ``pixels.npz``, no
        pictures in the report): for deployments and CI pipelines that must not hold the
        clients' data.
    retain_rounds : int, optional
        Keep the reconstruction files of the last ``retain_rounds`` audited rounds only: when a
        later round is stored, the pictures and raw inputs of older rounds are deleted (their
        metrics stay), and the report shows only the rounds kept. ``None``: keep every round.
        Deleting unlinks the files; it does not scrub the disk blocks they occupied.
    tensorboard : bool
        Also write each round's audit numbers (updates read, certified, samples readable, λ,
        ε where known, attack seconds) as TensorBoard scalars under ``tensorboard/``, one step
        per round, when the round's audit is done. Needs the ``tensorboard`` package (the extra
        ``fl-attack[tensorboard]``): without it ``ImportError`` names the extra, before the
        run directory is created.
    """

    def __init__(self, output_dir: str | os.PathLike[str] = "runs", run_name: str | None = None,
                 *, config: Mapping[str, Any] | None = None, reconstructions: bool = True,
                 retain_rounds: int | None = None, tensorboard: bool = False) -> None:
        if tensorboard:
            require_tensorboard()
        if retain_rounds is not None and not (isinstance(retain_rounds, int)
                                              and retain_rounds >= 1):
            raise ValueError(f"retain_rounds must be a positive int or None, got "
                             f"{retain_rounds!r}")
        self.reconstructions, self.retain_rounds = bool(reconstructions), retain_rounds
        name = run_name or new_run_name()
        if not is_run_name(name):
            raise ValueError(f"invalid run name {name!r} (letters, digits, '.', '_', '-')")
        self.root = Path(output_dir).expanduser().absolute()
        if not self.root.exists():
            self.root.mkdir(parents=True, mode=DIR_MODE, exist_ok=True)
            os.chmod(self.root, DIR_MODE)
        self.run_name = name
        self.run_dir = make_private_dir(self.root / name, exist_ok=False)
        self.config: dict[str, Any] = dict(config or {})
        self.records: list[ClientAudit] = []
        self._files: list[list[Path]] = []
        """The reconstruction files written for each record (same order as ``records``)."""
        self.rounds: dict[int, dict[str, Any]] = {}
        self.notes: list[str] = []
        """Plain-words warnings for the report (e.g. from the strategy about its setup)."""
        self.started = time.time()
        atomic_write_bytes(self.run_dir / "config.json", dumps(self.config, indent=2).encode())
        for name in ("metrics.jsonl", "rounds.jsonl"):  # exist even with no line
            atomic_write_bytes(self.run_dir / name, b"")
        self.scalars = RoundScalars(self.run_dir) if tensorboard else None
        """The TensorBoard writer (``None`` without ``tensorboard``)."""

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
        was taken), ``stored_at`` the seconds since the run started, ``files`` the
        reconstruction files written there (none in metrics-only mode).
        """
        cdir = self.client_dir(record)
        files = self._write_arrays(cdir, record) if self.reconstructions else []
        line = {**record.metrics(), "dir": str(cdir.relative_to(self.run_dir)),
                "stored_at": time.time() - self.started,
                "files": sorted(f.name for f in files)}
        atomic_write_bytes(cdir / "metrics.json", dumps(line, indent=2).encode())
        self.records.append(record if files else _without_arrays(record))
        self._files.append(files)
        append_line(self.run_dir / "metrics.jsonl", dumps(line))
        if self.retain_rounds is not None:
            self._forget_before(record.server_round - self.retain_rounds + 1)
        return cdir

    def _write_arrays(self, cdir: Path, record: ClientAudit) -> list[Path]:
        """The record's pictures and raw inputs, as files in ``cdir``."""
        files = []
        if record.recon_images is not None:
            files.append(atomic_write_bytes(cdir / "reconstruction.png",
                                            png_bytes(image_grid(record.recon_images))))
        if record.original_images is not None:
            files.append(atomic_write_bytes(cdir / "original.png",
                                            png_bytes(image_grid(record.original_images))))
        if record.inputs is not None:
            arrays: dict[str, np.ndarray] = {"inputs": np.asarray(record.inputs)}
            if record.matching is not None:
                arrays["matching"] = np.asarray(record.matching)
            if record.sample_indices is not None:
                arrays["sample_indices"] = np.asarray(record.sample_indices, dtype=np.int64)
            files.append(atomic_write_bytes(cdir / "inputs.npz", _npz(arrays)))
        if record.pixel_images is not None:
            pixels = {"images": np.asarray(record.pixel_images, dtype=np.float32)}
            if record.pixel_inputs is not None:
                pixels["model_inputs"] = np.asarray(record.pixel_inputs, dtype=np.float32)
            files.append(atomic_write_bytes(cdir / "pixels.npz", _npz(pixels)))
        if record.sentences is not None:
            lines = [dumps({k: v for k, v in s.items() if k not in ("pieces", "original_pieces")})
                     for s in record.sentences]
            lines += [dumps({"missed": True, "original": s})
                      for s in record.missed_sentences or []]
            files.append(atomic_write_bytes(cdir / "text.jsonl",
                                            "".join(f"{line}\n" for line in lines).encode()))
        return files

    def _forget_before(self, first_kept: int) -> None:
        """Delete the reconstruction files of rounds before ``first_kept`` (retention)."""
        for i, record in enumerate(self.records):
            if record.server_round < first_kept and self._files[i]:
                for path in self._files[i]:
                    path.unlink(missing_ok=True)
                self.records[i], self._files[i] = _without_arrays(record), []

    @property
    def kept(self) -> str:
        """Which reconstructions this run keeps, in words (for the summary and the report)."""
        if not self.reconstructions:
            return "none (metrics only)"
        if self.retain_rounds is not None:
            return f"the last {self.retain_rounds} audited round(s)"
        return "all"

    def add_round(self, server_round: int, info: Mapping[str, Any]) -> None:
        """Record round-level facts (wall time, aggregated metrics) and append the round's
        facts so far as one line."""
        entry = self.rounds.setdefault(int(server_round), {})
        entry.update(jsonable(dict(info)))
        append_line(self.run_dir / "rounds.jsonl", dumps({"round": int(server_round), **entry}))
        if self.scalars is not None and ROUND_KEY in info:
            self.scalars.write(server_round, round_scalars(self.records, server_round, info))

    def finalize(self, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Write ``summary.json`` and ``report.html``; return the summary."""
        summary = summarize(self.records, self.rounds, self.config, run_name=self.run_name,
                            run_dir=self.run_dir, wall_seconds=time.time() - self.started)
        summary["notes"] = [*self.notes, *summary.get("notes", [])]
        summary["reconstructions_kept"] = self.kept
        if extra:
            summary.update(jsonable(dict(extra)))
        atomic_write_bytes(self.run_dir / "summary.json", dumps(summary, indent=2).encode())
        page = render_report(summary, self.records, self.rounds, self.config)
        atomic_write_bytes(self.run_dir / "report.html", page.encode())
        if self.scalars is not None:
            self.scalars.close()
        return summary
