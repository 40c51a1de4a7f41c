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
