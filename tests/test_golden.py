"""Backwards compatibility: frozen payloads of every format version still decode."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fedcomp.codecs.policy import CompressionPolicy
from fedcomp.codecs.wire import unpack_payload

GOLDEN = Path(__file__).parent / "golden"
MANIFEST = json.loads((GOLDEN / "manifest.json").read_text())


def test_the_golden_set_covers_every_codec():
    from fedcomp.codecs.registry import available_codecs
    from fedcomp.codecs.spec import parse_spec

    used = {stage["id"] for case in MANIFEST.values()
            for spec in (case["codec"], case["small_codec"]) for stage in parse_spec(spec)}
    assert used == set(available_codecs())


@pytest.mark.parametrize("key", sorted(MANIFEST))
def test_golden_payload_decodes_to_the_frozen_values(key):
    case = MANIFEST[key]
    policy = CompressionPolicy(codec=case["codec"], small_codec=case["small_codec"],
                               min_numel=case["min_numel"],
                               budgeted=case.get("budgeted", False),
                               budget_values=tuple(case.get("budget_values", ())))
    payload = (GOLDEN / f"{key}.bin").read_bytes()
    decoded = unpack_payload(payload, expected=policy.expected(case["shapes"]))
    assert decoded.meta == case["meta"]
    with np.load(GOLDEN / f"{key}.npz", allow_pickle=False) as frozen:
        assert set(frozen.files) == set(decoded.tensors)
        for name in frozen.files:
            np.testing.assert_array_equal(decoded.tensors[name], frozen[name])


def test_the_golden_set_freezes_the_rows_index_coding():
    from fedcomp.codecs.fuzzing import split

    header, _ = split((GOLDEN / "v1-topk-rows.bin").read_bytes())
    coding = {name: tree["m"].get("ix") for name, _, _, tree in header["tensors"]}
    assert coding["fc.weight"] == "rows"


def test_the_predicted_golden_payloads_carry_the_predicted_header():
    predicted = [key for key in MANIFEST if key.startswith("v1-predicted-")]
    assert len(predicted) >= 4
    for key in predicted:
        assert (GOLDEN / f"{key}.bin").read_bytes()[5] == 4, key  # the flags byte
