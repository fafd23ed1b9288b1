"""Pixels from features: invert a network's first layers given the features SPEAR recovered.

The objective, per candidate batch ``x̂`` (one per restart), is

``Σ_i ‖f(x̂_i) − F_i‖² / ‖F_i‖²  +  τ_s · TV(x̂)  [+  γ · Σ_θ ‖Σ_i J_θ(x̂_i)ᵀ u_i − g_θ‖² / ‖g_θ‖²]``

subject to the box the normalisation maps [0, 1] pixels into. The first term is the feature
inversion of SPEAR §6.4 and of the Cocktail Party Attack (Kariyappa et al., ICML 2023); the
second the total-variation prior of Inverting Gradients (Geiping et al., NeurIPS 2020), with
colour variation weighted more (:func:`~fl_attack.pixels.terms.total_variation`); the third,
optional, the per-sample gradient consistency with the known upstream gradient
(:func:`~fl_attack.pixels.terms.gradient_mismatch`). The images are optimised coarse to fine
(:attr:`PixelConfig.scales`): a low-resolution image, bilinearly upsampled, first fits the
coarse layout the pooled features pin down, then finer stages add detail; TV decays
geometrically from stage to stage. Every restart of every sample is one row of one tensor,
optimised with one Adam; each sample keeps the restart whose features fit best, which needs
no ground truth. The choices and their weights come from the measurements in
``experiments/results/cnn.md`` (photos32 only).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from fl_attack.pixels.terms import feature_residuals, gradient_mismatch, total_variation

__all__ = ["PixelConfig", "PixelReconstruction", "invert_features"]

Bound = float | Sequence[float] | Tensor


@dataclass(frozen=True)
class PixelConfig:
    """The optimiser and the weights of the objective's terms (tuned on photos32)."""

    scales: tuple[int, ...] = (4, 2, 1)
    """Downsampling factor of each stage, coarse to fine (1: full resolution)."""
    lr: float = 0.05
    """Adam's step, in half box widths."""
    tv: float = 0.2
    """Total-variation weight at the first stage (images divided by the box width)."""
    tv_end: float = 0.04
    """Total-variation weight at the last stage; geometric in between."""
    chroma: float = 10.0
    """Weight of colour variation relative to luminance in TV (three channels)."""
    gradient: float = 0.0
    """Weight of the gradient-consistency term when ``upstream`` and ``param_grads`` are given
    (0: not used; at the same wall-clock budget it did not pay for its cost, see cnn.md)."""
    gradient_from: int = 1
    """First stage (index into ``scales``) that uses the gradient term."""
    steps: int | None = None
    """Steps per stage; None: each stage runs for its share of ``max_seconds``."""
    check_every: int = 10
    """Steps between looks at the clock."""
    init_std: float = 0.5
    """Standard deviation of the random start, in half box widths, around the box centre."""


@dataclass(frozen=True)
class PixelReconstruction:
    """Images recovered from features (:func:`invert_features`)."""

    images: Tensor
    """(B, C, H, W) float32 on the CPU, in the model's input space, rows in the order of the
    features."""
    feature_residual: Tensor
    """(B,) float64: ``‖f(x̂_i) − F_i‖ / ‖F_i‖`` of the kept restart (no ground truth needed)."""
    seconds: float
    restarts: int
    terms: tuple[str, ...]
    """The objective's terms that were used."""
    steps: int
    """Optimiser steps over all stages."""
    budget_exhausted: bool
    """True when the clock, not ``PixelConfig.steps``, ended a stage (then the result depends
    on the machine's speed)."""
    chosen: Tensor
    """(B,) int64: the restart kept for each sample."""


