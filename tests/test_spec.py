"""Spec strings: parse and print round-trip; bad specs name the problem."""

from __future__ import annotations

import pytest
from hypothesis import given

from fedcomp.codecs.pipeline import Pipeline
from fedcomp.codecs.spec import format_spec, parse_spec
from fedcomp.errors import SpecError
from tests.strategies import transform_then_bytes_specs


@given(configs=transform_then_bytes_specs())
def test_printing_then_parsing_gives_the_same_pipeline(configs):
    pipeline = Pipeline.from_config({"id": "pipeline", "stages": configs})
    again = Pipeline.parse(pipeline.spec)
    assert again == pipeline
    assert again.spec == pipeline.spec  # the canonical form is a fixed point


@given(configs=transform_then_bytes_specs())
def test_format_and_parse_are_inverse_on_configs(configs):
    assert parse_spec(format_spec(configs)) == configs


@pytest.mark.parametrize(
    "spec",
    [
        "none",
        "topk:ratio=0.01|quant:bits=4|zstd:level=3",
        "topk:ratio=0.001|ternary:mode=mean",
        "randk:ratio=0.01",
        "quant:bits=8",
        "qsgd:levels=4",
        "sign",
        "lowrank:rank=4|fp16",
        "topk:ratio=0.01,approx=true,trim=true",
    ],
)
def test_canonical_specs_print_back_identically(spec):
    assert Pipeline.parse(spec).spec == spec


def test_whitespace_and_default_values_are_normalized():
    assert Pipeline.parse(" topk : ratio=0.01 , approx=false | zstd ").spec == (
        "topk:ratio=0.01|zstd:level=3")


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        ("", "empty codec spec"),
        ("topk:ratio", "write key=value"),
        ("topk:ratio=0.1,ratio=0.2", "given twice"),
        ("Top-K", "bad stage name"),
        ("topk:ratio=0.1$", "cannot read value"),
        ("zstd|topk", "put byte stages"),
        ("|".join(["fp16"] * 9), "at most 8"),
        ("topk:ratio=1.5", "ratio must be <= 1.0"),
        ("tokp", "unknown codec 'tokp'"),
    ],
)
def test_bad_specs_raise_spec_error_naming_the_problem(spec, fragment):
    with pytest.raises(SpecError, match=fragment):
        Pipeline.parse(spec)
