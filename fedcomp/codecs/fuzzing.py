"""Hostile payload generation for fuzzing the decoder (tests and experiments).

Byte-level mutations (bit flips, truncation, extension, splices) mostly test the
framing and the checksum; one changes the stored header's bytes and re-frames them
with a valid checksum, to reach the zstd decoder, the JSON parser and the predicted
header's reader. Structure-aware mutations edit the JSON header or the
body and then re-frame the payload with a *valid* checksum, as an attacker would,
so that they reach the checks behind it: lying shapes and counts, wrong codecs, bad
indices, NaN values, leaves that overrun the body.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np
import zstandard

from fedcomp.codecs.compact_header import read_header
from fedcomp.codecs.wire import MAGIC, compact_layout, known_layout_dictionary

__all__ = ["MUTATIONS", "assemble", "mutate", "split"]

_PREFIX = struct.Struct("<4sBBHIII")


def split(payload: bytes, expected: Any = None) -> tuple[dict[str, Any], bytes]:
    """Return (header object, body bytes) of a valid payload; a predicted header
    needs the receiver's ``expected`` tensors."""
    _, _, flags, check, header_len, _, body_len = _PREFIX.unpack(payload[: _PREFIX.size])
    stored = payload[_PREFIX.size: _PREFIX.size + header_len]
    body = payload[_PREFIX.size + header_len: _PREFIX.size + header_len + body_len]
    if flags & 4:
        if expected is None:
            raise ValueError("a predicted header is read against the expected tensors")
        return read_header(stored, compact_layout(expected)), bytes(body)
    if flags & 2:  # against a layout dictionary: one this process built (it packed it)
        dictionary = known_layout_dictionary(check)
        if dictionary is None:
            raise ValueError(f"no layout dictionary with check {check:#06x} was built here")
        raw = zstandard.ZstdDecompressor(dict_data=dictionary.zstd).decompress(stored)
    else:
        raw = zstandard.ZstdDecompressor().decompress(stored) if flags & 1 else stored
    return json.loads(raw), bytes(body)


def assemble(header: dict[str, Any] | bytes, body: bytes, *, version: int = 1,
             flags: int = 0, raw_len: int | None = None, check: int = 0) -> bytes:
    """Frame a header (object or raw bytes) and a body with a valid CRC."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    out = bytearray(_PREFIX.pack(MAGIC, version, flags, check, len(raw),
                                 len(raw) if raw_len is None else raw_len, len(body)))
    out += raw + body
    out += struct.pack("<I", zlib.crc32(out))
    return bytes(out)


# ------------------------------------------------------------------ byte level
def _flip(p: bytes, rng: np.random.Generator) -> bytes:
    out = bytearray(p)
    for _ in range(int(rng.integers(1, 9))):
        out[int(rng.integers(len(out)))] ^= 1 << int(rng.integers(8))
    return bytes(out)


def _truncate(p: bytes, rng: np.random.Generator) -> bytes:
    return p[: int(rng.integers(len(p)))]


def _extend(p: bytes, rng: np.random.Generator) -> bytes:
    return p + rng.bytes(int(rng.integers(1, 64)))


def _header_bytes(p: bytes, rng: np.random.Generator) -> bytes:
    """Bytes of the stored header (JSON, zstd or predicted) changed, dropped or added,
    re-framed with its flags and layout check and a valid CRC: reaches the zstd
    decoder, the JSON parser and the predicted header's reader."""
    _, _, flags, check, header_len, raw_len, body_len = _PREFIX.unpack(p[: _PREFIX.size])
    stored = bytearray(p[_PREFIX.size: _PREFIX.size + header_len])
    body = p[_PREFIX.size + header_len: _PREFIX.size + header_len + body_len]
    for _ in range(int(rng.integers(1, 4))):
        at = int(rng.integers(len(stored) + 1))
        action = int(rng.integers(3))
        if action == 0 and at < len(stored):
            stored[at] = int(rng.integers(256))
        elif action == 1 and at < len(stored):
            del stored[at]
        else:
            stored[at:at] = rng.bytes(int(rng.integers(1, 4)))
    compressed = flags & 1
    return assemble(bytes(stored), body, flags=flags, check=check,
                    raw_len=raw_len if compressed else len(stored))


def _splice(p: bytes, rng: np.random.Generator) -> bytes:
    start = int(rng.integers(len(p)))
    stop = min(len(p), start + int(rng.integers(1, 32)))
    return p[:start] + rng.bytes(int(rng.integers(0, 40))) + p[stop:]


# ------------------------------------------------------------------ structure aware
_HOSTILE_VALUES: list[Any] = [
    0, -1, 1, 7, 255, 2**16, 2**31, 2**32 + 1, 2**63, 2**64 + 5, -(2**63), 1.5, 1e308,
    "x", "topk", "none", "", [], {}, None, True, [2**40, 2**40], [3, -1], [[1]],
    ["<f4", 10**9], ["|u1", -3], ["<f8", 4], {"c": "topk", "m": {}, "p": {}},
]


def _paths(obj: Any, prefix: tuple = ()) -> list[tuple]:
    paths = [prefix]
    if isinstance(obj, dict):
        for key, value in obj.items():
            paths += _paths(value, (*prefix, key))
    elif isinstance(obj, list):
        for i, value in enumerate(obj):
            paths += _paths(value, (*prefix, i))
    return paths


