"""Error feedback: telescoping sums, EF21, state that refuses the wrong model."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fedcomp.codecs.feedback import (
    EF21,
    EF21Estimate,
    ErrorFeedback,
    NoFeedback,
    OutcomeLedger,
    StateMismatchError,
    make_feedback,
)
from fedcomp.codecs.pipeline import Pipeline

BIASED = ["topk:ratio=0.05", "topk:ratio=0.05|quant:bits=2", "sign", "lowrank:rank=1",
          "randk:ratio=0.1", "topk:ratio=0.01|ternary:mode=mean", "quant:bits=1"]


@given(spec=st.sampled_from(BIASED), steps=st.integers(1, 12), seed=st.integers(0, 10**6))
def test_error_feedback_telescopes(spec, steps, seed):
    rng = np.random.default_rng(seed)
    pipeline = Pipeline.parse(spec)
    memory = ErrorFeedback(spec)
    sent = np.zeros((30, 20), dtype=np.float64)
    inputs = np.zeros_like(sent)
    for _ in range(steps):
        x = rng.standard_normal((30, 20)).astype(np.float32)
        inputs += x
        _, decoded = memory.compress("w", x, pipeline, rng)
        sent += decoded
    # sum of inputs == sum of what the receiver decoded + what is still owed
    np.testing.assert_allclose(sent + memory.memory["w"], inputs, atol=1e-4 * steps)


def test_error_feedback_eventually_sends_every_coordinate():
    # Without feedback Top-1 of a constant vector sends the same coordinate forever;
    # with it, the residual makes every coordinate win in turn.
    x = np.ones(10, dtype=np.float32)
    pipeline = Pipeline.parse("topk:k=1")
    memory, plain = ErrorFeedback("topk:k=1"), NoFeedback()
    seen_ef, seen_plain = set(), set()
    for _ in range(10):
        seen_ef |= set(np.flatnonzero(memory.compress("w", x, pipeline,
                                                      np.random.default_rng())[1]))
        seen_plain |= set(np.flatnonzero(plain.compress("w", x, pipeline,
                                                        np.random.default_rng())[1]))
    assert seen_ef == set(range(10))
    assert seen_plain == {0}


def test_lossless_pipelines_keep_no_state():
    memory = ErrorFeedback("none")
    memory.compress("w", np.ones(5, np.float32), Pipeline.parse("none"), np.random.default_rng())
    assert memory.memory == {}


def test_ef21_sender_and_receiver_track_the_same_estimate():
    rng = np.random.default_rng(0)
    pipeline = Pipeline.parse("topk:ratio=0.2")
    sender, receiver = EF21("topk"), EF21Estimate()
    target = rng.standard_normal(100).astype(np.float32)
    errors = []
    for _ in range(15):
        _, correction = sender.compress("w", target, pipeline, rng)
        estimate = receiver.update("w", correction)
        np.testing.assert_allclose(estimate, sender.memory["w"], atol=1e-6)
        errors.append(float(np.linalg.norm(estimate - target)))
    # For a fixed input the estimate converges to it (Top-20% per step).
    assert errors[-1] < 1e-5 and errors[0] > errors[3] > errors[-1]


def test_state_round_trips_and_refuses_another_codec_kind_or_shape():
    rng = np.random.default_rng(0)
    pipeline = Pipeline.parse("topk:ratio=0.1")
    memory = ErrorFeedback("topk:ratio=0.1")
    memory.compress("a", rng.standard_normal((4, 5)).astype(np.float32), pipeline, rng)
    memory.compress("b", rng.standard_normal(7).astype(np.float32), pipeline, rng)
    state = memory.state_dict()

    restored = ErrorFeedback("topk:ratio=0.1")
    restored.load_state_dict(state, shapes={"a": (4, 5), "b": (7,)})
    for name in ("a", "b"):
        np.testing.assert_array_equal(restored.memory[name], memory.memory[name])

    with pytest.raises(StateMismatchError, match="codec"):
        ErrorFeedback("topk:ratio=0.2").load_state_dict(state)
    with pytest.raises(StateMismatchError, match="'ef'"):
        EF21("topk:ratio=0.1").load_state_dict(state)
    with pytest.raises(StateMismatchError, match="shape"):
        ErrorFeedback("topk:ratio=0.1").load_state_dict(state, shapes={"a": (5, 4), "b": (7,)})
    with pytest.raises(StateMismatchError, match="shape"):
        restored.compress("a", np.zeros((5, 4), np.float32), pipeline, rng)


def test_make_feedback_names_the_bad_kind():
    assert isinstance(make_feedback("ef", "x"), ErrorFeedback)
    with pytest.raises(ValueError, match="unknown error feedback 'ef3'"):
        make_feedback("ef3", "x")


@given(spec=st.sampled_from([*BIASED, "none"]), lost=st.lists(st.booleans(), min_size=1,
                                                              max_size=10),
       seed=st.integers(0, 10**6))
def test_lost_updates_given_back_keep_the_telescoping_sum(spec, lost, seed):
    """Only what the receiver applied counts as sent: a lost update goes back to the memory.

    Without give_back the sum falls short by every lost update; for the lossless
    pipeline (no residual kept) the lost values come back in the next message.
    """
    rng = np.random.default_rng(seed)
    pipeline = Pipeline.parse(spec)
    memory = ErrorFeedback(spec)
    applied = np.zeros((30, 20), dtype=np.float64)
    inputs = np.zeros_like(applied)
    for was_lost in lost:
        x = rng.standard_normal((30, 20)).astype(np.float32)
        inputs += x
        _, decoded = memory.compress("w", x, pipeline, rng)
        if was_lost:
            memory.give_back({"w": decoded})
        else:
            applied += decoded
    owed = memory.memory.get("w", np.zeros((30, 20), np.float32))
    np.testing.assert_allclose(applied + owed, inputs, atol=1e-4 * len(lost))
    if spec == "none":  # lossless: lost values are owed, and paid with the next message
        assert (np.abs(owed).max() > 0) == lost[-1]


def test_the_ledger_keeps_the_latest_outcomes_of_each_node_asked():
    ledger = OutcomeLedger(keep=2)
    ledger.record(1, asked=[7, 8], applied=[7])
    ledger.record(2, asked=[8], applied=[])
    ledger.record(3, asked=[8, 9], applied=[8, 9, 10])  # 10 was not asked: not recorded
    assert ledger.for_node(7) == {1: True}
    assert ledger.for_node(8) == {2: False, 3: True}  # round 1 fell out (keep=2)
    assert ledger.for_node(9) == {3: True}
    assert ledger.for_node(10) == {}
    import json  # the server's checkpoint keeps it as JSON

    again = OutcomeLedger(keep=2)
    again.restore(json.loads(json.dumps(ledger.state())))
    assert {n: again.for_node(n) for n in (7, 8, 9)} == {n: ledger.for_node(n) for n in (7, 8, 9)}
    with pytest.raises(ValueError, match="keep"):
        OutcomeLedger(keep=0)
