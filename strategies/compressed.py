"""``CompressedFedAvg``: FedAvg over compressed, error-compensated client deltas.

A thin Flower layer over :mod:`fedcomp`. It subclasses Flower's ``FedAvg`` and
keeps its settings, summary and reply checks, but overrides the three hooks that
differ for compressed updates:

* ``configure_train``: each sampled node gets its own downlink message
  (:class:`fedcomp.federated.downlink.Downlink`: by default one compressed payload of
  the difference between the server's model and that client's replica; with
  ``downlink-mode = "shared"`` the compressed updates it missed, or the full model).
  Nodes are sampled with the run's seeded generator rather than FedAvg's
  ``random.sample`` on the global RNG, in the order of the data partitions they
  hold (asked once per node with a ``query`` message: Flower's node ids are random
  in every run), so the same seed trains the same clients (:mod:`fedcomp.federated.sampling`).
* ``aggregate_train``: every reply is decoded strictly; a bad one is rejected with
  its reason and the round goes on (:func:`fedcomp.federated.aggregation.aggregate_deltas`).
  The example-weighted mean delta goes through the server optimizer
  (SGD/FedAvgM/FedAdam/FedYogi) and is published on the downlink.

Differential privacy sits beside it as hooks (:func:`fedcomp.privacy.server.server_privacy`:
who trains, what a round's config carries, how updates weigh, what a round releases),
the way Flower's DP wrappers sit around a strategy; without DP the hooks change
nothing. What the server carries between rounds is one
:class:`~fedcomp.federated.server_state.ServerState`, saved and restored as a whole.
* ``configure_evaluate``: none; evaluation is centralized (``evaluate_fn``).

The ArrayRecord it returns is the shared model, the one clients actually hold (in
per-client mode: the server's own model, which each client holds up to what its
downlink has not sent yet).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from fedcomp.codecs.feedback import OutcomeLedger
from fedcomp.config import RunConfig
from fedcomp.errors import SpecError
from fedcomp.federated.aggregation import AggregationResult, ClientReply, aggregate_deltas
from fedcomp.federated.averaging import ModelAverage
from fedcomp.federated.downlink import Downlink, Recipient, make_downlink
from fedcomp.federated.replies import ReplyError, parse_reply_metrics
from fedcomp.federated.sampling import order_nodes, parse_partition_id, sample_nodes
from fedcomp.federated.server_opt import ServerOptimizer
from fedcomp.federated.server_state import ServerState
from fedcomp.federated.wire_bytes import WireLedger
from fedcomp.flower import (
    NODE_KEY,
    WIRE_RECEIVED_KEY,
    WIRE_SENT_KEY,
    WIRE_SINCE_KEY,
    reply_parts,
    train_content,
)
from fedcomp.ops.results import (
    RoundRecord,
    record_densities,
    record_downlink_densities,
    record_feedback,
)
from fedcomp.privacy.clipping import update_norm
from fedcomp.privacy.server import NoPrivacy, ServerPrivacy, server_privacy

__all__ = ["CompressedFedAvg", "RoundStats"]

log = logging.getLogger(__name__)

#: What a deployed node's warm worker adds to each reply (fedcomp.federated.wire_bytes).
_WIRE_KEYS = (WIRE_SENT_KEY, WIRE_RECEIVED_KEY, WIRE_SINCE_KEY)


@dataclass
class RoundStats:
    """What happened in one round, before evaluation adds accuracy."""

    record: RoundRecord
    rejected_by_reason: dict[str, int] = field(default_factory=dict)
    replica_checks: int = 0
    replica_mismatches: int = 0
    client_metrics: dict[int, dict[str, float]] = field(default_factory=dict)
    #: Why the round published nothing although updates arrived (a non-finite step).
    skipped: str | None = None

    def reject(self, reason: str, count: int = 1) -> None:
        self.record.rejected += count
        self.rejected_by_reason[reason] = self.rejected_by_reason.get(reason, 0) + count


class CompressedFedAvg(FedAvg):
    """FedAvg with compressed uplink and downlink and a server optimizer.

    Parameters
    ----------
    cfg
        The run configuration (codecs, sampling, server optimizer).
    initial
        The initial model as float32 numpy arrays by name.
    """

    def __init__(self, cfg: RunConfig, initial: dict[str, np.ndarray]) -> None:
        super().__init__(fraction_train=1.0, fraction_evaluate=0.0,
                         min_train_nodes=1, min_available_nodes=1)
        self.cfg = cfg
        shapes = {name: tuple(value.shape) for name, value in initial.items()}
        cfg.check_budgets(shapes)  # before round 1, naming the smallest payload
        self.state = ServerState(
            downlink=make_downlink(cfg.downlink_mode, initial, cfg.downlink_policy,
                                   history=cfg.downlink_history, seed=cfg.seed,
                                   shared_init=cfg.shared_init,
                                   forget_after=cfg.downlink_forget_after,
                                   budget=cfg.downlink_budget_bytes(shapes)),
            optimizer=ServerOptimizer(
                cfg.server_optimizer, lr=cfg.server_lr, momentum=cfg.server_momentum,
                beta1=cfg.server_beta1, beta2=cfg.server_beta2, tau=cfg.server_tau,
                schedule=cfg.server_lr_schedule, lr_final=cfg.server_lr_final,
                total_steps=cfg.num_server_rounds),
            average=(ModelAverage(cfg.server_average, initial)
                     if cfg.server_average > 0 else None),
            privacy=server_privacy(cfg),
            outcomes=OutcomeLedger(),
            rng=np.random.default_rng([cfg.seed, 0x5A]))
        #: What every uplink payload must hold (with shared-randk: the compact tensors).
        self.expected = cfg.uplink_expected(self.broadcaster.shapes)
        self.expected_shapes = {name: spec.shape for name, spec in self.expected.items()}
        #: The data partition each node said it holds (orders the sampling).
        self.partition_of: dict[int, int] = {}
        #: dp = "sample": each node's DP-SGD plan (rate, steps, examples), from its query.
        self.dp_plans: dict[int, tuple[float, int, int]] = {}
        self.stats: dict[int, RoundStats] = {}
        #: This round's downlink bytes and the replica digest each node should report.
        self._sent: dict[int, int] = {}
        self._expected_digest: dict[int, str] = {}
        #: Rounds completed before this process started (resumed runs): Flower counts
        #: from 1 again, we do not.
        self.round_offset = 0
        #: The last round's median update norm: the norm bound's yardstick in a round
        #: with too few updates for a median of its own.
        self.norm_reference: float | None = None
        # The run config every train message carries, its preset expanded. Empty
        # strings are left out (the client's RunConfig defaults them to ""): Flower's
        # ConfigRecord.count_bytes, which message_size_mod calls, rejects them.
        defaults = RunConfig().to_mapping()
        self._settings = {k: v for k, v in cfg.node_settings().items()
                          if not (v == "" and defaults.get(k) == "")}
        #: A node that answered a train message holds the settings: it is sent only
        #: their digest (1.5 kB less per message) until it fails or misses a reply.
        self._settings_digest = cfg.settings_digest()
        self._holds_settings: set[int] = set()
        #: Deployed nodes' wire counters, turned into bytes per round.
        self.wire = WireLedger()

    # The parts of the state the ServerApp reads.
    @property
    def broadcaster(self) -> Downlink:
        """The downlink, which holds the server's model."""
        return self.state.downlink

    @property
    def average(self) -> ModelAverage | None:
        return self.state.average

    @property
    def privacy(self) -> ServerPrivacy | NoPrivacy:
        return self.state.privacy

    @property
    def stopped(self) -> str | None:
        return self.state.stopped

    def summary(self) -> None:
        log.info("CompressedFedAvg: uplink %s, downlink %s, feedback %s, server optimizer "
                 "%s (lr %g)", self.cfg.uplink_policy.description,
                 self.cfg.downlink_policy.description, self.cfg.feedback,
                 self.cfg.server_optimizer, self.cfg.server_lr)

    # ------------------------------------------------------------------ sampling
    def _sample(self, grid: Grid) -> list[int]:
        wanted = self.cfg.clients_per_round
        minimum = max(self.cfg.min_clients, wanted)
        while len(nodes := sorted(grid.get_node_ids())) < minimum:
            log.info("waiting for nodes: %d connected, %d needed", len(nodes), minimum)
            time.sleep(1)
        # Per-client replicas are kept by partition, which outlives node ids. Under DP
        # every node is asked once (sample level: for its DP-SGD plan).
        if 0 < wanted < len(nodes) or self.broadcaster.per_client or self.privacy.active:
            self._learn_partitions(grid, [n for n in nodes if n not in self.partition_of])
        self.privacy.check_sample_plans(self.dp_plans)
        sampled = self.privacy.sample(order_nodes(nodes, self.partition_of))
        if sampled is not None:
            return sampled
        return sample_nodes(self.state.rng, nodes, self.partition_of, wanted)

    def _learn_partitions(self, grid: Grid, nodes: list[int]) -> None:
        """Ask nodes not seen before which partition they hold (a few bytes each, once)."""
        if not nodes:
            return
        ask = {"ask": "partition-id"}
        if self.cfg.dp == "sample":  # and its DP-SGD plan, checked before round 1
            ask = {"ask": "partition-id dp-plan", **self._settings}
        question = RecordDict({"config": ConfigRecord(ask)})
        messages = [Message(content=question, message_type=MessageType.QUERY, dst_node_id=n)
                    for n in nodes]
        for reply in grid.send_and_receive(messages, timeout=self.cfg.round_timeout):
            node = reply.metadata.src_node_id
            try:
                if reply.has_error():
                    raise ValueError(reply.error.reason)
                told = reply.content[NODE_KEY]
                self.partition_of[node] = parse_partition_id(told["partition-id"])
                self._start_wire(node, told)
                if self.cfg.dp == "sample":
                    self._learn_dp_plan(node, reply.content)
                # The replica it holds: a per-client catch-up goes only to a node that has it.
                held = (reply.content["replica"].get("digest", "")
                        if "replica" in reply.content else "")
                self.broadcaster.reconcile(self._recipient(node),
                                           held if isinstance(held, str) else "")
            except SpecError:
                raise  # a node refused the run's privacy settings: stop before round 1
            except (KeyError, TypeError, ValueError) as exc:
                log.warning("node %s did not tell its partition (%s): it is sampled after "
                            "the others, by node id", node, exc)
        missing = len([n for n in nodes if n not in self.partition_of])
        if missing:
            log.warning("%d of %d nodes have no known partition; sampling them is not "
                        "reproducible across runs", missing, len(nodes))

    def _start_wire(self, node: int, told: MetricRecord) -> None:
        """Where a node's wire counters stand at its query reply (when it reports them)."""
        try:
            counts = parse_reply_metrics(dict(told), required=_WIRE_KEYS)
        except ReplyError:
            return  # a simulated node, or one that does not count: no wire bytes
        self.wire.start(node, *(counts[key] for key in _WIRE_KEYS))

    def _learn_dp_plan(self, node: int, content: RecordDict) -> None:
        """A node's DP-SGD plan from its query reply; a refusal stops the run."""
        plan = content["dp-plan"] if "dp-plan" in content else None
        if plan is None:
            return
        if "error" in plan:
            raise SpecError(str(plan["error"]))
        self.dp_plans[self.partition_of[node]] = (
            float(plan["rate"]), int(plan["steps"]), int(plan["examples"]))

    def _recipient(self, node: int) -> Recipient:
        """A node as the downlink knows it: by partition where known (it outlives node
        ids), which also numbers the per-client codec's random stream."""
        partition = self.partition_of.get(node)
        if partition is None:
            return Recipient(node, f"node-{node}", node % 2**32)
        return Recipient(node, f"partition-{partition}", partition)

    # ------------------------------------------------------------------ training
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        server_round += self.round_offset
        if self.stopped:
            return []
        nodes = self._sample(grid)
        if reason := self.privacy.stop_reason(server_round):
            self.state.stopped = reason
            log.warning("privacy budget: %s", reason)
            return []
        this_round = {"server-round": server_round, "settings-digest": self._settings_digest,
                      **self.privacy.round_settings()}
        short, full = ConfigRecord(this_round), ConfigRecord({**self._settings, **this_round})
        messages = []
        self._sent, self._expected_digest = {}, {}
        for node in nodes:
            who = self._recipient(node)
            downlink = self.broadcaster.send(who)
            self._expected_digest[node] = self.broadcaster.digest_for(who)
            self._sent[node] = downlink.nbytes
            content = train_content(short if node in self._holds_settings else full,
                                    downlink, self.state.outcomes.for_node(node))
            messages.append(Message(content=content, message_type=MessageType.TRAIN,
                                    dst_node_id=node))
        log.info("round %d: sampled %d nodes, downlink %d bytes", server_round, len(nodes),
                 sum(self._sent.values()))
        return messages

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        server_round += self.round_offset
        if self.stopped:
            return self.current_arrays(), None
        stats = RoundStats(RoundRecord(round=server_round, clients_sampled=len(self._sent),
                                       downlink_bytes=sum(self._sent.values())))
        # Before this round's update is published: what the clients received.
        record_downlink_densities(self.broadcaster.take_kept(), self.broadcaster.shapes,
                                  stats.record)
        updates = self._accept(list(replies), stats)
        result = aggregate_deltas(updates, self.expected,
                                  expected_meta={"round": server_round},
                                  norm_action=self.cfg.norm_action,
                                  reference_norm=self._norm_reference(),
                                  rule=self.cfg.aggregation_rule,
                                  clip_norm=self.privacy.clip_norm,
                                  **self.cfg.influence_bounds())
        applied = self._publish(server_round, result, stats)
        self.state.outcomes.record(server_round, self._sent, applied)
        self.stats[server_round] = stats
        metrics = MetricRecord({"clients-ok": stats.record.clients_ok,
                                "rejected": stats.record.rejected,
                                "uplink-bytes": stats.record.uplink_bytes})
        return self.current_arrays(), metrics

    def _accept(self, replies: list[Message], stats: RoundStats) -> list[ClientReply]:
        """The replies whose fields and replica check out, as updates still to decode.

        Every other reply is counted (failed, rejected by reason, or late) and the
        downlink is told what the server can no longer know about that client.
        """
        # Replies that did not arrive before the round timeout were dropped by Flower;
        # a node that did not reply may or may not hold what it was sent.
        stats.record.timed_out = max(0, len(self._sent) - len(replies))
        if stats.record.timed_out:
            log.warning("round %d: %d sampled nodes did not reply within %g s",
                        stats.record.round, stats.record.timed_out, self.cfg.round_timeout)
        for node in set(self._sent) - {m.metadata.src_node_id for m in replies}:
            self.broadcaster.unconfirmed(self._recipient(node))
            self._holds_settings.discard(node)
            self.wire.forget(node)
        updates = []
        for msg in replies:
            node = msg.metadata.src_node_id
            who = self._recipient(node)
            if msg.has_error():
                stats.record.clients_failed += 1
                self._holds_settings.discard(node)  # a restarted node: send them again
                self.broadcaster.failed(who)  # how far did it get? The full model next.
                self.wire.forget(node)
                log.warning("node %s failed in round %d: %s", node, stats.record.round,
                            msg.error.reason)
                continue
            try:
                payload, raw, reported = reply_parts(msg.content)
                metrics = parse_reply_metrics(raw, required=self.privacy.required_metrics)
            except (ReplyError, KeyError, ValueError, TypeError) as exc:
                stats.reject(exc.reason if isinstance(exc, ReplyError) else "malformed")
                log.warning("node %s sent a malformed reply: %s", node, exc)
                self.broadcaster.unconfirmed(who)
                self.wire.forget(node)
                continue
            # The partition the node told when first asked overrides the one its reply
            # claims: a node cannot pass for another in the order of the sum or in
            # another's privacy accounting.
            metrics["partition-id"] = float(self.partition_of.get(
                node, metrics.get("partition-id", 0.0)))
            self._count_wire(node, metrics, len(payload), stats.record)
            stats.client_metrics[node] = metrics
            self._holds_settings.add(node)
            stats.replica_checks += 1
            if reported == self._expected_digest.get(node):
                self.broadcaster.applied(who)
            else:
                stats.replica_mismatches += 1
                log.error("node %s holds a replica that differs from the server's copy", node)
                self.broadcaster.unconfirmed(who)
            updates.append(ClientReply(node, payload, self.privacy.weight(metrics),
                                       order_key=int(metrics["partition-id"])))
            stats.record.encode_s += metrics.get("encode-s", 0.0)
            stats.record.train_s += metrics.get("train-s", 0.0)
        return updates

    def _count_wire(self, node: int, metrics: dict[str, float], payload_up: int,
                    record: RoundRecord) -> None:
        """The node's bytes on the wire since its previous reply, into the round's row
        and its own (``wire-up-bytes``, ``wire-down-bytes``), when it reports them."""
        counts = [metrics.pop(key, None) for key in _WIRE_KEYS]
        if None in counts:
            return
        sent, received, since = counts
        window = self.wire.window(node, int(sent), int(received), since,
                                  payload_up=payload_up, payload_down=self._sent.get(node, 0))
        if window is None:
            return
        metrics["wire-up-bytes"], metrics["wire-down-bytes"] = window.up, window.down
        record.wire_nodes += 1
        record.wire_up_bytes += window.up
        record.wire_down_bytes += window.down
        record.protocol_up_bytes += window.protocol_up
        record.protocol_down_bytes += window.protocol_down

    def _publish(self, server_round: int, result: AggregationResult,
                 stats: RoundStats) -> list[int]:
        """Release the round's mean (through the privacy hooks), step the server's model
        towards it and publish it on the downlink; return the nodes whose updates went
        in (none when the round is abandoned)."""
        if result.median_norm is not None:
            self.norm_reference = result.median_norm
        stats.record.uplink_bytes = result.received_bytes
        stats.record.decode_s = result.decode_s
        record_densities(result.kept, self.expected, stats.record, stats.client_metrics)
        if self.cfg.feedback != "none":
            record_feedback(stats.record, stats.client_metrics)
        stats.record.clients_ok = len(result.accepted)
        for reason, count in result.rejected_by_reason.items():
            stats.reject(reason, count)
        stats.record.dp_clip = self.privacy.clip_norm  # this round's C (it may move)
        mean = self.privacy.release(result, self.expected_shapes, stats.client_metrics)
        stats.record.epsilon = self.privacy.epsilon()
        if mean is not None and (subspace := self.cfg.subspace(server_round)) is not None:
            mean = subspace.lift(mean, self.broadcaster.shapes)
        if result.non_finite:
            return self._skip(server_round, stats, "the aggregate overflows float32")
        enough = len(result.accepted) >= self.cfg.min_clients
        if mean is None or not (enough or self.privacy.releases_every_round):
            log.warning("round %d: %d accepted updates (< min-clients %d); the model is "
                        "unchanged", server_round, len(result.accepted), self.cfg.min_clients)
            return []
        target = self.state.optimizer.step_if_finite(self.broadcaster.model, mean)
        if target is None:
            return self._skip(server_round, stats, "the server optimizer's step is not finite")
        self.broadcaster.publish(target)
        if self.average is not None:
            self.average.update(self.broadcaster.model)
        return result.accepted

    def _norm_reference(self) -> float:
        """The norm bound's yardstick when a round has too few updates for a median:
        the last round's median, else (the first rounds) the model's own norm, which no
        honest update comes near three times of."""
        if self.norm_reference is not None:
            return self.norm_reference
        return update_norm(self.broadcaster.model)

    def _skip(self, server_round: int, stats: RoundStats, why: str) -> list[int]:
        """Publish nothing this round: a model with NaN or Inf would stop every client."""
        stats.skipped = why
        log.error("round %d skipped, the model is unchanged: %s", server_round, why)
        return []

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> tuple[dict[str, np.ndarray], dict]:
        """Everything needed to continue the run: arrays and JSON-able metadata."""
        return self.state.state_dict()

    def load_state_dict(self, arrays: dict[str, np.ndarray], meta: dict) -> None:
        self.state.load_state_dict(arrays, meta)

    def evaluated_model(self) -> dict[str, np.ndarray]:
        """The model the run evaluates: the average with server-average, else the model."""
        return self.average.value if self.average is not None else self.broadcaster.model

    def current_arrays(self) -> ArrayRecord:
        """The shared model as an ArrayRecord."""
        return ArrayRecord({k: Array(v.copy()) for k, v in self.broadcaster.model.items()})

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        return []
