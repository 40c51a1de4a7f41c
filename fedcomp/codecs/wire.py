"""The payload envelope: one self-describing, versioned byte string per update.

Layout (all integers little-endian)::

    offset  size  field
    0       4     magic  b"FCMP"
    4       1     version (1)
    5       1     flags  (bit 0: header is zstd-compressed; bit 1: against the
                  layout dictionary; bit 2: the predicted header, alone; see below)
    6       2     layout check (bit 1 or 2 set) or reserved, must be 0
    8       4     header_len   bytes of the header as stored
    12      4     header_raw   bytes of the header as JSON (== header_len if not compressed)
    16      4     body_len
    20      ...   header (UTF-8 JSON, optionally one zstd frame)
    ...     ...   body: every array of every tensor, back to back, in header order
    end-4   4     CRC-32 of everything before it

The JSON header::

    {"v": 1, "meta": {...}, "specs": ["topk:ratio=0.01|quant:bits=4", "none"],
     "tensors": [["conv1.weight", [32, 1, 3, 3], 0, TREE], ...]}

``meta`` holds small caller values (round number, model version); ``specs`` lists
the distinct pipelines; each tensor names its spec by index. A TREE is a node
``{"c": codec id, "m": {meta}, "p": {part: TREE}}`` or a leaf ``[dtype, count]``;
leaves take their bytes from the body in depth-first order. Nothing is pickled.

**The layout dictionary.** A small payload's header is mostly what the receiver
already knows: tensor names, shapes, codec specs and the codec trees' keys. A
header of the 28x28 CNN's per-layer update is 1,435 bytes of JSON, 401 after zstd:
8% of a 4.8 kB payload, sent by every client every round. Sender and receiver can
both build the header that the same layout of tensors and pipelines produces for a
fixed reference input (:func:`layout_dictionary`), and zstd compresses the real
header against it as a raw-content dictionary, as zstd's dictionaries are meant for
small records with shared structure: that header shrinks to about 60 bytes. The
dictionary depends only on names, shapes and specs, not on the payload, so the
receiver builds it from what it expects; its 16-bit checksum travels in the prefix
and a receiver that expects another layout (another model or codec) rejects the
payload with reason ``codec`` instead of reading a garbled header.

**The predicted header.** With the layout known, most of what is left can be
predicted too: the receiver encodes the reference input with the pipeline a tensor
names and gets almost the same tree. The predicted header
(:mod:`fedcomp.codecs.compact_header`, flag bit 2, same layout check) carries only
each tensor's position, its budget family member and the tree's fields that differ
from the prediction: 3-10 bytes a tensor instead of 25-30. It decodes to the same
header object, checked as the JSON one is. :func:`pack_payload` tries it when given
the receiver's expected tensors and sends whichever header is smallest.

Decoding (:func:`unpack_payload`) treats the bytes as hostile: sizes are checked
before anything is allocated, the total must match to the byte, the checksum must
hold, JSON is parsed with duplicate keys, NaN and Infinity refused, and the tree is
decoded by the receiver's expected pipeline (see :mod:`fedcomp.codecs.pipeline`). Every
problem raises :class:`~fedcomp.errors.PayloadError` and nothing else.
"""

from __future__ import annotations

import collections
import functools
import io
import json
import math
import struct
import threading
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zstandard

from fedcomp.codecs.base import MAX_NDIM, Encoded
from fedcomp.codecs.compact_header import CompactLayout, Unpredictable, read_header, write_header
from fedcomp.codecs.lossless import LEAF_DTYPES
from fedcomp.codecs.pipeline import Pipeline
from fedcomp.codecs.spec import MAX_STAGES
from fedcomp.errors import PayloadError, SpecError

__all__ = [
    "FORMAT_VERSION",
    "MAGIC",
    "DecodedPayload",
    "EncodedTensor",
    "ExpectedTensor",
    "LayoutDictionary",
    "layout_dictionary",
    "pack_payload",
    "unpack_payload",
]

MAGIC = b"FCMP"
FORMAT_VERSION = 1
_PREFIX = struct.Struct("<4sBBHIII")
_CRC = struct.Struct("<I")
_FLAG_ZSTD_HEADER = 1
_FLAG_LAYOUT_DICTIONARY = 2
_FLAG_PREDICTED_HEADER = 4
_KNOWN_FLAGS = _FLAG_ZSTD_HEADER | _FLAG_LAYOUT_DICTIONARY | _FLAG_PREDICTED_HEADER
#: Framing bytes around header and body.
OVERHEAD_BYTES = _PREFIX.size + _CRC.size

