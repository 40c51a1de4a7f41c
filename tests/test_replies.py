"""Reply fields: every known field is checked, and a hostile reply never stops a round."""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Message
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedcomp.codecs.policy import encode_update
from fedcomp.federated.downlink import model_digest
from fedcomp.federated.replies import REPLY_FIELDS, ReplyError, parse_digest, parse_reply_metrics
from fedcomp.flower import reply_content, set_reply_metric
from tests.test_strategy import SHAPES, QueryingGrid

HOSTILE_VALUES = [math.nan, math.inf, -math.inf, -1.0, 1e300, -1e300, 0.5, 2.0**53, True,
                  [1.0], [1.0, 2.0], "3", b"3", None]


@pytest.mark.parametrize("name", sorted(REPLY_FIELDS))
@pytest.mark.parametrize("value", HOSTILE_VALUES, ids=repr)
def test_every_field_is_parsed_to_a_finite_in_range_number_or_refused(name, value):
    field = REPLY_FIELDS[name]
    try:
        parsed = parse_reply_metrics({name: value})[name]
    except ReplyError as exc:
        assert repr(name) in str(exc)
        return
    assert math.isfinite(parsed) and field.low <= parsed <= field.high
    assert not field.integral or parsed == int(parsed)


def test_required_fields_must_be_there_and_unknown_ones_are_dropped():
    with pytest.raises(ReplyError, match="'num-examples'"):
        parse_reply_metrics({"partition-id": 1}, required=("num-examples",))
    assert parse_reply_metrics({"num-examples": 5, "exfiltrated": 3.0}) == {"num-examples": 5.0}
    with pytest.raises(ReplyError):
        parse_reply_metrics([("num-examples", 5)])
    with pytest.raises(ReplyError, match="digest"):
        parse_digest("x" * 200)
    assert parse_digest("ab") == "ab"


def _honest(strategy, request, node, dp="none"):
    rng = np.random.default_rng(node)
    delta = {k: (0.1 * rng.standard_normal(s)).astype(np.float32) for k, s in SHAPES.items()}
    payload = encode_update(delta, strategy.cfg.uplink_policy, rng=rng,
                            meta={"round": 1}).payload
    return reply_content(payload, model_digest(strategy.broadcaster.model),
                         {"num-examples": 10.0, "partition-id": float(node)}
                         if dp == "none" else
                         {"dp-sample-rate": 0.25, "dp-steps": 4.0,
                          "partition-id": float(node)})


def _metric_values():
    # Everything a ConfigRecord can carry (the metrics travel in one).
    return st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                     st.integers(-2**62, 2**62), st.booleans(), st.text(max_size=5),
                     st.binary(max_size=5),
                     st.lists(st.floats(allow_nan=True), min_size=1, max_size=3))


# The fixture is a factory: each example builds its own strategy.
@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fields=st.dictionaries(st.sampled_from(sorted(REPLY_FIELDS)), _metric_values(),
                              max_size=6),
       drop=st.sets(st.sampled_from(["update", "digest", "payload"]), max_size=1),
       swap=st.booleans(), dp=st.sampled_from(["none", "sample"]))
def test_aggregate_train_never_raises_on_a_hostile_reply(make_strategy, fields, drop, swap,
                                                         dp):
    strategy = make_strategy(clients_per_round=0, dp=dp)
    messages = list(strategy.configure_train(1, None, ConfigRecord(),
                                             QueryingGrid([11, 12, 13])))
    replies = [Message(content=_honest(strategy, m, m.metadata.dst_node_id, dp), reply_to=m)
               for m in messages]
    hostile = replies[0].content
    for key, value in fields.items():
        set_reply_metric(hostile, key, value)
    for key in drop:
        if key in ("digest", "payload"):
            del hostile["update"][key]
        else:
            del hostile[key]
    if swap:
        hostile["update"] = ArrayRecord()  # the wrong kind of record
    done = {}

    def run():
        done["result"] = strategy.aggregate_train(1, replies)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(timeout=60)
    assert "result" in done, "aggregate_train blocked"
    stats = strategy.stats[1]
    # The other two replies always count; the hostile one counts only if it was valid.
    assert stats.record.clients_ok + stats.record.rejected == 3
    assert stats.record.clients_ok >= 2
    assert all(np.isfinite(v).all() for v in strategy.broadcaster.model.values())
    if dp == "sample":
        assert math.isfinite(strategy.privacy.epsilon())