@dataclass
class _Problem:
    """Everything one step needs, on the device."""

    target: Tensor
    extractor: Callable[[Tensor], Tensor]
    lo: Tensor
    hi: Tensor
    shape: tuple[int, int, int]
    cfg: PixelConfig
    upstream: Tensor | None = None
    params: list[Tensor] = dataclasses.field(default_factory=list)
    observed: list[Tensor] = dataclasses.field(default_factory=list)
    norms: list[Tensor] = dataclasses.field(default_factory=list)

    @property
    def uses_gradient(self) -> bool:
        return self.upstream is not None and self.cfg.gradient > 0

    def full(self, u: Tensor) -> Tensor:
        """The full-resolution images of the stage's parameters (bilinear upsampling)."""
        if tuple(u.shape[-2:]) == self.shape[1:]:
            return u
        return F.interpolate(u, size=self.shape[1:], mode="bilinear", align_corners=False)

    def loss(self, u: Tensor, stage: int) -> Tensor:
        """The objective of all restarts, summed (restarts are independent)."""
        x = self.full(u)
        feats = self.extractor(x)
        n_stages = len(self.cfg.scales)
        tv_w = 0.0
        if self.cfg.tv > 0 and self.cfg.tv_end > 0:
            tv_w = self.cfg.tv * (self.cfg.tv_end / self.cfg.tv) ** (stage / max(1, n_stages - 1))
        loss = feature_residuals(feats, self.target).sum()
        if tv_w > 0:
            loss = loss + tv_w * total_variation(x, self.hi - self.lo, self.cfg.chroma).sum()
        if self.uses_gradient and stage >= self.cfg.gradient_from:
            assert self.upstream is not None
            mismatch = gradient_mismatch(feats, self.upstream, self.params, self.observed,
                                         self.norms)
            loss = loss + self.cfg.gradient * mismatch.sum()
        return loss

    def residuals(self, u: Tensor) -> Tensor:
        """``‖f(x̂) − F‖ / ‖F‖`` per image, (R * B,)."""
        with torch.no_grad():
            return feature_residuals(self.extractor(self.full(u)), self.target).sqrt()


def _box(bounds: tuple[Bound, Bound], channels: int, device: torch.device
         ) -> tuple[Tensor, Tensor]:
    """``(lo, hi)`` as (C, 1, 1) tensors; scalars or one value per channel."""
    out = []
    for value in bounds:
        t = torch.as_tensor(value, dtype=torch.float32).flatten()
        if t.numel() == 1:
            t = t.expand(channels)
        if t.numel() != channels or not bool(torch.isfinite(t).all()):
            raise ValueError(f"bounds must be finite scalars or {channels} values each, "
                             f"got {bounds!r}")
        out.append(t.reshape(channels, 1, 1).to(device))
    lo, hi = out
    if not bool((hi > lo).all()):
        raise ValueError(f"bounds need lo < hi, got {bounds!r}")
    return lo, hi


def _device(device: str | torch.device | None, extractor: object,
            params: Mapping[str, Tensor] | None) -> torch.device:
    """``device``, else where the parameters (or the extractor's model) live, else the CPU."""
    if device is not None:
        return torch.device(device)
    if params:
        return next(iter(params.values())).device
    model = getattr(extractor, "model", None)
    first = next(model.parameters(), None) if isinstance(model, torch.nn.Module) else None
    return first.device if first is not None else torch.device("cpu")


def _gradient_inputs(problem: _Problem, features: Tensor, upstream: Tensor | None,
                     param_grads: Mapping[str, Tensor] | None,
                     params: Mapping[str, Tensor] | None, extractor: object) -> None:
    """Check and attach the gradient-consistency inputs (upstream, parameters, observed)."""
    if (upstream is None) != (param_grads is None):
        raise ValueError("pass upstream and param_grads together (or neither)")
    if upstream is None or param_grads is None:
        return
    if tuple(upstream.shape) != tuple(features.shape):
        raise ValueError(f"upstream must have the features' shape {tuple(features.shape)}, "
                         f"got {tuple(upstream.shape)}")
    if params is None:
        model = getattr(extractor, "model", None)
        if not isinstance(model, torch.nn.Module):
            raise ValueError("param_grads needs params (or an extractor with a .model)")
        params = dict(model.named_parameters())
    for key, grad in param_grads.items():
        p = params.get(key)
        if p is None or tuple(p.shape) != tuple(grad.shape) or not p.requires_grad:
            raise ValueError(f"param_grads[{key!r}] has no matching parameter that requires "
                             "grad in params")
        observed = torch.as_tensor(grad).detach().to(p.device, p.dtype)
        problem.params.append(p)
        problem.observed.append(observed)
        problem.norms.append(observed.pow(2).sum().clamp_min(1e-30))
    problem.upstream = torch.as_tensor(upstream).detach().to(problem.target)


