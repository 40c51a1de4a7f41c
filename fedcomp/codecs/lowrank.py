"""Low-rank approximation: send factors ``P`` (rows x r) and ``Q`` (cols x r), not ``M``.

As in PowerSGD (Vogels et al., 2019): ``M`` is the tensor viewed as a matrix (first
dimension by the rest; a 1-D tensor is folded into a near-square matrix, zero-padded),
``Q`` starts as a seeded Gaussian matrix, and each power iteration computes
``P = orth(M Q)``, ``Q = M^T P``. The receiver rebuilds ``P Q^T``. PowerSGD reuses
``Q`` across steps to warm-start; a stateless codec cannot, so ``iters`` (default 2)
buys the accuracy back. Both factors stay open for a following value stage (for
example ``lowrank:rank=4|fp16``). Biased: use error feedback.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from fedcomp.codecs.base import (
    Codec,
    Encoded,
    check_float_input,
    meta_int,
    meta_shape,
    param_int,
    require_finite,
    require_parts,
    take_part,
)
from fedcomp.codecs.registry import register_codec
from fedcomp.errors import PayloadError

__all__ = ["LowRank", "matrix_view_shape"]


def matrix_view_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """(rows, cols) of the matrix a tensor of ``shape`` is viewed as."""
    n = math.prod(shape)
    if len(shape) >= 2 and shape[0] > 0:
        return shape[0], n // shape[0]
    rows = max(1, math.isqrt(max(n - 1, 0)) + 1) if n else 0
    return rows, (-(-n // rows) if rows else 0)


@register_codec
@dataclass(frozen=True, kw_only=True)
class LowRank(Codec):
    """Rank-``rank`` approximation by ``iters`` seeded power iterations."""

    codec_id = "lowrank"
    shown_params = ("rank",)
    open_parts = ("p", "q")

    rank: int = 4
    iters: int = 2

    def __post_init__(self) -> None:
        param_int(self, "rank", lo=1, hi=4096)
        param_int(self, "iters", lo=1, hi=16)

    def encode(self, x: np.ndarray, *, rng: np.random.Generator) -> Encoded:
        x = check_float_input(self.codec_id, x)
        rows, cols = matrix_view_shape(x.shape)
        rank = min(self.rank, rows, cols)
        flat = x.reshape(-1)
        if rows * cols != flat.size:
            flat = np.concatenate([flat, np.zeros(rows * cols - flat.size, np.float32)])
        m = flat.reshape(rows, cols)
        if not np.isfinite(m).all():
            raise ValueError(f"{self.codec_id}: the input contains NaN or Inf")
        q = rng.standard_normal((cols, rank), dtype=np.float32)
        p = np.zeros((rows, rank), dtype=np.float32)
        for _ in range(self.iters):
            p, _r = np.linalg.qr(m @ q)
            q = m.T @ p
        meta = {"shape": list(x.shape), "rank": rank}
        return Encoded(self.codec_id, meta, {
            "p": np.ascontiguousarray(p, dtype=np.float32).reshape(-1),
            "q": np.ascontiguousarray(q, dtype=np.float32).reshape(-1),
        })

    def decode(self, enc: Encoded, *, max_numel: int) -> np.ndarray:
        shape = meta_shape(enc, max_numel)
        rows, cols = matrix_view_shape(shape)
        rank = meta_int(enc, "rank", 0, min(self.rank, rows, cols))
        require_parts(enc, ("p", "q"))
        p = take_part(enc, "p", np.float32, rows * rank).reshape(rows, rank)
        q = take_part(enc, "q", np.float32, cols * rank).reshape(cols, rank)
        require_finite(self.codec_id, "p", p)
        require_finite(self.codec_id, "q", q)
        # |(P Q^T)_ij| <= ||P_i|| ||Q_j||: reject factors whose product could overflow.
        if rank and float(np.linalg.norm(p.astype(np.float64), axis=1).max()) * float(
            np.linalg.norm(q.astype(np.float64), axis=1).max()
        ) > float(np.finfo(np.float32).max):
            raise PayloadError(f"{self.codec_id}: factors overflow float32", reason="non-finite")
        n = math.prod(shape)
        return (p @ q.T).reshape(-1)[:n].reshape(shape)
