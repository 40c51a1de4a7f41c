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
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from opacus.accountants import RDPAccountant

__all__ = [
    "AdaptiveClipping",
    "ClientLevelDP",
    "PrivacyBudgetExhausted",
    "SampleLevelBudget",
    "adaptive_noise_multiplier",
    "clip_update",
    "strip_module_prefix",
    "train_dp_sgd",
    "update_norm",
]


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
    #: The noise multiplier of the update itself, when it differs from the accounted
    #: one (adaptive clipping spends part of the budget on the clipped count).
    update_noise_multiplier: float | None = None

    def __post_init__(self) -> None:
        if self.noise_multiplier <= 0 or self.clip_norm <= 0:
            raise ValueError("dp-noise-multiplier and dp-clip-norm must be > 0")
        if not 0 < self.delta < 1:
            raise ValueError(f"dp-delta must be in (0, 1), got {self.delta}")

    @property
    def noise_std(self) -> float:
        """Std of the noise on the clipped sum (for the current ``clip_norm``)."""
        return (self.update_noise_multiplier or self.noise_multiplier) * self.clip_norm

    def epsilon(self) -> float:
        """Epsilon at ``delta`` for all rounds recorded so far (0 before any)."""
        return _epsilon(self.accountant.history, self.delta)

    def epsilon_after(self, sample_rate: float, rounds: int = 1) -> float:
        """Epsilon if ``rounds`` more rounds at ``sample_rate`` were run."""
        return _epsilon([*self.accountant.history,
                         (self.noise_multiplier, sample_rate, rounds)], self.delta)

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


def adaptive_noise_multiplier(noise_multiplier: float, count_stddev: float) -> float:
    """The update's noise multiplier when part of the budget goes to the clipped count.

    Andrew et al. (2021), Theorem 1: releasing the clipped sum with noise multiplier
    ``z_delta`` and the clipped count (sensitivity 1/2 after centring) with noise std
    ``count_stddev`` is as private as one Gaussian mechanism with multiplier ``z``
    when ``z_delta = (z**-2 - (2 * count_stddev)**-2) ** -1/2``. The accountant is then
    run with ``z``.

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

    Andrew et al. (2021), "Differentially Private Learning with Adaptive Clipping": each
    sampled client reports whether its update norm was at most the current ``C``
    (``b_i`` in {0, 1}); the server releases the noisy fraction
    ``b = (sum b_i + N(0, count_stddev**2)) / expected`` and moves ``C`` geometrically,
    ``C <- C * exp(-learning_rate * (b - target_quantile))``. When more clients than
    the target fraction are under ``C``, it shrinks, and it grows otherwise, so ``C``
    settles at the ``target_quantile`` of the norms.

    Parameters
    ----------
    clip_norm
        Initial ``C``.
    target_quantile
        Fraction of updates that should be left unclipped (0.5 in the paper).
    learning_rate
        ``eta_C`` of the geometric update (0.2 in the paper).
    count_stddev
        Noise std of the clipped count (the paper suggests expected clients / 20).
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

    def update(self, unclipped: int, expected: int, rng: np.random.Generator) -> float:
        """Move ``C`` after a round in which ``unclipped`` clients had norm <= ``C``."""
        if expected < 1:
            raise ValueError("expected must be >= 1")
        fraction = (unclipped + rng.normal(0.0, self.count_stddev)) / expected
        self.clip_norm *= math.exp(-self.learning_rate * (fraction - self.target_quantile))
        return self.clip_norm


# ------------------------------------------------------------------ sample-level DP
def strip_module_prefix(state: Mapping[str, Any]) -> dict[str, Any]:
    """State-dict keys without the ``_module.`` prefix Opacus' wrapper adds."""
    return {k.removeprefix("_module."): v for k, v in state.items()}


