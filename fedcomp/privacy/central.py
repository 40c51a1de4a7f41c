"""Client-level DP-FedAvg on the server: Poisson sampling, noise, adaptive clipping.

DP-FedAvg (McMahan et al., 2018) bounds each client's influence on a round and adds
Gaussian noise to the sum:

1. Each client joins a round with probability ``q`` (Poisson sampling), drawn from
   a secret source (:mod:`fedcomp.privacy.noise`): amplification by subsampling
   assumes nobody else knows who took part.
2. Each client clips what it sends to L2 norm ``C``; the server **re-clips each
   decoded update to** ``C``, so the bound holds whatever the codec did (Top-K never
   raises the norm, stochastic quantization can). The sum's L2 sensitivity to adding
   or removing one client is ``C``.
3. Noise ``N(0, (sigma C)^2)`` goes on every coordinate that a client could have
   changed: the whole model, or only the round's shared random subspace
   (:mod:`fedcomp.privacy.subspace`), whose positions do not depend on any data.
4. The noisy sum is divided by the *expected* number of participants ``q N``, a
   fixed denominator, and released every round, whoever answered.

Each round is one Poisson-subsampled Gaussian mechanism on the clipped sum;
:class:`~fedcomp.privacy.accounting.PrivacyAccountant` composes them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

from fedcomp.privacy.accounting import PrivacyAccountant, epsilon_of
from fedcomp.privacy.noise import NoiseSource

__all__ = [
    "AdaptiveClipping",
    "ClientLevelDP",
    "SampleLevelBudget",
    "adaptive_noise_multiplier",
    "poisson_sample",
]

T = TypeVar("T")


def poisson_sample(nodes: Sequence[T], rate: float, noise: NoiseSource) -> list[T]:
    """Each node independently with probability ``rate`` (order kept; may be empty)."""
    if not 0 < rate <= 1:
        raise ValueError(f"a sampling rate must be in (0, 1], got {rate!r}")
    if rate == 1:
        return list(nodes)
    draws = noise.uniform(len(nodes))
    return [node for node, u in zip(nodes, draws, strict=True) if u < rate]


@dataclass
class ClientLevelDP:
    """Server-side noise and cumulative (epsilon, delta) accounting.

    Parameters
    ----------
    noise_multiplier
        sigma of the accounted mechanism (with adaptive clipping, of the clipped sum
        and the clipped count together).
    clip_norm
        C: every contribution is clipped to this L2 norm.
    delta
        The delta of the reported (epsilon, delta).
    target_epsilon
        0 for none; otherwise training stops before a round that would exceed it.
    accountant
        Composes the rounds (PLD by default).
    update_noise_multiplier
        The noise multiplier on the clipped sum when it differs from the accounted
        one (adaptive clipping spends part of the budget on the clipped count).
    """

    noise_multiplier: float
    clip_norm: float
    delta: float = 1e-5
    target_epsilon: float = 0.0
    accountant: PrivacyAccountant = field(default_factory=PrivacyAccountant)
    update_noise_multiplier: float | None = None

    def __post_init__(self) -> None:
        if not self.noise_multiplier > 0 or not self.clip_norm > 0:
            raise ValueError("dp-noise-multiplier and dp-clip-norm must be > 0")
        if not 0 < self.delta < 1:
            raise ValueError(f"dp-delta must be in (0, 1), got {self.delta}")

    @property
    def noise_std(self) -> float:
        """Std of the noise on the clipped sum (for the current ``clip_norm``)."""
        return (self.update_noise_multiplier or self.noise_multiplier) * self.clip_norm

    def epsilon(self) -> float:
        """Epsilon at ``delta`` for all rounds recorded so far (0 before any)."""
        return self.accountant.epsilon(self.delta)

    def epsilon_after(self, sample_rate: float, rounds: int = 1) -> float:
        """Epsilon if ``rounds`` more rounds at ``sample_rate`` were run."""
        return self.accountant.epsilon_after(self.noise_multiplier, sample_rate, rounds,
                                             self.delta)

    def would_exceed(self, sample_rate: float) -> bool:
        """Whether one more round would take epsilon past the target."""
        return self.target_epsilon > 0 and self.epsilon_after(sample_rate) > self.target_epsilon

    def record_round(self, sample_rate: float) -> None:
        self.accountant.step(self.noise_multiplier, sample_rate)

    def noisy_mean(self, clipped_sum: Mapping[str, np.ndarray], expected_participants: float,
                   noise: NoiseSource) -> dict[str, np.ndarray]:
        """``(sum + N(0, (sigma C)^2)) / expected_participants``, tensor by tensor.

        ``clipped_sum`` holds exactly the coordinates a client could change (the
        whole model, or a subspace's compact tensors): each gets noise.
        """
        if not expected_participants > 0:
            raise ValueError("expected_participants must be > 0")
        return {name: ((value + noise.normal(self.noise_std, value.shape))
                       / expected_participants).astype(np.float32)
                for name, value in clipped_sum.items()}

    def state(self) -> list[list[float]]:
        """The accountant's history, JSON-able (for checkpoints)."""
        return self.accountant.state()

    def restore(self, history: list[list[float]]) -> None:
        self.accountant.restore(history)


def adaptive_noise_multiplier(noise_multiplier: float, count_stddev: float) -> float:
    """The clipped sum's noise multiplier when part of the budget goes to the count.

    Andrew et al. (2021), Theorem 1: releasing the clipped sum with noise multiplier
    ``z_delta`` and the clipped count with noise std ``count_stddev`` is as private as
    one Gaussian mechanism with multiplier ``z`` when
    ``z_delta = (z**-2 - (2 * count_stddev)**-2) ** -1/2``. This holds because the
    count has sensitivity 1/2: :class:`AdaptiveClipping` counts centred bits
    ``b - 1/2``, as TF Privacy's quantile estimator does (a raw 0/1 count has
    sensitivity 1, and would need ``count_stddev ** -2`` in place of
    ``(2 * count_stddev) ** -2``).

    Raises
    ------
    ValueError
        If ``count_stddev`` is too small to fit in the budget (``2 * count_stddev <= z``).
    """
    if count_stddev <= noise_multiplier / 2:
        raise ValueError(f"dp-clipped-count-stddev {count_stddev:g} must exceed half the "
                         f"noise multiplier ({noise_multiplier / 2:g}); raise it")
    return (noise_multiplier ** -2 - (2 * count_stddev) ** -2) ** -0.5


@dataclass
class AdaptiveClipping:
    """The clipping norm follows a quantile of the clients' update norms.

    Andrew et al. (2021), "Differentially Private Learning with Adaptive Clipping":
    each participant reports whether its update norm was at most the current ``C``
    (``b_i`` in {0, 1}); the server releases the noisy centred count
    ``sum(b_i - 1/2) + N(0, count_stddev^2)`` (sensitivity 1/2), estimates the
    unclipped fraction as that over the expected participants plus 1/2, and moves
    ``C`` geometrically, ``C <- C * exp(-learning_rate * (fraction - target_quantile))``.
    When more clients than the target fraction are under ``C`` it shrinks, else it
    grows, so ``C`` settles at the ``target_quantile`` of the norms.

    Parameters
    ----------
    clip_norm
        Initial ``C``.
    target_quantile
        Fraction of updates that should be left unclipped (0.5 in the paper).
    learning_rate
        ``eta_C`` of the geometric update (0.2 in the paper).
    count_stddev
        Noise std of the centred count (the paper suggests expected clients / 20).
    """

    clip_norm: float
    target_quantile: float = 0.5
    learning_rate: float = 0.2
    count_stddev: float = 1.0

    def __post_init__(self) -> None:
        if self.clip_norm <= 0 or self.learning_rate <= 0 or self.count_stddev <= 0:
            raise ValueError("adaptive clipping needs clip_norm, learning_rate and "
                             "count_stddev > 0")
        if not 0 < self.target_quantile < 1:
            raise ValueError(f"dp-target-quantile must be in (0, 1), got {self.target_quantile}")

    @staticmethod
    def centred_count(unclipped: int, participants: int) -> float:
        """The query the server noises: ``sum(b_i - 1/2)`` over the participants."""
        if not 0 <= unclipped <= participants:
            raise ValueError(f"{unclipped} unclipped of {participants} participants")
        return unclipped - participants / 2

    def update(self, unclipped: int, participants: int, expected: float,
               noise: NoiseSource) -> float:
        """Move ``C`` after a round in which ``unclipped`` of ``participants`` clients
        had norm <= ``C``; ``expected`` is the fixed expected number of participants."""
        if not expected > 0:
            raise ValueError("expected must be > 0")
        noisy = self.centred_count(unclipped, participants) + float(
            noise.normal(self.count_stddev, 1)[0])
        fraction = noisy / expected + 0.5
        self.clip_norm *= math.exp(-self.learning_rate * (fraction - self.target_quantile))
        return self.clip_norm


@dataclass
class SampleLevelBudget:
    """The server's replay of every client's DP-SGD spending (``dp = "sample"``).

    Each client reports its sampling rate and the steps it took in a round; the server
    composes them in its own accountant, one history per client, so that it reports
    the worst client's epsilon (never decreasing) and stops the run before a round that
    would take any known client past ``target_epsilon`` (the clients also refuse such
    a round themselves).
    """

    noise_multiplier: float
    delta: float
    target_epsilon: float = 0.0
    method: str = "pld"
    #: client -> (sampling rate, steps so far, steps in its last round)
    spent: dict[int, tuple[float, int, int]] = field(default_factory=dict)

    def record(self, client: int, sample_rate: float, steps: int) -> None:
        """Client ``client`` took ``steps`` steps at ``sample_rate`` this round."""
        if not 0 < sample_rate <= 1 or steps < 0:
            raise ValueError(f"not a DP-SGD round: rate {sample_rate!r}, steps {steps!r}")
        _, total, _ = self.spent.get(client, (sample_rate, 0, 0))
        self.spent[client] = (sample_rate, total + steps, steps)

    def _epsilon(self, q: float, steps: int) -> float:
        return epsilon_of([(self.noise_multiplier, q, steps)], self.delta, self.method)

    def epsilon(self) -> float:
        """The largest epsilon any known client has spent (grows with every round)."""
        return max((self._epsilon(q, total) for q, total, _ in self.spent.values()),
                   default=0.0)

    def epsilon_after_next_round(self) -> float:
        """The largest epsilon any known client would reach after one more round."""
        return max((self._epsilon(q, total + last) for q, total, last in self.spent.values()),
                   default=0.0)

    def would_exceed(self) -> bool:
        return self.target_epsilon > 0 and self.epsilon_after_next_round() > self.target_epsilon

    def state(self) -> dict[str, list[float]]:
        return {str(k): [q, total, last] for k, (q, total, last) in self.spent.items()}

    def restore(self, state: Mapping[str, Sequence[float]]) -> None:
        self.spent = {int(k): (float(q), int(t), int(n)) for k, (q, t, n) in state.items()}
