"""Reading a client's training reply: is it aggregatable, what does it say, what is attacked.

:func:`corrupt_reason` checks what FedAvg relies on; :func:`build_job` turns the arrays the
server sent and the arrays the client returned into a picklable :class:`AttackJob` (the attacked
layer's update pair, and the next layer's weight update) that any executor can run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord

from fl_attack_flwr.settings import AttackSettings
from fl_attack_flwr.wire import CLIENT_INFO_KEY, PARTITION_ID_KEY, SAMPLE_INDICES_KEY

__all__ = [
    "AttackJob",
    "LayerChoice",
    "build_job",
    "choose_layer",
    "client_info",
    "corrupt_reason",
    "metric",
    "partition_id",
    "sample_indices",
    "strip_ground_truth",
]


@dataclass(frozen=True)
class LayerChoice:
    """The attacked layer of a model's state dict.

    ``first_is_linear`` is False when a non-linear-layer weight (a convolution, an embedding)
    comes before it: the reconstruction is then that layer's input *features*, not the raw input.
    """

    weight_key: str
    bias_key: str
    shape: tuple[int, int]
    first_is_linear: bool
    next_weight_key: str | None = None


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
    """A ``pixel_step.PixelTask`` when the reconstructed features are to become pictures."""
    num_examples: int | None = None
    """The samples the reply says the client trained on (an upper bound of the batch size)."""


def choose_layer(state: dict[str, np.ndarray], weight_key: str | None = None,
                 bias_key: str | None = None) -> LayerChoice:
    """The layer to attack: ``weight_key`` when given, else the first linear layer with a bias.

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


def build_job(server_round: int, node_id: int, label: str, sent: dict[str, np.ndarray],
              returned: dict[str, np.ndarray], layer: LayerChoice,
              settings: AttackSettings) -> AttackJob:
    """The attack job of one reply (``ValueError`` when there is nothing to attack)."""
    from fl_attack.model.updates import weight_update_pair

    dw, db, w0, b0 = weight_update_pair(sent, returned, weight_key=layer.weight_key,
                                        bias_key=layer.bias_key)
    readings = settings.readings()
    dw2 = None
    if settings.next_layer and layer.next_weight_key is not None and "gradient" in readings:
        dw2 = _next_layer_update(sent, returned, layer)
    return AttackJob(server_round, node_id, label, dw.numpy(), db.numpy(), w0.numpy(),
                     b0.numpy(), dw2, readings, settings.invert_kwargs(),
                     settings.memory_limit_gb)


def _next_layer_update(sent: dict[str, np.ndarray], returned: dict[str, np.ndarray],
                       layer: LayerChoice) -> np.ndarray | None:
    """``W0 - W_E`` of the layer the attacked one feeds, if it takes its outputs."""
    from fl_attack.model.updates import weight_update_pair

    try:
        dw2, *_ = weight_update_pair(sent, returned, weight_key=layer.next_weight_key)
    except ValueError:
        return None
    return dw2.numpy() if dw2.shape[1] == layer.shape[0] else None


def _weight_of(metrics: MetricRecord, key: str) -> float | None:
    value = metrics.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) and value > 0 else None


def corrupt_reason(reply: Message, global_arrays: ArrayRecord | None,
                   weighted_by_key: str = "num-examples") -> str | None:
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
        missing = sorted(set(global_arrays.keys()) - set(record.keys()))
        extra = sorted(set(record.keys()) - set(global_arrays.keys()))
        if missing:
            return f"missing arrays {missing}"
        if extra:
            return f"unexpected arrays {extra}"
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


def _array_problem(key: str, arr: Any, global_arrays: ArrayRecord | None) -> str | None:
    try:
        value = arr.numpy()
    except Exception as exc:  # noqa: BLE001 - undecodable payload
        return f"array {key!r} cannot be decoded: {exc}"
    if global_arrays is not None:
        want = tuple(global_arrays[key].shape)
        if tuple(value.shape) != want:
            return f"array {key!r} has shape {tuple(value.shape)}, expected {want}"
    real = np.issubdtype(value.dtype, np.number) and not np.iscomplexobj(value)
    if not (real or value.dtype == np.bool_):  # FedAvg's weighted sum takes ints and bools
        return f"array {key!r} is not real numeric (dtype {value.dtype})"
    if not np.isfinite(value).all():
        return f"array {key!r} contains NaN or inf"
    return None


def client_info(reply: Message) -> ConfigRecord | None:
    """The reply's ``client-info`` ConfigRecord (the plugin's own clients send one)."""
    if reply.has_content() and CLIENT_INFO_KEY in reply.content.config_records:
        return reply.content.config_records[CLIENT_INFO_KEY]
    return None


def partition_id(reply: Message) -> int | None:
    """The client's partition id, from ``client-info`` or a metric of that name."""
    info = client_info(reply)
    sources = ([info] if info is not None else []) + (
        list(reply.content.metric_records.values()) if reply.has_content() else [])
    for source in sources:
        value = source.get(PARTITION_ID_KEY)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return int(value)
    return None


def sample_indices(reply: Message) -> list[int] | None:
    """The audit-mode ground truth: indices of the samples the client trained on."""
    info = client_info(reply)
    values = None if info is None else info.get(SAMPLE_INDICES_KEY)
    return [int(v) for v in values] if values else None


def strip_ground_truth(reply: Message) -> None:
    """Remove the audit-only sample indices before the wrapped strategy sees the reply."""
    info = client_info(reply)
    if info is not None and SAMPLE_INDICES_KEY in info:
        del info[SAMPLE_INDICES_KEY]


def metric(reply: Message, key: str) -> float | None:
    """A numeric metric of the reply, or ``None``."""
    if not reply.has_content():
        return None
    for record in reply.content.metric_records.values():
        value = record.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return None
