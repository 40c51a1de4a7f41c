#!/usr/bin/env python
"""Byte-budget benchmark: how fast the controller encodes, and how well it fits.

For each task's model and budget, a client's budgeted encodes over several rounds
with error feedback (:func:`fedcomp.codecs.policy.encode_within_budget`, with each
tensor's value coding chosen, as ``fedcomp-budget-auto``, and with one sign bit a
value, as ``fedcomp-budget``'s uplink): the payload's bytes against the budget, its
header's share, how many tensors a payload carries, the median encode and decode
time, and beside them the encode time of one fixed pipeline (Top-1% ternary on
every tensor) for scale. The
updates are synthetic: Laplace values (heavier-tailed than Gaussian, as training
deltas are) scaled by 1/sqrt(fan-in) per tensor, a fresh draw every round. They
exercise the allocation, the fit and the wire format; accuracy is measured by the
sweeps (experiments/RESULTS.md, "One byte budget").

    python experiments/bench_budget.py [--rounds 8] [--values ternary] [--json FILE]

Times are medians over the rounds after the first (which builds the layout
dictionary), on one thread. Nothing is asserted: a benchmark reports, tests decide.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import struct  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

from fedcomp.codecs.budget import VALUE_CHOICES, parse_budget  # noqa: E402
from fedcomp.codecs.feedback import ErrorFeedback  # noqa: E402
from fedcomp.codecs.policy import (  # noqa: E402
    WIRE_HEADERS,
    CompressionPolicy,
    encode_update,
    encode_within_budget,
    smallest_budget_bytes,
)
from fedcomp.codecs.wire import unpack_payload  # noqa: E402
from fedcomp.tasks.models import model_shapes  # noqa: E402

TASKS = ("fashion-mnist", "mnist1d")
BUDGETS = ("100x", "400x", "1000x")
FIXED_SPEC = "topk:ratio=0.01|ternary:mode=mean"
#: The payload prefix: magic, version, flags, check, header length, raw header length,
#: body length (see fedcomp.codecs.wire).
_PREFIX = struct.Struct("<4sBBHIII")


def synthetic_update(shapes: dict[str, tuple[int, ...]], rng: np.random.Generator
                     ) -> dict[str, np.ndarray]:
    """Laplace values scaled by 1/sqrt(fan-in), one tensor per name."""
    out = {}
    for name, shape in shapes.items():
        fan_in = math.prod(shape[1:]) if len(shape) > 1 else 1
        out[name] = (rng.laplace(size=shape) / math.sqrt(fan_in)).astype(np.float32)
    return out


def bench(task: str, text: str, rounds: int, values: str = "auto",
          wire_header: str = "json") -> dict[str, Any]:
    """One row; ``values``: ``"auto"`` (each tensor's value coding chosen, as
    ``budget-values = "auto"``) or ``"ternary"`` (one sign bit and a scale, as preset
    fedcomp-budget's uplink); ``wire_header``: as the run config's ``wire-header``."""
    shapes = model_shapes(task)
    numel = sum(math.prod(s) for s in shapes.values())
    policy = CompressionPolicy(FIXED_SPEC, budgeted=True,
                               budget_values=VALUE_CHOICES if values == "auto" else (),
                               wire_header=wire_header)
    fixed = CompressionPolicy(FIXED_SPEC, min_numel=0)
    budget = parse_budget(text).payload_bytes(numel)
    row: dict[str, Any] = {"task": task, "budget": text, "values": values,
                           "wire_header": wire_header, "parameters": numel,
                           "tensors": len(shapes), "budget_bytes": budget}
    smallest = smallest_budget_bytes(policy, shapes)
    if budget < smallest:  # a run refuses it before round 1 (RunConfig.check_budgets)
        return {**row, "refused": True, "smallest_budget_bytes": smallest,
                "largest_factor": int(4 * numel / smallest)}
    expected = policy.expected(shapes)
    memory = ErrorFeedback(policy.description)
    rng = np.random.default_rng(0)
    sizes, headers, sent, encode_s, decode_s, fixed_s = [], [], [], [], [], []
    for r in range(rounds):
        update = synthetic_update(shapes, rng)
        start = time.perf_counter()
        encoded = encode_within_budget(update, policy, budget, rng=rng, feedback=memory,
                                       meta={"round": r})
        encode_time = time.perf_counter() - start
        start = time.perf_counter()
        unpack_payload(encoded.payload, expected=expected)
        decode_time = time.perf_counter() - start
        start = time.perf_counter()
        encode_update(update, fixed, rng=rng, meta={"round": r})
        fixed_time = time.perf_counter() - start
        header_len = _PREFIX.unpack(encoded.payload[:_PREFIX.size])[4]
        sizes.append(encoded.nbytes)
        headers.append(_PREFIX.size + header_len + 4)
        sent.append(sum(c.count > 0 for c in encoded.choices.values()))
        if r:  # the first round builds the layout dictionaries
            encode_s.append(encode_time)
            decode_s.append(decode_time)
            fixed_s.append(fixed_time)
    return {
        **row, "refused": False, "payload_bytes": statistics.mean(sizes),
        "spent": statistics.mean(sizes) / budget, "max_spent": max(sizes) / budget,
        "framing_and_header_bytes": statistics.mean(headers),
        "tensors_sent": statistics.mean(sent),
        "encode_s": statistics.median(encode_s), "decode_s": statistics.median(decode_s),
        "fixed_encode_s": statistics.median(fixed_s),
    }


def print_table(rows: list[dict[str, Any]]) -> None:
    titles = ["task", "budget", "values", "header", "budget B", "payload B", "spent", "max",
              "header B", "tensors sent", "enc ms", "dec ms", f"enc ms, {FIXED_SPEC} everywhere"]
    measured = [r for r in rows if not r["refused"]]
    cells = [[r["task"], r["budget"], r["values"], r["wire_header"],
              f"{r['budget_bytes']:,}",
              f"{r['payload_bytes']:,.0f}",
              f"{100 * r['spent']:.1f}%", f"{100 * r['max_spent']:.1f}%",
              f"{r['framing_and_header_bytes']:.0f}",
              f"{r['tensors_sent']:.1f} / {r['tensors']}", f"{1000 * r['encode_s']:.1f}",
              f"{1000 * r['decode_s']:.1f}", f"{1000 * r['fixed_encode_s']:.1f}"]
             for r in measured]
    widths = [max([len(t), *(len(c[i]) for c in cells)]) for i, t in enumerate(titles)]
    print("  ".join(t.ljust(w) if i < 4 else t.rjust(w)
                    for i, (t, w) in enumerate(zip(titles, widths, strict=True))))
    for row in cells:
        print("  ".join(c.ljust(w) if i < 4 else c.rjust(w)
                        for i, (c, w) in enumerate(zip(row, widths, strict=True))))
    for r in rows:
        if r["refused"]:  # as a run would refuse it, before round 1
            print(f"{r['task']} {r['budget']}, {r['values']} values, {r['wire_header']} header "
                  f"({r['budget_bytes']:,} B): "
                  f"refused, below the smallest budget of this model, "
                  f"{r['smallest_budget_bytes']:,} B ({r['largest_factor']}x)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=8, help="encodes per row (>= 2)")
    parser.add_argument("--task", action="append", choices=TASKS, help="default: both")
    parser.add_argument("--budget", action="append", help=f"default: {', '.join(BUDGETS)}")
    parser.add_argument("--values", action="append", choices=("auto", "ternary"),
                        help="value codings: each tensor's chosen (auto, as "
                             "fedcomp-budget-auto) or one sign bit (ternary, as "
                             "fedcomp-budget's uplink); default: both")
    parser.add_argument("--wire-header", action="append", choices=WIRE_HEADERS,
                        help="header forms, as the run config's wire-header; default: both")
    parser.add_argument("--json", type=Path, help="write the rows as a JSON list here")
    args = parser.parse_args(argv)
    if args.rounds < 2:
        parser.error(f"--rounds must be at least 2, got {args.rounds}")
    rows = []
    for task in args.task or TASKS:
        for text in args.budget or BUDGETS:
            for values in args.values or ("auto", "ternary"):
                for form in args.wire_header or WIRE_HEADERS:
                    print(f"  {task} {text} {values} {form} ...", file=sys.stderr, flush=True)
                    rows.append(bench(task, text, args.rounds, values, form))
                    if args.json:  # after every row: an interrupted run keeps its rows
                        args.json.parent.mkdir(parents=True, exist_ok=True)
                        args.json.write_text(json.dumps(rows, indent=1))
    print_table(rows)
    if args.json:
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
