"""fedcomp: communication-efficient federated learning on Flower.

The library side: codecs (:mod:`fedcomp.codecs`), pipelines and spec strings
(:mod:`fedcomp.pipeline`, :mod:`fedcomp.spec`), the wire format (:mod:`fedcomp.wire`),
error feedback (:mod:`fedcomp.feedback`) and per-tensor policies
(:mod:`fedcomp.policy`). Flower itself is only imported by :mod:`fedcomp.flower`.

Quick start::

    import numpy as np
    from fedcomp import Pipeline
    pipe = Pipeline.parse("topk:ratio=0.01|quant:bits=4")
    x = np.random.default_rng(0).standard_normal(1_000_000).astype(np.float32)
    encoded, decoded = pipe.roundtrip(x, rng=np.random.default_rng(1))
"""

from fedcomp.codecs.base import Codec, Encoded
from fedcomp.errors import PayloadError, SpecError
from fedcomp.feedback import EF21, ErrorFeedback, NoFeedback, make_feedback
from fedcomp.pipeline import Pipeline
from fedcomp.policy import CompressionPolicy, EncodedUpdate, encode_update
from fedcomp.registry import available_codecs, get_codec, register_codec
from fedcomp.wire import ExpectedTensor, pack_payload, unpack_payload

__version__ = "0.1.0"

__all__ = [
    "EF21",
    "Codec",
    "CompressionPolicy",
    "Encoded",
    "EncodedUpdate",
    "ErrorFeedback",
    "ExpectedTensor",
    "NoFeedback",
    "PayloadError",
    "Pipeline",
    "SpecError",
    "available_codecs",
    "encode_update",
    "get_codec",
    "make_feedback",
    "pack_payload",
    "register_codec",
    "unpack_payload",
]
