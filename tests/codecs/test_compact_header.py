"""The predicted header: the same payload in fewer bytes, and hostile bytes rejected."""

from __future__ import annotations

import dataclasses
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedcomp.codecs.budget import VALUE_CHOICES
from fedcomp.codecs.compact_header import (
    CompactLayout,
    Unpredictable,
    read_header,
    write_header,
)
from fedcomp.codecs.fuzzing import assemble, split
from fedcomp.codecs.policy import CompressionPolicy, encode_update, encode_within_budget
from fedcomp.codecs.wire import compact_layout, layout_dictionary, unpack_payload
from fedcomp.errors import PayloadError

SHAPES = {"conv.weight": (16, 1, 3, 3), "conv.bias": (16,), "fc.weight": (10, 400),
          "fc.bias": (10,)}
_PREFIX = struct.Struct("<4sBBHIII")


def _policy(wire_header: str = "predicted", values=VALUE_CHOICES) -> CompressionPolicy:
    return CompressionPolicy("topk:ratio=0.01|ternary:mode=mean", budgeted=True,
                             budget_values=values, wire_header=wire_header)


def _tensors(rng: np.random.Generator, row_scaled: bool = False) -> dict[str, np.ndarray]:
    out = {}
    for name, shape in SHAPES.items():
        tensor = rng.standard_normal(shape).astype(np.float32)
        if row_scaled and tensor.ndim > 1:  # supports crowd into a few rows
            tensor *= np.logspace(0, 3, shape[0], dtype=np.float32).reshape(
                (-1,) + (1,) * (tensor.ndim - 1))
        out[name] = tensor
    return out


def _members(policy: CompressionPolicy, draw_k, draw_v) -> dict:
    """Each tensor in a member of its family (a budget's choices), or left out."""
    chosen = {}
    for name, shape in SHAPES.items():
        family = policy.family_for(shape, name)
        k = draw_k(family.numel)
        chosen[name] = None if k == 0 else family.with_choice(k, draw_v(len(family.tails)))
    return chosen


def _flags(payload: bytes) -> int:
    return _PREFIX.unpack(payload[:_PREFIX.size])[2]


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), row_scaled=st.booleans(),
       data=st.data())
def test_predicted_header_decodes_to_exactly_what_the_json_header_does(seed, row_scaled,
                                                                        data):
    """Any members of the families (any count, any value coding, tensors left out),
    any data: the predicted payload decodes to the same tensors, specs and meta as
    the JSON one, and is never larger."""
    rng = np.random.default_rng(seed)
    tensors = _tensors(rng, row_scaled)
    predicted, plain = _policy(), _policy("json")
    chosen = _members(plain, lambda n: data.draw(st.integers(0, n)),
                      lambda n: data.draw(st.integers(0, n - 1)))
    meta = {"round": data.draw(st.integers(0, 10**6)), "kind": "delta"}
    a = encode_update(tensors, plain, rng=np.random.default_rng(seed), pipelines=chosen,
                      meta=meta)
    b = encode_update(tensors, predicted, rng=np.random.default_rng(seed), pipelines=chosen,
                      meta=meta)
    assert len(b.payload) <= len(a.payload)
    expected = plain.expected(SHAPES)
    da, db = unpack_payload(a.payload, expected=expected), unpack_payload(b.payload,
                                                                          expected=expected)
    assert da.meta == db.meta == meta and da.specs == db.specs
    for name in SHAPES:
        np.testing.assert_array_equal(da.tensors[name], db.tensors[name])
        np.testing.assert_array_equal(db.tensors[name], b.decoded[name])


def test_a_budgeted_payload_spends_the_header_bytes_it_saves_on_values():
    """MNIST-1D's transformer (31 tensors) at 400x, the same update: the predicted
    header is sent, is much smaller than the JSON one, and the budget keeps more
    entries with the bytes it frees."""
    from fedcomp.codecs.budget import parse_budget
    from fedcomp.tasks.models import model_shapes

    shapes = model_shapes("mnist1d")
    rng = np.random.default_rng(3)
    tensors = {n: rng.laplace(size=s).astype(np.float32) for n, s in shapes.items()}
    budget = parse_budget("400x").payload_bytes(sum(int(np.prod(s)) for s in shapes.values()))
    kept, headers = {}, {}
    for form in ("json", "predicted"):
        update = encode_within_budget(tensors, _policy(form), budget,
                                      rng=np.random.default_rng(0), meta={"round": 1})
        assert update.nbytes <= budget
        headers[form] = _PREFIX.unpack(update.payload[:_PREFIX.size])[4]
        kept[form] = sum(c.count for c in update.choices.values())
        if form == "predicted":
            assert _flags(update.payload) == 4
    assert headers["predicted"] * 2 < headers["json"]
    assert kept["predicted"] > kept["json"]


