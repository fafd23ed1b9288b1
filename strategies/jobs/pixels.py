"""From exact features to pictures inside an attack job (SPEAR §6.4, ``fl_attack.pixels``).

When the attacked layer is not the model's first (a CNN's first linear layer), SPEAR recovers
that layer's *input features*, exactly and with the same certificate; pictures need the layers
before it. A job built with the user's model (``jobs.model_plan``) carries a :class:`PixelTask`:
the model and the weights the server sent it (so the layers before the attacked one can run),
the update of those layers, the input shape and the box the normalisation puts pixels in. After
the attack, :func:`run_pixels` inverts the recovered features into images with
:func:`fl_attack.pixels.invert_features`, using each sample's gradient flowing back into those
layers (from the exact ∂L/∂Z) where the update is one gradient step. The pixels are an
estimate: the report says what is exact (features) and what is not (pixels).

Only plain data and the model travel in the job (the model must pickle: a class importable in
the worker, as Flower apps' models are).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True)
class PixelTask:
    """What the pixel step needs besides the recovered features."""

    model: Any = field(repr=False)
    """An ``nn.Module`` (copied, then loaded with :attr:`sent`) or a zero-argument factory."""
    sent: dict[str, np.ndarray] = field(repr=False)
    """Every array the server sent the client (the weights the client started from)."""
    updates: dict[str, np.ndarray] = field(repr=False)
    """``W0 - W_E`` of the parameters used before the attacked layer, by state-dict name."""
    weight_key: str
    input_shape: tuple[int, int, int]
    bounds: tuple[tuple[float, ...], tuple[float, ...]]
    """Per-channel box ``(lo, hi)`` that pixels in ``[0, 1]`` occupy in the model's input space."""
    max_seconds: float = 60.0
    restarts: int = 4
    seed: int = 0
    norm_returned: dict[str, np.ndarray] = field(default_factory=dict, repr=False)
    """The running statistics the client returned (``...running_mean``, ``...running_var``,
    ``...num_batches_tracked``): where the batch statistics of its BatchNorms are read."""


@dataclass(frozen=True)
class PixelOutcome:
    """The pixel step's result: images in the model's input space, and how well they fit."""

    images: np.ndarray | None = field(default=None, repr=False)
    """``(B, C, H, W)``, rows in the order of the recovered features."""
    feature_residual: list[float] | None = None
    """Per sample ``‖f(x̂) − F‖ / ‖F‖``: how well the pictures' own features match the
    recovered ones (no ground truth needed; 0 is a perfect fit, not a perfect picture)."""
    seconds: float = 0.0
    terms: tuple[str, ...] = ()
    budget_exhausted: bool = False
    error: str | None = None
    batch_statistics: str | None = None
    """How the model's BatchNorms were set to the batch's statistics (``None``: it has none)."""


def build_model(spec: Any) -> Any:
    """A fresh ``nn.Module`` from ``spec``: a copy of an instance, or what a class or factory
    without arguments builds; ``ValueError`` when that is no ``nn.Module``."""
    import torch

    model = copy.deepcopy(spec) if isinstance(spec, torch.nn.Module) else spec()
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"model must be an nn.Module or build one, got {type(model).__name__}")
    return model


def load_model(spec: Any, state: Mapping[str, np.ndarray]) -> Any:
    """A fresh model of ``spec`` (instance or factory) holding the weights ``state``."""
    import torch

    model = build_model(spec)
    tensors = {k: torch.as_tensor(np.array(v)) for k, v in state.items()}
    model.load_state_dict(tensors, strict=True)
    return model.float().eval()


def run_pixels(task: PixelTask, features: np.ndarray, weight_grad: np.ndarray | None,
               weight: np.ndarray) -> PixelOutcome:
    """Invert ``features`` (B, n) into images; ``weight_grad`` (the attacked layer's update,
    one gradient step) adds each sample's known upstream gradient, ``None`` leaves it out.
    Never raises: a failure is the outcome's ``error``."""
    t0 = time.perf_counter()
    try:
        return _invert(task, features, weight_grad, weight, t0)
    except Exception as exc:  # noqa: BLE001 - pixels are an extra; the features stand
        return PixelOutcome(seconds=time.perf_counter() - t0,
                            error=f"pixels: {type(exc).__name__}: {exc}")


def _invert(task: PixelTask, features: np.ndarray, weight_grad: np.ndarray | None,
            weight: np.ndarray, t0: float) -> PixelOutcome:
    import torch

    from fl_attack.model.split import feature_extractor
    from fl_attack.pixels import feature_gradients, invert_features

    model = load_model(task.model, task.sent)
    extractor = feature_extractor(model, task.weight_key)
    norms = set_batch_statistics(model, extractor, task, len(features))
    params = dict(model.named_parameters())
    grads = {k: torch.as_tensor(v, dtype=torch.float32) for k, v in task.updates.items()
             if k in params}
    upstream = None
    if weight_grad is not None and grads:
        upstream = feature_gradients(weight_grad, features, weight).float()
    left = max(task.max_seconds - (time.perf_counter() - t0), 1.0)
    rec = invert_features(
        torch.as_tensor(features, dtype=torch.float32), extractor,
        input_shape=task.input_shape, bounds=task.bounds, upstream=upstream,
        param_grads=grads if upstream is not None else None, max_seconds=left,
        restarts=task.restarts, seed=task.seed, device="cpu")
    return PixelOutcome(rec.images.double().numpy(),
                        [float(v) for v in rec.feature_residual.sqrt()],
                        time.perf_counter() - t0, tuple(rec.terms), bool(rec.budget_exhausted),
                        batch_statistics=norms)


