"""A training reply's way in: can it be aggregated, what does it say, what is attacked.

Each reply becomes :class:`~fl_attack_flwr.intake.facts.ReplyFacts` (who sent it, which layer,
how many examples, the DP accounting and the guard's finding it reported, the audit-mode sample
ids) and its *work*: an :class:`~fl_attack_flwr.jobs.build.AttackJob` when there is something
to attack (built by :func:`fl_attack_flwr.jobs.build.attack_job`), otherwise the
:class:`~fl_attack_flwr.jobs.outcome.AttackOutcome` that says why not (a client error, a corrupt
reply, a refused or skipped one, no update). Under secure aggregation the round's aggregate is
the one thing attacked (:func:`aggregate_intake`). Nothing here raises for what a reply holds.

This is the plugin's one reader of Flower ``Message`` s from clients; the keys it reads are
defined in :mod:`fl_attack_flwr.wire`.
"""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord

from fl_attack_flwr import verdicts, wire
from fl_attack_flwr.intake.facts import ReplyFacts
from fl_attack_flwr.intake.update import Work, array_problem, keys_problem, update_work
from fl_attack_flwr.jobs.model_plan import ModelPlan
from fl_attack_flwr.jobs.outcome import AttackOutcome
from fl_attack_flwr.settings import AttackSettings

__all__ = ["Intake", "Work", "aggregate_intake", "corrupt_reason", "reply_intake",
           "sample_replies"]


@dataclass(frozen=True)
class Intake:
    """What the audit knows when a round's replies arrive."""

    server_round: int
    settings: AttackSettings
    weighted_by_key: str
    protocol: str | None
    current: ArrayRecord | None
    """The arrays the round started from."""
    sent: dict[int, ArrayRecord]
    """The arrays each node was sent (the attack's ``W0``)."""
    model: ModelPlan | None = None
    """The user's model, when the strategy was given one (pictures from features; a language
    model's architecture)."""
    tokenizer: Any = None
    """Decodes a language model's token ids (``jobs.text``)."""
    decoded: dict[int, dict[str, np.ndarray]] = field(default_factory=dict, compare=False)
    """The sent ArrayRecords decoded once per round (by ``id``): every reply's job shares
    them (a language model's are hundreds of MB)."""


def sample_replies(settings: AttackSettings, rng: random.Random, server_round: int,
                   replies: list[Message]) -> dict[int, str | None]:
    """Reply index -> ``None`` (attack it) or why it is skipped (the sampling settings)."""
    if server_round not in settings.round_filter:
        return {i: f"round {server_round} is not audited (rounds = {settings.rounds!r})"
                for i in range(len(replies))}
    ok = [i for i, r in enumerate(replies) if not r.has_error()]
    take = len(ok) if settings.fraction >= 1 else math.ceil(settings.fraction * len(ok))
    take = min(take, settings.max_per_round or take)
    picked = set(rng.sample(ok, take)) if take < len(ok) else set(ok)
    why = (f"not sampled (fraction {settings.fraction:g}, at most {settings.max_per_round} per "
           "round)")
    return {i: None if i in picked else why for i in range(len(replies))}


def reply_intake(ctx: Intake, reply: Message, label: str,
                 skip: str | None) -> tuple[ReplyFacts, Work]:
    """The reply's facts and its work (``skip``: why the sampling leaves it out, or ``None``).

    The audit-only sample indices are read, then taken out of the reply: the wrapped strategy
    never sees them.
    """
    facts, work = _read(ctx, reply, label, skip)
    _strip_ground_truth(reply)
    return facts, work