def test_trees_the_prediction_misses_travel_whole():
    """A tree whose structure differs from the prediction (another index coding) is
    written out; it decodes to what was sent."""
    layout = _layout({"t": (8, 16)})
    predicted = layout.predict((8, 16), "x")
    real = {"c": "topk", "m": {"shape": [8, 16], "count": 3, "ix": "raw"},
            "p": {"values": ["<f4", 3], "ix_raw": ["<u2", 3]}}
    header = {"v": 1, "meta": {"round": 2, "note": "é"}, "specs": ["x"],
              "tensors": [["t", [8, 16], 0, real]]}
    assert predicted["m"]["ix"] == "bitmap"
    assert read_header(write_header(header, layout), layout) == header


def test_only_the_fields_that_differ_travel():
    layout = _layout({"t": (8, 16)})
    tree = layout.predict((8, 16), "x")
    header = {"v": 1, "meta": {}, "specs": ["x"], "tensors": [["t", [8, 16], 0, tree]]}
    same = write_header(header, layout)
    # No meta, one tensor, #0, member 0, no edits; the predictions' 16-bit check.
    assert same[:-2] == bytes([0, 1, 0, 0, 0])
    edited = {**tree, "m": {**tree["m"], "count": 5}, "p": {**tree["p"],
                                                             "values": ["<f4", 5]}}
    header["tensors"][0][3] = edited
    written = write_header(header, layout)
    assert len(written) == len(same) + 4  # two edits: a position and a difference each
    assert read_header(written, layout)["tensors"][0][3] == edited


def _layout(shapes: dict[str, tuple[int, ...]]) -> CompactLayout:
    """A hand-made layout: every tensor's one member predicts a bitmap-coded Top-4."""
    def predict(shape, spec):
        return {"c": "topk", "m": {"shape": list(shape), "count": 4, "ix": "bitmap"},
                "p": {"values": ["<f4", 4], "ix_bitmap": ["|u1", 16]}}
    return CompactLayout(
        names=tuple(sorted(shapes)), shapes=shapes,
        members={n: (lambda code: "x" if code == 0 else None) for n in shapes},
        member_codes={n: (lambda spec: 0 if spec == "x" else None) for n in shapes},
        predict=predict, strings=("topk", "shape", "count", "ix", "bitmap", "values",
                                  "ix_bitmap", "<f4", "|u1", "round"))


def test_a_receiver_that_predicts_otherwise_rejects_the_payload():
    layout = _layout({"t": (8, 16)})
    tree = layout.predict((8, 16), "x")
    header = {"v": 1, "meta": {}, "specs": ["x"], "tensors": [["t", [8, 16], 0, tree]]}
    written = write_header(header, layout)

    def other_prediction(shape, spec):
        out = layout.predict(shape, spec)
        return {**out, "m": {**out["m"], "ix": "rice"}}
    other = dataclasses.replace(layout, predict=other_prediction)
    with pytest.raises(PayloadError, match="predictions differ") as info:
        read_header(written, other)
    assert info.value.reason == "codec"


def test_values_the_form_cannot_carry_fall_back_to_json():
    layout = _layout({"t": (8, 16)})
    header = {"v": 1, "meta": {"x": {"nested": 1}}, "specs": ["x"], "tensors": []}
    with pytest.raises(Unpredictable):
        write_header(header, layout)
    header = {"v": 1, "meta": {}, "specs": ["y"],
              "tensors": [["t", [8, 16], 0, layout.predict((8, 16), "y")]]}
    with pytest.raises(Unpredictable):
        write_header(header, layout)  # not a member of the layout