def train_dp_sgd(
    model: torch.nn.Module,
    x: np.ndarray,
    y: np.ndarray,
    *,
    epochs: int,
    steps: int,
    batch_size: int,
    lr: float,
    momentum: float,
    noise_multiplier: float,
    max_grad_norm: float,
    history: list[tuple[float, float, int]],
    delta: float,
    seed: int,
    target_epsilon: float = 0.0,
) -> tuple[float, list[tuple[float, float, int]], float]:
    """DP-SGD with Opacus on one client's data; the accountant carries on from ``history``.

    Opacus clips every example's gradient to ``max_grad_norm``, adds Gaussian noise of
    std ``noise_multiplier * max_grad_norm`` to each batch's sum, and samples batches
    by Poisson sampling with rate ``batch_size / len(y)``, as its RDP analysis
    assumes. One accountant serves the client's whole life: ``history`` (kept in the
    client's state between rounds) is loaded into it first, so the epsilon returned
    is cumulative over every round this client has trained, not per round (Flower's
    own Opacus example makes a new engine every round and reports the latter).

    Returns
    -------
    (mean loss, the accountant's new history, epsilon at ``delta`` so far)

    Raises
    ------
    PrivacyBudgetExhausted
        If ``target_epsilon`` > 0 and this round would take epsilon past it; the
        model is left untouched.
    """
    from opacus import PrivacyEngine
    from torch.utils.data import DataLoader, TensorDataset

    if len(y) == 0:
        return float("nan"), list(history), _epsilon(history, delta)
    batches = math.ceil(len(y) / min(batch_size, len(y)))
    planned = steps if steps > 0 else epochs * batches
    if target_epsilon > 0:
        after = _epsilon([*history, (noise_multiplier, 1 / batches, planned)], delta)
        if after > target_epsilon:
            raise PrivacyBudgetExhausted(
                f"this round of DP-SGD would take epsilon to {after:.3f}, above "
                f"dp-target-epsilon {target_epsilon}: not training")
    torch_gen = torch.Generator().manual_seed(seed)
    loader = DataLoader(TensorDataset(torch.from_numpy(x), torch.from_numpy(y)),
                        batch_size=min(batch_size, len(y)), generator=torch_gen)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    with warnings.catch_warnings():
        # We pass seeded generators on purpose (reproducible runs); Opacus warns that
        # its secure RNG is off. The README says so once, not every round.
        warnings.filterwarnings("ignore", message="Secure RNG turned off")
        engine = PrivacyEngine(accountant="rdp")
    engine.accountant.history = [tuple(h) for h in history]
    private_model, private_opt, private_loader = engine.make_private(
        module=model, optimizer=optimizer, data_loader=loader,
        noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm,
        poisson_sampling=True, noise_generator=torch.Generator().manual_seed(seed + 1))
    loss_fn = torch.nn.CrossEntropyLoss()
    private_model.train()
    target_steps = steps if steps > 0 else epochs * len(private_loader)
    total, taken = 0.0, 0
    while taken < target_steps:
        for xb, yb in private_loader:
            private_opt.zero_grad()
            if len(yb) == 0:  # Poisson sampling can draw an empty batch: still a step
                private_opt.step()
            else:
                loss = loss_fn(private_model(xb), yb)
                with warnings.catch_warnings():  # Opacus' hooks on an input without grad
                    warnings.filterwarnings("ignore", message="Full backward hook")
                    loss.backward()
                private_opt.step()
                total += loss.item()
            taken += 1
            if taken >= target_steps:
                break
    # The wrapped module shares its parameters with ``model``; load them back by name
    # all the same, so that callers never see Opacus' "_module." keys.
    model.load_state_dict(strip_module_prefix(private_model.state_dict()))
    new_history = [(float(s), float(q), int(n)) for s, q, n in engine.accountant.history]
    return total / max(taken, 1), new_history, _epsilon(new_history, delta)


def _epsilon(history: list[tuple[float, float, int]], delta: float) -> float:
    if not history:
        return 0.0
    accountant = RDPAccountant()
    accountant.history = list(history)
    return float(accountant.get_epsilon(delta=delta))


class PrivacyBudgetExhausted(RuntimeError):
    """Raised by a client whose next round of DP-SGD would exceed ``dp-target-epsilon``."""


@dataclass
class SampleLevelBudget:
    """The server's view of every client's DP-SGD spending (``dp = "sample"``).

    Each client reports its sampling rate and the steps it took in a round; the server
    replays them in its own RDP accountants, one per client, so that it can stop the
    run before a round that would take any known client past ``target_epsilon`` (the
    clients also refuse such a round themselves).
    """

    noise_multiplier: float
    delta: float
    target_epsilon: float = 0.0
    spent: dict[int, tuple[float, int, int]] = field(default_factory=dict)

    def record(self, client: int, sample_rate: float, steps: int) -> None:
        """Client ``client`` took ``steps`` steps at ``sample_rate`` this round."""
        _, total, _ = self.spent.get(client, (sample_rate, 0, 0))
        self.spent[client] = (sample_rate, total + steps, steps)

    def epsilon_after_next_round(self) -> float:
        """The largest epsilon any known client would reach after one more round."""
        return max((_epsilon([(self.noise_multiplier, q, total + last)], self.delta)
                    for q, total, last in self.spent.values()), default=0.0)

    def would_exceed(self) -> bool:
        return self.target_epsilon > 0 and self.epsilon_after_next_round() > self.target_epsilon

    def state(self) -> dict[str, list[float]]:
        return {str(k): [q, total, last] for k, (q, total, last) in self.spent.items()}

    def restore(self, state: dict[str, list[float]]) -> None:
        self.spent = {int(k): (float(q), int(t), int(n)) for k, (q, t, n) in state.items()}