MAX_HEADER_BYTES = 1 << 20
MAX_HEADER_RAW_BYTES = 4 << 20
#: The header cap with an expected model: this much plus the next per tensor.
HEADER_BASE_BYTES = 8 << 10
HEADER_BYTES_PER_TENSOR = 2 << 10
MAX_TENSORS = 4096
MAX_NAME_LENGTH = 256
MAX_PARTS = 16
MAX_META_ITEMS = 32
MAX_META_STRING = 256
#: Default bound on the elements one payload may decode to (1 GiB of float32).
DEFAULT_MAX_TOTAL_NUMEL = 1 << 28


@dataclass(frozen=True)
class EncodedTensor:
    """One tensor's encoded tree, ready to pack."""

    name: str
    shape: tuple[int, ...]
    pipeline: Pipeline
    root: Encoded
    #: The spec the layout dictionary uses for this tensor when it differs from the
    #: pipeline's own: a budgeted tensor's family template (see ``ExpectedTensor``).
    layout_spec: str = ""
    #: More specs whose headers the layout dictionary holds: a budgeted tensor's
    #: family's representative members (``TopKFamily.dictionary_specs``).
    layout_variants: tuple[str, ...] = ()


@dataclass(frozen=True)
class ExpectedTensor:
    """What the receiver expects for one tensor: its shape and pipeline.

    ``family``, when set, also admits the pipelines its ``match(spec)`` returns (a
    :class:`fedcomp.codecs.budget.TopKFamily`: the pipeline with another Top-K count,
    chosen by the sender's byte budget), and the tensor's absence, which decodes to
    zeros (the budget sent none of its entries); ``pipeline`` is then the family's
    template, which the layout dictionary uses on both sides.
    """

    shape: tuple[int, ...]
    pipeline: Pipeline
    family: Any = None


@dataclass
class DecodedPayload:
    """The result of :func:`unpack_payload`."""

    tensors: dict[str, np.ndarray]
    specs: dict[str, str]
    meta: dict[str, Any] = field(default_factory=dict)
    nbytes: int = 0
    #: The pipeline each tensor was decoded with (a family member where one was
    #: admitted); a budgeted tensor the payload left out has none (and no spec).
    pipelines: dict[str, Pipeline] = field(default_factory=dict)


# --------------------------------------------------------------------------------------
# Packing
# --------------------------------------------------------------------------------------
def _tree_to_json(node: Encoded | np.ndarray, leaves: list[np.ndarray]) -> Any:
    if isinstance(node, np.ndarray):
        array = np.ascontiguousarray(node.reshape(-1))
        if array.dtype.byteorder == ">":
            array = array.astype(array.dtype.newbyteorder("<"))
        if array.dtype.str not in LEAF_DTYPES:
            raise TypeError(f"arrays of dtype {array.dtype} cannot travel on the wire")
        leaves.append(array)
        return [array.dtype.str, int(array.size)]
    return {
        "c": node.codec,
        "m": dict(node.meta),
        "p": {name: _tree_to_json(part, leaves) for name, part in node.parts.items()},
    }


def _header_object(tensors: Sequence[EncodedTensor], meta: Mapping[str, Any] | None,
                   leaves: list[np.ndarray]) -> dict[str, Any]:
    specs: list[str] = []
    entries = []
    for tensor in tensors:
        spec = tensor.pipeline.spec
        if spec not in specs:
            specs.append(spec)
        entries.append([tensor.name, list(tensor.shape), specs.index(spec),
                        _tree_to_json(tensor.root, leaves)])
    return {"v": FORMAT_VERSION, "meta": dict(meta or {}), "specs": specs, "tensors": entries}


def _json_bytes(header_obj: Mapping[str, Any]) -> bytes:
    return json.dumps(header_obj, separators=(",", ":"), allow_nan=False).encode()


def _header_bytes(tensors: Sequence[EncodedTensor], meta: Mapping[str, Any] | None,
                  leaves: list[np.ndarray]) -> bytes:
    return _json_bytes(_header_object(tensors, meta, leaves))


