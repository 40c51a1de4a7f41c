"""The predicted header: a payload header of a few bytes a tensor, for a known layout.

A payload's JSON header (see :mod:`fedcomp.codecs.wire`) repeats what the receiver
can work out for itself. Knowing the model's tensors and the pipeline each may use,
the receiver can encode a fixed reference input of the tensor's shape with the
pipeline the sender names and get the tree the real one almost always matches: the
same codecs, meta keys, part names and leaf dtypes, and mostly the same numbers (a
Top-K's count, the values' shape, a packed leaf's length all follow from the count).
What differs depends on the data: an index coding's Rice parameter and its streams'
lengths, a ternary's dense flag, sometimes the index coding itself. So the sender
writes, for each tensor, only

* its position among the layout's tensor names (sorted), and which member of the
  tensor's budget family it uses (:class:`fedcomp.codecs.budget.TopKFamily`'s
  Top-K count and value coding), 0 for the layout's own pipeline;
* the fields of its tree that differ from the prediction, each as a position in
  the prediction's fields and the difference (ints as zigzag varints of the
  difference, a bool's flip as nothing, strings as codes);
* or, where the structure itself differs (another index coding), the tree written
  out in full, strings coded against the layout's string table.

A Top-K tensor whose tree matches the prediction costs 3-4 bytes instead of the 25-30
that its JSON entry takes after zstd against the layout dictionary. On MNIST-1D's
transformer at 400x (188 bytes a payload) the header of 4 tensors takes about 100
bytes, the predicted one of 8-9 tensors 40-60: the budget spends the difference on
values (``experiments/bench_budget.py``).

Floats are never predicted: one is written whole wherever the tree holds it, so a
prediction never depends on floating-point rounding. The integer fields follow from
the reference input's Top-K support, which is the same on every machine up to 2**24
entries a tensor (see :func:`fedcomp.codecs.wire._reference_input`). The header ends
with a 16-bit check of the predictions it was written against, so a receiver whose
predictions differ (another version of a codec, a tie in a larger tensor's Top-K)
rejects the payload instead of reading other fields into it.

Reading treats the bytes as hostile: every varint is at most 10 bytes, every count
is bounded before anything is built, positions must increase and lie inside the
prediction, and every byte must be used. The result is the same object a JSON
header parses to, so every check behind the header (shapes, specs, leaves against
the body, each codec's own validation) applies unchanged. Every problem raises
:class:`~fedcomp.errors.PayloadError`.

Written by hand: the format is a few varints and a string table, smaller than any
general serializer's framing (protobuf, msgpack and CBOR all spend a byte or more on
every field the prediction already gives).
"""

from __future__ import annotations

import json
import math
import struct
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fedcomp.errors import PayloadError

__all__ = ["CompactLayout", "Unpredictable", "read_header", "write_header"]

#: Longest varint accepted (70 bits).
MAX_VARINT_BYTES = 10
#: Longest string written out literally.
MAX_STRING_BYTES = 256
_FLOAT = struct.Struct("<d")
_CHECK = struct.Struct("<H")

#: Type tags of literal values (payload meta, literal trees).
_NONE, _FALSE, _TRUE, _INT, _FLOAT_TAG, _STRING, _INT_LIST = range(7)
#: Literal tree nodes.
_LEAF, _NODE = 0, 1


class Unpredictable(ValueError):
    """The sender cannot write this header in the predicted form (a value type or
    pipeline the form does not carry); it sends the JSON header instead."""


@dataclass(frozen=True)
class CompactLayout:
    """What both sides know of a layout: built from the receiver's expected tensors.

    Parameters
    ----------
    names
        The layout's tensor names, sorted; a tensor is written as its position.
    shapes
        Each tensor's shape.
    members
        ``members[name](code)``: the pipeline spec of member ``code`` of the tensor's
        family (0: the layout's own pipeline), or None for a code that names none.
    member_codes
        ``member_codes[name](spec)``: the code of a spec, or None.
    predict
        ``predict(shape, spec)``: the JSON-form tree of the reference input encoded
        with that pipeline.
    strings
        The string table: codes 1, 2, ... name its entries, 0 a literal string.
    limits
        Most meta items, int-list entries, parts and tree depth accepted.
    """

    names: tuple[str, ...]
    shapes: Mapping[str, tuple[int, ...]]
    members: Mapping[str, Callable[[int], str | None]]
    member_codes: Mapping[str, Callable[[str], int | None]]
    predict: Callable[[tuple[int, ...], str], Any]
    strings: tuple[str, ...]
    max_meta_items: int = 32
    max_list: int = 8
    max_parts: int = 16
    max_depth: int = 10


