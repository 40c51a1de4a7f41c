"""Fixed-width bit packing: every width lays out the same MSB-first bit stream."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fedcomp.codecs.bitpack import pack_uint, packed_size, unpack_uint
from fedcomp.errors import PayloadError


@given(width=st.integers(1, 31), data=st.data())
def test_pack_unpack_round_trip(width, data):
    values = np.array(data.draw(st.lists(st.integers(0, 2**width - 1), max_size=300)),
                      dtype=np.int64)
    packed = pack_uint(values, width)
    assert packed.size == packed_size(values.size, width)
    np.testing.assert_array_equal(unpack_uint(packed, values.size, width, "t"), values)


@pytest.mark.parametrize("width", [1, 2, 4, 8])
def test_fast_paths_match_the_generic_bit_stream(width):
    values = np.random.default_rng(0).integers(0, 2**width, 37)
    bits = ((values[:, None] >> np.arange(width - 1, -1, -1)) & 1).reshape(-1)
    np.testing.assert_array_equal(pack_uint(values, width), np.packbits(bits.astype(np.uint8)))


def test_nonzero_padding_and_wrong_lengths_are_rejected():
    packed = pack_uint(np.array([1, 2, 3]), 4)  # 12 bits: 4 padding bits
    packed[-1] |= 1
    with pytest.raises(PayloadError, match="padding"):
        unpack_uint(packed, 3, 4, "t")
    with pytest.raises(PayloadError, match="cannot hold"):
        unpack_uint(np.zeros(5, np.uint8), 3, 4, "t")
