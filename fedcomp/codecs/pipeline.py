"""A chain of codec stages that is itself a codec.

How stages compose. Each stage encodes an array into an :class:`Encoded` node whose
parts are arrays. The next stage is then applied to some of those arrays:

* a ``"transform"`` stage (sparsifier, quantizer, low-rank) applies to the input and
  to the parts an earlier stage left *open* (``Codec.open_parts``): Top-K's kept
  ``values``, low-rank's factors. Indices, scales and packed codes are closed.
* a ``"bytes"`` stage (zstd) applies to every array produced so far.

So ``topk:ratio=0.01|quant:bits=4|zstd`` builds::

    topk ─ values ─ quant ─ codes ─ zstd
         │               ├ lo    ─ zstd
         │               └ step  ─ zstd
         └ ix_unary ─ zstd, ix_low ─ zstd

Decoding walks the same rule from the *expected* pipeline, not from the codec ids in
the payload: at every position the decoder knows which stage must be there and
rejects anything else, so a hostile payload cannot pick decoders, nest nodes more
deeply than the pipeline does, or change a stage's parameters (bits, chunk size):
those come from the receiver's own pipeline object.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from fedcomp.codecs.base import Codec, Encoded, check_float_input
from fedcomp.codecs.identity import Identity
from fedcomp.codecs.registry import get_codec
from fedcomp.codecs.spec import format_spec, parse_spec
from fedcomp.codecs.tensor import from_numpy, to_numpy
from fedcomp.errors import PayloadError, SpecError

__all__ = ["Identity", "Pipeline"]


class Pipeline(Codec):
    """Stages applied in turn; built from a spec string with :meth:`parse`.

    Parameters
    ----------
    stages
        Codecs in application order. Byte stages (zstd) must come after every
        transform stage. An empty sequence means ``none``.
    """

    codec_id: ClassVar[str] = "pipeline"

    def __init__(self, stages: Sequence[Codec]) -> None:
        stages = tuple(stages) or (Identity(),)
        seen_bytes = False
        for stage in stages:
            if isinstance(stage, Pipeline):
                raise SpecError("a pipeline stage cannot itself be a pipeline")
            if stage.kind == "bytes":
                seen_bytes = True
            elif seen_bytes:
                raise SpecError(
                    f"stage {stage.codec_id!r} comes after a lossless byte stage; put "
                    "byte stages (zstd) last"
                )
        self.stages: tuple[Codec, ...] = stages
        self._spec: str | None = None

    # ---------------------------------------------------------------- construction
    @classmethod
    def parse(cls, spec: str) -> Pipeline:
        """Build from a spec string such as ``"topk:ratio=0.01|quant:bits=4"``."""
        return cls([get_codec(config) for config in parse_spec(spec)])

    @property
    def spec(self) -> str:
        """Canonical spec string; ``Pipeline.parse(p.spec)`` rebuilds ``p``.

        Formatted once (the stages are fixed once built): an encode names its
        pipeline several times (layout, header, checks)."""
        if self._spec is None:
            self._spec = format_spec(
                [stage.get_config() for stage in self.stages],
                [stage.defaults() for stage in self.stages],
            )
        return self._spec

    def get_config(self) -> dict[str, Any]:
        return {"id": self.codec_id, "stages": [s.get_config() for s in self.stages]}

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> Pipeline:
        if config.get("id") != cls.codec_id or set(config) != {"id", "stages"}:
            raise SpecError(f"not a pipeline config: {dict(config)!r}")
        return cls([get_codec(stage) for stage in config["stages"]])

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Pipeline) and self.stages == other.stages

    def __hash__(self) -> int:
        return hash(self.stages)

    def __repr__(self) -> str:
        return f"Pipeline({self.spec!r})"

    # ---------------------------------------------------------------- flags
    @property
    def lossless(self) -> bool:  # type: ignore[override]
        return all(stage.lossless for stage in self.stages)

    @property
    def unbiased(self) -> bool:  # type: ignore[override]
        return all(stage.unbiased for stage in self.stages)

    @property
    def sparse(self) -> bool:  # type: ignore[override]
        return any(stage.sparse for stage in self.stages)

    # ---------------------------------------------------------------- encoding
    def _next_stage(self, after: int, is_open: bool) -> int | None:
        for j in range(after + 1, len(self.stages)):
            if is_open or self.stages[j].kind == "bytes":
                return j
        return None

    def _encode_at(self, x: np.ndarray, after: int, is_open: bool,
                   rng: np.random.Generator) -> np.ndarray | Encoded:
        j = self._next_stage(after, is_open)
        if j is None:
            return x
        stage = self.stages[j]
        node = stage.encode(x, rng=rng)
        parts = {
            name: self._encode_at(part, j, is_open and name in stage.open_parts, rng)
            for name, part in node.parts.items()
        }
        return Encoded(node.codec, node.meta, parts)

    def encode(self, x: Any, *, rng: np.random.Generator) -> Encoded:
        """Encode a float32 numpy array or torch tensor."""
        array, _ = to_numpy(x)
        root = self._encode_at(check_float_input(self.spec, array), -1, True, rng)
        assert isinstance(root, Encoded)
        return root

    # ---------------------------------------------------------------- decoding
    def _decode_at(self, part: Any, after: int, is_open: bool, max_numel: int) -> np.ndarray:
        j = self._next_stage(after, is_open)
        if j is None:
            if not isinstance(part, np.ndarray):
                raise PayloadError(f"{self.spec}: unexpected nested node", reason="header")
            return part
        stage = self.stages[j]
        if not isinstance(part, Encoded) or part.codec != stage.codec_id:
            got = part.codec if isinstance(part, Encoded) else "an array"
            raise PayloadError(
                f"{self.spec}: expected a {stage.codec_id!r} node, got {got!r}",
                reason="codec",
            )
        children = {
            name: self._decode_at(child, j, is_open and name in stage.open_parts, max_numel)
            for name, child in part.parts.items()
        }
        return stage.decode(Encoded(part.codec, part.meta, children), max_numel=max_numel)

    def decode(self, enc: Encoded, *, max_numel: int) -> np.ndarray:
        """Decode a root node; nothing allocated exceeds O(``max_numel``)."""
        # Nested stages may see slightly more elements than the tensor (low-rank pads
        # 1-D tensors to a matrix), never more than twice as many.
        out = self._decode_at(enc, -1, True, 2 * max_numel + 64)
        if out.size > max_numel:
            raise PayloadError(f"{self.spec}: decoded {out.size} elements, more than "
                               f"{max_numel}", reason="shape")
        return out

    def decode_tensor(self, enc: Encoded, shape: Sequence[int]) -> np.ndarray:
        """Decode a root node that must produce exactly ``shape`` (float32)."""
        shape = tuple(shape)
        out = self.decode(enc, max_numel=math.prod(shape))
        if out.shape != shape or out.dtype != np.float32:
            raise PayloadError(
                f"{self.spec}: decoded shape {out.shape} does not match expected {shape}",
                reason="shape",
            )
        return out

    def roundtrip(self, x: Any, *, rng: np.random.Generator) -> tuple[Encoded, Any]:
        """Encode ``x`` and decode it again; the decoded value is of ``x``'s kind."""
        array, kind = to_numpy(x)
        enc = self.encode(array, rng=rng)
        return enc, from_numpy(self.decode_tensor(enc, array.shape), kind)
