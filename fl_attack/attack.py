"""The one-call entry point: ``invert`` a linear layer's gradient (or weight update).

The pipeline behind it, step by step with the papers' sections, is described in
``docs/algorithm.md``: the output side in :mod:`fl_attack.levels`, the input side in
:mod:`fl_attack.input_layer`, both driven by the search loop of :mod:`fl_attack.loop`.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from fl_attack import input_layer, levels
from fl_attack.clock import Clock
from fl_attack.config import AttackConfig
from fl_attack.result import Reconstruction, certified
from fl_attack.tolerances import noisy_update, tolerances
from fl_attack.validation import load_layer

__all__ = ["Reconstruction", "certified", "invert", "noisy_update", "tolerances"]


def invert(
    weight_grad: torch.Tensor | np.ndarray,
    bias_grad: torch.Tensor | np.ndarray,
    *,
    weight: torch.Tensor | np.ndarray | None = None,
    bias: torch.Tensor | np.ndarray | None = None,
    method: str = "spear++",
    seed: int = 0,
    device: str | torch.device | None = None,
    config: AttackConfig | None = None,
    next_weight_grad: torch.Tensor | np.ndarray | None = None,
    **options: Any,
) -> Reconstruction:
    """Recover the batch that produced a linear layer's gradient (SPEAR / SPEAR++).

    ``weight_grad`` (m, n) and ``bias_grad`` (m,) are ∂L/∂W and ∂L/∂b of ``nn.Linear(n, m)``, or a
    weight update ``W₀ - W_E``, ``b₀ - b_E`` (FedAvg; the learning rate cancels). ``weight`` and
    ``bias`` (the layer's parameters the client started from) enable the sparsity-matching
    certificate λ and the greedy selection; without them the result is never marked exact.
    Options are the fields of :class:`AttackConfig` (unknown names raise ``TypeError``).

    ``next_weight_grad`` (k, m), the weight gradient of the linear layer that this layer's ReLU
    feeds (same batch, same step), lets found samples be recovered and verified one by one and
    taken off the gradient, so the rest is searched as a smaller batch (``fl_attack.peel``;
    beyond the papers, which use one layer). Needs ``weight`` and ``bias``; clean FedSGD
    gradients only (not ``update="fedavg"``; ignored when noise is detected).
    """
    start = time.perf_counter()
    cfg = AttackConfig.from_options(config, method=method, **options)
    layer = load_layer(weight_grad, bias_grad, weight, bias, next_weight_grad, device, cfg)
    clock = Clock(cfg.max_seconds, start=start)
    if cfg.sparse == "input":  # the layer's inputs are the sparse factor (SPEAR §3.2)
        return input_layer.invert_inputs(layer, cfg, seed, clock)
    if cfg.sparse == "auto":
        return input_layer.invert_auto(layer, cfg, seed, clock)
    return levels.invert_output(layer, cfg, seed, clock)
