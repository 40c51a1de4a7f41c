"""Datasets that need no network, and their federated partitions.

The readers of fedcomp's own datasets; each task (:mod:`fedcomp.tasks`) says which
it uses, and :func:`load_partition` splits any task's training set among clients.

* ``digits``: scikit-learn's 1,797 real 8x8 digits (inside its wheel), split into
  train and test by a seeded stratified shuffle.
* ``fashion-mnist``: the standard IDX ``.gz`` files (60k train, 10k test), by default
  from Debian's ``dataset-fashion-mnist`` package, or from ``data-dir``. Nothing is
  downloaded: a missing file raises an error that says how to install it.

Partitions come from flwr-datasets' partitioners (IID, Dirichlet, pathological)
applied to a locally built ``datasets.Dataset`` of the training labels, after a seeded
shuffle, so every client process computes the same partition for the same seed.
Results are cached per process: Ray reuses its actors for many virtual clients.
"""

from __future__ import annotations

import functools
import gzip
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = [
    "DEFAULT_FASHION_DIR",
    "ArrayDataset",
    "dirichlet_clients",
    "load_dataset",
    "load_digits",
    "load_digits_split",
    "load_fashion_mnist",
    "load_partition",
    "partition_indices",
    "read_idx",
]

DEFAULT_FASHION_DIR = "/usr/share/datasets/fashion-mnist"
_FASHION_FILES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}


@dataclass(frozen=True)
class ArrayDataset:
    """Features (N, ...) float32 and labels (N,) int64 class indices."""

    x: np.ndarray
    y: np.ndarray

    def __len__(self) -> int:
        return len(self.y)

    def subset(self, indices: np.ndarray) -> ArrayDataset:
        return ArrayDataset(self.x[indices], self.y[indices])


def load_digits() -> ArrayDataset:
    """scikit-learn's 1,797 real 8x8 digits, scaled to [0, 1]."""
    from sklearn.datasets import load_digits as _load

    bunch = _load()
    x = (bunch.images.astype(np.float32) / 16.0)[:, None, :, :]
    return ArrayDataset(x=x, y=bunch.target.astype(np.int64))


