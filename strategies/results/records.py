"""What the audit keeps per client and round: :class:`ClientAudit`, built in one place; and
what the round's records add up to (its MetricRecord numbers, its log lines).

Three facts make a record, each from the step that knows it:

* :class:`~fl_attack_flwr.intake.facts.ReplyFacts`: what the server read off the reply before
  any attack (who, which layer, how many examples, the DP accounting the client reported, the
  audit-mode sample ids);
* :class:`~fl_attack_flwr.jobs.outcome.AttackOutcome`: what the attack (or the intake, for
  replies it does not attack) concluded;
* :class:`~fl_attack_flwr.results.pictures.Pictures`: the reconstruction shown as images and,
  with ground truth, scored.

:func:`record_of` (what the strategy calls for each finished attack) makes the pictures and
:func:`build_record` combines the three into the immutable :class:`ClientAudit` that the store
writes, the report shows and the round's metrics count.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fl_attack_flwr import verdicts
from fl_attack_flwr.intake.facts import ReplyFacts, client_label
from fl_attack_flwr.jobs.outcome import AttackOutcome
from fl_attack_flwr.results.pictures import GroundTruth, InputView, Pictures, pictures_of
from fl_attack_flwr.results.text import Sentences, TextTruth, sentences_of

log = logging.getLogger("flwr")


@dataclass(frozen=True)
class ClientAudit:
    """What the server learned about one client's update in one round.

    ``status`` is one of ``verdicts.STATUSES``, with ``reason`` in plain words where the status
    needs one. Array fields never go to ``metrics.jsonl`` (only to the client directory):
    ``inputs`` are the reconstructed layer inputs ``(B, n)``; ``recon_images`` /
    ``original_images`` are ``(B, C, H, W)`` in ``[0, 1]``, the reconstructions put in the
    originals' order when the ground truth is known. Build records with :func:`build_record`.
    """

    server_round: int
    node_id: int
    partition_id: int | None = None
    label: str | None = None
    status: str = verdicts.PENDING
    reason: str | None = None
    error: str | None = None
    protected_by: str | None = None
    """For ``protected``: ``"full-rank"`` (the update mixes more samples than the layer
    separates) or ``"no-signal"`` (noise hides every sample), as
    ``fl_attack.errors.NotIdentifiable.reason`` says it."""
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
    ran_on: str | None = None
    psnr: list[float] | None = None
    psnr_mean: float | None = None
    ssim: list[float] | None = None
    ssim_mean: float | None = None
    reads: str | None = None
    pixels: dict[str, Any] | None = None
    """For features (``reads == "features"``): the pixel step's facts (feature residual of the
    pictures, seconds, terms used, budget, error, how the batch statistics of normalisations
    were set, what ``pixels.npz`` holds); ``psnr`` / ``ssim`` then score the pictures."""
    passed_over: list[dict[str, str]] | None = None
    """Linear layers before the attacked one that the attack does not cover, with reasons."""
    epsilon: float | None = None
    epsilon_cumulative: float | None = None
    delta: float | None = None
    noise_std: float | None = None
    guard: dict[str, Any] | None = None
    attack: dict[str, Any] | None = None
    sample_indices: list[int] | None = None
    inputs: np.ndarray | None = field(default=None, repr=False)
    recon_images: np.ndarray | None = field(default=None, repr=False)
    original_images: np.ndarray | None = field(default=None, repr=False)
    matching: np.ndarray | None = field(default=None, repr=False)
    pixel_images: np.ndarray | None = field(default=None, repr=False)
    """Pictures estimated from features, ``(B, C, H, W)`` in ``[0, 1]``, row i from row i of
    ``inputs`` (``pixels["arrays"]`` says how they were scaled)."""
    pixel_inputs: np.ndarray | None = field(default=None, repr=False)
    """The same pictures in the model's input space (what its forward pass takes)."""
    text: dict[str, Any] | None = None
    """For a language model's update (``reads == "text"``): ``sentences_read`` and, with the
    truth, ``rouge1``, ``rouge2``, ``exact``, ``sentences_exact``, ``sentences_true``,
    ``batch_exact`` (no sentence: those are in :attr:`sentences`)."""
    sentences: list[dict[str, Any]] | None = field(default=None, repr=False)
    """The sentences read (``results.text.Sentences.read``): the client's private data, kept
    out of ``metrics.jsonl``."""
    missed_sentences: list[str] | None = field(default=None, repr=False)
    """With the truth: the client's sentences no sentence read was matched to."""

    def __post_init__(self) -> None:
        if self.status not in verdicts.STATUSES:
            raise ValueError(f"unknown status {self.status!r}; expected one of "
                             f"{verdicts.STATUSES}")

    @property
    def client_label(self) -> str:
        """The label records and logs name this client by (see :func:`client_label`)."""
        return client_label(self.partition_id, self.label, self.node_id)

    @property
    def reconstructed(self) -> bool:
        """Whether the record holds a reconstruction (certified, not certified or partial)."""
        return self.status in verdicts.RECONSTRUCTED

    def verified_pictures(self) -> np.ndarray | None:
        """``(len(recon_images),)`` flags: the pictures of samples verified on their own
        through the next layer (``Reconstruction.verified``), in the pictures' order (the
        originals' when the ground truth matched them); ``None`` when there are no such
        pictures, or when they are estimated from features (the features are verified, the
        pictures are not)."""
        rows = [int(v) for v in (self.attack or {}).get("verified") or []]
        return self._pictures_of(rows)

    def unproven_pictures(self) -> np.ndarray | None:
        """``(len(recon_images),)`` flags: the pictures of the samples the reason names as
        keeping the batch unproven (``Reconstruction.unproven``, per-sample reasons only),
        in the pictures' order; ``None`` when there are none or the pictures are estimated
        from features."""
        rows = [int(row) for row, why in (self.attack or {}).get("unproven") or []
                if why in verdicts.PER_SAMPLE_UNPROVEN]
        return self._pictures_of(rows)

    def _pictures_of(self, rows: list[int]) -> np.ndarray | None:
        """Flags over the pictures (in their shown order) of the reconstruction's ``rows``."""
        if self.recon_images is None or self.reads == "features" or not rows:
            return None
        shown = (np.arange(self.recon_images.shape[0]) if self.matching is None
                 else np.asarray(self.matching))
        return np.isin(shown, rows)

    def metrics(self) -> dict[str, Any]:
        """The line of ``metrics.jsonl`` (no arrays, no sample indices; the store writes it
        as strict JSON)."""
        keys = (
            "server_round", "partition_id", "node_id", "status", "reason", "error",
            "protected_by", "protocol",
            "reading", "layer", "layer_shape", "inputs_are", "num_examples", "batch_size",
            "true_batch_size", "sparsity_match", "exact", "n_directions", "attack_seconds",
            "ran_on", "reads", "psnr_mean", "psnr", "ssim_mean", "ssim", "pixels", "epsilon",
            "epsilon_cumulative", "delta", "noise_std", "guard", "attack", "passed_over", "text",
        )
        line = {k: getattr(self, k) for k in keys}
        line["client"] = self.client_label
        return line


