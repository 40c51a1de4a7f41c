"""Fixed-width bit packing of small unsigned integers (MSB-first bit stream).

Every width lays out the same bit stream: value 0's bits (most significant first),
then value 1's, and so on, zero-padded to a whole byte. Widths 1, 2, 4 and 8 take
fast paths (``np.packbits`` and shifts on whole bytes); other widths go through a
bit-plane matrix, which is slower but only used for small arrays (Rice remainders,
3/5/6/7-bit codes). numpy has no packed-integer dtype, hence this module.
"""

from __future__ import annotations

import numpy as np

from fedcomp.errors import PayloadError

__all__ = ["pack_uint", "packed_size", "unpack_uint"]


def packed_size(count: int, width: int) -> int:
    """Bytes that ``count`` values of ``width`` bits occupy."""
    return (count * width + 7) // 8


def pack_uint(values: np.ndarray, width: int) -> np.ndarray:
    """Pack non-negative integers ``< 2**width`` into a uint8 array."""
    if not 0 <= width <= 32:
        raise ValueError(f"width must be in [0, 32], got {width}")
    count = values.size
    if width == 0 or count == 0:
        return np.zeros(0, dtype=np.uint8)
    if width == 8:
        return values.astype(np.uint8)
    if width == 1:
        return np.packbits(values.astype(np.uint8))
    if width in (2, 4):
        per_byte = 8 // width
        padded = np.zeros(-(-count // per_byte) * per_byte, dtype=np.uint8)
        padded[:count] = values
        groups = padded.reshape(-1, per_byte)
        out = groups[:, 0] << np.uint8(8 - width)
        for j in range(1, per_byte):
            out |= groups[:, j] << np.uint8(8 - width * (j + 1))
        return out
    shifts = np.arange(width - 1, -1, -1, dtype=np.int64)
    bits = ((values.astype(np.int64)[:, None] >> shifts) & 1).astype(np.uint8)
    return np.packbits(bits.reshape(-1))


def unpack_uint(packed: np.ndarray, count: int, width: int, who: str) -> np.ndarray:
    """Inverse of :func:`pack_uint`; checks the byte count and zero padding.

    Returns uint8 for widths up to 8, int64 above. Raises :class:`PayloadError`
    naming ``who`` when ``packed`` does not hold exactly ``count`` values.
    """
    if packed.dtype != np.uint8 or packed.ndim != 1:
        raise PayloadError(f"{who}: packed codes must be a 1-D uint8 array", reason="header")
    if packed.size != packed_size(count, width):
        raise PayloadError(
            f"{who}: {packed.size} bytes cannot hold exactly {count} codes of {width} bits",
            reason="size",
        )
    out_dtype = np.uint8 if width <= 8 else np.int64
    if width == 0 or count == 0:
        return np.zeros(count, dtype=out_dtype)
    if width == 8:
        return packed
    if width in (2, 4):
        per_byte = 8 // width
        mask = np.uint8((1 << width) - 1)
        groups = np.empty((packed.size, per_byte), dtype=np.uint8)
        for j in range(per_byte):
            groups[:, j] = (packed >> np.uint8(8 - width * (j + 1))) & mask
        flat = groups.reshape(-1)
        if flat[count:].any():
            raise PayloadError(f"{who}: nonzero padding bits", reason="header")
        return flat[:count]
    bits = np.unpackbits(packed)
    nbits = count * width
    if bits[nbits:].any():
        raise PayloadError(f"{who}: nonzero padding bits", reason="header")
    if width == 1:
        return bits[:count]
    weights = np.left_shift(np.int64(1), np.arange(width - 1, -1, -1, dtype=np.int64))
    values = bits[:nbits].reshape(count, width).astype(np.int64) @ weights
    return values.astype(out_dtype)
