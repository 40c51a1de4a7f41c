"""Value quantizers: fewer bits for each value of a (dense or already sparsified) array.

=========  ===========================================================  =========
id         what                                                          unbiased
=========  ===========================================================  =========
quant      uniform b-bit (1..8) per chunk between the chunk's min and    stochastic
           max, nearest or stochastic rounding                           rounding
qsgd       QSGD (Alistarh et al., 2017): s levels of |x| / ||bucket||,   yes
           stochastic, with sign
sign       scaled sign (EF-signSGD, Karimireddy et al., 2019):           no
           mean(|x|) * sign(x), one bit per value
ternary    TernGrad (Wen et al., 2017, ``mode=stochastic``) or Sparse    stochastic
           Ternary Compression's mean magnitude (Sattler et al., 2019,   mode
           ``mode=mean``)
fp16/bf16  casts to half precision (saturating)                          no
=========  ===========================================================  =========

Scales (per chunk or bucket) travel as float32 parts. Stochastic rounding draws from
the ``rng`` passed to ``encode``. The decoders check that every scale is finite and
that no decoded value can overflow float32, so a lying payload cannot produce NaN or
Inf downstream.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from fedcomp.codecs.base import (
    Codec,
    Encoded,
    check_float_input,
    meta_bool,
    meta_shape,
    param_choice,
    param_int,
    require_finite,
    require_parts,
    take_part,
)
from fedcomp.codecs.bitpack import pack_uint, unpack_uint
from fedcomp.codecs.registry import register_codec
from fedcomp.errors import PayloadError

__all__ = ["BF16", "FP16", "QSGD", "ScaledSign", "Ternary", "Uniform"]

_FLOAT32_MAX = float(np.finfo(np.float32).max)
_SMALLEST_SUBNORMAL = np.finfo(np.float32).smallest_subnormal


def _chunks(flat: np.ndarray, chunk: int) -> np.ndarray:
    """View ``flat`` as (n_chunks, chunk), padding the tail with its last value.

    Edge padding leaves each chunk's min, max and absmax unchanged; the padded
    entries are dropped again after decoding.
    """
    n = flat.size
    pad = (-n) % chunk
    if pad:
        flat = np.concatenate([flat, np.full(pad, flat[-1], dtype=flat.dtype)])
    return flat.reshape(-1, chunk)


def _chunk_len(chunk: int, n: int) -> int:
    """Chunk length; 0 means one chunk for the whole array."""
    return chunk if chunk > 0 else max(n, 1)


def _check_scales(codec_id: str, name: str, scales: np.ndarray, levels: float) -> None:
    """Scales must be finite, non-negative, and keep ``levels * scale`` within float32."""
    require_finite(codec_id, name, scales)
    if scales.size and (scales.min() < 0 or float(scales.max()) * levels > _FLOAT32_MAX):
        raise PayloadError(f"{codec_id}: {name} out of range", reason="non-finite")


@register_codec
@dataclass(frozen=True, kw_only=True)
class Uniform(Codec):
    """Uniform quantization to ``bits`` bits between each chunk's min and max.

    With ``rounding="nearest"`` every value is off by at most half a step
    ``(max - min) / (2**bits - 1)`` of its chunk; with ``"stochastic"`` the rounding
    is unbiased. Each chunk costs two float32 scales (``lo`` and ``step``): 0.5 extra
    bits per value at the default chunk of 128.
    """

    codec_id = "quant"
    shown_params = ("bits",)

    bits: int = 8
    chunk: int = 128
    rounding: str = "stochastic"

    def __post_init__(self) -> None:
        param_int(self, "bits", lo=1, hi=8)
        param_int(self, "chunk", lo=1, hi=2**20)
        param_choice(self, "rounding", ("stochastic", "nearest"))

    @property
    def unbiased(self) -> bool:  # type: ignore[override]
        return self.rounding == "stochastic"

    def encode(self, x: np.ndarray, *, rng: np.random.Generator) -> Encoded:
        x = check_float_input(self.codec_id, x)
        flat = x.reshape(-1)
        n = flat.size
        levels = (1 << self.bits) - 1
        if n == 0:
            lo = step = np.zeros(0, dtype=np.float32)
            codes = np.zeros(0, dtype=np.uint8)
        else:
            blocks = _chunks(flat, self.chunk)
            lo = blocks.min(axis=1)
            hi = blocks.max(axis=1)
            if not (np.isfinite(lo).all() and np.isfinite(hi).all()):
                raise ValueError(f"{self.codec_id}: the input contains NaN or Inf")
            step = ((hi.astype(np.float64) - lo) / levels).astype(np.float32)
            # A range of a few subnormals divided by the levels underflows to 0, which
            # would round every value to lo: keep the step at least one subnormal.
            step = np.where(hi > lo, np.maximum(step, _SMALLEST_SUBNORMAL), step)
            if not np.isfinite(step).all():
                raise ValueError(f"{self.codec_id}: value range exceeds float32")
            # Divide rather than multiply by 1/step: 1/step overflows for subnormal steps.
            q = blocks - lo[:, None]
            q /= np.where(step > 0, step, np.float32(1))[:, None]
            if self.rounding == "stochastic":
                q += rng.random(q.shape, dtype=np.float32)
                np.floor(q, out=q)
            else:
                np.rint(q, out=q)
            np.clip(q, 0, levels, out=q)
            codes = q.astype(np.uint8).reshape(-1)[:n]
        meta = {"shape": list(x.shape)}
        return Encoded(self.codec_id, meta,
                       {"codes": pack_uint(codes, self.bits), "lo": lo, "step": step})

    def decode(self, enc: Encoded, *, max_numel: int) -> np.ndarray:
        shape = meta_shape(enc, max_numel)
        n = math.prod(shape)
        n_chunks = -(-n // self.chunk)
        require_parts(enc, ("codes", "lo", "step"))
        lo = take_part(enc, "lo", np.float32, n_chunks)
        step = take_part(enc, "step", np.float32, n_chunks)
        require_finite(self.codec_id, "lo", lo)
        levels = (1 << self.bits) - 1
        _check_scales(self.codec_id, "step", step, levels)
        if lo.size and float(np.abs(lo).max()) + float(step.max()) * levels > _FLOAT32_MAX:
            raise PayloadError(f"{self.codec_id}: scales overflow float32", reason="non-finite")
        codes = unpack_uint(enc.parts["codes"], n, self.bits, self.codec_id)  # type: ignore[arg-type]
        if n == 0:
            return np.zeros(shape, dtype=np.float32)
        padded = np.zeros(n_chunks * self.chunk, dtype=np.float32)
        padded[:n] = codes
        blocks = padded.reshape(n_chunks, self.chunk)
        blocks *= step[:, None]
        blocks += lo[:, None]
        return padded[:n].reshape(shape)


@register_codec
@dataclass(frozen=True, kw_only=True)
class QSGD(Codec):
    """QSGD: ``|x| / ||bucket||_2`` stochastically rounded to ``levels`` levels, with sign.

    Codes ``sign * level + levels`` are packed in ``bit_length(2 * levels)`` bits.
    """

    codec_id = "qsgd"
    shown_params = ("levels",)
    unbiased = True

    levels: int = 4
    bucket: int = 512

    def __post_init__(self) -> None:
        param_int(self, "levels", lo=1, hi=127)
        param_int(self, "bucket", lo=1, hi=2**20)

    @property
    def width(self) -> int:
        return (2 * self.levels).bit_length()

    def encode(self, x: np.ndarray, *, rng: np.random.Generator) -> Encoded:
        x = check_float_input(self.codec_id, x)
        flat = x.reshape(-1)
        n = flat.size
        if n == 0:
            norms = np.zeros(0, dtype=np.float32)
            codes = np.zeros(0, dtype=np.uint8)
        else:
            blocks = _chunks(flat, self.bucket)
            # The edge padding must not count towards the last bucket's norm.
            pad = blocks.size - n
            sq = np.einsum("ij,ij->i", blocks, blocks, dtype=np.float64)
            if pad:
                sq[-1] -= pad * float(flat[-1]) ** 2
            norms = np.sqrt(np.maximum(sq, 0.0)).astype(np.float32)
            if not np.isfinite(norms).all():
                raise ValueError(f"{self.codec_id}: the input contains NaN or Inf")
            # Divide by the norm (1/norm overflows for subnormal norms); |x| <= norm.
            r = np.abs(blocks)
            r /= np.where(norms > 0, norms, np.float32(1))[:, None]
            r *= np.float32(self.levels)
            r += rng.random(r.shape, dtype=np.float32)
            np.floor(r, out=r)
            np.minimum(r, self.levels, out=r)
            level = r.astype(np.int16)
            level[blocks < 0] *= -1
            codes = (level + self.levels).astype(np.uint8).reshape(-1)[:n]
        return Encoded(self.codec_id, {"shape": list(x.shape)},
                       {"codes": pack_uint(codes, self.width), "norms": norms})

    def decode(self, enc: Encoded, *, max_numel: int) -> np.ndarray:
        shape = meta_shape(enc, max_numel)
        n = math.prod(shape)
        n_buckets = -(-n // self.bucket)
        require_parts(enc, ("codes", "norms"))
        norms = take_part(enc, "norms", np.float32, n_buckets)
        _check_scales(self.codec_id, "norms", norms, 1.0)
        codes = unpack_uint(enc.parts["codes"], n, self.width, self.codec_id)  # type: ignore[arg-type]
        if codes.size and int(codes.max()) > 2 * self.levels:
            raise PayloadError(f"{self.codec_id}: code above 2 * levels", reason="header")
        padded = np.zeros(n_buckets * self.bucket, dtype=np.float32)
        padded[:n] = codes
        padded[:n] -= self.levels
        blocks = padded.reshape(n_buckets, self.bucket)
        blocks *= (norms / np.float32(self.levels))[:, None]
        return padded[:n].reshape(shape)


def _per_chunk_abs_stat(flat: np.ndarray, chunk: int, stat: str) -> tuple[np.ndarray, int]:
    """Per-chunk mean or max of ``|x|`` (padding excluded); returns (stats, chunk)."""
    n = flat.size
    chunk = _chunk_len(chunk, n)
    if n == 0:
        return np.zeros(0, dtype=np.float32), chunk
    blocks = np.abs(_chunks(flat, chunk))
    if stat == "max":
        out = blocks.max(axis=1)
    else:
        sums = blocks.sum(axis=1, dtype=np.float64)
        pad = blocks.size - n
        if pad:
            sums[-1] -= pad * float(blocks[-1, -1])
        counts = np.full(blocks.shape[0], chunk, dtype=np.float64)
        counts[-1] = n - chunk * (blocks.shape[0] - 1)
        out = sums / counts
    out = np.asarray(out, dtype=np.float32)
    if not np.isfinite(out).all():
        raise ValueError("the input contains NaN or Inf")
    return out, chunk


def _expand(per_chunk: np.ndarray, chunk: int, n: int) -> np.ndarray:
    return np.repeat(per_chunk, chunk)[:n]


@register_codec
@dataclass(frozen=True, kw_only=True)
class ScaledSign(Codec):
    """One bit per value: ``mean(|x|) * sign(x)`` per chunk (``chunk=0``: whole tensor).

    Biased; EF-signSGD pairs it with error feedback. Zero is sent as ``+``.
    """

    codec_id = "sign"

    chunk: int = 0

    def __post_init__(self) -> None:
        param_int(self, "chunk", lo=0, hi=2**30)

    def encode(self, x: np.ndarray, *, rng: np.random.Generator) -> Encoded:
        x = check_float_input(self.codec_id, x)
        flat = x.reshape(-1)
        scale, _ = _per_chunk_abs_stat(flat, self.chunk, "mean")
        return Encoded(self.codec_id, {"shape": list(x.shape)},
                       {"signs": np.packbits(flat < 0), "scale": scale})

    def decode(self, enc: Encoded, *, max_numel: int) -> np.ndarray:
        shape = meta_shape(enc, max_numel)
        n = math.prod(shape)
        chunk = _chunk_len(self.chunk, n)
        require_parts(enc, ("signs", "scale"))
        scale = take_part(enc, "scale", np.float32, -(-n // chunk) if n else 0)
        _check_scales(self.codec_id, "scale", scale, 1.0)
        negative = unpack_uint(enc.parts["signs"], n, 1, self.codec_id)  # type: ignore[arg-type]
        out = np.float32(1) - np.float32(2) * negative  # +1 / -1
        out *= scale[0] if scale.size == 1 else _expand(scale, chunk, n)
        return out.reshape(shape)


def _pack_trits(symbols: np.ndarray) -> np.ndarray:
    """Pack values in {-1, 0, 1} five to a byte (3**5 = 243 <= 256): 1.6 bits each."""
    count = symbols.size
    trits = np.ones(-(-count // 5) * 5, dtype=np.uint8)  # padding is the symbol 0
    trits[:count] = symbols + 1
    groups = trits.reshape(-1, 5)
    return (groups @ np.array([81, 27, 9, 3, 1], dtype=np.uint8)).astype(np.uint8)


def _unpack_trits(packed: np.ndarray, count: int, who: str) -> np.ndarray:
    if packed.dtype != np.uint8 or packed.size != -(-count // 5):
        raise PayloadError(f"{who}: {packed.size} bytes cannot hold {count} trits",
                           reason="size")
    if packed.size and int(packed.max()) > 242:
        raise PayloadError(f"{who}: byte above 242 in a trit stream", reason="header")
    trits = np.empty((packed.size, 5), dtype=np.int8)
    rest = packed.astype(np.int16)
    for j in range(4, -1, -1):
        trits[:, j] = rest % 3
        rest //= 3
    flat = trits.reshape(-1) - 1
    if flat[count:].any():
        raise PayloadError(f"{who}: nonzero padding trits", reason="header")
    return flat[:count]


@register_codec
@dataclass(frozen=True, kw_only=True)
class Ternary(Codec):
    """Values in ``scale * {-1, 0, +1}``.

    ``mode="stochastic"`` is TernGrad: scale is the chunk's max ``|x|`` and each value
    becomes ``sign(x)`` with probability ``|x| / scale``, else 0 (unbiased).
    ``mode="mean"`` is STC's rule after Top-K: every nonzero value becomes
    ``sign(x) * mean(|x|)`` over the chunk's nonzeros (biased: use error feedback).
    Symbols take 1 bit each when none is zero (the usual case after Top-K), otherwise
    1.6 bits (five trits per byte).
    """

    codec_id = "ternary"

    mode: str = "stochastic"
    chunk: int = 0

    def __post_init__(self) -> None:
        param_choice(self, "mode", ("stochastic", "mean"))
        param_int(self, "chunk", lo=0, hi=2**30)

    @property
    def unbiased(self) -> bool:  # type: ignore[override]
        return self.mode == "stochastic"

    def encode(self, x: np.ndarray, *, rng: np.random.Generator) -> Encoded:
        x = check_float_input(self.codec_id, x)
        flat = x.reshape(-1)
        n = flat.size
        stat = "max" if self.mode == "stochastic" else "mean"
        scale, chunk = _per_chunk_abs_stat(flat, self.chunk, stat)  # refuses NaN/Inf
        symbols = np.sign(flat).astype(np.int8)
        if self.mode == "stochastic":
            if n:
                # |x| / max|x| directly: 1 / max|x| overflows float32 when the
                # chunk's largest magnitude is subnormal.
                per_value = _expand(scale, chunk, n)
                share = np.divide(np.abs(flat), per_value, out=np.zeros_like(flat),
                                  where=per_value > 0)
                keep = rng.random(n, dtype=np.float32) < share
                symbols[~keep] = 0
        else:
            # mean |x| over the chunk's nonzeros = mean |x| / share of nonzeros
            share, _ = _per_chunk_abs_stat((symbols != 0).astype(np.float32), chunk, "mean")
            scale = np.divide(scale, share, out=np.zeros_like(scale), where=share > 0)
        dense = bool(n) and bool((symbols != 0).all())
        packed = np.packbits(symbols < 0) if dense else _pack_trits(symbols)
        return Encoded(self.codec_id, {"shape": list(x.shape), "dense": dense},
                       {"symbols": packed, "scale": scale})

    def decode(self, enc: Encoded, *, max_numel: int) -> np.ndarray:
        shape = meta_shape(enc, max_numel)
        n = math.prod(shape)
        chunk = _chunk_len(self.chunk, n)
        dense = meta_bool(enc, "dense")
        require_parts(enc, ("symbols", "scale"))
        scale = take_part(enc, "scale", np.float32, -(-n // chunk) if n else 0)
        _check_scales(self.codec_id, "scale", scale, 1.0)
        packed = enc.parts["symbols"]
        if dense:
            symbols = 1 - 2 * unpack_uint(packed, n, 1, self.codec_id).astype(np.int8)  # type: ignore[arg-type]
        else:
            symbols = _unpack_trits(packed, n, self.codec_id)  # type: ignore[arg-type]
        out = _expand(scale, chunk, n) * symbols
        return out.astype(np.float32, copy=False).reshape(shape)


@register_codec
@dataclass(frozen=True, kw_only=True)
class FP16(Codec):
    """IEEE half precision; values beyond +-65504 saturate instead of becoming Inf."""

    codec_id = "fp16"

    def encode(self, x: np.ndarray, *, rng: np.random.Generator) -> Encoded:
        x = check_float_input(self.codec_id, x)
        half_max = float(np.finfo(np.float16).max)
        data = np.clip(x.reshape(-1), -half_max, half_max).astype(np.float16)
        if not np.isfinite(data).all():
            raise ValueError(f"{self.codec_id}: the input contains NaN")
        return Encoded(self.codec_id, {"shape": list(x.shape)}, {"data": data})

    def decode(self, enc: Encoded, *, max_numel: int) -> np.ndarray:
        shape = meta_shape(enc, max_numel)
        require_parts(enc, ("data",))
        data = take_part(enc, "data", np.float16, math.prod(shape))
        require_finite(self.codec_id, "data", data)
        return data.astype(np.float32).reshape(shape)


@register_codec
@dataclass(frozen=True, kw_only=True)
class BF16(Codec):
    """bfloat16 (float32's exponent, 8-bit mantissa), round to nearest even.

    Hand-written on the float's bits because numpy has no bfloat16 dtype; the three
    lines below are not worth a dependency (``ml_dtypes``) or a torch round trip.
    """

    codec_id = "bf16"

    def encode(self, x: np.ndarray, *, rng: np.random.Generator) -> Encoded:
        x = check_float_input(self.codec_id, x)
        if not np.isfinite(x).all():
            raise ValueError(f"{self.codec_id}: the input contains NaN or Inf")
        # No uint32 overflow: the largest finite pattern, 0xFF7FFFFF, plus 0x8000 fits.
        bits = x.reshape(-1).view(np.uint32)
        rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> 16
        # Values within half an ulp of float32's max round up to Inf: saturate instead.
        exponent_all_ones = (rounded & np.uint32(0x7F80)) == np.uint32(0x7F80)
        rounded[exponent_all_ones] -= np.uint32(1)
        return Encoded(self.codec_id, {"shape": list(x.shape)},
                       {"data": rounded.astype(np.uint16)})

    def decode(self, enc: Encoded, *, max_numel: int) -> np.ndarray:
        shape = meta_shape(enc, max_numel)
        require_parts(enc, ("data",))
        data = take_part(enc, "data", np.uint16, math.prod(shape))
        if data.size and ((data & 0x7F80) == 0x7F80).any():
            raise PayloadError(f"{self.codec_id}: NaN or Inf in data", reason="non-finite")
        return (data.astype(np.uint32) << 16).view(np.float32).reshape(shape)
