"""What the audit keeps per client and round: :class:`ClientAudit`, built in one place.

Three facts make a record, each from the step that knows it:

* :class:`ReplyFacts`: what the server read off the reply before any attack (who, which layer,
  how many examples, the DP accounting the client reported, the audit-mode sample ids);
* :class:`~fl_attack_flwr.jobs.outcome.AttackOutcome`: what the attack (or the intake, for replies
  it does not attack) concluded;
* :class:`Pictures`: the reconstruction shown as images and, with ground truth, scored.

:func:`build_record` combines them into the immutable :class:`ClientAudit` that the store
writes, the report shows and the round's metrics count.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fl_attack_flwr import verdicts
from fl_attack_flwr.jobs.outcome import AttackOutcome
from fl_attack_flwr.output.private_files import jsonable

__all__ = ["ClientAudit", "Pictures", "ReplyFacts", "build_record", "client_label"]


def client_label(partition_id: int | None, label: str | None, node_id: int) -> str:
    """``client-<partition-id>``, else the label the strategy gave, else ``node-<node-id>``."""
    if partition_id is not None:
        return f"client-{partition_id}"
    return label or f"node-{node_id}"


@dataclass(frozen=True, eq=False)
class ReplyFacts:
    """What the server knows of one reply (or of the round's aggregate) before attacking it.

    Compared and hashed by identity: each reply has its own facts, which the strategy uses as
    the key of that reply's record.
    """

    server_round: int
    node_id: int
    label: str | None = None
    partition_id: int | None = None
    protocol: str | None = None
    num_examples: int | None = None
    epsilon: float | None = None
    epsilon_cumulative: float | None = None
    delta: float | None = None
    noise_std: float | None = None
    sample_indices: list[int] | None = None
    layer: str | None = None
    layer_shape: list[int] | None = None
    inputs_are: str | None = None
    """A note on what the reconstructed inputs are (features of a later layer, an aggregate)."""
    guard: dict[str, Any] | None = None
    """The client's own ``LeakGuard`` finding, when its reply carries one (:func:`guard_of`)."""
    reads: str | None = None
    """What a reconstruction is: ``"inputs"`` (the model's own inputs: the attacked layer is
    the first) or ``"features"`` (a later layer's inputs)."""
    passed_over: list[dict[str, str]] | None = None
    """The linear layers before the attacked one that the attack does not cover, each with its
    status (``not-covered``) and reason (``coverage.Passed.as_dict``)."""

    @property
    def client_label(self) -> str:
        """The label records and logs name this reply by (see :func:`client_label`)."""
        return client_label(self.partition_id, self.label, self.node_id)


@dataclass(frozen=True)
class Pictures:
    """A reconstruction as pictures; with ground truth, matched to the originals and scored."""

    recon_images: np.ndarray | None = field(default=None, repr=False)
    """``(B, C, H, W)`` in ``[0, 1]``, in the originals' order when they are known."""
    original_images: np.ndarray | None = field(default=None, repr=False)
    matching: np.ndarray | None = field(default=None, repr=False)
    psnr: list[float] | None = None
    psnr_mean: float | None = None
    ssim: list[float] | None = None
    ssim_mean: float | None = None
    true_batch_size: int | None = None
    note: str | None = None
    """How the inputs were shown (not images; shape inferred)."""
    estimated: np.ndarray | None = field(default=None, repr=False)
    """Pictures estimated from features: ``(B, C, H, W)`` in ``[0, 1]``, row i from row i of
    the reconstructed features (not reordered)."""
    estimated_scale: str | None = None
    """How :attr:`estimated` was brought into ``[0, 1]`` from the model's input space."""
    error: str | None = None
    """Why the pictures or the scores could not be made."""


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

    def metrics(self) -> dict[str, Any]:
        """The JSON-safe line of ``metrics.jsonl`` (no arrays, no sample indices)."""
        keys = (
            "server_round", "partition_id", "node_id", "status", "reason", "error", "protocol",
            "reading", "layer", "layer_shape", "inputs_are", "num_examples", "batch_size",
            "true_batch_size", "sparsity_match", "exact", "n_directions", "attack_seconds",
            "ran_on", "reads", "psnr_mean", "psnr", "ssim_mean", "ssim", "pixels", "epsilon",
            "epsilon_cumulative", "delta", "noise_std", "guard", "attack", "passed_over",
        )
        line = {k: getattr(self, k) for k in keys}
        line["client"] = self.client_label
        return jsonable(line)


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


def build_record(facts: ReplyFacts, outcome: AttackOutcome,
                 pictures: Pictures | None = None) -> ClientAudit:
    """The record of one reply: its facts, its outcome and, for reconstructions, its pictures.

    A pictures error (the inputs could not be shown or scored) becomes the record's ``error``;
    the facts' note on what the inputs are comes before the pictures' note.
    """
    pics = pictures or Pictures()
    summary = dict(outcome.summary) if outcome.summary is not None else None

    def from_summary(key: str, kind: type) -> Any:
        value = outcome.summary_value(key)
        return None if value is None else kind(value)

    return ClientAudit(
        server_round=facts.server_round, node_id=facts.node_id,
        partition_id=facts.partition_id, label=facts.label, status=outcome.status,
        reason=outcome.reason, error=pics.error or outcome.error, protocol=facts.protocol,
        reading=outcome.reading, layer=facts.layer, layer_shape=facts.layer_shape,
        inputs_are=facts.inputs_are or pics.note, num_examples=facts.num_examples,
        batch_size=from_summary("batch_size", int), true_batch_size=pics.true_batch_size,
        sparsity_match=from_summary("sparsity_match", float),
        exact=from_summary("exact", bool), n_directions=from_summary("n_directions", int),
        attack_seconds=outcome.seconds, ran_on=outcome.ran_on, psnr=pics.psnr,
        psnr_mean=pics.psnr_mean, ssim=pics.ssim, ssim_mean=pics.ssim_mean, reads=facts.reads,
        pixels=_pixel_facts(outcome, pics), passed_over=facts.passed_over,
        epsilon=facts.epsilon, epsilon_cumulative=facts.epsilon_cumulative,
        delta=facts.delta, noise_std=facts.noise_std, guard=facts.guard, attack=summary,
        sample_indices=facts.sample_indices, inputs=outcome.inputs,
        recon_images=pics.recon_images, original_images=pics.original_images,
        matching=pics.matching, pixel_images=pics.estimated,
        pixel_inputs=None if pics.estimated is None else outcome.pixels.images,
    )
