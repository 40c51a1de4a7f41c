"""Downlink: replicas equal the server's model bit for bit, catch-up picks the smaller."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedcomp.codecs.policy import CompressionPolicy
from fedcomp.errors import PayloadError
from fedcomp.federated.downlink import (
    Broadcaster,
    DownlinkMessage,
    PerClientBroadcaster,
    Recipient,
    Replica,
    ReplicaOutOfSync,
    make_downlink,
    model_digest,
)

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


# ---------------------------------------------------------------- per-client downlink
def _moved(server, rng, scale=1.0):
    return {k: v + np.float32(scale) * rng.standard_normal(v.shape).astype(np.float32)
            for k, v in server.model.items()}


@settings(max_examples=25)
@given(schedule=st.lists(st.sets(st.integers(0, 3)), min_size=1, max_size=8),
       seed=st.integers(0, 1000))
def test_per_client_replicas_equal_the_servers_copy_whatever_the_participation(
        schedule, seed):
    rng = np.random.default_rng(seed)
    initial = _model(rng)
    server = PerClientBroadcaster(initial, POLICY, seed=seed)
    full = len(server.full_payload())
    replicas = [Replica() for _ in range(4)]
    for participants in schedule:
        for i in sorted(participants):
            message = server.message_for(f"c{i}", stream=i, shared_init=True)
            # One payload, smaller than the model, however many rounds were missed.
            assert message.kind == "catchup" and len(message.payloads) == 1
            assert message.nbytes < full
            replicas[i].apply(message, server.shapes, POLICY, initial=initial)
            assert model_digest(replicas[i].model) == server.digests[f"c{i}"]
            assert model_digest(server.replica(f"c{i}")) == server.digests[f"c{i}"]
        server.publish(_moved(server, rng))


def test_per_client_catch_up_converges_to_the_servers_model():
    """What the codec leaves out is sent later: the difference is the client's memory."""
    rng = np.random.default_rng(0)
    initial = _model(rng)
    server = PerClientBroadcaster(initial, POLICY)
    server.publish(_moved(server, rng))
    gap0 = sum(float(np.sum((v - initial[k]) ** 2)) for k, v in server.model.items())
    replica = Replica()
    for _ in range(60):  # the model stands still; Top-10% a message
        replica.apply(server.message_for("a", stream=0, shared_init=True), server.shapes,
                      POLICY, initial=initial)
    gap = sum(float(np.sum((v - replica.model[k]) ** 2)) for k, v in server.model.items())
    assert gap < 1e-4 * gap0


def test_per_client_message_depends_on_the_client_and_the_stream_not_on_others():
    rng = np.random.default_rng(1)
    initial = _model(rng)
    one, two = PerClientBroadcaster(initial, POLICY, seed=3), PerClientBroadcaster(
        initial, POLICY, seed=3)
    target = _moved(one, rng)
    one.publish(target)
    two.publish(target)
    # Another client's messages in between change nothing for "a".
    two.message_for("b", stream=1, shared_init=True)
    assert (one.message_for("a", stream=0, shared_init=True).payloads
            == two.message_for("a", stream=0, shared_init=True).payloads)


def _server_and_a_synced_client(seed):
    """A per-client server and client "a", whose replica took its first catch-up."""
    rng = np.random.default_rng(seed)
    initial = _model(rng)
    server = PerClientBroadcaster(initial, POLICY)
    replica = Replica()
    replica.apply(server.message_for("a", stream=0, shared_init=True), server.shapes,
                  POLICY, initial=initial)
    return rng, initial, server, replica


