"""A client round without Flower: replica sync, training, feedback state restore."""

from __future__ import annotations

import numpy as np
import pytest

from fedcomp.codecs.feedback import ErrorFeedback
from fedcomp.codecs.wire import unpack_payload
from fedcomp.config import RunConfig
from fedcomp.federated.client_round import ClientState, run_client_round
from fedcomp.federated.downlink import Broadcaster
from fedcomp.tasks.data import load_partition
from fedcomp.tasks.models import build_model, model_shapes
from fedcomp.tasks.training import state_arrays

CFG = RunConfig(local_steps=2, local_epochs=0)


def _setup():
    server = Broadcaster(state_arrays(build_model("digits", seed=0)), CFG.downlink_policy)
    data = load_partition("digits", 0, 5, scheme="iid")
    return server, data


def _first_round():
    """A fresh client's first round: (server, data, state, result)."""
    server, data = _setup()
    state = ClientState.fresh(CFG)
    result = run_client_round(CFG, state, server.message_for(None), data, server_round=1,
                              client_seed=0)
    return server, data, state, result


def test_a_round_returns_a_decodable_payload_and_carries_the_residual():
    server, data, state, first = _first_round()
    decoded = unpack_payload(first.payload, expected=CFG.uplink_policy.expected(server.shapes))
    assert decoded.meta == {"round": 1}
    assert first.metrics["payload-bytes"] == len(first.payload)
    assert first.metrics["residual-norm-in"] == 0.0
    assert first.metrics["num-examples"] == len(data)

    saved = state.to_arrays()
    restored = ClientState.from_arrays(CFG, saved, model_shapes("digits"))
    assert isinstance(restored.feedback, ErrorFeedback)
    second = run_client_round(CFG, restored, server.message_for(restored.replica.round), data,
                              server_round=2, client_seed=0)
    assert second.metrics["residual-norm-in"] > 0
    assert second.metrics["downlink-bytes"] == 0  # the replica was already current


def test_state_for_another_codec_or_model_is_dropped_not_fatal():
    server, data = _setup()
    state = ClientState.fresh(CFG)
    run_client_round(CFG, state, server.message_for(None), data, server_round=1, client_seed=0)
    saved = state.to_arrays()
    other_codec = CFG.replace(codec="topk:ratio=0.05|quant:bits=4")
    restored = ClientState.from_arrays(other_codec, saved, model_shapes("digits"))
    assert restored.feedback.memory == {}
    assert restored.replica.round == 0  # the replica does not depend on the codec
    wrong_model = {**saved, "replica": {**saved["replica"],
                                       "replica/fc2.bias": np.zeros(3, np.float32)}}
    assert ClientState.from_arrays(CFG, wrong_model, model_shapes("digits")).replica.model is None


def test_a_poisoned_message_leaves_the_clients_error_feedback_untouched():
    server, data = _setup()
    state = ClientState.fresh(CFG)
    poisoned = run_client_round(CFG, state, server.message_for(None), data, server_round=1,
                                client_seed=0, delta_scale=1e6)
    assert state.feedback.memory == {}  # nothing of the 1e6-scaled delta is carried on
    decoded = unpack_payload(poisoned.payload,
                             expected=CFG.uplink_policy.expected(server.shapes))
    assert max(float(np.abs(v).max()) for v in decoded.tensors.values()) > 1e3


def test_restoring_state_without_error_feedback_is_silent(caplog):
    import logging

    cfg = CFG.replace(feedback="none")
    server, data = _setup()
    state = ClientState.fresh(cfg)
    run_client_round(cfg, state, server.message_for(None), data, server_round=1, client_seed=0)
    with caplog.at_level(logging.WARNING):
        restored = ClientState.from_arrays(cfg, state.to_arrays(), model_shapes("digits"))
    assert caplog.text == "" and restored.replica.round == 0


