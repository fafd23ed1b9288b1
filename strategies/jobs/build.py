"""From the arrays the server sent and the arrays the client returned to an attack job.

:func:`attack_job` is what the auditing server (:mod:`fl_attack_flwr.intake.reply`) and the
client's own ``LeakGuard`` both call: it finds the layer to attack (the first the attack covers,
:func:`~fl_attack_flwr.jobs.layers.scan_layers`) and builds a picklable :class:`AttackJob` (the
attacked layer's update pair, and the next layer's weight update) that any executor can run;
where there is nothing to attack it returns the outcome that says why (``not-covered``,
``no-update``). Plain arrays in, plain data out: no Flower here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fl_attack_flwr import verdicts
from fl_attack_flwr.jobs.layers import (
    LayerChoice,
    Passed,
    PlanOf,
    choose_layer,
    passed_words,
    scan_layers,
)
from fl_attack_flwr.jobs.outcome import AttackOutcome
from fl_attack_flwr.settings import AttackSettings


@dataclass
class AttackJob:
    """Everything one attack needs, as plain picklable data (no Flower types)."""

    server_round: int
    node_id: int
    label: str
    weight_grad: np.ndarray
    bias_grad: np.ndarray
    weight: np.ndarray
    bias: np.ndarray
    next_weight_grad: np.ndarray | None
    readings: tuple[str, ...]
    invert_kwargs: dict[str, Any] = field(default_factory=dict)
    memory_limit_gb: float | None = None
    pixels: Any = None
    """A ``jobs.pixels.PixelTask`` when the reconstructed features are to become pictures."""
    num_examples: int | None = None
    """The samples the reply says the client trained on (an upper bound of the batch size)."""
    next_weight: np.ndarray | None = None
    """The next layer's weight as sent (beside ``next_weight_grad``: its rounding floor)."""


@dataclass(frozen=True)
class Target:
    """Where an update is attacked: the first layer the attack covers (``covered``) or, when it
    covers none, the first layer scanned; and the layers passed over before it."""

    layer: LayerChoice
    covered: bool
    passed: list[Passed]


def attack_job(sent: Mapping[str, np.ndarray], returned: Mapping[str, np.ndarray],
               settings: AttackSettings, *, label: str, server_round: int = 0,
               node_id: int = 0, num_examples: int | None = None,
               plan_of: PlanOf | None = None) -> tuple[Target, AttackJob | AttackOutcome]:
    """The job that attacks the update ``sent -> returned``, or the outcome that says why there
    is none: ``not-covered`` (no layer the attack covers) or ``no-update`` (the attacked layer's
    update is zero, :class:`fl_attack.errors.ZeroUpdate`).

    ``plan_of`` is what the user's model says about a layer (``jobs.model_plan``);
    ``num_examples`` the samples the reply reports. Raises ``ValueError`` for what is no
    update at all (the model has no linear layer with a bias, the named layer is not one).
    """
    from fl_attack.errors import ZeroUpdate

    layer, passed = scan_layers(sent, returned, settings, plan_of)
    if layer is None:
        first = Target(choose_layer(sent, passed[0].layer), False, passed)
        return first, AttackOutcome(verdicts.NOT_COVERED, reason=passed_words(
            passed, settings.weight_key is not None))
    target = Target(layer, True, passed)
    try:
        job = build_job(server_round, node_id, label, sent, returned, layer, settings,
                        num_examples=num_examples)
    except ZeroUpdate as exc:
        return target, AttackOutcome(verdicts.NO_UPDATE, reason=str(exc))
    return target, job


def build_job(server_round: int, node_id: int, label: str, sent: Mapping[str, np.ndarray],
              returned: Mapping[str, np.ndarray], layer: LayerChoice,
              settings: AttackSettings, *, num_examples: int | None = None) -> AttackJob:
    """The attack job of one update at ``layer`` (``ZeroUpdate`` when it is zero there).

    The update is ``W0 - W_E`` of the reply's weights, so the attack is told their dtype
    (``weights_dtype``: their rounding is no sample), unless the reply reports at least as
    many samples as the layer has units or inputs (``num_examples``): then the whole spectrum
    may be samples, its weakest below that rounding, and the update is read as it is."""
    from fl_attack.model.updates import weight_update_pair

    dw, db, w0, b0 = weight_update_pair(sent, returned, weight_key=layer.weight_key,
                                        bias_key=layer.bias_key)
    readings = settings.readings()
    dw2 = w2 = None
    if settings.next_layer and layer.next_weight_key is not None and "gradient" in readings:
        dw2, w2 = _next_layer_update(sent, returned, layer)
    kwargs = settings.invert_kwargs()
    stored = _stored_dtype(returned[layer.weight_key])
    if stored is not None and (num_examples is None or num_examples < min(dw.shape)):
        kwargs.setdefault("weights_dtype", stored)
    return AttackJob(server_round, node_id, label, dw.numpy(), db.numpy(), w0.numpy(),
                     b0.numpy(), dw2, readings, kwargs, settings.memory_limit_gb,
                     num_examples=num_examples, next_weight=w2)


def _stored_dtype(value: Any) -> str | None:
    """The name of the float dtype an array of the reply is stored in (``"float32"``, ...),
    as ``AttackConfig.weights_dtype`` takes it; None for any other type."""
    from fl_attack.config import WEIGHT_DTYPES

    name = str(getattr(value, "dtype", "")).removeprefix("torch.")
    return name if name in WEIGHT_DTYPES else None


def _next_layer_update(sent: Mapping[str, np.ndarray], returned: Mapping[str, np.ndarray],
                       layer: LayerChoice) -> tuple[np.ndarray | None, np.ndarray | None]:
    """``W0 - W_E`` and ``W0`` of the layer the attacked one feeds, if it takes its outputs
    (``None, None`` otherwise)."""
    from fl_attack.model.updates import weight_update_pair

    try:
        dw2, _, w2, _ = weight_update_pair(sent, returned, weight_key=layer.next_weight_key)
    except ValueError:
        return None, None
    if dw2.shape[1] != layer.shape[0]:
        return None, None
    return dw2.numpy(), w2.numpy()
