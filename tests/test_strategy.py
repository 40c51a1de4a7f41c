"""CompressedFedAvg hooks called directly with Flower messages built in memory."""

from __future__ import annotations

import numpy as np
from flwr.app import ConfigRecord, Error, Message, MetricRecord, RecordDict

from fedcomp.codecs.policy import encode_update
from fedcomp.federated.downlink import model_digest
from fedcomp.flower import reply_content, stamp_wire_counts, train_parts
from strategies.compressed import CompressedFedAvg
from tests.conftest import STRATEGY_SHAPES

SHAPES = STRATEGY_SHAPES


class FakeGrid:
    def __init__(self, nodes):
        self.nodes = nodes

    def get_node_ids(self):
        return list(self.nodes)


def _reply(request: Message, strategy: CompressedFedAvg, round_: int, node: int) -> Message:
    rng = np.random.default_rng(node)
    delta = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
    payload = encode_update(delta, strategy.cfg.uplink_policy, rng=rng,
                            meta={"round": round_}).payload
    content = reply_content(payload, model_digest(strategy.broadcaster.model),
                            {"num-examples": 10.0, "partition-id": float(node)})
    reply = Message(content=content, reply_to=request)
    return reply


def test_late_replies_are_counted_and_the_round_goes_on(make_strategy):
    strategy = make_strategy()
    messages = list(strategy.configure_train(1, None, ConfigRecord(), FakeGrid([11, 12, 13, 14])))
    assert len(messages) == 4
    # Flower's message_size_mod sizes every record; it fails on empty strings and lists.
    assert all(r.count_bytes() > 0 for m in messages for r in m.content.values())
    # One record a train message: Flower moves each record as its own request.
    assert all(list(m.content.keys()) == ["train"] for m in messages)
    # Two of four nodes answered before the timeout.
    replies = [_reply(m, strategy, 1, m.metadata.dst_node_id) for m in messages[:2]]
    arrays, _ = strategy.aggregate_train(1, replies)
    record = strategy.stats[1].record
    assert record.timed_out == 2 and record.clients_ok == 2
    assert strategy.broadcaster.round == 1  # the model moved on with the two
    assert arrays is not None and set(arrays) == set(SHAPES)


def test_each_node_hears_whether_its_last_update_was_applied(make_strategy):
    strategy = make_strategy(min_clients=2)
    grid = FakeGrid([11, 12, 13])

    def outcomes(messages):
        return {m.metadata.dst_node_id: train_parts(m.content)[2] for m in messages}

    first = list(strategy.configure_train(1, None, ConfigRecord(), grid))
    assert outcomes(first) == {11: {}, 12: {}, 13: {}}
    # 13 is too late: its update is lost, the others are applied.
    strategy.aggregate_train(1, [_reply(m, strategy, 1, m.metadata.dst_node_id)
                                 for m in first[:2]])
    second = list(strategy.configure_train(2, None, ConfigRecord(), grid))
    assert outcomes(second) == {11: {1: True}, 12: {1: True}, 13: {1: False}}
    # Round 2: only 11 answers, below min-clients: the round is abandoned, so even 11's
    # update was not applied.
    strategy.aggregate_train(2, [_reply(second[0], strategy, 2, 11)])
    assert strategy.broadcaster.round == 1
    third = list(strategy.configure_train(3, None, ConfigRecord(), grid))
    assert outcomes(third)[11] == {1: True, 2: False}
    assert all(r.count_bytes() > 0 for m in third for r in m.content.values())


