"""Fault injection: deterministic draws; each payload fault is rejected for its reason."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from fedcomp.codecs.policy import CompressionPolicy, encode_update
from fedcomp.codecs.wire import unpack_payload
from fedcomp.errors import PayloadError
from fedcomp.federated.aggregation import ClientReply, aggregate_deltas
from fedcomp.federated.faults import (
    INFLATED_EXAMPLES,
    POISON_SCALE,
    AttackPlan,
    ClientMisbehaviour,
    FaultPlan,
    misbehaviour,
    tamper,
)

SHAPES = {"w": (40, 50), "b": (40,)}
POLICY = CompressionPolicy("topk:ratio=0.05|quant:bits=4|zstd", min_numel=100)


def _payload(seed: int = 0, round_: int = 3) -> bytes:
    rng = np.random.default_rng(seed)
    tensors = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
    return encode_update(tensors, POLICY, rng=rng, meta={"round": round_}).payload


def test_draws_are_deterministic_and_follow_the_probabilities():
    plan = FaultPlan({"dropout": 0.3, "corrupt": 0.1}, seed=4)
    draws = [plan.draw(r, p) for r in range(1, 201) for p in range(20)]
    assert draws == [plan.draw(r, p) for r in range(1, 201) for p in range(20)]
    counts = collections.Counter(draws)
    assert abs(counts["dropout"] / len(draws) - 0.3) < 0.02
    assert abs(counts["corrupt"] / len(draws) - 0.1) < 0.02
    assert set(counts) == {None, "dropout", "corrupt"}
    assert FaultPlan({}).draw(1, 1) is None
    with pytest.raises(ValueError, match="add up to at most 1"):
        FaultPlan({"dropout": 0.7, "lie": 0.4})


@pytest.mark.parametrize(
    ("kind", "reasons"),
    [
        ("corrupt", {"checksum", "truncated", "size"}),
        ("lie", {"shape", "size", "model", "zstd", "header", "indices"}),
        ("nonfinite", {"non-finite"}),
    ],
)
def test_payload_faults_are_rejected_for_their_reason(kind, reasons):
    seen = set()
    for seed in range(30):
        hostile = tamper(kind, _payload(seed), np.random.default_rng(seed))
        with pytest.raises(PayloadError) as info:
            unpack_payload(hostile, expected=POLICY.expected(SHAPES))
        seen.add(info.value.reason)
    assert seen <= reasons and seen


def test_a_stale_payload_decodes_but_is_rejected_by_round():
    stale = tamper("stale", _payload(round_=3), np.random.default_rng(0))
    assert unpack_payload(stale, expected=POLICY.expected(SHAPES)).meta["round"] == 2
    result = aggregate_deltas([ClientReply(1, stale, 10)], POLICY.expected(SHAPES),
                              expected_meta={"round": 3})
    assert result.rejected_by_reason == {"stale": 1}


def test_the_lie_fault_includes_a_zstd_bomb_that_is_rejected_cheaply():
    rng = np.random.default_rng(0)
    reasons = set()
    for _ in range(40):
        hostile = tamper("lie", _payload(), rng)
        try:
            unpack_payload(hostile, expected=POLICY.expected(SHAPES))
        except PayloadError as exc:
            reasons.add(exc.reason)
    assert "zstd" in reasons


def test_an_attack_plan_picks_a_fixed_share_of_the_partitions():
    from fedcomp.federated.faults import AttackPlan

    plan = AttackPlan("signflip", 0.3, seed=7)
    attackers = plan.attackers(10)
    assert len(attackers) == 3 and attackers == plan.attackers(10)
    assert [plan.attack(p, 10) for p in range(10)].count("signflip") == 3
    assert AttackPlan().attackers(10) == frozenset()
    with pytest.raises(ValueError, match="unknown attack"):
        AttackPlan("ddos", 0.1)
    with pytest.raises(ValueError, match="fraction"):
        AttackPlan("scale", 1.0)


def test_an_fltmax_payload_is_valid_and_every_float_is_the_maximum():
    from fedcomp.codecs.policy import CompressionPolicy, encode_update
    from fedcomp.codecs.wire import unpack_payload
    from fedcomp.federated.faults import tamper

    policy = CompressionPolicy("topk:ratio=0.1")
    shapes = {"w": (20, 30)}
    rng = np.random.default_rng(0)
    payload = encode_update({"w": rng.standard_normal((20, 30)).astype(np.float32)}, policy,
                            rng=rng).payload
    hostile = tamper("fltmax", payload, rng)
    values = unpack_payload(hostile, expected=policy.expected(shapes)).tensors["w"]
    assert np.count_nonzero(values) >= 60  # at least the Top-K values ...
    assert (values[values != 0] == np.finfo(np.float32).max).all()  # ... all at the maximum


def test_each_fault_and_attack_lands_where_the_client_app_plays_it():
    def plan(faults=None, attack="none", partition=0):
        return misbehaviour(FaultPlan(faults or {}, seed=1), AttackPlan(attack, 0.5, seed=1),
                            server_round=3, partition_id=partition, num_partitions=2,
                            round_timeout=10.0)

    attacker = next(iter(AttackPlan("scale", 0.5, seed=1).attackers(2)))
    assert plan() == ClientMisbehaviour() and plan().honest
    assert plan(attack="scale", partition=1 - attacker).honest  # an honest client
    # Around the round (the mod): drop out, be late, tamper, lie about the count.
    assert plan({"dropout": 1.0}).drop_out
    assert plan({"straggler": 1.0}).delay_s > 10.0
    assert plan({"corrupt": 1.0}).tamper == ("corrupt",)
    assert plan({"stale": 1.0}, attack="fltmax", partition=attacker).tamper == (
        "stale", "fltmax")
    assert plan(attack="inflate", partition=attacker).examples == INFLATED_EXAMPLES
    # Inside it (the round): what is trained and how the delta is scaled.
    assert plan(attack="labelflip", partition=attacker).flip_labels
    assert plan(attack="signflip", partition=attacker).delta_scale == -1.0
    assert plan({"poison": 1.0}).delta_scale == plan(
        attack="scale", partition=attacker).delta_scale == POISON_SCALE
