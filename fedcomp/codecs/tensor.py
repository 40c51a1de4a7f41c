"""numpy <-> torch conversion at the library's edges.

The codecs compute in numpy (one code path, no torch import in the hot loop); users
may hand in torch tensors and get torch tensors back. CPU tensors convert without a
copy. torch is only imported when a torch tensor is actually seen.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np

__all__ = ["from_numpy", "is_torch", "to_numpy"]

Kind = Literal["numpy", "torch"]


def is_torch(x: Any) -> bool:
    """Whether ``x`` is a torch tensor (checked without importing torch)."""
    return type(x).__module__.startswith("torch") and hasattr(x, "detach")


def to_numpy(x: Any) -> tuple[np.ndarray, Kind]:
    """Return ``x`` as a numpy array (a view when possible) and the kind it came as."""
    if is_torch(x):
        return x.detach().cpu().numpy(), "torch"
    if isinstance(x, np.ndarray):
        return x, "numpy"
    raise TypeError(f"expected a numpy array or torch tensor, got {type(x).__name__}")


def from_numpy(array: np.ndarray, kind: Kind) -> Any:
    """Return ``array`` as ``kind`` (a torch tensor shares memory with the array)."""
    if kind == "torch":
        import torch

        return torch.from_numpy(np.ascontiguousarray(array))
    return array
