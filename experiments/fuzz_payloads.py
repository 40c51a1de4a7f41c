#!/usr/bin/env python
"""Fuzz the server's decode-and-validate path with hostile payloads; count by reason.

    python experiments/fuzz_payloads.py [--cases 100000] [--json results/fuzz.json]

Payloads are built for the digits CNN with several codecs and mutated at random
(bit flips, truncation, extension, splices, and structure-aware edits of the header
and body that keep the checksum valid: see ``fedcomp.codecs.fuzzing``). Each is decoded
as the server does, against the expected model. Every outcome must be an accepted
update or a ``PayloadError``; anything else is a bug and is counted as a crash. Peak
memory of one decode is tracked with tracemalloc.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np

from fedcomp.codecs.fuzzing import mutate
from fedcomp.codecs.policy import CompressionPolicy, encode_update
from fedcomp.codecs.wire import unpack_payload
from fedcomp.errors import PayloadError
from fedcomp.tasks.models import model_shapes

SPECS = ["topk:ratio=0.01|quant:bits=4", "topk:ratio=0.05|quant:bits=2|zstd:level=1",
         "randk:ratio=0.01|qsgd:levels=4", "sign", "lowrank:rank=2|fp16",
         "topk:ratio=0.001|ternary:mode=mean", "none|zstd",
         "topk:ratio=0.05|ternary:mode=mean"]
#: Specs whose update rows get very different scales (as a layer's update has), so
#: that Top-K codes the indices by rows.
ROW_SCALED = {"topk:ratio=0.05|ternary:mode=mean"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    shapes = model_shapes("digits")
    model_bytes = 4 * sum(int(np.prod(s)) for s in shapes.values())
    rng = np.random.default_rng(args.seed)
    bases = []
    for spec in SPECS:
        policy = CompressionPolicy(spec, min_numel=1024)
        tensors = {k: (0.01 * rng.standard_normal(s)).astype(np.float32)
                   for k, s in shapes.items()}
        if spec in ROW_SCALED:
            tensors = {k: t * np.logspace(0, 3, t.shape[0], dtype=np.float32).reshape(
                (-1,) + (1,) * (t.ndim - 1)) if t.ndim > 1 else t for k, t in tensors.items()}
        bases.append((policy.expected(shapes),
                      encode_update(tensors, policy, rng=rng, meta={"round": 1}).payload))
    reasons: collections.Counter = collections.Counter()
    by_mutation: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    crashes: collections.Counter = collections.Counter()
    peak = 0
    start = time.perf_counter()
    tracemalloc.start()
    for case in range(args.cases):
        expected, payload = bases[case % len(bases)]
        kind, hostile = mutate(payload, rng)
        tracemalloc.reset_peak()
        try:
            unpack_payload(hostile, expected=expected)
            outcome = "accepted"
        except PayloadError as exc:
            outcome = exc.reason
        except Exception as exc:
            outcome = "CRASH"
            crashes[f"{kind}: {type(exc).__name__}: {exc}"[:200]] += 1
        peak = max(peak, tracemalloc.get_traced_memory()[1])
        reasons[outcome] += 1
        by_mutation[kind][outcome] += 1
        if (case + 1) % 20_000 == 0:
            print(f"  {case + 1:,} payloads, {time.perf_counter() - start:.0f} s",
                  file=sys.stderr, flush=True)
    tracemalloc.stop()
    elapsed = time.perf_counter() - start

    print(f"{args.cases:,} hostile payloads in {elapsed:.1f} s "
          f"({args.cases / elapsed:,.0f}/s); model {model_bytes / 1e3:.0f} kB fp32; "
          f"peak decode memory {peak / 1e6:.1f} MB\n")
    print(f"{'outcome':14s} {'count':>8s} {'share':>7s}")
    for outcome, count in reasons.most_common():
        print(f"{outcome:14s} {count:8,d} {100 * count / args.cases:6.2f}%")
    print(f"\n{'mutation':14s} outcomes")
    for kind in sorted(by_mutation):
        top = ", ".join(f"{o} {c}" for o, c in by_mutation[kind].most_common(4))
        print(f"{kind:14s} {top}")
    print(f"\ncrashes (anything but PayloadError): {sum(crashes.values())}")
    for message, count in crashes.most_common(10):
        print(f"  {count} x {message}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "cases": args.cases, "seconds": elapsed, "peak_decode_bytes": peak,
            "model_bytes": model_bytes, "reasons": dict(reasons),
            "by_mutation": {k: dict(v) for k, v in by_mutation.items()},
            "crashes": dict(crashes)}, indent=1))
    return 1 if crashes else 0


if __name__ == "__main__":
    sys.exit(main())
