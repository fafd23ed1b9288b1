"""What one federated client does locally: FedSGD, FedAvg or per-sample DP-SGD (Opacus).

This module is framework-free (torch + Opacus only) so that the experiments and the Flower
ClientApp run *the same* local training. The server-side attack never sees the client's data; it
only sees the weights the client sends back (see :mod:`fl_attack.updates`), so what matters here is
that the local training is exactly what a real client runs:

* ``fedsgd``: one SGD step of the mean cross-entropy on the whole batch, so ``W0 - W1 = lr * grad``.
* ``fedavg``: ``epochs`` passes of plain SGD over mini-batches (SPEAR App. F); the weight delta
  keeps the low-rank structure of the first-layer gradient.
* ``dpsgd``: real per-sample DP-SGD with Opacus (``GradSampleModule`` + ``DPOptimizer``):
  per-sample clipping at ``max_grad_norm``, Gaussian noise of std ``noise_multiplier *
  max_grad_norm`` on the summed gradient, and (epsilon, delta) from Opacus' RDP accountant
  (SPEAR App. E.6). Batches are fixed (no Poisson sampling) so the client uses exactly its data.
"""

from __future__ import annotations

import copy
import math
import numbers
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

__all__ = [
    "PROTOCOLS",
    "LocalTrainingResult",
    "local_update",
    "noise_multiplier_for_std",
]

PROTOCOLS: tuple[str, ...] = ("fedsgd", "fedavg", "dpsgd")

# RDP orders for the accountant: Opacus' default grid (1.1 .. 63) widened at both ends. Audits use
# tiny noise multipliers (the optimal order is then close to 1) as well as large ones (optimal
# order above 63); a wider grid gives a tighter, honest epsilon in both regimes.
_RDP_ALPHAS: list[float] = (
    [1.0 + x / 100.0 for x in range(1, 10)]
    + [1.0 + x / 10.0 for x in range(1, 100)]
    + [float(a) for a in range(12, 64)]
    + [float(a) for a in (80, 100, 128, 160, 200, 256, 400, 512, 1024, 4096)]
)


@dataclass
class LocalTrainingResult:
    """Outcome of one client's local training.

    Attributes:
        state_dict: the model's weights after local training (detached CPU clones), i.e. what the
            client sends back to the server.
        num_examples: number of local examples (FedAvg aggregation weight).
        steps: optimiser steps taken.
        epsilon: DP-SGD only: epsilon spent for ``delta`` (Opacus RDP accountant); ``inf`` when
            ``noise_multiplier == 0`` (clipping alone gives no DP guarantee). ``None`` otherwise.
        delta: DP-SGD only: the delta ``epsilon`` is quoted for.
        noise_std: DP-SGD only: std of the Gaussian noise on the *averaged* gradient of one step,
            ``noise_multiplier * max_grad_norm / batch_size`` (the scale the papers quote).
    """

    state_dict: dict[str, Tensor]
    num_examples: int
    steps: int
    epsilon: float | None = None
    delta: float | None = None
    noise_std: float | None = None


