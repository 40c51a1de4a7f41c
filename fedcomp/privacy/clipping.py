"""L2 clipping of a whole update (numpy only: the server's aggregation imports it)."""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

__all__ = ["clip_update", "update_norm"]


def update_norm(tensors: Mapping[str, np.ndarray]) -> float:
    """L2 norm of a whole update (all tensors together), in float64."""
    return math.sqrt(sum(float(np.vdot(v.astype(np.float64), v.astype(np.float64)))
                         for v in tensors.values()))


def clip_update(tensors: Mapping[str, np.ndarray], clip_norm: float
                ) -> tuple[dict[str, np.ndarray], float]:
    """Scale the update so its L2 norm is at most ``clip_norm``; return (update, norm).

    The factor is computed in float64 and slightly shrunk, so the float32 result
    stays within the bound after rounding. A non-finite norm cannot be clipped into a
    bound: it raises ``ValueError`` (the server decodes strictly, so it never sees one).
    """
    norm = update_norm(tensors)
    if not math.isfinite(norm):
        raise ValueError(f"cannot clip an update whose norm is {norm}")
    if norm <= clip_norm:
        return {k: np.asarray(v, dtype=np.float32) for k, v in tensors.items()}, norm
    factor = np.float32(clip_norm / norm * (1 - 1e-6))
    return {k: (np.asarray(v, dtype=np.float32) * factor) for k, v in tensors.items()}, norm
