"""scikit-learn's 1,797 real 8x8 digits (inside its wheel) and a small CNN.

The images are split into train and test by a seeded stratified shuffle.
"""

from __future__ import annotations

import torch
from torch import nn

from fedcomp.tasks.data import load_digits_split


class Net(nn.Module):
    """CNN for 8x8 digits: conv32, conv64, pool, fc128, fc10 (151,306 parameters)."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, padding=1)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
        self.fc1 = nn.Linear(64 * 4 * 4, 128)
        self.fc2 = nn.Linear(128, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.conv1(x))
        x = torch.max_pool2d(torch.relu(self.conv2(x)), 2)
        x = torch.relu(self.fc1(x.flatten(1)))
        return self.fc2(x)


def load_data(data_dir: str, test_fraction: float, seed: int):
    """((x, y), (x_test, y_test)): images (N, 1, 8, 8) in [0, 1]."""
    train, test = load_digits_split(test_fraction, seed)
    return (train.x, train.y), (test.x, test.y)