@dataclass(frozen=True)
class LayoutDictionary:
    """The zstd dictionary of one layout and its 16-bit check (see the module doc)."""

    zstd: zstandard.ZstdCompressionDict
    check: int
    nbytes: int
    #: The strings of the reference trees (codec ids, meta keys, part names, dtypes,
    #: string meta values), then :data:`COMMON_STRINGS`: the predicted header's table.
    strings: tuple[str, ...] = ()
    _compressor: list[zstandard.ZstdCompressor] = field(
        default_factory=list, init=False, repr=False, compare=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False,
                                  compare=False)

    def compress(self, raw: bytes) -> bytes:
        """``raw`` compressed against the dictionary (level 19, no dictionary id).

        A new compressor digests the whole dictionary first, 8 ms for a budgeted
        layout's 90 kB at level 19, more than the rest of a small payload's encode;
        one compressor is kept per dictionary and used by one thread at a time (its
        output is the same as a new one's)."""
        with self._lock:
            if not self._compressor:
                self._compressor.append(zstandard.ZstdCompressor(
                    level=19, dict_data=self.zstd, write_content_size=True,
                    write_dict_id=False))
            return self._compressor[0].compress(raw)


#: A layout: sorted (tensor name, shape, pipeline spec, variant specs) entries.
Layout = tuple[tuple[str, tuple[int, ...], str, tuple[str, ...]], ...]


def _layout_key(items: Any) -> Layout:
    return tuple(sorted((str(name), tuple(int(d) for d in shape), str(spec),
                         tuple(str(v) for v in variants))
                        for name, shape, spec, variants in items))


@functools.lru_cache(maxsize=16)
def _reference_input(shape: tuple[int, ...]) -> np.ndarray:
    """The fixed input a layout's dictionary header is encoded from.

    The dictionary must come out byte-identical on every machine, so the input holds
    no RNG stream and, up to 2**24 elements, no two equal magnitudes: any correct
    Top-K (numpy's introselect, or the SIMD sort some CPUs use) keeps the same
    support. ``u = i * 2654435761 mod 2**24`` is a bijection on ``[0, 2**24)``
    (an odd multiplier), spread over the range like a low-discrepancy sequence, and
    ``(2**24 + u) / 2**25`` lies in ``[0.5, 1)``, where float32 represents it exactly.
    The last few shapes' inputs are kept: the predicted header encodes them for every
    payload (:func:`predicted_tree`), and a large tensor's takes milliseconds to build.
    """
    n = math.prod(shape)
    u = (np.arange(n, dtype=np.int64) * 2654435761) % (1 << 24)
    out = ((u + (1 << 24)) / float(1 << 25)).astype(np.float32).reshape(shape)
    out.flags.writeable = False  # cached: shared by every encode of this shape
    return out


#: Dictionaries built so far, by layout (a few per run: uplink, downlink, full model).
_BUILT: dict[Layout, LayoutDictionary] = {}
_MAX_BUILT = 32


def _reference_header(entries: Sequence[tuple[str, tuple[int, ...], str]]) -> bytes:
    tensors = []
    for name, shape, spec in entries:
        pipeline = Pipeline.parse(spec)
        root = pipeline.encode(_reference_input(shape), rng=np.random.default_rng(0))
        tensors.append(EncodedTensor(name, shape, pipeline, root))
    return _header_bytes(tensors, None, [])


def _build_layout_dictionary(layout: Layout) -> LayoutDictionary:
    """The header of the layout for the reference input; where tensors have variants
    (a byte budget's family members: other counts and value codings), then the header
    of each variant in turn. A budgeted payload's header entries differ from the
    template's in their counts, index coding and value codec's tree: with those
    structures in the dictionary, a sent tensor's entry compresses to about two
    thirds, and one in a value coding other than the template's to half."""
    headers = [_reference_header([(name, shape, spec) for name, shape, spec, _ in layout])]
    rounds = max((len(variants) for *_, variants in layout), default=0)
    for j in range(rounds):
        headers.append(_reference_header([(name, shape, variants[j]) for name, shape, _,
                                          variants in layout if j < len(variants)]))
    raw = b"".join(headers)
    strings: dict[str, None] = {}
    for header in headers:
        for entry in json.loads(header)["tensors"]:
            _collect_strings(entry[3], strings)
    strings.update(dict.fromkeys(COMMON_STRINGS))
    return LayoutDictionary(
        zstandard.ZstdCompressionDict(raw, dict_type=zstandard.DICT_TYPE_RAWCONTENT),
        zlib.crc32(raw) & 0xFFFF, len(raw), tuple(strings))