# ------------------------------------------------------------------ hostile bytes
def _budgeted_payload(seed: int = 0) -> tuple[bytes, dict]:
    policy = _policy()
    update = encode_within_budget(_tensors(np.random.default_rng(seed)), policy, 600,
                                  rng=np.random.default_rng(seed), meta={"round": 4})
    assert _flags(update.payload) == 4
    return update.payload, policy.expected(SHAPES)


def _reframe(payload: bytes, header: bytes) -> bytes:
    """The payload with another predicted header, its check kept, a valid CRC."""
    _, _, flags, check, header_len, _, body_len = _PREFIX.unpack(payload[:_PREFIX.size])
    body = payload[_PREFIX.size + header_len:_PREFIX.size + header_len + body_len]
    return assemble(header, body, flags=flags, check=check)


def _reason(payload: bytes, expected) -> str:
    with pytest.raises(PayloadError) as info:
        unpack_payload(payload, expected=expected)
    return info.value.reason


def test_a_predicted_header_needs_the_receivers_layout():
    payload, expected = _budgeted_payload()
    assert _reason(payload, None) == "codec"
    other = CompressionPolicy("topk:ratio=0.01|quant:bits=4", budgeted=True)
    assert _reason(payload, other.expected(SHAPES)) == "codec"
    header, body = split(payload, expected)  # its JSON form decodes the same
    again = unpack_payload(assemble(header, body), expected=expected)
    for name, value in unpack_payload(payload, expected=expected).tensors.items():
        np.testing.assert_array_equal(again.tensors[name], value)


def test_every_truncation_or_extension_of_the_header_is_rejected():
    payload, expected = _budgeted_payload()
    header_len = _PREFIX.unpack(payload[:_PREFIX.size])[4]
    stored = payload[_PREFIX.size:_PREFIX.size + header_len]
    for cut in range(len(stored)):
        _reason(_reframe(payload, stored[:cut]), expected)
    assert _reason(_reframe(payload, stored + b"\0"), expected) == "size"


def test_lies_in_a_predicted_header_are_named():
    payload, expected = _budgeted_payload()
    names = sorted(expected)
    fc = names.index("fc.weight")

    def lie(parts: list[bytes]) -> str:
        with pytest.raises(PayloadError) as info:
            unpack_payload(_reframe(payload, b"".join(parts)), expected=expected)
        return str(info.value)

    no_meta = b"\x00"
    assert "exceeds" in lie([no_meta, b"\x01", bytes([len(names)]), b"\x00\x00"])
    assert "appears twice" in lie([no_meta, b"\x02", bytes([fc, 0, 0, fc, 0, 0])])
    assert "not in its family" in lie([no_meta, b"\x01", bytes([fc]),
                                       b"\xff\xff\xff\xff\x7f", b"\x00"])
    assert "edit of field" in lie([no_meta, b"\x01", bytes([fc, 0, 2, 60, 0])])
    assert "varint of more" in lie([no_meta, b"\x01", bytes([fc]), b"\xff" * 11])
    assert "not UTF-8" in lie([b"\x01\x00\x02\xff\xfe", b"\x00", b"\x00"])
    assert "non-finite" in lie([b"\x01\x00\x01k\x04", struct.pack("<d", float("nan")),
                                b"\x00"])
    assert "neither a literal" in lie([no_meta, b"\x01", bytes([fc, 0, 3])])


@settings(max_examples=300, deadline=None)
@given(noise=st.binary(min_size=0, max_size=64))
def test_random_header_bytes_raise_only_payload_error(noise):
    payload, expected = _budgeted_payload()
    try:
        decoded = unpack_payload(_reframe(payload, noise), expected=expected)
    except PayloadError as exc:
        assert exc.reason != "invalid", exc  # every rejection is a named check
    else:
        for name, value in decoded.tensors.items():
            assert value.shape == SHAPES[name] and np.isfinite(value).all()


def test_the_layout_string_table_is_the_same_on_both_sides():
    """Sender and receiver build the table from the layout alone."""
    a = compact_layout(_policy().expected(SHAPES))
    b = compact_layout(_policy("json").expected(dict(reversed(list(SHAPES.items())))))
    assert a.strings == b.strings == layout_dictionary(_policy().expected(SHAPES)).strings
    assert {"topk", "ternary", "quant", "bitmap", "rice", "round"} <= set(a.strings)
