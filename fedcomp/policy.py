"""Which pipeline each tensor of a model gets, and encoding a whole update with it.

Small tensors (biases, norm scales) are a rounding error of the bytes but a large
share of the accuracy: TFF's aggregators and PyTorch's PowerSGD hook send them
uncompressed. :class:`CompressionPolicy` does the same: tensors with fewer than
``min_numel`` elements use ``small_codec`` (``none`` by default; ``fp16`` halves them).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedcomp.errors import SpecError
from fedcomp.feedback import FeedbackMemory, NoFeedback
from fedcomp.pipeline import Pipeline
from fedcomp.tensor import to_numpy
from fedcomp.wire import EncodedTensor, ExpectedTensor, pack_payload

__all__ = ["CompressionPolicy", "EncodedUpdate", "encode_update"]


@dataclass(frozen=True)
class CompressionPolicy:
    """Per-tensor choice of pipeline.

    Parameters
    ----------
    codec
        Spec for tensors with at least ``min_numel`` elements.
    small_codec
        Spec for smaller tensors.
    min_numel
        Size threshold in elements.
    """

    codec: str = "none"
    small_codec: str = "none"
    min_numel: int = 1024
    _pipelines: tuple[Pipeline, Pipeline] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.min_numel, bool) or not isinstance(self.min_numel, int) \
                or self.min_numel < 0:
            raise SpecError(f"min_numel must be a non-negative integer, got {self.min_numel!r}")
        object.__setattr__(self, "_pipelines",
                           (Pipeline.parse(self.codec), Pipeline.parse(self.small_codec)))

    @property
    def description(self) -> str:
        """One string naming the whole policy (keys saved feedback state)."""
        return f"{self._pipelines[0].spec} / small<{self.min_numel}: {self._pipelines[1].spec}"

    def pipeline_for(self, shape: Sequence[int]) -> Pipeline:
        """The pipeline a tensor of ``shape`` uses."""
        big, small = self._pipelines
        return big if math.prod(shape) >= self.min_numel else small

    def expected(self, shapes: Mapping[str, Sequence[int]]) -> dict[str, ExpectedTensor]:
        """What a receiver should demand of a payload for a model of these shapes."""
        return {name: ExpectedTensor(tuple(shape), self.pipeline_for(shape))
                for name, shape in shapes.items()}


@dataclass
class EncodedUpdate:
    """An encoded model update and what it cost."""

    payload: bytes
    decoded: dict[str, Any]
    encode_s: float
    numel: int

    @property
    def nbytes(self) -> int:
        return len(self.payload)

    @property
    def bits_per_param(self) -> float:
        return 8 * len(self.payload) / max(self.numel, 1)


def encode_update(
    tensors: Mapping[str, Any],
    policy: CompressionPolicy,
    *,
    rng: np.random.Generator,
    feedback: FeedbackMemory | None = None,
    meta: Mapping[str, Any] | None = None,
) -> EncodedUpdate:
    """Compress every tensor of an update (with error feedback) into one payload.

    Returns the payload, the values the receiver will decode (for the caller's own
    bookkeeping, e.g. a downlink replica), and the encode time.
    """
    memory = feedback if feedback is not None else NoFeedback()
    start = time.perf_counter()
    encoded = []
    decoded: dict[str, Any] = {}
    numel = 0
    for name, value in tensors.items():
        array, _ = to_numpy(value)
        pipeline = policy.pipeline_for(array.shape)
        root, decoded[name] = memory.compress(name, value, pipeline, rng)
        encoded.append(EncodedTensor(name, tuple(array.shape), pipeline, root))
        numel += array.size
    payload = pack_payload(encoded, meta)
    return EncodedUpdate(payload, decoded, time.perf_counter() - start, numel)