def _read(ctx: Intake, reply: Message, label: str,
          skip: str | None) -> tuple[ReplyFacts, Work]:
    node = int(reply.metadata.src_node_id)
    facts = ReplyFacts(ctx.server_round, node, label=label, protocol=ctx.protocol)
    if reply.has_error():
        return facts, AttackOutcome(verdicts.CLIENT_ERROR, error=str(reply.error.reason))
    facts = dataclasses.replace(facts, partition_id=partition_id(reply))
    sent = ctx.sent.get(node, ctx.current)
    reason = corrupt_reason(reply, sent, ctx.weighted_by_key)
    if reason is not None:
        return facts, AttackOutcome(verdicts.CORRUPT, error=reason)
    facts = _with_metrics(ctx, facts, reply)
    if facts.guard is not None and facts.guard["refused"]:
        return facts, AttackOutcome(verdicts.REFUSED, reason=(
            f"the client's LeakGuard proved {facts.guard['readable_samples']} sample(s) of its "
            f"update readable ({facts.guard['status']}) and sent no update"))
    if skip is not None:
        return facts, AttackOutcome(verdicts.SKIPPED, reason=skip)
    returned = next(iter(reply.content.array_records.values()))
    return _with_job(ctx, facts, sent, returned)


def aggregate_intake(ctx: Intake, clients: list[ReplyFacts],
                     aggregated: ArrayRecord) -> tuple[ReplyFacts, Work]:
    """The facts and work of the round's aggregate ``W0 - W_aggregate``: one batch of every
    aggregated client's samples (``clients``: the facts of the replies it aggregates; ground
    truth: the union of their sample indices)."""
    indices = [i for f in clients for i in (f.sample_indices or [])]
    facts = ReplyFacts(
        ctx.server_round, 0, label=f"aggregate-of-{len(clients)}", protocol=ctx.protocol,
        inputs_are=(f"The round's aggregate of {len(clients)} clients' updates (what a server "
                    "under secure aggregation sees), attacked as one batch."),
        sample_indices=indices if all(f.sample_indices for f in clients) else None,
        num_examples=sum(f.num_examples or 0 for f in clients))
    sent = ctx.current
    if sent is None or not all(_same(ctx.sent.get(f.node_id, sent), sent) for f in clients):
        return facts, AttackOutcome(verdicts.ATTACK_ERROR, error="the clients were sent "
                                    "different models: their aggregate is no update")
    return _with_job(ctx, facts, sent, aggregated)


def _strip_ground_truth(reply: Message) -> None:
    """Remove the audit-only sample indices before the wrapped strategy sees the reply."""
    info = client_info(reply)
    if info is not None and wire.SAMPLE_INDICES_KEY in info:
        del info[wire.SAMPLE_INDICES_KEY]


# ---------------------------------------------------------------------------- what it says


def _with_metrics(ctx: Intake, facts: ReplyFacts, reply: Message) -> ReplyFacts:
    """``facts`` with what the reply's metrics say (examples, DP accounting, sample ids)."""
    return dataclasses.replace(
        facts, num_examples=wire.num_examples(reply, ctx.weighted_by_key),
        epsilon=wire.metric(reply, wire.EPSILON_KEY),
        epsilon_cumulative=wire.metric(reply, wire.EPSILON_CUMULATIVE_KEY),
        delta=wire.metric(reply, wire.DELTA_KEY), noise_std=wire.metric(reply, wire.NOISE_STD_KEY),
        sample_indices=sample_indices(reply), guard=guard_of(reply))


def guard_of(reply: Message) -> dict[str, Any] | None:
    """The reply's ``LeakGuard`` finding (``wire.GUARD_KEYS``) in words, or ``None``."""
    values = {key: wire.metric(reply, key) for key in wire.GUARD_KEYS}
    if any(v is None for v in values.values()):
        return None
    status, refused, escalated, certified, readable, lam, seconds = values.values()
    return {"status": wire.GUARD_CODES.get(int(status), "unknown"), "refused": bool(refused),
            "escalated": bool(escalated), "certified": bool(certified),
            "readable_samples": int(readable), "sparsity_match": None if lam < 0 else lam,
            "seconds": seconds}


