"""The codec contract, the encoded representation, and strict decoding helpers.

A codec turns one float32 array into an :class:`Encoded` node and back. An encoded
node is a small tree: a codec id, a little JSON-able ``meta`` (counts, scales' chunk
size, a seed), and named ``parts`` that are either 1-D numpy arrays (the bytes that
travel) or nested :class:`Encoded` nodes produced by a later pipeline stage. The wire
format (:mod:`fedcomp.codecs.wire`) serializes this tree; :mod:`fedcomp.codecs.pipeline` builds it.

The contract, in the spirit of numcodecs' ``Codec`` ABC:

* ``encode(x, *, rng)`` is pure given ``rng`` (a seeded :class:`numpy.random.Generator`
  passed in by the caller, never a global RNG).
* ``decode(enc, *, max_numel)`` trusts nothing in ``enc``: it may come from the network.
  It validates every meta value and part, never allocates more than ``max_numel``
  elements' worth of memory, never returns NaN or Inf, and raises only
  :class:`~fedcomp.errors.PayloadError`.
* ``get_config()`` returns a JSON-only dict with an ``"id"`` key; ``from_config`` is its
  inverse and validates every parameter, raising :class:`~fedcomp.errors.SpecError`.

Class flags describe what a codec promises: ``lossless`` (decode(encode(x)) == x
exactly), ``unbiased`` (E[decode(encode(x))] == x over the rng), and ``kind``, which
decides where the codec applies inside a pipeline (see :mod:`fedcomp.codecs.pipeline`).
"""

from __future__ import annotations

import abc
import dataclasses
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import numpy as np

from fedcomp.errors import PayloadError, SpecError

__all__ = [
    "MAX_NDIM",
    "Codec",
    "Encoded",
    "Part",
    "check_float_input",
    "meta_bool",
    "meta_float",
    "meta_int",
    "meta_shape",
    "meta_str",
    "param_bool",
    "param_choice",
    "param_float",
    "param_int",
    "require_finite",
    "require_parts",
    "take_part",
]

#: Most dimensions a tensor may declare; real models stay far below.
MAX_NDIM = 8


@dataclass(frozen=True)
class Encoded:
    """One node of an encoded tensor: what a codec produced for one array.

    Attributes
    ----------
    codec
        The id of the codec that produced this node (for example ``"topk"``).
    meta
        Small JSON-able values the decoder needs (ints, floats, bools, strings, lists
        of ints). Never large: everything proportional to the data lives in ``parts``.
    parts
        Named 1-D little-endian numpy arrays, or nested nodes where a later pipeline
        stage re-encoded that part.
    """

    codec: str
    meta: Mapping[str, Any]
    parts: Mapping[str, Part]

    def leaves(self) -> Iterator[np.ndarray]:
        """Yield every array in the tree, depth first, in part order."""
        for part in self.parts.values():
            if isinstance(part, Encoded):
                yield from part.leaves()
            else:
                yield part

    @property
    def nbytes(self) -> int:
        """Bytes of all arrays in the tree (the body size on the wire)."""
        return sum(leaf.nbytes for leaf in self.leaves())

    def replace_parts(self, **parts: Part) -> Encoded:
        """Return a copy with some parts replaced (used by pipelines and tests)."""
        return Encoded(self.codec, self.meta, {**self.parts, **parts})


Part = np.ndarray | Encoded


