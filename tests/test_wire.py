"""Wire format: round trips, framing, and every kind of lie a header can tell."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from fedcomp.codecs.fuzzing import assemble, split
from fedcomp.codecs.pipeline import Pipeline
from fedcomp.codecs.policy import CompressionPolicy, encode_update
from fedcomp.codecs.wire import (
    OVERHEAD_BYTES,
    ExpectedTensor,
    layout_dictionary,
    pack_payload,
    unpack_payload,
)
from fedcomp.errors import PayloadError

SHAPES = {"conv.weight": (16, 1, 3, 3), "conv.bias": (16,), "fc.weight": (10, 400)}
POLICY = CompressionPolicy(codec="topk:ratio=0.05|quant:bits=4", min_numel=100)


def _update(seed: int = 0, policy: CompressionPolicy = POLICY, **meta) -> bytes:
    rng = np.random.default_rng(seed)
    tensors = {n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}
    return encode_update(tensors, policy, rng=rng, meta=meta or None).payload


def _decode(payload: bytes, policy: CompressionPolicy = POLICY):
    return unpack_payload(payload, expected=policy.expected(SHAPES))


def test_round_trip_keeps_names_shapes_meta_and_the_small_tensor_policy():
    rng = np.random.default_rng(1)
    tensors = {n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}
    update = encode_update(tensors, POLICY, rng=rng, meta={"round": 7, "model": "abc"})
    decoded = _decode(update.payload)
    assert decoded.meta == {"round": 7, "model": "abc"}
    assert decoded.nbytes == len(update.payload)
    for name in SHAPES:
        np.testing.assert_array_equal(decoded.tensors[name], update.decoded[name])
    np.testing.assert_array_equal(decoded.tensors["conv.bias"], tensors["conv.bias"])  # small
    assert decoded.specs["conv.bias"] == "none"
    assert decoded.specs["fc.weight"] == "topk:ratio=0.05|quant:bits=4"


def test_payload_size_is_framing_plus_header_plus_body():
    payload = _update()
    header, body = split(payload)
    assert len(payload) == OVERHEAD_BYTES + len(body) + struct.unpack_from("<I", payload, 8)[0]
    assert header["v"] == 1 and len(header["tensors"]) == 3


def test_headers_are_compressed_only_when_that_is_smaller():
    assert pack_payload([])[5] == 0  # flags: a 40-byte header does not shrink
    rng = np.random.default_rng(0)
    tensors = {n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}
    plain = encode_update(tensors, POLICY, rng=rng, layout_dictionary=False).payload
    assert plain[5] == 1 and struct.unpack_from("<H", plain, 6)[0] == 0


def _header_len(payload: bytes) -> int:
    return struct.unpack_from("<I", payload, 8)[0]


def test_the_layout_dictionary_shrinks_the_header_and_decodes_to_the_same_values():
    rng = np.random.default_rng(3)
    tensors = {n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}
    plain = encode_update(tensors, POLICY, rng=np.random.default_rng(1), meta={"round": 4},
                          layout_dictionary=False)
    packed = encode_update(tensors, POLICY, rng=np.random.default_rng(1), meta={"round": 4})
    assert packed.payload[5] == 3
    assert struct.unpack_from("<H", packed.payload, 6)[0] == (
        layout_dictionary(POLICY.expected(SHAPES)).check)
    # Same body, a header at most a third the size of plain zstd's.
    assert len(plain.payload) - len(packed.payload) == (
        _header_len(plain.payload) - _header_len(packed.payload))
    assert 3 * _header_len(packed.payload) < _header_len(plain.payload)
    a, b = _decode(plain.payload), _decode(packed.payload)
    assert a.meta == b.meta == {"round": 4}
    for name in SHAPES:
        np.testing.assert_array_equal(a.tensors[name], b.tensors[name])


def test_the_layout_dictionary_depends_on_names_shapes_and_specs_not_on_order():
    expected = POLICY.expected(SHAPES)
    reordered = dict(reversed(list(expected.items())))
    assert layout_dictionary(reordered).check == layout_dictionary(expected).check
    other_shapes = {**SHAPES, "fc.weight": (10, 401)}
    other_codec = CompressionPolicy(codec="topk:ratio=0.05|quant:bits=3", min_numel=100)
    checks = {layout_dictionary(expected).check,
              layout_dictionary(POLICY.expected(other_shapes)).check,
              layout_dictionary(other_codec.expected(SHAPES)).check}
    assert len(checks) == 3


def test_a_receiver_with_another_layout_rejects_the_payload_as_a_codec_mismatch():
    payload = _update()
    other = CompressionPolicy(codec="topk:ratio=0.05|quant:bits=3", min_numel=100)
    with pytest.raises(PayloadError, match="another layout") as info:
        unpack_payload(payload, expected=other.expected(SHAPES))
    assert info.value.reason == "codec" and "quant:bits=3" in str(info.value)
    # A receiver that was not told what to expect cannot rebuild the dictionary.
    assert _reason(payload, unchecked=True) == "codec"
    # A dictionary flag without zstd, or a check without the flag, is not a format we know.
    header, body = split(payload)
    forged = bytearray(assemble(header, body))
    forged[6] = 7
    assert _reason(_recrc(bytes(forged))) == "version"
    forged = bytearray(payload)
    forged[5] = 2
    assert _reason(_recrc(bytes(forged))) == "version"


def _recrc(payload: bytes) -> bytes:
    import zlib
    body = payload[:-4]
    return body + struct.pack("<I", zlib.crc32(body))


def _reason(payload: bytes, **kwargs) -> str:
    with pytest.raises(PayloadError) as info:
        if kwargs.pop("unchecked", False):
            unpack_payload(payload, **kwargs)
        else:
            _decode(payload)
    return info.value.reason


def test_every_truncation_is_rejected():
    payload = _update()
    for cut in range(0, len(payload), 7):
        assert _reason(payload[:cut]) in {"truncated", "size", "checksum"}


def test_extension_bad_magic_version_flags_and_checksum_are_rejected():
    payload = _update()
    assert _reason(payload + b"\0") == "size"
    assert _reason(b"XXXX" + payload[4:]) == "magic"
    header, body = split(payload)
    assert _reason(assemble(header, body, version=2)) == "version"
    assert _reason(assemble(header, body, flags=8)) == "version"
    assert _reason(assemble(header, body, flags=4 | 1)) == "version"
    corrupted = bytearray(payload)
    corrupted[len(payload) // 2] ^= 0x10
    assert _reason(bytes(corrupted)) == "checksum"


def _lie(edit, payload: bytes | None = None, body_edit=None) -> str:
    header, body = split(payload or _update())
    edit(header)
    if body_edit is not None:
        body = body_edit(bytearray(body))
    return _reason(assemble(header, bytes(body)))


def _tensor(header: dict, name: str) -> list:
    return next(t for t in header["tensors"] if t[0] == name)


def test_shape_lies_are_rejected():
    def huge(h):
        _tensor(h, "fc.weight")[1] = [2**40, 2**40]
    assert _lie(huge) == "model"
    # Without an expected model the product is still bounded (no overflow, no alloc).
    header, body = split(_update())
    _tensor(header, "fc.weight")[1] = [2**62, 2**62]
    assert _reason(assemble(header, body), unchecked=True) == "size"


def test_counts_larger_than_the_tensor_are_rejected():
    def count(h):
        _tensor(h, "fc.weight")[3]["m"]["count"] = 4001
    assert _lie(count) == "size"


def test_unsorted_duplicate_and_out_of_range_indices_are_rejected():
    policy = CompressionPolicy(codec="topk:k=3", min_numel=100)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((10, 400)).astype(np.float32)
    expected = {"w": ExpectedTensor((10, 400), Pipeline.parse("topk:k=3"))}
    payload = encode_update({"w": x}, policy, rng=rng).payload
    header, body = split(payload)
    tree = header["tensors"][0][3]
    # Re-code the indices as raw uint16 so we can write any index we like.
    for bad, reason in (([5, 3, 9], "indices"), ([3, 3, 9], "indices"), ([1, 2, 4000], "indices")):
        tree["m"] = {**tree["m"], "ix": "raw"}
        values = body[:12]
        tree["p"] = {"values": ["<f4", 3], "ix_raw": ["<u2", 3]}
        forged = assemble(header, values + np.array(bad, np.uint16).tobytes())
        with pytest.raises(PayloadError) as info:
            unpack_payload(forged, expected=expected)
        assert info.value.reason == reason


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nan_or_inf_values_are_rejected(bad):
    plain = CompressionPolicy(codec="none")
    header, body = split(_update(policy=plain))
    body = bytearray(body)
    body[0:4] = np.array([bad], np.float32).tobytes()  # first float of conv.weight
    with pytest.raises(PayloadError) as info:
        _decode(assemble(header, bytes(body)), policy=plain)
    assert info.value.reason == "non-finite"


def test_a_zstd_frame_that_expands_past_its_declared_size_is_rejected():
    policy = CompressionPolicy(codec="topk:ratio=0.05|zstd", min_numel=100)
    payload = _update(policy=policy)
    header, body = split(payload)
    import zstandard
    bomb = zstandard.ZstdCompressor(write_content_size=False).compress(bytes(10**7))
    tree = _tensor(header, "fc.weight")[3]
    # Replace the values' frame: fix up the leaf size and rebuild the body in order.
    leaves = []
    offset = 0

    def walk(node):
        nonlocal offset
        if isinstance(node, list):
            size = node[1] * np.dtype(node[0]).itemsize
            leaves.append([node, body[offset: offset + size]])
            offset += size
            return
        for part in node["p"].values():
            walk(part)

    for entry in header["tensors"]:
        walk(entry[3])
    target = tree["p"]["values"]["p"]["frame"]
    for leaf in leaves:
        if leaf[0] is target:
            leaf[1] = bomb
            target[1] = len(bomb)
    forged = assemble(header, b"".join(leaf[1] for leaf in leaves))
    with pytest.raises(PayloadError) as info:
        unpack_payload(forged, expected=policy.expected(SHAPES))
    assert info.value.reason == "zstd"


def test_payloads_for_another_model_or_codec_are_rejected():
    assert _lie(lambda h: _tensor(h, "fc.weight").__setitem__(0, "fc2.weight")) == "model"
    assert _lie(lambda h: h["tensors"].pop()) == "model"
    other = CompressionPolicy(codec="topk:ratio=0.05|quant:bits=8", min_numel=100)
    assert _reason(_update(policy=other)) == "codec"


@pytest.mark.parametrize(
    "raw_header",
    [
        b"[" * 100_000 + b"]" * 100_000,                    # nesting bomb
        b'{"v":1,"v":1,"meta":{},"specs":[],"tensors":[]}',  # duplicate key
        b'{"v":1,"meta":{"x":NaN},"specs":[],"tensors":[]}',  # NaN constant
        b"\xff\xfe not utf-8",
        b'{"v":1,"meta":{},"specs":[],"tensors":[]',          # unterminated
        b'{"v":2,"meta":{},"specs":[],"tensors":[]}',         # header version
    ],
)
def test_hostile_json_headers_are_rejected(raw_header):
    with pytest.raises(PayloadError):
        unpack_payload(assemble(raw_header, b""))


def test_a_compressed_header_that_lies_about_its_size_is_rejected():
    import zstandard
    raw = json.dumps({"v": 1, "meta": {}, "specs": [], "tensors": []}).encode()
    frame = zstandard.ZstdCompressor().compress(raw)
    with pytest.raises(PayloadError, match="prefix says"):
        unpack_payload(assemble(frame, b"", flags=1, raw_len=len(raw) - 5))


def test_an_empty_update_round_trips():
    decoded = unpack_payload(pack_payload([], {"round": 1}))
    assert decoded.tensors == {} and decoded.meta == {"round": 1}


def test_the_reference_input_has_distinct_magnitudes_so_every_top_k_agrees():
    # The layout dictionary must be byte-identical on every machine: with no two equal
    # magnitudes, any correct Top-K (whatever its tie-breaking) keeps the same support.
    from fedcomp.codecs.wire import _reference_input
    values = _reference_input((1 << 20,))
    assert values.dtype == np.float32 and np.unique(np.abs(values)).size == values.size
    np.testing.assert_array_equal(_reference_input((4, 5)).ravel(), _reference_input((20,)))


def test_a_header_bomb_is_refused_before_it_is_inflated():
    from fedcomp.codecs.fuzzing import MUTATIONS
    from fedcomp.codecs.policy import CompressionPolicy, encode_update
    from fedcomp.codecs.wire import header_cap
    from fedcomp.tasks.models import model_shapes

    shapes = model_shapes("digits")
    policy = CompressionPolicy("topk:ratio=0.01|quant:bits=4")
    rng = np.random.default_rng(0)
    payload = encode_update({k: rng.standard_normal(s).astype(np.float32)
                             for k, s in shapes.items()}, policy, rng=rng,
                            meta={"round": 1}).payload
    bomb = MUTATIONS["header-bomb"](payload, rng)
    assert len(bomb) < 64 << 10  # a few kB on the wire ...
    with pytest.raises(PayloadError, match="too large") as caught:
        unpack_payload(bomb, expected=policy.expected(shapes))  # ... refused unread
    assert caught.value.reason == "size"
    assert header_cap(policy.expected(shapes)) == (8 + 2 * len(shapes)) << 10
    # A real header of this model fits with room to spare.
    assert unpack_payload(payload, expected=policy.expected(shapes)).meta == {"round": 1}
