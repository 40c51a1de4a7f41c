"""``CompressedFedAvg``: FedAvg over compressed, error-compensated client deltas.

A thin Flower layer over :mod:`fedcomp`. It subclasses Flower's ``FedAvg`` and
keeps its settings, summary and reply checks, but overrides the three hooks that
differ for compressed updates:

* ``configure_train``: each sampled node gets its own downlink message: the full
  model, or only the compressed updates it missed (:class:`fedcomp.downlink.Broadcaster`),
  or with ``downlink-mode = "per-client"`` one compressed payload of the difference
  between the server's model and that client's replica
  (:class:`fedcomp.downlink.PerClientBroadcaster`).
  Nodes are sampled with the run's seeded generator rather than FedAvg's
  ``random.sample`` on the global RNG, in the order of the data partitions they
  hold (asked once per node with a ``query`` message: Flower's node ids are random
  in every run), so the same seed trains the same clients (:mod:`fedcomp.sampling`).
* ``aggregate_train``: every reply is decoded strictly; a bad one is rejected with
  its reason and the round goes on (:func:`fedcomp.aggregation.aggregate_deltas`).
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

from fedcomp.aggregation import ClientReply, aggregate_deltas
from fedcomp.averaging import ModelAverage
from fedcomp.config import RunConfig
from fedcomp.downlink import Broadcaster, PerClientBroadcaster, model_digest
from fedcomp.feedback import OutcomeLedger
from fedcomp.flower import downlink_to_record, outcomes_to_record, payload_from_record
from fedcomp.privacy import (
    AdaptiveClipping,
    ClientLevelDP,
    SampleLevelBudget,
    adaptive_noise_multiplier,
)
from fedcomp.results import RoundRecord
from fedcomp.sampling import parse_partition_id, sample_nodes
from fedcomp.server_opt import ServerOptimizer

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
        self.expected = cfg.uplink_policy.expected(self.broadcaster.shapes)
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
        self.dp = (ClientLevelDP(cfg.dp_noise_multiplier, cfg.dp_clip_norm, cfg.dp_delta,
                                 cfg.dp_target_epsilon) if cfg.dp == "client" else None)
        # Adaptive clipping: C follows a quantile of the update norms; part of the noise
        # budget goes to the clipped count (fedcomp.privacy.adaptive_noise_multiplier).
        self.adaptive = None
        if self.dp is not None and cfg.dp_adaptive_clip:
            count_stddev = cfg.dp_clipped_count_stddev or max(
                max(cfg.clients_per_round, 1) / 20, cfg.dp_noise_multiplier)
            self.adaptive = AdaptiveClipping(cfg.dp_clip_norm, cfg.dp_target_quantile,
                                             cfg.dp_clip_lr, count_stddev)
            self.dp.update_noise_multiplier = adaptive_noise_multiplier(
                cfg.dp_noise_multiplier, count_stddev)
        self.dp_rng = np.random.default_rng([cfg.seed, 0xD9])
        #: dp = "sample": the largest cumulative epsilon any client reported, and
        #: every client's spending replayed, to stop before dp-target-epsilon.
        self.sample_epsilon = 0.0
        self.sample_budget = SampleLevelBudget(cfg.dp_noise_multiplier, cfg.dp_delta,
                                               cfg.dp_target_epsilon)
        #: Why training stopped before the last round (a privacy budget), if it did.
        self.stopped: str | None = None
        self._sample_rate = 1.0
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
        if 0 < wanted < len(nodes) or isinstance(self.broadcaster, PerClientBroadcaster):
            self._learn_partitions(grid, [n for n in nodes if n not in self.partition_of])
        return sample_nodes(self.rng, nodes, self.partition_of, wanted)

    def _learn_partitions(self, grid: Grid, nodes: list[int]) -> None:
        """Ask nodes not seen before which partition they hold (a few bytes each, once)."""
        if not nodes:
            return
        question = RecordDict({"config": ConfigRecord({"ask": "partition-id"})})
        messages = [Message(content=question, message_type=MessageType.QUERY, dst_node_id=n)
                    for n in nodes]
        for reply in grid.send_and_receive(messages, timeout=self.cfg.round_timeout):
            node = reply.metadata.src_node_id
            try:
                if reply.has_error():
                    raise ValueError(reply.error.reason)
                self.partition_of[node] = parse_partition_id(
                    reply.content["node"]["partition-id"])
                if isinstance(self.broadcaster, PerClientBroadcaster):
                    # The replica it holds: a catch-up goes only to a node that has it.
                    held = (reply.content["replica"].get("digest", "")
                            if "replica" in reply.content else "")
                    self.broadcaster.reconcile(self._client_key(node),
                                               held if isinstance(held, str) else "")
            except (KeyError, TypeError, ValueError) as exc:
                log.warning("node %s did not tell its partition (%s): it is sampled after "
                            "the others, by node id", node, exc)
        missing = len([n for n in nodes if n not in self.partition_of])
        if missing:
            log.warning("%d of %d nodes have no known partition; sampling them is not "
                        "reproducible across runs", missing, len(nodes))

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
        self._sample_rate = len(nodes) / max(len(list(grid.get_node_ids())), 1)
        if self.dp is not None and self.dp.would_exceed(self._sample_rate):
            self.stopped = (f"stopped before round {server_round}: it would take epsilon to "
                            f"{self.dp.epsilon_after(self._sample_rate):.3f}, above "
                            f"dp-target-epsilon {self.cfg.dp_target_epsilon}")
            log.warning("privacy budget: %s", self.stopped)
            return []
        if self.cfg.dp == "sample" and self.sample_budget.would_exceed():
            self.stopped = (f"stopped before round {server_round}: it would take a client's "
                            f"DP-SGD epsilon to "
                            f"{self.sample_budget.epsilon_after_next_round():.3f}, above "
                            f"dp-target-epsilon {self.cfg.dp_target_epsilon}")
            log.warning("privacy budget: %s", self.stopped)
            return []
        settings = ConfigRecord({**self._settings, "server-round": server_round})
        if self.dp is not None:
            settings["dp-clip-current"] = self.dp.clip_norm  # moves with adaptive clipping
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
                payload = payload_from_record(msg.content["update"])
                metrics = dict(msg.content["metrics"])
                reported = msg.content["replica"]["digest"]
            except (KeyError, ValueError, TypeError) as exc:
                stats.record.rejected += 1
                stats.rejected_by_reason["malformed"] = (
                    stats.rejected_by_reason.get("malformed", 0) + 1)
                log.warning("node %s sent a malformed reply: %s", node, exc)
                self._forget_replica(node)
                continue
            stats.client_metrics[node] = metrics
            stats.replica_checks += 1
            if reported != self._expected_digest.get(node):
                stats.replica_mismatches += 1
                log.error("node %s holds a replica that differs from the server's copy", node)
                self._forget_replica(node)
            client_replies.append(ClientReply(
                node, payload, float(metrics.get("num-examples", 0.0)),
                order_key=int(metrics.get("partition-id", 0))))
            stats.record.encode_s += float(metrics.get("encode-s", 0.0))
            stats.record.train_s += float(metrics.get("train-s", 0.0))
            # The node applied the downlink: its replica is at the pre-publish round.
            self.node_rounds[node] = self.broadcaster.round

        result = aggregate_deltas(client_replies, self.expected,
                                  expected_meta={"round": server_round},
                                  norm_bound=self.cfg.norm_bound,
                                  norm_action=self.cfg.norm_action,
                                  clip_norm=self.dp.clip_norm if self.dp else 0.0)
        if self.dp is not None:
            # Noise on the clipped sum, divided by the number sampled (fixed, whoever
            # answered); the round is accounted even if nothing came back.
            if result.total is not None:
                result.mean_delta = self.dp.noisy_mean(result.total, len(self._sent),
                                                       self.dp_rng)
            self.dp.record_round(self._sample_rate)
            stats.record.epsilon = self.dp.epsilon()
            stats.record.dp_clip = self.dp.clip_norm
            if self.adaptive is not None:
                accepted = set(result.accepted)
                unclipped = sum(int(stats.client_metrics[n].get("dp-unclipped", 0) > 0)
                                for n in accepted)
                self.dp.clip_norm = self.adaptive.update(unclipped, len(self._sent),
                                                         self.dp_rng)
        elif self.cfg.dp == "sample":
            # Each client accounts its own DP-SGD; the run's guarantee is the worst one.
            stats.record.epsilon = max((float(m.get("epsilon", 0.0))
                                        for m in stats.client_metrics.values()), default=0.0)
            self.sample_epsilon = max(self.sample_epsilon, stats.record.epsilon)
            for metrics in stats.client_metrics.values():
                if "dp-steps" in metrics:
                    self.sample_budget.record(int(metrics.get("partition-id", 0)),
                                              float(metrics["dp-sample-rate"]),
                                              int(metrics["dp-steps"]))
        stats.record.uplink_bytes = result.received_bytes
        stats.record.decode_s = result.decode_s
        stats.record.clients_ok = len(result.accepted)
        stats.record.rejected += len(result.rejected)
        for reason, count in result.rejected_by_reason.items():
            stats.rejected_by_reason[reason] = stats.rejected_by_reason.get(reason, 0) + count
        applied: list[int] = []  # an abandoned round applies no one's update
        if result.mean_delta is not None and len(result.accepted) >= self.cfg.min_clients:
            target = self.optimizer.step(self.broadcaster.model, result.mean_delta)
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
                     "dp_rng": self.dp_rng.bit_generator.state,
                     "dp_history": self.dp.state() if self.dp else [],
                     "dp_clip": self.dp.clip_norm if self.dp else None,
                     "sample_epsilon": self.sample_epsilon,
                     "sample_budget": self.sample_budget.state(),
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
        self.dp_rng.bit_generator.state = meta["dp_rng"]
        if self.dp is not None:
            self.dp.restore(meta["dp_history"])
            self.dp.clip_norm = float(meta["dp_clip"])
        self.sample_epsilon = float(meta.get("sample_epsilon", 0.0))
        self.sample_budget.restore(meta.get("sample_budget", {}))
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
