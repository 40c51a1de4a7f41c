"""Datasets and partitions: IDX reading, determinism, coverage, clear errors."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np
import pytest

from fedcomp.tasks.data import (
    DEFAULT_FASHION_DIR,
    load_dataset,
    load_fashion_mnist,
    load_partition,
    partition_indices,
    read_idx,
)


def _write_idx(path: Path, array: np.ndarray, compress: bool = True) -> None:
    header = struct.pack(">HBB", 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I",
                                                                     *array.shape)
    data = header + array.astype(np.uint8).tobytes()
    path.write_bytes(gzip.compress(data) if compress else data)


def _fake_fashion(folder: Path, n_train: int = 50, n_test: int = 20) -> None:
    rng = np.random.default_rng(0)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        _write_idx(folder / f"{prefix}-images-idx3-ubyte.gz",
                   rng.integers(0, 256, (n, 28, 28)))
        _write_idx(folder / f"{prefix}-labels-idx1-ubyte.gz", rng.integers(0, 10, n))


def test_idx_reader_reads_what_was_written(tmp_path):
    array = np.arange(2 * 3 * 4).reshape(2, 3, 4)
    for compress in (True, False):
        path = tmp_path / ("a.gz" if compress else "a.idx")
        _write_idx(path, array, compress)
        np.testing.assert_array_equal(read_idx(path), array)


def test_idx_reader_rejects_bad_files(tmp_path):
    bad = tmp_path / "bad.idx"
    bad.write_bytes(struct.pack(">HBB", 0, 0x0D, 1) + struct.pack(">I", 2) + b"\0" * 8)
    with pytest.raises(ValueError, match="not an unsigned-byte IDX"):
        read_idx(bad)
    short = tmp_path / "short.idx"
    short.write_bytes(struct.pack(">HBB", 0, 0x08, 2) + struct.pack(">2I", 3, 3) + b"\0" * 5)
    with pytest.raises(ValueError, match="data bytes for shape"):
        read_idx(short)


def test_fashion_loader_reads_a_folder_and_scales_to_unit_range(tmp_path):
    _fake_fashion(tmp_path)
    train, test = load_fashion_mnist(str(tmp_path))
    assert train.x.shape == (50, 1, 28, 28) and test.x.shape == (20, 1, 28, 28)
    assert train.x.dtype == np.float32 and 0 <= train.x.min() and train.x.max() <= 1
    assert train.y.dtype == np.int64


def test_missing_fashion_files_say_how_to_install_them(tmp_path):
    with pytest.raises(FileNotFoundError, match="apt-get install dataset-fashion-mnist"):
        load_fashion_mnist(str(tmp_path))


@pytest.mark.skipif(not Path(DEFAULT_FASHION_DIR).exists(),
                    reason="Debian's dataset-fashion-mnist is not installed")
def test_the_real_fashion_mnist_files():
    train, test = load_fashion_mnist()
    assert train.x.shape == (60_000, 1, 28, 28) and test.x.shape == (10_000, 1, 28, 28)
    assert np.bincount(train.y).tolist() == [6000] * 10
    assert np.bincount(test.y).tolist() == [1000] * 10


def test_digits_split_is_stratified_and_disjoint():
    train, test = load_dataset("digits")
    assert len(train) + len(test) == 1797
    assert abs(len(test) / 1797 - 0.2) < 0.01
    assert set(np.unique(test.y)) == set(range(10))
    train_rows = {row.tobytes() for row in train.x}
    assert sum(row.tobytes() in train_rows for row in test.x) < 5  # digits has duplicates


@pytest.mark.parametrize("scheme", ["iid", "dirichlet", "pathological"])
def test_partitions_are_deterministic_disjoint_and_cover_the_data(scheme):
    labels = np.random.default_rng(0).integers(0, 10, 2000)
    parts = partition_indices(labels, 8, scheme, alpha=0.3, classes_per_client=2, seed=5)
    again = partition_indices(labels.copy(), 8, scheme, alpha=0.3, classes_per_client=2,
                              seed=5)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))
    joined = np.concatenate(parts)
    assert len(joined) == len(np.unique(joined))
    if scheme != "pathological":  # pathological may leave classes nobody drew
        assert len(joined) == 2000
    if scheme == "pathological":
        assert all(len(np.unique(labels[p])) <= 2 for p in parts)
    other = partition_indices(labels, 8, scheme, alpha=0.3, classes_per_client=2, seed=6)
    assert not all(np.array_equal(a, b) for a, b in zip(parts, other, strict=True))


def test_dirichlet_with_small_alpha_is_more_skewed_than_iid():
    labels = np.random.default_rng(0).integers(0, 10, 5000)

    def mean_classes(scheme: str) -> float:
        parts = partition_indices(labels, 10, scheme, alpha=0.1, seed=0)
        return float(np.mean([len(np.unique(labels[p])) for p in parts]))

    assert mean_classes("dirichlet") < mean_classes("iid") == 10


def test_load_partition_checks_the_partition_id():
    data = load_partition("digits", 2, 10, scheme="iid")
    assert 140 <= len(data) <= 146
    with pytest.raises(ValueError, match="partition-id 10"):
        load_partition("digits", 10, 10, scheme="iid")


def test_dirichlet_clients_split_the_training_set_exactly_once():
    from fedcomp.tasks.data import dirichlet_clients

    clients, test = dirichlet_clients("digits", 7, alpha=0.3, seed=1)
    train, same_test = load_dataset("digits", seed=1)
    assert len(clients) == 7 and len(test) == len(same_test)
    assert sum(len(c) for c in clients) == len(train)
    # Each client holds the rows of the seeded partition, the same a Flower client loads.
    third = load_partition("digits", 3, 7, scheme="dirichlet", alpha=0.3, seed=1)
    np.testing.assert_array_equal(clients[3].y, third.y)
    np.testing.assert_array_equal(clients[3].x, third.x)
