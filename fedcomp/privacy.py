"""Client-level differential privacy for compressed updates (DP-FedAvg).

DP-FedAvg (McMahan et al., 2018) bounds each client's influence on a round and adds
Gaussian noise to the sum:

1. Each client clips its delta to L2 norm ``C`` before compressing it.
2. The server **re-clips each decoded update to** ``C``. This makes the bound hold by
   construction whatever the codec does. Top-K never raises the norm, but stochastic
   quantization can, and error feedback adds a residual to the clipped delta. Every
   contribution entering the sum has norm <= ``C``, so the sum's L2 sensitivity to
   adding or removing one client is ``C``.
3. Noise ``N(0, (sigma * C)^2)`` is added to the sum of the (unweighted) clipped
   updates. The sum is divided by the *expected* number of participants, a fixed
   denominator that does not depend on who answered, before the server optimizer.

Error feedback stays valid: the residual never leaves the client, and what does leave
is re-clipped and noised like everything else. Each round is a subsampled Gaussian
mechanism on the clipped sum, and the dependence on earlier rounds is covered by
adaptive composition. The noise is added by the server (central DP, a trusted
server).

Accounting uses Opacus' RDP accountant for the subsampled Gaussian mechanism, with
sampling rate ``q = clients sampled / clients connected``, over all rounds so far.
Opacus assumes Poisson sampling; we sample a fixed number without replacement, the
usual approximation in federated DP and the one Flower's own DP examples make.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
from opacus.accountants import RDPAccountant

__all__ = ["ClientLevelDP", "clip_update", "update_norm"]


def update_norm(tensors: Mapping[str, np.ndarray]) -> float:
    """L2 norm of a whole update (all tensors together), in float64."""
    return math.sqrt(sum(float(np.vdot(v.astype(np.float64), v.astype(np.float64)))
                         for v in tensors.values()))


def clip_update(tensors: Mapping[str, np.ndarray], clip_norm: float
                ) -> tuple[dict[str, np.ndarray], float]:
    """Scale the update so its L2 norm is at most ``clip_norm``; return (update, norm).

    The factor is computed in float64 and slightly shrunk, so the float32 result
    stays within the bound after rounding.
    """
    norm = update_norm(tensors)
    if norm <= clip_norm:
        return {k: np.asarray(v, dtype=np.float32) for k, v in tensors.items()}, norm
    factor = np.float32(clip_norm / norm * (1 - 1e-6))
    return {k: (np.asarray(v, dtype=np.float32) * factor) for k, v in tensors.items()}, norm


@dataclass
class ClientLevelDP:
    """Server-side noise and cumulative (epsilon, delta) accounting.

    Parameters
    ----------
    noise_multiplier
        sigma: noise std is ``sigma * clip_norm``.
    clip_norm
        C: every contribution is clipped to this L2 norm.
    delta
        The delta of the reported (epsilon, delta).
    target_epsilon
        0 for none; otherwise training stops before a round that would exceed it.
    """

    noise_multiplier: float
    clip_norm: float
    delta: float = 1e-5
    target_epsilon: float = 0.0
    accountant: RDPAccountant = field(default_factory=RDPAccountant)

    def __post_init__(self) -> None:
        if self.noise_multiplier <= 0 or self.clip_norm <= 0:
            raise ValueError("dp-noise-multiplier and dp-clip-norm must be > 0")
        if not 0 < self.delta < 1:
            raise ValueError(f"dp-delta must be in (0, 1), got {self.delta}")

    @property
    def noise_std(self) -> float:
        return self.noise_multiplier * self.clip_norm

    def epsilon(self) -> float:
        """Epsilon at ``delta`` for all rounds recorded so far (0 before any)."""
        if not self.accountant.history:
            return 0.0
        return float(self.accountant.get_epsilon(delta=self.delta))

    def epsilon_after(self, sample_rate: float, rounds: int = 1) -> float:
        """Epsilon if ``rounds`` more rounds at ``sample_rate`` were run."""
        trial = RDPAccountant()
        trial.history = [*self.accountant.history, (self.noise_multiplier, sample_rate, rounds)]
        return float(trial.get_epsilon(delta=self.delta))

    def would_exceed(self, sample_rate: float) -> bool:
        """Whether one more round would take epsilon past the target."""
        return self.target_epsilon > 0 and self.epsilon_after(sample_rate) > self.target_epsilon

    def record_round(self, sample_rate: float) -> None:
        self.accountant.step(noise_multiplier=self.noise_multiplier, sample_rate=sample_rate)

    def noisy_mean(self, clipped_sum: Mapping[str, np.ndarray], expected_participants: int,
                   rng: np.random.Generator) -> dict[str, np.ndarray]:
        """``(sum + N(0, (sigma C)^2)) / expected_participants``, tensor by tensor."""
        if expected_participants < 1:
            raise ValueError("expected_participants must be >= 1")
        out = {}
        for name, value in clipped_sum.items():
            noise = rng.normal(0.0, self.noise_std, size=value.shape)
            out[name] = ((value + noise) / expected_participants).astype(np.float32)
        return out

    def state(self) -> list[list[float]]:
        """The accountant's history, JSON-able (for checkpoints)."""
        return [[float(s), float(q), int(n)] for s, q, n in self.accountant.history]

    def restore(self, history: list[list[float]]) -> None:
        self.accountant.history = [(float(s), float(q), int(n)) for s, q, n in history]
