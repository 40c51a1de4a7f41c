"""A random subspace shared by every client of a round: Rand-K without index bytes.

Why. Under differential privacy, Top-K chooses its coordinates from the data, so the
server cannot know which coordinates an update touched and must noise all ``d`` of
them: the noise norm grows with ``sqrt(d)`` while each client's contribution is
clipped to ``C``. A subspace whose positions are a pure function of public values
(the run's seed, the round and the tensor's name) is data-independent: clients train,
clip and send only its ``k`` coordinates, and the server adds noise only there, so the
noise norm grows with ``sqrt(k)`` and all of ``C`` is spent on coordinates that are
sent. The positions cost no bytes: both sides compute them.

Tensors under ``min_numel`` elements (biases) are sent whole: they are a rounding
error of the bytes and a large share of the accuracy.

A compact update holds, per tensor, the subspace's values as a 1-D array (or the whole
tensor when it is small); :meth:`RandomSubspace.project` and :meth:`RandomSubspace.lift`
convert between the two.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["RandomSubspace"]


@dataclass(frozen=True)
class RandomSubspace:
    """The coordinates of one round's shared subspace.

    Parameters
    ----------
    ratio
        Fraction of each large tensor's coordinates in the subspace, in (0, 1].
    seed
        The run's seed.
    server_round
        The round: the subspace changes every round.
    min_numel
        Tensors with fewer elements are kept whole.
    """

    ratio: float
    seed: int
    server_round: int
    min_numel: int = 1024

    def __post_init__(self) -> None:
        if not 0 < self.ratio <= 1:
            raise ValueError(f"a subspace ratio must be in (0, 1], got {self.ratio!r}")

    def count(self, numel: int) -> int:
        """How many coordinates of a tensor of ``numel`` elements the subspace keeps."""
        if numel < self.min_numel:
            return numel
        return min(numel, max(1, round(self.ratio * numel)))

    def positions(self, name: str, numel: int) -> np.ndarray | None:
        """Sorted flat positions kept of tensor ``name``; ``None`` for the whole tensor."""
        k = self.count(numel)
        if k == numel:
            return None
        rng = np.random.default_rng([self.seed, self.server_round, zlib.crc32(name.encode())])
        chosen = rng.choice(numel, size=k, replace=False, shuffle=False)
        chosen.sort()
        return chosen

    def compact_shapes(self, shapes: Mapping[str, Sequence[int]]) -> dict[str, tuple[int, ...]]:
        """The shape of each tensor of a compact update."""
        out = {}
        for name, shape in shapes.items():
            numel = math.prod(shape)
            k = self.count(numel)
            out[name] = tuple(shape) if k == numel else (k,)
        return out

    def project(self, tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The compact update: each tensor's subspace values (small tensors whole)."""
        out = {}
        for name, value in tensors.items():
            where = self.positions(name, value.size)
            out[name] = (np.array(value, dtype=np.float32) if where is None
                         else np.asarray(value, dtype=np.float32).reshape(-1)[where])
        return out

    def lift(self, compact: Mapping[str, np.ndarray], shapes: Mapping[str, Sequence[int]]
             ) -> dict[str, np.ndarray]:
        """Full tensors of ``shapes``: the compact values in place, zero elsewhere."""
        out = {}
        for name, shape in shapes.items():
            numel = math.prod(shape)
            where = self.positions(name, numel)
            value = np.asarray(compact[name], dtype=np.float32)
            if where is None:
                out[name] = value.reshape(shape).copy()
            else:
                full = np.zeros(numel, dtype=np.float32)
                full[where] = value.reshape(-1)
                out[name] = full.reshape(shape)
        return out

    def masks(self, shapes: Mapping[str, Sequence[int]]) -> dict[str, np.ndarray]:
        """Boolean masks of the subspace, one per tensor (DP-SGD masks its gradients)."""
        out = {}
        for name, shape in shapes.items():
            numel = math.prod(shape)
            where = self.positions(name, numel)
            mask = np.ones(numel, dtype=bool)
            if where is not None:
                mask[:] = False
                mask[where] = True
            out[name] = mask.reshape(shape)
        return out
