"""Results files: columns, cumulative sums, summary figures."""

from __future__ import annotations

import csv
import json

from fedcomp.results import ROUND_COLUMNS, RoundRecord, RunRecorder, format_summary_table


def test_rounds_csv_and_summary_json(tmp_path):
    recorder = RunRecorder(tmp_path / "run", {"codec": "sign"}, model_bytes=1000,
                           num_rounds=2, verbose=False)
    recorder.record(RoundRecord(1, accuracy=0.5, uplink_bytes=100, downlink_bytes=2000,
                                clients_ok=2, rejected=1), {"checksum": 1})
    recorder.record(RoundRecord(2, accuracy=0.7, uplink_bytes=50, downlink_bytes=500,
                                clients_ok=1), {"checksum": 2, "stale": 1})
    summary = recorder.finish()
    with open(tmp_path / "run" / "rounds.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert list(rows[0]) == ROUND_COLUMNS
    assert [int(r["cum_uplink_bytes"]) for r in rows] == [100, 150]
    assert [int(r["cum_downlink_bytes"]) for r in rows] == [2000, 2500]
    on_disk = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert on_disk == json.loads(json.dumps(summary))
    assert summary["final_accuracy"] == 0.7 and summary["best_accuracy"] == 0.7
    assert summary["uplink_bytes"] == 150 and summary["downlink_bytes"] == 2500
    assert summary["fp32_uplink_bytes"] == 3 * 1000  # three accepted replies
    assert summary["uplink_compression"] == 20.0
    assert summary["rejected_updates"] == 4
    assert summary["rejected_by_reason"] == {"checksum": 3, "stale": 1}
    table = format_summary_table([summary])
    assert "run" in table.splitlines()[0] and "20.0" in table