#: Strings the predicted header's table holds after the layout's own: the payload
#: meta keys and values this library sends and every index coding's names. Part of
#: the format: a change here changes which payloads decode.
COMMON_STRINGS = ("round", "kind", "from-round", "delta", "full", "catchup",
                  "raw", "bitmap", "rice", "rows", "ix", "rk", "ix_raw", "ix_bitmap",
                  "ix_unary", "ix_low", "dense")


def _collect_strings(tree: Any, out: dict[str, None]) -> None:
    if isinstance(tree, list):
        out[tree[0]] = None
        return
    out[tree["c"]] = None
    for key, value in tree["m"].items():
        out[key] = None
        if isinstance(value, str):
            out[value] = None
    for name, part in tree["p"].items():
        out[name] = None
        _collect_strings(part, out)


def layout_dictionary(layout: Mapping[str, ExpectedTensor] | Sequence[EncodedTensor],
                      left_out: Sequence[tuple[str, tuple[int, ...], str, tuple[str, ...]]] = (),
                      ) -> LayoutDictionary:
    """The header dictionary of a layout: the receiver's expected tensors, or the
    sender's encoded ones and those it leaves out (see :func:`pack_payload`); the
    same dictionary when names, shapes and specs agree.

    Built once per layout (cached): encoding the reference input costs milliseconds.
    """
    if isinstance(layout, Mapping):
        items: Any = ((name, t.shape, t.pipeline.spec,
                       t.family.dictionary_specs() if t.family is not None else ())
                      for name, t in layout.items())
    else:
        items = [(t.name, t.shape, t.layout_spec or t.pipeline.spec, t.layout_variants)
                 for t in layout] + list(left_out)
    key = _layout_key(items)
    if key not in _BUILT:
        if len(_BUILT) >= _MAX_BUILT:
            _BUILT.pop(next(iter(_BUILT)))  # the oldest
        _BUILT[key] = _build_layout_dictionary(key)
    return _BUILT[key]


def known_layout_dictionary(check: int) -> LayoutDictionary | None:
    """A layout dictionary built in this process with this check (test tooling only:
    :mod:`fedcomp.codecs.fuzzing` re-frames payloads without knowing their layout)."""
    return next((d for d in _BUILT.values() if d.check == check), None)


#: Predicted trees by (shape, spec): a budget's counts change every update, and a
#: round's payloads share most of them; bounded, as hostile payloads may name any.
_PREDICTED: collections.OrderedDict[tuple[tuple[int, ...], str], Any] = (
    collections.OrderedDict())
_MAX_PREDICTED = 2048
_PREDICTED_LOCK = threading.Lock()


def predicted_tree(shape: tuple[int, ...], spec: str) -> Any:
    """The JSON-form tree of the reference input of ``shape`` encoded with ``spec``:
    what the predicted header (:mod:`fedcomp.codecs.compact_header`) codes a
    tensor's tree against. Callers must not change it (it is cached)."""
    key = (tuple(shape), spec)
    with _PREDICTED_LOCK:
        if key in _PREDICTED:
            _PREDICTED.move_to_end(key)
            return _PREDICTED[key]
    root = Pipeline.parse(spec).encode(_reference_input(key[0]), rng=np.random.default_rng(0))
    tree = _tree_to_json(root, [])
    with _PREDICTED_LOCK:
        _PREDICTED[key] = tree
        if len(_PREDICTED) > _MAX_PREDICTED:
            _PREDICTED.popitem(last=False)
    return tree


def _member_of(tensor: ExpectedTensor) -> Any:
    own, family = tensor.pipeline.spec, tensor.family

    def member(code: int) -> str | None:
        if code == 0:
            return own
        if family is None:
            return None
        k, values = divmod(code - 1, len(family.tails))
        return family.member_spec(k + 1, values) if k < family.numel else None
    return member


