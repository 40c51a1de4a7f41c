"""Quantizers: error bounds, unbiasedness, packing, casts."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fedcomp.codecs.pipeline import Pipeline
from fedcomp.codecs.quantize import Uniform
from tests.strategies import float_arrays


@given(x=float_arrays(max_side=300, max_dims=1), bits=st.integers(1, 8),
       chunk=st.sampled_from([1, 5, 128]))
def test_nearest_rounding_error_is_at_most_half_a_step(x, bits, chunk):
    codec = Uniform(bits=bits, chunk=chunk, rounding="nearest")
    encoded = codec.encode(x, rng=np.random.default_rng(0))
    decoded = codec.decode(encoded, max_numel=x.size)
    step = np.repeat(encoded.parts["step"], chunk)[: x.size].astype(np.float64)
    lo = np.repeat(encoded.parts["lo"], chunk)[: x.size].astype(np.float64)
    # The step itself: (max - min) / (2**bits - 1) of each chunk.
    blocks = np.pad(x.astype(np.float64), (0, (-x.size) % chunk), mode="edge").reshape(-1, chunk)
    tiny = float(np.finfo(np.float32).smallest_subnormal)  # float32 cannot step finer
    np.testing.assert_allclose(
        encoded.parts["step"], (blocks.max(1) - blocks.min(1)) / (2**bits - 1), rtol=1e-6,
        atol=tiny)
    np.testing.assert_array_equal(encoded.parts["lo"], blocks.min(1).astype(np.float32))
    # float32 arithmetic adds a few ulps of the chunk's magnitude on top of step / 2.
    slack = 4 * np.finfo(np.float32).eps * (np.abs(lo) + step * 2**bits) + tiny
    assert (np.abs(decoded.astype(np.float64) - x) <= step / 2 + slack).all()


def _assert_unbiased(spec: str, x: np.ndarray, per_element_std: np.ndarray, trials: int):
    pipeline = Pipeline.parse(spec)
    total = np.zeros(x.shape, dtype=np.float64)
    for seed in range(trials):
        total += pipeline.roundtrip(x, rng=np.random.default_rng(seed))[1]
    mean = total / trials
    # Five standard errors per element: with 64 elements the chance of a false
    # failure is under 64 * 6e-7 < 1e-4 (and the seeds are fixed, so it is repeatable).
    bound = 5 * per_element_std / np.sqrt(trials) + 1e-6
    assert (np.abs(mean - x) <= bound).all(), np.abs(mean - x).max()


X64 = np.random.default_rng(9).standard_normal(64).astype(np.float32)


def test_stochastic_uniform_quantization_is_unbiased():
    step = (X64.max() - X64.min()) / 15
    _assert_unbiased("quant:bits=4,chunk=64", X64, np.full(64, step / 2), 3000)


def test_qsgd_is_unbiased():
    norm = np.linalg.norm(X64)
    _assert_unbiased("qsgd:levels=2,bucket=64", X64, np.full(64, norm / 2 / 2), 3000)


def test_terngrad_is_unbiased():
    _assert_unbiased("ternary:mode=stochastic", X64, np.full(64, np.abs(X64).max()), 3000)


def test_the_unbiasedness_check_detects_a_biased_codec():
    # Nearest rounding is biased for values off the grid: the same check must fail.
    with pytest.raises(AssertionError):
        _assert_unbiased("quant:bits=2,chunk=64,rounding=nearest", X64,
                         np.full(64, (X64.max() - X64.min()) / 6), 3000)


def test_scaled_sign_sends_one_bit_per_value_and_the_mean_magnitude():
    x = np.array([1.0, -2.0, 3.0, -4.0, 0.0], dtype=np.float32)
    encoded, decoded = Pipeline.parse("sign").roundtrip(x, rng=np.random.default_rng())
    assert encoded.parts["signs"].size == 1
    np.testing.assert_allclose(decoded, [2.0, -2.0, 2.0, -2.0, 2.0])


def test_ternary_mean_mode_is_the_stc_rule():
    x = np.array([1.0, -3.0, 0.0, 2.0], dtype=np.float32)
    encoded, decoded = Pipeline.parse("ternary:mode=mean").roundtrip(
        x, rng=np.random.default_rng())
    np.testing.assert_allclose(decoded, [2.0, -2.0, 0.0, 2.0])
    assert encoded.meta["dense"] is False  # a zero forces the trit packing
    dense, _ = Pipeline.parse("ternary:mode=mean").roundtrip(x[x != 0],
                                                            rng=np.random.default_rng())
    assert dense.meta["dense"] is True and dense.parts["symbols"].size == 1


def test_fp16_saturates_instead_of_overflowing():
    x = np.array([1e6, -1e6, 1.5], dtype=np.float32)
    _, decoded = Pipeline.parse("fp16").roundtrip(x, rng=np.random.default_rng())
    np.testing.assert_array_equal(decoded, [65504.0, -65504.0, 1.5])


F32_LIMIT = float(np.float32(3e38))


@given(x=float_arrays(max_side=200, max_dims=1,
                      elements=st.floats(-F32_LIMIT, F32_LIMIT, width=32, allow_nan=False)))
def test_bf16_matches_torch_round_to_nearest_even(x):
    torch = pytest.importorskip("torch")
    _, decoded = Pipeline.parse("bf16").roundtrip(x, rng=np.random.default_rng())
    reference = torch.from_numpy(x).to(torch.bfloat16).to(torch.float32).numpy()
    finite = np.isfinite(reference)  # torch rounds values near float32's max to Inf
    np.testing.assert_array_equal(decoded[finite], reference[finite])
    assert np.isfinite(decoded).all()


@pytest.mark.parametrize("bits", range(1, 9))
def test_uniform_payload_size_is_bits_per_value_plus_scales(bits):
    x = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    encoded = Pipeline.parse(f"quant:bits={bits},chunk=100").encode(
        x, rng=np.random.default_rng(0))
    assert encoded.nbytes == (1000 * bits + 7) // 8 + 10 * 2 * 4


def test_stochastic_ternary_of_subnormal_values_keeps_each_with_its_share_of_the_max():
    # 1 / max|x| overflows float32 for a subnormal max; the keep probability must not.
    tiny = np.float32(1e-45)
    x = np.array([tiny, -tiny, 0.0] * 200, dtype=np.float32)
    pipeline = Pipeline.parse("ternary:mode=stochastic")
    _, decoded = pipeline.roundtrip(x, rng=np.random.default_rng(0))
    # |x| equals the max wherever it is non-zero: kept with probability 1, sign intact.
    np.testing.assert_array_equal(np.sign(decoded), np.sign(x))