def test_server_average_follows_each_applied_step_and_survives_a_checkpoint(make_strategy):
    strategy = make_strategy(server_average=0.9)
    assert strategy.evaluated_model() is strategy.average.value
    grid = FakeGrid([11, 12])
    for round_ in (1, 2):
        messages = list(strategy.configure_train(round_, None, ConfigRecord(), grid))
        strategy.aggregate_train(round_, [_reply(m, strategy, round_, m.metadata.dst_node_id)
                                          for m in messages])
    assert strategy.average.updates == 2
    # The clients' model moved; the evaluated one is between it and the start.
    model, averaged = strategy.broadcaster.model, strategy.evaluated_model()
    assert not np.array_equal(model["w"], averaged["w"])
    arrays, meta = strategy.state_dict()
    resumed = make_strategy(server_average=0.9)
    resumed.load_state_dict(arrays, meta)
    assert resumed.average.updates == 2
    np.testing.assert_array_equal(resumed.evaluated_model()["w"], averaged["w"])
    # Without server-average the evaluated model is the server's own.
    plain = make_strategy()
    assert plain.average is None and plain.evaluated_model() is plain.broadcaster.model



class QueryingGrid(FakeGrid):
    """Answers the strategy's partition queries as our ClientApp would (no replica yet)."""

    def send_and_receive(self, messages, timeout=None):
        return [Message(content=RecordDict({"node": MetricRecord(
                    {"partition-id": m.metadata.dst_node_id - 10})}), reply_to=m)
                for m in messages]


def test_per_client_downlink_checks_each_replica_and_forgets_what_it_cannot_know(
        make_strategy):
    from fedcomp.federated.downlink import Replica

    strategy = make_strategy(downlink_codec="topk:ratio=0.1|quant:bits=4",
                             downlink_mode="per-client", seed=1)
    grid = QueryingGrid([11, 12, 13])  # clients-per-round 10: all of them train
    replicas = {node: Replica() for node in grid.nodes}
    initial = {k: v.copy() for k, v in strategy.broadcaster.model.items()}

    def round_trip(server_round, answering, wrong_digest=()):
        messages = list(strategy.configure_train(server_round, None, ConfigRecord(), grid))
        kinds, replies = {}, []
        for message in messages:
            node = message.metadata.dst_node_id
            downlink = train_parts(message.content)[1]
            kinds[node] = downlink.kind
            replicas[node].apply(downlink, strategy.broadcaster.shapes,
                                 strategy.cfg.downlink_policy, initial=initial)
            reply = _reply(message, strategy, server_round, node)
            held = "0" * 64 if node in wrong_digest else model_digest(replicas[node].model)
            reply.content["update"]["digest"] = held
            if node in answering:
                replies.append(reply)
        strategy.aggregate_train(server_round, replies)
        return kinds

    # First contact: a catch-up from the round-0 model each builds from the seed.
    assert round_trip(1, answering={11, 12}) == {11: "catchup", 12: "catchup", 13: "catchup"}
    assert sorted(strategy.partition_of.values()) == [1, 2, 3]  # asked even so
    assert strategy.stats[1].replica_checks == 2 and strategy.stats[1].replica_mismatches == 0
    # Each replica is its own approximation of the server's model, which moved exactly.
    assert model_digest(replicas[11].model) != model_digest(strategy.broadcaster.model)
    # 13 did not answer: the server cannot know what it holds and sends the full model.
    assert round_trip(2, answering={11, 12, 13}, wrong_digest={12}) == {
        11: "catchup", 12: "catchup", 13: "full"}
    assert strategy.stats[2].replica_mismatches == 1
    assert round_trip(3, answering={11, 12, 13}) == {11: "catchup", 12: "full", 13: "catchup"}
    assert strategy.stats[3].replica_mismatches == 0
    _, meta = strategy.state_dict()
    assert sorted(meta["replica_store"]) == ["partition-1", "partition-2", "partition-3"]