def _code_of(tensor: ExpectedTensor) -> Any:
    own, family = tensor.pipeline.spec, tensor.family

    def code(spec: str) -> int | None:
        if spec == own:
            return 0
        choice = family.choice_of(spec) if family is not None else None
        if choice is None:
            return None
        return 1 + (choice[0] - 1) * len(family.tails) + choice[1]
    return code


def compact_layout(expected: Mapping[str, ExpectedTensor]) -> CompactLayout:
    """What the predicted header of a payload for ``expected`` is written against."""
    dictionary = layout_dictionary(expected)
    return CompactLayout(
        names=tuple(sorted(expected)),
        shapes={name: tuple(t.shape) for name, t in expected.items()},
        members={name: _member_of(t) for name, t in expected.items()},
        member_codes={name: _code_of(t) for name, t in expected.items()},
        predict=predicted_tree, strings=dictionary.strings, max_meta_items=MAX_META_ITEMS,
        max_list=MAX_NDIM, max_parts=MAX_PARTS, max_depth=MAX_STAGES + 1)


def pack_payload(tensors: Sequence[EncodedTensor], meta: Mapping[str, Any] | None = None,
                 *, use_layout_dictionary: bool = False,
                 left_out: Sequence[tuple[str, tuple[int, ...], str, tuple[str, ...]]] = (),
                 predict_from: Mapping[str, ExpectedTensor] | None = None,
                 ) -> bytes:
    """Serialize encoded tensors (and small ``meta`` values) into one payload.

    ``use_layout_dictionary`` compresses the header against the layout's dictionary
    (see the module doc; the receiver must then pass ``expected`` to
    :func:`unpack_payload`). The smallest of plain, zstd and dictionary-zstd is sent.
    ``left_out`` names the (name, shape, family template spec, variant specs) of
    the budgeted tensors the payload leaves out: they are part of the layout the
    receiver expects, so of its dictionary, though not of the payload.
    ``predict_from``, the receiver's expected tensors, also tries the predicted
    header (:mod:`fedcomp.codecs.compact_header`), which the receiver decodes with
    the same ``expected``; it is sent when it is the smallest.
    """
    leaves: list[np.ndarray] = []
    header_obj = _header_object(tensors, meta, leaves)
    header_raw = _json_bytes(header_obj)
    if len(header_raw) > MAX_HEADER_RAW_BYTES:
        raise ValueError(f"payload header of {len(header_raw)} bytes is too large")
    header, flags, check = header_raw, 0, 0
    compressed = zstandard.ZstdCompressor(level=9, write_content_size=True).compress(header_raw)
    if len(compressed) < len(header):
        header, flags = compressed, _FLAG_ZSTD_HEADER
    if use_layout_dictionary and (tensors or left_out):
        dictionary = layout_dictionary(tensors, left_out)
        against = dictionary.compress(header_raw)
        if len(against) < len(header):
            header, check = against, dictionary.check
            flags = _FLAG_ZSTD_HEADER | _FLAG_LAYOUT_DICTIONARY
    if predict_from is not None and (tensors or left_out):
        try:
            predicted = write_header(header_obj, compact_layout(predict_from))
        except Unpredictable:
            predicted = None
        if predicted is not None and len(predicted) < len(header):
            header = header_raw = predicted
            flags, check = _FLAG_PREDICTED_HEADER, layout_dictionary(predict_from).check
    body_len = sum(leaf.nbytes for leaf in leaves)
    out = bytearray(_PREFIX.pack(MAGIC, FORMAT_VERSION, flags, check, len(header),
                                 len(header_raw), body_len))
    out += header
    for leaf in leaves:
        out += leaf.tobytes()
    out += _CRC.pack(zlib.crc32(out))
    return bytes(out)


# --------------------------------------------------------------------------------------
# Unpacking
# --------------------------------------------------------------------------------------
def _reject(message: str, reason: str = "header") -> PayloadError:
    return PayloadError(message, reason=reason)


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _reject(f"duplicate key {key!r} in payload header")
        out[key] = value
    return out


