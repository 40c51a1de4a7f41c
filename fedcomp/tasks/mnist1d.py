"""MNIST-1D (Greydanus and Kapoor, 2020) and a small transformer: a sequence task.

Each example is a 40-step 1-D signal made from one of ten digit templates by padding,
shifting, scaling, shearing and noise; the ``mnist1d`` package generates the standard
5,000 examples (its seed 42) in about a second, with no network. The model is a
two-layer transformer encoder (embedding, learned positions, attention, LayerNorm,
mean pooling): layers the image CNNs do not have, in 19k parameters.
"""

from __future__ import annotations

import random

import numpy as np
import torch
from torch import nn

#: The standard dataset's size and seed (the run seed partitions it).
NUM_SAMPLES = 5000
DATA_SEED = 42


class Net(nn.Module):
    """Transformer encoder over the 40 steps: dim 32, 4 heads, 2 layers, 10 classes."""

    def __init__(self, length: int = 40, dim: int = 32, heads: int = 4, layers: int = 2,
                 num_classes: int = 10) -> None:
        super().__init__()
        self.embed = nn.Linear(1, dim)
        self.position = nn.Parameter(0.02 * torch.randn(length, dim))
        layer = nn.TransformerEncoderLayer(dim, heads, dim_feedforward=2 * dim, dropout=0.0,
                                           batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x.unsqueeze(-1)) + self.position
        h = self.norm(self.encoder(h))
        return self.head(h.mean(dim=1))


def load_data(data_dir: str, test_fraction: float, seed: int):
    """((x, y), (x_test, y_test)): signals (N, 40) float32, standardized.

    The package seeds NumPy's and Python's global generators; their states are put
    back afterwards, so generating the data changes nothing else in the process.
    """
    from mnist1d.data import get_dataset_args, make_dataset

    args = get_dataset_args()
    args.num_samples, args.seed, args.train_split = NUM_SAMPLES, DATA_SEED, 1 - test_fraction
    saved = np.random.get_state(), random.getstate()  # noqa: NPY002 (the package uses it)
    try:
        data = make_dataset(args)
    finally:
        np.random.set_state(saved[0])  # noqa: NPY002
        random.setstate(saved[1])
    return ((data["x"].astype(np.float32), data["y"].astype(np.int64)),
            (data["x_test"].astype(np.float32), data["y_test"].astype(np.int64)))
