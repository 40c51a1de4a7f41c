"""Where the randomness of a differentially private run comes from.

Why this module exists. A Gaussian mechanism protects nothing if the noise can be
regenerated: a generator seeded from the run's seed (which ``summary.json`` records)
lets anyone holding the results subtract the noise and recover the clipped sum. The
same holds for the choice of participants: privacy amplification by subsampling
assumes that the adversary does not know who was sampled.

So every draw that a privacy guarantee rests on (the server's noise, the clipped-count
noise of adaptive clipping, Poisson client sampling, DP-SGD's noise and batch
sampling) goes through a :class:`NoiseSource`:

* :class:`SecureNoise` (the default) reads the operating system's CSPRNG
  (``os.urandom``) for every draw. Nothing is seeded, nothing is stored, and two runs
  with the same seed draw different noise. Gaussian samples are built from those
  uniform bits by Box-Muller, and each is the scaled sum of four draws, the defence
  against floating-point attacks on Gaussian samplers that Opacus' ``secure_mode``
  uses (Holohan and Braghin, 2021, section 5.1). Hand-written because NumPy has no
  cryptographically secure bit generator and Opacus' secure mode needs
  ``torchcsprng``, which is not maintained for current torch releases.
* :class:`SeededNoise` is for experiments that must be repeatable bit for bit
  (``dp-reproducible-noise = true``). It gives **no privacy**; the run records it in
  ``summary.json`` and logs a warning.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Protocol

import numpy as np

__all__ = ["NoiseSource", "SecureNoise", "SeededNoise", "noise_source"]

_TWO_PI = 2.0 * np.pi
#: Bytes read from the OS per call at most (larger draws are read in pieces).
_CHUNK_BYTES = 1 << 24


class NoiseSource(Protocol):
    """Randomness for a privacy mechanism."""

    #: Whether the draws can be regenerated (true only for :class:`SeededNoise`).
    reproducible: bool

    def normal(self, std: float, shape: int | Sequence[int]) -> np.ndarray:
        """Gaussian samples N(0, std^2) as float64."""
        ...

    def uniform(self, size: int) -> np.ndarray:
        """Uniform samples in [0, 1) as float64."""
        ...


class SecureNoise:
    """Draws from the operating system's CSPRNG; nothing to seed, store or replay."""

    reproducible = False

    def uniform(self, size: int) -> np.ndarray:
        """``size`` uniforms in [0, 1) with 53 random bits each (all a float64 holds)."""
        if size < 0:
            raise ValueError(f"size must be >= 0, got {size}")
        words = np.empty(size, dtype=np.uint64)
        per_chunk = _CHUNK_BYTES // 8
        for start in range(0, size, per_chunk):
            count = min(per_chunk, size - start)
            words[start:start + count] = np.frombuffer(os.urandom(8 * count), dtype=np.uint64)
        return (words >> np.uint64(11)).astype(np.float64) * 2.0 ** -53

    def _standard_normal(self, count: int) -> np.ndarray:
        """``count`` standard normals by Box-Muller (two per pair of uniforms)."""
        pairs = (count + 1) // 2
        u = self.uniform(2 * pairs)
        radius = np.sqrt(-2.0 * np.log1p(-u[:pairs]))  # 1 - u is in (0, 1]: log is finite
        angle = _TWO_PI * u[pairs:]
        out = np.empty(2 * pairs, dtype=np.float64)
        np.multiply(radius, np.cos(angle), out=out[:pairs])
        np.multiply(radius, np.sin(angle), out=out[pairs:])
        return out[:count]

    def normal(self, std: float, shape: int | Sequence[int]) -> np.ndarray:
        """N(0, std^2) as (sum of four N(0, std^2) draws) / 2: the same distribution."""
        if not std >= 0:
            raise ValueError(f"noise std must be >= 0, got {std!r}")
        size = int(np.prod(shape))
        total = self._standard_normal(size)
        for _ in range(3):
            total += self._standard_normal(size)
        total *= std / 2.0
        return total.reshape(shape)


class SeededNoise:
    """NumPy's PCG64 from a seed: repeatable, and so **not private**."""

    reproducible = True

    def __init__(self, seed: Sequence[int] | int) -> None:
        self.rng = np.random.default_rng(seed)

    def uniform(self, size: int) -> np.ndarray:
        return self.rng.random(size)

    def normal(self, std: float, shape: int | Sequence[int]) -> np.ndarray:
        if not std >= 0:
            raise ValueError(f"noise std must be >= 0, got {std!r}")
        return self.rng.normal(0.0, std, size=shape)


def noise_source(reproducible: bool, seed: Sequence[int] | int = 0) -> NoiseSource:
    """:class:`SeededNoise` from ``seed`` if ``reproducible``, else :class:`SecureNoise`."""
    return SeededNoise(seed) if reproducible else SecureNoise()