def _problem(features: Tensor, extractor: Callable[[Tensor], Tensor],
             input_shape: tuple[int, int, int], bounds: tuple[Bound, Bound],
             device: torch.device, cfg: PixelConfig) -> _Problem:
    """Check the shapes and the box; the features as float32 on the device."""
    if features.ndim != 2 or len(tuple(input_shape)) != 3:
        raise ValueError(f"features must be (B, n) and input_shape (C, H, W); got "
                         f"{tuple(features.shape)} and {input_shape!r}")
    if not cfg.scales or any(int(f) != f or f < 1 for f in cfg.scales):
        raise ValueError(f"PixelConfig.scales must be positive integers, got {cfg.scales!r}")
    c, h, w = (int(v) for v in input_shape)
    lo, hi = _box(bounds, c, device)
    target = features.detach().to(device, torch.float32)
    return _Problem(target, extractor, lo, hi, (c, h, w), cfg)


def _stage_size(shape: tuple[int, int, int], factor: int) -> tuple[int, int]:
    return (max(1, math.ceil(shape[1] / factor)), max(1, math.ceil(shape[2] / factor)))


def _run_stage(problem: _Problem, u: Tensor, stage: int, deadline: float,
               device: torch.device) -> tuple[Tensor, int, bool]:
    """Adam on the stage's images until ``PixelConfig.steps`` or the stage's deadline.

    Returns the images, the steps taken and whether the clock ended the stage. The box is
    kept by projection after each step (bilinear upsampling keeps it too).
    """
    cfg = problem.cfg
    u = u.detach().requires_grad_(True)
    half = float((problem.hi - problem.lo).mean()) / 2
    opt = torch.optim.Adam([u], lr=cfg.lr * half)
    steps = 0
    while cfg.steps is None or steps < cfg.steps:
        (grad,) = torch.autograd.grad(problem.loss(u, stage), [u])
        u.grad = grad
        opt.step()
        with torch.no_grad():
            torch.maximum(torch.minimum(u, problem.hi), problem.lo, out=u)
        steps += 1
        if steps % cfg.check_every == 0:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if time.perf_counter() > deadline:
                return u.detach(), steps, cfg.steps is None or steps < cfg.steps
    return u.detach(), steps, False


