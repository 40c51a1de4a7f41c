"""fedcomp: communication-efficient federated learning on Flower.

The library is in layers, each importing only those before it:

* :mod:`fedcomp.codecs`: codecs, pipelines, spec strings, per-tensor policies, error
  feedback and the wire format (numpy and zstd only: no torch, no Flower);
* :mod:`fedcomp.privacy`: clipping, noise, accounting, DP-SGD;
* :mod:`fedcomp.tasks`: data, models and local training (torch);
* :mod:`fedcomp.federated`: the round on each side (aggregation, downlink, sampling,
  server optimizer, client round, checkpoints, faults);
* :mod:`fedcomp.config` and :mod:`fedcomp.presets`: the run configuration;
* :mod:`fedcomp.ops`: the command line, results, sweeps, reports, deployment.

Flower itself is only imported by :mod:`fedcomp.flower`, the adapter the apps in
``clients/``, ``server/`` and ``strategies/`` use.

Quick start::

    import numpy as np
    from fedcomp import Pipeline
    pipe = Pipeline.parse("topk:ratio=0.01|quant:bits=4")
    x = np.random.default_rng(0).standard_normal(1_000_000).astype(np.float32)
    encoded, decoded = pipe.roundtrip(x, rng=np.random.default_rng(1))
"""

from fedcomp.codecs.base import Codec, Encoded
from fedcomp.codecs.feedback import EF21, ErrorFeedback, NoFeedback, make_feedback
from fedcomp.codecs.pipeline import Pipeline
from fedcomp.codecs.policy import CompressionPolicy, EncodedUpdate, encode_update
from fedcomp.codecs.registry import available_codecs, get_codec, register_codec
from fedcomp.codecs.wire import ExpectedTensor, pack_payload, unpack_payload
from fedcomp.errors import PayloadError, SpecError

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
