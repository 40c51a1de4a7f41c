"""Pipelines: equal to their stages applied in turn; decoding is guided and strict."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fedcomp.codecs.base import Encoded
from fedcomp.codecs.pipeline import Pipeline
from fedcomp.codecs.registry import get_codec
from fedcomp.errors import PayloadError
from tests.strategies import float_arrays, transform_then_bytes_specs


@given(x=float_arrays(max_side=50), seed=st.integers(0, 2**32 - 1),
       bits=st.integers(1, 8), ratio=st.sampled_from([0.05, 0.3, 1.0]))
def test_topk_then_quant_equals_the_stages_applied_in_turn(x, seed, bits, ratio):
    topk = get_codec({"id": "topk", "ratio": ratio})
    quant = get_codec({"id": "quant", "bits": bits, "rounding": "stochastic"})
    _, piped = Pipeline([topk, quant]).roundtrip(x, rng=np.random.default_rng(seed))

    rng = np.random.default_rng(seed)  # the same randomness, consumed in the same order
    sparse = topk.encode(x, rng=rng)
    values = sparse.parts["values"]
    values_back = quant.decode(quant.encode(values, rng=rng), max_numel=values.size)
    by_hand = topk.decode(sparse.replace_parts(values=values_back), max_numel=x.size)
    np.testing.assert_array_equal(piped, by_hand)


@given(x=float_arrays(max_side=30, max_dims=2), seed=st.integers(0, 1000))
def test_lowrank_then_fp16_then_zstd_equals_the_stages_in_turn(x, seed):
    lowrank, fp16, zstd = (get_codec({"id": i}) for i in ("lowrank", "fp16", "zstd"))
    _, piped = Pipeline([lowrank, fp16, zstd]).roundtrip(x, rng=np.random.default_rng(seed))
    factors = lowrank.encode(x, rng=np.random.default_rng(seed))
    halves = {name: fp16.decode(fp16.encode(factors.parts[name], rng=None), max_numel=10**6)
              for name in ("p", "q")}
    by_hand = lowrank.decode(factors.replace_parts(**halves), max_numel=x.size)
    np.testing.assert_array_equal(piped, by_hand)


@given(configs=transform_then_bytes_specs(), x=float_arrays(max_side=30),
       seed=st.integers(0, 1000))
def test_any_valid_pipeline_round_trips_to_the_right_shape(configs, x, seed):
    pipeline = Pipeline([get_codec(c) for c in configs])
    encoded, decoded = pipeline.roundtrip(x, rng=np.random.default_rng(seed))
    assert decoded.shape == x.shape and np.isfinite(decoded).all()
    # Decoding depends only on the encoded tree, not on extra state.
    np.testing.assert_array_equal(pipeline.decode_tensor(encoded, x.shape), decoded)


def test_the_tree_has_the_documented_shape():
    x = np.random.default_rng(0).standard_normal(5000).astype(np.float32)
    tree = Pipeline.parse("topk:ratio=0.01|quant:bits=4|zstd").encode(
        x, rng=np.random.default_rng(0))
    assert tree.codec == "topk"
    assert tree.parts["values"].codec == "quant"
    assert {p.codec for p in tree.parts["values"].parts.values()} == {"zstd"}
    assert all(isinstance(p, Encoded) and p.codec == "zstd"
               for name, p in tree.parts.items() if name.startswith("ix_"))


def test_a_node_of_the_wrong_codec_is_rejected():
    x = np.random.default_rng(0).standard_normal(500).astype(np.float32)
    encoded = Pipeline.parse("topk|quant:bits=4").encode(x, rng=np.random.default_rng(0))
    other = Pipeline.parse("topk|qsgd:levels=4")
    with pytest.raises(PayloadError, match="expected a 'qsgd' node"):
        other.decode_tensor(encoded, x.shape)
    with pytest.raises(PayloadError, match=r"elements|shape"):
        Pipeline.parse("topk|quant:bits=4").decode_tensor(encoded, (499,))
    nested = encoded.replace_parts(ix_unary=Encoded("zstd", {}, {}))
    with pytest.raises(PayloadError, match="unexpected nested node"):
        Pipeline.parse("topk|quant:bits=4").decode_tensor(nested, x.shape)


def test_flags_combine_over_stages():
    assert Pipeline.parse("none|zstd").lossless
    assert not Pipeline.parse("topk").lossless
    assert Pipeline.parse("quant:bits=4").unbiased
    assert not Pipeline.parse("quant:bits=4,rounding=nearest").unbiased
    assert Pipeline.parse("topk|quant").sparse
