"""Which linear layer is attacked: the first one the attack covers, and why not the others.

SPEAR reads a linear layer whose output goes straight into a ReLU (§3.2: each sample's ∂L/∂Z
is zero where its unit is inactive) and fixes each sample's scale with the layer's bias
gradient (§3.4). A BatchNorm in train mode between the layer and its ReLU breaks both: it
normalises with the batch's own mean and variance, so each sample's ∂L/∂Z depends on every
sample of the batch (no longer zero where that sample's unit is inactive), and it subtracts
the batch mean, so the bias gradient Σᵢ ∂L/∂zᵢ is zero. Such a layer is outside what the
attack covers: the scan records it ``not-covered`` and goes on to the next linear layer whose
input is that block's output (its inputs are then features, and recorded as such).

What follows a layer is read from the user's model when the audit has it
(:class:`~fl_attack_flwr.jobs.model_plan.LayerPlan`: the traced consumer of the layer's output),
and from the arrays otherwise (:func:`batchnorm_after`): a norm's ``...running_mean`` of the
layer's width among the keys right after the layer's, or a bias that did not move while the
weights did. A layer the user names (``AttackSettings(weight_key=...)``) is the only one
scanned.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from fl_attack_flwr import verdicts
from fl_attack_flwr.settings import AttackSettings

STILL_RATIO = 1e-4
"""A unit's bias change below this fraction of its largest weight change is rounding: after a
BatchNorm in train mode the ratio stayed below 1e-6 on photo batches (the float32 sum of a
gradient that cancels), while a layer followed by a ReLU has a median ratio of 0.15-0.25 over
its units (``∂L/∂b = Σᵢ ∂L/∂zᵢ`` against ``∂L/∂W = Σᵢ ∂L/∂zᵢ xᵢᵀ``); every unit must pass."""

PlanOf = Callable[[str], Any]
"""``weight_key -> LayerPlan | None``: what the user's model says about a layer."""


@dataclass(frozen=True)
class LayerChoice:
    """A linear layer of a model's state dict, by its keys.

    ``first_is_linear`` is False when a non-linear-layer weight (a convolution, an embedding)
    comes before it: the reconstruction is then that layer's input *features*, not the raw input.
    """

    weight_key: str
    bias_key: str
    shape: tuple[int, int]
    first_is_linear: bool
    next_weight_key: str | None = None


def choose_layer(state: Mapping[str, np.ndarray], weight_key: str | None = None,
                 bias_key: str | None = None) -> LayerChoice:
    """The layer ``weight_key`` when given, else the first linear layer with a bias.

    Raises ``ValueError`` naming the keys when the named layer is missing or is not a linear
    layer with a bias, or when the model has no such layer at all.
    """
    from fl_attack.model.updates import layer_keys

    pairs = layer_keys(state)
    if weight_key is None:
        if not pairs:
            raise ValueError("the model has no linear layer with a bias (a 2-d '...weight' and "
                             f"its '...bias'); its arrays: {list(state)}")
        weight_key, bias_key = pairs[0]
    else:
        bias_key = bias_key or (weight_key[: -len("weight")] + "bias"
                                if weight_key.endswith("weight") else None)
        if (weight_key, bias_key) not in pairs:
            raise ValueError(f"weight_key {weight_key!r} / bias_key {bias_key!r} is not a linear "
                             f"layer with a bias of this model; linear layers: "
                             f"{[w for w, _ in pairs]}")
    keys = [w for w, _ in pairs]
    at = keys.index(weight_key)
    nxt = keys[at + 1] if at + 1 < len(keys) else None
    before = list(state)[: list(state).index(weight_key)]
    first_is_linear = not any(np.ndim(state[k]) >= 2 for k in before)
    shape = tuple(int(s) for s in np.shape(state[weight_key]))
    return LayerChoice(weight_key, str(bias_key), (shape[0], shape[1]), first_is_linear, nxt)


@dataclass(frozen=True)
class Passed:
    """A linear layer the audit did not attack, and why (its status is ``not-covered``)."""

    layer: str
    reason: str

    def as_dict(self) -> dict[str, str]:
        """The JSON form kept in the record's ``passed_over``."""
        return {"layer": self.layer, "status": verdicts.NOT_COVERED, "reason": self.reason}


def scan_layers(sent: Mapping[str, np.ndarray], returned: Mapping[str, np.ndarray],
                settings: AttackSettings, plan_of: PlanOf | None = None
                ) -> tuple[LayerChoice | None, list[Passed]]:
    """The layer to attack and the layers passed over before it.

    Parameters
    ----------
    sent, returned : mapping of str to array
        The state the server sent and the state the client returned.
    settings : AttackSettings
        ``weight_key`` / ``bias_key`` name the one layer to consider; otherwise every linear
        layer with a bias, in state order, from the first.
    plan_of : callable, optional
        ``weight_key -> LayerPlan | None`` from the user's model.

    Returns
    -------
    (LayerChoice or None, list of Passed)
        ``None`` when no layer is covered (the list then says why for each layer scanned).

    Raises
    ------
    ValueError
        When the model has no linear layer with a bias, or the named layer is not one.
    """
    first = choose_layer(sent, settings.weight_key, settings.bias_key)
    passed: list[Passed] = []
    layer: LayerChoice | None = first
    while layer is not None:
        why = _not_covered(layer, sent, returned, plan_of)
        if why is None:
            return layer, passed
        passed.append(Passed(layer.weight_key, why))
        if settings.weight_key is not None or layer.next_weight_key is None:
            break
        after = choose_layer(sent, layer.next_weight_key)
        # the next layer reads this block's output only when its input width is this width
        layer = after if after.shape[1] == layer.shape[0] else None
    return None, passed


