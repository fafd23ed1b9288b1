"""The app's model, data and training loop: Flower's quickstart-pytorch, nothing of fl-attack.

``Net`` and ``train`` are those of Flower's ``quickstart-pytorch`` example (a LeNet-style CNN;
SGD with momentum 0.9, learning rate from the server, batches of 32, inputs normalised with
mean 0.5 / std 0.5). The data are real photographs cut into CIFAR-10-shaped crops, or
torchvision's CIFAR-10 when it is on disk (``source = "cifar10"``, ``$FL_ATTACK_DATA``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

MEAN, STD = 0.5, 0.5  # Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)), as the quickstart
POOL = 4000  # images loaded and split among the clients


class Net(nn.Module):
    """Model (simple CNN adapted from 'PyTorch: A 60 Minute Blitz'), as in the quickstart."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.view(-1, 16 * 5 * 5)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


def dataset(source: str) -> str:
    """The ``fl_attack.testbed.data`` name of a data source of this app."""
    if source not in ("photos", "cifar10"):
        raise ValueError(f"source must be 'photos' or 'cifar10', got {source!r}")
    return "photos32" if source == "photos" else "cifar10"


def load_partition(partition_id: int, num_partitions: int, samples: int, round_: int,
                   source: str = "photos") -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """This round's ``samples`` normalised images of a client, their labels and their indices
    in the pool (each client owns every ``num_partitions``-th image; rounds take new ones)."""
    from fl_attack.testbed.data import load_images

    images, labels = load_images(dataset(source), POOL, seed=7)
    own = torch.arange(partition_id, POOL, num_partitions)
    start = ((round_ - 1) * samples) % max(len(own) - samples, 1)
    idx = own[start:start + samples]
    return (images[idx] - MEAN) / STD, labels[idx], [int(i) for i in idx]


def train(net: Net, x: torch.Tensor, y: torch.Tensor, *, epochs: int, batch_size: int,
          lr: float, seed: int = 0) -> float:
    """The quickstart's loop: SGD with momentum 0.9 over shuffled batches; the mean loss."""
    criterion = torch.nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    net.train()
    gen = torch.Generator().manual_seed(seed)
    running, steps = 0.0, 0
    for _ in range(epochs):
        order = torch.randperm(len(x), generator=gen)
        for start in range(0, len(x), batch_size):
            batch = order[start:start + batch_size]
            optimizer.zero_grad()
            loss = criterion(net(x[batch]), y[batch])
            loss.backward()
            optimizer.step()
            running, steps = running + float(loss), steps + 1
    return running / max(steps, 1)
