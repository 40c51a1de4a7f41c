"""Results files: columns, cumulative sums, summary figures."""

from __future__ import annotations

import csv
import json

import pytest

from fedcomp.ops.results import (
    ROUND_COLUMNS,
    RoundRecord,
    RunFolderBusy,
    RunRecorder,
    format_summary_table,
)


def test_rounds_csv_and_summary_json(tmp_path):
    recorder = RunRecorder(tmp_path / "run", {"codec": "sign"}, model_bytes=1000,
                           num_rounds=2, verbose=False)
    recorder.record(RoundRecord(1, accuracy=0.5, uplink_bytes=100, downlink_bytes=2000,
                                clients_ok=2, rejected=1, clients_sampled=3),
                    {"checksum": 1})
    recorder.record(RoundRecord(2, accuracy=0.7, uplink_bytes=50, downlink_bytes=500,
                                clients_ok=1, clients_sampled=2), {"checksum": 2, "stale": 1})
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
    # FedAvg would have sent the fp32 model to all five sampled nodes.
    assert summary["fp32_downlink_bytes"] == 5 * 1000
    assert summary["downlink_compression"] == 2.0
    assert summary["total_compression"] == (3000 + 5000) / (150 + 2500)
    assert summary["rejected_updates"] == 4
    assert summary["rejected_by_reason"] == {"checksum": 3, "stale": 1}
    assert "best_raw_accuracy" not in summary  # no server-average: no raw figures
    assert "wire" not in summary  # a simulation: nothing crossed a network
    machine = summary["machine"]
    assert machine["cores"] >= 1 and machine["cpu"] and machine["python"].count(".") == 2
    assert machine["flwr"] == "1.42.0" and machine["numpy"]
    table = format_summary_table([summary])
    header, row = table.splitlines()
    assert header.endswith("up x fp32  down x fp32  total x fp32")
    assert row.split()[-3:] == ["20.0", "2.0", f"{8000 / 2650:.1f}"]


def test_an_averaged_run_keeps_the_raw_models_accuracy_beside_it(tmp_path, capsys):
    recorder = RunRecorder(tmp_path / "run", {}, model_bytes=1000, num_rounds=3)
    recorder.record(RoundRecord(1, accuracy=0.6, raw_accuracy=0.65, clients_ok=1))
    recorder.record(RoundRecord(2, clients_ok=1))  # not evaluated
    recorder.record(RoundRecord(3, accuracy=0.8, raw_accuracy=0.7, clients_ok=1))
    summary = recorder.finish()
    assert summary["best_accuracy"] == 0.8 and summary["final_raw_accuracy"] == 0.7
    assert summary["best_raw_accuracy"] == 0.7
    with open(tmp_path / "run" / "rounds.csv") as handle:
        raw = [r["raw_accuracy"] for r in csv.DictReader(handle)]
    assert raw == ["0.65", "nan", "0.7"]
    out = capsys.readouterr().out
    assert "acc 0.6000 (raw 0.6500)" in out
    assert "[round   2/3] not evaluated | up" in out


def test_the_progress_line_shows_the_feedback_ratio_where_there_is_one(tmp_path, capsys):
    recorder = RunRecorder(tmp_path / "run", {}, model_bytes=1000, num_rounds=2)
    recorder.record(RoundRecord(1, clients_ok=1, feedback_ratio=15.72))
    recorder.record(RoundRecord(2, clients_ok=1))  # no error feedback
    recorder.finish()
    first, second = capsys.readouterr().out.splitlines()[:2]
    assert "down 0.0 kB | EF residual/update 15.7 | ok 1 " in first
    assert "EF residual" not in second and "down 0.0 kB | ok 1 " in second
    with open(tmp_path / "run" / "rounds.csv") as handle:
        assert [r["feedback_ratio"] for r in csv.DictReader(handle)] == ["15.72", "nan"]


