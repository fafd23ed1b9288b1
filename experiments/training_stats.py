"""What training does to a layer's update, from the batch's true ∂L/∂Z (ground truth that only
a benchmark has): the statistics ``experiments.bench_training`` reports beside the attack.

A trained model changes the structure the attack relies on (SPEAR App. E.4): units become
active for every sample (dense rows of ∂L/∂Z) or for none, columns keep fewer zeros, the
per-sample gradients spread over orders of magnitude (confidently classified samples
contribute little), and two samples may differ on few units.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from fl_attack.testbed import models

ROUNDING = 2.0 ** -23
"""A sample whose gradient contribution ‖∂L/∂z_k‖ ‖x_k‖ is below this share of the batch's
largest is below the float32 rounding of the update: no attack reads it from the update."""


@dataclass(frozen=True)
class UpdateStats:
    """The structure of one batch's first-layer update."""

    spread: float
    """Largest over smallest per-sample gradient contribution ‖∂L/∂z_k‖ ‖x_k‖."""
    zeros_min: int
    zeros_median: float
    """Zeros per column of ∂L/∂Z (of the layer's m units)."""
    always_on: int
    """Units active for every sample of the batch."""
    always_off: int
    """Units active for no sample."""
    closest: int
    """The fewest units on which two samples' activation patterns differ."""
    below_rounding: torch.Tensor
    """(B,) bool: samples whose contribution is below :data:`ROUNDING` of the largest."""


def output_grad(model: nn.Module, xn: torch.Tensor, y: torch.Tensor,
                layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(m, B) ∂L/∂Z of ``linear_layers(model)[layer]`` for the batch's mean cross-entropy,
    and (m, B) its pre-activations Z."""
    lin = models.linear_layers(model)[layer]
    outs: list[torch.Tensor] = []
    hook = lin.register_forward_hook(lambda _m, _a, out: outs.append(out))
    try:
        with torch.enable_grad():
            loss = nn.functional.cross_entropy(model(xn), y)
            (D,) = torch.autograd.grad(loss, outs[0])
    finally:
        hook.remove()
    return D.detach().double().T, outs[0].detach().double().T


def update_stats(model: nn.Module, xn: torch.Tensor, y: torch.Tensor,
                 grads: tuple[torch.Tensor, torch.Tensor] | None = None) -> UpdateStats:
    """:class:`UpdateStats` of the first linear layer's update of the batch ``xn``, ``y``
    (its inputs are the pixels of an MLP, the features of a CNN's ``fc1``); ``grads`` is
    :func:`output_grad` of the batch when the caller already has it."""
    D, Z = output_grad(model, xn, y) if grads is None else grads
    X = models.layer_inputs(model, xn).double()
    contrib = D.norm(dim=0) * X.norm(dim=1)
    top = float(contrib.max())
    active = Z > 0
    zeros = (D == 0).sum(dim=0)
    diff = (active[:, :, None] != active[:, None, :]).sum(dim=0)
    diff.fill_diagonal_(active.shape[0] + 1)
    return UpdateStats(
        spread=top / max(float(contrib.min()), torch.finfo(torch.float64).tiny),
        zeros_min=int(zeros.min()), zeros_median=float(zeros.double().median()),
        always_on=int(active.all(dim=1).sum()), always_off=int((~active).all(dim=1).sum()),
        closest=int(diff.min()), below_rounding=contrib < ROUNDING * top)
