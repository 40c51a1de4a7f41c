"""Fashion-MNIST (60k train, 10k test) from its IDX files and a small CNN.

The files come from Debian's ``dataset-fashion-mnist`` or the run config's
``data-dir``; nothing is downloaded.
"""

from __future__ import annotations

import torch
from torch import nn

from fedcomp.tasks.data import load_fashion_mnist


class Net(nn.Module):
    """CNN for 28x28 images: conv32, pool, conv64, pool, fc128, fc10 (421,642 parameters)."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, padding=1)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
        self.fc1 = nn.Linear(64 * 7 * 7, 128)
        self.fc2 = nn.Linear(128, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.max_pool2d(torch.relu(self.conv1(x)), 2)
        x = torch.max_pool2d(torch.relu(self.conv2(x)), 2)
        x = torch.relu(self.fc1(x.flatten(1)))
        return self.fc2(x)


def load_data(data_dir: str, test_fraction: float, seed: int):
    """((x, y), (x_test, y_test)): images (N, 1, 28, 28) in [0, 1]; the split is the
    files' own (``test_fraction`` and ``seed`` do not apply)."""
    train, test = load_fashion_mnist(data_dir)
    return (train.x, train.y), (test.x, test.y)