def test_a_stale_or_foreign_replica_refuses_a_catch_up_and_the_full_model_recovers_it():
    rng, initial, server, replica = _server_and_a_synced_client(2)
    server.publish(_moved(server, rng))
    lost = server.message_for("a", stream=0, shared_init=True)  # never arrives
    server.publish(_moved(server, rng))
    kept = {k: v.copy() for k, v in replica.model.items()}
    with pytest.raises(ReplicaOutOfSync, match="not the one"):
        replica.apply(server.message_for("a", stream=0, shared_init=True), server.shapes,
                      POLICY, initial=initial)
    assert all(np.array_equal(kept[k], v) for k, v in replica.model.items())
    # A client whose round-0 model differs cannot start from it either.
    other = {k: v + np.float32(1e-3) for k, v in initial.items()}
    fresh = PerClientBroadcaster(initial, POLICY)
    with pytest.raises(ReplicaOutOfSync, match="not the one"):
        Replica().apply(fresh.message_for("z", stream=0, shared_init=True), fresh.shapes,
                        POLICY, initial=other)
    # The server forgets what it cannot know; the full model brings the replica back.
    assert lost.kind == "catchup"
    server.forget("a")
    message = server.message_for("a", stream=0, shared_init=True)
    assert message.kind == "full"
    replica.apply(message, server.shapes, POLICY, initial=initial)
    assert model_digest(replica.model) == model_digest(server.model) == server.digests["a"]
    # Without shared-init a new client gets the full model.
    assert server.message_for("new", stream=9, shared_init=False).kind == "full"


def test_a_reconnecting_client_keeps_its_catch_up_only_if_it_holds_the_replica():
    rng, _, server, replica = _server_and_a_synced_client(3)
    server.publish(_moved(server, rng))
    a, new = Recipient(node=7, key="a", stream=0), Recipient(node=8, key="never-seen", stream=1)
    server.reconcile(a, model_digest(replica.model))
    assert server.send(a).kind == "catchup"
    server.reconcile(a, "")  # restarted without its state
    assert server.send(a).kind == "full"
    server.reconcile(new, "")  # a first contact stays a first contact
    assert server.send(new).kind == "catchup"


def test_both_downlinks_answer_the_same_questions_about_a_client():
    """The strategy drives either through one interface: what a node that did not
    answer or that failed gets next."""
    rng = np.random.default_rng(0)
    initial = {"w": rng.standard_normal((40, 30)).astype(np.float32)}
    who = Recipient(node=3, key="partition-0", stream=0)
    for mode in ("shared", "per-client"):
        server = make_downlink(mode, initial, POLICY, history=10, seed=0, shared_init=True)
        assert server.per_client == (mode == "per-client")
        first = server.send(who)
        assert first.kind in ("delta", "catchup") and server.digest_for(who)
        server.applied(who)
        server.publish({"w": initial["w"] + 0.1})
        # No reply: the shared downlink keeps its lower bound (the missed update is
        # enough); the per-client one cannot know the replica: the full model.
        server.unconfirmed(who)
        assert server.send(who).kind == ("full" if server.per_client else "delta")
        # A failed node may hold anything: the full model, whichever the downlink.
        server.failed(who)
        assert server.send(who).kind == "full"
        assert server.digest_for(who) == model_digest(server.model)


