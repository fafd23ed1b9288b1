"""Convolutional models a Flower user trains, their normalisation and their training loop.

:class:`QuickstartNet` is the LeNet-style CNN of Flower's ``quickstart-pytorch`` example
(``Net`` there, with the same attribute names, so a state dict of one loads into the other);
:class:`WideCNN` is a wider CNN whose first linear layer sees more features (64 x 8 x 8 = 4096)
than an image has pixels (3 x 32 x 32 = 3072). SPEAR (§6.4) attacks the first linear layer of
such a network (``fc1``): it recovers that layer's *input features* exactly; turning them back
into pixels is :func:`fl_attack.pixels.invert_features`.

Flower's quickstart normalises every channel with mean 0.5 and std 0.5
(``Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))``), so the model sees pixels in [-1, 1]:
:func:`quickstart_normalize`, :func:`quickstart_denormalize`, :data:`QUICKSTART_BOUNDS`.
Its training loop (:func:`quickstart_train`) is SGD with momentum on the mean cross-entropy
over shuffled mini-batches; :func:`fedsgd_step` is one such step on one batch, returning what
the server sees (the weights it sent and those it gets back).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "QUICKSTART_BOUNDS",
    "QUICKSTART_MEAN",
    "QUICKSTART_STD",
    "QuickstartNet",
    "ServerView",
    "WideCNN",
    "build",
    "fedsgd_step",
    "quickstart_denormalize",
    "quickstart_normalize",
    "quickstart_train",
]

QUICKSTART_MEAN = 0.5
"""Per-channel mean of Flower quickstart's ``Normalize`` (all three channels)."""
QUICKSTART_STD = 0.5
"""Per-channel standard deviation of Flower quickstart's ``Normalize``."""
QUICKSTART_BOUNDS = (-1.0, 1.0)
"""Where pixels of [0, 1] land after the quickstart normalisation: the box the model's inputs
lie in, which an inversion may enforce (``fl_attack.pixels.invert_features(bounds=...)``)."""


class QuickstartNet(nn.Module):
    """Flower ``quickstart-pytorch``'s ``Net``: two 5x5 convolutions, max pooling, three linear
    layers, for 3 x 32 x 32 images (CIFAR-10).

    ``fc1`` (400 -> 120, followed by a ReLU) is the layer SPEAR attacks; its inputs are the
    flattened 16 x 5 x 5 output of the second pooling.
    """

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        """Logits of a batch ``(B, 3, 32, 32)`` of normalised images."""
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.view(-1, 16 * 5 * 5)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


class WideCNN(nn.Module):
    """A wider CNN: 3x3 convolutions 3 -> 32 -> 64 with padding, each followed by ReLU and 2x2
    max pooling, then ``fc1`` (64 x 8 x 8 = 4096 -> 1024, ReLU) and ``fc2`` (1024 -> classes).

    Its first linear layer sees more numbers than the image has pixels, so the features pin the
    pixels down far more than QuickstartNet's 400.
    """

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 32, 3, padding=1)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
        self.pool = nn.MaxPool2d(2, 2)
        self.fc1 = nn.Linear(64 * 8 * 8, 1024)
        self.fc2 = nn.Linear(1024, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        """Logits of a batch ``(B, 3, 32, 32)`` of normalised images."""
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        return self.fc2(x)


_MODELS: dict[str, type[nn.Module]] = {"quickstart": QuickstartNet, "wide": WideCNN}


def build(name: str, *, seed: int | None = None, num_classes: int = 10) -> nn.Module:
    """A fresh ``"quickstart"`` (:class:`QuickstartNet`) or ``"wide"`` (:class:`WideCNN`).

    Parameters
    ----------
    name : {"quickstart", "wide"}
        Which model.
    seed : int, optional
        Draws PyTorch's default initialisation from a private generator state, so the model is
        reproducible and the global random state is left untouched.
    num_classes : int
        Outputs of the last layer.

    Returns
    -------
    nn.Module
        The model in float32 on the CPU, in training mode.
    """
    if name not in _MODELS:
        raise ValueError(f"unknown model {name!r}; expected one of {sorted(_MODELS)}")
    if seed is None:
        return _MODELS[name](num_classes)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(seed))
        return _MODELS[name](num_classes)


