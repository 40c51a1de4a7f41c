"""Server optimizers applied to the mean client delta (Reddi et al., 2021).

The mean delta acts as a pseudo-gradient step. ``sgd`` adds it scaled by the server
learning rate (``server-lr = 1`` is FedAvg); ``momentum`` is FedAvgM (Hsu et al.,
2019); ``adam`` and ``yogi`` are FedAdam and FedYogi. State (momentum, moments) is
created lazily per tensor and saved by :meth:`ServerOptimizer.state_dict` for
checkpoints. Arithmetic stays in float32, like the model.

The server learning rate may follow a cosine schedule from ``lr`` down to ``lr_final``
over ``total_steps`` rounds (Loshchilov and Hutter, 2017). FedAdam's steps are nearly
sign-sized whatever the update's magnitude, so with sparse updates its constant step
is also a constant noise floor late in training; annealing it is how centralized
training removes that floor.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

__all__ = ["ServerOptimizer"]

KINDS = ("sgd", "momentum", "adam", "yogi")
SCHEDULES = ("constant", "cosine")


@dataclass
class ServerOptimizer:
    """``new_model = step(model, mean_delta)`` with FedAvg/FedAvgM/FedAdam/FedYogi rules.

    Parameters
    ----------
    kind
        ``sgd``, ``momentum``, ``adam`` or ``yogi``.
    lr
        Server learning rate.
    momentum
        FedAvgM's momentum.
    beta1, beta2, tau
        Adam/Yogi moment decay rates and the adaptivity floor added to ``sqrt(v)``.
    schedule, lr_final, total_steps
        ``constant`` keeps ``lr``; ``cosine`` anneals it to ``lr_final`` at step
        ``total_steps`` (and keeps ``lr_final`` after).
    """

    kind: str = "sgd"
    lr: float = 1.0
    momentum: float = 0.9
    beta1: float = 0.9
    beta2: float = 0.99
    tau: float = 1e-3
    schedule: str = "constant"
    lr_final: float = 0.0
    total_steps: int = 1
    state: dict[str, np.ndarray] = field(default_factory=dict)
    steps: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown server optimizer {self.kind!r}; choose {', '.join(KINDS)}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"unknown server learning-rate schedule {self.schedule!r}; "
                             f"choose {', '.join(SCHEDULES)}")
        if self.total_steps < 1:
            raise ValueError(f"total_steps must be >= 1, got {self.total_steps}")

    def lr_at(self, step: int) -> float:
        """The learning rate of step ``step`` (1-based, as :attr:`steps` after it)."""
        if self.schedule == "constant":
            return self.lr
        progress = min(max(step - 1, 0) / max(self.total_steps - 1, 1), 1.0)
        return self.lr_final + 0.5 * (self.lr - self.lr_final) * (1 + math.cos(math.pi * progress))

    def _slot(self, key: str, like: np.ndarray, fill: float = 0.0) -> np.ndarray:
        if key not in self.state:
            self.state[key] = np.full(like.shape, fill, dtype=np.float32)
        return self.state[key]

    def step(self, model: Mapping[str, np.ndarray],
             delta: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Return the new model (the inputs are not modified)."""
        self.steps += 1
        lr = np.float32(self.lr_at(self.steps))
        out: dict[str, np.ndarray] = {}
        for name, w in model.items():
            d = np.asarray(delta[name], dtype=np.float32)
            if self.kind == "sgd":
                out[name] = w + lr * d
            elif self.kind == "momentum":
                v = self._slot(f"v/{name}", d)
                v *= np.float32(self.momentum)
                v += d
                out[name] = w + lr * v
            else:
                m = self._slot(f"m/{name}", d)
                v = self._slot(f"v/{name}", d, fill=self.tau**2)
                m *= np.float32(self.beta1)
                m += np.float32(1 - self.beta1) * d
                d2 = d * d
                if self.kind == "adam":
                    v *= np.float32(self.beta2)
                    v += np.float32(1 - self.beta2) * d2
                else:  # Yogi: additive, sign-controlled update of v
                    v -= np.float32(1 - self.beta2) * d2 * np.sign(v - d2)
                out[name] = w + lr * m / (np.sqrt(v) + np.float32(self.tau))
        return out

    def step_if_finite(self, model: Mapping[str, np.ndarray],
                       delta: Mapping[str, np.ndarray]) -> dict[str, np.ndarray] | None:
        """:meth:`step`, or None, with the optimizer's state untouched, when the new
        model would hold a NaN or an infinity (an overflow must never be published)."""
        saved_steps, saved_state = self.steps, {k: v.copy() for k, v in self.state.items()}
        with np.errstate(over="ignore", invalid="ignore"):
            out = self.step(model, delta)
        if all(np.isfinite(v).all() for v in out.values()) and all(
                np.isfinite(v).all() for v in self.state.values()):
            return out
        self.steps, self.state = saved_steps, saved_state
        return None

    def state_dict(self) -> dict[str, np.ndarray]:
        state = {f"state/{k}": v for k, v in self.state.items()}
        state["steps"] = np.array([self.steps], dtype=np.int64)
        return state

    def load_state_dict(self, state: Mapping[str, np.ndarray]) -> None:
        self.steps = int(np.asarray(state["steps"])[0])
        self.state = {k[len("state/"):]: np.array(v, dtype=np.float32)
                      for k, v in state.items() if k.startswith("state/")}