def noise_multiplier_for_std(std: float, max_grad_norm: float, batch_size: int) -> float:
    """Noise multiplier giving Gaussian noise of absolute std ``std`` on the averaged gradient.

    The papers (SPEAR App. E.6) quote DP noise as the absolute std on the (mean) gradient,
    whereas Opacus takes a multiplier of the clipping norm on the *summed* gradient:
    ``std = noise_multiplier * max_grad_norm / batch_size``.
    """
    if not math.isfinite(std) or std < 0:
        raise ValueError(f"std must be finite and >= 0, got {std}")
    if not math.isfinite(max_grad_norm) or max_grad_norm <= 0:
        raise ValueError(f"max_grad_norm must be finite and > 0, got {max_grad_norm}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    return float(std) * batch_size / float(max_grad_norm)


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _validate(
    model: nn.Module,
    inputs: Tensor,
    labels: Tensor,
    protocol: str,
    lr: float,
    epochs: int,
    batch_size: int | None,
    max_grad_norm: float | None,
    noise_multiplier: float,
    delta: float,
    sample_rate: float | None,
) -> None:
    if protocol not in PROTOCOLS:
        raise ValueError(f"unknown protocol {protocol!r}; expected one of {PROTOCOLS}")
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be an nn.Module, got {type(model).__name__}")
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError("model has no trainable parameters")
    if not isinstance(inputs, Tensor) or not isinstance(labels, Tensor):
        raise ValueError("inputs and labels must be torch tensors")
    if inputs.ndim < 1 or inputs.shape[0] == 0:
        raise ValueError(f"inputs must hold at least one example, got shape {tuple(inputs.shape)}")
    if labels.ndim != 1:
        raise ValueError(f"labels must be 1-d class indices, got shape {tuple(labels.shape)}")
    if inputs.shape[0] != labels.shape[0]:
        raise ValueError(
            f"inputs and labels lengths differ: {inputs.shape[0]} inputs vs "
            f"{labels.shape[0]} labels"
        )
    if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
        raise ValueError(f"labels must be integer class indices, got dtype {labels.dtype}")
    if not inputs.dtype.is_floating_point:
        raise ValueError(f"inputs must be floating point, got dtype {inputs.dtype}")
    if not bool(torch.isfinite(inputs).all()):
        raise ValueError("inputs contain non-finite values (NaN or inf)")
    if not _is_real(lr) or not math.isfinite(lr) or lr <= 0:
        raise ValueError(f"lr must be finite and > 0, got {lr!r}")
    if not _is_int(epochs) or epochs < 1:
        raise ValueError(f"epochs must be an int >= 1, got {epochs!r}")
    if batch_size is not None and (not _is_int(batch_size) or batch_size < 1):
        raise ValueError(f"batch_size must be None or an int >= 1, got {batch_size!r}")
    n = inputs.shape[0]
    if protocol == "fedsgd" and (epochs != 1 or (batch_size is not None and batch_size != n)):
        raise ValueError(
            "protocol 'fedsgd' is a single full-batch step (epochs=1, batch_size=None); "
            f"got epochs={epochs}, batch_size={batch_size}: use protocol='fedavg'"
        )
    if protocol != "dpsgd":
        if max_grad_norm is not None or noise_multiplier != 0:
            raise ValueError(
                f"max_grad_norm / noise_multiplier are only used by protocol='dpsgd', "
                f"not {protocol!r} (got max_grad_norm={max_grad_norm}, "
                f"noise_multiplier={noise_multiplier})"
            )
        return
    if max_grad_norm is None:
        raise ValueError("protocol 'dpsgd' requires max_grad_norm (the per-sample clipping norm)")
    if not _is_real(max_grad_norm) or not math.isfinite(max_grad_norm) or max_grad_norm <= 0:
        raise ValueError(f"max_grad_norm must be finite and > 0, got {max_grad_norm!r}")
    nm = noise_multiplier
    if not _is_real(nm) or not math.isfinite(nm) or nm < 0:
        raise ValueError(f"noise_multiplier must be finite and >= 0, got {noise_multiplier!r}")
    if not _is_real(delta) or not (0 < delta < 1):
        raise ValueError(f"delta must lie in (0, 1), got {delta!r}")
    if sample_rate is not None and (not _is_real(sample_rate) or not (0 < sample_rate <= 1)):
        raise ValueError(f"sample_rate must lie in (0, 1], got {sample_rate}")


def _batches(n: int, batch_size: int | None, generator: torch.Generator) -> list[Tensor]:
    """Index sets of one epoch: one full batch, or a seeded shuffle cut into mini-batches."""
    if batch_size is None or batch_size >= n:
        return [torch.arange(n)]
    perm = torch.randperm(n, generator=generator)
    return list(perm.split(batch_size))


def _state(model: nn.Module) -> dict[str, Tensor]:
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


def local_update(
    model: nn.Module,
    inputs: Tensor,
    labels: Tensor,
    *,
    protocol: str = "fedsgd",
    lr: float = 0.01,
    epochs: int = 1,
    batch_size: int | None = None,
    max_grad_norm: float | None = None,
    noise_multiplier: float = 0.0,
    delta: float = 1e-5,
    sample_rate: float | None = None,
    seed: int = 0,
) -> LocalTrainingResult:
    """Run one client's local training from the global ``model`` and return the new weights.

    The passed ``model`` is never modified (it is deep-copied), so the caller keeps the global
    weights ``W0`` to form the update ``W0 - W_E`` (:func:`fl_attack.updates.weight_update_pair`).
    Training runs on the model's device and dtype (inputs are cast to it).

    Args:
        model: global model (e.g. ``fl_attack.models.relu_mlp``), in its state at round start.
        inputs: the client's examples, shape ``(N, ...)``, as the model takes them.
        labels: integer class labels, shape ``(N,)``.
        protocol: ``"fedsgd"`` (one full-batch step), ``"fedavg"`` (``epochs`` of mini-batch
            SGD) or ``"dpsgd"`` (per-sample DP-SGD with Opacus).
        lr: SGD learning rate (> 0).
        epochs: local epochs (fedavg / dpsgd; must be 1 for fedsgd).
        batch_size: mini-batch size (None = full batch; fedavg / dpsgd). Mini-batches come from a
            seeded shuffle per epoch; the last one may be smaller.
        max_grad_norm: per-sample clipping norm ``C`` (required for dpsgd, rejected otherwise).
        noise_multiplier: Gaussian noise std on the summed gradient in units of ``C`` (dpsgd;
            0 = clipping only). See :func:`noise_multiplier_for_std`.
        delta: the delta epsilon is reported for (dpsgd).
        sample_rate: sampling rate for the accountant (dpsgd): the probability that an example is
            in a step's batch, e.g. the client's batch size over the population it was drawn from.
            Default ``batch_size / N`` (1.0 for full-batch steps).
        seed: seeds the mini-batch shuffle and the DP noise, so runs are reproducible.

    Returns:
        :class:`LocalTrainingResult` with the trained weights and, for dpsgd, the DP accounting.

    Raises:
        ValueError: unknown protocol, mismatched lengths, non-finite inputs, non-positive lr,
            dpsgd without ``max_grad_norm``, DP arguments for a non-DP protocol, ...
    """
    _validate(
        model, inputs, labels, protocol, lr, epochs, batch_size, max_grad_norm,
        noise_multiplier, delta, sample_rate,
    )
    lr, epochs = float(lr), int(epochs)
    batch_size = None if batch_size is None else int(batch_size)
    n = int(inputs.shape[0])
    local = copy.deepcopy(model)
    local.train()
    ref = next(p for p in local.parameters())
    x = inputs.detach().to(device=ref.device, dtype=ref.dtype)
    y = labels.detach().to(device=ref.device, dtype=torch.long)
    shuffle = torch.Generator().manual_seed(int(seed))

    if protocol == "dpsgd":
        assert max_grad_norm is not None  # checked by _validate
        return _dpsgd(
            local, x, y, lr=lr, epochs=epochs, batch_size=batch_size,
            max_grad_norm=float(max_grad_norm), noise_multiplier=float(noise_multiplier),
            delta=float(delta), sample_rate=sample_rate, seed=int(seed), shuffle=shuffle,
        )

    optimizer = torch.optim.SGD(local.parameters(), lr=lr)
    loss_fn = nn.CrossEntropyLoss()
    steps = 0
    n_epochs = 1 if protocol == "fedsgd" else epochs
    for _ in range(n_epochs):
        for idx in _batches(n, None if protocol == "fedsgd" else batch_size, shuffle):
            optimizer.zero_grad(set_to_none=True)
            loss_fn(local(x[idx]), y[idx]).backward()
            optimizer.step()
            steps += 1
    return LocalTrainingResult(state_dict=_state(local), num_examples=n, steps=steps)


def _dpsgd(
    local: nn.Module,
    x: Tensor,
    y: Tensor,
    *,
    lr: float,
    epochs: int,
    batch_size: int | None,
    max_grad_norm: float,
    noise_multiplier: float,
    delta: float,
    sample_rate: float | None,
    seed: int,
    shuffle: torch.Generator,
) -> LocalTrainingResult:
    """Per-sample DP-SGD with Opacus' own GradSampleModule, DPOptimizer and RDP accountant.

    Opacus' ``PrivacyEngine.make_private`` is not used because it wants a DataLoader and swaps in
    Poisson sampling; the client here must train on exactly its batch, so the three
    pieces ``make_private`` assembles are assembled directly (``secure_mode=False``, seeded noise).

    Warnings silenced (all expected here, none signals a problem with this use):
      * ``"Optimal order is the {smallest,largest} alpha"`` from the RDP accountant: audits use
        extreme noise multipliers on purpose (the alpha grid is already widened, see
        ``_RDP_ALPHAS``); epsilon is still a valid upper bound.
      * torch's ``"Full backward hook is firing when gradients are computed with respect to module
        outputs since no inputs require gradients"``, raised once per step by the hooks Opacus puts
        on the first layer: the client's data never requires gradients, and Opacus only needs the
        gradient w.r.t. the module output there, so this is exactly the intended behaviour.
    (PrivacyEngine's ``"Secure RNG turned off"`` warning does not arise: PrivacyEngine is not used;
    ``secure_mode=False`` is deliberate so that the noise is reproducible from ``seed``.)
    """
    from opacus import GradSampleModule
    from opacus.accountants import RDPAccountant
    from opacus.optimizers import DPOptimizer

    n = int(x.shape[0])
    eff_batch = n if batch_size is None else min(batch_size, n)
    q = float(sample_rate) if sample_rate is not None else eff_batch / n
    noise_gen = torch.Generator(device=x.device).manual_seed(seed)

    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=r"Full backward hook is firing when gradients are computed"
        )
        gsm = GradSampleModule(local, batch_first=True, loss_reduction="mean")
        optimizer = DPOptimizer(
            torch.optim.SGD(gsm.parameters(), lr=lr),
            noise_multiplier=noise_multiplier,
            max_grad_norm=max_grad_norm,
            expected_batch_size=eff_batch,
            loss_reduction="mean",
            generator=noise_gen,
            secure_mode=False,
        )
        accountant = RDPAccountant()
        loss_fn = nn.CrossEntropyLoss(reduction="mean")
        steps = 0
        for _ in range(epochs):
            for idx in _batches(n, batch_size, shuffle):
                optimizer.zero_grad(set_to_none=True)
                loss_fn(gsm(x[idx]), y[idx]).backward()
                optimizer.step()
                accountant.step(noise_multiplier=noise_multiplier, sample_rate=q)
                steps += 1
        optimizer.zero_grad(set_to_none=True)
        gsm.remove_hooks()

    return LocalTrainingResult(
        state_dict=_finite_state(local),
        num_examples=n,
        steps=steps,
        epsilon=_epsilon(accountant, noise_multiplier, delta),
        delta=delta,
        noise_std=noise_multiplier * max_grad_norm / eff_batch,
    )


def _epsilon(accountant: Any, noise_multiplier: float, delta: float) -> float:
    """The ε spent for ``delta`` (inf without noise: clipping alone guarantees nothing)."""
    if noise_multiplier == 0:
        return math.inf
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*Optimal order is the.*alpha.*")
        return float(accountant.get_epsilon(delta=delta, alphas=_RDP_ALPHAS))


def _finite_state(local: nn.Module) -> dict[str, Tensor]:
    """The trained weights (Opacus wraps the module in place), checked for NaN/Inf."""
    state = _state(local)
    for k, v in state.items():
        if not bool(torch.isfinite(v).all()):
            raise ValueError(f"DP-SGD produced non-finite weights in {k!r} (lr too large?)")
    return state