def header_cap(expected: Mapping[str, ExpectedTensor] | None) -> int:
    """Most bytes a payload's JSON header may expand to, checked before it is inflated.

    With the expected model known, 8 KiB plus 2 KiB per tensor (real headers take
    about 0.2-0.6 KiB per tensor), so a header bomb costs at most a few tens of KiB of
    decompression and JSON parsing; without it, :data:`MAX_HEADER_RAW_BYTES`.
    """
    if expected is None:
        return MAX_HEADER_RAW_BYTES
    return min(MAX_HEADER_RAW_BYTES, HEADER_BASE_BYTES + HEADER_BYTES_PER_TENSOR * len(expected))


def _refuse_constant(name: str) -> Any:
    raise _reject(f"payload header contains {name}", reason="non-finite")


def _read_header(stored: bytes, raw_len: int, compressed: bool,
                 dictionary: LayoutDictionary | None = None) -> dict[str, Any]:
    if compressed:
        try:
            decompressor = (zstandard.ZstdDecompressor(dict_data=dictionary.zstd)
                            if dictionary is not None else zstandard.ZstdDecompressor())
            reader = decompressor.stream_reader(io.BytesIO(stored))
            raw = reader.read(raw_len + 1)
        except zstandard.ZstdError as exc:
            raise _reject(f"corrupt compressed header ({exc})") from None
    else:
        raw = stored
    if len(raw) != raw_len:
        raise _reject(f"header is {len(raw)} bytes; prefix says {raw_len}", reason="size")
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates,
                            parse_constant=_refuse_constant)
    except PayloadError:
        raise
    except (ValueError, RecursionError) as exc:
        raise _reject(f"payload header is not valid JSON ({type(exc).__name__})") from None
    if not isinstance(header, dict) or set(header) != {"v", "meta", "specs", "tensors"}:
        raise _reject("payload header must have exactly the keys v, meta, specs, tensors")
    if header["v"] != FORMAT_VERSION:
        raise _reject(f"header version {header['v']!r} != {FORMAT_VERSION}", reason="version")
    return header


def _describe_layout(expected: Mapping[str, ExpectedTensor]) -> str:
    specs: dict[str, list[str]] = {}
    for name, tensor in expected.items():
        specs.setdefault(tensor.pipeline.spec, []).append(name)
    text = "; ".join(f"{spec!r} for {', '.join(names[:6])}{' ...' if len(names) > 6 else ''}"
                     for spec, names in specs.items())
    return text[:600]


def _check_meta(meta: Any, where: str) -> dict[str, Any]:
    if not isinstance(meta, dict) or len(meta) > MAX_META_ITEMS:
        raise _reject(f"{where}: meta must be an object of at most {MAX_META_ITEMS} items")
    for key, value in meta.items():
        if len(key) > 64:
            raise _reject(f"{where}: meta key too long")
        if isinstance(value, list):
            if len(value) > MAX_NDIM or not all(
                isinstance(v, int) and not isinstance(v, bool) for v in value
            ):
                raise _reject(f"{where}: meta {key!r} must be a short list of integers")
        elif isinstance(value, str):
            if len(value) > MAX_META_STRING:
                raise _reject(f"{where}: meta {key!r} string too long")
        elif value is not None and not isinstance(value, bool | int | float):
            raise _reject(f"{where}: meta {key!r} has an unsupported type")
    return meta


class _Body:
    """Hands out consecutive slices of the body as read-only arrays, bounded."""

    def __init__(self, body: memoryview) -> None:
        self.body = body
        self.offset = 0

    def take(self, dtype_str: Any, count: Any) -> np.ndarray:
        if not isinstance(dtype_str, str) or dtype_str not in LEAF_DTYPES:
            raise _reject(f"leaf dtype {dtype_str!r} is not allowed")
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise _reject(f"leaf count {count!r} is not a non-negative integer")
        dtype = LEAF_DTYPES[dtype_str]
        nbytes = count * dtype.itemsize
        if nbytes > len(self.body) - self.offset:
            raise _reject(f"leaf of {nbytes} bytes overruns the body", reason="truncated")
        array = np.frombuffer(self.body, dtype=dtype, count=count, offset=self.offset)
        self.offset += nbytes
        return array


