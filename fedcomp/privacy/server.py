"""The server's side of a differentially private run, as hooks a strategy calls.

As Flower's DP wrappers sit around a strategy, :class:`ServerPrivacy` sits beside
``CompressedFedAvg``: the strategy asks it who trains, what each round's config
carries, how each decoded update is bounded, and what the round releases. It knows
nothing of Flower, so every rule is tested without a simulation.

``dp = "client"`` (central DP-FedAvg, :mod:`fedcomp.privacy.central`): Poisson client
sampling from a secret source, re-clipping of every decoded update, noise on the
clipped sum (on the shared subspace only, with ``shared-randk``), a fixed
denominator, a release every round whoever answered, optional adaptive clipping.

``dp = "sample"`` (DP-SGD on every client, :mod:`fedcomp.privacy.dpsgd`): the noise is
the clients'; the server replays each client's accounting to report the worst
client's epsilon and to stop before ``dp-target-epsilon``.

Impossible settings stop the run before round 1 with a :class:`SpecError` naming the
key: a delta of at least 1/N (client level: N clients; sample level: N examples of
the largest client), or a target epsilon that one round already exceeds.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from fedcomp.config import RunConfig
from fedcomp.errors import SpecError
from fedcomp.federated.aggregation import AggregationResult
from fedcomp.privacy.accounting import PrivacyAccountant
from fedcomp.privacy.central import (
    AdaptiveClipping,
    ClientLevelDP,
    SampleLevelBudget,
    adaptive_noise_multiplier,
    poisson_sample,
)
from fedcomp.privacy.noise import noise_source

__all__ = ["NoPrivacy", "ServerPrivacy", "server_privacy"]

log = logging.getLogger(__name__)


def server_privacy(cfg: RunConfig) -> ServerPrivacy | NoPrivacy:
    """The privacy hooks of a run: :class:`ServerPrivacy`, or :class:`NoPrivacy` for
    ``dp = "none"``, so that a strategy calls the same hooks either way."""
    return NoPrivacy() if cfg.dp == "none" else ServerPrivacy(cfg)


class NoPrivacy:
    """The hooks of a run without DP: they change nothing (updates weigh their
    example counts, the mean is published as it is)."""

    active = False
    #: Publish a mean only when enough updates arrived (``min-clients``).
    releases_every_round = False
    required_metrics: tuple[str, ...] = ("num-examples",)
    clip_norm = 0.0

    def sample(self, ordered_nodes: Sequence[int]) -> list[int] | None:
        return None

    def check_sample_plans(self, plans: Mapping[int, tuple[float, int, int]]) -> None:
        pass

    def stop_reason(self, server_round: int) -> str | None:
        return None

    def round_settings(self) -> dict[str, float]:
        return {}

    def weight(self, metrics: Mapping[str, float]) -> float:
        return float(metrics["num-examples"])

    def release(self, result: AggregationResult, shapes: Mapping[str, Sequence[int]],
                metrics: Mapping[int, Mapping[str, float]]) -> dict[str, np.ndarray] | None:
        return result.mean_delta

    def epsilon(self) -> float:
        return 0.0

    def summary(self) -> dict[str, Any]:
        return {"epsilon": None}

    def state_dict(self) -> None:
        return None

    def load_state_dict(self, state: Any) -> None:
        pass


class ServerPrivacy:
    """Sampling, bounding, noise and accounting of one DP run (``dp`` != ``"none"``)."""

    active = True

    def __init__(self, cfg: RunConfig) -> None:
        if cfg.dp == "none":
            raise ValueError("ServerPrivacy needs dp = 'client' or 'sample'")
        self.cfg = cfg
        self.noise = noise_source(cfg.dp_reproducible_noise, [cfg.seed, 0xD9])
        if self.noise.reproducible:
            log.warning("dp-reproducible-noise = true: the noise and the client sample are "
                        "drawn from the run's seed and can be regenerated: this run is NOT "
                        "differentially private")
        self.central: ClientLevelDP | None = None
        self.adaptive: AdaptiveClipping | None = None
        self.sample_budget: SampleLevelBudget | None = None
        if cfg.dp == "client":
            self.central = ClientLevelDP(cfg.dp_noise_multiplier, cfg.dp_clip_norm,
                                         cfg.dp_delta, cfg.dp_target_epsilon,
                                         PrivacyAccountant(cfg.dp_accountant))
            if cfg.dp_adaptive_clip:
                count_stddev = cfg.dp_clipped_count_stddev or max(
                    max(cfg.clients_per_round, 1) / 20, cfg.dp_noise_multiplier)
                self.adaptive = AdaptiveClipping(cfg.dp_clip_norm, cfg.dp_target_quantile,
                                                 cfg.dp_clip_lr, count_stddev)
                self.central.update_noise_multiplier = adaptive_noise_multiplier(
                    cfg.dp_noise_multiplier, count_stddev)
        else:
            self.sample_budget = SampleLevelBudget(cfg.dp_noise_multiplier, cfg.dp_delta,
                                                   cfg.dp_target_epsilon, cfg.dp_accountant)
        #: Client level releases a noisy mean every round, whoever answered.
        self.releases_every_round = cfg.dp == "client"
        #: The reply fields the run cannot do without (clients send no example counts).
        self.required_metrics: tuple[str, ...] = (
            ("dp-sample-rate", "dp-steps") if cfg.dp == "sample" else
            ("dp-unclipped",) if cfg.dp_adaptive_clip else ())
        #: This round's Poisson sampling rate and expected participants (client level).
        self.rate = 1.0
        self.expected = 1.0
        self._checked = False

    # ------------------------------------------------------------------ before a round
    def sample(self, ordered_nodes: Sequence[int]) -> list[int] | None:
        """Client level: each node joins with probability q = clients-per-round / N,
        drawn from the secret source; ``None`` at sample level (any sampler will do)."""
        if self.central is None:
            return None
        population = len(ordered_nodes)
        if population == 0:
            return []
        wanted = self.cfg.clients_per_round
        self.rate = min(1.0, wanted / population) if wanted > 0 else 1.0
        self.expected = self.rate * population
        self._check_client_level(population)
        return poisson_sample(list(ordered_nodes), self.rate, self.noise)

    def _check_client_level(self, population: int) -> None:
        if self._checked:
            return
        assert self.central is not None
        if self.cfg.dp_delta >= 1 / population:
            raise SpecError(f"run config 'dp-delta' = {self.cfg.dp_delta:g} must be below "
                            f"1/N = {1 / population:.3g} for N = {population} clients (a "
                            "delta that large allows releasing one client's data outright)")
        first = self.central.epsilon_after(self.rate)
        if self.cfg.dp_target_epsilon > 0 and first > self.cfg.dp_target_epsilon:
            raise SpecError(f"run config 'dp-target-epsilon' = {self.cfg.dp_target_epsilon:g} "
                            f"cannot be met: one round at this dp-noise-multiplier and "
                            f"sampling rate {self.rate:.3g} already costs epsilon {first:.3f}")
        self._checked = True

    def check_sample_plans(self, plans: Mapping[int, tuple[float, int, int]]) -> None:
        """Sample level, before round 1: each client's DP-SGD plan (sampling rate, steps
        a round, examples), as its ``query`` reply told it; refuses impossible settings."""
        if self.sample_budget is None or self._checked or not plans:
            return
        largest = max(examples for _, _, examples in plans.values())
        if self.cfg.dp_delta >= 1 / largest:
            raise SpecError(f"run config 'dp-delta' = {self.cfg.dp_delta:g} must be below "
                            f"1/n = {1 / largest:.3g} for the largest client's n = "
                            f"{largest} examples")
        if self.cfg.dp_target_epsilon > 0:
            for partition, (rate, steps, _) in sorted(plans.items()):
                first = SampleLevelBudget(self.cfg.dp_noise_multiplier, self.cfg.dp_delta,
                                          method=self.cfg.dp_accountant)
                first.record(partition, rate, steps)
                if first.epsilon() > self.cfg.dp_target_epsilon:
                    raise SpecError(
                        f"run config 'dp-target-epsilon' = {self.cfg.dp_target_epsilon:g} "
                        f"cannot be met: one round of DP-SGD on partition {partition} already "
                        f"costs epsilon {first.epsilon():.3f}")
        self._checked = True

    def stop_reason(self, server_round: int) -> str | None:
        """Why the run must stop before ``server_round`` (its budget), or None."""
        if self.central is not None and self.central.would_exceed(self.rate):
            return (f"stopped before round {server_round}: it would take epsilon to "
                    f"{self.central.epsilon_after(self.rate):.3f}, above dp-target-epsilon "
                    f"{self.cfg.dp_target_epsilon}")
        if self.sample_budget is not None and self.sample_budget.would_exceed():
            return (f"stopped before round {server_round}: it would take a client's DP-SGD "
                    f"epsilon to {self.sample_budget.epsilon_after_next_round():.3f}, above "
                    f"dp-target-epsilon {self.cfg.dp_target_epsilon}")
        return None

    def weight(self, metrics: Mapping[str, float]) -> float:
        """Every update weighs the same: clients send no example counts under DP."""
        return 1.0

    def round_settings(self) -> dict[str, float]:
        """What the round's train config carries: this round's clipping norm."""
        return {"dp-clip-current": self.central.clip_norm} if self.central is not None else {}

    @property
    def clip_norm(self) -> float:
        """The norm every decoded update is re-clipped to (0: none, sample level)."""
        return self.central.clip_norm if self.central is not None else 0.0

    # ------------------------------------------------------------------ after a round
    def release(self, result: AggregationResult, shapes: Mapping[str, Sequence[int]],
                metrics: Mapping[int, Mapping[str, float]]) -> dict[str, np.ndarray] | None:
        """The round's mean update to publish, and the round's accounting.

        Client level: noise on the clipped sum of exactly the coordinates in ``shapes``
        (the model's, or the subspace's compact ones), divided by the expected number
        of participants: released even when no update arrived (then it is noise only).
        Sample level: the mean of the accepted (already private) updates.
        """
        if self.central is not None:
            total = result.total if result.total is not None else {
                name: np.zeros(tuple(shape), dtype=np.float32) for name, shape in shapes.items()}
            mean = self.central.noisy_mean(total, self.expected, self.noise)
            self.central.record_round(self.rate)
            if self.adaptive is not None:
                unclipped = sum(1 for node in result.accepted
                                if float(metrics.get(node, {}).get("dp-unclipped", 0.0)) > 0)
                self.central.clip_norm = self.adaptive.update(
                    unclipped, len(result.accepted), self.expected, self.noise)
            return mean
        assert self.sample_budget is not None
        for node in result.accepted:
            reported = metrics.get(node, {})
            self.sample_budget.record(int(reported.get("partition-id", node)),
                                      float(reported["dp-sample-rate"]),
                                      int(reported["dp-steps"]))
        return result.mean_delta

    def epsilon(self) -> float:
        """Epsilon spent so far (sample level: the worst client's; never decreasing)."""
        if self.central is not None:
            return self.central.epsilon()
        assert self.sample_budget is not None
        return self.sample_budget.epsilon()

    def summary(self) -> dict[str, Any]:
        """What ``summary.json`` says of the run's privacy."""
        return {"epsilon": self.epsilon(), "dp_delta": self.cfg.dp_delta,
                "dp_accountant": self.cfg.dp_accountant,
                "dp_noise": ("seeded: NOT PRIVATE (dp-reproducible-noise)"
                             if self.noise.reproducible else "os-entropy"),
                "dp_final_clip": self.clip_norm if self.central is not None else None}

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The accounting and the clipping norm: never any state of the noise."""
        return {"history": self.central.state() if self.central is not None else [],
                "clip": self.clip_norm,
                "sample_budget": (self.sample_budget.state()
                                  if self.sample_budget is not None else {})}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if self.central is not None:
            self.central.restore(state["history"])
            clip = float(state["clip"])
            if not (clip > 0 and math.isfinite(clip)):
                raise ValueError(f"checkpoint holds an impossible clipping norm {clip!r}")
            self.central.clip_norm = clip
            if self.adaptive is not None:
                self.adaptive.clip_norm = clip
        if self.sample_budget is not None:
            self.sample_budget.restore(state.get("sample_budget", {}))
        self._checked = True
