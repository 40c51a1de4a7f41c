"""Codecs and the wire format: everything that turns a tensor into bytes and back.

Numpy, zstd and the standard library only (no torch, no Flower).

* codec families: :mod:`~fedcomp.codecs.sparsify`, :mod:`~fedcomp.codecs.quantize`,
  :mod:`~fedcomp.codecs.rotation`, :mod:`~fedcomp.codecs.lowrank`, :mod:`~fedcomp.codecs.lossless`,
  :mod:`~fedcomp.codecs.identity`, on :mod:`~fedcomp.codecs.base`; index and bit
  packing in :mod:`~fedcomp.codecs.index_coding` and :mod:`~fedcomp.codecs.bitpack`.
* composing them: spec strings (:mod:`~fedcomp.codecs.spec`), the registry
  (:mod:`~fedcomp.codecs.registry`), pipelines (:mod:`~fedcomp.codecs.pipeline`),
  per-tensor policies (:mod:`~fedcomp.codecs.policy`) and error feedback
  (:mod:`~fedcomp.codecs.feedback`).
* the wire format (:mod:`~fedcomp.codecs.wire`) and hostile payloads to test it with
  (:mod:`~fedcomp.codecs.fuzzing`).

Importing this package registers every built-in codec.
"""

from fedcomp.codecs.base import Codec, Encoded
from fedcomp.codecs.identity import Identity
from fedcomp.codecs.lossless import Zstd
from fedcomp.codecs.lowrank import LowRank
from fedcomp.codecs.quantize import BF16, FP16, QSGD, ScaledSign, Ternary, Uniform
from fedcomp.codecs.rotation import Hadamard
from fedcomp.codecs.sparsify import RandomK, Threshold, TopK

__all__ = [
    "BF16",
    "FP16",
    "QSGD",
    "Codec",
    "Encoded",
    "Hadamard",
    "Identity",
    "LowRank",
    "RandomK",
    "ScaledSign",
    "Ternary",
    "Threshold",
    "TopK",
    "Uniform",
    "Zstd",
]