def set_batch_statistics(model: Any, extractor: Any, task: PixelTask, rows: int) -> str | None:
    """Give each BatchNorm before the attacked layer the statistics the client's batch was
    normalised with, read off the running statistics it returned; say how (``None``: none).

    In train mode a BatchNorm normalises with the batch's own mean and variance, which the
    server never sees; it also folds them into its running statistics, which the client sends
    back. After k steps with momentum μ, ``r_k = (1-μ)^k r_0 + Σ_j μ (1-μ)^(k-j) s_j``, so
    ``(r_k - (1-μ)^k r_0) / (1 - (1-μ)^k)`` is the batch's statistic for k = 1, exactly (the
    running variance is the unbiased one over n = B·H·W values per channel; the forward pass
    divides by n), and a weighted mean of the k batches' otherwise, an estimate. The model
    then runs in eval mode with these as its running statistics, so for one step its features
    are those of the client's forward pass. A norm whose statistics did not move normalised
    with the ones sent (frozen) and keeps them. ``ValueError`` for a BatchNorm without running
    statistics (it normalises whatever batch it is given: the client's is unknown).
    """
    import torch

    norms = {m: name for name, m in model.named_modules()
             if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)}
    counts = _values_per_channel(extractor, task.input_shape, list(norms))
    words = []
    for module, name in norms.items():
        if module not in counts:  # after the attacked layer: the features never see it
            continue
        if module.running_mean is None or module.running_var is None:
            raise ValueError(f"the BatchNorm {name} keeps no running statistics, so the batch "
                             "statistics it normalised with are unknown to the server")
        words.append(f"{name}: " + _batch_statistic(module, name, task.norm_returned,
                                                    rows * counts[module]))
    return None if not words else "; ".join(words)


def _values_per_channel(extractor: Any, input_shape: tuple[int, int, int],
                        modules: list[Any]) -> dict[Any, int]:
    """Per sample, how many values each of ``modules`` normalises per channel (H·W, or 1),
    for the modules the forward pass up to the attacked layer runs."""
    import torch

    seen: dict[Any, int] = {}

    def hook(module: Any, args: tuple[Any, ...]) -> None:
        seen[module] = int(np.prod(args[0].shape[2:]))

    handles = [m.register_forward_pre_hook(hook) for m in modules]
    try:
        with torch.no_grad():
            extractor(torch.zeros(1, *input_shape))
    finally:
        for handle in handles:
            handle.remove()
    return seen


def _batch_statistic(module: Any, name: str, returned: Mapping[str, np.ndarray],
                     n: int) -> str:
    """Set ``module``'s running statistics to the batch's (see :func:`set_batch_statistics`);
    the words that say how (``n``: values per channel in one batch)."""
    import torch

    prefix = f"{name}." if name else ""
    mean, var = returned.get(prefix + "running_mean"), returned.get(prefix + "running_var")
    if mean is None or var is None:
        return "the statistics sent (the reply holds none of its own)"
    new_m, new_v = (torch.as_tensor(np.asarray(v, np.float64)) for v in (mean, var))
    old_m, old_v = module.running_mean.double(), module.running_var.double()
    count = returned.get(prefix + "num_batches_tracked")
    old_count = module.num_batches_tracked
    if count is not None and old_count is not None:
        steps = int(round(float(np.asarray(count)) - float(old_count)))
    else:
        steps = int(not (torch.equal(new_m, old_m) and torch.equal(new_v, old_v)))
    if steps <= 0:
        return "frozen statistics (they did not move), as sent"
    if module.momentum is None:  # a cumulative average over num_batches_tracked batches
        total = float(np.asarray(count)) if count is not None else float(steps)
        mix = (total - steps) / total
    else:
        mix = (1.0 - float(module.momentum)) ** steps
    batch_m = (new_m - mix * old_m) / (1.0 - mix)
    batch_v = (new_v - mix * old_v) / (1.0 - mix)
    if steps == 1 and n > 1:
        batch_v = batch_v * (n - 1) / n
    module.running_mean.copy_(batch_m.to(module.running_mean))
    module.running_var.copy_(batch_v.clamp_min(0.0).to(module.running_var))
    if steps == 1:
        return ("the batch's own mean and variance, recovered exactly from the running "
                "statistics the client returned (one step)")
    return (f"the mean of {steps} steps' batch statistics, estimated from the running "
            "statistics the client returned (not the last batch's own)")
