"""What one attack job gave back: :class:`AttackOutcome`, the one type every executor returns.

An outcome crosses process boundaries (pool workers, Ray actors), so it holds plain data only
(numbers, strings, a NumPy array, the library's JSON-safe reconstruction facts) and this module
imports neither torch nor Flower. ``status`` is one of ``verdicts.STATUSES``: a reconstruction
(``certified``, ``not-certified``, ``partial``), ``protected``, or why the audit gave no answer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fl_attack_flwr import verdicts


@dataclass(frozen=True)
class AttackOutcome:
    """The result of one attack job.

    Attributes
    ----------
    status
        One of ``verdicts.STATUSES``.
    reason
        Plain words for statuses that need them (why not certified, why protected, why skipped).
    error
        What went wrong, for the error statuses (``verdicts.ERRORS``, ``corrupt``, ...).
    reading
        How the update was read (``"gradient"`` or ``"fedavg"``), when an attack ran.
    seconds
        Wall time of the attack job (``None`` when no attack ran).
    inputs
        ``(B, n)`` reconstructed layer inputs (float64), for reconstructions only.
    reconstruction
        ``fl_attack.Reconstruction.as_dict()`` of the reconstruction (JSON-safe), or ``None``.
    ran_on
        Where the attack ran: ``"server"`` (inline), ``"pid:<pid>@<host>"`` (a worker
        process) or ``"ray-node:<node id>"`` (a Ray actor).
    pixels
        When the reconstructed inputs are features and the model is known: the pictures
        estimated from them (a ``jobs.pixels.PixelOutcome``).
    protected_by
        For ``protected``: why the layer cannot separate the batch, as
        ``fl_attack.errors.NotIdentifiable.reason`` says it (``"full-rank"``: the update mixes
        more samples than the layer separates; ``"no-signal"``: noise hides every sample).
    text
        For a language model's update (``jobs.text``): the sentences read, as ``token_ids``
        (one list per sentence), ``sentences`` (decoded with the model's tokenizer, or None)
        and ``evidence`` (per sentence, how it was read). The clients' private data: records
        keep it out of ``metrics.jsonl``.
    """

    status: str
    reason: str | None = None
    error: str | None = None
    reading: str | None = None
    seconds: float | None = None
    inputs: np.ndarray | None = field(default=None, repr=False, compare=False)
    reconstruction: Mapping[str, Any] | None = field(default=None, repr=False)
    ran_on: str | None = None
    pixels: Any = field(default=None, repr=False, compare=False)
    protected_by: str | None = None
    text: Mapping[str, Any] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.status not in verdicts.STATUSES:
            raise ValueError(f"unknown status {self.status!r}; expected one of "
                             f"{verdicts.STATUSES}")

    @property
    def reconstructed(self) -> bool:
        """Whether the outcome holds a reconstruction."""
        return self.status in verdicts.RECONSTRUCTED

    def reconstruction_field(self, key: str) -> Any:
        """One field of :attr:`reconstruction` (``None`` without a reconstruction)."""
        return None if self.reconstruction is None else self.reconstruction.get(key)

    def took(self, seconds: float) -> AttackOutcome:
        """The same outcome with ``seconds`` as its wall time."""
        return dataclasses.replace(self, seconds=float(seconds))


def error_outcome(status: str, error: str, seconds: float = 0.0) -> AttackOutcome:
    """An outcome without a reconstruction (``status`` one of ``verdicts.ERRORS``)."""
    return AttackOutcome(status, error=error, seconds=float(seconds))
