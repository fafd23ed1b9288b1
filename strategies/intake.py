"""From a training reply to an audit record and an attack job, without raising.

Each reply becomes a :class:`~fl_attack_flwr.store.ClientAudit` whose status already says
what cannot be attacked (a client error, a corrupt reply, a skipped one, no update), and, when
there is something to attack, an :class:`~fl_attack_flwr.replies.AttackJob`. Under secure
aggregation the round's aggregate is the one thing attacked (:func:`aggregate_intake`).
"""

from __future__ import annotations

import logging
import math
import random
from dataclasses import dataclass

import numpy as np
from flwr.app import ArrayRecord, Message

from fl_attack_flwr import verdicts
from fl_attack_flwr.protocol import (
    DELTA_KEY,
    EPSILON_CUMULATIVE_KEY,
    EPSILON_KEY,
    NOISE_STD_KEY,
)
from fl_attack_flwr.replies import (
    AttackJob,
    build_job,
    choose_layer,
    corrupt_reason,
    metric,
    partition_id,
    sample_indices,
)
from fl_attack_flwr.settings import AttackSettings
from fl_attack_flwr.store import ClientAudit

__all__ = ["Intake", "aggregate_intake", "reply_intake", "sample_replies"]

log = logging.getLogger("flwr")


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
                 skip: str | None) -> tuple[ClientAudit, AttackJob | None]:
    """The reply's record and attack job (``None``: nothing to attack, the record says why)."""
    node = int(reply.metadata.src_node_id)
    record = ClientAudit(ctx.server_round, node, label=label, protocol=ctx.protocol)
    if reply.has_error():
        record.status, record.error = verdicts.CLIENT_ERROR, str(reply.error.reason)
        return record, None
    record.partition_id = partition_id(reply)
    sent = ctx.sent.get(node, ctx.current)
    reason = corrupt_reason(reply, sent, ctx.weighted_by_key)
    if reason is not None:
        record.status, record.error = verdicts.CORRUPT, reason
        return record, None
    _read_metrics(ctx, record, reply)
    if skip is not None:
        record.status, record.reason = verdicts.SKIPPED, skip
        return record, None
    returned = next(iter(reply.content.array_records.values()))
    return _with_job(ctx, record, sent, returned)


def aggregate_intake(ctx: Intake, records: list[ClientAudit],
                     aggregated: ArrayRecord) -> tuple[ClientAudit, AttackJob | None]:
    """The record and job of the round's aggregate ``W0 - W_aggregate``: one batch of every
    aggregated client's samples (ground truth: the union of their sample indices)."""
    clients = [r for r in records if r.status == verdicts.SKIPPED]
    record = ClientAudit(ctx.server_round, 0, label=f"aggregate-of-{len(clients)}",
                         protocol=ctx.protocol)
    record.inputs_are = (f"The round's aggregate of {len(clients)} clients' updates (what a "
                         "server under secure aggregation sees), attacked as one batch.")
    indices = [i for r in clients for i in (r.sample_indices or [])]
    record.sample_indices = indices if all(r.sample_indices for r in clients) else None
    record.num_examples = sum(r.num_examples or 0 for r in clients)
    sent = ctx.current
    if sent is None or not all(_same(ctx.sent.get(r.node_id, sent), sent) for r in clients):
        record.status = verdicts.ATTACK_ERROR
        record.error = "the clients were sent different models: their aggregate is no update"
        return record, None
    return _with_job(ctx, record, sent, aggregated)


def _read_metrics(ctx: Intake, record: ClientAudit, reply: Message) -> None:
    num = metric(reply, ctx.weighted_by_key)
    record.num_examples = None if num is None else int(num)
    record.epsilon = metric(reply, EPSILON_KEY)
    record.epsilon_cumulative = metric(reply, EPSILON_CUMULATIVE_KEY)
    record.delta = metric(reply, DELTA_KEY)
    record.noise_std = metric(reply, NOISE_STD_KEY)
    record.sample_indices = sample_indices(reply)


def _with_job(ctx: Intake, record: ClientAudit, sent: ArrayRecord | None,
              returned: ArrayRecord) -> tuple[ClientAudit, AttackJob | None]:
    """The attack job of ``sent -> returned``; a record that says why when there is none."""
    try:
        if sent is None:
            raise ValueError("the server has no record of the arrays it sent this node")
        g_state = {k: v.numpy() for k, v in sent.items()}
        n_state = {k: v.numpy() for k, v in returned.items()}
        layer = choose_layer(g_state, ctx.settings.weight_key, ctx.settings.bias_key)
        record.layer, record.layer_shape = layer.weight_key, list(layer.shape)
        if not layer.first_is_linear:
            record.inputs_are = (f"The attacked layer {layer.weight_key} is not the model's "
                                 "first layer: the reconstructions are its input features, "
                                 "not the raw inputs.")
        job = build_job(record.server_round, record.node_id, record.client_label, g_state,
                        n_state, layer, ctx.settings)
    except ValueError as exc:
        zero = "identically zero" in str(exc)
        record.status = verdicts.NO_UPDATE if zero else verdicts.ATTACK_ERROR
        record.reason, record.error = (str(exc), None) if zero else (None, str(exc))
        return record, None
    log.info("[audit] round %d, %s: attacking %s %s (read as %s)", record.server_round,
             record.client_label, layer.weight_key, layer.shape, " then ".join(job.readings))
    return record, job


def _same(a: ArrayRecord, b: ArrayRecord) -> bool:
    """Whether two ArrayRecords hold the same arrays."""
    return a is b or (a.keys() == b.keys() and all(np.array_equal(a[k].numpy(), b[k].numpy())
                                                  for k in a.keys()))