def invert_features(
    features: Tensor,
    extractor: Callable[[Tensor], Tensor],
    *,
    input_shape: tuple[int, int, int],
    bounds: tuple[Bound, Bound],
    upstream: Tensor | None = None,
    param_grads: Mapping[str, Tensor] | None = None,
    params: Mapping[str, Tensor] | None = None,
    max_seconds: float = 30.0,
    restarts: int = 4,
    seed: int = 0,
    device: str | torch.device | None = None,
    config: PixelConfig | None = None,
) -> PixelReconstruction:
    """Recover images whose features are ``features`` (SPEAR §6.4's feature inversion).

    Parameters
    ----------
    features : (B, n) tensor
        The attacked linear layer's inputs, e.g. ``fl_attack.invert(...).inputs``.
    extractor : callable
        ``images (N, C, H, W) -> (N, n)`` with autograd, e.g.
        :func:`fl_attack.model.split.feature_extractor`; it must run on ``device``.
    input_shape : (C, H, W)
        One image's shape in the model's input space.
    bounds : (lo, hi)
        The box pixels of [0, 1] occupy after the normalisation (scalars or one value per
        channel), e.g. ``(-1, 1)`` for mean 0.5 / std 0.5.
    upstream : (B, n) tensor, optional
        Each sample's ``∂L/∂features`` (:func:`fl_attack.pixels.upstream.feature_gradients`),
        rows in the order of ``features``; with ``param_grads`` enables the gradient term.
    param_grads : dict of str to tensor, optional
        Observed summed gradient (or weight update, matching ``upstream``'s factor) of
        parameters used before the attacked layer, by name.
    params : dict of str to tensor, optional
        The parameters those names refer to, as the extractor uses them; default: the
        extractor's ``model.named_parameters()``.
    max_seconds : float
        Wall-clock budget; each stage gets an equal share.
    restarts : int
        Random starts per sample, optimised together as one (restarts x B) batch.
    seed : int
        Seeds the starts (drawn on the CPU): same seed, same machine, same result, as long as
        ``PixelConfig.steps`` (not the clock) ends the stages.
    device : str or torch.device, optional
        Default: where ``params`` or the extractor's model live, else the CPU.
    config : PixelConfig, optional
        Schedule and weights (default :class:`PixelConfig`).

    Returns
    -------
    PixelReconstruction

    Raises
    ------
    ValueError
        Wrong shapes, bounds with lo >= hi, a non-positive budget or restart count, or
        ``upstream`` / ``param_grads`` given alone or not matching the parameters.
    """
    start = time.perf_counter()
    if not max_seconds > 0 or int(restarts) != restarts or restarts < 1:
        raise ValueError(f"need max_seconds > 0 and restarts >= 1, got {max_seconds}, {restarts}")
    dev = _device(device, extractor, params)
    problem = _problem(features, extractor, input_shape, bounds, dev, config or PixelConfig())
    _gradient_inputs(problem, features, upstream, param_grads, params, extractor)
    cfg, shape, lo, hi = problem.cfg, problem.shape, problem.lo, problem.hi
    gen = torch.Generator().manual_seed(int(seed))
    size = _stage_size(shape, cfg.scales[0])
    noise = torch.randn(int(restarts) * features.shape[0], shape[0], *size, generator=gen)
    u = ((lo + hi) / 2 + noise.to(dev) * cfg.init_std * (hi - lo) / 2).clamp(lo, hi)
    total, exhausted = 0, False
    for stage, factor in enumerate(cfg.scales):
        if stage:
            u = F.interpolate(u, size=_stage_size(shape, factor), mode="bilinear",
                              align_corners=False)
        deadline = start + max_seconds * (stage + 1) / len(cfg.scales)
        u, steps, clocked = _run_stage(problem, u, stage, deadline, dev)
        total, exhausted = total + steps, exhausted or clocked
    return _best_restart(problem, u, int(restarts), start, total, exhausted)


def _best_restart(problem: _Problem, u: Tensor, restarts: int, start: float, steps: int,
                  exhausted: bool) -> PixelReconstruction:
    """Keep each sample's restart with the smallest feature residual."""
    b = problem.target.shape[0]
    res = problem.residuals(u).view(restarts, b)
    chosen = res.argmin(0)
    images = problem.full(u).view(restarts, b, *problem.shape)[chosen, torch.arange(b)]
    terms = ["features", "box", "multiscale" if len(problem.cfg.scales) > 1 else "single-scale"]
    if problem.cfg.tv > 0:
        terms.append("tv")
    if problem.uses_gradient:
        terms.append("gradient")
    return PixelReconstruction(
        images=images.detach().to("cpu", torch.float32),
        feature_residual=res.min(0).values.detach().to("cpu", torch.float64),
        seconds=time.perf_counter() - start, restarts=restarts, terms=tuple(terms),
        steps=steps, budget_exhausted=exhausted, chosen=chosen.to("cpu"))
