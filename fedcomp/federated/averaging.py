"""Server-side model averaging: an exponential moving average of the server's models.

Why: with 10 of 100 non-IID clients a round, each round's model leans toward the
clients just drawn, and a sparse uplink adds its own round-to-round noise; the test
accuracy of consecutive evaluations (5 rounds apart) differs by up to 2 points in the
headline setting (experiments/RESULTS.md). Averaging
the iterates (Polyak and Juditsky, 1992; in federated learning the server-side SWA of
Caldarola et al., 2022, "Improving Generalization in Federated Learning by Seeking
Flat Minima") averages over the clients drawn in recent rounds as well as over the
noise. It lives on the server only: clients keep training from the server's own
model, no byte is sent for it, and the averaged model is the one a run evaluates
(``accuracy`` in ``rounds.csv``; the server's own model's is ``raw_accuracy``).

The decay warms up as TensorFlow's ``ExponentialMovingAverage`` with ``num_updates``
does, ``min(decay, (1 + t) / (10 + t))`` at the t-th update, so the first rounds'
average does not hold on to the random initial model.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import InitVar, dataclass, field

import numpy as np

__all__ = ["ModelAverage"]


@dataclass
class ModelAverage:
    """``average <- d * average + (1 - d) * model`` after every server step.

    Parameters
    ----------
    decay
        The long-run decay ``d`` in [0, 1): 0 keeps only the latest model; 0.9
        averages over about the last ten rounds once the warm-up's decay reaches it
        (after 80 updates; before, about the last ``(10 + t) / 9``).
    initial
        The model the average starts from (the round-0 model).

    Notes
    -----
    Arithmetic is float32 like the model's; ``state_dict`` and ``load_state_dict``
    carry the average and the update count through a checkpoint.
    """

    decay: float
    initial: InitVar[Mapping[str, np.ndarray]]
    updates: int = 0
    value: dict[str, np.ndarray] = field(init=False, repr=False)

    def __post_init__(self, initial: Mapping[str, np.ndarray]) -> None:
        if not 0.0 <= self.decay < 1.0:
            raise ValueError(f"model-average decay must be in [0, 1), got {self.decay!r}")
        self.value = {k: np.array(v, dtype=np.float32, copy=True) for k, v in initial.items()}

    def current_decay(self) -> float:
        """The decay the next update uses (warm-up included)."""
        return min(self.decay, (1.0 + self.updates) / (10.0 + self.updates))

    def update(self, model: Mapping[str, np.ndarray]) -> None:
        """Fold the server's new model into the average."""
        if set(model) != set(self.value):
            raise ValueError(f"model tensors {sorted(model)} differ from the average's "
                             f"{sorted(self.value)}")
        d = np.float32(self.current_decay())
        for name, average in self.value.items():
            new = np.asarray(model[name], dtype=np.float32)
            if new.shape != average.shape:
                raise ValueError(f"tensor {name!r} has shape {new.shape}, the average "
                                 f"{average.shape}")
            average *= d
            average += (np.float32(1.0) - d) * new
        self.updates += 1

    def state_dict(self) -> dict[str, np.ndarray]:
        """Arrays for a checkpoint: the average, and the update count as a 0-d array."""
        state = {f"value/{k}": v.copy() for k, v in self.value.items()}
        state["updates"] = np.array(self.updates, dtype=np.int64)
        return state

    def load_state_dict(self, state: Mapping[str, np.ndarray]) -> None:
        """Restore what :meth:`state_dict` saved (same tensors)."""
        value = {k[len("value/"):]: np.array(v, dtype=np.float32)
                 for k, v in state.items() if k.startswith("value/")}
        if set(value) != set(self.value) or "updates" not in state:
            raise ValueError("checkpoint's model average does not match this model")
        self.value = value
        self.updates = int(state["updates"])
