"""Atomic checkpoints: a flat dict of numpy arrays plus JSON-able metadata.

Written to a temporary file in the same folder and moved into place with
``os.replace``, so a process killed mid-write leaves the previous checkpoint intact.
Read back with ``allow_pickle=False``: a checkpoint is data, never code.
"""

from __future__ import annotations

import json
import os
import tempfile
import zipfile
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["CheckpointError", "load_checkpoint", "load_model", "save_checkpoint",
           "save_model"]

_META = "__meta__"
FORMAT = "fedcomp.checkpoint/1"


class CheckpointError(ValueError):
    """A checkpoint is missing, unreadable or for another run."""


def save_checkpoint(path: str | Path, arrays: Mapping[str, np.ndarray],
                    meta: Mapping[str, Any]) -> None:
    """Write ``arrays`` and ``meta`` to ``path`` atomically."""
    blob = json.dumps({"format": FORMAT, **meta}).encode()
    _save_atomically(Path(path), {**arrays, _META: np.frombuffer(blob, dtype=np.uint8)})


def save_model(path: str | Path, arrays: Mapping[str, np.ndarray]) -> None:
    """Write a model's tensors to ``path`` (``.npz``, one array per tensor name).

    Plain ``np.savez`` keys, so a notebook loads it with ``np.load`` and
    ``model.load_state_dict({k: torch.from_numpy(v) for k, v in np.load(path).items()})``.
    """
    _save_atomically(Path(path), arrays)


def load_model(path: str | Path) -> dict[str, np.ndarray]:
    """Read a model written by :func:`save_model` (never unpickles)."""
    return _load_arrays(path, "model")


def _load_arrays(path: str | Path, what: str) -> dict[str, np.ndarray]:
    try:
        data = np.load(path, allow_pickle=False)
        if not isinstance(data, np.lib.npyio.NpzFile):
            raise ValueError("not an .npz archive")
        with data:
            return {k: data[k] for k in data.files}
    except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile, zlib.error) as exc:
        # Empty, truncated or corrupt files: every way an .npz read fails, as one error.
        raise CheckpointError(f"cannot read {what} {path}: {type(exc).__name__}: {exc}"
                              ) from None


def _save_atomically(path: Path, payload: Mapping[str, np.ndarray]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            np.savez(handle, **payload)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_checkpoint(path: str | Path) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Read a checkpoint written by :func:`save_checkpoint`."""
    arrays = _load_arrays(path, "checkpoint")
    if _META not in arrays:
        raise CheckpointError(f"{path} is not a fedcomp checkpoint")
    try:
        meta = json.loads(arrays.pop(_META).tobytes())
    except ValueError as exc:
        raise CheckpointError(f"{path}: unreadable checkpoint metadata ({exc})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a {FORMAT} checkpoint")
    return arrays, meta
