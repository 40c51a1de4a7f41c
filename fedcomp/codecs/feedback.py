"""Error feedback: remember what compression dropped and send it later.

Why. Top-K, sign and low-rank are biased: on their own they drop the same small
coordinates round after round, and training stalls or diverges. Error feedback
(EF-SGD, Seide et al. 2014; Karimireddy et al. 2019) keeps the dropped part as a
residual and adds it to the next input, so every coordinate is eventually sent:
after T rounds, ``sum(inputs) == sum(decoded) + residual`` exactly (it telescopes).

The split follows GRACE: a codec (:class:`~fedcomp.codecs.pipeline.Pipeline`) knows nothing
of memory, and a memory object knows nothing of codecs beyond ``roundtrip``. Each
memory exposes ``compress(name, x, pipeline, rng) -> (encoded, decoded)``:

* :class:`ErrorFeedback` -- EF-SGD: send ``C(x + e)``, keep
  ``e' = x + e - decode(C(x + e))``, exactly the part the receiver did not get.
* :class:`EF21` -- Richtarik et al. 2021: keep the receiver's estimate ``g`` of this
  sender's input; send ``C(x - g)``, then ``g += decode(C(x - g))``. The receiver must
  add the decoded message to *its* copy of ``g`` (see :class:`EF21Estimate`).
* :class:`NoFeedback` -- the null object: plain compression, no state.

State is created lazily per tensor name (as PowerSGD's hook does), skipped for
lossless pipelines (nothing is lost in coding; an update the server never applied is
given back with :meth:`ErrorFeedback.give_back`, for every tensor), and round-trips through
:meth:`state_dict` / :meth:`load_state_dict` as a flat dict of numpy arrays, which
:mod:`fedcomp.flower` turns into a Flower ``ArrayRecord`` for ``context.state``.
Loading refuses state made for another kind of memory, another codec, or other shapes.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar, Protocol

import numpy as np

from fedcomp.codecs.base import Encoded
from fedcomp.codecs.pipeline import Pipeline
from fedcomp.codecs.tensor import from_numpy, to_numpy

__all__ = [
    "EF21",
    "EF21Estimate",
    "ErrorFeedback",
    "FeedbackMemory",
    "NoFeedback",
    "OutcomeLedger",
    "StateMismatchError",
    "make_feedback",
]

_META_KEY = "__fedcomp_feedback__"
_STATE_FORMAT = "fedcomp.feedback/1"


class StateMismatchError(ValueError):
    """Saved feedback state does not belong to this memory (kind, codec or shapes)."""


class FeedbackMemory(Protocol):
    """What a client needs from an error-feedback memory."""

    def compress(self, name: str, x: Any, pipeline: Pipeline,
                 rng: np.random.Generator) -> tuple[Encoded, Any]: ...

    def state_dict(self) -> dict[str, np.ndarray]: ...

    def load_state_dict(self, state: Mapping[str, np.ndarray],
                        shapes: Mapping[str, tuple[int, ...]] | None = None) -> None: ...


class NoFeedback:
    """Plain compression without memory (the null object)."""

    kind: ClassVar[str] = "none"

    def __init__(self, codec_spec: str = "") -> None:
        self.codec_spec = codec_spec

    def compress(self, name: str, x: Any, pipeline: Pipeline,
                 rng: np.random.Generator) -> tuple[Encoded, Any]:
        return pipeline.roundtrip(x, rng=rng)

    def compensate(self, tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The tensors themselves (float32 copies): there is no residual."""
        return {name: np.array(value, dtype=np.float32) for name, value in tensors.items()}

    def keep(self, residuals: Mapping[str, np.ndarray]) -> None:
        """Nothing is remembered."""

    def state_dict(self) -> dict[str, np.ndarray]:
        return {}

    def load_state_dict(self, state: Mapping[str, np.ndarray],
                        shapes: Mapping[str, tuple[int, ...]] | None = None) -> None:
        if state:
            raise StateMismatchError("NoFeedback has no state to load")


