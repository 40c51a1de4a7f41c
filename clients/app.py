"""fedcomp ClientApp: local training and a compressed, error-compensated delta.

Thin by design: the round's logic is :func:`fedcomp.client_round.run_client_round`;
this file reads the message and the node's config, restores the client's state from
``context.state`` (never module globals: Ray reuses processes across virtual
clients), and packs the reply.
"""

from __future__ import annotations

from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedcomp.client_round import ClientState, model_shapes, run_client_round
from fedcomp.config import RunConfig
from fedcomp.data import load_partition
from fedcomp.downlink import Replica, ReplicaOutOfSync
from fedcomp.flower import (
    downlink_from_record,
    load_client_state,
    payload_to_record,
    save_client_state,
)

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    settings = dict(msg.content["config"])
    server_round = int(settings.pop("server-round"))
    cfg = RunConfig.from_mapping(settings)
    partition_id = int(context.node_config["partition-id"])
    num_partitions = int(context.node_config["num-partitions"])
    data = load_partition(
        cfg.dataset, partition_id, num_partitions, scheme=cfg.partitioning,
        alpha=cfg.dirichlet_alpha, classes_per_client=cfg.classes_per_client, seed=cfg.seed,
        data_dir=cfg.data_dir, test_fraction=cfg.test_fraction,
    )
    state = ClientState.from_arrays(cfg, load_client_state(context.state),
                                    model_shapes(cfg.dataset))
    try:
        result = run_client_round(cfg, state, downlink_from_record(msg.content["downlink"]),
                                  data, server_round=server_round, client_seed=partition_id)
    except ReplicaOutOfSync:
        state.replica = Replica()  # the server sends the full model after a failure
        save_client_state(context.state, state.to_arrays())
        raise
    save_client_state(context.state, state.to_arrays())
    content = RecordDict({
        "update": payload_to_record(result.payload),
        "metrics": MetricRecord(result.metrics),
        "replica": ConfigRecord({"digest": result.replica_digest}),
    })
    return Message(content=content, reply_to=msg)
