"""Lossless byte codecs applied to every array a pipeline has produced so far.

Zstandard is the one lossless stage: on quantized values and coded indices it gains
little (their entropy is already near their size), but on fp32 or fp16 values and on
raw indices it pays, and it is what users expect to find. Decompression is bounded:
the declared size must fit the tensor, a frame that claims another size is
rejected, and we never read more than the declared size plus one byte, so a
"zstd bomb" costs nothing.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass

import numpy as np
import zstandard

from fedcomp.codecs.base import (
    Codec,
    Encoded,
    meta_shape,
    meta_str,
    param_int,
    require_parts,
    take_part,
)
from fedcomp.codecs.registry import register_codec
from fedcomp.errors import PayloadError

__all__ = ["LEAF_DTYPES", "Zstd"]

#: Array dtypes that may travel on the wire (little-endian), by their numpy ``.str``.
LEAF_DTYPES: dict[str, np.dtype] = {
    np.dtype(t).str: np.dtype(t)
    for t in ("u1", "i1", "<u2", "<i2", "<u4", "<i4", "<u8", "<i8", "<f2", "<f4")
}


@register_codec
@dataclass(frozen=True, kw_only=True)
class Zstd(Codec):
    """Zstandard at ``level`` (1..22; 3 is a good default, above 9 gains little here)."""

    codec_id = "zstd"
    shown_params = ("level",)
    kind = "bytes"
    lossless = True
    unbiased = True

    level: int = 3

    def __post_init__(self) -> None:
        param_int(self, "level", lo=1, hi=22)

    def encode(self, x: np.ndarray, *, rng: np.random.Generator | None = None) -> Encoded:
        if x.dtype.str not in LEAF_DTYPES:
            raise TypeError(f"{self.codec_id}: cannot encode dtype {x.dtype}")
        frame = zstandard.ZstdCompressor(level=self.level, write_content_size=True).compress(
            np.ascontiguousarray(x).tobytes()
        )
        meta = {"shape": list(x.shape), "dtype": x.dtype.str}
        return Encoded(self.codec_id, meta, {"frame": np.frombuffer(frame, dtype=np.uint8)})

    def decode(self, enc: Encoded, *, max_numel: int) -> np.ndarray:
        # Wrapped arrays hold at most 8 bytes per element of the tensor.
        shape = meta_shape(enc, 8 * max_numel + 64)
        dtype = LEAF_DTYPES[meta_str(enc, "dtype", tuple(LEAF_DTYPES))]
        size = math.prod(shape) * dtype.itemsize
        if size > 8 * max_numel + 64:
            raise PayloadError(f"{self.codec_id}: declared {size} bytes is too large",
                               reason="size")
        require_parts(enc, ("frame",))
        frame = take_part(enc, "frame", np.uint8).tobytes()
        try:
            declared = zstandard.frame_content_size(frame)
        except zstandard.ZstdError as exc:
            raise PayloadError(f"{self.codec_id}: not a zstd frame ({exc})",
                               reason="zstd") from None
        if declared not in (-1, size):
            raise PayloadError(
                f"{self.codec_id}: frame declares {declared} bytes, header {size}",
                reason="zstd",
            )
        try:
            reader = zstandard.ZstdDecompressor().stream_reader(
                io.BytesIO(frame), read_across_frames=False
            )
            raw = reader.read(size + 1) if size else reader.read(1)
        except zstandard.ZstdError as exc:
            raise PayloadError(f"{self.codec_id}: corrupt frame ({exc})",
                               reason="zstd") from None
        if len(raw) != size:
            found = f"more than {size}" if len(raw) > size else str(len(raw))
            raise PayloadError(
                f"{self.codec_id}: frame decompresses to {found} bytes; header says {size}",
                reason="zstd",
            )
        return np.frombuffer(raw, dtype=dtype).reshape(shape)
