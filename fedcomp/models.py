"""Small CNNs for the datasets fedcomp ships with, chosen by dataset name."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["CNN8", "CNN28", "build_model"]


class CNN8(nn.Module):
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


class CNN28(nn.Module):
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


_MODELS = {"digits": CNN8, "fashion-mnist": CNN28}


def build_model(dataset: str, *, seed: int) -> nn.Module:
    """The model for ``dataset``, initialized from ``seed`` (torch's RNG is forked)."""
    try:
        cls = _MODELS[dataset]
    except KeyError:
        raise ValueError(f"no model for dataset {dataset!r}; known: {', '.join(_MODELS)}") from None
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return cls()