def test_an_update_the_server_did_not_apply_goes_back_into_the_residual():
    """Through a save and restore: the unconfirmed update travels with the state."""
    server, data, state, first = _first_round()
    sent = unpack_payload(first.payload, expected=CFG.uplink_policy.expected(server.shapes))
    residual = {k: v.copy() for k, v in state.feedback.memory.items()}

    def restored() -> ClientState:
        return ClientState.from_arrays(CFG, state.to_arrays(), model_shapes("digits"))

    after_loss = restored()
    assert after_loss.unconfirmed_round == 1
    assert after_loss.unconfirmed == first.payload  # kept as sent: a few kB, not a model
    lost = run_client_round(CFG, after_loss, server.message_for(0), data, server_round=2,
                            client_seed=0, outcomes={1: False})
    # What the residual was when round 2 began: round 1's residual plus everything
    # round 1 sent, which the server never applied.
    owed = {k: residual.get(k, 0) + sent.tensors[k] for k in sent.tensors}
    assert lost.metrics["given-back-norm"] == pytest.approx(
        float(np.sqrt(sum(np.vdot(v, v) for v in sent.tensors.values()))), rel=1e-5)
    assert lost.metrics["residual-norm-in"] == pytest.approx(
        float(np.sqrt(sum(np.vdot(v, v) for v in owed.values()))), rel=1e-5)
    assert after_loss.unconfirmed_round == 2  # round 2's update now waits for its outcome
    # Applied, or no word of round 1 (a restarted server): nothing is given back.
    for outcomes in ({1: True}, {0: False}, None):
        again = restored()
        result = run_client_round(CFG, again, server.message_for(0), data, server_round=2,
                                  client_seed=0, outcomes=outcomes)
        assert result.metrics["given-back-norm"] == 0.0
        assert result.metrics["residual-norm-in"] == pytest.approx(
            float(np.sqrt(sum(np.vdot(v, v) for v in residual.values()))), rel=1e-5)
    # A settled update is written as settled (round -1), so it never comes back.
    assert int(again.to_arrays()["unconfirmed"]["round"][0]) == 2
    again.unconfirmed, again.unconfirmed_round = b"", None
    assert ClientState.from_arrays(CFG, again.to_arrays(),
                                   model_shapes("digits")).unconfirmed_round is None


def test_a_train_message_names_the_run_config_in_full_or_by_digest():
    from fedcomp.config import RunConfig
    from fedcomp.federated.client_round import SettingsUnknown, resolve_settings

    cfg = RunConfig(codec="sign", seed=3)
    full = {**cfg.to_mapping(), "server-round": 2, "settings-digest": cfg.settings_digest()}
    first = resolve_settings(full, kept=None, run_config={})
    assert first.cfg == cfg and first.server_round == 2 and first.clip_now is None
    assert first.to_keep == cfg.to_mapping()  # the node keeps what it was sent
    short = {"server-round": 3, "settings-digest": cfg.settings_digest(),
             "dp-clip-current": 0.5}
    # By digest: from what the node kept, else from Flower's context.run_config.
    again = resolve_settings(short, kept=first.to_keep, run_config={})
    assert again.cfg == cfg and again.clip_now == 0.5 and again.to_keep is None
    assert resolve_settings(short, kept=None, run_config=cfg.to_mapping()).cfg == cfg
    # A node that holds other settings, or none (restarted), cannot guess them.
    other = RunConfig(codec="sign", seed=4).to_mapping()
    with pytest.raises(SettingsUnknown, match="in full next time"):
        resolve_settings(short, kept=other, run_config={})
    with pytest.raises(SettingsUnknown):
        resolve_settings(short, kept=None, run_config={"codec": "no-such-codec"})


@pytest.mark.parametrize("wire_header", ["json", "predicted"])
def test_a_relative_worth_budget_weighs_the_update_against_the_clients_replica(wire_header):
    """``budget-worth = "relative"`` needs the model the delta starts from: the client
    hands its replica to the budget, and the payload fits, in either header form."""
    cfg = RunConfig.from_mapping({"local-steps": 2, "local-epochs": 0, "codec": "topk",
                                  "uplink-budget": "200x", "budget-worth": "relative",
                                  "wire-header": wire_header})
    server, data = _setup()
    state = ClientState.fresh(cfg)
    result = run_client_round(cfg, state, server.message_for(None), data, server_round=1,
                              client_seed=0)
    assert len(result.payload) <= cfg.uplink_budget_bytes(server.shapes)
    assert (result.payload[5] == 4) == (wire_header == "predicted")  # the flags byte
    decoded = unpack_payload(result.payload, expected=cfg.uplink_expected(server.shapes))
    assert any(np.any(value) for value in decoded.tensors.values())