def _build_tree(obj: Any, body: _Body, depth: int) -> Encoded | np.ndarray:
    if isinstance(obj, list):
        if len(obj) != 2:
            raise _reject("a leaf must be [dtype, count]")
        return body.take(obj[0], obj[1])
    if not isinstance(obj, dict) or set(obj) != {"c", "m", "p"}:
        raise _reject("a node must have exactly the keys c, m, p")
    if depth > MAX_STAGES + 1:
        raise _reject("encoded tree nested too deeply")
    codec, meta, parts = obj["c"], obj["m"], obj["p"]
    if not isinstance(codec, str) or len(codec) > 32:
        raise _reject(f"bad codec id {codec!r:.40}")
    if not isinstance(parts, dict) or not 0 < len(parts) <= MAX_PARTS:
        raise _reject(f"{codec}: parts must be an object of 1 to {MAX_PARTS} entries")
    return Encoded(
        codec,
        _check_meta(meta, codec),
        {str(name): _build_tree(part, body, depth + 1) for name, part in parts.items()},
    )


def _check_shape(value: Any, name: str) -> tuple[int, ...]:
    if (not isinstance(value, list) or len(value) > MAX_NDIM
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                       for d in value)):
        raise _reject(f"tensor {name!r}: bad shape {value!r:.80}", reason="shape")
    return tuple(value)


def unpack_payload(
    data: bytes | bytearray | memoryview,
    *,
    expected: Mapping[str, ExpectedTensor] | None = None,
    max_total_numel: int = DEFAULT_MAX_TOTAL_NUMEL,
) -> DecodedPayload:
    """Validate and decode a payload.

    Parameters
    ----------
    data
        The received bytes (untrusted).
    expected
        The model the receiver expects: tensor names, shapes and the pipeline each
        must use. A payload with any other name, shape or codec is rejected. Without
        it, the payload's own specs are used, bounded by ``max_total_numel``.
    max_total_numel
        Most elements all tensors of the payload may decode to.

    Raises
    ------
    PayloadError
        For every problem, with a message naming it and a ``reason`` tag.
    """
    try:
        return _unpack(memoryview(data).cast("B"), expected, max_total_numel)
    except PayloadError:
        raise
    except (ValueError, TypeError, KeyError, IndexError, OverflowError, MemoryError) as exc:
        # Defence in depth: a check we missed must still reject only this payload.
        raise PayloadError(f"malformed payload ({type(exc).__name__}: {exc})",
                           reason="invalid") from exc


