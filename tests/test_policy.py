"""Compression policy: which pipeline each tensor gets, per-tensor overrides."""

from __future__ import annotations

import numpy as np
import pytest

from fedcomp.codecs.feedback import ErrorFeedback, StateMismatchError
from fedcomp.codecs.policy import CompressionPolicy, encode_update, parse_overrides
from fedcomp.codecs.wire import unpack_payload
from fedcomp.config import RunConfig
from fedcomp.errors import PayloadError, SpecError

SHAPES = {"conv1.weight": (32, 1, 3, 3), "conv1.bias": (32,), "conv2.weight": (64, 32, 3, 3),
          "fc1.weight": (128, 3136), "fc2.weight": (10, 128)}


def _update(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}


def test_parse_overrides_reads_patterns_and_specs_that_contain_equals_signs():
    text = " conv*.weight = topk:ratio=0.1|quant:bits=4 ;fc2.*=fp16; "
    assert parse_overrides(text) == (("conv*.weight", "topk:ratio=0.1|quant:bits=4"),
                                     ("fc2.*", "fp16"))
    assert parse_overrides("") == ()


@pytest.mark.parametrize(("text", "fragment"), [
    ("conv2.weight", "must be 'PATTERN=SPEC'"),
    ("=fp16", "must be 'PATTERN=SPEC'"),
    ("conv2.weight=", "must be 'PATTERN=SPEC'"),
    ("conv2.weight=topk:ratio=2", "ratio must be <= 1.0"),
    ("conv2.weight=nosuchcodec", "nosuchcodec"),
])
def test_bad_overrides_are_refused_naming_the_entry(text, fragment):
    with pytest.raises(SpecError, match=fragment):
        parse_overrides(text)


def test_the_first_matching_override_wins_and_the_rest_fall_back_to_size():
    policy = CompressionPolicy("topk:ratio=0.003|quant:bits=4", "fp16", 1024, overrides=(
        ("conv2.weight", "topk:ratio=0.1|quant:bits=4"),
        ("conv*.weight", "quant:bits=8"),
        ("fc2.*", "quant:bits=8")))
    specs = {name: spec.pipeline.spec for name, spec in policy.expected(SHAPES).items()}
    assert specs == {"conv1.weight": "quant:bits=8",      # small, but an override matches
                     "conv1.bias": "fp16",                 # small: the small codec
                     "conv2.weight": "topk:ratio=0.1|quant:bits=4",  # first match wins
                     "fc1.weight": "topk:ratio=0.003|quant:bits=4",  # large: the codec
                     "fc2.weight": "quant:bits=8"}
    # Without a name (old callers) the size rule alone decides.
    assert policy.pipeline_for((64, 32, 3, 3)).spec == "topk:ratio=0.003|quant:bits=4"


def test_an_overridden_tensor_is_encoded_with_its_own_pipeline():
    plain = CompressionPolicy("topk:ratio=0.003|quant:bits=4", "fp16")
    policy = CompressionPolicy("topk:ratio=0.003|quant:bits=4", "fp16",
                               overrides=(("conv2.weight", "topk:ratio=0.1|quant:bits=4"),))
    update = _update()
    encoded = encode_update(update, policy, rng=np.random.default_rng(0))
    decoded = unpack_payload(encoded.payload, expected=policy.expected(SHAPES))
    conv2 = decoded.tensors["conv2.weight"]
    assert np.count_nonzero(conv2) == round(0.1 * conv2.size)
    assert np.count_nonzero(decoded.tensors["fc1.weight"]) == round(0.003 * 128 * 3136)
    # The kept conv2 coordinates are its largest ones, as Top-K promises.
    kept = np.abs(update["conv2.weight"])[conv2 != 0]
    assert kept.min() >= np.sort(np.abs(update["conv2.weight"]).ravel())[-kept.size]
    # A receiver that expects the plain policy refuses the payload: the codec differs.
    with pytest.raises(PayloadError, match=r"conv2\.weight"):
        unpack_payload(encoded.payload, expected=plain.expected(SHAPES))


def test_feedback_state_saved_under_other_overrides_is_refused():
    a = CompressionPolicy("topk:ratio=0.01", overrides=(("conv2.weight", "fp16"),))
    b = CompressionPolicy("topk:ratio=0.01", overrides=(("conv2.weight", "quant:bits=8"),))
    assert a.description != b.description != CompressionPolicy("topk:ratio=0.01").description
    memory = ErrorFeedback(a.description)
    encode_update(_update(), a, feedback=memory, rng=np.random.default_rng(0))
    with pytest.raises(StateMismatchError):
        ErrorFeedback(b.description).load_state_dict(memory.state_dict())


def test_the_run_config_builds_both_policies_and_names_a_bad_key():
    cfg = RunConfig(codec_overrides="conv2.weight=topk:ratio=0.1",
                    downlink_codec_overrides="conv2.weight=topk:ratio=0.05")
    assert cfg.uplink_policy.pipeline_for((1,), "conv2.weight").spec == "topk:ratio=0.1"
    assert cfg.downlink_policy.pipeline_for((1,), "conv2.weight").spec == "topk:ratio=0.05"
    assert cfg.describe()["codec-overrides-config"][0][0] == "conv2.weight"
    with pytest.raises(SpecError, match=r"'downlink-codec-overrides'.*PATTERN=SPEC"):
        RunConfig(downlink_codec_overrides="conv2.weight")


def test_the_encoder_fingerprint_follows_the_bytes_not_the_config(monkeypatch):
    from fedcomp.codecs import sparsify
    from fedcomp.codecs.policy import encoder_fingerprint

    shapes = {"conv.weight": (8, 1, 3, 3), "conv.bias": (8,), "fc.weight": (16, 200)}
    policies = (CompressionPolicy("topk:ratio=0.05|ternary:mode=mean", min_numel=64),
                CompressionPolicy("topk:ratio=0.02|quant:bits=4", min_numel=64))
    first = encoder_fingerprint(policies, shapes)
    assert first == encoder_fingerprint(policies, shapes)  # a pure function
    assert first != encoder_fingerprint(policies[:1], shapes)
    assert first != encoder_fingerprint(
        (CompressionPolicy("topk:ratio=0.06|ternary:mode=mean", min_numel=64), policies[1]),
        shapes)
    # The same config under code that codes indices differently (no rows coding, as
    # before it existed) fingerprints differently: what a stale run looks like.
    monkeypatch.setattr(sparsify, "_row_length", lambda shape: 0)
    assert encoder_fingerprint(policies, shapes) != first
