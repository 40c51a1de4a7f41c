"""``CompressedFedAvg``: FedAvg over compressed, error-compensated client deltas.

A thin Flower layer over :mod:`fedcomp`. It subclasses Flower's ``FedAvg`` and
keeps its settings, summary and reply checks, but overrides the three hooks that
differ for compressed updates:

* ``configure_train``: each sampled node gets its own downlink message: the full
  model, or only the compressed updates it missed (:class:`fedcomp.federated.downlink.Broadcaster`),
  or with ``downlink-mode = "per-client"`` one compressed payload of the difference
  between the server's model and that client's replica
  (:class:`fedcomp.federated.downlink.PerClientBroadcaster`).
  Nodes are sampled with the run's seeded generator rather than FedAvg's
  ``random.sample`` on the global RNG, in the order of the data partitions they
  hold (asked once per node with a ``query`` message: Flower's node ids are random
  in every run), so the same seed trains the same clients (:mod:`fedcomp.federated.sampling`).
* ``aggregate_train``: every reply is decoded strictly; a bad one is rejected with
  its reason and the round goes on (:func:`fedcomp.federated.aggregation.aggregate_deltas`).
  The example-weighted mean delta goes through the server optimizer
  (SGD/FedAvgM/FedAdam/FedYogi) and is published on the downlink.
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
from fedcomp.federated.aggregation import ClientReply, aggregate_deltas
from fedcomp.federated.averaging import ModelAverage
from fedcomp.federated.downlink import Broadcaster, PerClientBroadcaster, model_digest
from fedcomp.federated.replies import ReplyError, parse_reply_metrics
from fedcomp.federated.sampling import order_nodes, parse_partition_id, sample_nodes
from fedcomp.federated.server_opt import ServerOptimizer
from fedcomp.flower import downlink_to_record, outcomes_to_record, reply_parts
from fedcomp.ops.results import RoundRecord
from fedcomp.privacy.clipping import update_norm
from fedcomp.privacy.server import ServerPrivacy

__all__ = ["CompressedFedAvg", "RoundStats"]

log = logging.getLogger(__name__)


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
        self.broadcaster: Broadcaster | PerClientBroadcaster
        if cfg.downlink_mode == "per-client":
            self.broadcaster = PerClientBroadcaster(initial, cfg.downlink_policy,
                                                    seed=cfg.seed)
        else:
            self.broadcaster = Broadcaster(initial, cfg.downlink_policy,
                                           history=cfg.downlink_history, seed=cfg.seed)
        self.optimizer = ServerOptimizer(
            cfg.server_optimizer, lr=cfg.server_lr, momentum=cfg.server_momentum,
            beta1=cfg.server_beta1, beta2=cfg.server_beta2, tau=cfg.server_tau,
            schedule=cfg.server_lr_schedule, lr_final=cfg.server_lr_final,
            total_steps=cfg.num_server_rounds)
        #: What every uplink payload must hold (with shared-randk: the compact tensors).
        self.expected = cfg.uplink_expected(self.broadcaster.shapes)
        self.expected_shapes = {name: spec.shape for name, spec in self.expected.items()}
        #: server-average > 0: the averaged model the run evaluates (server-side only).
        self.average = (ModelAverage(cfg.server_average, initial)
                        if cfg.server_average > 0 else None)
        self.rng = np.random.default_rng([cfg.seed, 0x5A])
        #: The round each node's replica is known to be at (a lower bound).
        self.node_rounds: dict[int, int] = {}
        #: Which of each node's updates went into the model; told to the node so that
        #: an update that was lost goes back into its error-feedback residual.
        self.outcomes = OutcomeLedger()
        #: The data partition each node said it holds (orders the sampling).
        self.partition_of: dict[int, int] = {}
        self.stats: dict[int, RoundStats] = {}
        self._sent: dict[int, int] = {}
        #: The replica digest each node of this round should report back.
        self._expected_digest: dict[int, str] = {}
        #: Rounds completed before this process started (resumed runs): Flower counts
        #: from 1 again, we do not.
        self.round_offset = 0
        #: dp = "client" or "sample": sampling, bounds, noise and accounting.
        self.privacy = ServerPrivacy(cfg) if cfg.dp != "none" else None
        #: dp = "sample": each node's DP-SGD plan (rate, steps, examples), from its query.
        self.dp_plans: dict[int, tuple[float, int, int]] = {}
        #: Why training stopped before the last round (a privacy budget), if it did.
        self.stopped: str | None = None
        #: The last round's median update norm: the norm bound's yardstick in a round
        #: with too few updates for a median of its own.
        self.norm_reference: float | None = None
        #: The reply fields this run cannot do without.
        self._required_metrics = (
            ("num-examples",) if cfg.dp == "none" else
            ("dp-sample-rate", "dp-steps") if cfg.dp == "sample" else
            ("dp-unclipped",) if cfg.dp_adaptive_clip else ())
        # The run config every train message carries. Empty strings are left out (the
        # client's RunConfig defaults them to ""): Flower's ConfigRecord.count_bytes,
        # which message_size_mod calls, rejects them.
        defaults = RunConfig().to_mapping()
        self._settings = {k: v for k, v in cfg.to_mapping().items()
                          if not (v == "" and defaults.get(k) == "")}

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
        # Per-client downlink: replicas are kept by partition, which outlives node ids.
        # Under DP every node is asked once (sample level: for its DP-SGD plan).
        if (0 < wanted < len(nodes) or isinstance(self.broadcaster, PerClientBroadcaster)
                or self.privacy is not None):
            self._learn_partitions(grid, [n for n in nodes if n not in self.partition_of])
        if self.privacy is not None:
            self.privacy.check_sample_plans(self.dp_plans)
            sampled = self.privacy.sample(order_nodes(nodes, self.partition_of))
            if sampled is not None:
                return sampled
        return sample_nodes(self.rng, nodes, self.partition_of, wanted)

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
                self.partition_of[node] = parse_partition_id(
                    reply.content["node"]["partition-id"])
                if self.cfg.dp == "sample":
                    self._learn_dp_plan(node, reply.content)
                if isinstance(self.broadcaster, PerClientBroadcaster):
                    # The replica it holds: a catch-up goes only to a node that has it.
                    held = (reply.content["replica"].get("digest", "")
                            if "replica" in reply.content else "")
                    self.broadcaster.reconcile(self._client_key(node),
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

    def _parse_reply(self, node: int, content: RecordDict) -> tuple[bytes, dict[str, float], str]:
        """A reply's payload, checked metrics and replica digest (:mod:`fedcomp.federated.replies`).

        The partition the node told when it was first asked overrides the one its reply
        claims: a node cannot pass for another in the order of the sum or in another's
        privacy accounting.
        """
        payload, raw, digest = reply_parts(content)
        metrics = parse_reply_metrics(raw, required=self._required_metrics)
        metrics["partition-id"] = float(self.partition_of.get(
            node, metrics.get("partition-id", 0.0)))
        return payload, metrics, digest

    def _learn_dp_plan(self, node: int, content: RecordDict) -> None:
        """A node's DP-SGD plan from its query reply; a refusal stops the run."""
        plan = content["dp-plan"] if "dp-plan" in content else None
        if plan is None:
            return
        if "error" in plan:
            raise SpecError(str(plan["error"]))
        self.dp_plans[self.partition_of[node]] = (
            float(plan["rate"]), int(plan["steps"]), int(plan["examples"]))

    def _client_key(self, node: int) -> str:
        """Who holds a per-client replica: the partition if known (it outlives node ids)."""
        partition = self.partition_of.get(node)
        return f"partition-{partition}" if partition is not None else f"node-{node}"

    def _forget_replica(self, node: int) -> None:
        """Per-client downlink: the server no longer knows what ``node`` holds.

        The shared downlink needs nothing here: a node's replica round is a lower
        bound, and a stale replica refuses the updates and gets the full model.
        """
        if isinstance(self.broadcaster, PerClientBroadcaster):
            self.broadcaster.forget(self._client_key(node))

    def _stream(self, node: int) -> int:
        """The per-client downlink codec's random stream: the partition, else the node."""
        return self.partition_of.get(node, node % 2**32)

    # ------------------------------------------------------------------ training
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        server_round += self.round_offset
        if self.stopped:
            return []
        nodes = self._sample(grid)
        if self.privacy is not None and (reason := self.privacy.stop_reason(server_round)):
            self.stopped = reason
            log.warning("privacy budget: %s", reason)
            return []
        settings = ConfigRecord({**self._settings, "server-round": server_round,
                                 **(self.privacy.round_settings() if self.privacy else {})})
        messages = []
        self._sent = {}
        self._expected_digest = {}
        shared_digest = (model_digest(self.broadcaster.model)
                         if isinstance(self.broadcaster, Broadcaster) else "")
        for node in nodes:
            if isinstance(self.broadcaster, PerClientBroadcaster):
                client = self._client_key(node)
                downlink = self.broadcaster.message_for(
                    client, stream=self._stream(node), shared_init=self.cfg.shared_init)
                self._expected_digest[node] = self.broadcaster.digests[client]
            else:
                # A node never seen builds the round-0 model from the seed (shared-init);
                # -1 marks a node whose replica is unknown: it gets the full model.
                downlink = self.broadcaster.message_for(
                    self.node_rounds.get(node, 0 if self.cfg.shared_init else -1))
                self._expected_digest[node] = shared_digest
            self._sent[node] = downlink.nbytes
            content = RecordDict({"config": settings, "downlink": downlink_to_record(downlink),
                                  "outcomes": outcomes_to_record(self.outcomes.for_node(node))})
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
        replies = list(replies)
        stats = RoundStats(RoundRecord(round=server_round,
                                       downlink_bytes=sum(self._sent.values())))
        # Replies that did not arrive before the round timeout were dropped by Flower.
        stats.record.timed_out = max(0, len(self._sent) - len(replies))
        stats.record.clients_sampled = len(self._sent)
        if stats.record.timed_out:
            log.warning("round %d: %d sampled nodes did not reply within %g s",
                        server_round, stats.record.timed_out, self.cfg.round_timeout)
        client_replies = []
        # A node that did not reply may or may not hold what it was sent.
        for node in set(self._sent) - {m.metadata.src_node_id for m in replies}:
            self._forget_replica(node)
        for msg in replies:
            node = msg.metadata.src_node_id
            if msg.has_error():
                stats.record.clients_failed += 1
                # We cannot know how far the node got: send it the full model next time.
                self.node_rounds[node] = -1
                self._forget_replica(node)
                log.warning("node %s failed in round %d: %s", node, server_round,
                            msg.error.reason)
                continue
            try:
                payload, metrics, reported = self._parse_reply(node, msg.content)
            except (ReplyError, KeyError, ValueError, TypeError) as exc:
                reason = exc.reason if isinstance(exc, ReplyError) else "malformed"
                stats.record.rejected += 1
                stats.rejected_by_reason[reason] = stats.rejected_by_reason.get(reason, 0) + 1
                log.warning("node %s sent a malformed reply: %s", node, exc)
                self._forget_replica(node)
                continue
            stats.client_metrics[node] = metrics
            stats.replica_checks += 1
            if reported != self._expected_digest.get(node):
                stats.replica_mismatches += 1
                log.error("node %s holds a replica that differs from the server's copy", node)
                self._forget_replica(node)
            # Under DP every update weighs the same (clients send no example counts).
            weight = 1.0 if self.privacy else metrics["num-examples"]
            client_replies.append(ClientReply(
                node, payload, weight, order_key=int(metrics["partition-id"])))
            stats.record.encode_s += metrics.get("encode-s", 0.0)
            stats.record.train_s += metrics.get("train-s", 0.0)
            # The node applied the downlink: its replica is at the pre-publish round.
            self.node_rounds[node] = self.broadcaster.round

        result = aggregate_deltas(client_replies, self.expected,
                                  expected_meta={"round": server_round},
                                  norm_action=self.cfg.norm_action,
                                  reference_norm=self._norm_reference(),
                                  rule=self.cfg.aggregation_rule,
                                  clip_norm=self.privacy.clip_norm if self.privacy else 0.0,
                                  **self.cfg.influence_bounds())
        if result.median_norm is not None:
            self.norm_reference = result.median_norm
        mean = result.mean_delta
        # Client-level DP releases a noisy mean every round, whoever answered.
        released = self.cfg.dp == "client"
        if self.privacy is not None:
            stats.record.dp_clip = self.privacy.clip_norm  # this round's C (it may move)
            mean = self.privacy.release(result, self.expected_shapes, stats.client_metrics)
            stats.record.epsilon = self.privacy.epsilon()
        if mean is not None and (subspace := self.cfg.subspace(server_round)) is not None:
            mean = subspace.lift(mean, self.broadcaster.shapes)
        stats.record.uplink_bytes = result.received_bytes
        stats.record.decode_s = result.decode_s
        stats.record.clients_ok = len(result.accepted)
        stats.record.rejected += len(result.rejected)
        for reason, count in result.rejected_by_reason.items():
            stats.rejected_by_reason[reason] = stats.rejected_by_reason.get(reason, 0) + count
        applied: list[int] = []  # an abandoned round applies no one's update
        if result.non_finite:
            self._skip(server_round, stats, "the aggregate overflows float32")
        elif mean is not None and (released or len(result.accepted) >= self.cfg.min_clients):
            target = self.optimizer.step_if_finite(self.broadcaster.model, mean)
            if target is None:
                self._skip(server_round, stats, "the server optimizer's step is not finite")
            else:
                self.broadcaster.publish(target)
                if self.average is not None:
                    self.average.update(self.broadcaster.model)
                applied = result.accepted
        else:
            log.warning("round %d: %d accepted updates (< min-clients %d); the model is "
                        "unchanged", server_round, len(result.accepted), self.cfg.min_clients)
        self.outcomes.record(server_round, self._sent, applied)
        self.stats[server_round] = stats
        arrays = self.current_arrays()
        metrics = MetricRecord({"clients-ok": stats.record.clients_ok,
                                "rejected": stats.record.rejected,
                                "uplink-bytes": stats.record.uplink_bytes})
        return arrays, metrics

    def _norm_reference(self) -> float:
        """The norm bound's yardstick when a round has too few updates for a median:
        the last round's median, else (the first rounds) the model's own norm, which no
        honest update comes near three times of."""
        if self.norm_reference is not None:
            return self.norm_reference
        return update_norm(self.broadcaster.model)

    def _skip(self, server_round: int, stats: RoundStats, why: str) -> None:
        """Publish nothing this round: a model with NaN or Inf would stop every client."""
        stats.skipped = why
        log.error("round %d skipped, the model is unchanged: %s", server_round, why)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> tuple[dict[str, np.ndarray], dict]:
        """Everything needed to continue the run: arrays and JSON-able metadata."""
        arrays, meta = self.broadcaster.state_dict()
        arrays.update({f"opt/{k}": v for k, v in self.optimizer.state_dict().items()})
        if self.average is not None:
            arrays.update({f"avg/{k}": v for k, v in self.average.state_dict().items()})
        meta.update({"node_rounds": {str(k): v for k, v in self.node_rounds.items()},
                     "uplink_outcomes": self.outcomes.state(),
                     "rng": self.rng.bit_generator.state,
                     "privacy": self.privacy.state_dict() if self.privacy else None,
                     "stopped": self.stopped})
        return arrays, meta

    def load_state_dict(self, arrays: dict[str, np.ndarray], meta: dict) -> None:
        self.broadcaster.load_state_dict(arrays, meta)
        self.optimizer.load_state_dict({k[len("opt/"):]: v for k, v in arrays.items()
                                        if k.startswith("opt/")})
        if self.average is not None:
            self.average.load_state_dict({k[len("avg/"):]: v for k, v in arrays.items()
                                          if k.startswith("avg/")})
        self.node_rounds = {int(k): int(v) for k, v in meta["node_rounds"].items()}
        self.outcomes.restore(meta.get("uplink_outcomes", {}))  # older checkpoints: none
        self.rng.bit_generator.state = meta["rng"]
        if self.privacy is not None:
            self.privacy.load_state_dict(meta["privacy"])
        self.stopped = meta.get("stopped")

    def evaluated_model(self) -> dict[str, np.ndarray]:
        """The model the run evaluates: the average with server-average, else the model."""
        return self.average.value if self.average is not None else self.broadcaster.model

    def current_arrays(self) -> ArrayRecord:
        """The shared model as an ArrayRecord."""
        return ArrayRecord({k: Array(v.copy()) for k, v in self.broadcaster.model.items()})

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        return []