class Codec(abc.ABC):
    """A stateless, pure transformation of one float32 array.

    Subclasses are frozen keyword-only dataclasses whose fields are the codec's
    parameters; ``__post_init__`` validates them with the ``param_*`` helpers.
    """

    #: Stable name used in spec strings, configs and payload headers.
    codec_id: ClassVar[str]
    #: ``"transform"``: applies to the input and to the float parts that earlier
    #: stages leave open (``open_parts``). ``"bytes"``: a lossless byte codec that
    #: applies to every array of the tree built so far.
    kind: ClassVar[Literal["transform", "bytes"]] = "transform"
    #: decode(encode(x)) == x exactly.
    lossless: ClassVar[bool] = False
    #: E[decode(encode(x, rng))] == x over the randomness of ``rng``.
    unbiased: ClassVar[bool] = False
    #: Produces a sparse tensor whose indices are index-coded.
    sparse: ClassVar[bool] = False
    #: Parts of this codec's output holding float32 values that a later transform
    #: stage may compress further (for example Top-K's kept ``values``).
    open_parts: ClassVar[tuple[str, ...]] = ()
    #: Parameters printed in spec strings even at their default (the ones a reader
    #: needs to see, such as Top-K's ratio or the quantizer's bits).
    shown_params: ClassVar[tuple[str, ...]] = ()

    @abc.abstractmethod
    def encode(self, x: np.ndarray, *, rng: np.random.Generator) -> Encoded:
        """Encode a float32 array. ``rng`` supplies all randomness."""

    @abc.abstractmethod
    def decode(self, enc: Encoded, *, max_numel: int) -> np.ndarray:
        """Decode a node whose parts are arrays; validate everything (untrusted)."""

    def get_config(self) -> dict[str, Any]:
        """JSON-only config with an ``"id"`` key; ``from_config`` inverts it."""
        config: dict[str, Any] = {"id": self.codec_id}
        for field in dataclasses.fields(self):  # type: ignore[arg-type]
            config[field.name] = getattr(self, field.name)
        return config

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> Codec:
        """Build the codec from ``get_config()`` output, validating every value."""
        params = dict(config)
        codec_id = params.pop("id", cls.codec_id)
        if codec_id != cls.codec_id:
            raise SpecError(f"config id {codec_id!r} does not match codec {cls.codec_id!r}")
        known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        unknown = sorted(set(params) - known)
        if unknown:
            raise SpecError(
                f"codec {cls.codec_id!r} has no parameter {unknown[0]!r}; "
                f"its parameters are: {', '.join(sorted(known)) or '(none)'}"
            )
        return cls(**params)

    def defaults(self) -> dict[str, Any]:
        """Defaults that a printed spec may leave out (all but ``shown_params``)."""
        return {
            f.name: f.default
            for f in dataclasses.fields(self)  # type: ignore[arg-type]
            if f.default is not dataclasses.MISSING and f.name not in self.shown_params
        }


# --------------------------------------------------------------------------------------
# Parameter validation (user input: raise SpecError)
# --------------------------------------------------------------------------------------
def _set(obj: object, name: str, value: object) -> None:
    object.__setattr__(obj, name, value)


def param_float(
    obj: object, name: str, *, lo: float | None = None, hi: float | None = None,
    lo_open: bool = False,
) -> float:
    """Validate a float parameter of a frozen dataclass codec (ints are accepted)."""
    value = getattr(obj, name)
    cid = type(obj).codec_id  # type: ignore[attr-defined]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise SpecError(f"{cid}: {name} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise SpecError(f"{cid}: {name} must be finite, got {value!r}")
    if lo is not None and (value < lo or (lo_open and value == lo)):
        op = ">" if lo_open else ">="
        raise SpecError(f"{cid}: {name} must be {op} {lo}, got {value!r}")
    if hi is not None and value > hi:
        raise SpecError(f"{cid}: {name} must be <= {hi}, got {value!r}")
    _set(obj, name, value)
    return value


def param_int(obj: object, name: str, *, lo: int | None = None, hi: int | None = None) -> int:
    """Validate an integer parameter (a float with an integral value is accepted)."""
    value = getattr(obj, name)
    cid = type(obj).codec_id  # type: ignore[attr-defined]
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(f"{cid}: {name} must be an integer, got {value!r}")
    if lo is not None and value < lo:
        raise SpecError(f"{cid}: {name} must be >= {lo}, got {value!r}")
    if hi is not None and value > hi:
        raise SpecError(f"{cid}: {name} must be <= {hi}, got {value!r}")
    _set(obj, name, value)
    return value


def param_bool(obj: object, name: str) -> bool:
    """Validate a boolean parameter."""
    value = getattr(obj, name)
    if not isinstance(value, bool):
        cid = type(obj).codec_id  # type: ignore[attr-defined]
        raise SpecError(f"{cid}: {name} must be true or false, got {value!r}")
    return value


def param_choice(obj: object, name: str, choices: tuple[str, ...]) -> str:
    """Validate a string parameter against a fixed set of choices."""
    value = getattr(obj, name)
    if value not in choices:
        cid = type(obj).codec_id  # type: ignore[attr-defined]
        raise SpecError(f"{cid}: {name} must be one of {', '.join(choices)}; got {value!r}")
    return value


def check_float_input(codec_id: str, x: np.ndarray) -> np.ndarray:
    """Validate an encoder input: a float32 numpy array (made C-contiguous)."""
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{codec_id}: expected a numpy array, got {type(x).__name__}")
    if x.dtype != np.float32:
        raise TypeError(
            f"{codec_id}: expected float32 input, got {x.dtype}; cast with .astype(np.float32)"
        )
    if x.ndim > MAX_NDIM:
        raise ValueError(f"{codec_id}: at most {MAX_NDIM} dimensions, got {x.ndim}")
    return np.ascontiguousarray(x)