def quickstart_normalize(images: Tensor) -> Tensor:
    """Images in [0, 1] to the quickstart's model space: ``(x - 0.5) / 0.5``, in [-1, 1]."""
    return (images - QUICKSTART_MEAN) / QUICKSTART_STD


def quickstart_denormalize(x: Tensor) -> Tensor:
    """Inverse of :func:`quickstart_normalize`: ``x * 0.5 + 0.5`` (not clamped)."""
    return x * QUICKSTART_STD + QUICKSTART_MEAN


def _state(model: nn.Module) -> dict[str, Tensor]:
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


def quickstart_train(
    model: nn.Module,
    images: Tensor,
    labels: Tensor,
    *,
    lr: float = 0.1,
    momentum: float = 0.9,
    batch_size: int = 32,
    epochs: int = 1,
    seed: int = 0,
) -> dict[str, Tensor]:
    """Flower quickstart's local training loop; returns the trained state dict.

    SGD with momentum on the mean cross-entropy, over mini-batches of a seeded shuffle of the
    data each epoch (the last one may be smaller), as the quickstart's ``train`` runs over its
    ``DataLoader(shuffle=True)``. A new optimiser (empty momentum buffer) per call, as Flower
    builds one per round.

    Parameters
    ----------
    model : nn.Module
        The global model; it is not modified (a deep copy trains).
    images : (N, C, H, W) tensor
        Inputs in the model's space (already normalised, e.g. :func:`quickstart_normalize`).
    labels : (N,) tensor
        Integer class labels.
    lr, momentum, batch_size, epochs : float, float, int, int
        The quickstart's optimiser and loop settings.
    seed : int
        Seeds the shuffle.

    Returns
    -------
    dict of str to Tensor
        The trained weights (detached CPU copies).
    """
    if images.shape[0] != labels.shape[0]:
        raise ValueError(f"{images.shape[0]} images but {labels.shape[0]} labels")
    if lr <= 0 or batch_size < 1 or epochs < 1:
        raise ValueError(f"need lr > 0, batch_size >= 1, epochs >= 1; got {lr}, {batch_size}, "
                         f"{epochs}")
    local = copy.deepcopy(model)
    local.train()
    ref = next(local.parameters())
    x = images.detach().to(device=ref.device, dtype=ref.dtype)
    y = labels.detach().to(device=ref.device, dtype=torch.long)
    optimizer = torch.optim.SGD(local.parameters(), lr=lr, momentum=momentum)
    loss_fn = nn.CrossEntropyLoss()
    shuffle = torch.Generator().manual_seed(int(seed))
    for _ in range(int(epochs)):
        for idx in torch.randperm(x.shape[0], generator=shuffle).split(int(batch_size)):
            optimizer.zero_grad(set_to_none=True)
            loss_fn(local(x[idx]), y[idx]).backward()
            optimizer.step()
    return _state(local)


@dataclass(frozen=True)
class ServerView:
    """What an honest-but-curious server holds after one client's FedSGD step.

    ``before`` is the state dict it sent, ``after`` the one it got back; for every parameter
    ``before - after = lr * ∂L/∂θ`` (one SGD step from an empty momentum buffer), so
    ``update(key)`` over ``lr`` is the batch's mean-loss gradient.
    """

    before: dict[str, Tensor]
    after: dict[str, Tensor]
    lr: float

    def update(self, key: str) -> Tensor:
        """``before[key] - after[key]`` in float64: ``lr`` times the gradient of ``key``."""
        return self.before[key].double() - self.after[key].double()


def fedsgd_step(model: nn.Module, images: Tensor, labels: Tensor, *, lr: float = 0.1,
                momentum: float = 0.9) -> ServerView:
    """One quickstart SGD step on one batch (FedSGD): the weights sent and received.

    Parameters
    ----------
    model : nn.Module
        The global model (not modified).
    images : (B, C, H, W) tensor
        The client's batch in the model's space (normalised).
    labels : (B,) tensor
        Its labels.
    lr, momentum : float
        The quickstart's optimiser; the first step of a fresh optimiser is ``lr`` times the
        gradient whatever the momentum.

    Returns
    -------
    ServerView
        The state dicts before and after the step, and ``lr``.
    """
    after = quickstart_train(model, images, labels, lr=lr, momentum=momentum,
                             batch_size=images.shape[0], epochs=1)
    return ServerView(before=_state(model), after=after, lr=float(lr))
