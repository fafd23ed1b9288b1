"""An update as two state dicts: can it be aggregated, and what is attacked. No Flower here.

A reply from a client (:mod:`fl_attack_flwr.intake.reply`) and a pair of saved weights
(:mod:`fl_attack_flwr.intake.files`) both come down to the arrays the server sent and the
arrays it got back. This module is what the two readers share:

* :func:`keys_problem` and :func:`array_problem`: what FedAvg relies on (the same names and
  shapes as the sent model, real numbers or booleans, finite values), in the words a record or
  an error message gives;
* :func:`update_work`: the reply's facts completed with the attacked layer and what its
  reconstruction is (inputs or features), and its work: an attack job from
  :func:`fl_attack_flwr.jobs.build.attack_job`, or the outcome that says why there is none.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from fl_attack_flwr import verdicts
from fl_attack_flwr.intake.facts import ReplyFacts
from fl_attack_flwr.jobs.build import AttackJob, attack_job
from fl_attack_flwr.jobs.layers import LayerChoice, Passed
from fl_attack_flwr.jobs.model_plan import LayerPlan, ModelPlan
from fl_attack_flwr.jobs.outcome import AttackOutcome
from fl_attack_flwr.jobs.text import TextJob, text_job, text_layer
from fl_attack_flwr.settings import AttackSettings

Work = AttackJob | TextJob | AttackOutcome
"""What to do with a reply: attack this job, or record this outcome (nothing to attack)."""

log = logging.getLogger("flwr")


def keys_problem(sent: Iterable[str], returned: Iterable[str]) -> str | None:
    """Why the returned arrays' names do not match the sent ones (missing names first), or
    ``None`` when they match."""
    sent, returned = set(sent), set(returned)
    missing, extra = sorted(sent - returned), sorted(returned - sent)
    if missing:
        return f"missing arrays {missing}"
    if extra:
        return f"unexpected arrays {extra}"
    return None


def array_problem(key: str, value: np.ndarray, want: tuple[int, ...] | None) -> str | None:
    """Why the returned array ``key`` cannot be aggregated, or ``None``: a shape other than the
    sent one (``want``; ``None``: not checked), not real numbers or booleans (FedAvg's weighted
    sum takes integers and booleans too), or NaN / inf."""
    if want is not None and tuple(value.shape) != tuple(want):
        return f"array {key!r} has shape {tuple(value.shape)}, expected {tuple(want)}"
    real = np.issubdtype(value.dtype, np.number) and not np.iscomplexobj(value)
    if not (real or value.dtype == np.bool_):
        return f"array {key!r} is not real numeric (dtype {value.dtype})"
    if not np.isfinite(value).all():
        return f"array {key!r} contains NaN or inf"
    return None


def update_work(settings: AttackSettings, model: ModelPlan | None, facts: ReplyFacts,
                sent: Mapping[str, np.ndarray], returned: Mapping[str, np.ndarray], *,
                tokenizer: Any = None) -> tuple[ReplyFacts, Work]:
    """The attack job of the update ``sent -> returned`` and the facts it adds (the attacked
    layer, the layers passed over, what a reconstruction is); an outcome that says why when
    there is no job (``not-covered``, ``no-update``, or ``attack-error`` for what is no update
    at all: no linear layer with a bias, a named layer the model lacks). Never raises for what
    the arrays hold. A language model's update goes to the text attack (:func:`text_work`)."""
    if text_layer(returned) is not None:
        return text_work(settings, model, facts, sent, returned, tokenizer)
    try:
        plan_of = None if model is None else (lambda key: model.layer(key, sent))
        target, work = attack_job(sent, returned, settings, label=facts.client_label,
                                  server_round=facts.server_round, node_id=facts.node_id,
                                  num_examples=facts.num_examples or None, plan_of=plan_of)
        layer = target.layer
        facts = dataclasses.replace(
            facts, passed_over=[p.as_dict() for p in target.passed] or None,
            layer=layer.weight_key, layer_shape=list(layer.shape))
        if not target.covered:
            return facts, work
        plan = None if plan_of is None else plan_of(layer.weight_key)
        facts = dataclasses.replace(
            facts, reads="inputs" if layer.first_is_linear else "features",
            inputs_are=what_is_read(layer, plan, target.passed) or facts.inputs_are)
        if isinstance(work, AttackOutcome):
            return facts, work
        if plan is not None and not layer.first_is_linear and model is not None:
            work = dataclasses.replace(work, pixels=model.task(plan, sent, returned,
                                                               settings.seed))
    except ValueError as exc:
        return facts, AttackOutcome(verdicts.ATTACK_ERROR, error=str(exc))
    log.info("[audit] round %d, %s: attacking %s %s (read as %s)", facts.server_round,
             facts.client_label, layer.weight_key, layer.shape, " then ".join(work.readings))
    return facts, work


def text_work(settings: AttackSettings, model: ModelPlan | None, facts: ReplyFacts,
              sent: Mapping[str, np.ndarray], returned: Mapping[str, np.ndarray],
              tokenizer: Any) -> tuple[ReplyFacts, Work]:
    """The text attack's job of a language model's update (``jobs.text``), and its facts."""
    layer = str(text_layer(returned))
    facts = dataclasses.replace(
        facts, layer=layer, layer_shape=list(np.shape(returned[layer])), reads="text",
        inputs_are=("The sentences the client trained on, as token ids read off blocks 0 and "
                    "1 and the output layer (DAGER), decoded with the model's tokenizer."))
    work = text_job(sent, returned, model=None if model is None else model.spec,
                    tokenizer=tokenizer, server_round=facts.server_round, node_id=facts.node_id,
                    label=facts.client_label, num_examples=facts.num_examples,
                    protocol=facts.protocol, max_seconds=settings.max_seconds,
                    device=settings.device, memory_limit_gb=settings.memory_limit_gb)
    if not isinstance(work, AttackOutcome):
        log.info("[audit] round %d, %s: reading the text of a language model's update (%s)",
                 facts.server_round, facts.client_label, layer)
    return facts, work


def what_is_read(layer: LayerChoice, plan: LayerPlan | None,
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


def as_arrays(state: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """``state`` (arrays, tensors, numbers) as NumPy arrays, names kept in order."""
    return {str(k): _array(v) for k, v in state.items()}


def _array(value: Any) -> np.ndarray:
    if hasattr(value, "detach"):  # a torch tensor (bfloat16 has no NumPy type: float32)
        import torch

        value = value.detach().cpu()
        if value.dtype == torch.bfloat16:
            value = value.float()
        return value.numpy()
    return np.asarray(value)
