"""The app's model, data and training loop: plain PyTorch, nothing of fl-attack."""

from __future__ import annotations

import torch
from torch import nn

MEAN, STD = 0.5, 0.25  # this app's own input normalisation


class Net(nn.Module):
    """fc1 -> ReLU -> fc2 -> ReLU -> head, on flattened 3x32x32 photos."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(3 * 32 * 32, 128)
        self.fc2 = nn.Linear(128, 64)
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.fc1(x.flatten(1)))
        return self.head(torch.relu(self.fc2(x)))


def load_partition(partition_id: int, num_partitions: int,
                   samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``samples`` normalised photos and their labels for one client (disjoint per client).

    Real photographs cut into CIFAR-10-shaped crops; any image dataset works the same way.
    """
    from fl_attack.testbed.data import load_images

    images, labels = load_images("photos32", samples * num_partitions, seed=7)
    part = slice(partition_id * samples, (partition_id + 1) * samples)
    return (images[part] - MEAN) / STD, labels[part]


def train(net: Net, x: torch.Tensor, y: torch.Tensor, *, epochs: int, batch_size: int,
          lr: float) -> None:
    """Ordinary mini-batch SGD on the client's samples, in order."""
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    for _ in range(epochs):
        for start in range(0, len(x), batch_size):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(net(x[start:start + batch_size]),
                                               y[start:start + batch_size])
            loss.backward()
            opt.step()
