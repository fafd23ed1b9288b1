"""The baselines a pixel reconstruction from features is compared with.

* :func:`gradient_matching` -- Inverting Gradients (Geiping, Bauermeister, Dröge, Moeller,
  *Inverting Gradients -- How easy is it to break privacy in federated learning?*,
  NeurIPS 2020): Adam on the pixels of a whole candidate batch, minimising the cosine
  distance between the gradient of all layers the candidates produce and the observed update,
  plus total variation, inside the box of the normalisation, with the step size divided by 10
  at 3/8, 5/8 and 7/8 of the run (their schedule, here over the wall-clock budget). It is given
  the batch's *true labels* (a generous baseline: iDLG-style inference from the last bias only
  tells which classes occur, not how often).
* :func:`batch_mean` -- every sample "reconstructed" as the mean image of the true batch: an
  oracle-ish floor that an informative reconstruction must beat.

Both run with the same restarts and wall-clock budget as the method they are compared with.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fl_attack.pixels.terms import total_variation

__all__ = ["BaselineResult", "batch_mean", "gradient_matching"]

_DECAY = (3 / 8, 5 / 8, 7 / 8)


@dataclass(frozen=True)
class BaselineResult:
    """Images from a baseline and what it cost."""

    images: Tensor
    """(B, C, H, W) float32 on the CPU, in the model's input space."""
    seconds: float
    steps: int
    chosen: int
    """The restart kept (smallest gradient distance)."""


def _cosine_distances(model: nn.Module, x: Tensor, labels: Tensor, observed: list[Tensor],
                      create_graph: bool) -> Tensor:
    """``1 − cos(∇θ L(x̂), g)`` over all parameters, one value per restart (rows of ``x``)."""
    params = [p for p in model.parameters() if p.requires_grad]
    b = labels.shape[0]
    g_norm = torch.sqrt(sum(o.pow(2).sum() for o in observed))
    out = []
    for chunk in x.split(b):
        loss = F.cross_entropy(model(chunk), labels)
        grads = torch.autograd.grad(loss, params, create_graph=create_graph)
        dot = sum((g * o).sum() for g, o in zip(grads, observed, strict=True))
        norm = torch.sqrt(sum(g.pow(2).sum() for g in grads))
        out.append(1 - dot / (norm * g_norm).clamp_min(1e-30))
    return torch.stack(out)


def gradient_matching(
    model: nn.Module,
    update: Mapping[str, Tensor],
    labels: Tensor,
    *,
    input_shape: tuple[int, int, int],
    bounds: tuple[float, float],
    max_seconds: float = 30.0,
    restarts: int = 4,
    seed: int = 0,
    tv: float = 2e-2,
    lr: float = 0.1,
    device: str | torch.device = "cpu",
) -> BaselineResult:
    """Inverting Gradients on the full update of every layer (Geiping et al. 2020).

    Parameters
    ----------
    model : nn.Module
        The global model the client started from (copied; not modified).
    update : dict of str to tensor
        ``before − after`` of every named parameter (the learning rate cancels in the cosine).
    labels : (B,) tensor
        The batch's true labels (the generous choice, see the module docstring).
    input_shape, bounds
        One image's shape and the box of the model's input space.
    max_seconds, restarts, seed, device
        As :func:`fl_attack.pixels.invert_features`, so that both get the same budget.
    tv, lr : float
        Total-variation weight (on images divided by the box width) and Adam's step; tv chosen
        on photos32 among 2e-2 and 2e-1 (the paper's 1e-1 on images in [-1, 1]), lr the
        paper's.

    Returns
    -------
    BaselineResult
        The restart with the smallest final gradient distance.
    """
    start = time.perf_counter()
    net = copy.deepcopy(model).to(device)
    names = [k for k, p in net.named_parameters() if p.requires_grad]
    observed = [torch.as_tensor(update[k]).to(device, torch.float32) for k in names]
    y = labels.to(device, torch.long)
    lo, hi = float(bounds[0]), float(bounds[1])
    scale = torch.full((input_shape[0], 1, 1), hi - lo, device=device)
    gen = torch.Generator().manual_seed(int(seed))
    x = torch.randn(restarts * y.shape[0], *input_shape, generator=gen).to(device)
    x = x.clamp(lo, hi).requires_grad_(True)
    opt = torch.optim.Adam([x], lr=lr)
    steps, decayed = 0, 0
    while time.perf_counter() < start + max_seconds:
        while decayed < len(_DECAY) and time.perf_counter() > start + _DECAY[decayed] * max_seconds:
            for group in opt.param_groups:
                group["lr"] *= 0.1
            decayed += 1
        loss = _cosine_distances(net, x, y, observed, True).sum()
        loss = loss + tv * total_variation(x, scale, 1.0).sum()
        (x.grad,) = torch.autograd.grad(loss, [x])
        opt.step()
        with torch.no_grad():
            x.clamp_(lo, hi)
        steps += 1
    dist = _cosine_distances(net, x.detach(), y, observed, False)
    best = int(dist.argmin())
    images = x.detach().view(restarts, y.shape[0], *input_shape)[best]
    return BaselineResult(images.to("cpu", torch.float32), time.perf_counter() - start, steps,
                          best)


def batch_mean(images: Tensor) -> Tensor:
    """Every sample replaced by the batch's mean image (same shape as ``images``)."""
    return images.mean(0, keepdim=True).expand_as(images).clone()
