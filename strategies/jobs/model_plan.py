"""The user's model as the server reads it, once per attacked layer: what follows the layer
(for ``jobs.layers``), the model's input shape, and the
:class:`~fl_attack_flwr.jobs.pixels.PixelTask` a job carries when the attacked layer's inputs
are features (SPEAR §6.4).

``AuditingStrategy(..., model=Net)`` gives the audit the clients' model; the intake asks
:class:`ModelPlan` for each layer's :class:`LayerPlan` and each job's pixel task.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from fl_attack_flwr.jobs.pixels import PixelTask, load_model

#: The buffers a BatchNorm keeps its running statistics in.
_RUNNING = ("running_mean", "running_var", "num_batches_tracked")

#: Image sizes tried when the model's input shape is neither given nor known from a dataset.
_SIDES = (32, 28, 64, 224, 96, 128, 16, 256)


def model_input_shape(model: Any, weight_key: str, in_features: int,
                      channels: int | None = None) -> tuple[int, int, int] | None:
    """The square image shape whose forward pass gives the attacked layer ``in_features``
    inputs per sample (tried on common sizes; ``None`` when none fits)."""
    import torch

    from fl_attack.model.split import feature_extractor

    if channels is None:
        conv = next((m for m in model.modules() if isinstance(m, torch.nn.Conv2d)), None)
        channels = 3 if conv is None else int(conv.in_channels)
    extract = feature_extractor(model, weight_key)
    for side in _SIDES:
        try:
            with torch.no_grad():
                n = extract(torch.zeros(1, channels, side, side)).shape
        except (RuntimeError, ValueError):
            continue
        if tuple(n) == (1, in_features):
            return channels, side, side
    return None


def pixel_task(spec: Any, sent: Mapping[str, np.ndarray], returned: Mapping[str, np.ndarray],
               weight_key: str, input_shape: tuple[int, int, int],
               bounds: tuple[tuple[float, ...], tuple[float, ...]], *, max_seconds: float,
               seed: int) -> PixelTask:
    """The job's pixel task: the update of every float array the model uses before the
    attacked layer (by state-dict order) goes with it."""
    keys = list(sent)
    before = keys[: keys.index(weight_key)]
    updates = {k: np.asarray(sent[k], np.float64) - np.asarray(returned[k], np.float64)
               for k in before if np.issubdtype(np.asarray(sent[k]).dtype, np.floating)
               and np.ndim(sent[k]) >= 1}
    stats = {k: np.array(v) for k, v in returned.items() if k.endswith(_RUNNING)}
    return PixelTask(spec, {k: np.array(v) for k, v in sent.items()}, updates, weight_key,
                     tuple(int(s) for s in input_shape), bounds, float(max_seconds),
                     seed=int(seed), norm_returned=stats)


@dataclass(frozen=True)
class LayerPlan:
    """What the server knows about the attacked layer from the user's model."""

    weight_key: str
    relu_after: bool | None
    """The layer's output goes straight into a ReLU (``None``: the model did not trace)."""
    after: str | None
    norm_before: bool | None
    input_shape: tuple[int, int, int] | None
    """The model's input shape (given, or found by :func:`model_input_shape`)."""
    error: str | None = None
    """Why the model could not be used (it does not load the sent weights, ...)."""


class ModelPlan:
    """The user's model, read once per attacked layer (the layer's surroundings, the input
    shape), and the pixel tasks of the jobs that attack it."""

    def __init__(self, spec: Any, *, input_shape: tuple[int, int, int] | None,
                 bounds: tuple[tuple[float, ...], tuple[float, ...]] | None,
                 max_seconds: float = 60.0) -> None:
        self.spec, self.input_shape, self.bounds = spec, input_shape, bounds
        self.max_seconds = float(max_seconds)
        self._layers: dict[str, LayerPlan] = {}

    def layer(self, weight_key: str, sent: Mapping[str, np.ndarray]) -> LayerPlan:
        """The plan of the layer ``weight_key`` (cached)."""
        if weight_key not in self._layers:
            self._layers[weight_key] = self._read(weight_key, sent)
        return self._layers[weight_key]

    def _read(self, weight_key: str, sent: Mapping[str, np.ndarray]) -> LayerPlan:
        from fl_attack.model.split import layer_context

        try:
            model = load_model(self.spec, sent)
            ctx = layer_context(model, weight_key)
            n = int(np.shape(sent[weight_key])[1])
            shape = self.input_shape or model_input_shape(model, weight_key, n)
        except Exception as exc:  # noqa: BLE001 - a model that does not fit is reported
            return LayerPlan(weight_key, None, None, None, None,
                             error=f"the model given to the audit does not fit the update: "
                                   f"{type(exc).__name__}: {exc}")
        return LayerPlan(weight_key, ctx.relu_after, ctx.after, ctx.norm_before, shape)

    def task(self, plan: LayerPlan, sent: Mapping[str, np.ndarray],
             returned: Mapping[str, np.ndarray], seed: int) -> PixelTask | None:
        """The pixel task of one job (``None`` when the input shape is unknown)."""
        if plan.input_shape is None or plan.error is not None:
            return None
        channels = plan.input_shape[0]
        bounds = self.bounds or ((-3.0,) * channels, (3.0,) * channels)
        return pixel_task(self.spec, sent, returned, plan.weight_key, plan.input_shape,
                          bounds, max_seconds=self.max_seconds, seed=seed)