# --------------------------------------------------------------------------------------
# Strict decoding of untrusted nodes (network input: raise PayloadError)
# --------------------------------------------------------------------------------------
def require_parts(enc: Encoded, names: tuple[str, ...] | frozenset[str]) -> None:
    """The node must have exactly these part names."""
    got = set(enc.parts)
    want = set(names)
    if got != want:
        missing = sorted(want - got)
        extra = sorted(got - want)
        raise PayloadError(
            f"{enc.codec}: parts {sorted(got)} do not match the expected {sorted(want)}"
            f" (missing {missing}, unexpected {extra})",
            reason="header",
        )


def take_part(
    enc: Encoded, name: str, dtype: np.dtype | type, length: int | None = None
) -> np.ndarray:
    """Return part ``name`` after checking it is an array of ``dtype`` (and ``length``)."""
    part = enc.parts.get(name)
    if not isinstance(part, np.ndarray):
        raise PayloadError(f"{enc.codec}: part {name!r} is missing or not an array",
                           reason="header")
    if part.dtype != np.dtype(dtype) or part.ndim != 1:
        raise PayloadError(
            f"{enc.codec}: part {name!r} has dtype {part.dtype} and {part.ndim} dims; "
            f"expected 1-D {np.dtype(dtype)}",
            reason="header",
        )
    if length is not None and part.size != length:
        raise PayloadError(
            f"{enc.codec}: part {name!r} has {part.size} elements; expected {length}",
            reason="size",
        )
    return part


def _meta_value(enc: Encoded, key: str) -> Any:
    if key not in enc.meta:
        raise PayloadError(f"{enc.codec}: meta {key!r} is missing", reason="header")
    return enc.meta[key]


def meta_int(enc: Encoded, key: str, lo: int, hi: int) -> int:
    """Read an integer meta value and check ``lo <= value <= hi``."""
    value = _meta_value(enc, key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise PayloadError(f"{enc.codec}: meta {key!r} must be an integer, got {value!r}",
                           reason="header")
    if not lo <= value <= hi:
        raise PayloadError(
            f"{enc.codec}: meta {key!r} = {value} is outside [{lo}, {hi}]", reason="size"
        )
    return value


def meta_float(enc: Encoded, key: str) -> float:
    """Read a finite float meta value (ints accepted)."""
    value = _meta_value(enc, key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise PayloadError(f"{enc.codec}: meta {key!r} must be a number, got {value!r}",
                           reason="header")
    value = float(value)
    if not math.isfinite(value):
        raise PayloadError(f"{enc.codec}: meta {key!r} is not finite", reason="non-finite")
    return value


def meta_bool(enc: Encoded, key: str) -> bool:
    """Read a boolean meta value."""
    value = _meta_value(enc, key)
    if not isinstance(value, bool):
        raise PayloadError(f"{enc.codec}: meta {key!r} must be a boolean, got {value!r}",
                           reason="header")
    return value


def meta_str(enc: Encoded, key: str, choices: tuple[str, ...]) -> str:
    """Read a string meta value from a fixed set of choices."""
    value = _meta_value(enc, key)
    if not isinstance(value, str) or value not in choices:
        raise PayloadError(
            f"{enc.codec}: meta {key!r} = {value!r} is not one of {list(choices)}",
            reason="header",
        )
    return value


def meta_shape(enc: Encoded, max_numel: int, key: str = "shape") -> tuple[int, ...]:
    """Read a declared shape; its element count (exact integer maths) <= ``max_numel``."""
    value = _meta_value(enc, key)
    if not isinstance(value, list) or len(value) > MAX_NDIM:
        raise PayloadError(
            f"{enc.codec}: meta {key!r} must be a list of at most {MAX_NDIM} dims, "
            f"got {value!r:.80}",
            reason="shape",
        )
    numel = 1
    for dim in value:
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 0:
            raise PayloadError(f"{enc.codec}: meta {key!r} has a bad dimension {dim!r:.40}",
                               reason="shape")
        numel *= dim  # Python ints cannot overflow; a lying header is caught below
    if numel > max_numel:
        raise PayloadError(
            f"{enc.codec}: declared shape {value} has {numel} elements, more than the "
            f"{max_numel} allowed for this tensor",
            reason="shape",
        )
    return tuple(value)


def require_finite(codec_id: str, what: str, values: np.ndarray) -> None:
    """Reject NaN or Inf in decoded or received float values."""
    if values.size and not np.isfinite(values).all():
        raise PayloadError(f"{codec_id}: {what} contains NaN or Inf", reason="non-finite")
