#!/usr/bin/env python
"""Codec benchmark: bytes, bits per parameter and index, speed and error of every stage.

Every number comes from this run on this machine: bytes are the length of the real
payload (framing and header included), times are medians of several runs after a
warm-up, on one thread. Inputs: a Gaussian vector (10M elements; 1M with ``--quick``)
and the real delta of the digits CNN (151k parameters) after one epoch of local
training, flattened into one tensor.

    python experiments/bench_codecs.py [--quick] [--json results/bench_codecs.json]

The table ends with the codec library's targets (Top-1% + 4-bit + coded indices:
ratio >= 200, encode <= 1/3 of torch.topk, decode <= 20 ms; <= 9.0 bits per index),
each judged from numbers measured in this run. Nothing is asserted: a benchmark
reports, tests decide.
"""

from __future__ import annotations

import os

# One thread everywhere (numpy's BLAS for low-rank, torch for the baseline), set
# before numpy and torch load their thread pools.
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

from fedcomp.codecs.base import Encoded  # noqa: E402
from fedcomp.codecs.pipeline import Pipeline  # noqa: E402
from fedcomp.codecs.wire import EncodedTensor, ExpectedTensor, pack_payload, unpack_payload  # noqa: E402

TARGET_SPEC = "topk:ratio=0.01|quant:bits=4"
SPECS = [
    "none",
    "zstd:level=1",
    "fp16",
    "bf16",
    "quant:bits=8",
    "quant:bits=4",
    "quant:bits=4,rounding=nearest",
    "qsgd:levels=4",
    "sign",
    "ternary",
    "lowrank:rank=4",
    "topk:ratio=0.01",
    "topk:ratio=0.01,approx=true",
    "topk:ratio=0.01,approx=true,trim=true",
    "randk:ratio=0.01",
    "threshold:value={t99}",
    TARGET_SPEC,
    TARGET_SPEC + "|zstd:level=1",
    "topk:ratio=0.01|quant:bits=8",
    "topk:ratio=0.001|ternary:mode=mean",
    "lowrank:rank=4|fp16",
    # A random Hadamard rotation before 1-2 bit quantization (DRIVE/EDEN style).
    "quant:bits=2",
    "hadamard|quant:bits=2",
    "quant:bits=1",
    "hadamard|quant:bits=1",
    "hadamard|sign",
]


