"""Datasets that need no network: scikit-learn's digits (shipped in its wheel)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["ArrayDataset", "load_digits"]


@dataclass(frozen=True)
class ArrayDataset:
    """Images (N, 1, H, W) float32 in [0, 1] and labels (N,) int64."""

    x: np.ndarray
    y: np.ndarray

    def __len__(self) -> int:
        return len(self.y)


def load_digits() -> ArrayDataset:
    """scikit-learn's 1,797 real 8x8 digits, scaled to [0, 1]."""
    from sklearn.datasets import load_digits as _load

    bunch = _load()
    x = (bunch.images.astype(np.float32) / 16.0)[:, None, :, :]
    return ArrayDataset(x=x, y=bunch.target.astype(np.int64))
