"""The downlink: getting the global model to clients in as few bytes as possible.

The server keeps the *shared model* ``w``: exactly the model every up-to-date client
holds. After aggregation it wants to move to ``target``; it sends
``C(target - w + e)`` through the downlink codec with its own error-feedback residual
``e``, and both sides add the decoded update to their copy. Because both add the
very same float32 values in the same order, a client's replica equals ``w`` bit for
bit (a test checks it after every round).

A client that missed rounds (partial participation) catches up with whatever is
smaller: the updates it missed, replayed in order, or the full model. The server
keeps the updates for that, as many as together cost less than the full model (and
at most ``history``): an older replica gets the full model anyway. A replica that is
lost (a restarted node) gets the full model. With ``downlink-codec = none`` an update
is as large as the model, so every message is the full model: plain FedAvg.

A client that has never held a replica can start from the round-0 model it builds
itself from the run's seed (``shared-init``), so that a first contact costs the
missed updates rather than the full model. The message carries the round-0 model's
digest; a client whose own initial model differs refuses it and gets the full model.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from fedcomp.feedback import ErrorFeedback
from fedcomp.policy import CompressionPolicy, encode_update
from fedcomp.wire import unpack_payload

__all__ = ["Broadcaster", "DownlinkMessage", "Replica", "ReplicaOutOfSync", "model_digest"]

_FULL = CompressionPolicy("none")


class ReplicaOutOfSync(RuntimeError):
    """A client's replica cannot be brought to the server's round with this message."""


def model_digest(model: Mapping[str, np.ndarray]) -> str:
    """SHA-256 over names, shapes and float32 bytes: equal iff models are bit-identical."""
    digest = hashlib.sha256()
    for name in sorted(model):
        value = np.ascontiguousarray(model[name], dtype=np.float32)
        digest.update(f"{name}:{value.shape};".encode())
        digest.update(value.tobytes())
    return digest.hexdigest()


@dataclass(frozen=True)
class DownlinkMessage:
    """What one client receives: the full model, or the updates from ``from_round`` on."""

    kind: str  # "full" or "delta"
    from_round: int
    to_round: int
    payloads: tuple[bytes, ...]
    #: For updates from round 0: the digest of the round-0 model they start from.
    base_digest: str = ""

    @property
    def nbytes(self) -> int:
        return sum(len(p) for p in self.payloads)


@dataclass
class Broadcaster:
    """Server side of the downlink: the shared model and the updates that built it."""

    model: dict[str, np.ndarray]
    policy: CompressionPolicy
    history: int = 1000
    seed: int = 0
    round: int = 0
    updates: dict[int, bytes] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.model = {k: np.array(v, dtype=np.float32) for k, v in self.model.items()}
        self.feedback = ErrorFeedback(self.policy.description)
        self.rng = np.random.default_rng([self.seed, 0xD0])
        self._full: tuple[int, bytes] | None = None
        #: Digest of the round-0 model, for clients that build it from the seed.
        self.initial_digest = model_digest(self.model)

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {k: v.shape for k, v in self.model.items()}

    def full_payload(self) -> bytes:
        """The shared model itself, losslessly (cached for the current round)."""
        if self._full is None or self._full[0] != self.round:
            payload = encode_update(self.model, _FULL, rng=self.rng,
                                    meta={"kind": "full", "round": self.round}).payload
            self._full = (self.round, payload)
        return self._full[1]

    def publish(self, target: Mapping[str, np.ndarray]) -> int:
        """Move the shared model towards ``target``; return the update's bytes."""
        delta = {k: np.asarray(target[k], dtype=np.float32) - v for k, v in self.model.items()}
        update = encode_update(delta, self.policy, rng=self.rng, feedback=self.feedback,
                               meta={"kind": "delta", "from-round": self.round})
        for name, value in update.decoded.items():
            self.model[name] += value
        self.updates[self.round] = update.payload
        self.updates.pop(self.round - self.history, None)
        # Updates older than the full model's worth of bytes are never sent again.
        budget = len(self.full_payload())
        kept = sum(len(p) for p in self.updates.values())
        for old in sorted(self.updates):
            if kept <= budget:
                break
            kept -= len(self.updates.pop(old))
        self.round += 1
        return len(update.payload)

    def message_for(self, replica_round: int | None) -> DownlinkMessage:
        """The smallest message that brings a replica at ``replica_round`` up to date."""
        base = self.initial_digest if replica_round == 0 else ""
        if replica_round == self.round:
            return DownlinkMessage("delta", self.round, self.round, (), base)
        if replica_round is not None and 0 <= replica_round < self.round and all(
            r in self.updates for r in range(replica_round, self.round)
        ):
            missed = tuple(self.updates[r] for r in range(replica_round, self.round))
            if sum(len(p) for p in missed) < len(self.full_payload()):
                return DownlinkMessage("delta", replica_round, self.round, missed, base)
        return DownlinkMessage("full", self.round, self.round, (self.full_payload(),))


@dataclass
class Replica:
    """Client side of the downlink: a copy of the shared model and its round."""

    model: dict[str, np.ndarray] | None = None
    round: int | None = None

    def apply(self, message: DownlinkMessage, shapes: Mapping[str, tuple[int, ...]],
              policy: CompressionPolicy,
              initial: Mapping[str, np.ndarray] | None = None) -> None:
        """Bring the replica to ``message.to_round``; every payload is decoded strictly.

        ``initial`` is the round-0 model this client builds from the run's seed; an
        empty replica starts from it when the message starts at round 0 and its
        ``base_digest`` matches.
        """
        if message.kind == "full":
            if len(message.payloads) != 1:
                raise ReplicaOutOfSync("a full-model message must carry exactly one payload")
            decoded = unpack_payload(message.payloads[0], expected=_FULL.expected(shapes))
            self.model = {k: np.array(v) for k, v in decoded.tensors.items()}
            self.round = message.to_round
            return
        if message.kind != "delta":
            raise ReplicaOutOfSync(f"unknown downlink message kind {message.kind!r}")
        if self.model is None and message.from_round == 0 and initial is not None:
            if not message.base_digest or model_digest(initial) != message.base_digest:
                raise ReplicaOutOfSync("this client's initial model differs from the "
                                       "server's round-0 model: a full model is needed")
            self.model = {k: np.array(v, dtype=np.float32) for k, v in initial.items()}
            self.round = 0
        if len(message.payloads) != message.to_round - message.from_round:
            raise ReplicaOutOfSync("downlink message carries the wrong number of updates")
        if (self.model is None or self.round is None
                or not message.from_round <= self.round <= message.to_round):
            raise ReplicaOutOfSync(
                f"replica is at round {self.round}; the update starts at round "
                f"{message.from_round}: a full model is needed"
            )
        expected = policy.expected(shapes)
        for offset in range(self.round - message.from_round, len(message.payloads)):
            decoded = unpack_payload(message.payloads[offset], expected=expected)
            if decoded.meta.get("from-round") != message.from_round + offset:
                raise ReplicaOutOfSync("downlink update is for another round")
            for name, value in decoded.tensors.items():
                self.model[name] += value
        self.round = message.to_round
