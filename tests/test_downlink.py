"""Downlink: replicas equal the server's model bit for bit, catch-up picks the smaller."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedcomp.downlink import Broadcaster, DownlinkMessage, Replica, ReplicaOutOfSync, model_digest
from fedcomp.errors import PayloadError
from fedcomp.policy import CompressionPolicy

POLICY = CompressionPolicy("topk:ratio=0.1|quant:bits=4", min_numel=64)


def _model(rng):
    return {"w": rng.standard_normal((20, 30)).astype(np.float32),
            "b": rng.standard_normal(20).astype(np.float32)}


@settings(max_examples=25)
@given(schedule=st.lists(st.sets(st.integers(0, 3)), min_size=1, max_size=8),
       history=st.integers(1, 4), seed=st.integers(0, 1000))
def test_replicas_always_equal_the_shared_model_whatever_the_participation(
        schedule, history, seed):
    rng = np.random.default_rng(seed)
    server = Broadcaster(_model(rng), POLICY, history=history, seed=seed)
    replicas = [Replica() for _ in range(4)]
    for participants in schedule:
        for i in sorted(participants):
            replicas[i].apply(server.message_for(replicas[i].round), server.shapes, POLICY)
            assert replicas[i].round == server.round
            assert model_digest(replicas[i].model) == model_digest(server.model)
        target = {k: v + rng.standard_normal(v.shape).astype(np.float32)
                  for k, v in server.model.items()}
        server.publish(target)


def test_catch_up_uses_missed_updates_until_the_full_model_is_smaller():
    rng = np.random.default_rng(0)
    server = Broadcaster(_model(rng), POLICY, history=50)
    full = len(server.full_payload())
    for _ in range(30):
        server.publish({k: v + 1 for k, v in server.model.items()})
    one_behind = server.message_for(server.round - 1)
    assert one_behind.kind == "delta" and one_behind.nbytes < full
    far_behind = server.message_for(0)
    assert far_behind.kind == "full"  # 30 updates cost more than the model
    assert server.message_for(None).kind == "full"
    assert server.message_for(server.round).nbytes == 0


def test_with_no_downlink_codec_every_message_is_the_full_model():
    rng = np.random.default_rng(0)
    server = Broadcaster(_model(rng), CompressionPolicy("none"))
    server.publish({k: v + 1 for k, v in server.model.items()})
    assert server.message_for(0).kind == "full"


def test_a_replica_that_cannot_catch_up_says_so():
    rng = np.random.default_rng(0)
    server = Broadcaster(_model(rng), POLICY)
    replica = Replica()
    replica.apply(server.message_for(None), server.shapes, POLICY)
    for _ in range(3):
        server.publish({k: v + 1 for k, v in server.model.items()})
    stale = Replica()
    with pytest.raises(ReplicaOutOfSync, match="full model is needed"):
        stale.apply(server.message_for(1), server.shapes, POLICY)
    # Updates out of order are refused by their round tag.
    message = server.message_for(0)
    shuffled = DownlinkMessage("delta", 0, 3, message.payloads[::-1])
    with pytest.raises(ReplicaOutOfSync, match="another round"):
        replica.apply(shuffled, server.shapes, POLICY)


def test_a_corrupted_downlink_payload_is_rejected():
    rng = np.random.default_rng(0)
    server = Broadcaster(_model(rng), POLICY)
    message = server.message_for(None)
    bad = bytearray(message.payloads[0])
    bad[40] ^= 1
    with pytest.raises(PayloadError):
        Replica().apply(DownlinkMessage("full", 0, 0, (bytes(bad),)), server.shapes, POLICY)


def test_a_new_client_starts_from_its_own_round_zero_model_when_digests_agree():
    rng = np.random.default_rng(0)
    initial = _model(rng)
    server = Broadcaster(initial, POLICY)
    for _ in range(3):
        server.publish({k: v + 1 for k, v in server.model.items()})
    message = server.message_for(0)
    assert message.kind == "delta" and message.base_digest == model_digest(initial)
    assert message.nbytes < len(server.full_payload())
    replica = Replica()
    replica.apply(message, server.shapes, POLICY, initial=initial)
    assert model_digest(replica.model) == model_digest(server.model)
    # A client whose own initial model differs (another seed or torch) must not go on.
    other = {k: v + np.float32(1e-3) for k, v in initial.items()}
    with pytest.raises(ReplicaOutOfSync, match="initial model differs"):
        Replica().apply(message, server.shapes, POLICY, initial=other)
    # Without its own initial model, an empty replica needs the full model.
    with pytest.raises(ReplicaOutOfSync, match="full model is needed"):
        Replica().apply(message, server.shapes, POLICY)


def test_history_never_keeps_more_bytes_than_the_full_model():
    rng = np.random.default_rng(0)
    server = Broadcaster(_model(rng), POLICY, history=1000)
    full = len(server.full_payload())
    for _ in range(40):
        server.publish({k: v + 1 for k, v in server.model.items()})
        assert sum(len(p) for p in server.updates.values()) <= full
    assert server.message_for(server.round - 1).kind == "delta"
    assert server.message_for(0).kind == "full"  # its updates were dropped
