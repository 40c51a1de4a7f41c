"""Write the frozen golden payloads of wire format version 1.

Run once per format version: ``python -m tests.golden.generate``. The files it
writes are committed and never regenerated for an existing version; the test
``tests/test_golden.py`` checks that the current code still decodes each of them to
the stored values (backwards compatibility, as numcodecs' frozen fixtures do).
Re-running it only adds files that do not exist yet. Every case is written twice:
``v1-NAME`` with a plain zstd header and ``v1-layout-NAME`` with the header
compressed against the layout dictionary (which the receiver rebuilds from the
codecs, so a codec change that alters the reference header shows up here). The
``v1-predicted-NAME`` cases (added later, same format version) carry the predicted
header (:mod:`fedcomp.codecs.compact_header`): byte budgets' members of each
tensor's family, and fixed codecs, whose trees the receiver predicts by encoding
its reference input, so a codec change that alters a prediction shows up here too.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from fedcomp.codecs.budget import VALUE_CHOICES
from fedcomp.codecs.policy import CompressionPolicy, encode_update, encode_within_budget

HERE = Path(__file__).parent
SHAPES = {"conv.weight": [8, 1, 3, 3], "conv.bias": [8], "fc.weight": [10, 120]}
CASES = {
    "none": ("none", "none"),
    "topk-quant4-zstd": ("topk:ratio=0.05|quant:bits=4|zstd:level=3", "none"),
    "topk-approx": ("topk:ratio=0.02,approx=true,trim=true", "fp16"),
    "topk-bitmap": ("topk:ratio=0.5", "bf16"),
    "randk": ("randk:ratio=0.1", "none"),
    "threshold": ("threshold:value=1.5", "none"),
    "quant3-nearest": ("quant:bits=3,rounding=nearest", "none"),
    "qsgd": ("qsgd:levels=4", "none"),
    "sign": ("sign", "none"),
    "ternary": ("ternary", "none"),
    "stc": ("topk:ratio=0.01|ternary:mode=mean", "none"),
    "lowrank-fp16": ("lowrank:rank=2|fp16", "none"),
    # Rows of very different scales, as a layer's update has: Top-K picks the
    # ``rows`` index coding (added after the first twelve cases, same format version).
    "topk-rows": ("topk:ratio=0.1|ternary:mode=mean", "none"),
    # The random Hadamard rotation (added later, same format version).
    "hadamard-quant2": ("hadamard:block=64|quant:bits=2", "none"),
}
#: Cases whose tensors get one scale per row (1 to 1000), so their supports crowd
#: into a few rows.
ROW_SCALED = {"topk-rows"}
#: Predicted-header cases: (codec, small codec, budget in bytes or 0 for none, row
#: scaled). Budgets take each tensor's count and value coding from VALUE_CHOICES.
PREDICTED = {
    "budget-600": ("topk:ratio=0.01|ternary:mode=mean", "none", 600, False),
    "budget-150": ("topk:ratio=0.01|ternary:mode=mean", "none", 150, True),
    "stc": ("topk:ratio=0.01|ternary:mode=mean", "none", 0, False),
    "topk-rows": ("topk:ratio=0.1|ternary:mode=mean", "none", 0, True),
}


def main() -> None:
    manifest_path = HERE / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    for with_layout in (False, True):
        for index, (name, (codec, small)) in enumerate(CASES.items()):
            _write_case(manifest, index, name, codec, small, with_layout)
    for index, (name, case) in enumerate(PREDICTED.items()):
        _write_predicted_case(manifest, 100 + index, name, *case)
    manifest_path.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def _tensors(rng: np.random.Generator, row_scaled: bool) -> dict[str, np.ndarray]:
    """Normal values per tensor; row scaled: one scale per row, 1 to 1000."""
    tensors = {n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}
    if row_scaled:
        tensors = {n: (t * np.logspace(0, 3, t.shape[0], dtype=np.float32).reshape(
            (-1,) + (1,) * (t.ndim - 1))) if t.ndim > 1 else t for n, t in tensors.items()}
    return tensors


def _write_case(manifest: dict, index: int, name: str, codec: str, small: str,
                with_layout: bool) -> None:
    key = f"v1-layout-{name}" if with_layout else f"v1-{name}"
    if key in manifest:
        return
    rng = np.random.default_rng(1000 + index)
    tensors = _tensors(rng, name in ROW_SCALED)
    policy = CompressionPolicy(codec=codec, small_codec=small, min_numel=64)
    update = encode_update(tensors, policy, rng=rng, meta={"round": index},
                           layout_dictionary=with_layout)
    (HERE / f"{key}.bin").write_bytes(update.payload)
    np.savez(HERE / f"{key}.npz", **update.decoded)
    manifest[key] = {"codec": codec, "small_codec": small, "min_numel": 64,
                     "shapes": SHAPES, "meta": {"round": index}}


def _write_predicted_case(manifest: dict, index: int, name: str, codec: str, small: str,
                          budget: int, row_scaled: bool) -> None:
    key = f"v1-predicted-{name}"
    if key in manifest:
        return
    rng = np.random.default_rng(1000 + index)
    tensors = _tensors(rng, row_scaled)
    values = list(VALUE_CHOICES) if budget else []
    policy = CompressionPolicy(codec=codec, small_codec=small, min_numel=64,
                               budgeted=bool(budget), budget_values=tuple(values),
                               wire_header="predicted")
    meta = {"round": index}
    update = (encode_within_budget(tensors, policy, budget, rng=rng, meta=meta) if budget
              else encode_update(tensors, policy, rng=rng, meta=meta))
    (HERE / f"{key}.bin").write_bytes(update.payload)
    np.savez(HERE / f"{key}.npz", **update.decoded)
    manifest[key] = {"codec": codec, "small_codec": small, "min_numel": 64,
                     "shapes": SHAPES, "meta": meta, "budgeted": bool(budget),
                     "budget_values": values}


if __name__ == "__main__":
    main()
