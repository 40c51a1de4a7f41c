"""zstd stage: exact, bounded decompression, lying frames rejected."""

from __future__ import annotations

import numpy as np
import pytest
import zstandard

from fedcomp.codecs.base import Encoded
from fedcomp.codecs.lossless import Zstd
from fedcomp.errors import PayloadError


def test_round_trip_of_every_allowed_dtype():
    codec = Zstd(level=3)
    for dtype in ("u1", "i1", "<u2", "<i2", "<u4", "<i4", "<u8", "<i8", "<f2", "<f4"):
        x = np.arange(100).astype(dtype)
        np.testing.assert_array_equal(codec.decode(codec.encode(x), max_numel=100), x)


def _node(frame: bytes, shape: list[int], dtype: str = "|u1") -> Encoded:
    return Encoded("zstd", {"shape": shape, "dtype": dtype},
                   {"frame": np.frombuffer(frame, np.uint8)})


def test_a_zstd_bomb_is_rejected_without_decompressing_it():
    # 1 GB of zeros compresses to a few kB. Without content size in the frame, the
    # reader stops after declared + 1 bytes.
    bomb = zstandard.ZstdCompressor(write_content_size=False).compressobj()
    frame = b"".join(bomb.compress(bytes(1 << 20)) for _ in range(1024)) + bomb.flush()
    with pytest.raises(PayloadError, match="more than"):
        Zstd().decode(_node(frame, [1000]), max_numel=1000)


def test_a_frame_whose_content_size_disagrees_with_the_header_is_rejected():
    frame = zstandard.ZstdCompressor().compress(bytes(5000))
    with pytest.raises(PayloadError, match="declares 5000"):
        Zstd().decode(_node(frame, [1000]), max_numel=1000)


def test_a_declared_size_beyond_the_tensor_is_rejected_before_decompressing():
    frame = zstandard.ZstdCompressor().compress(bytes(100))
    with pytest.raises(PayloadError):
        Zstd().decode(_node(frame, [10**9], "<f4"), max_numel=1000)


def test_garbage_frames_are_rejected():
    with pytest.raises(PayloadError):
        Zstd().decode(_node(b"\x28\xb5\x2f\xfd garbage", [10]), max_numel=10)
    with pytest.raises(PayloadError):
        Zstd().decode(_node(b"not zstd", [10]), max_numel=10)
