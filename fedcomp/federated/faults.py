"""Fault injection: what real deployments do to a federated round, on demand.

A :class:`FaultPlan` draws at most one fault per (round, client) from the run
config's probabilities, deterministically from ``fault-seed``, the round and the
client's partition id, so a test can recompute exactly what was injected:

============  ==============================================  ==================
fault         what the client does                             the server sees
============  ==============================================  ==================
dropout       raises before training                           an error reply
straggler     sleeps past the round timeout, then replies      no reply in time
corrupt       flips bits, truncates or extends its payload     checksum / size
lie           re-frames its payload (valid checksum) with a    shape / size /
              lying header: huge shape, count past the          model / zstd
              tensor, indices out of range, zstd bomb
nonfinite     re-frames its payload with NaN or Inf values     non-finite
poison        sends a valid update scaled by 1e6               (norm bound)
stale         re-frames its payload for the previous round     stale
============  ==============================================  ==================

An :class:`AttackPlan` makes a fixed share of the clients (chosen from ``fault-seed``)
attack in every round they train, one way for the whole run:

============  ==================================================================
attack        what an attacking client does
============  ==================================================================
signflip      sends its honest update negated
scale         sends its honest update scaled by 1e6
fltmax        sends a valid payload whose every float32 value is the float32 maximum
inflate       claims 1e9 examples (its weight in the mean)
labelflip     trains on labels ``9 - y``
============  ==================================================================
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import zstandard

from fedcomp.codecs.fuzzing import assemble, split

__all__ = ["ATTACK_KINDS", "FAULT_KINDS", "INFLATED_EXAMPLES", "POISON_SCALE", "AttackPlan",
           "ClientMisbehaviour", "FaultPlan", "InjectedFault", "misbehaviour", "tamper"]

FAULT_KINDS = ("dropout", "straggler", "corrupt", "lie", "nonfinite", "poison", "stale")
ATTACK_KINDS = ("none", "signflip", "scale", "fltmax", "inflate", "labelflip")
POISON_SCALE = 1e6
INFLATED_EXAMPLES = 1e9


class InjectedFault(RuntimeError):
    """Raised by a client that was told to drop out."""


@dataclass(frozen=True)
class FaultPlan:
    """Per-(round, client) fault draws with fixed probabilities."""

    probabilities: Mapping[str, float]
    seed: int = 0

    def __post_init__(self) -> None:
        unknown = set(self.probabilities) - set(FAULT_KINDS)
        if unknown:
            raise ValueError(f"unknown fault kinds {sorted(unknown)}")
        if any(not 0.0 <= p <= 1.0 for p in self.probabilities.values()):
            raise ValueError("fault probabilities must be in [0, 1]")
        if sum(self.probabilities.values()) > 1.0 + 1e-9:
            raise ValueError("fault probabilities must add up to at most 1")

    @property
    def active(self) -> bool:
        return any(p > 0 for p in self.probabilities.values())

    def draw(self, server_round: int, partition_id: int) -> str | None:
        """The fault for this client in this round, or ``None``."""
        if not self.active:
            return None
        u = np.random.default_rng([self.seed, server_round, partition_id, 0xFA17]).random()
        edge = 0.0
        for kind in FAULT_KINDS:
            edge += self.probabilities.get(kind, 0.0)
            if u < edge:
                return kind
        return None


@dataclass(frozen=True)
class AttackPlan:
    """A fixed share of the clients attacks the same way in every round."""

    kind: str = "none"
    fraction: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ATTACK_KINDS:
            raise ValueError(f"unknown attack {self.kind!r}; choose one of "
                             f"{', '.join(ATTACK_KINDS)}")
        if not 0.0 <= self.fraction < 1.0:
            raise ValueError(f"attack fraction must be in [0, 1), got {self.fraction!r}")

    def attackers(self, num_partitions: int) -> frozenset[int]:
        """The attacking partitions: ``round(fraction * N)`` of them, from the seed."""
        if self.kind == "none" or self.fraction == 0 or num_partitions < 1:
            return frozenset()
        count = round(self.fraction * num_partitions)
        order = np.random.default_rng([self.seed, 0xA77AC]).permutation(num_partitions)
        return frozenset(int(p) for p in order[:count])

    def attack(self, partition_id: int, num_partitions: int) -> str | None:
        """This client's attack, or None if it is honest."""
        return self.kind if partition_id in self.attackers(num_partitions) else None


@dataclass(frozen=True)
class ClientMisbehaviour:
    """What one client does wrong in one round, split by where it happens.

    Around the round (a ClientApp mod plays these, the round itself never sees
    them): ``drop_out`` before training; after it, ``delay_s`` of sleep, the
    :func:`tamper` kinds applied in turn to the reply's payload, ``examples`` claimed
    instead of the true
    count. Inside it, because they change what is trained or encoded: ``flip_labels``
    and ``delta_scale``.
    """

    drop_out: bool = False
    flip_labels: bool = False
    delta_scale: float = 1.0
    delay_s: float = 0.0
    tamper: tuple[str, ...] = ()
    examples: float | None = None

    @property
    def honest(self) -> bool:
        return self == ClientMisbehaviour()


