"""Client sampling: the same seed draws the same partitions, whatever Flower's node ids."""

from __future__ import annotations

import math

import numpy as np
import pytest
from flwr.app import ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from hypothesis import given, settings
from hypothesis import strategies as st

from fedcomp.config import RunConfig
from fedcomp.federated.sampling import (
    MAX_PARTITION_ID,
    order_nodes,
    parse_partition_id,
    sample_nodes,
)
from strategies.compressed import CompressedFedAvg


@settings(max_examples=50, deadline=None)
@given(n=st.integers(2, 40), wanted=st.integers(0, 45), seed=st.integers(0, 2**32 - 1),
       ids_seed=st.integers(0, 2**32 - 1))
def test_the_partitions_drawn_depend_on_the_seed_not_on_the_node_ids(n, wanted, seed, ids_seed):
    """Two runs whose nodes got other random ids draw the same partitions."""
    draws = []
    for salt in (0, 1):
        ids = np.random.default_rng([ids_seed, salt]).integers(0, 2**62, size=n)
        # Distinct ids over the whole uint64 range, as Flower's are.
        node_ids = [int(i) * 4 + k % 4 + 2**63 * (k % 2) for k, i in enumerate(ids)]
        assert len(set(node_ids)) == n
        partition_of = {node: p for p, node in enumerate(node_ids)}
        rng = np.random.default_rng(seed)
        rounds = [sample_nodes(rng, node_ids, partition_of, wanted) for _ in range(3)]
        draws.append([[partition_of[node] for node in nodes] for nodes in rounds])
        for nodes in rounds:
            assert len(nodes) == (n if wanted == 0 or wanted >= n else wanted)
            assert len(set(nodes)) == len(nodes) and set(nodes) <= set(node_ids)
    assert draws[0] == draws[1]


def test_nodes_of_unknown_partition_come_last_by_node_id():
    assert order_nodes([50, 7, 30, 9], {50: 0, 30: 1}) == [50, 30, 7, 9]
    # Two nodes claiming one partition: node id breaks the tie; duplicates are merged.
    assert order_nodes([4, 3, 3], {4: 0, 3: 0}) == [3, 4]


@pytest.mark.parametrize("value", [True, -1, 1.5, math.nan, math.inf, "3", None,
                                   MAX_PARTITION_ID + 1, [1]])
def test_bad_partition_ids_are_refused_with_the_value_named(value):
    with pytest.raises(ValueError, match="partition id"):
        parse_partition_id(value)


def test_good_partition_ids_are_accepted():
    assert parse_partition_id(3) == 3 and parse_partition_id(3.0) == 3
    assert parse_partition_id(np.int64(MAX_PARTITION_ID)) == MAX_PARTITION_ID


class QueryGrid:
    """A grid whose nodes answer the strategy's query with a partition id."""

    def __init__(self, answers: dict[int, object]) -> None:
        self.answers = answers
        self.queried: list[int] = []

    def get_node_ids(self):
        return list(self.answers)

    def send_and_receive(self, messages, *, timeout=None):
        replies = []
        for msg in messages:
            assert msg.metadata.message_type == MessageType.QUERY
            node = msg.metadata.dst_node_id
            self.queried.append(node)
            answer = self.answers[node]
            if answer == "silent":
                continue
            replies.append(Message(content=RecordDict(
                {"node": MetricRecord({"partition-id": answer})} if answer != "garbage"
                else {"node": ConfigRecord({"what": "no"})}), reply_to=msg))
        return replies


@pytest.fixture()
def flower_task(monkeypatch):
    # Messages read the run id of the current process, which a ServerApp would set.
    from flwr.supercore.task_identity import TaskIdentity
    monkeypatch.setattr(TaskIdentity, "_run_id", 1)
    monkeypatch.setattr(TaskIdentity, "_node_id", 0)
    monkeypatch.setattr(TaskIdentity, "_task_id", 0)


def _strategy(seed: int = 0) -> CompressedFedAvg:
    initial = {"w": np.zeros((4, 4), np.float32)}
    return CompressedFedAvg(RunConfig(codec="none", clients_per_round=3, seed=seed), initial)


def test_the_strategy_asks_each_node_once_and_samples_by_partition(flower_task):
    sampled = []
    for ids in ([101, 202, 303, 404, 505, 606], [66, 55, 44, 33, 22, 11]):
        grid = QueryGrid({node: p for p, node in enumerate(ids)})
        strategy = _strategy()
        rounds = [strategy._sample(grid) for _ in range(4)]
        assert sorted(grid.queried) == sorted(ids)  # once each, not every round
        sampled.append([[strategy.partition_of[n] for n in nodes] for nodes in rounds])
    assert sampled[0] == sampled[1]
    assert sampled[0] != [sorted(s) for s in _other_seed_draws()]


def _other_seed_draws():
    grid = QueryGrid({node: p for p, node in enumerate([101, 202, 303, 404, 505, 606])})
    strategy = _strategy(seed=1)
    return [[strategy.partition_of[n] for n in strategy._sample(grid)] for _ in range(4)]


def test_nodes_that_do_not_answer_or_lie_are_still_sampled(flower_task, caplog):
    grid = QueryGrid({10: 0, 20: "silent", 30: "garbage", 40: -5, 50: 1})
    strategy = _strategy()
    nodes = strategy._sample(grid)
    assert len(nodes) == 3
    assert strategy.partition_of == {10: 0, 50: 1}
    assert "3 of 5 nodes have no known partition" in caplog.text