def _set(obj: Any, path: tuple, value: Any) -> Any:
    if not path:
        return value
    parent = obj
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = value
    return obj


def _header_value(p: bytes, rng: np.random.Generator) -> bytes:
    header, body = split(p)
    paths = _paths(header)[1:]
    path = paths[int(rng.integers(len(paths)))]
    value = _HOSTILE_VALUES[int(rng.integers(len(_HOSTILE_VALUES)))]
    return assemble(_set(header, path, value), body)


def _header_delete(p: bytes, rng: np.random.Generator) -> bytes:
    header, body = split(p)
    containers = [path for path in _paths(header) if _get(header, path)]
    path = containers[int(rng.integers(len(containers)))]
    target = _get(header, path)
    if isinstance(target, dict):
        del target[list(target)[int(rng.integers(len(target)))]]
    elif isinstance(target, list):
        del target[int(rng.integers(len(target)))]
    return assemble(header, body)


def _get(obj: Any, path: tuple) -> Any:
    for key in path:
        obj = obj[key]
    return obj if isinstance(obj, dict | list) else None


def _is_leaf(node: Any) -> bool:
    return (isinstance(node, list) and len(node) == 2 and isinstance(node[0], str)
            and isinstance(node[1], int))


def _leaf_count(p: bytes, rng: np.random.Generator) -> bytes:
    header, body = split(p)
    leaves = [path for path in _paths(header) if _is_leaf(_get(header, path))]
    if not leaves:
        return _header_value(p, rng)
    leaf = _get(header, leaves[int(rng.integers(len(leaves)))])
    leaf[1] = max(0, leaf[1] + int(rng.integers(-3, 4)))
    return assemble(header, body)


def _body_bytes(p: bytes, rng: np.random.Generator) -> bytes:
    header, body = split(p)
    if not body:
        return _header_value(p, rng)
    out = bytearray(body)
    for _ in range(int(rng.integers(1, 6))):
        out[int(rng.integers(len(out)))] = int(rng.integers(256))
    return assemble(header, bytes(out))


def _body_floats(p: bytes, rng: np.random.Generator) -> bytes:
    header, body = split(p)
    if len(body) < 4:
        return _header_value(p, rng)
    out = bytearray(body)
    at = int(rng.integers(len(out) - 3))
    bad = [np.nan, np.inf, -np.inf, 3e38, 1e-45][int(rng.integers(5))]
    out[at: at + 4] = np.array([bad], np.float32).tobytes()
    return assemble(header, bytes(out))


def _spec(p: bytes, rng: np.random.Generator) -> bytes:
    header, body = split(p)
    specs = ["none", "topk", "topk:ratio=0.5|quant:bits=8", "zstd|topk", "sign",
             "quant:bits=9", "x" * 600, "lowrank:rank=4096"]
    if header.get("specs"):
        header["specs"][int(rng.integers(len(header["specs"])))] = specs[
            int(rng.integers(len(specs)))]
    return assemble(header, body)


def _resize_body(p: bytes, rng: np.random.Generator) -> bytes:
    header, body = split(p)
    if rng.random() < 0.5 and body:
        return assemble(header, body[: int(rng.integers(len(body)))])
    return assemble(header, body + rng.bytes(int(rng.integers(1, 64))))


def _header_bomb(p: bytes, rng: np.random.Generator) -> bytes:
    """A valid header padded with up to 4 MiB of whitespace: a few kB compressed."""
    header, body = split(p)
    raw = json.dumps(header).encode()
    raw = raw[:-1] + b" " * int(rng.integers(64 << 10, 4 << 20)) + raw[-1:]
    stored = zstandard.ZstdCompressor(level=3).compress(raw)
    framed = bytearray(assemble(stored, body, flags=1, raw_len=len(raw)))
    return bytes(framed)


MUTATIONS: dict[str, Callable[[bytes, np.random.Generator], bytes]] = {
    "flip": _flip,
    "truncate": _truncate,
    "extend": _extend,
    "splice": _splice,
    "header-bytes": _header_bytes,
    "header-value": _header_value,
    "header-delete": _header_delete,
    "leaf-count": _leaf_count,
    "body-bytes": _body_bytes,
    "body-floats": _body_floats,
    "spec": _spec,
    "resize-body": _resize_body,
    "header-bomb": _header_bomb,
}


#: Mutations that work on the bytes as they are; the others edit the header object.
_BYTE_LEVEL = {"flip", "truncate", "extend", "splice", "header-bytes"}


def mutate(payload: bytes, rng: np.random.Generator, expected: Any = None
           ) -> tuple[str, bytes]:
    """Apply one random mutation; return its name and the hostile payload.

    A payload with a predicted header needs the receiver's ``expected`` tensors for
    the mutations that edit the header object: they edit its JSON form, which they
    frame as a JSON header."""
    names = list(MUTATIONS)
    name = names[int(rng.integers(len(names)))]
    if name not in _BYTE_LEVEL and payload[5] & 4:
        payload = assemble(*split(payload, expected))
    return name, MUTATIONS[name](payload, rng)