# IDX: a big-endian header (magic 0x0000 | type 0x08 ubyte | ndim), ndim uint32 sizes,
# then the bytes. http://yann.lecun.com/exdb/mnist/ describes the format.
_IDX_UBYTE = 0x08


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """Read an IDX file (optionally gzip-compressed) of unsigned bytes, strictly."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as handle:
        data = handle.read()
    if len(data) < 4:
        raise ValueError(f"{path}: too short for an IDX header")
    zero, dtype, ndim = struct.unpack(">HBB", data[:4])
    if zero != 0 or dtype != _IDX_UBYTE or not 1 <= ndim <= 4:
        raise ValueError(f"{path}: not an unsigned-byte IDX file (magic {data[:4].hex()})")
    header = 4 + 4 * ndim
    if len(data) < header:
        raise ValueError(f"{path}: truncated IDX header")
    shape = struct.unpack(f">{ndim}I", data[4:header])
    if len(data) - header != int(np.prod(shape)):
        raise ValueError(f"{path}: {len(data) - header} data bytes for shape {shape}")
    return np.frombuffer(data, dtype=np.uint8, offset=header).reshape(shape)


def load_fashion_mnist(data_dir: str = "") -> tuple[ArrayDataset, ArrayDataset]:
    """Fashion-MNIST train and test sets from IDX ``.gz`` files in ``data_dir``."""
    folder = Path(data_dir or DEFAULT_FASHION_DIR)
    splits = []
    for split in ("train", "test"):
        images_name, labels_name = _FASHION_FILES[split]
        images_path, labels_path = folder / images_name, folder / labels_name
        for path in (images_path, labels_path):
            if not path.exists():
                raise FileNotFoundError(
                    f"Fashion-MNIST file {path} not found. Install Debian's package "
                    f"(`sudo apt-get install dataset-fashion-mnist`, files in "
                    f"{DEFAULT_FASHION_DIR}) or set the run config 'data-dir' to a folder "
                    f"holding {', '.join(n for pair in _FASHION_FILES.values() for n in pair)}."
                )
        images, labels = read_idx(images_path), read_idx(labels_path)
        if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
            raise ValueError(f"{folder}: {split} images {images.shape} and labels "
                             f"{labels.shape} do not match")
        x = (images.astype(np.float32) / 255.0)[:, None, :, :]
        splits.append(ArrayDataset(x=x, y=labels.astype(np.int64)))
    return splits[0], splits[1]


def load_digits_split(test_fraction: float = 0.2, seed: int = 0
                      ) -> tuple[ArrayDataset, ArrayDataset]:
    """Digits split into (train, test) by a seeded, stratified shuffle."""
    data = load_digits()
    rng = np.random.default_rng(seed)
    test_idx = []
    for label in np.unique(data.y):  # stratified: the same share of every class
        members = np.flatnonzero(data.y == label)
        rng.shuffle(members)
        test_idx.append(members[: round(test_fraction * len(members))])
    test_mask = np.zeros(len(data), dtype=bool)
    test_mask[np.concatenate(test_idx)] = True
    return data.subset(np.flatnonzero(~test_mask)), data.subset(np.flatnonzero(test_mask))


def load_dataset(name: str, data_dir: str = "", test_fraction: float = 0.2,
                 seed: int = 0) -> tuple[ArrayDataset, ArrayDataset]:
    """(train, test) of a task by name (:mod:`fedcomp.tasks`), cached per process."""
    from fedcomp.tasks import get_task

    return get_task(name).load_data(data_dir, test_fraction, seed)


@functools.lru_cache(maxsize=8)
def _partitions(labels_key: bytes, num_partitions: int, scheme: str, alpha: float,
                classes_per_client: int, seed: int) -> tuple[np.ndarray, ...]:
    import datasets
    from flwr_datasets.partitioner import (
        DirichletPartitioner,
        IidPartitioner,
        PathologicalPartitioner,
    )

    labels = np.frombuffer(labels_key, dtype=np.int64)
    order = np.random.default_rng(seed).permutation(len(labels))
    table = datasets.Dataset.from_dict({"label": labels[order], "index": order})
    if scheme == "iid":
        partitioner = IidPartitioner(num_partitions=num_partitions)
    elif scheme == "dirichlet":
        partitioner = DirichletPartitioner(
            num_partitions=num_partitions, partition_by="label", alpha=alpha, seed=seed,
            min_partition_size=0, self_balancing=False)
    elif scheme == "pathological":
        partitioner = PathologicalPartitioner(
            num_partitions=num_partitions, partition_by="label",
            num_classes_per_partition=classes_per_client, seed=seed,
            class_assignment_mode="first-deterministic")  # else some classes go unused
    else:
        raise ValueError(f"unknown partitioning {scheme!r}; choose iid, dirichlet or "
                         "pathological")
    partitioner.dataset = table
    return tuple(np.asarray(partitioner.load_partition(i)["index"], dtype=np.int64)
                 for i in range(num_partitions))


def partition_indices(labels: np.ndarray, num_partitions: int, scheme: str, *,
                      alpha: float = 0.5, classes_per_client: int = 2,
                      seed: int = 0) -> list[np.ndarray]:
    """Indices of each partition of ``labels`` (deterministic for a seed)."""
    if num_partitions < 1:
        raise ValueError(f"num_partitions must be >= 1, got {num_partitions}")
    key = np.ascontiguousarray(labels, dtype=np.int64).tobytes()
    return list(_partitions(key, num_partitions, scheme, float(alpha), classes_per_client,
                            seed))


def load_partition(name: str, partition_id: int, num_partitions: int, *, scheme: str,
                   alpha: float = 0.5, classes_per_client: int = 2, seed: int = 0,
                   data_dir: str = "", test_fraction: float = 0.2) -> ArrayDataset:
    """Training data of one client."""
    if not 0 <= partition_id < num_partitions:
        raise ValueError(f"partition-id {partition_id} is outside [0, {num_partitions})")
    train, _ = load_dataset(name, data_dir, test_fraction, seed)
    parts = partition_indices(train.y, num_partitions, scheme, alpha=alpha,
                              classes_per_client=classes_per_client, seed=seed)
    return train.subset(np.sort(parts[partition_id]))


def dirichlet_clients(name: str, num_clients: int, *, alpha: float, seed: int
                      ) -> tuple[list[ArrayDataset], ArrayDataset]:
    """Every client's training data (Dirichlet label split) and the test set, at once.

    What the in-process experiments (pilots, measurements) use to play all clients of
    a run in one process; a Flower client of a run with this ``seed`` loads the same
    data for itself with :func:`load_partition` (digits' train/test split is seeded
    too; Fashion-MNIST's is fixed by its files).
    """
    train, test = load_dataset(name, seed=seed)
    parts = partition_indices(train.y, num_clients, "dirichlet", alpha=alpha, seed=seed)
    return [train.subset(np.sort(p)) for p in parts], test