class _ResidualMemory:
    """Shared state handling: one float32 array per tensor name, created lazily."""

    kind: ClassVar[str]

    def __init__(self, codec_spec: str) -> None:
        #: The codec (or policy) description the state was made for; loading state
        #: saved under another description is refused.
        self.codec_spec = codec_spec
        self.memory: dict[str, np.ndarray] = {}

    def _slot(self, name: str, x: np.ndarray) -> np.ndarray | None:
        slot = self.memory.get(name)
        if slot is not None and slot.shape != x.shape:
            raise StateMismatchError(
                f"{self.kind} state for {name!r} has shape {slot.shape}, "
                f"but the tensor has shape {x.shape}"
            )
        return slot

    def state_dict(self) -> dict[str, np.ndarray]:
        """Flat dict of arrays: the memories plus a JSON description under a meta key."""
        description = {"format": _STATE_FORMAT, "kind": self.kind, "codec": self.codec_spec,
                       "names": sorted(self.memory)}
        state = {_META_KEY: np.frombuffer(json.dumps(description).encode(), dtype=np.uint8)}
        state.update({f"{self.kind}/{name}": value for name, value in self.memory.items()})
        return state

    def load_state_dict(self, state: Mapping[str, np.ndarray],
                        shapes: Mapping[str, tuple[int, ...]] | None = None) -> None:
        """Load state saved by :meth:`state_dict`; refuse state made for something else.

        Parameters
        ----------
        state
            The saved arrays.
        shapes
            Optional expected shape per tensor name; any saved array of another shape,
            or for a name not in ``shapes``, is refused.
        """
        if not state:
            self.memory = {}
            return
        if _META_KEY not in state:
            raise StateMismatchError("feedback state lacks its description")
        try:
            description = json.loads(np.asarray(state[_META_KEY], dtype=np.uint8).tobytes())
        except ValueError as exc:
            raise StateMismatchError(f"feedback state description unreadable: {exc}") from None
        if description.get("format") != _STATE_FORMAT:
            raise StateMismatchError(f"unknown feedback state format {description.get('format')!r}")
        if description.get("kind") != self.kind:
            raise StateMismatchError(
                f"state was saved by {description.get('kind')!r} feedback, not {self.kind!r}"
            )
        if description.get("codec") != self.codec_spec:
            raise StateMismatchError(
                f"state was saved for codec {description.get('codec')!r}, "
                f"not {self.codec_spec!r}"
            )
        memory = {}
        for name in description.get("names", []):
            key = f"{self.kind}/{name}"
            if key not in state:
                raise StateMismatchError(f"feedback state lacks the array for {name!r}")
            value = np.array(state[key], dtype=np.float32)
            if shapes is not None and tuple(shapes.get(name, ())) != value.shape:
                raise StateMismatchError(
                    f"saved {self.kind} state for {name!r} has shape {value.shape}; "
                    f"the model has {shapes.get(name)}"
                )
            memory[name] = value
        self.memory = memory


