"""Sparsifiers: Top-K keeps exactly the k largest; approximate, random and threshold."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fedcomp.codecs.pipeline import Pipeline
from fedcomp.codecs.sparsify import TopK, select_top_k
from tests.strategies import float_arrays

# Small integers as floats produce many ties, the hard case for an exact Top-K.
tied_arrays = float_arrays(max_side=60, elements=st.integers(-4, 4).map(float))


@given(x=st.one_of(float_arrays(max_side=60), tied_arrays), k=st.integers(1, 80))
def test_topk_keeps_exactly_the_k_largest_magnitudes(x, k):
    k = min(k, x.size)
    _, decoded = Pipeline.parse(f"topk:k={k}").roundtrip(x, rng=np.random.default_rng(0))
    kept = np.flatnonzero(decoded.reshape(-1) != 0)
    flat = x.reshape(-1)
    # Kept entries are sent exactly ...
    np.testing.assert_array_equal(decoded.reshape(-1)[kept], flat[kept])
    # ... and the multiset of sent magnitudes is the k largest (zeros may be "kept").
    sent = np.zeros(flat.size, dtype=np.float32)
    sent[kept] = np.abs(flat[kept])
    expected = np.sort(np.abs(flat))[::-1][:k]
    got = np.sort(sent)[::-1][:k]
    np.testing.assert_array_equal(got, expected)
    assert np.count_nonzero(decoded) <= k


def test_select_top_k_on_a_large_tensor_matches_a_full_sort():
    rng = np.random.default_rng(3)
    # A large tensor takes the sampled-candidate path; heavy tails and a block of
    # large values defeat a naive strided sample.
    x = rng.standard_t(2, size=300_000).astype(np.float32)
    x[1000:1500] = 50.0
    for k in (1, 7, 300, 3000, 30_000):
        chosen = select_top_k(x, k)
        assert chosen.size == k and (np.diff(chosen) > 0).all()
        threshold = np.sort(np.abs(x))[-k]
        assert np.abs(x[chosen]).min() == threshold
        assert np.count_nonzero(np.abs(x) > threshold) <= k


def test_topk_by_ratio_keeps_ratio_times_n():
    x = np.random.default_rng(0).standard_normal(10_000).astype(np.float32)
    encoded = Pipeline.parse("topk:ratio=0.01").encode(x, rng=np.random.default_rng(0))
    assert encoded.meta["count"] == 100


def test_approximate_topk_keeps_about_k_and_trim_keeps_at_most_k():
    rng = np.random.default_rng(1)
    x = rng.standard_normal(200_000).astype(np.float32)
    k = 2000
    approx = TopK(k=k, approx=True).encode(x, rng=np.random.default_rng(2))
    assert 0.7 * k <= approx.meta["count"] <= 1.3 * k
    trimmed = TopK(k=k, approx=True, trim=True).encode(x, rng=np.random.default_rng(2))
    assert trimmed.meta["count"] == min(k, approx.meta["count"])
    # Trimming keeps the largest of the approximate selection.
    exact = set(select_top_k(x, trimmed.meta["count"]).tolist())
    decoded = TopK(k=k, approx=True, trim=True).decode(trimmed, max_numel=x.size)
    assert set(np.flatnonzero(decoded).tolist()) <= exact | set(np.flatnonzero(x == 0).tolist())


def test_random_k_sends_no_index_bytes_and_regenerates_positions_from_the_seed():
    x = np.random.default_rng(0).standard_normal(10_000).astype(np.float32)
    encoded, decoded = Pipeline.parse("randk:ratio=0.05").roundtrip(
        x, rng=np.random.default_rng(4))
    assert set(encoded.parts) == {"values"}
    assert encoded.nbytes == 500 * 4
    kept = np.flatnonzero(decoded)
    assert kept.size == 500
    np.testing.assert_array_equal(decoded[kept], x[kept])
    other, _ = Pipeline.parse("randk:ratio=0.05").roundtrip(x, rng=np.random.default_rng(5))
    assert other.meta["seed"] != encoded.meta["seed"]


def test_scaled_random_k_is_unbiased():
    x = np.linspace(-1, 1, 50, dtype=np.float32)
    pipeline = Pipeline.parse("randk:k=10,scale=true")
    trials = 4000
    total = np.zeros_like(x, dtype=np.float64)
    for seed in range(trials):
        total += pipeline.roundtrip(x, rng=np.random.default_rng(seed))[1]
    # Each entry is (n/k) x with probability k/n: std = |x| sqrt(n/k - 1) = 2|x|.
    bound = 5 * 2 * np.abs(x) / np.sqrt(trials) + 1e-6
    assert (np.abs(total / trials - x) <= bound).all()


def test_threshold_keeps_every_entry_at_or_above_the_value():
    x = np.array([0.5, -0.6, 0.1, -0.05, 2.0, 0.0], dtype=np.float32)
    _, decoded = Pipeline.parse("threshold:value=0.5").roundtrip(x, rng=np.random.default_rng())
    np.testing.assert_array_equal(decoded, np.array([0.5, -0.6, 0, 0, 2.0, 0], np.float32))


@pytest.mark.parametrize("spec", ["topk:ratio=0.1", "topk:approx=true", "threshold:value=0.1"])
def test_inf_in_the_input_is_caught_even_when_it_would_be_dropped(spec):
    x = np.zeros(100_000, dtype=np.float32)
    x[5] = np.inf
    with pytest.raises(ValueError, match="NaN or Inf"):
        Pipeline.parse(spec).encode(x, rng=np.random.default_rng(0))