def client_info(reply: Message) -> ConfigRecord | None:
    """The reply's ``client-info`` ConfigRecord (the plugin's own clients send one)."""
    if reply.has_content() and wire.CLIENT_INFO_KEY in reply.content.config_records:
        return reply.content.config_records[wire.CLIENT_INFO_KEY]
    return None


def partition_id(reply: Message) -> int | None:
    """The client's partition id, from ``client-info`` or a metric of that name."""
    info = client_info(reply)
    sources = ([info] if info is not None else []) + (
        list(reply.content.metric_records.values()) if reply.has_content() else [])
    for source in sources:
        value = source.get(wire.PARTITION_ID_KEY)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return int(value)
    return None


def sample_indices(reply: Message) -> list[int] | None:
    """The audit-mode ground truth: indices of the samples the client trained on."""
    info = client_info(reply)
    values = None if info is None else info.get(wire.SAMPLE_INDICES_KEY)
    return [int(v) for v in values] if values else None


# ---------------------------------------------------------------------------- can it be aggregated


def corrupt_reason(reply: Message, global_arrays: ArrayRecord | None,
                   weighted_by_key: str = wire.NUM_EXAMPLES_KEY) -> str | None:
    """Why a (non-error) training reply cannot be aggregated, or ``None`` when it can.

    Checks what FedAvg relies on: exactly one ArrayRecord with the same array names and shapes as
    the global model, real numbers or booleans (integer buffers such as BatchNorm's
    ``num_batches_tracked`` included: the audit never attacks them) and finite, and exactly one
    MetricRecord with a positive finite ``weighted_by_key``.
    """
    content = reply.content
    if len(content.array_records) != 1:
        return f"expected exactly one ArrayRecord, got {len(content.array_records)}"
    record = next(iter(content.array_records.values()))
    if global_arrays is not None:
        reason = keys_problem(global_arrays.keys(), record.keys())
        if reason is not None:
            return reason
    for key, arr in record.items():
        reason = _array_problem(key, arr, global_arrays)
        if reason is not None:
            return reason
    if len(content.metric_records) != 1:
        return f"expected exactly one MetricRecord, got {len(content.metric_records)}"
    metrics = next(iter(content.metric_records.values()))
    if _weight_of(metrics, weighted_by_key) is None:
        return f"MetricRecord lacks a positive finite {weighted_by_key!r}"
    return None


def _weight_of(metrics: MetricRecord, key: str) -> float | None:
    value = metrics.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) and value > 0 else None


def _array_problem(key: str, arr: Any, global_arrays: ArrayRecord | None) -> str | None:
    try:
        value = arr.numpy()
    except Exception as exc:  # noqa: BLE001 - undecodable payload
        return f"array {key!r} cannot be decoded: {exc}"
    want = None if global_arrays is None else tuple(global_arrays[key].shape)
    return array_problem(key, value, want)


# ---------------------------------------------------------------------------- what is attacked


def _with_job(ctx: Intake, facts: ReplyFacts, sent: ArrayRecord | None,
              returned: ArrayRecord) -> tuple[ReplyFacts, Work]:
    """The attack job of ``sent -> returned`` (:func:`~fl_attack_flwr.intake.update.update_work`);
    an outcome that says why when there is none."""
    if sent is None:
        return facts, AttackOutcome(verdicts.ATTACK_ERROR, error="the server has no record of "
                                    "the arrays it sent this node")
    if id(sent) not in ctx.decoded:
        ctx.decoded[id(sent)] = {k: v.numpy() for k, v in sent.items()}
    return update_work(ctx.settings, ctx.model, facts, ctx.decoded[id(sent)],
                       {k: v.numpy() for k, v in returned.items()}, tokenizer=ctx.tokenizer)


def _same(a: ArrayRecord, b: ArrayRecord) -> bool:
    """Whether two ArrayRecords hold the same arrays."""
    return a is b or (a.keys() == b.keys() and all(np.array_equal(a[k].numpy(), b[k].numpy())
                                                  for k in a.keys()))