def _reject(message: str, reason: str = "header") -> PayloadError:
    return PayloadError(f"predicted header: {message}", reason=reason)


# --------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------
class _Writer:
    def __init__(self, strings: Sequence[str]) -> None:
        self.out = bytearray()
        self.codes = {s: i + 1 for i, s in enumerate(strings)}

    def uint(self, value: int) -> None:
        if value < 0:
            raise Unpredictable(f"negative varint {value}")
        while True:
            byte = value & 0x7F
            value >>= 7
            if value:
                self.out.append(byte | 0x80)
            else:
                self.out.append(byte)
                return

    def sint(self, value: int) -> None:
        self.uint(2 * value if value >= 0 else -2 * value - 1)

    def string(self, text: str) -> None:
        code = self.codes.get(text)
        if code is not None:
            self.uint(code)
            return
        raw = text.encode()
        if len(raw) > MAX_STRING_BYTES:
            raise Unpredictable(f"string of {len(raw)} bytes")
        self.uint(0)
        self.uint(len(raw))
        self.out += raw

    def real(self, value: float) -> None:
        if not math.isfinite(value):
            raise Unpredictable(f"non-finite float {value}")
        self.out += _FLOAT.pack(value)

    def value(self, value: Any) -> None:
        """A tagged literal value."""
        if value is None:
            self.uint(_NONE)
        elif isinstance(value, bool):
            self.uint(_TRUE if value else _FALSE)
        elif isinstance(value, int):
            self.uint(_INT)
            self.sint(value)
        elif isinstance(value, float):
            self.uint(_FLOAT_TAG)
            self.real(value)
        elif isinstance(value, str):
            self.uint(_STRING)
            self.string(value)
        elif isinstance(value, list) and all(_is_int(v) for v in value):
            self.uint(_INT_LIST)
            self.uint(len(value))
            for v in value:
                self.sint(v)
        else:
            raise Unpredictable(f"value {value!r:.40} has no predicted-header form")

    def meta(self, meta: Mapping[str, Any]) -> None:
        """A meta object: a count, then (string key, tagged value) pairs."""
        self.uint(len(meta))
        for key, value in meta.items():
            self.string(key)
            self.value(value)

    def tree(self, tree: Any) -> None:
        """A literal tree."""
        if isinstance(tree, list):
            self.uint(_LEAF)
            self.string(tree[0])
            self.uint(tree[1])
            return
        self.uint(_NODE)
        self.string(tree["c"])
        self.meta(tree["m"])
        self.uint(len(tree["p"]))
        for name, part in tree["p"].items():
            self.string(name)
            self.tree(part)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _kind(value: Any) -> str:
    """A field's type, part of the tree's structure."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "str"
    if isinstance(value, list) and all(_is_int(v) for v in value):
        return f"list{len(value)}"
    raise Unpredictable(f"value {value!r:.40} has no predicted-header form")


def _structure(tree: Any, fields: list[tuple[Any, Any]]) -> Any:
    """A tree's structure (codecs, meta keys and types, part names, leaf dtypes) as a
    comparable value; its fields (meta values, leaf counts) appended to ``fields`` as
    (container, key) in depth-first order."""
    if isinstance(tree, list):
        fields.append((tree, 1))
        return ("leaf", tree[0])
    meta = tuple((key, _kind(value)) for key, value in tree["m"].items())
    fields.extend((tree["m"], key) for key in tree["m"])
    parts = tuple((name, _structure(part, fields)) for name, part in tree["p"].items())
    return ("node", tree["c"], meta, parts)


def _write_field(writer: _Writer, real: Any, predicted: Any) -> None:
    """The difference of one field from its prediction (same kind)."""
    if isinstance(real, bool):
        return  # a bool that differs is the other one
    if isinstance(real, int):
        writer.sint(real - predicted)
    elif isinstance(real, float):
        writer.real(real)
    elif isinstance(real, str):
        writer.string(real)
    else:  # an int list of the predicted length
        for r, p in zip(real, predicted, strict=True):
            writer.sint(r - p)


def _write_tree(writer: _Writer, tree: Any, predicted: Any) -> None:
    real_fields: list[tuple[Any, Any]] = []
    predicted_fields: list[tuple[Any, Any]] = []
    if _structure(tree, real_fields) != _structure(predicted, predicted_fields):
        writer.uint(1)
        writer.tree(tree)
        return
    edits = [i for i, ((rc, rk), (pc, pk)) in enumerate(zip(real_fields, predicted_fields,
                                                            strict=True))
             if isinstance(rc[rk], float) or rc[rk] != pc[pk]]
    writer.uint(2 * len(edits))
    previous = -1
    for i in edits:
        writer.uint(i - previous - 1)
        previous = i
        (rc, rk), (pc, pk) = real_fields[i], predicted_fields[i]
        _write_field(writer, rc[rk], pc[pk])


def _prediction_check(tree: Any, check: int) -> int:
    return zlib.crc32(json.dumps(tree, separators=(",", ":")).encode(), check)


def write_header(header: Mapping[str, Any], layout: CompactLayout) -> bytes:
    """The predicted form of a JSON-form header (``{"v", "meta", "specs", "tensors"}``).

    Raises
    ------
    Unpredictable
        If a tensor, pipeline or value has no predicted form (the sender then sends
        the JSON header).
    """
    writer = _Writer(layout.strings)
    writer.meta(header["meta"])
    position = {name: i for i, name in enumerate(layout.names)}
    check = 0
    writer.uint(len(header["tensors"]))
    for name, shape, spec_index, tree in header["tensors"]:
        if name not in position or tuple(shape) != tuple(layout.shapes[name]):
            raise Unpredictable(f"tensor {name!r} is not in the layout")
        spec = header["specs"][spec_index]
        code = layout.member_codes[name](spec)
        if code is None:
            raise Unpredictable(f"tensor {name!r}: {spec!r} is not a member of its layout")
        writer.uint(position[name])
        writer.uint(code)
        predicted = layout.predict(tuple(shape), spec)
        check = _prediction_check(predicted, check)
        _write_tree(writer, tree, predicted)
    writer.out += _CHECK.pack(check & 0xFFFF)
    return bytes(writer.out)


# --------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------
class _Reader:
    def __init__(self, data: bytes, strings: Sequence[str]) -> None:
        self.data = data
        self.offset = 0
        self.strings = strings

    def byte(self) -> int:
        if self.offset >= len(self.data):
            raise _reject("ends early", "truncated")
        self.offset += 1
        return self.data[self.offset - 1]

    def uint(self, bound: int | None = None, what: str = "value") -> int:
        value = 0
        for i in range(MAX_VARINT_BYTES):
            byte = self.byte()
            value |= (byte & 0x7F) << (7 * i)
            if not byte & 0x80:
                if bound is not None and value > bound:
                    raise _reject(f"{what} {value} exceeds {bound}")
                return value
        raise _reject(f"varint of more than {MAX_VARINT_BYTES} bytes")

    def sint(self) -> int:
        value = self.uint()
        return value >> 1 if not value & 1 else -((value + 1) >> 1)

    def string(self) -> str:
        code = self.uint(len(self.strings), "string code")
        if code:
            return self.strings[code - 1]
        length = self.uint(MAX_STRING_BYTES, "string length")
        if length > len(self.data) - self.offset:
            raise _reject("string overruns the header", "truncated")
        raw = self.data[self.offset:self.offset + length]
        self.offset += length
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise _reject("string is not UTF-8") from None

    def real(self) -> float:
        if len(self.data) - self.offset < _FLOAT.size:
            raise _reject("float overruns the header", "truncated")
        (value,) = _FLOAT.unpack_from(self.data, self.offset)
        self.offset += _FLOAT.size
        if not math.isfinite(value):
            raise _reject("holds a non-finite float", "non-finite")
        return value

    def value(self, max_list: int) -> Any:
        tag = self.uint(_INT_LIST, "value tag")
        if tag == _NONE:
            return None
        if tag in (_FALSE, _TRUE):
            return tag == _TRUE
        if tag == _INT:
            return self.sint()
        if tag == _FLOAT_TAG:
            return self.real()
        if tag == _STRING:
            return self.string()
        return [self.sint() for _ in range(self.uint(max_list, "list length"))]

    def meta(self, layout: CompactLayout, what: str) -> dict[str, Any]:
        """A meta object: a count, then (string key, tagged value) pairs."""
        meta: dict[str, Any] = {}
        for _ in range(self.uint(layout.max_meta_items, what)):
            key = self.string()
            if key in meta:
                raise _reject(f"duplicate meta key {key!r}")
            meta[key] = self.value(layout.max_list)
        return meta

    def tree(self, layout: CompactLayout, depth: int) -> Any:
        if depth > layout.max_depth:
            raise _reject("tree nested too deeply")
        if self.uint(_NODE, "tree tag") == _LEAF:
            return [self.string(), self.uint()]
        codec = self.string()
        meta = self.meta(layout, "meta items")
        parts: dict[str, Any] = {}
        for _ in range(self.uint(layout.max_parts, "parts")):
            name = self.string()
            if name in parts:
                raise _reject(f"duplicate part {name!r}")
            parts[name] = self.tree(layout, depth + 1)
        return {"c": codec, "m": meta, "p": parts}


def _copy(tree: Any) -> Any:
    if isinstance(tree, list):
        return list(tree)
    return {"c": tree["c"], "m": {k: list(v) if isinstance(v, list) else v
                                  for k, v in tree["m"].items()},
            "p": {name: _copy(part) for name, part in tree["p"].items()}}


def _read_tree(reader: _Reader, layout: CompactLayout, predicted: Any) -> Any:
    form = reader.uint(what="tree form")
    if form == 1:
        return reader.tree(layout, 0)
    tree = _copy(predicted)
    fields: list[tuple[Any, Any]] = []
    _structure(tree, fields)
    if form % 2 or form // 2 > len(fields):
        raise _reject(f"tree form {form} is neither a literal tree nor at most "
                      f"{len(fields)} edits")
    position = -1
    for _ in range(form // 2):
        position += reader.uint(what="edit position") + 1
        if position >= len(fields):
            raise _reject(f"edit of field {position}; the prediction has {len(fields)}")
        container, key = fields[position]
        old = container[key]
        if isinstance(old, bool):
            container[key] = not old
        elif isinstance(old, int):
            container[key] = old + reader.sint()
        elif isinstance(old, float):
            container[key] = reader.real()
        elif isinstance(old, str):
            container[key] = reader.string()
        elif isinstance(old, list):
            container[key] = [v + reader.sint() for v in old]
        else:
            raise _reject(f"field {position} ({old!r:.20}) cannot be edited")
    return tree


def read_header(data: bytes, layout: CompactLayout) -> dict[str, Any]:
    """The JSON-form header (``{"v": 1, "meta", "specs", "tensors"}``) that ``data``
    (a predicted header, untrusted) stands for.

    Raises
    ------
    PayloadError
        For every problem.
    """
    reader = _Reader(bytes(data), layout.strings)
    meta = reader.meta(layout, "payload meta items")
    specs: list[str] = []
    entries = []
    seen: set[int] = set()
    check = 0
    for _ in range(reader.uint(len(layout.names), "tensors")):
        index = reader.uint(len(layout.names) - 1, "tensor position")
        if index in seen:
            raise _reject(f"tensor {layout.names[index]!r} appears twice")
        seen.add(index)
        name = layout.names[index]
        code = reader.uint(what="member")
        spec = layout.members[name](code)
        if spec is None:
            raise _reject(f"tensor {name!r}: member {code} is not in its family", "codec")
        shape = tuple(layout.shapes[name])
        predicted = layout.predict(shape, spec)
        check = _prediction_check(predicted, check)
        tree = _read_tree(reader, layout, predicted)
        if spec not in specs:
            specs.append(spec)
        entries.append([name, list(shape), specs.index(spec), tree])
    if len(reader.data) - reader.offset < _CHECK.size:
        raise _reject("ends before its check", "truncated")
    (sent,) = _CHECK.unpack_from(reader.data, reader.offset)
    reader.offset += _CHECK.size
    if sent != check & 0xFFFF:
        raise _reject(f"the sender's predictions differ from this receiver's (check "
                      f"{sent:#06x}, here {check & 0xFFFF:#06x}): its codecs encode the "
                      f"reference input differently", "codec")
    if reader.offset != len(reader.data):
        raise _reject(f"{len(reader.data) - reader.offset} bytes follow the last tensor",
                      "size")
    return {"v": 1, "meta": meta, "specs": specs, "tensors": entries}
