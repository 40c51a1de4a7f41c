"""The random Hadamard rotation: exact inverse, norm kept, energy spread, strict decode."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fedcomp.codecs.base import Encoded
from fedcomp.codecs.pipeline import Pipeline
from fedcomp.codecs.rotation import Hadamard, walsh_hadamard
from fedcomp.errors import PayloadError, SpecError
from tests.strategies import float_arrays


@given(x=float_arrays(max_side=70), block=st.sampled_from([1, 2, 16, 256, 4096]),
       seed=st.integers(0, 2**32 - 1))
def test_the_rotation_is_undone_exactly_and_keeps_the_norm(x, block, seed):
    codec = Hadamard(block=block)
    encoded = codec.encode(x, rng=np.random.default_rng(seed))
    rotated = encoded.parts["values"]
    # Orthonormal: the rotated (zero-padded) vector has the input's norm.
    np.testing.assert_allclose(np.linalg.norm(rotated.astype(np.float64)),
                               np.linalg.norm(x.astype(np.float64)), rtol=1e-5, atol=1e-4)
    decoded = codec.decode(encoded, max_numel=x.size)
    np.testing.assert_allclose(decoded, x, rtol=1e-5, atol=1e-4 * (np.abs(x).max() + 1))


def test_the_transform_is_hadamards_own_inverse_and_spreads_a_spike():
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((3, 64))
    np.testing.assert_allclose(walsh_hadamard(walsh_hadamard(rows)), rows, atol=1e-12)
    # H / sqrt(8) of a one-hot vector: every coordinate +-1/sqrt(8), so a spike's
    # energy is spread evenly (what makes a low-bit quantizer after it lose less).
    spike = np.zeros((1, 8))
    spike[0, 3] = 1.0
    np.testing.assert_allclose(np.abs(walsh_hadamard(spike)), 1 / np.sqrt(8))
    # Sylvester's H_2 = [[1, 1], [1, -1]] / sqrt(2), applied to (a, b).
    np.testing.assert_allclose(walsh_hadamard(np.array([[3.0, 1.0]])),
                               [[4 / np.sqrt(2), 2 / np.sqrt(2)]])


def test_the_signs_come_from_the_rng_and_travel_as_a_seed():
    x = np.arange(1, 65, dtype=np.float32)
    a = Hadamard().encode(x, rng=np.random.default_rng(1))
    b = Hadamard().encode(x, rng=np.random.default_rng(2))
    assert a.meta["seed"] != b.meta["seed"]
    assert not np.array_equal(a.parts["values"], b.parts["values"])


def test_rotating_before_low_bit_quantization_lowers_its_error_on_heavy_tails():
    x = np.random.default_rng(0).standard_t(2, (200, 160)).astype(np.float32)

    def error(spec):
        errors = [np.linalg.norm(Pipeline.parse(spec).roundtrip(
            x, rng=np.random.default_rng(seed))[1] - x) for seed in range(5)]
        return float(np.mean(errors)) / float(np.linalg.norm(x))

    assert error("hadamard|quant:bits=2") < 0.6 * error("quant:bits=2")
    assert error("hadamard|sign") < error("sign")


def test_rotation_then_stochastic_quantization_stays_unbiased():
    x = np.random.default_rng(3).standard_normal(256).astype(np.float32)
    pipeline = Pipeline.parse("hadamard:block=64|quant:bits=1")
    mean = np.mean([pipeline.roundtrip(x, rng=np.random.default_rng(s))[1]
                    for s in range(3000)], axis=0)
    assert np.abs(mean - x).max() < 0.15


def test_a_block_that_is_not_a_power_of_two_is_refused():
    with pytest.raises(SpecError, match="power of two"):
        Hadamard(block=48)


@pytest.mark.parametrize(("meta", "values", "reason"), [
    ({"shape": [10], "seed": 1}, np.zeros(15, np.float32), "size"),
    ({"shape": [10], "seed": -1}, np.zeros(16, np.float32), None),
    ({"shape": [10], "seed": 2**63}, np.zeros(16, np.float32), None),
    ({"shape": [10], "seed": 1}, np.full(16, np.nan, np.float32), "non-finite"),
    # Finite rotated values whose inverse overflows float32.
    ({"shape": [16], "seed": 1}, np.full(16, 3e38, np.float32), "non-finite"),
])
def test_hostile_nodes_are_rejected_with_a_payload_error(meta, values, reason):
    with pytest.raises(PayloadError) as info:
        Hadamard().decode(Encoded("hadamard", meta, {"values": values}), max_numel=100)
    if reason is not None:
        assert info.value.reason == reason
