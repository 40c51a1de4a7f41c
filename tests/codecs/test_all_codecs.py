"""Properties every registered codec must have, checked over random configs and inputs."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fedcomp.codecs.base import Codec
from fedcomp.codecs.pipeline import Pipeline
from fedcomp.codecs.registry import available_codecs, codec_class, get_codec, register_codec
from fedcomp.errors import SpecError
from tests.strategies import CODEC_PARAMS, codec_configs, float_arrays


def test_every_registered_codec_is_covered_by_the_test_strategies():
    assert set(available_codecs()) == set(CODEC_PARAMS)


@given(config=codec_configs(), x=float_arrays(), seed=st.integers(0, 2**32 - 1))
def test_shape_and_dtype_are_kept(config, x, seed):
    pipeline = Pipeline([get_codec(config)])
    if pipeline.stages[0].kind == "bytes":
        pipeline = Pipeline([get_codec({"id": "none"}), pipeline.stages[0]])
    _, decoded = pipeline.roundtrip(x, rng=np.random.default_rng(seed))
    assert decoded.shape == x.shape
    assert decoded.dtype == np.float32
    assert np.isfinite(decoded).all()


@given(config=codec_configs())
def test_config_round_trips_through_json(config):
    codec = get_codec(config)
    again = get_codec(json.loads(json.dumps(codec.get_config())))
    assert again == codec
    assert again.get_config() == codec.get_config()


@given(x=float_arrays(), seed=st.integers(0, 2**32 - 1))
def test_lossless_codecs_are_exact(x, seed):
    for spec in ("none", "none|zstd:level=1", "zstd"):
        _, decoded = Pipeline.parse(spec).roundtrip(x, rng=np.random.default_rng(seed))
        np.testing.assert_array_equal(decoded, x)


@pytest.mark.parametrize("codec_id", sorted(CODEC_PARAMS))
def test_encode_is_a_pure_function_of_the_rng(codec_id):
    x = np.random.default_rng(0).standard_normal((33, 17)).astype(np.float32)
    pipeline = Pipeline.parse(codec_id if codec_id != "zstd" else "none|zstd")
    a, _ = pipeline.roundtrip(x, rng=np.random.default_rng(7))
    b, _ = pipeline.roundtrip(x, rng=np.random.default_rng(7))
    assert [leaf.tobytes() for leaf in a.leaves()] == [leaf.tobytes() for leaf in b.leaves()]


@pytest.mark.parametrize("codec_id", sorted(set(CODEC_PARAMS) - {"zstd"}))
def test_torch_in_torch_out(codec_id):
    torch = pytest.importorskip("torch")
    x = torch.randn(20, 30)
    _, decoded = Pipeline.parse(codec_id).roundtrip(x, rng=np.random.default_rng(0))
    assert isinstance(decoded, torch.Tensor)
    assert decoded.shape == x.shape and decoded.dtype == torch.float32


@pytest.mark.parametrize("codec_id", sorted(set(CODEC_PARAMS) - {"zstd", "none"}))
def test_non_finite_input_is_refused_at_encode(codec_id):
    x = np.ones(300, dtype=np.float32)
    x[17] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        Pipeline.parse(codec_id + (":ratio=1.0" if codec_id in ("randk",) else "")).encode(
            x, rng=np.random.default_rng(0))


def test_float64_input_is_refused_with_a_clear_message():
    with pytest.raises(TypeError, match="float32"):
        Pipeline.parse("topk").encode(np.zeros(10), rng=np.random.default_rng(0))


@pytest.mark.parametrize(
    ("config", "fragment"),
    [
        ({"id": "topk", "ratio": 2.0}, "ratio must be <= 1.0"),
        ({"id": "topk", "ratio": 0}, "ratio must be > 0.0"),
        ({"id": "quant", "bits": 9}, "bits must be <= 8"),
        ({"id": "quant", "rounding": "up"}, "rounding must be one of"),
        ({"id": "topk", "approx": "yes"}, "approx must be true or false"),
        ({"id": "topk", "ratoi": 0.1}, "no parameter 'ratoi'"),
        ({"id": "nosuch"}, "unknown codec 'nosuch'"),
    ],
)
def test_bad_configs_name_the_bad_value(config, fragment):
    with pytest.raises(SpecError, match=fragment):
        get_codec(config)


def test_registry_refuses_to_overwrite_an_id():
    with pytest.raises(ValueError, match="already registered"):

        @register_codec
        class Impostor(codec_class("topk")):  # type: ignore[misc]
            codec_id = "topk"


def test_codec_is_abstract():
    with pytest.raises(TypeError):
        Codec()  # type: ignore[abstract]