def misbehaviour(faults: FaultPlan, attacks: AttackPlan, *, server_round: int,
                 partition_id: int, num_partitions: int,
                 round_timeout: float) -> ClientMisbehaviour:
    """What the run's fault and attack plans make this client do this round."""
    fault = faults.draw(server_round, partition_id)  # None unless fault-* > 0
    attack = attacks.attack(partition_id, num_partitions)
    scale = (POISON_SCALE if fault == "poison" or attack == "scale" else
             -1.0 if attack == "signflip" else 1.0)
    tampered = ((fault,) if fault in ("corrupt", "lie", "nonfinite", "stale") else ()) + (
        ("fltmax",) if attack == "fltmax" else ())
    return ClientMisbehaviour(
        drop_out=fault == "dropout", flip_labels=attack == "labelflip", delta_scale=scale,
        delay_s=round_timeout + 1.0 if fault == "straggler" else 0.0, tamper=tampered,
        examples=INFLATED_EXAMPLES if attack == "inflate" else None)


def _first_node(tree: Any, codec: str | None = None) -> dict | None:
    if isinstance(tree, dict):
        if codec is None or tree.get("c") == codec:
            return tree
        for part in tree["p"].values():
            found = _first_node(part, codec)
            if found is not None:
                return found
    return None


def _leaves(tree: Any, out: list) -> list:
    if isinstance(tree, list):
        out.append(tree)
    else:
        for part in tree["p"].values():
            _leaves(part, out)
    return out


def tamper(kind: str, payload: bytes, rng: np.random.Generator) -> bytes:
    """Apply a payload fault (``corrupt``, ``lie``, ``nonfinite``, ``stale``) or the
    ``fltmax`` attack."""
    if kind == "corrupt":
        choice = int(rng.integers(3))
        if choice == 0:
            out = bytearray(payload)
            out[int(rng.integers(len(out)))] ^= 1 << int(rng.integers(8))
            return bytes(out)
        if choice == 1:
            return payload[: int(rng.integers(1, len(payload)))]
        return payload + rng.bytes(int(rng.integers(1, 64)))
    header, body = split(payload)
    if kind == "stale":
        header["meta"]["round"] = int(header["meta"].get("round", 0)) - 1
        return assemble(header, body)
    if kind == "fltmax":
        floats = bytearray(body)
        offset = 0
        for entry in header["tensors"]:
            for dtype, count in _leaves(entry[3], []):
                size = count * np.dtype(dtype).itemsize
                if dtype == "<f4":
                    floats[offset:offset + size] = np.full(
                        count, np.finfo(np.float32).max, np.float32).tobytes()
                offset += size
        return assemble(header, bytes(floats))
    if kind == "nonfinite":
        offset, target = 0, None
        for entry in header["tensors"]:
            for dtype, count in _leaves(entry[3], []):
                if dtype == "<f4" and count and target is None:
                    target = offset
                offset += count * np.dtype(dtype).itemsize
        if target is None:
            raise ValueError("payload has no float32 values to poison with NaN")
        out = bytearray(body)
        out[target: target + 4] = np.array([rng.choice([np.nan, np.inf])],
                                           np.float32).tobytes()
        return assemble(header, bytes(out))
    if kind == "lie":
        entry = header["tensors"][int(rng.integers(len(header["tensors"])))]
        bomb_target = _first_node(entry[3], "zstd")
        choice = int(rng.integers(5))
        if choice == 4 and "count" in entry[3]["m"]:
            # The node claims a much smaller tensor: its indices now point past the end.
            entry[3]["m"]["shape"] = [1]
        elif choice == 0:
            entry[1] = [2**40, 2**40]                     # a shape that overflows
        elif choice == 1 and "count" in entry[3]["m"]:
            entry[3]["m"]["count"] = 2**31                # more entries than the tensor
        elif choice == 2 and bomb_target is not None:
            return _zstd_bomb(header, body, bomb_target)
        else:
            entry[3]["m"]["shape"] = [int(d) + 1 for d in entry[3]["m"].get("shape", [1])]
        return assemble(header, body)
    raise ValueError(f"{kind!r} is not a payload fault")


def _zstd_bomb(header: dict, body: bytes, node: dict) -> bytes:
    """Replace one zstd frame by a 100 MB-of-zeros frame, keeping the declared size."""
    frame_leaf = node["p"]["frame"]
    bomb = zstandard.ZstdCompressor(write_content_size=False).compress(bytes(100 << 20))
    leaves, chunks, offset = [], [], 0
    for entry in header["tensors"]:
        _leaves(entry[3], leaves)
    for leaf in leaves:
        size = leaf[1] * np.dtype(leaf[0]).itemsize
        chunk = body[offset: offset + size]
        offset += size
        if leaf is frame_leaf:
            chunk, leaf[1] = bomb, len(bomb)
        chunks.append(chunk)
    return assemble(header, b"".join(chunks))