def _pixel_facts(outcome: AttackOutcome, pics: Pictures) -> dict[str, Any] | None:
    """The pixel step's facts for the record (no arrays), with what ``pixels.npz`` holds."""
    px = outcome.pixels
    if px is None:
        return None
    residual = px.feature_residual
    facts = {"feature_residual": residual,
             "feature_residual_mean": None if not residual else float(np.mean(residual)),
             "seconds": px.seconds, "terms": list(px.terms),
             "budget_exhausted": px.budget_exhausted, "error": px.error,
             "batch_statistics": px.batch_statistics}
    if pics.estimated is not None:
        facts["arrays"] = {
            "file": "pixels.npz",
            "images": f"(B, C, H, W) in [0, 1]: {pics.estimated_scale}",
            "model_inputs": "(B, C, H, W) the same pictures in the model's input space",
            "rows": "row i is estimated from row i of inputs.npz (the recovered features)"}
    return facts


def record_of(facts: ReplyFacts, outcome: AttackOutcome, view: InputView,
              truth: GroundTruth | TextTruth | None) -> ClientAudit:
    """The record of one reply: a reconstruction's pictures (scored against ``truth`` in audit
    mode, :func:`~fl_attack_flwr.results.pictures.pictures_of`), then :func:`build_record`."""
    if outcome.text is not None:
        return build_record(facts, outcome, sentences=sentences_of(
            outcome, facts, truth if isinstance(truth, TextTruth) else None))
    pictures = None
    if outcome.reconstructed and outcome.inputs is not None:
        pictures = pictures_of(outcome, facts, view,
                               truth if isinstance(truth, GroundTruth) else None)
    return build_record(facts, outcome, pictures)


