"""Everything the server carries from one round to the next, saved as one.

A checkpoint of a run is this state (plus the results so far, which the ServerApp
adds): the downlink (the model, its residual, update history and what it knows of
each client), the server optimizer's moments, the model average, the privacy
accounting, which updates reached the model (:class:`OutcomeLedger`), the sampling
generator and why training stopped, if it did. Each part that holds arrays keeps them
under its own prefix, so the parts are saved and restored by one loop.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedcomp.codecs.feedback import OutcomeLedger
from fedcomp.federated.averaging import ModelAverage
from fedcomp.federated.downlink import Downlink
from fedcomp.federated.server_opt import ServerOptimizer
from fedcomp.privacy.server import NoPrivacy, ServerPrivacy

__all__ = ["ServerState"]


@dataclass
class ServerState:
    """The server's state between rounds (see the module's docstring)."""

    downlink: Downlink
    optimizer: ServerOptimizer
    #: ``server-average`` > 0: the averaged model the run evaluates.
    average: ModelAverage | None
    #: The privacy hooks (:mod:`fedcomp.privacy.server`): their accounting is state.
    privacy: ServerPrivacy | NoPrivacy
    #: Which of each node's updates went into the model, told back to the node.
    outcomes: OutcomeLedger
    #: Samples the clients of each round.
    rng: np.random.Generator
    #: Why training stopped before the last round (a privacy budget), if it did.
    stopped: str | None = None

    def _array_parts(self) -> dict[str, Any]:
        """The parts with array state, by the prefix their arrays are saved under."""
        return {"opt/": self.optimizer,
                **({"avg/": self.average} if self.average is not None else {})}

    def state_dict(self) -> tuple[dict[str, np.ndarray], dict]:
        """Arrays and JSON-able metadata to continue the run from."""
        arrays, meta = self.downlink.state_dict()
        for prefix, part in self._array_parts().items():
            arrays.update({prefix + k: v for k, v in part.state_dict().items()})
        meta.update({"uplink_outcomes": self.outcomes.state(),
                     "rng": self.rng.bit_generator.state,
                     "privacy": self.privacy.state_dict(),
                     "stopped": self.stopped})
        return arrays, meta

    def load_state_dict(self, arrays: Mapping[str, np.ndarray], meta: Mapping) -> None:
        self.downlink.load_state_dict(arrays, meta)
        for prefix, part in self._array_parts().items():
            part.load_state_dict({k[len(prefix):]: v for k, v in arrays.items()
                                  if k.startswith(prefix)})
        self.outcomes.restore(meta.get("uplink_outcomes", {}))
        self.rng.bit_generator.state = meta["rng"]
        self.privacy.load_state_dict(meta["privacy"])
        self.stopped = meta.get("stopped")
