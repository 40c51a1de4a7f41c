"""The null codec: no compression (spec ``none``), as GRACE's ``NoneCompressor``.

Having a real codec for "no compression" keeps call sites free of branches: a
pipeline always has at least one stage and a payload always has a root node.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from fedcomp.codecs.base import (
    Codec,
    Encoded,
    check_float_input,
    meta_shape,
    require_finite,
    require_parts,
    take_part,
)
from fedcomp.codecs.registry import register_codec

__all__ = ["Identity"]


@register_codec
@dataclass(frozen=True, kw_only=True)
class Identity(Codec):
    """No compression: the float32 values as they are (spec ``none``)."""

    codec_id = "none"
    lossless = True
    unbiased = True
    open_parts = ("data",)

    def encode(self, x: np.ndarray, *, rng: np.random.Generator | None = None) -> Encoded:
        x = check_float_input(self.codec_id, x)
        return Encoded(self.codec_id, {"shape": list(x.shape)}, {"data": x.reshape(-1)})

    def decode(self, enc: Encoded, *, max_numel: int) -> np.ndarray:
        shape = meta_shape(enc, max_numel)
        require_parts(enc, ("data",))
        data = take_part(enc, "data", np.float32, math.prod(shape))
        require_finite(self.codec_id, "data", data)
        return data.reshape(shape)