def build_record(facts: ReplyFacts, outcome: AttackOutcome,
                 pictures: Pictures | None = None, *,
                 sentences: Sentences | None = None) -> ClientAudit:
    """The record of one reply: its facts, its outcome and, for reconstructions, its pictures.

    A pictures error (the inputs could not be shown or scored) becomes the record's ``error``;
    the facts' note on what the inputs are comes before the pictures' note.
    """
    pics = pictures or Pictures()
    found = dict(outcome.reconstruction) if outcome.reconstruction is not None else None
    text = None
    if sentences is not None:
        text = {"sentences_read": len(sentences.read), **(sentences.scores or {})}
        if found is not None and found.get("tokens_read") is not None:
            text["tokens_read"] = int(found["tokens_read"])

    def from_reconstruction(key: str, kind: type) -> Any:
        value = outcome.reconstruction_field(key)
        return None if value is None else kind(value)

    return ClientAudit(
        server_round=facts.server_round, node_id=facts.node_id,
        partition_id=facts.partition_id, label=facts.label, status=outcome.status,
        reason=outcome.reason,
        error=pics.error or (sentences.error if sentences else None) or outcome.error,
        protected_by=outcome.protected_by, protocol=facts.protocol,
        reading=outcome.reading, layer=facts.layer, layer_shape=facts.layer_shape,
        inputs_are=facts.inputs_are or pics.note, num_examples=facts.num_examples,
        batch_size=from_reconstruction("batch_size", int), true_batch_size=pics.true_batch_size,
        sparsity_match=from_reconstruction("sparsity_match", float),
        exact=from_reconstruction("exact", bool),
        n_directions=from_reconstruction("n_directions", int),
        attack_seconds=outcome.seconds, ran_on=outcome.ran_on, psnr=pics.psnr,
        psnr_mean=pics.psnr_mean, ssim=pics.ssim, ssim_mean=pics.ssim_mean, reads=facts.reads,
        pixels=_pixel_facts(outcome, pics), passed_over=facts.passed_over,
        epsilon=facts.epsilon, epsilon_cumulative=facts.epsilon_cumulative,
        delta=facts.delta, noise_std=facts.noise_std, guard=facts.guard, attack=found,
        sample_indices=facts.sample_indices, inputs=outcome.inputs,
        recon_images=pics.recon_images, original_images=pics.original_images,
        matching=pics.matching, pixel_images=pics.estimated,
        pixel_inputs=None if pics.estimated is None else outcome.pixels.images,
        text=text, sentences=None if sentences is None else sentences.read,
        missed_sentences=None if sentences is None else sentences.missed,
    )


def round_metrics(records: list[ClientAudit], seconds: float) -> dict[str, float]:
    """The audit's numbers for a round's MetricRecord (numbers only, as Flower requires)."""
    done = [r for r in records if r.reconstructed]

    def n(*statuses: str) -> int:
        return sum(1 for r in records if r.status in statuses)

    stats: dict[str, float] = {
        "audit-replies": len(records),
        "audit-reconstructions": len(done),
        "audit-certified": n(verdicts.CERTIFIED),
        "audit-protected": n(verdicts.PROTECTED),
        "audit-refused": n(verdicts.REFUSED),
        "audit-skipped": n(verdicts.SKIPPED),
        "audit-failures": n(*verdicts.ERRORS),
        "audit-corrupt": n(verdicts.CORRUPT),
        "audit-client-errors": n(verdicts.CLIENT_ERROR),
        "audit-attack-seconds": float(sum(r.attack_seconds or 0.0 for r in records)),
        "audit-seconds": float(seconds),
    }
    if seconds > 0 and stats["audit-attack-seconds"] > 0:
        attacked = len(done) + n(verdicts.PROTECTED, *verdicts.ERRORS)
        stats["audit-attacks-per-minute"] = 60.0 * attacked / seconds
    lams = [r.sparsity_match for r in done if r.sparsity_match is not None]
    if lams:
        stats["audit-lambda-mean"] = float(np.mean(lams))
    psnrs = [r.psnr_mean for r in done if r.psnr_mean is not None and math.isfinite(r.psnr_mean)]
    if psnrs:
        stats["audit-psnr-mean"] = float(np.mean(psnrs))
    return stats


def log_record(record: ClientAudit) -> None:
    """One line per finished record (round, client, status, λ, PSNR, seconds, why)."""
    lam = "" if record.sparsity_match is None else f", λ={record.sparsity_match:.4f}"
    psnr = "" if record.psnr_mean is None else f", PSNR {record.psnr_mean:.1f} dB"
    if record.reads == "features" and record.reconstructed:
        lam = f" ({str(record.layer).removesuffix('.weight')} input features){lam}"
        psnr = psnr and f", pictures estimated: PSNR {record.psnr_mean:.1f} dB"
    secs = "" if record.attack_seconds is None else f", {record.attack_seconds:.1f}s"
    why = record.reason or record.error
    level = (logging.WARNING if record.status in (*verdicts.ERRORS, verdicts.CORRUPT)
             else logging.INFO)
    log.log(level, "[audit] round %d, %s: %s%s%s%s%s", record.server_round, record.client_label,
            record.status, lam, psnr, secs, f" ({why})" if why else "")


def log_round(server_round: int, stats: dict[str, float], queued: int) -> None:
    """One line per round: what the audit found, its throughput and what is still queued."""
    log.info("[audit] round %d: %d replies, %d certified, %d reconstructed, %d protected, "
             "%d without answer; %.1f attacks/min, %d still queued", server_round,
             int(stats["audit-replies"]), int(stats["audit-certified"]),
             int(stats["audit-reconstructions"]), int(stats["audit-protected"]),
             int(stats["audit-failures"]), stats.get("audit-attacks-per-minute", 0.0), queued)
