"""Random rotation: random signs, then a Walsh-Hadamard transform, block by block.

As in DRIVE (Vargaftik et al., 2021) and EDEN (2022): rotating a vector by
``H D / sqrt(B)`` (``D`` a diagonal of random signs, ``H`` the Hadamard matrix of
order ``B``) spreads its energy evenly over the coordinates, which then look alike
(near-Gaussian, one scale), so a following 1-2 bit quantizer loses less than on the
raw, heavy-tailed values. The rotation is orthonormal and its own inverse up to the
signs, so the receiver undoes it exactly (up to float32 rounding) from the seed of
the signs, which travels in the header (8 bytes). The values left open for the next
stage are the rotated ones: ``hadamard|quant:bits=2``.

The vector is rotated in blocks of ``block`` values (a power of two; the last block
is zero-padded), so the padding costs at most one block, and a tensor smaller than a
block gets the next power of two above its size instead. Rotating costs
``O(n log block)`` numpy passes.
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
from fedcomp.errors import PayloadError, SpecError

__all__ = ["Hadamard", "walsh_hadamard"]

_MAX_SEED = 2**63 - 1


def walsh_hadamard(blocks: np.ndarray) -> np.ndarray:
    """The orthonormal Walsh-Hadamard transform of each row of ``blocks`` (float64).

    Rows must have a power-of-two length. The transform is its own inverse.
    """
    rows, size = blocks.shape
    out = np.array(blocks, dtype=np.float64)
    half = 1
    while half < size:
        view = out.reshape(rows, size // (2 * half), 2, half)
        first, second = view[:, :, 0, :].copy(), view[:, :, 1, :]
        view[:, :, 0, :] += second
        view[:, :, 1, :] = first - second
        half *= 2
    return out / math.sqrt(size) if size else out


def _block_size(n: int, block: int) -> int:
    """The block a tensor of ``n`` values is rotated in: ``block``, or the next power
    of two above ``n`` when that is smaller."""
    return min(block, 1 << max(n - 1, 0).bit_length()) if n else 1


def _fits_float32(values: np.ndarray) -> bool:
    return not values.size or float(np.abs(values).max()) <= float(np.finfo(np.float32).max)


def _signs(seed: int, count: int) -> np.ndarray:
    return np.where(np.random.default_rng(seed).integers(0, 2, count, dtype=np.uint8),
                    1.0, -1.0)


@register_codec
@dataclass(frozen=True, kw_only=True)
class Hadamard(Codec):
    """Random rotation ``H D / sqrt(block)`` of each block (see the module)."""

    codec_id = "hadamard"
    #: The rotation is exact up to float32 rounding: E[decode(encode(x))] == x.
    unbiased = True
    open_parts = ("values",)

    block: int = 4096

    def __post_init__(self) -> None:
        param_int(self, "block", lo=1, hi=2**20)
        if self.block & (self.block - 1):
            raise SpecError(f"codec 'hadamard': 'block' must be a power of two, "
                            f"got {self.block}")

    def encode(self, x: np.ndarray, *, rng: np.random.Generator) -> Encoded:
        x = check_float_input(self.codec_id, x)
        if not np.isfinite(x).all():
            raise ValueError(f"{self.codec_id}: the input contains NaN or Inf")
        n = x.size
        size = _block_size(n, self.block)
        padded = np.zeros(-(-n // size) * size, dtype=np.float64)
        padded[:n] = x.reshape(-1)
        seed = int(rng.integers(0, _MAX_SEED, dtype=np.int64))
        rotated = walsh_hadamard((padded * _signs(seed, padded.size)).reshape(-1, size))
        if not _fits_float32(rotated):
            raise ValueError(f"{self.codec_id}: the rotated values overflow float32")
        values = rotated.reshape(-1).astype(np.float32)
        return Encoded(self.codec_id, {"shape": list(x.shape), "seed": seed},
                       {"values": values})

    def decode(self, enc: Encoded, *, max_numel: int) -> np.ndarray:
        shape = meta_shape(enc, max_numel)
        seed = meta_int(enc, "seed", 0, _MAX_SEED)
        n = math.prod(shape)
        size = _block_size(n, self.block)
        require_parts(enc, ("values",))
        values = take_part(enc, "values", np.float32, -(-n // size) * size)
        require_finite(self.codec_id, "values", values)
        restored = walsh_hadamard(values.reshape(-1, size)).reshape(-1)
        restored *= _signs(seed, restored.size)
        if not _fits_float32(restored[:n]):
            raise PayloadError(f"{self.codec_id}: the rotated values overflow float32",
                               reason="non-finite")
        return restored[:n].astype(np.float32).reshape(shape)
