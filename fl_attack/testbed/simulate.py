"""What one federated client does locally: FedSGD, FedAvg or per-sample DP-SGD (Opacus).

This module is framework-free (torch + Opacus only) so that the experiments and the Flower
ClientApp run *the same* local training. The server-side attack never sees the client's data; it
only sees the weights the client sends back (see :mod:`fl_attack.model.updates`), so what
matters here is that the local training is exactly what a real client runs:

* ``fedsgd``: one SGD step of the mean cross-entropy on the whole batch, so ``W0 - W1 = lr * grad``.
* ``fedavg``: ``epochs`` passes of plain SGD over mini-batches (SPEAR App. F); the weight delta
  keeps the low-rank structure of the first-layer gradient.
* ``dpsgd``: real per-sample DP-SGD with Opacus (:mod:`fl_attack.testbed.dpsgd`): per-sample
  clipping at ``max_grad_norm``, Gaussian noise of std ``noise_multiplier * max_grad_norm`` on
  the summed gradient, and (epsilon, delta) from Opacus' RDP accountant (SPEAR App. E.6).
  Batches are fixed (no Poisson sampling) so the client uses exactly its data.
"""

from __future__ import annotations

import copy
import math
import numbers
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from fl_attack.testbed import dpsgd

__all__ = [
    "PROTOCOLS",
    "LocalTrainingResult",
    "local_update",
    "noise_multiplier_for_std",
]

PROTOCOLS: tuple[str, ...] = ("fedsgd", "fedavg", "dpsgd")

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
    dp_engine: str = "auto",
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
    if dp_engine not in dpsgd.ENGINES:
        raise ValueError(f"unknown dp_engine {dp_engine!r}; expected one of {dpsgd.ENGINES}")


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
    dp_engine: str = "auto",
) -> LocalTrainingResult:
    """Run one client's local training from the global ``model`` and return the new weights.

    The passed ``model`` is never modified (it is deep-copied), so the caller keeps the global
    weights ``W0`` to form the update ``W0 - W_E``
    (:func:`fl_attack.model.updates.weight_update_pair`).
    Training runs on the model's device and dtype (inputs are cast to it).

    Args:
        model: global model (e.g. ``testbed.models.relu_mlp``), in its state at round start.
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
        dp_engine: dpsgd: ``"opacus"`` (per-sample gradients), ``"ghost"`` (ghost clipping, the
            same update in far less memory) or ``"auto"`` (ghost where per-sample gradients
            would need more than 2 GiB); see :mod:`fl_attack.testbed.dpsgd`.

    Returns:
        :class:`LocalTrainingResult` with the trained weights and, for dpsgd, the DP accounting.

    Raises:
        ValueError: unknown protocol, mismatched lengths, non-finite inputs, non-positive lr,
            dpsgd without ``max_grad_norm``, DP arguments for a non-DP protocol, ...
    """
    _validate(
        model, inputs, labels, protocol, lr, epochs, batch_size, max_grad_norm,
        noise_multiplier, delta, sample_rate, dp_engine,
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
    if protocol == "fedsgd":
        epochs, batch_size = 1, None
    batches = [_batches(n, batch_size, shuffle) for _ in range(epochs)]
    if protocol != "dpsgd":
        return LocalTrainingResult(state_dict=_sgd(local, x, y, batches, lr), num_examples=n,
                                   steps=sum(len(epoch) for epoch in batches))
    assert max_grad_norm is not None  # checked by _validate
    rate = sample_rate if sample_rate is not None else min(batch_size or n, n) / n
    dp = dpsgd.train(local, x, y, batches, lr=lr, max_grad_norm=float(max_grad_norm),
                     noise_multiplier=float(noise_multiplier), delta=float(delta),
                     sample_rate=float(rate), seed=int(seed), engine=dp_engine)
    return LocalTrainingResult(state_dict=dp.state_dict, num_examples=n, steps=dp.steps,
                               epsilon=dp.epsilon, delta=float(delta), noise_std=dp.noise_std)


def _sgd(local: nn.Module, x: Tensor, y: Tensor, batches: list[list[Tensor]],
         lr: float) -> dict[str, Tensor]:
    """Plain SGD on the mean cross-entropy over ``batches`` (one list per epoch)."""
    optimizer = torch.optim.SGD(local.parameters(), lr=lr)
    loss_fn = nn.CrossEntropyLoss()
    for epoch in batches:
        for idx in epoch:
            optimizer.zero_grad(set_to_none=True)
            loss_fn(local(x[idx]), y[idx]).backward()
            optimizer.step()
    return _state(local)
