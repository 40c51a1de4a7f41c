"""fedcomp ClientApp: local training and a compressed, error-compensated delta.

Thin by design: the round's logic is :func:`fedcomp.federated.client_round.run_client_round`;
this file reads the message and the node's config, restores the client's state from
``context.state`` (never module globals: Ray reuses processes across virtual
clients), and packs the reply. Injected faults and attacks (``fault-*``, ``attack``:
experiments only) that happen around a round are a mod, :func:`misbehave`; the two
that change what is trained (flipped labels, a scaled delta) are passed to the round.
"""

from __future__ import annotations

import time
from logging import INFO

import numpy as np
from flwr.app import ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.clientapp.mod import message_size_mod
from flwr.common.logger import log as flwr_log

from fedcomp.config import RunConfig
from fedcomp.federated.client_round import (
    ClientState,
    RoundSettings,
    dp_sgd_plan_reply,
    load_state_file,
    resolve_settings,
    run_client_round,
    save_state_file,
    saved_replica_digest,
    state_file,
)
from fedcomp.federated.downlink import Replica, ReplicaOutOfSync
from fedcomp.federated.faults import ClientMisbehaviour, InjectedFault, misbehaviour, tamper
from fedcomp.flower import (
    NODE_KEY,
    PAYLOAD_KEY,
    UPDATE_KEY,
    load_client_state,
    payload_from_record,
    reply_content,
    save_client_state,
    set_reply_metric,
    train_parts,
)
from fedcomp.tasks.data import ArrayDataset, load_partition
from fedcomp.tasks.models import model_shapes


def _message_size(msg: Message, context: Context, call_next):
    """Flower's own ``message_size_mod``, on nodes started with ``log-message-size=true``."""
    if str(context.node_config.get("log-message-size", "false")).lower() == "true":
        return message_size_mod(msg, context, call_next)
    return call_next(msg, context)


#: Where a node keeps the run config it was sent in full (``context.state``).
_SETTINGS_KEY = "fedcomp-settings"


def _settings(msg: Message, context: Context) -> RoundSettings:
    """The train message's run config: sent in full (then kept), or by digest."""
    kept = context.state[_SETTINGS_KEY] if _SETTINGS_KEY in context.state else None
    resolved = resolve_settings(train_parts(msg.content)[0],
                                kept=dict(kept) if kept is not None else None,
                                run_config=dict(context.run_config))
    if resolved.to_keep is not None:
        context.state[_SETTINGS_KEY] = ConfigRecord(resolved.to_keep)
    return resolved


def _misbehaviour(resolved: RoundSettings, context: Context) -> ClientMisbehaviour:
    """What the run's fault and attack plans make this node do in this train round."""
    cfg, server_round = resolved.cfg, resolved.server_round
    return misbehaviour(cfg.fault_plan, cfg.attack_plan, server_round=server_round,
                        partition_id=int(context.node_config["partition-id"]),
                        num_partitions=int(context.node_config["num-partitions"]),
                        round_timeout=cfg.round_timeout)


def misbehave(msg: Message, context: Context, call_next) -> Message:
    """Play the faults and attacks around a train round: drop out before it; after it,
    sleep past the timeout, tamper with the payload, lie about the example count."""
    if msg.metadata.message_type != MessageType.TRAIN:
        return call_next(msg, context)
    resolved = _settings(msg, context)
    plan, server_round = _misbehaviour(resolved, context), resolved.server_round
    if plan.drop_out:
        raise InjectedFault(f"injected dropout (round {server_round}, partition "
                            f"{context.node_config['partition-id']})")
    reply = call_next(msg, context)
    if plan.honest or reply.has_error():
        return reply
    time.sleep(plan.delay_s)
    if plan.tamper:
        update = reply.content[UPDATE_KEY]
        payload = payload_from_record(update)
        rng = np.random.default_rng([server_round, int(context.node_config["partition-id"])])
        for kind in plan.tamper:
            payload = tamper(kind, payload, rng)
        update[PAYLOAD_KEY] = payload
    if plan.examples is not None:
        set_reply_metric(reply.content, "num-examples", plan.examples)
    return reply


app = ClientApp(mods=[_message_size, misbehave])


