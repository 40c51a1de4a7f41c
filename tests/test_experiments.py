"""Experiment scripts run end to end on small inputs and write what they promise."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "experiments" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_codec_benchmark_writes_one_row_per_spec_with_the_documented_keys(tmp_path, capsys):
    bench = _load("bench_codecs")
    out = tmp_path / "rows.json"
    assert bench.main(["--quick", "--no-cnn", "--repeats", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    keys = {"spec", "n", "bytes", "bits_per_param", "ratio_vs_fp32", "bits_per_index",
            "encode_s", "decode_s", "rel_l2_error"}
    assert all(keys <= set(row) for row in rows)
    specs = [row["spec"] for row in rows]
    assert {"none", "zstd:level=1", "fp16", "baseline:torch.topk"} <= set(specs)
    by_spec = {row["spec"]: row for row in rows}
    # Sizes are the real payload lengths: fp32 costs 4 bytes per value plus framing.
    assert by_spec["none"]["bytes"] > 4 * by_spec["none"]["n"]
    assert by_spec["none"]["rel_l2_error"] == 0.0
    assert by_spec["fp16"]["bits_per_index"] is None
    assert 8.0 < by_spec["topk:ratio=0.01"]["bits_per_index"] < 9.0
    assert "Targets for" in capsys.readouterr().out


def test_support_overlap_measures_shares_of_the_compressed_energy(capsys):
    overlap = _load("support_overlap")
    own, own_double, on_support, support_plus = overlap.main(
        ["--dataset", "digits", "--rounds", "4", "--skip", "1", "--clients", "5",
         "--per-round", "3"])
    assert 0.0 < on_support < 1.0 and 0.0 < own < own_double <= 1.0
    # S plus a third of the client's own Top-K can only add to S alone.
    assert support_plus > on_support
    assert "own top-0.3%" in capsys.readouterr().out