def test_clients_csv_has_a_row_per_reply_and_survives_a_resume(tmp_path):
    from fedcomp.ops.results import CLIENT_COLUMNS

    recorder = RunRecorder(tmp_path / "run", {}, model_bytes=1000, num_rounds=3,
                           verbose=False)
    recorder.record(RoundRecord(1, clients_ok=2), None, {
        7: {"partition-id": 1.0, "payload-bytes": 90.0},
        5: {"partition-id": 0.0, "payload-bytes": 80.0, "state-from-file": 1.0}})
    state = recorder.state()
    resumed = RunRecorder(tmp_path / "run", {}, model_bytes=1000, num_rounds=3, verbose=False)
    resumed.restore(state)
    resumed.record(RoundRecord(2, clients_ok=1), None, {7: {"partition-id": 1.0}})
    with open(tmp_path / "run" / "clients.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert list(rows[0]) == CLIENT_COLUMNS
    # Sorted by partition within a round; the resumed run appended.
    assert [(r["round"], r["node_id"], r["payload-bytes"]) for r in rows] == [
        ("1", "5", "80.0"), ("1", "7", "90.0"), ("2", "7", "")]
    assert rows[0]["state-from-file"] == "1.0"
    with open(tmp_path / "run" / "rounds.csv") as handle:
        walls = [float(r["wall_s"]) for r in csv.DictReader(handle)]
    assert len(walls) == 2 and all(w >= 0 for w in walls)
    # A fresh run in the same folder starts clients.csv over.
    fresh = RunRecorder(tmp_path / "run", {}, model_bytes=1000, num_rounds=3, verbose=False)
    fresh.record(RoundRecord(1), None, {9: {"partition-id": 0.0}})
    with open(tmp_path / "run" / "clients.csv") as handle:
        assert [r["node_id"] for r in csv.DictReader(handle)] == ["9"]


def test_a_resume_forgets_client_rows_of_rounds_after_its_checkpoint(tmp_path):
    """A run that died after round 2 but checkpointed after round 1 replays round 2."""
    recorder = RunRecorder(tmp_path / "run", {}, model_bytes=1000, num_rounds=3,
                           verbose=False)
    recorder.record(RoundRecord(1, clients_ok=1), None, {5: {"partition-id": 0.0}})
    state = recorder.state()  # the checkpoint holds round 1 only
    recorder.record(RoundRecord(2, clients_ok=1), None, {6: {"partition-id": 1.0}})
    resumed = RunRecorder(tmp_path / "run", {}, model_bytes=1000, num_rounds=3, verbose=False)
    resumed.restore(state)
    resumed.record(RoundRecord(2, clients_ok=1), None, {8: {"partition-id": 1.0}})
    with open(tmp_path / "run" / "clients.csv") as handle:
        assert [(r["round"], r["node_id"]) for r in csv.DictReader(handle)] == [
            ("1", "5"), ("2", "8")]
    with open(tmp_path / "run" / "rounds.csv") as handle:
        assert [r["round"] for r in csv.DictReader(handle)] == ["1", "2"]


def test_a_deployed_runs_wire_bytes_are_summed_and_compared_per_node_and_round(tmp_path,
                                                                              capsys):
    recorder = RunRecorder(tmp_path / "run", {}, model_bytes=40_000, num_rounds=2)
    recorder.record(RoundRecord(1, clients_ok=2, uplink_bytes=800, wire_nodes=1,
                                wire_up_bytes=12_000, wire_down_bytes=8_000,
                                protocol_up_bytes=11_600, protocol_down_bytes=3_000))
    recorder.record(RoundRecord(2, clients_ok=2, uplink_bytes=800, wire_nodes=2,
                                wire_up_bytes=28_000, wire_down_bytes=12_000,
                                protocol_up_bytes=27_200, protocol_down_bytes=6_000))
    wire = recorder.finish()["wire"]
    assert wire["node_rounds"] == 3
    assert (wire["up_bytes"], wire["down_bytes"]) == (40_000, 20_000)
    assert (wire["protocol_up_bytes"], wire["protocol_down_bytes"]) == (38_800, 9_000)
    # Per node and round: 40 kB up and 20 kB down measured over three windows.
    assert wire["uplink_compression"] == 40_000 / (40_000 / 3)
    assert wire["total_compression"] == 80_000 / (60_000 / 3)
    with open(tmp_path / "run" / "rounds.csv") as handle:
        assert [r["wire_up_bytes"] for r in csv.DictReader(handle)] == ["12000", "28000"]
    assert "on the wire, per node and round (3 measured): up 13.3 kB" in capsys.readouterr().out


def test_a_second_process_cannot_write_a_run_folder_while_its_run_goes_on(tmp_path):
    """A run still writing its folder (a Flower run a stopped sweep left behind) is
    not overwritten by another run started there: that one stops, naming the
    writer's pid, before it truncates rounds.csv. Once the writer finishes (or dies:
    the kernel drops its lock) the folder is free again."""
    import subprocess
    import sys

    folder = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys\n"
         "from fedcomp.ops.results import RunRecorder\n"
         f"r = RunRecorder({str(folder)!r}, {{}}, model_bytes=1000, num_rounds=3, "
         "verbose=False)\n"
         "print('locked', flush=True)\n"
         "sys.stdin.readline()\n"
         "r.finish()\n"
         "print('finished', flush=True)\n"
         "sys.stdin.readline()\n"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        (folder / "rounds.csv").write_text("what the running run wrote\n")
        with pytest.raises(RunFolderBusy, match=f"pid {holder.pid}"):
            RunRecorder(folder, {}, model_bytes=1000, num_rounds=3, verbose=False)
        assert (folder / "rounds.csv").read_text() == "what the running run wrote\n"
        holder.stdin.write("\n")
        holder.stdin.flush()
        assert holder.stdout.readline().strip() == "finished"
        recorder = RunRecorder(folder, {}, model_bytes=1000, num_rounds=3, verbose=False)
        again = RunRecorder(folder, {}, model_bytes=1000, num_rounds=3, verbose=False)
        assert recorder.out_dir == again.out_dir  # one process may make it again
    finally:
        holder.kill()
        holder.wait()