def test_the_run_config_goes_in_full_until_a_node_has_answered_then_by_digest(make_strategy):
    strategy = make_strategy()
    grid = FakeGrid([11, 12, 13])

    def full(messages):
        return {m.metadata.dst_node_id: "codec" in train_parts(m.content)[0]
                for m in messages}

    first = list(strategy.configure_train(1, None, ConfigRecord(), grid))
    assert full(first) == {11: True, 12: True, 13: True}
    digest = strategy.cfg.settings_digest()
    assert all(train_parts(m.content)[0]["settings-digest"] == digest for m in first)
    # 11 answers; 12 fails (a restarted node may have lost them); 13 does not answer.
    failed = Message(Error(code=0, reason="lost"), reply_to=first[1])
    strategy.aggregate_train(1, [_reply(first[0], strategy, 1, 11), failed])
    second = list(strategy.configure_train(2, None, ConfigRecord(), grid))
    assert full(second) == {11: False, 12: True, 13: True}
    short = train_parts(second[0].content)[0]
    assert set(short.keys()) == {"server-round", "settings-digest"}
    in_full = train_parts(second[1].content)[0]
    assert ConfigRecord(short).count_bytes() * 10 < ConfigRecord(in_full).count_bytes()


def test_nodes_are_sent_the_expanded_run_config_without_its_preset(make_strategy):
    """The server expands a preset knowing which keys the user wrote; a node that
    expanded it again would put back a preset setting the user set to its default."""
    strategy = make_strategy(preset="fedcomp-budget", budget_worth="energy")
    (message,) = strategy.configure_train(1, None, ConfigRecord(), FakeGrid([11]))
    sent = train_parts(message.content)[0]
    assert "preset" not in sent and sent["budget-worth"] == "energy"
    assert sent["settings-digest"] == strategy.cfg.settings_digest()


class MeteredGrid(FakeGrid):
    """Nodes whose warm workers report wire counters with every reply."""

    def __init__(self, nodes):
        super().__init__(nodes)
        self.counters = {node: [1_000 * node, 5_000 * node] for node in nodes}

    def send_and_receive(self, messages, timeout=None):
        replies = []
        for m in messages:
            node = m.metadata.dst_node_id
            record = MetricRecord({"partition-id": node - 10})
            stamp_wire_counts(RecordDict({"node": record}), *self.counters[node], since=3.0)
            replies.append(Message(content=RecordDict({"node": record}), reply_to=m))
        return replies

    def reply(self, message, strategy, round_, up, down):
        node = message.metadata.dst_node_id
        self.counters[node][0] += up
        self.counters[node][1] += down
        reply = _reply(message, strategy, round_, node)
        assert stamp_wire_counts(reply.content, *self.counters[node], since=3.0)
        return reply


def test_wire_counters_become_bytes_per_round_less_the_payloads_that_crossed(make_strategy):
    strategy = make_strategy(downlink_codec="topk:ratio=0.1|quant:bits=4",
                             downlink_mode="per-client")  # asks each node its partition
    grid = MeteredGrid([11, 12])
    payloads = {}
    for round_ in (1, 2):
        messages = list(strategy.configure_train(round_, None, ConfigRecord(), grid))
        sent = dict(strategy._sent)
        replies = [grid.reply(m, strategy, round_, up=9_000, down=sent[m.metadata.dst_node_id]
                              + 2_500) for m in messages]
        strategy.aggregate_train(round_, replies)
        record = strategy.stats[round_].record
        assert record.wire_nodes == 2
        assert (record.wire_up_bytes, record.wire_down_bytes) == (18_000, 5_000 + sum(
            sent.values()))
        # Round 1's windows carried no payload up (the query reply has none); round 2's
        # carried round 1's replies.
        assert record.protocol_up_bytes == 18_000 - sum(payloads.values())
        assert record.protocol_down_bytes == 5_000
        assert all(m["wire-up-bytes"] == 9_000 for m in strategy.stats[round_]
                   .client_metrics.values())
        payloads = {r.metadata.src_node_id: len(r.content["update"]["payload"])
                    for r in replies}
    # A node that fails opens no window for its next reply; nor does a simulated node.
    messages = list(strategy.configure_train(3, None, ConfigRecord(), grid))
    failed = Message(Error(code=0, reason="boom"), reply_to=messages[0])
    strategy.aggregate_train(3, [failed, _reply(messages[1], strategy, 3, 12)])
    assert strategy.stats[3].record.wire_nodes == 0


