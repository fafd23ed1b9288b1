"""From a training reply to what the audit knows of it and what it attacks, without raising.

Each reply becomes :class:`~fl_attack_flwr.results.records.ReplyFacts` (who sent it, which
layer, how many examples, the DP accounting it reported) and its *work*: an
:class:`~fl_attack_flwr.jobs.build.AttackJob` when there is something to attack, otherwise the
:class:`~fl_attack_flwr.jobs.outcome.AttackOutcome` that says why not (a client error, a corrupt
reply, a skipped one, no update). Under secure aggregation the round's aggregate is the one
thing attacked (:func:`aggregate_intake`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import random
from dataclasses import dataclass
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, Message

from fl_attack_flwr import verdicts
from fl_attack_flwr.jobs.build import (
    AttackJob,
    LayerChoice,
    build_job,
    choose_layer,
    corrupt_reason,
    metric,
    partition_id,
    sample_indices,
)
from fl_attack_flwr.jobs.layers import Passed, passed_words, scan_layers
from fl_attack_flwr.jobs.outcome import AttackOutcome
from fl_attack_flwr.jobs.pixels import LayerPlan, ModelPlan
from fl_attack_flwr.results.records import ReplyFacts
from fl_attack_flwr.settings import AttackSettings
from fl_attack_flwr.wire import (
    DELTA_KEY,
    EPSILON_CUMULATIVE_KEY,
    EPSILON_KEY,
    GUARD_CODES,
    GUARD_KEYS,
    NOISE_STD_KEY,
)

__all__ = ["Intake", "Work", "aggregate_intake", "guard_of", "reply_intake", "sample_replies"]

Work = AttackJob | AttackOutcome
"""What to do with a reply: attack this job, or record this outcome (nothing to attack)."""

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
    model: ModelPlan | None = None
    """The user's model, when the strategy was given one (pictures from features)."""


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
    """The reply's facts and its work (``skip``: why the sampling leaves it out, or ``None``)."""
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


def _with_metrics(ctx: Intake, facts: ReplyFacts, reply: Message) -> ReplyFacts:
    """``facts`` with what the reply's metrics say (examples, DP accounting, sample ids)."""
    num = metric(reply, ctx.weighted_by_key)
    return dataclasses.replace(
        facts, num_examples=None if num is None else int(num),
        epsilon=metric(reply, EPSILON_KEY),
        epsilon_cumulative=metric(reply, EPSILON_CUMULATIVE_KEY), delta=metric(reply, DELTA_KEY),
        noise_std=metric(reply, NOISE_STD_KEY), sample_indices=sample_indices(reply),
        guard=guard_of(reply))


def guard_of(reply: Message) -> dict[str, Any] | None:
    """The reply's ``LeakGuard`` finding (``protocol.GUARD_KEYS``) in words, or ``None``."""
    values = {key: metric(reply, key) for key in GUARD_KEYS}
    if any(v is None for v in values.values()):
        return None
    status, refused, escalated, certified, readable, lam, seconds = values.values()
    return {"status": GUARD_CODES.get(int(status), "unknown"), "refused": bool(refused),
            "escalated": bool(escalated), "certified": bool(certified),
            "readable_samples": int(readable), "sparsity_match": None if lam < 0 else lam,
            "seconds": seconds}


def _with_job(ctx: Intake, facts: ReplyFacts, sent: ArrayRecord | None,
              returned: ArrayRecord) -> tuple[ReplyFacts, Work]:
    """The attack job of ``sent -> returned``; an outcome that says why when there is none."""
    try:
        if sent is None:
            raise ValueError("the server has no record of the arrays it sent this node")
        g_state = {k: v.numpy() for k, v in sent.items()}
        n_state = {k: v.numpy() for k, v in returned.items()}
        model = ctx.model
        plan_of = None if model is None else (lambda key: model.layer(key, g_state))
        layer, passed = scan_layers(g_state, n_state, ctx.settings, plan_of)
        facts = dataclasses.replace(facts, passed_over=[p.as_dict() for p in passed] or None)
        if layer is None:
            first = choose_layer(g_state, passed[0].layer)
            facts = dataclasses.replace(facts, layer=first.weight_key,
                                        layer_shape=list(first.shape))
            return facts, AttackOutcome(verdicts.NOT_COVERED, reason=passed_words(
                passed, ctx.settings.weight_key is not None))
        plan = None if plan_of is None else plan_of(layer.weight_key)
        facts = dataclasses.replace(
            facts, layer=layer.weight_key, layer_shape=list(layer.shape),
            reads="inputs" if layer.first_is_linear else "features",
            inputs_are=_what_is_read(layer, plan, passed) or facts.inputs_are)
        job = build_job(facts.server_round, facts.node_id, facts.client_label, g_state,
                        n_state, layer, ctx.settings)
        job = dataclasses.replace(job, num_examples=facts.num_examples or None)
        if plan is not None and not layer.first_is_linear and model is not None:
            job = dataclasses.replace(job, pixels=model.task(plan, g_state, n_state,
                                                             ctx.settings.seed))
    except ValueError as exc:
        if "identically zero" in str(exc):
            return facts, AttackOutcome(verdicts.NO_UPDATE, reason=str(exc))
        return facts, AttackOutcome(verdicts.ATTACK_ERROR, error=str(exc))
    log.info("[audit] round %d, %s: attacking %s %s (read as %s)", facts.server_round,
             facts.client_label, layer.weight_key, layer.shape, " then ".join(job.readings))
    return facts, job


def _what_is_read(layer: LayerChoice, plan: LayerPlan | None,
                  passed: list[Passed]) -> str | None:
    """The note on what the reconstructions are, for a layer that is not the model's first."""
    if layer.first_is_linear:
        return None
    name = layer.weight_key.removesuffix(".weight")
    head = (f"The attacked layer {name} is not the model's first layer: what the attack "
            "recovers (and certifies) are its input features, not the raw inputs.")
    if passed:
        skipped = ", ".join(p.layer.removesuffix(".weight") for p in passed)
        head = (f"Not covered: {skipped} ({passed[0].reason}). The audit attacked {name}, the "
                "first layer after it that it covers: what the attack recovers (and certifies) "
                f"are {name}'s input features, the output of the block before it, not the raw "
                "inputs.")
    if plan is None:
        return head + (" Pass the model to the audit (AuditingStrategy(..., model=Net)) to "
                       "estimate pictures from them.")
    if plan.error is not None or plan.input_shape is None:
        why = plan.error or "its input shape could not be found (pass input_shape=(C, H, W))"
        return head + f" No pictures: {why}."
    return head + (" The pictures are estimated from them by feature inversion through the "
                   "model's earlier layers (fl_attack.pixels): an approximation, scored "
                   "separately.")


def _same(a: ArrayRecord, b: ArrayRecord) -> bool:
    """Whether two ArrayRecords hold the same arrays."""
    return a is b or (a.keys() == b.keys() and all(np.array_equal(a[k].numpy(), b[k].numpy())
                                                  for k in a.keys()))
