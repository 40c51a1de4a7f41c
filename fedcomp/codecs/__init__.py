"""Codec families. Importing this package registers every built-in codec."""

from fedcomp.codecs.base import Codec, Encoded
from fedcomp.codecs.identity import Identity
from fedcomp.codecs.lossless import Zstd
from fedcomp.codecs.lowrank import LowRank
from fedcomp.codecs.quantize import BF16, FP16, QSGD, ScaledSign, Ternary, Uniform
from fedcomp.codecs.sparsify import RandomK, Threshold, TopK

__all__ = [
    "BF16",
    "FP16",
    "QSGD",
    "Codec",
    "Encoded",
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
