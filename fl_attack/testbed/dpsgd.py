"""Per-sample DP-SGD with Opacus (SPEAR App. E.6): clipping, Gaussian noise, RDP accounting.

Two engines give the same update:

* ``"opacus"``: Opacus' ``GradSampleModule`` + ``DPOptimizer``. It materialises every sample's
  gradient, B × (#parameters) floats: about 27 GB for B = 150 and ``relu_mlp(3072, 4000, 3)``
  (44 M parameters), more than a small machine has.
* ``"ghost"``: Opacus' ghost clipping (``GradSampleModuleFastGradientClipping`` +
  ``DPOptimizerFastGradientClipping``): the same per-sample norms from the layers' activations
  and output gradients, without the per-sample gradients, then one backward pass of the
  clipped-weighted loss.

``"auto"`` (:func:`choose_engine`) takes ghost clipping where the per-sample gradients would need
more than :data:`GHOST_ABOVE_BYTES`. Both clip the flat per-sample gradient over all parameters
(factor ``min(1, C / (‖g_i‖ + 1e-6))``), add noise of std ``noise_multiplier · C`` to the summed
gradient from a generator seeded with ``seed`` (reproducible, ``secure_mode=False``), divide by
the batch size, and account ε with the RDP accountant on :data:`RDP_ALPHAS`.

Opacus' ``PrivacyEngine.make_private`` is not used because it wants a DataLoader and swaps in
Poisson sampling; a client here trains on exactly its batch, so the pieces ``make_private``
assembles are assembled directly.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["ENGINES", "GHOST_ABOVE_BYTES", "RDP_ALPHAS", "DpTraining", "choose_engine",
           "epsilon", "train"]

ENGINES: tuple[str, ...] = ("auto", "opacus", "ghost")
GHOST_ABOVE_BYTES = 2 * 1024**3
"""``engine="auto"`` takes ghost clipping when per-sample gradients would need more bytes."""

#: RDP orders for the accountant: Opacus' default grid (1.1 .. 63) widened at both ends. Audits
#: use tiny noise multipliers (the optimal order is then close to 1) as well as large ones
#: (optimal order above 63); a wider grid gives a tighter, honest epsilon in both regimes.
RDP_ALPHAS: list[float] = (
    [1.0 + x / 100.0 for x in range(1, 10)]
    + [1.0 + x / 10.0 for x in range(1, 100)]
    + [float(a) for a in range(12, 64)]
    + [float(a) for a in (80, 100, 128, 160, 200, 256, 400, 512, 1024, 4096)]
)

# Warnings silenced (all expected here, none signals a problem with this use):
# * "Optimal order is the {smallest,largest} alpha" from the RDP accountant: audits use extreme
#   noise multipliers on purpose (the grid is already widened); epsilon is still an upper bound.
# * torch's "Full backward hook is firing when gradients are computed with respect to module
#   outputs since no inputs require gradients", once per step from the hooks Opacus puts on the
#   first layer: the client's data never requires gradients, and Opacus only needs the gradient
#   with respect to the module output there.
_HOOK_WARNING = r"Full backward hook is firing"
_ALPHA_WARNING = r".*Optimal order is the.*alpha.*"


@dataclass(frozen=True)
class DpTraining:
    """What DP-SGD local training produced: the weights, the steps and the accounting."""

    state_dict: dict[str, Tensor]
    steps: int
    epsilon: float
    """ε spent for the given δ; ``inf`` without noise (clipping alone guarantees nothing)."""
    noise_std: float
    """Std of the noise on the *averaged* gradient of one step: ``σ · C / batch``."""
    engine: str


def choose_engine(model: nn.Module, batch_size: int, requested: str = "auto") -> str:
    """``"opacus"`` or ``"ghost"``: ``requested`` unless it is ``"auto"`` (see the module)."""
    if requested not in ENGINES:
        raise ValueError(f"unknown DP-SGD engine {requested!r}; expected one of {ENGINES}")
    if requested != "auto":
        return requested
    n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    need = batch_size * n_params * torch.finfo(torch.float32).bits // 8
    return "ghost" if need > GHOST_ABOVE_BYTES else "opacus"


def epsilon(noise_multiplier: float, sample_rate: float, steps: int, delta: float) -> float:
    """ε of ``steps`` Gaussian-mechanism steps at ``sample_rate`` for ``delta`` (Opacus RDP)."""
    from opacus.accountants import RDPAccountant

    if noise_multiplier == 0:
        return math.inf
    accountant = RDPAccountant()
    for _ in range(steps):
        accountant.step(noise_multiplier=noise_multiplier, sample_rate=sample_rate)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_ALPHA_WARNING)
        return float(accountant.get_epsilon(delta=delta, alphas=RDP_ALPHAS))


def train(local: nn.Module, x: Tensor, y: Tensor, batches: Sequence[Sequence[Tensor]], *,
          lr: float, max_grad_norm: float, noise_multiplier: float, delta: float,
          sample_rate: float, seed: int, engine: str = "auto") -> DpTraining:
    """DP-SGD on ``local`` (modified in place) over ``batches`` (one list of index tensors per
    epoch), with the chosen engine.

    The expected batch size (noise scaling, accountant) is the largest batch; ``sample_rate`` is
    the accountant's probability that an example is in a step's batch.
    """
    eff_batch = max(int(idx.numel()) for epoch in batches for idx in epoch)
    used = choose_engine(local, eff_batch, engine)
    noise_gen = torch.Generator(device=x.device).manual_seed(seed)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_HOOK_WARNING)
        module, optimizer, loss_fn = _assemble(used, local, lr, max_grad_norm, noise_multiplier,
                                               eff_batch, noise_gen)
        steps = 0
        for epoch in batches:
            for idx in epoch:
                optimizer.zero_grad(set_to_none=True)
                loss_fn(module(x[idx]), y[idx]).backward()
                optimizer.step()
                steps += 1
        optimizer.zero_grad(set_to_none=True)
        module.remove_hooks()
    return DpTraining(_finite_state(local), steps,
                      epsilon(noise_multiplier, sample_rate, steps, delta),
                      noise_multiplier * max_grad_norm / eff_batch, used)


def _assemble(engine: str, local: nn.Module, lr: float, clip: float, noise_multiplier: float,
              batch: int, generator: torch.Generator) -> tuple[Any, Any, Any]:
    """The wrapped module, the DP optimizer and the loss of one engine."""
    common = dict(noise_multiplier=noise_multiplier, max_grad_norm=clip,
                  expected_batch_size=batch, loss_reduction="mean", generator=generator,
                  secure_mode=False)
    if engine == "opacus":
        from opacus import GradSampleModule
        from opacus.optimizers import DPOptimizer

        gsm = GradSampleModule(local, batch_first=True, loss_reduction="mean")
        optimizer = DPOptimizer(torch.optim.SGD(gsm.parameters(), lr=lr), **common)
        return gsm, optimizer, nn.CrossEntropyLoss(reduction="mean")
    from opacus.grad_sample import GradSampleModuleFastGradientClipping
    from opacus.optimizers import DPOptimizerFastGradientClipping
    from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping

    gsm = GradSampleModuleFastGradientClipping(local, batch_first=True, loss_reduction="mean",
                                               max_grad_norm=clip, use_ghost_clipping=True)
    optimizer = DPOptimizerFastGradientClipping(torch.optim.SGD(gsm.parameters(), lr=lr),
                                                **common)
    loss = DPLossFastGradientClipping(gsm, optimizer, nn.CrossEntropyLoss(),
                                      loss_reduction="mean")
    return gsm, optimizer, loss


def _finite_state(local: nn.Module) -> dict[str, Tensor]:
    """The trained weights (Opacus wraps the module in place), checked for NaN/Inf."""
    state = {k: v.detach().to("cpu", copy=True) for k, v in local.state_dict().items()}
    for k, v in state.items():
        if not bool(torch.isfinite(v).all()):
            raise ValueError(f"DP-SGD produced non-finite weights in {k!r} (lr too large?)")
    return state