def _unpack(
    data: memoryview,
    expected: Mapping[str, ExpectedTensor] | None,
    max_total_numel: int,
) -> DecodedPayload:
    total = len(data)
    if total < OVERHEAD_BYTES:
        raise _reject(f"payload of {total} bytes is shorter than the framing", "truncated")
    magic, version, flags, reserved, header_len, header_raw, body_len = _PREFIX.unpack(
        data[: _PREFIX.size]
    )
    if magic != MAGIC:
        raise _reject(f"bad magic {bytes(magic)!r}; not a fedcomp payload", "magic")
    if version != FORMAT_VERSION:
        raise _reject(f"unsupported payload version {version}", "version")
    with_dictionary = bool(flags & _FLAG_LAYOUT_DICTIONARY)
    predicted = bool(flags & _FLAG_PREDICTED_HEADER)
    if (flags & ~_KNOWN_FLAGS or (reserved and not (with_dictionary or predicted))
            or (with_dictionary and not flags & _FLAG_ZSTD_HEADER)
            or (predicted and flags != _FLAG_PREDICTED_HEADER)):
        raise _reject(f"unknown flags {flags:#x}/{reserved:#x}", "version")
    raw_cap = header_cap(expected)
    if header_len > min(MAX_HEADER_BYTES, raw_cap) or header_raw > raw_cap:
        raise _reject(f"header of {header_len}/{header_raw} bytes is too large (at most "
                      f"{raw_cap} for this model)", "size")
    want = OVERHEAD_BYTES + header_len + body_len
    if total != want:
        raise _reject(f"payload is {total} bytes; its prefix says {want}",
                      "truncated" if total < want else "size")
    (crc,) = _CRC.unpack(data[total - _CRC.size:])
    if zlib.crc32(data[: total - _CRC.size]) != crc:
        raise _reject("checksum mismatch: the payload was corrupted", "checksum")
    if not flags & _FLAG_ZSTD_HEADER and header_raw != header_len:
        raise _reject("uncompressed header length mismatch", "size")

    dictionary = None
    if with_dictionary or predicted:
        if expected is None:
            how = ("predicted from" if predicted else "compressed against")
            raise _reject(f"the payload's header is {how} its layout; the receiver must "
                          f"pass the expected tensors", "codec")
        dictionary = layout_dictionary(expected)
        if reserved != dictionary.check:
            raise _reject(
                f"the payload was packed for another layout of tensors and codecs "
                f"(layout check {reserved:#06x}; this receiver's is {dictionary.check:#06x}): "
                f"the sender's model or codec settings differ from the receiver's, which "
                f"expects {_describe_layout(expected)}", "codec")

    start = _PREFIX.size
    if predicted:
        header = read_header(bytes(data[start:start + header_len]), compact_layout(expected))
    else:
        header = _read_header(bytes(data[start:start + header_len]), header_raw,
                              bool(flags & _FLAG_ZSTD_HEADER), dictionary)
    meta = _check_meta(header["meta"], "payload")
    specs, entries = header["specs"], header["tensors"]
    if not isinstance(specs, list) or not all(isinstance(s, str) for s in specs):
        raise _reject("specs must be a list of strings")
    if not isinstance(entries, list) or len(entries) > MAX_TENSORS:
        raise _reject(f"tensors must be a list of at most {MAX_TENSORS} entries")

    body = _Body(data[start + header_len: start + header_len + body_len])
    parsed = []
    names: set[str] = set()
    numel_total = 0
    for entry in entries:
        if not isinstance(entry, list) or len(entry) != 4:
            raise _reject("a tensor entry must be [name, shape, spec, tree]")
        name, shape_obj, spec_index, tree = entry
        if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_LENGTH:
            raise _reject(f"bad tensor name {name!r:.80}")
        if name in names:
            raise _reject(f"tensor {name!r} appears twice")
        names.add(name)
        shape = _check_shape(shape_obj, name)
        if expected is not None and name in expected and shape != tuple(expected[name].shape):
            raise _reject(f"tensor {name!r} has shape {list(shape)[:8]}; the model has "
                          f"{list(expected[name].shape)}", "model")
        numel_total += math.prod(shape)
        if numel_total > max_total_numel:
            raise _reject(f"payload declares more than {max_total_numel} elements", "size")
        if (isinstance(spec_index, bool) or not isinstance(spec_index, int)
                or not 0 <= spec_index < len(specs)):
            raise _reject(f"tensor {name!r}: bad spec index {spec_index!r}")
        spec = specs[spec_index]
        if expected is not None:
            want_tensor = expected.get(name)
            if want_tensor is None:
                raise _reject(f"unexpected tensor {name!r}", "model")
            pipeline = want_tensor.pipeline
            if spec != pipeline.spec:
                member = want_tensor.family.match(spec) if want_tensor.family else None
                if member is None:
                    what = "a member of the family of" if want_tensor.family else ""
                    raise _reject(f"tensor {name!r} uses codec {spec!r:.120}; expected "
                                  f"{what}{' ' if what else ''}{pipeline.spec!r}", "codec")
                pipeline = member
        else:
            try:
                pipeline = Pipeline.parse(spec)
            except SpecError as exc:
                raise _reject(f"tensor {name!r}: bad codec spec ({exc})", "codec") from None
        parsed.append((name, shape, pipeline, _build_tree(tree, body, 0)))
    absent = sorted(set(expected) - names) if expected is not None else []
    missing = [name for name in absent if expected[name].family is None]
    if missing:
        raise _reject(f"payload lacks tensors {missing[:5]}", "model")
    if body.offset != body_len:
        raise _reject(f"body has {body_len - body.offset} bytes no tensor accounts for",
                      "size")

    tensors: dict[str, np.ndarray] = {}
    used_specs: dict[str, str] = {}
    pipelines: dict[str, Pipeline] = {}
    for name, shape, pipeline, root in parsed:
        if not isinstance(root, Encoded):
            raise _reject(f"tensor {name!r}: root must be a node, not a leaf")
        tensors[name] = pipeline.decode_tensor(root, shape)
        used_specs[name] = pipeline.spec
        pipelines[name] = pipeline
    for name in absent:  # a budget left it out: no update this round
        tensors[name] = np.zeros(expected[name].shape, dtype=np.float32)
    return DecodedPayload(tensors=tensors, specs=used_specs, meta=meta, nbytes=total,
                          pipelines=pipelines)
