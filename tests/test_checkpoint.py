"""Checkpoints: round trip, atomic replacement, refusal of other files."""

from __future__ import annotations

import numpy as np
import pytest

from fedcomp.federated.checkpoint import CheckpointError, load_checkpoint, save_checkpoint


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
    from fedcomp.federated.checkpoint import load_model, save_model

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


@pytest.mark.parametrize("damage", ["empty", "truncated", "garbage", "npy", "bad-meta"])
def test_every_malformed_checkpoint_is_a_checkpoint_error(tmp_path, damage):
    path = tmp_path / "checkpoint.npz"
    save_checkpoint(path, {"w": np.arange(1000, dtype=np.float32)}, {"round": 3})
    data = path.read_bytes()
    if damage == "empty":
        path.write_bytes(b"")
    elif damage == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        path.write_bytes(np.random.default_rng(0).bytes(len(data)))
    elif damage == "npy":
        np.save(path.with_suffix(".npy"), np.zeros(3))
        path.write_bytes(path.with_suffix(".npy").read_bytes())
    else:
        np.savez(path, w=np.zeros(3), __meta__=np.frombuffer(b"{not json", dtype=np.uint8))
    with pytest.raises(CheckpointError):
        load_checkpoint(path)


@pytest.mark.parametrize("damage", [b"", b"PK\x03\x04 truncated"])
def test_a_malformed_client_state_file_means_a_clean_start(tmp_path, damage, caplog):
    from fedcomp.federated.client_round import load_state_file

    path = tmp_path / "state.npz"
    path.write_bytes(damage)
    assert load_state_file(path, run_id=1, partition_id=0) == {}
    assert "starting clean" in caplog.text