@app.query()
def query(msg: Message, context: Context) -> Message:
    """Tell the server which data partition this node holds and which replica it holds.

    The server samples by partition; a per-client downlink keeps each partition's
    replica and checks the digest before it sends a catch-up to a (re)connected node.
    """
    partition_id = int(context.node_config["partition-id"])
    content = RecordDict({NODE_KEY: MetricRecord({"partition-id": partition_id})})
    settings = dict(msg.content["config"])
    if "dp-plan" in str(settings.pop("ask", "")).split():
        cfg = RunConfig.from_mapping(settings)
        content["dp-plan"] = ConfigRecord(dp_sgd_plan_reply(cfg, _load_data(cfg, context)))
    saved = _load_saved(context, partition_id)[0]
    if held := saved_replica_digest(saved):
        content["replica"] = ConfigRecord({"digest": held})
    return Message(content=content, reply_to=msg)


def _load_data(cfg: RunConfig, context: Context):
    """This node's partition of the run's dataset."""
    return load_partition(
        cfg.task_name, int(context.node_config["partition-id"]),
        int(context.node_config["num-partitions"]), scheme=cfg.partitioning,
        alpha=cfg.dirichlet_alpha, classes_per_client=cfg.classes_per_client, seed=cfg.seed,
        # A SuperNode names its own data location; the run config's is the fallback.
        data_dir=str(context.node_config.get("data-dir", cfg.data_dir)),
        test_fraction=cfg.test_fraction,
    )


def _load_saved(context: Context, partition_id: int):
    """The node's saved state: ``context.state``, else its state file; and that file."""
    state_dir = context.node_config.get("state-dir")
    state_path = (state_file(str(state_dir), context.run_id, partition_id)
                  if state_dir else None)
    saved = load_client_state(context.state)
    from_file = False
    if not saved and state_path is not None:
        saved = load_state_file(state_path, run_id=context.run_id, partition_id=partition_id)
        from_file = bool(saved)
    return saved, state_path, from_file


class EmptyPartitionError(RuntimeError):
    """This node's partition of the dataset holds no training example."""


@app.train()
def train(msg: Message, context: Context) -> Message:
    resolved = _settings(msg, context)
    cfg, server_round, clip_now = resolved.cfg, resolved.server_round, resolved.clip_now
    partition_id = int(context.node_config["partition-id"])
    data = _load_data(cfg, context)
    if len(data) == 0:
        # Flower answers the server with this reason (the node counts as failed), rather
        # than an update over no examples, which the server would reject as malformed.
        raise EmptyPartitionError(
            f"partition {partition_id} of {context.node_config['num-partitions']} holds no "
            f"training examples ({cfg.partitioning!r} split of {cfg.task_name!r}): nothing "
            "to train on; use fewer partitions or another split")
    # The attacks that change what this client trains (the rest are misbehave's).
    plan = _misbehaviour(resolved, context)
    if plan.flip_labels:
        data = ArrayDataset(data.x, (9 - data.y) % 10)
    # State lives in context.state; with a node-config `state-dir` it is also kept on
    # disk, so that a restarted SuperNode (whose context.state is empty) carries on.
    saved, state_path, from_file = _load_saved(context, partition_id)
    if from_file:  # in the SuperNode's log: an operator sees the node carry on
        flwr_log(INFO, "fedcomp: partition %d resumed from state file %s in round %d",
                 partition_id, state_path, server_round)
    state = ClientState.from_arrays(cfg, saved, model_shapes(cfg.task_name))
    try:
        # With the downlink, what the server did with this node's recent updates.
        _, downlink, outcomes = train_parts(msg.content)
        result = run_client_round(cfg, state, downlink, data,
                                  server_round=server_round, client_seed=partition_id,
                                  delta_scale=plan.delta_scale,
                                  clip_norm=clip_now,
                                  outcomes=outcomes)
    except ReplicaOutOfSync:
        state.replica = Replica()  # the server sends the full model after a failure
        _save(context, state, state_path, partition_id, server_round)
        raise
    _save(context, state, state_path, partition_id, server_round)
    metrics = {**result.metrics, "state-from-file": float(from_file)}
    return Message(content=reply_content(result.payload, result.replica_digest, metrics),
                   reply_to=msg)


def _save(context: Context, state: ClientState, path, partition_id: int,
          server_round: int) -> None:
    groups = state.to_arrays()
    save_client_state(context.state, groups)
    if path is not None:
        save_state_file(path, groups, run_id=context.run_id, partition_id=partition_id,
                        server_round=server_round)
