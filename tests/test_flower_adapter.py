"""The Flower adapter: feedback state and payloads through Flower's own records."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, RecordDict

from fedcomp.codecs.feedback import ErrorFeedback, StateMismatchError
from fedcomp.codecs.pipeline import Pipeline
from fedcomp.flower import (
    payload_from_record,
    payload_to_record,
    record_to_state,
    state_to_record,
)


def test_feedback_state_survives_a_trip_through_context_state():
    rng = np.random.default_rng(0)
    pipeline = Pipeline.parse("topk:ratio=0.1")
    memory = ErrorFeedback(pipeline.spec)
    memory.compress("fc.weight", rng.standard_normal((8, 16)).astype(np.float32), pipeline, rng)

    state = RecordDict()  # what context.state is
    state["feedback"] = state_to_record(memory.state_dict())
    assert isinstance(state["feedback"], ArrayRecord)

    restored = ErrorFeedback(pipeline.spec)
    restored.load_state_dict(record_to_state(state["feedback"]), shapes={"fc.weight": (8, 16)})
    np.testing.assert_array_equal(restored.memory["fc.weight"], memory.memory["fc.weight"])
    with pytest.raises(StateMismatchError):
        ErrorFeedback("sign").load_state_dict(record_to_state(state["feedback"]))


def test_payload_bytes_arrive_byte_identical_in_a_config_record():
    payload = bytes(range(256)) * 3
    record = payload_to_record(payload)
    assert isinstance(record, ConfigRecord)
    assert payload_from_record(record) == payload
    with pytest.raises(ValueError, match="no 'payload' bytes"):
        payload_from_record(ConfigRecord({"payload": "text"}))
