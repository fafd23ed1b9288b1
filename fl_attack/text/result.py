"""What :func:`fl_attack.text.invert_text` returns."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class SequenceEvidence:
    """How one recovered sentence was read.

    Attributes
    ----------
    token_ids : list[int]
        The sentence (with its last token where read).
    span_distances : list[tuple[float, float]]
        Per position of the prefix, the relative distance of its vector to block 0's MLP-input
        span and to block 1's attention-input span (NaN where that check did not run; position
        0 of a sentence is checked like any other).
    last_token : int | None
        The last token, read from the output layer; None where the update does not carry it.
    last_coefficient : float | None
        Its coefficient in the output layer's gradient (1.0 for one sentence, exactly read).
    count : int
        How many sentences of the batch are this one. Only the ratios of the counts are read:
        the update's scale is unknown, so a batch repeated k times gives the same update;
        counts are the smallest integers in those ratios (scaled to ``batch_size`` when given).
    """

    token_ids: list[int]
    span_distances: list[tuple[float, float]]
    last_token: int | None
    last_coefficient: float | None
    count: int = 1


@dataclass
class TextReconstruction:
    """The sentences read off a transformer's update.

    Attributes
    ----------
    token_ids : list[list[int]]
        One list per recovered sentence (repeats listed as often as counted), in the model's
        tokenizer; decode with it. Order is not the batch's.
    sequences : list[SequenceEvidence]
        The distinct sentences with their evidence.
    certified : bool
        Proven without ground truth (the conditions in ``docs/algorithm.md``, "The text
        certificate"): every token of every sentence, the last included, is the client's.
    stopped : str
        ``"complete"``, ``"budget"``, ``"ambiguous"`` (the span checks did not separate),
        ``"not-identifiable"`` (as many positions as the width, or no signal),
        ``"not-applicable"`` (a LoRA adapter whose rank the batch's positions reach).
    reason : str
        The verdict in words: what was read and, where not certified, why.
    limit : str | None
        Where ``stopped`` is ``"not-identifiable"`` or ``"not-applicable"``: why, as
        ``fl_attack.errors.NotIdentifiable.reason`` says it (``"full-rank"``, ``"no-signal"``,
        ``"adapter-rank"``); ``"positions"`` with any ``stopped``: an encoder's tokens read,
        and the search over whole sentences (its first block did not separate the positions)
        did not place them all.
    labels : list[int] | None
        A sequence classifier's update: each sentence's class, read from the head's update
        (same order as ``token_ids``); None where not read or not a classifier.
    bag : list[int]
        Every token the first block's span holds (sorted ids): the batch's tokens, whatever
        their order, read even where no sentence is (an encoder whose positions the first
        block does not separate).
    not_carried : list[str]
        What the update does not hold, named, never guessed (e.g. the last tokens when the
        output layer's gradient is absent).
    family : str
        The adapter that read the model (``"rotary"``, ``"learned"``, ``"encoder"``).
    ranks : dict[str, int]
        Numerical rank of each span read (``attn0``, ``mlp``: block 0's MLP input, ``attn1``).
    margins : dict[str, float]
        The largest kept and smallest rejected score (distance over tilt,
        ``span.Span.score``) of the token filter (``tokens_*``) and of the first prefix check
        (``prefixes_*``), and the largest kept score at block 1's confirming check
        (``prefixes_confirm_max``).
    residuals : dict[str, float]
        Per parameter, the recomputed update's relative residual (empty when not computed).
    timings : dict[str, float]
        Seconds per step (``spans``, ``tokens``, ``sequences``, ``last_token``, ``certify``).
    seconds : float
        Wall time of the call.
    """

    token_ids: list[list[int]]
    sequences: list[SequenceEvidence]
    certified: bool
    stopped: str
    reason: str
    limit: str | None = None
    labels: list[int] | None = None
    bag: list[int] = field(default_factory=list)
    not_carried: list[str] = field(default_factory=list)
    family: str = ""
    ranks: dict[str, int] = field(default_factory=dict)
    margins: dict[str, float] = field(default_factory=dict)
    residuals: dict[str, float] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def batch_size(self) -> int:
        """Sentences recovered, repeats counted."""
        return len(self.token_ids)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready fields (for records and reports)."""
        out = asdict(self)
        out["batch_size"] = self.batch_size
        return out