def _median_time(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    result = fn()  # warm-up (page faults, caches, lazy imports)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def _index_bits(node: Encoded | np.ndarray, under_index: bool = False) -> int:
    if isinstance(node, np.ndarray):
        return 8 * node.nbytes if under_index else 0
    return sum(_index_bits(part, under_index or name.startswith("ix_"))
               for name, part in node.parts.items())


def bench_spec(name: str, spec: str, x: np.ndarray, repeats: int) -> dict[str, Any]:
    pipeline = Pipeline.parse(spec)
    expected = {"x": ExpectedTensor(x.shape, pipeline)}
    seeds = iter(range(10**6))

    def encode() -> tuple[Encoded, bytes]:
        root = pipeline.encode(x, rng=np.random.default_rng(next(seeds)))
        return root, pack_payload([EncodedTensor("x", x.shape, pipeline, root)])

    encode_s, (root, payload) = _median_time(encode, repeats)
    decode_s, decoded = _median_time(lambda: unpack_payload(payload, expected=expected),
                                     repeats)
    out = decoded.tensors["x"]
    n = x.size
    count = root.meta.get("count") if pipeline.sparse else None
    return {
        "input": name,
        "spec": pipeline.spec,
        "n": n,
        "bytes": len(payload),
        "bits_per_param": 8 * len(payload) / n,
        "ratio_vs_fp32": 4 * n / len(payload),
        "bits_per_index": (_index_bits(root) / count) if count else None,
        "encode_s": encode_s,
        "decode_s": decode_s,
        "rel_l2_error": float(np.linalg.norm(out - x) / max(np.linalg.norm(x), 1e-30)),
    }


def bench_torch_topk(name: str, x: np.ndarray, repeats: int) -> dict[str, Any]:
    tx = torch.from_numpy(x)
    k = max(1, round(0.01 * x.size))
    encode_s, _ = _median_time(lambda: torch.topk(tx.abs(), k, sorted=False), repeats)
    return {"input": name, "spec": "baseline:torch.topk", "n": x.size, "bytes": None,
            "bits_per_param": None, "ratio_vs_fp32": None, "bits_per_index": None,
            "encode_s": encode_s, "decode_s": None, "rel_l2_error": None}


def cnn_delta(seed: int = 0) -> np.ndarray:
    """The digits CNN's parameter change after one epoch of local SGD."""
    from fedcomp.tasks.data import load_digits
    from fedcomp.tasks.models import build_model
    from fedcomp.tasks.training import flat_delta, state_arrays, train

    data = load_digits()
    model = build_model("digits", seed=seed)
    before = state_arrays(model)
    train(model, data.x, data.y, epochs=1, seed=seed)
    return flat_delta(state_arrays(model), before)


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if value >= 1000:
            return f"{value:,.0f}"
        return f"{value:.{digits}g}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def print_table(rows: list[dict[str, Any]]) -> None:
    columns = [("input", "input"), ("spec", "spec"), ("bytes", "bytes"),
               ("bits_per_param", "bits/param"), ("ratio_vs_fp32", "x fp32"),
               ("bits_per_index", "bits/idx"), ("encode_s", "enc ms"), ("decode_s", "dec ms"),
               ("rel_l2_error", "rel err")]
    table = []
    for row in rows:
        cells = []
        for key, _ in columns:
            value = row[key]
            if key in ("encode_s", "decode_s") and value is not None:
                value = value * 1000
            cells.append(_fmt(value))
        table.append(cells)
    widths = [max(len(title), *(len(r[i]) for r in table)) for i, (_, title) in enumerate(columns)]
    print("  ".join(title.ljust(w) if i < 2 else title.rjust(w)
                    for i, ((_, title), w) in enumerate(zip(columns, widths, strict=True))))
    for cells in table:
        print("  ".join(c.ljust(w) if i < 2 else c.rjust(w)
                        for i, (c, w) in enumerate(zip(cells, widths, strict=True))))


def print_targets(rows: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    by_spec = {r["spec"]: r for r in rows if r["input"] == name}
    target, topk = by_spec[TARGET_SPEC], by_spec["baseline:torch.topk"]
    plain = by_spec["topk:ratio=0.01"]
    checks = [
        ("ratio_vs_fp32 >= 200", target["ratio_vs_fp32"], target["ratio_vs_fp32"] >= 200),
        ("encode_s <= torch.topk / 3",
         f"{target['encode_s'] * 1000:.1f} ms vs {topk['encode_s'] * 1000:.1f} ms "
         f"({topk['encode_s'] / target['encode_s']:.1f}x faster)",
         target["encode_s"] <= topk["encode_s"] / 3),
        ("decode_s <= 20 ms", f"{target['decode_s'] * 1000:.1f} ms",
         target["decode_s"] <= 0.020),
        ("bits_per_index <= 9.0 (Top-1%)", f"{plain['bits_per_index']:.2f}",
         plain["bits_per_index"] <= 9.0),
    ]
    print(f"\nTargets for {TARGET_SPEC} on {name} (n = {target['n']:,}, one thread):")
    results = []
    for label, value, ok in checks:
        print(f"  {'PASS' if ok else 'FAIL'}  {label:34s} {_fmt(value)}")
        results.append({"target": label, "value": value, "pass": bool(ok)})
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1M elements, fewer repeats")
    parser.add_argument("--json", type=Path, help="write the rows as a JSON list here")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--no-cnn", action="store_true", help="skip the CNN delta input")
    parser.add_argument("--spec", action="append", default=[], metavar="SPEC",
                        help="benchmark only this spec (repeatable; default: every spec)")
    args = parser.parse_args(argv)

    torch.set_num_threads(1)
    n = 1_000_000 if args.quick else 10_000_000
    repeats = args.repeats or (3 if args.quick else 5)
    gaussian_name = f"gaussian-{n // 1_000_000}M"
    inputs = {gaussian_name: np.random.default_rng(0).standard_normal(n).astype(np.float32)}
    if not args.no_cnn:
        inputs["cnn-digits-delta"] = cnn_delta()
    print(f"fedcomp codec benchmark: {platform.processor() or platform.machine()}, "
          f"Python {platform.python_version()}, numpy {np.__version__}, torch "
          f"{torch.__version__}, {repeats} repeats, one thread\n", flush=True)

    rows = []
    for name, x in inputs.items():
        t99 = f"{float(np.quantile(np.abs(x), 0.99)):.3g}"
        for spec in args.spec or SPECS:
            rows.append(bench_spec(name, spec.format(t99=t99), x, repeats))
            print(f"  {name:18s} {rows[-1]['spec']:45s} done", file=sys.stderr, flush=True)
        rows.append(bench_torch_topk(name, x, repeats))
    print_table(rows)
    if not args.spec:  # the targets need the Top-K rows
        print_targets(rows, gaussian_name)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1, default=float) + "\n")
        print(f"\nwrote {len(rows)} rows to {args.json}")
    return 0 if all(math.isfinite(r["encode_s"]) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
