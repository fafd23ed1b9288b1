"""Each round's audit numbers as TensorBoard scalars, beside a user's training curves.

``AuditStore(..., tensorboard=True)`` (run config ``tensorboard = true``) writes, when a
round's audit is done, the scalars of :func:`round_scalars` under ``<run dir>/tensorboard/``,
one step per round: point TensorBoard at the run directory, or at a parent that also holds
the training logs. The events are written by ``torch.utils.tensorboard.SummaryWriter``, which
needs the ``tensorboard`` package: an optional extra (``pip install 'fl-attack[tensorboard]'``),
checked when the store is built (:func:`require_tensorboard`), so a run that asks for events
without it fails before its first round.

The events hold numbers only (counts, λ, ε, seconds), never a reconstruction; their folder and
files are owner-only like the rest of the run directory.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fl_attack_flwr.output import progress
from fl_attack_flwr.output.private_files import DIR_MODE, FILE_MODE, make_private_dir
from fl_attack_flwr.output.summary import READABLE_DB
from fl_attack_flwr.results.records import ClientAudit

INSTALL = "pip install 'fl-attack[tensorboard]'"
FOLDER = "tensorboard"
"""The events' folder in the run directory."""
ROUND_KEY = "audit-replies"
"""The key of a round's audit numbers (``results.records.round_metrics``) in the facts the
strategy stores per round: the scalars are written when it arrives."""


def require_tensorboard() -> None:
    """``ImportError`` saying which extra to install when the ``tensorboard`` package (which
    ``torch.utils.tensorboard`` writes its events with) is missing."""
    try:
        import tensorboard  # noqa: F401
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError as exc:
        raise ImportError(f"TensorBoard scalars need the tensorboard package ({exc}): "
                          f"{INSTALL}") from None


def round_scalars(records: Sequence[ClientAudit], server_round: int,
                  info: Mapping[str, Any]) -> dict[str, float]:
    """The scalars of one round (tag -> value), from the round's records and its audit
    numbers ``info``: updates attacked and read, certified, samples read (certified from the
    model's own inputs, or recognisable against the ground truth: ``output.progress``), mean λ
    and PSNR where known, the largest ε the clients reported (finite only), attack seconds."""
    mine = [r for r in records if r.server_round == server_round]
    (row,) = progress.by_round(mine, {server_round: {}}, readable_db=READABLE_DB)
    read = sum(1 for r in mine if progress.samples_read(r, READABLE_DB) > 0)
    scalars = {"audit/updates_attacked": row["attacked"], "audit/clients_read": read,
               "audit/certified": row["certified"], "audit/samples": row["samples"],
               "audit/samples_readable": row["read"], "audit/no_answer": row["no_answer"],
               "audit/attack_seconds": info.get("audit-attack-seconds")}
    for tag, key in (("audit/lambda_mean", "audit-lambda-mean"),
                     ("audit/psnr_mean", "audit-psnr-mean")):
        scalars[tag] = info.get(key)
    eps = [r.epsilon_cumulative if r.epsilon_cumulative is not None else r.epsilon
           for r in mine]
    finite = [float(e) for e in eps if e is not None and math.isfinite(float(e))]
    scalars["audit/epsilon"] = max(finite) if finite else None
    return {tag: float(v) for tag, v in scalars.items()
            if isinstance(v, (int, float)) and math.isfinite(float(v))}


class RoundScalars:
    """The run's TensorBoard event writer (``<run_dir>/tensorboard``, owner-only)."""

    def __init__(self, run_dir: Path) -> None:
        require_tensorboard()
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = make_private_dir(Path(run_dir) / FOLDER, exist_ok=True)
        self._open = lambda: SummaryWriter(log_dir=str(self.log_dir))
        self._writer: Any = self._open()
        self._private()

    def write(self, server_round: int, scalars: Mapping[str, float]) -> None:
        """Add one round's scalars at step ``server_round`` and flush them to disk (after
        :meth:`close`, into a new event file of the same folder)."""
        if self._writer is None:
            self._writer = self._open()
        for tag, value in scalars.items():
            self._writer.add_scalar(tag, value, global_step=int(server_round))
        self._writer.flush()
        self._private()

    def close(self) -> None:
        """Flush and close the event file."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
            self._private()

    def _private(self) -> None:
        """Owner-only modes for what the writer created with the process's umask."""
        for path in self.log_dir.rglob("*"):
            os.chmod(path, DIR_MODE if path.is_dir() else FILE_MODE)
