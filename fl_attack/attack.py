"""The one-call entry point: ``invert`` a linear layer's gradient (or weight update).

The pipeline behind it, step by step with the papers' sections, is described in
``docs/algorithm.md``: the output side in :mod:`fl_attack.solver.output_side`, the input side
in :mod:`fl_attack.solver.input_side`, both driven by the search loop of
:mod:`fl_attack.solver.loop`; the choice between the two for ``sparse="auto"`` in
:mod:`fl_attack.solver.both_sides`.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from fl_attack.config import AttackConfig
from fl_attack.core.clock import Clock
from fl_attack.result import Reconstruction
from fl_attack.solver import both_sides, input_side, output_side
from fl_attack.validation import load_layer


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
    next_weight: torch.Tensor | np.ndarray | None = None,
    **options: Any,
) -> Reconstruction:
    """Recover the batch that produced a linear layer's gradient (SPEAR / SPEAR++).

    Parameters
    ----------
    weight_grad : (m, n) tensor or array
        ∂L/∂W of ``nn.Linear(n, m)``, or a weight update ``W₀ - W_E`` (FedAvg, DP-SGD; the
        learning rate cancels).
    bias_grad : (m,) tensor or array
        ∂L/∂b, or ``b₀ - b_E``.
    weight : (m, n), optional
        The layer's weight the client started from; with ``bias`` it enables the
        sparsity-matching certificate λ and the greedy selection (without them the result is
        never marked exact).
    bias : (m,), optional
        The layer's bias (pass both or neither).
    method : {"spear++", "spear"}
        Dictionary learning (polynomial in B) or SPEAR's sampling (exponential in B).
    seed : int
        Seeds the search's random generator (same seed, same machine: same result).
    device : str or torch.device, optional
        Where the search runs; None picks CUDA when available.
    config : AttackConfig, optional
        Base options; ``options`` override its fields.
    next_weight_grad : (k, m), optional
        The weight gradient of the linear layer this layer's ReLU feeds (same batch, same
        step): found samples are then recovered and verified one by one and taken off the
        gradient, so the rest is searched as a smaller batch (``fl_attack.steps.peel``, beyond the
        papers). Needs ``weight`` and ``bias``; clean single-step gradients only.
    next_weight : (k, m), optional
        That layer's weight before the step: with ``weights_dtype``, a weight difference's
        next layer is read above its own stored weights' rounding (docs/algorithm.md step 10).
    **options
        Fields of :class:`AttackConfig` (e.g. ``max_seconds``, ``sparse``, ``update``).

    Returns
    -------
    Reconstruction
        ``inputs`` (B, n) float64 on the CPU in arbitrary order; ``exact`` when certified
        (λ = 1, all B directions, no noise); ``budget_exhausted`` when the time budget
        (``max_seconds``, 120 s by default) ended the search.

    Raises
    ------
    TypeError
        An unknown option, or an argument that is not a real tensor or array.
    ValueError
        An invalid option value, wrong shapes, non-finite gradients, a weight without a bias,
        an unknown or unavailable device, or a ``next_weight_grad`` (or ``next_weight``) that
        cannot belong to this layer. Two subclasses say why the update itself cannot be inverted:
        :class:`fl_attack.errors.NotIdentifiable` (a batch not smaller than the layer, or
        noise that hides it) and :class:`fl_attack.errors.ZeroUpdate` (an all-zero gradient).

    See Also
    --------
    docs/algorithm.md : the pipeline step by step, with the papers' section numbers.
    """
    start = time.perf_counter()
    cfg = AttackConfig.from_options(config, method=method, **options)
    layer = load_layer(weight_grad, bias_grad, weight, bias, next_weight_grad, device, cfg,
                       next_weight=next_weight)
    clock = Clock(cfg.max_seconds, start=start)
    if cfg.sparse == "input":  # the layer's inputs are the sparse factor (SPEAR §3.2)
        return input_side.invert_inputs(layer, cfg, seed, clock)
    if cfg.sparse == "auto":
        return both_sides.invert_auto(layer, cfg, seed, clock)
    return output_side.invert_output(layer, cfg, seed, clock)
