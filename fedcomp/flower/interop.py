"""fedcomp inside any Flower app: a ClientApp mod and a strategy wrapper.

As Flower's own DP support pairs ``fixedclipping_mod`` on the ClientApp with a
``DifferentialPrivacyClientSideFixedClipping`` wrapper around the strategy, fedcomp
pairs :func:`compression_mod` with :class:`CompressedUplink`:

* the wrapper adds the compression settings to every train message (the ServerApp
  decides, the clients follow);
* the mod lets the app's own ``@app.train()`` run unchanged, then replaces the model
  it returns by the compressed, error-compensated difference to the model it received
  (a few kB in a ConfigRecord), keeping the residual in ``context.state``;
* the wrapper decodes each reply strictly (a bad one is dropped with its reason and
  the round goes on), rebuilds the client's model as the server's plus the decoded
  difference, and hands the wrapped strategy the replies it expects, so FedAvg,
  FedAdam, FedProx, ... aggregate as usual. Bytes are counted as received.

The app's reply keeps its MetricRecord (``num-examples`` and the rest); only its
ArrayRecord travels compressed. The downlink is the wrapped strategy's own.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from fedcomp.codecs.feedback import ErrorFeedback, NoFeedback, StateMismatchError
from fedcomp.codecs.policy import CompressionPolicy, encode_update
from fedcomp.codecs.wire import unpack_payload
from fedcomp.errors import PayloadError, SpecError

__all__ = ["SETTINGS_KEY", "UPDATE_KEY", "CompressedUplink", "compression_mod"]

log = logging.getLogger(__name__)

#: The ConfigRecord of a train message that carries the compression settings.
SETTINGS_KEY = "fedcomp.settings"
#: The ConfigRecord of a reply that carries the compressed update.
UPDATE_KEY = "fedcomp.update"
_STATE_KEY = "fedcomp.residual"
_FEEDBACK = ("ef", "none")


def _only_array_record(content: RecordDict, where: str) -> tuple[str, ArrayRecord]:
    found = [(k, v) for k, v in content.items() if isinstance(v, ArrayRecord)]
    if len(found) != 1:
        raise ValueError(f"{where} must hold exactly one ArrayRecord, it holds {len(found)}")
    return found[0]


def _to_numpy(record: ArrayRecord) -> dict[str, np.ndarray]:
    return {name: np.asarray(record[name].numpy(), dtype=np.float32) for name in record}


def _policy(settings: ConfigRecord | dict[str, Any]) -> CompressionPolicy:
    return CompressionPolicy(str(settings["codec"]), str(settings.get("small-codec", "none")),
                             int(settings.get("min-numel", 1024)))


def compression_mod(msg: Message, context: Context,
                    call_next: Callable[[Message, Context], Message]) -> Message:
    """A ClientApp mod: send the trained model as a compressed, error-compensated delta.

    Messages without fedcomp's settings (evaluation, a plain FedAvg server) pass
    through untouched.
    """
    if msg.metadata.message_type != MessageType.TRAIN or SETTINGS_KEY not in msg.content:
        return call_next(msg, context)
    settings = msg.content[SETTINGS_KEY]
    _, sent = _only_array_record(msg.content, "a train message")
    received = _to_numpy(sent)
    reply = call_next(msg, context)
    if reply.has_error():
        return reply
    key, trained = _only_array_record(reply.content, "the ClientApp's train reply")
    delta = {name: value - received[name] for name, value in _to_numpy(trained).items()}
    policy = _policy(settings)
    memory: ErrorFeedback | NoFeedback = (ErrorFeedback(policy.description)
                                          if settings.get("feedback", "ef") == "ef"
                                          else NoFeedback())
    if isinstance(memory, ErrorFeedback) and _STATE_KEY in context.state:
        saved = context.state[_STATE_KEY]
        try:
            memory.load_state_dict({n: saved[n].numpy() for n in saved},
                                   shapes={n: v.shape for n, v in delta.items()})
        except (StateMismatchError, KeyError, ValueError) as exc:
            log.warning("fedcomp: dropping saved error-feedback state: %s", exc)
    # Stochastic rounding's randomness needs no seed: numpy seeds it from OS entropy.
    rng = np.random.default_rng()
    update = encode_update(delta, policy, feedback=memory, rng=rng,
                           meta={"round": int(settings["server-round"])})
    if isinstance(memory, ErrorFeedback):
        context.state[_STATE_KEY] = ArrayRecord(
            {n: Array(np.ascontiguousarray(v)) for n, v in memory.state_dict().items()})
    content = RecordDict({k: v for k, v in reply.content.items() if k != key})
    content[UPDATE_KEY] = ConfigRecord({"payload": update.payload, "array-key": key})
    reply.content = content
    return reply


class CompressedUplink(Strategy):
    """Wrap a Flower strategy so that its clients' updates travel compressed.

    Parameters
    ----------
    strategy
        The strategy that aggregates (FedAvg, FedAdam, ...); it sees ordinary replies.
    codec
        The uplink codec spec (see "Codecs" in the README).
    feedback
        ``"ef"`` (error feedback, the default) or ``"none"``.
    small_codec, min_numel
        The codec of tensors under ``min_numel`` elements (biases): fp32 by default.
    """

    def __init__(self, strategy: Strategy, *, codec: str = "topk:ratio=0.01|quant:bits=4",
                 feedback: str = "ef", small_codec: str = "none", min_numel: int = 1024) -> None:
        super().__init__()
        if feedback not in _FEEDBACK:
            raise SpecError(f"feedback must be one of {', '.join(_FEEDBACK)}, got {feedback!r}")
        self.strategy = strategy
        self.settings = {"codec": codec, "feedback": feedback, "small-codec": small_codec,
                         "min-numel": min_numel}
        self.policy = _policy(self.settings)  # a bad spec is refused here
        self._current: dict[str, np.ndarray] = {}
        #: Per round: uplink payload bytes received, updates decoded, replies dropped.
        self.history: dict[int, dict[str, int]] = {}

    def summary(self) -> None:
        log.info("fedcomp CompressedUplink: uplink %s, feedback %s, around:",
                 self.policy.description, self.settings["feedback"])
        self.strategy.summary()

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        self._current = _to_numpy(arrays)
        messages = list(self.strategy.configure_train(server_round, arrays, config, grid))
        for message in messages:
            message.content[SETTINGS_KEY] = ConfigRecord({**self.settings,
                                                          "server-round": server_round})
        return messages

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        expected = self.policy.expected({n: v.shape for n, v in self._current.items()})
        rebuilt, stats = [], {"uplink-bytes": 0, "decoded": 0, "dropped": 0}
        for reply in replies:
            if reply.has_error():
                rebuilt.append(reply)
                continue
            try:
                record = reply.content[UPDATE_KEY] if UPDATE_KEY in reply.content else None
                if not isinstance(record, ConfigRecord) or not isinstance(
                        record.get("payload"), bytes) or not isinstance(
                            record.get("array-key"), str):
                    raise PayloadError("reply carries no fedcomp update", reason="malformed")
                stats["uplink-bytes"] += len(record["payload"])
                decoded = unpack_payload(record["payload"], expected=expected)
                if decoded.meta.get("round") != server_round:
                    raise PayloadError("update made for another round", reason="stale")
                if not all(np.isfinite(v).all() for v in decoded.tensors.values()):
                    raise PayloadError("update decodes to NaN or Inf", reason="non-finite")
            except PayloadError as exc:
                stats["dropped"] += 1
                log.warning("fedcomp: dropped the update of node %s (%s): %s",
                            reply.metadata.src_node_id, exc.reason, exc)
                continue
            weights = ArrayRecord({n: Array(self._current[n] + decoded.tensors[n])
                                   for n in self._current})
            content = RecordDict({k: v for k, v in reply.content.items() if k != UPDATE_KEY})
            content[record["array-key"]] = weights
            reply.content = content  # what the wrapped strategy expects of a reply
            rebuilt.append(reply)
            stats["decoded"] += 1
        self.history[server_round] = stats
        arrays, metrics = self.strategy.aggregate_train(server_round, rebuilt)
        if metrics is not None:
            metrics = MetricRecord({**metrics, **{f"fedcomp-{k}": v for k, v in stats.items()}})
        return arrays, metrics

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        return self.strategy.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]
                           ) -> MetricRecord | None:
        return self.strategy.aggregate_evaluate(server_round, replies)