def test_a_corrupted_or_misrouted_catch_up_is_rejected_and_leaves_the_replica():
    rng = np.random.default_rng(4)
    initial = _model(rng)
    server = PerClientBroadcaster(initial, POLICY)
    message = server.message_for("a", stream=0, shared_init=True)
    bad = bytearray(message.payloads[0])
    bad[len(bad) // 2] ^= 1
    replica = Replica()
    with pytest.raises(PayloadError):
        replica.apply(DownlinkMessage("catchup", 0, 0, (bytes(bad),), message.base_digest),
                      server.shapes, POLICY, initial=initial)
    assert replica.model is None
    with pytest.raises(ReplicaOutOfSync, match="another round"):
        replica.apply(DownlinkMessage("catchup", 1, 1, message.payloads, message.base_digest),
                      server.shapes, POLICY, initial=initial)
    with pytest.raises(ReplicaOutOfSync, match="one payload"):
        replica.apply(DownlinkMessage("catchup", 0, 0, message.payloads * 2,
                                      message.base_digest), server.shapes, POLICY,
                      initial=initial)


def test_per_client_state_round_trips_and_continues_identically():
    rng = np.random.default_rng(5)
    initial = _model(rng)
    server = PerClientBroadcaster(initial, POLICY, seed=7)
    for client in ("a", "b"):
        server.message_for(client, stream=ord(client), shared_init=True)
    server.publish(_moved(server, rng))
    server.message_for("a", stream=ord("a"), shared_init=True)
    server.forget("b")
    arrays, meta = server.state_dict()
    restored = PerClientBroadcaster(initial, POLICY, seed=7)
    restored.load_state_dict(arrays, meta)
    target = _moved(server, rng)
    for side in (server, restored):
        side.publish(target)
    for client in ("a", "b", "c"):
        mine = server.message_for(client, stream=ord(client), shared_init=True)
        theirs = restored.message_for(client, stream=ord(client), shared_init=True)
        assert mine == theirs
    assert [server.message_for("b", stream=0, shared_init=True).kind] == ["catchup"]
    with pytest.raises(ValueError, match="another round-0 model"):
        PerClientBroadcaster(_model(rng), POLICY).load_state_dict(arrays, meta)
    # A replica missing from the checkpoint is not trusted: that client gets the model.
    partial = PerClientBroadcaster(initial, POLICY, seed=7)
    partial.load_state_dict({k: v for k, v in arrays.items() if k != "dl-chains"}, meta)
    assert partial.message_for("a", stream=0, shared_init=True).kind == "full"


# ------------------------------------------------- per-client memory: what was sent
def _run_clients(server, rng, initial, rounds, clients, replicas):
    for round_ in range(rounds):
        for i in range(clients):
            if (round_ + i) % 2 == 0:
                message = server.message_for(f"c{i}", stream=i, shared_init=True)
                replicas[i].apply(message, server.shapes, POLICY, initial=initial)
        server.publish(_moved(server, rng, scale=0.1))


def test_per_client_memory_is_the_bytes_sent_not_a_model_per_client():
    rng = np.random.default_rng(11)
    initial = _model(rng)
    server = PerClientBroadcaster(initial, POLICY, seed=1)
    sent = {f"c{i}": 0 for i in range(6)}
    replicas = [Replica() for _ in range(6)]
    for round_ in range(3):
        for i in range(6):
            if (round_ + i) % 2 == 0:
                message = server.message_for(f"c{i}", stream=i, shared_init=True)
                sent[f"c{i}"] += message.nbytes
                replicas[i].apply(message, server.shapes, POLICY, initial=initial)
        server.publish(_moved(server, rng, scale=0.1))
    memory = server.memory()
    assert memory["dense_clients"] == 0 and memory["base_bytes"] == 0
    assert memory["chain_bytes"] == sum(sent.values())
    assert memory["chain_bytes"] < server.model_nbytes * len(sent)
    for i, replica in enumerate(replicas):  # rebuilt from the chain, bit for bit
        assert model_digest(server.replica(f"c{i}")) == model_digest(replica.model)


def test_a_chain_that_would_outweigh_the_model_becomes_the_model():
    rng = np.random.default_rng(12)
    initial = _model(rng)
    server = PerClientBroadcaster(initial, POLICY)
    replica = Replica()
    for _ in range(30):  # ~6% of the model a message: dense after ~16 messages
        replica.apply(server.message_for("a", stream=0, shared_init=True), server.shapes,
                      POLICY, initial=initial)
        assert server.held["a"].nbytes <= server.model_nbytes
        server.publish(_moved(server, rng, scale=0.1))
    assert server.held["a"].dense is not None
    assert server.memory()["dense_clients"] == 1
    message = server.message_for("a", stream=0, shared_init=True)
    replica.apply(message, server.shapes, POLICY, initial=initial)
    assert model_digest(replica.model) == server.digests["a"]


def test_idle_clients_are_forgotten_and_start_again_from_the_round_0_model():
    rng = np.random.default_rng(13)
    initial = _model(rng)
    server = PerClientBroadcaster(initial, POLICY, forget_after=2)
    replica = Replica()
    replica.apply(server.message_for("a", stream=0, shared_init=True), server.shapes,
                  POLICY, initial=initial)
    server.message_for("b", stream=1, shared_init=True)
    for round_ in range(3):
        server.publish(_moved(server, rng, scale=0.1))
        if round_ < 2:
            server.message_for("b", stream=1, shared_init=True)  # b stays active
    assert "a" not in server.held and "b" in server.held and server.forgotten == 1
    # A forgotten client is a client never seen: a catch-up from the round-0 model,
    # which it can apply whatever replica it still holds.
    message = server.message_for("a", stream=0, shared_init=True)
    assert message.kind == "catchup" and message.base_digest == server.initial_digest
    replica.apply(message, server.shapes, POLICY, initial=initial)
    assert model_digest(replica.model) == server.digests["a"]


def test_a_full_model_keeps_its_base_only_while_a_chain_starts_from_it():
    rng = np.random.default_rng(14)
    initial = _model(rng)
    server = PerClientBroadcaster(initial, POLICY)
    server.publish(_moved(server, rng, scale=0.1))
    replica = Replica()
    message = server.message_for("a", stream=0, shared_init=False)
    assert message.kind == "full"
    replica.apply(message, server.shapes, POLICY, initial=initial)
    assert set(server.bases) == {0, 1} and server.memory()["base_bytes"] == server.model_nbytes
    server.publish(_moved(server, rng, scale=0.1))
    replica.apply(server.message_for("a", stream=0, shared_init=False), server.shapes,
                  POLICY, initial=initial)
    assert model_digest(replica.model) == server.digests["a"]
    arrays, meta = server.state_dict()
    restored = PerClientBroadcaster(initial, POLICY)
    restored.load_state_dict(arrays, meta)
    assert model_digest(restored.replica("a")) == server.digests["a"]
    server.forget("a")
    server.publish(_moved(server, rng, scale=0.1))
    assert set(server.bases) == {0}


def test_checkpoint_grows_with_the_bytes_sent_and_a_damaged_chain_means_the_full_model():
    rng = np.random.default_rng(15)
    initial = _model(rng)
    server = PerClientBroadcaster(initial, POLICY)
    replicas = [Replica() for _ in range(8)]
    _run_clients(server, rng, initial, 3, 8, replicas)
    arrays, meta = server.state_dict()
    stored = sum(v.nbytes for k, v in arrays.items() if not k.startswith("model/"))
    assert stored == server.memory()["chain_bytes"] < 8 * server.model_nbytes
    # A flipped byte in a stored payload: that client is rebuilt wrong or not at all.
    chains = arrays["dl-chains"].copy()
    chains[len(chains) // 3] ^= 0xFF
    damaged = PerClientBroadcaster(initial, POLICY)
    damaged.load_state_dict({**arrays, "dl-chains": chains}, meta)
    kinds = [damaged.message_for(f"c{i}", stream=i, shared_init=True).kind for i in range(8)]
    assert kinds.count("full") == 1


def test_a_checkpoint_with_a_model_per_client_still_loads():
    rng = np.random.default_rng(16)
    initial = _model(rng)
    server = PerClientBroadcaster(initial, POLICY)
    replica = Replica()
    replica.apply(server.message_for("a", stream=0, shared_init=True), server.shapes,
                  POLICY, initial=initial)
    server.publish(_moved(server, rng, scale=0.1))
    arrays = {f"model/{k}": v for k, v in server.model.items()}
    arrays.update({f"dl-replica/a/{k}": v for k, v in replica.model.items()})
    meta = {"downlink_round": 1, "initial_digest": server.initial_digest,
            "replica_digests": {"a": model_digest(replica.model)}, "unknown_replicas": []}
    restored = PerClientBroadcaster(initial, POLICY)
    restored.load_state_dict(arrays, meta)
    message = restored.message_for("a", stream=0, shared_init=True)
    assert message.kind == "catchup"
    replica.apply(message, server.shapes, POLICY, initial=initial)
    assert model_digest(replica.model) == restored.digests["a"]