def test_budgeted_replies_are_decoded_and_their_choices_recorded(make_strategy):
    """With byte budgets both ways: the strategy starts (the budgets fit this model),
    sends downlink payloads within its budget, decodes uplink payloads made within
    the uplink budget and records each client's Top-K share and what the downlink
    budget chose; a budget below the model's smallest payload is refused before
    round 1."""
    import pytest

    from fedcomp.codecs.policy import encode_within_budget
    from fedcomp.errors import SpecError

    strategy = make_strategy(uplink_budget="1200B", downlink_budget="1500B",
                             downlink_codec="topk:ratio=0.1|quant:bits=4",
                             downlink_mode="per-client")
    assert strategy.cfg.uplink_policy.family_for(SHAPES["w"], "w") is not None
    messages = list(strategy.configure_train(1, None, ConfigRecord(),
                                             QueryingGrid([11, 12, 13])))
    replies = []
    for message in messages:
        node = message.metadata.dst_node_id
        downlink = train_parts(message.content)[1]
        assert downlink.kind == "catchup" and downlink.nbytes <= 1500
        rng = np.random.default_rng(node)
        delta = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
        update = encode_within_budget(delta, strategy.cfg.uplink_policy, 1200, rng=rng,
                                      meta={"round": 1})
        assert update.nbytes <= 1200
        content = reply_content(update.payload, strategy.broadcaster.digest_for(
            strategy._recipient(node)), {"num-examples": 10.0, "partition-id": float(node)})
        replies.append(Message(content=content, reply_to=message))
    strategy.aggregate_train(1, replies)
    stats = strategy.stats[1]
    assert stats.record.clients_ok == 3 and stats.record.rejected == 0
    assert 0 < stats.record.uplink_density < 1
    assert stats.record.uplink_tensor_density.startswith("w=")
    assert all(0 < m["uplink-density"] < 1 for m in stats.client_metrics.values())
    # The downlink budget's choices for the three catch-ups sent this round: in round
    # 1 the replicas and the server hold the same shared initial model, the difference
    # is zero, and the budget leaves every tensor out.
    assert stats.record.downlink_density == 0 and stats.record.downlink_value_bits == 0
    assert stats.record.downlink_tensor_density == "w=0;b=0"
    assert strategy.broadcaster.take_kept() == []  # taken by the round's record
    with pytest.raises(SpecError, match="smallest payload"):
        make_strategy(uplink_budget="20B")


def test_the_round_records_how_far_error_feedback_lags(make_strategy):
    """``feedback_ratio``: the median over the replies of each client's residual over
    its fresh update, and ``feedback_residual`` the median residual; a reply without
    the norms (or with no fresh update) does not count, and without error feedback
    both stay NaN."""
    import math

    from fedcomp.flower import set_reply_metric

    def replies(strategy, norms):
        messages = list(strategy.configure_train(1, None, ConfigRecord(),
                                                 FakeGrid([11, 12, 13, 14])))
        out = []
        for message, extra in zip(messages, norms, strict=True):
            reply = _reply(message, strategy, 1, message.metadata.dst_node_id)
            for key, value in extra.items():
                set_reply_metric(reply.content, key, value)
            out.append(reply)
        return out

    norms = [{"residual-norm-in": 3.0, "delta-norm": 1.0},     # 3
             {"residual-norm-in": 10.0, "delta-norm": 2.0},    # 5
             {"residual-norm-in": 100.0, "delta-norm": 1.0},   # 100
             {"residual-norm-in": 5.0, "delta-norm": 0.0}]     # no fresh update: left out
    strategy = make_strategy(feedback="ef")
    strategy.aggregate_train(1, replies(strategy, norms))
    assert strategy.stats[1].record.clients_ok == 4
    assert strategy.stats[1].record.feedback_ratio == 5.0  # the median, not the mean (36)
    assert strategy.stats[1].record.feedback_residual == 10.0  # of the same three
    plain = make_strategy(feedback="none")
    plain.aggregate_train(1, replies(plain, norms))
    assert math.isnan(plain.stats[1].record.feedback_ratio)
    assert math.isnan(plain.stats[1].record.feedback_residual)