class ErrorFeedback(_ResidualMemory):
    """EF-SGD residual memory: send ``C(x + e)``, keep ``x + e - decode(C(x + e))``."""

    kind = "ef"

    def compress(self, name: str, x: Any, pipeline: Pipeline,
                 rng: np.random.Generator) -> tuple[Encoded, Any]:
        array, kind = to_numpy(x)
        if pipeline.lossless:
            given_back = self.memory.pop(name, None)  # only ever set by give_back
            if given_back is None:
                return pipeline.roundtrip(x, rng=rng)
            return pipeline.roundtrip(from_numpy(array + given_back, kind), rng=rng)
        residual = self._slot(name, array)
        compensated = array + residual if residual is not None else array.copy()
        encoded, decoded = pipeline.roundtrip(compensated, rng=rng)
        # Reuse the compensated buffer as the new residual: what was not received.
        np.subtract(compensated, decoded, out=compensated)
        self.memory[name] = compensated
        return encoded, from_numpy(decoded, kind)

    def compensate(self, tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Each tensor plus its residual, for a caller that transforms the whole
        compensated update before coding it (differential privacy clips it, a shared
        subspace projects it) and then says what to remember with :meth:`keep`."""
        out = {}
        for name, value in tensors.items():
            array = np.array(value, dtype=np.float32)
            residual = self._slot(name, array)
            if residual is not None:
                array += residual
            out[name] = array
        return out

    def keep(self, residuals: Mapping[str, np.ndarray]) -> None:
        """Replace the residuals by what the receiver did not get of the last input."""
        for name, value in residuals.items():
            self.memory[name] = np.array(value, dtype=np.float32)

    def give_back(self, lost: Mapping[str, Any]) -> None:
        """Add an update the receiver never applied back into the residual.

        ``compress`` subtracts what it sends from the residual as if it arrived. When
        the server did not apply it (the reply came after the round's timeout, was
        rejected, or the round was abandoned), the decoded values are added back, so
        ``sum(inputs) == sum(applied decoded) + residual`` holds again and nothing is
        lost for good. ``lost`` is what ``compress`` returned for each tensor.
        """
        for name, value in lost.items():
            array = np.asarray(to_numpy(value)[0], dtype=np.float32)
            slot = self._slot(name, array)
            if slot is None:
                self.memory[name] = array.copy()
            else:
                slot += array

    def residual_norm(self) -> float:
        """L2 norm of all residuals (a diagnostic worth logging per round)."""
        return float(np.sqrt(sum(float(np.vdot(r, r)) for r in self.memory.values())))


class EF21(_ResidualMemory):
    """EF21 sender: keep the receiver's estimate ``g``; send ``C(x - g)``; ``g += decoded``.

    The returned ``decoded`` value is the *correction* the receiver must add to its
    estimate; the receiver's new estimate of ``x`` is ``g_old + decoded`` (this
    object's ``memory[name]`` after the call).
    """

    kind = "ef21"

    def compress(self, name: str, x: Any, pipeline: Pipeline,
                 rng: np.random.Generator) -> tuple[Encoded, Any]:
        array, kind = to_numpy(x)
        estimate = self._slot(name, array)
        difference = array - estimate if estimate is not None else array.copy()
        encoded, decoded = pipeline.roundtrip(difference, rng=rng)
        if estimate is None:
            self.memory[name] = decoded.copy()
        else:
            estimate += decoded
        return encoded, from_numpy(decoded, kind)


class EF21Estimate:
    """Receiver side of EF21 for one sender: ``g += decoded correction``."""

    def __init__(self) -> None:
        self.estimate: dict[str, np.ndarray] = {}

    def update(self, name: str, correction: np.ndarray) -> np.ndarray:
        """Apply a decoded correction; return the new estimate of the sender's input."""
        current = self.estimate.get(name)
        if current is None:
            self.estimate[name] = np.array(correction, dtype=np.float32)
        else:
            current += correction
        return self.estimate[name]


_KINDS: dict[str, type] = {"none": NoFeedback, "ef": ErrorFeedback, "ef21": EF21}


def make_feedback(kind: str, codec_spec: str) -> NoFeedback | ErrorFeedback | EF21:
    """Build a feedback memory by name: ``"none"``, ``"ef"`` or ``"ef21"``."""
    try:
        cls = _KINDS[kind]
    except KeyError:
        raise ValueError(
            f"unknown error feedback {kind!r}; choose one of {', '.join(_KINDS)}"
        ) from None
    return cls(codec_spec)


class OutcomeLedger:
    """Server side of :meth:`ErrorFeedback.give_back`: which of a node's updates it applied.

    For every round a node was asked to train, whether its update went into the model;
    the latest ``keep`` rounds per node. Sent to the node with its next message, so
    that an update that was lost (late, rejected, or its round abandoned) goes back
    into the node's residual rather than being lost for good.
    """

    def __init__(self, keep: int = 16) -> None:
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        self.keep = keep
        self.rounds: dict[int, dict[int, bool]] = {}

    def record(self, server_round: int, asked: Iterable[int], applied: Iterable[int]) -> None:
        """Note the round's outcome for every node asked to train in it."""
        applied = set(applied)
        for node in asked:
            history = self.rounds.setdefault(node, {})
            history[server_round] = node in applied
            for old in sorted(history)[:-self.keep]:
                del history[old]

    def for_node(self, node: int) -> dict[int, bool]:
        """The node's latest outcomes, round -> applied (empty if it was never asked)."""
        return dict(self.rounds.get(node, {}))

    def state(self) -> dict[str, dict[str, bool]]:
        """JSON-able copy, for the server's checkpoint."""
        return {str(node): {str(r): a for r, a in history.items()}
                for node, history in self.rounds.items()}

    def restore(self, state: Mapping[str, Mapping[str, bool]]) -> None:
        """Inverse of :meth:`state`."""
        self.rounds = {int(node): {int(r): bool(a) for r, a in history.items()}
                       for node, history in state.items()}