def passed_words(passed: list[Passed], named: bool) -> str:
    """The ``not-covered`` reason of a reply none of whose scanned layers is covered
    (``named``: the user named the one layer to attack)."""
    words = "; ".join(p.reason for p in passed)
    if named:
        return words + " (the audit attacks only the layer named by weight_key)"
    return words + "; no later linear layer that reads this block's output is covered"


def _not_covered(layer: LayerChoice, sent: Mapping[str, np.ndarray],
                 returned: Mapping[str, np.ndarray], plan_of: PlanOf | None) -> str | None:
    """Why ``layer`` is outside what the attack covers, or ``None`` when nothing says so."""
    plan = plan_of(layer.weight_key) if plan_of is not None else None
    norm = _norm_keys(sent, returned, layer)
    still = _bias_still(sent, returned, layer)
    if norm is not None:
        return verdicts.batchnorm_reason(layer.weight_key, *norm)
    if plan is not None and plan.relu_after is False:
        if (plan.after or "").startswith("BatchNorm"):
            return verdicts.batchnorm_reason(layer.weight_key, plan.after, True if still else None)
        return verdicts.not_relu_reason(layer.weight_key, plan.after)
    return verdicts.still_bias_reason(layer.weight_key) if still else None


def batchnorm_after(sent: Mapping[str, np.ndarray], returned: Mapping[str, np.ndarray],
                    layer: LayerChoice) -> str | None:
    """Why a BatchNorm follows ``layer``, read off the arrays, or ``None``.

    Two signs, either suffices: among the keys after the layer's bias, before the next
    array of two or more dimensions, a ``...running_mean`` of the layer's width (a BatchNorm
    registered right after it; train mode when its running statistics or
    ``num_batches_tracked`` moved); or a bias that moved by no more than rounding
    (:data:`STILL_RATIO` of the unit's weight change) on every unit whose weights moved (the
    bias gradient a BatchNorm over the batch cancels).
    """
    norm = _norm_keys(sent, returned, layer)
    if norm is not None:
        return verdicts.batchnorm_reason(layer.weight_key, *norm)
    if _bias_still(sent, returned, layer):
        return verdicts.still_bias_reason(layer.weight_key)
    return None


def _norm_keys(sent: Mapping[str, np.ndarray], returned: Mapping[str, np.ndarray],
               layer: LayerChoice) -> tuple[str, bool | None] | None:
    """``(norm name, train mode)`` of a BatchNorm whose keys follow the layer's, or ``None``
    (train mode: its running statistics moved; ``None`` when the reply cannot tell)."""
    keys = list(sent)
    for key in keys[keys.index(layer.bias_key) + 1:]:
        if np.ndim(sent[key]) >= 2:
            return None
        if key.endswith("running_mean") and np.shape(sent[key]) == (layer.shape[0],):
            prefix = key[: -len("running_mean")]
            moved = [_moved(sent, returned, prefix + name)
                     for name in ("num_batches_tracked", "running_mean", "running_var")]
            train = None if all(v is None for v in moved) else any(bool(v) for v in moved)
            return prefix.rstrip(".") or key, train
    return None


def _moved(sent: Mapping[str, np.ndarray], returned: Mapping[str, np.ndarray],
           key: str) -> bool | None:
    """Whether the array ``key`` differs between the two states (``None``: not in both)."""
    if key not in sent or key not in returned:
        return None
    return not np.array_equal(np.asarray(sent[key]), np.asarray(returned[key]))


def _bias_still(sent: Mapping[str, np.ndarray], returned: Mapping[str, np.ndarray],
                layer: LayerChoice) -> bool:
    """Whether, on every unit whose weights moved, the bias moved by at most
    :data:`STILL_RATIO` of that unit's largest weight change (float rounding of a cancelled
    gradient, not a gradient)."""
    if layer.weight_key not in returned or layer.bias_key not in returned:
        return False
    dw = np.abs(np.asarray(sent[layer.weight_key], np.float64)
                - np.asarray(returned[layer.weight_key], np.float64)).max(axis=1)
    db = np.abs(np.asarray(sent[layer.bias_key], np.float64)
                - np.asarray(returned[layer.bias_key], np.float64))
    live = dw > 0
    return bool(live.any() and np.all(db[live] <= STILL_RATIO * dw[live]))
