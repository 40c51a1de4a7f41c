"""Checkpoints: round trip, atomic replacement, refusal of other files."""

from __future__ import annotations

import numpy as np
import pytest

from fedcomp.checkpoint import CheckpointError, load_checkpoint, save_checkpoint


def test_round_trip_and_replacement(tmp_path):
    path = tmp_path / "run" / "checkpoint.npz"
    save_checkpoint(path, {"a": np.arange(3, dtype=np.float32)}, {"round": 1, "x": [1, 2]})
    save_checkpoint(path, {"a": np.arange(4, dtype=np.float32)}, {"round": 2})
    arrays, meta = load_checkpoint(path)
    np.testing.assert_array_equal(arrays["a"], np.arange(4, dtype=np.float32))
    assert meta["round"] == 2
    assert [p.name for p in path.parent.iterdir()] == ["checkpoint.npz"]  # no temp left


def test_unreadable_or_foreign_files_are_refused(tmp_path):
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError):
        load_checkpoint(bad)
    other = tmp_path / "other.npz"
    np.savez(other, a=np.zeros(2))
    with pytest.raises(CheckpointError, match="not a fedcomp checkpoint"):
        load_checkpoint(other)


def test_a_saved_model_loads_back_with_plain_names(tmp_path):
    from fedcomp.checkpoint import load_model, save_model

    arrays = {"fc1.weight": np.arange(6, dtype=np.float32).reshape(2, 3),
              "fc1.bias": np.ones(2, dtype=np.float32)}
    path = tmp_path / "models" / "round-0001.npz"
    save_model(path, arrays)
    loaded = load_model(path)
    assert sorted(loaded) == sorted(arrays)  # no metadata entry a state_dict would trip on
    for name, value in arrays.items():
        np.testing.assert_array_equal(loaded[name], value)
    assert [p.name for p in path.parent.iterdir()] == ["round-0001.npz"]
    path.write_bytes(b"truncated")
    with pytest.raises(CheckpointError, match="cannot read model"):
        load_model(path)
