"""Hypothesis strategies shared by the codec tests (arrays and codec configs)."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

#: Every built-in codec with parameter ranges that keep tests fast.
CODEC_PARAMS: dict[str, dict[str, st.SearchStrategy]] = {
    "none": {},
    "topk": {
        "ratio": st.sampled_from([0.001, 0.01, 0.1, 0.5, 1.0]),
        "k": st.integers(0, 50),
        "approx": st.booleans(),
        "trim": st.booleans(),
    },
    "randk": {"ratio": st.sampled_from([0.01, 0.1, 0.5]), "k": st.integers(0, 50),
              "scale": st.booleans()},
    "threshold": {"value": st.sampled_from([0.0, 0.1, 0.5, 2.0])},
    "quant": {"bits": st.integers(1, 8), "chunk": st.sampled_from([1, 7, 64, 128]),
              "rounding": st.sampled_from(["stochastic", "nearest"])},
    "qsgd": {"levels": st.integers(1, 127), "bucket": st.sampled_from([1, 16, 512])},
    "sign": {"chunk": st.sampled_from([0, 1, 5, 64])},
    "ternary": {"mode": st.sampled_from(["stochastic", "mean"]),
                "chunk": st.sampled_from([0, 3, 64])},
    "fp16": {},
    "bf16": {},
    "lowrank": {"rank": st.integers(1, 6), "iters": st.integers(1, 3)},
    "hadamard": {"block": st.sampled_from([1, 2, 8, 64, 4096])},
    "zstd": {"level": st.integers(1, 9)},
}


@st.composite
def codec_configs(draw, ids: list[str] | None = None) -> dict:
    """A config dict for one codec, with a random subset of its parameters set."""
    codec_id = draw(st.sampled_from(ids or sorted(CODEC_PARAMS)))
    config = {"id": codec_id}
    for key, values in CODEC_PARAMS[codec_id].items():
        if draw(st.booleans()):
            config[key] = draw(values)
    return config


@st.composite
def transform_then_bytes_specs(draw) -> list[dict]:
    """Configs of a valid pipeline: 1-3 transform stages, then an optional zstd."""
    transforms = [k for k in CODEC_PARAMS if k != "zstd"]
    stages = draw(st.lists(codec_configs(transforms), min_size=1, max_size=3))
    if draw(st.booleans()):
        stages.append(draw(codec_configs(["zstd"])))
    return stages


def float_arrays(max_side: int = 40, max_dims: int = 3, elements=None) -> st.SearchStrategy:
    """float32 arrays of 0-3 dims with finite, moderately sized values."""
    return hnp.arrays(
        dtype=np.float32,
        shape=hnp.array_shapes(min_dims=1, max_dims=max_dims, min_side=1, max_side=max_side),
        elements=(st.floats(-1e3, 1e3, width=32, allow_nan=False) if elements is None
                  else elements),
    )
