"""Results a user can trust: ``rounds.csv``, ``summary.json``, progress and a table.

Every byte figure is the length of payloads actually put into messages, summed where
they were produced or received, never a codec's formula. ``rounds.csv`` is appended
(and flushed) after every round, so a long run can be watched, or loaded from a
notebook (``pandas.read_csv``), while it runs.

One process writes a run's folder at a time: a recorder holds an advisory lock on
``.fedcomp.lock`` in it until :meth:`RunRecorder.finish`, so a second run started
into the same folder (a sweep re-run while a Flower run it lost track of still
writes there) stops with :class:`RunFolderBusy` before it truncates ``rounds.csv``.
"""

from __future__ import annotations

import csv
import importlib.metadata
import json
import math
import os
import platform
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from fedcomp.privacy.release import RELEASED_ROUND_COLUMNS, released_summary

__all__ = [
    "CLIENT_COLUMNS",
    "FP32_NOTE",
    "ROUND_COLUMNS",
    "TEXT_ROUND_COLUMNS",
    "RoundRecord",
    "RunFolderBusy",
    "RunRecorder",
    "format_summary_table",
    "format_wire_line",
    "record_densities",
    "record_downlink_densities",
    "record_feedback",
]

ROUND_COLUMNS = [
    "round", "accuracy", "loss", "uplink_bytes", "downlink_bytes", "cum_uplink_bytes",
    "cum_downlink_bytes", "clients_ok", "clients_failed", "rejected", "timed_out",
    "encode_s", "decode_s", "train_s", "epsilon", "dp_clip", "wall_s", "raw_accuracy",
    "clients_sampled", "wire_nodes", "wire_up_bytes", "wire_down_bytes", "protocol_up_bytes",
    "protocol_down_bytes", "uplink_density", "uplink_tensor_density", "uplink_value_bits",
    "downlink_density", "downlink_tensor_density", "downlink_value_bits",
    "uplink_tensor_sent", "downlink_tensor_sent", "feedback_ratio", "feedback_residual",
]

#: The columns of ``rounds.csv`` that hold text, not numbers.
TEXT_ROUND_COLUMNS = frozenset({"uplink_tensor_density", "downlink_tensor_density",
                                "uplink_tensor_sent", "downlink_tensor_sent"})

#: ``clients.csv``: one row per reply the server accepted for decoding, with what the
#: client reported about itself (bytes it sent and received, residual, the norm of a
#: lost update it gave back to its residual, where its state came from).
CLIENT_COLUMNS = [
    "round", "node_id", "partition-id", "num-examples", "payload-bytes", "downlink-bytes",
    "train-s", "encode-s", "residual-norm-in", "given-back-norm", "delta-norm",
    "replica-round", "state-from-file", "wire-up-bytes", "wire-down-bytes", "uplink-density",
    "uplink-value-bits",
]


@dataclass
class RoundRecord:
    """One row of ``rounds.csv``."""

    round: int
    accuracy: float = math.nan
    loss: float = math.nan
    uplink_bytes: int = 0
    downlink_bytes: int = 0
    cum_uplink_bytes: int = 0
    cum_downlink_bytes: int = 0
    clients_ok: int = 0
    clients_failed: int = 0
    rejected: int = 0
    timed_out: int = 0
    encode_s: float = 0.0
    decode_s: float = 0.0
    train_s: float = 0.0
    epsilon: float = 0.0
    dp_clip: float = 0.0  # the clipping norm C used this round (dp = "client")
    wall_s: float = 0.0  # seconds since the previous round ended (or the run started)
    #: server-average > 0: the accuracy of the server's own model (``accuracy`` is the
    #: averaged model's); NaN otherwise.
    raw_accuracy: float = math.nan
    #: Nodes sent a downlink message this round (FedAvg would send each the fp32 model).
    clients_sampled: int = 0
    #: Deployed runs: the nodes whose bytes on the wire this round are known (0 in a
    #: simulation), what they sent and received through TCP since their previous reply
    #: (:mod:`fedcomp.federated.wire_bytes`), and that less the payloads in it.
    wire_nodes: int = 0
    wire_up_bytes: int = 0
    wire_down_bytes: int = 0
    protocol_up_bytes: int = 0
    protocol_down_bytes: int = 0
    #: With ``uplink-budget``: the share of the budgeted tensors' entries the accepted
    #: clients sent (mean over clients), and each tensor's (``name=share;...``).
    uplink_density: float = math.nan
    uplink_tensor_density: str = ""
    #: With ``uplink-budget``: the bits a kept value cost under the value codings the
    #: budget chose (mean over the accepted clients, weighted by entries).
    uplink_value_bits: float = math.nan
    #: With ``downlink-budget``: the same for the compressed downlink payloads the
    #: server made for this round (per-client catch-ups, or the shared update the
    #: clients received).
    downlink_density: float = math.nan
    downlink_tensor_density: str = ""
    downlink_value_bits: float = math.nan
    #: With a budget: the share of the payloads that carried each tensor at all
    #: (``name=share;...``); a budget may leave a tensor out of a payload, so a tensor
    #: sent densely now and then and one sent thinly every time can have the same
    #: ``*_tensor_density``.
    uplink_tensor_sent: str = ""
    downlink_tensor_sent: str = ""
    #: With error feedback: how far the uplink lags behind what the clients learn.
    #: Each client's residual carried into the round (after any update given back)
    #: over the norm of its fresh update, the median over the replies read; NaN
    #: without error feedback or where clients do not report the two norms (under
    #: differential privacy). A ratio of r: the residual holds about r rounds of what
    #: a client now learns. It grows when the residual grows (the codec sends less than
    #: the clients learn) or when the fresh updates shrink as training converges and
    #: the residual drains more slowly; ``feedback_residual`` tells the two apart.
    feedback_ratio: float = math.nan
    #: With error feedback: the residual's norm itself, the median over the same
    #: replies as ``feedback_ratio``.
    feedback_residual: float = math.nan


def machine_facts() -> dict[str, Any]:
    """Where a run's numbers come from: the CPU (torch's kernels differ by CPU, which
    moves accuracy by tenths of a point), its cores, and the versions that shape
    results."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    versions = {}
    for package in ("fedcomp", "flwr", "torch", "numpy", "zstandard"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            **versions}


def _choice_summary(choices: Mapping[str, tuple[int, float]], numel: Mapping[str, int]
                    ) -> tuple[float, float]:
    """One payload's share of its budgeted entries sent, and bits a kept value."""
    entries = sum(k for k, _ in choices.values())
    share = entries / max(sum(numel[name] for name in choices), 1)
    return share, sum(k * b for k, b in choices.values()) / max(entries, 1)


def _tensor_density(kept: Sequence[Mapping[str, tuple[int, float]]],
                    numel: Mapping[str, int]) -> str:
    return ";".join(f"{name}={sum(c[name][0] for c in kept) / len(kept) / numel[name]:.6g}"
                    for name in numel)


def _tensor_sent(kept: Sequence[Mapping[str, tuple[int, float]]],
                 numel: Mapping[str, int]) -> str:
    return ";".join(f"{name}={sum(c[name][0] > 0 for c in kept) / len(kept):.6g}"
                    for name in numel)


def record_densities(kept: Mapping[int, Mapping[str, tuple[int, float]]],
                     expected: Mapping[str, Any], record: RoundRecord,
                     client_metrics: dict[int, dict[str, float]]) -> None:
    """What a byte budget chose this round, read from the decoded payloads' Top-K
    counts and value codings (``kept``, see
    :class:`fedcomp.federated.aggregation.AggregationResult`): each client's share of
    the budgeted entries and bits per kept value into its ``clients.csv`` row, their
    means, each tensor's mean share and the share of payloads that carried it into
    the round's row."""
    if not kept:
        return
    numel = {name: math.prod(expected[name].shape) for name in next(iter(kept.values()))}
    shares, bits = [], []
    for node, choices in kept.items():
        share, per_value = _choice_summary(choices, numel)
        shares.append(share)
        bits.append(per_value)
        if node in client_metrics:
            client_metrics[node]["uplink-density"] = share
            client_metrics[node]["uplink-value-bits"] = per_value
    record.uplink_density = float(sum(shares) / len(shares))
    record.uplink_value_bits = float(sum(bits) / len(bits))
    payloads = list(kept.values())
    record.uplink_tensor_density = _tensor_density(payloads, numel)
    record.uplink_tensor_sent = _tensor_sent(payloads, numel)


def record_feedback(record: RoundRecord,
                    client_metrics: Mapping[int, Mapping[str, float]]) -> None:
    """The round's ``feedback_ratio`` and ``feedback_residual``: over the clients that
    report both norms (``residual-norm-in``, ``delta-norm`` > 0), the median of the
    first over the second, and the median of the first. Medians, since one client
    that barely trained (a tiny fresh update) would swing a mean. Unchanged (NaN)
    when no client reports them."""
    norms = [(m["residual-norm-in"], m["delta-norm"]) for m in client_metrics.values()
             if "residual-norm-in" in m and m.get("delta-norm", 0.0) > 0]
    if norms:
        record.feedback_ratio = float(statistics.median(r / d for r, d in norms))
        record.feedback_residual = float(statistics.median(r for r, _ in norms))


def record_downlink_densities(kept: Sequence[Mapping[str, tuple[int, float]]],
                              shapes: Mapping[str, Sequence[int]],
                              record: RoundRecord) -> None:
    """What ``downlink-budget`` chose for the payloads the server made for this round
    (``kept`` as :meth:`fedcomp.federated.downlink.Downlink.take_kept` returns it):
    their mean share of the budgeted entries, bits a kept value, each tensor's mean
    share and the share of payloads that carried it, into the round's row. Nothing
    without a budgeted payload."""
    if not kept:
        return
    numel = {name: math.prod(shapes[name]) for name in kept[0]}
    summaries = [_choice_summary(choices, numel) for choices in kept]
    record.downlink_density = float(sum(s for s, _ in summaries) / len(summaries))
    record.downlink_value_bits = float(sum(b for _, b in summaries) / len(summaries))
    record.downlink_tensor_density = _tensor_density(kept, numel)
    record.downlink_tensor_sent = _tensor_sent(kept, numel)


class RunFolderBusy(RuntimeError):
    """Another live process is writing this run's results folder."""


#: The name of the lock file in a run's folder.
LOCK_FILE = ".fedcomp.lock"

#: Folders whose lock this process holds, and the open lock files that hold them:
#: a recorder made again in the same process (a resumed run, a test) shares it.
_HELD_LOCKS: dict[Path, Any] = {}


def _lock_folder(folder: Path) -> None:
    """Take the folder's lock for this process, or raise :class:`RunFolderBusy`
    naming the process that holds it. The lock is ``flock``'s: the kernel drops it
    when its holder exits, however it exits, so a crashed run never leaves a folder
    locked. Where ``fcntl`` is missing (Windows) folders are not guarded."""
    key = folder.resolve()
    if key in _HELD_LOCKS:
        return
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not on POSIX
        return
    handle = (folder / LOCK_FILE).open("a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.seek(0)
        owner = handle.read().strip() or "unknown"
        handle.close()
        raise RunFolderBusy(
            f"results folder {folder} is being written by another process (pid {owner}): "
            f"a run is still going there, e.g. a Flower run a stopped sweep left behind "
            f"(stop it, e.g. `kill {owner}`, or give this run another folder)") from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    _HELD_LOCKS[key] = handle


def _unlock_folder(folder: Path) -> None:
    """Give up the folder's lock (closing the file drops it; the file stays, empty of
    meaning: unlinking it could race a process that has just opened it)."""
    handle = _HELD_LOCKS.pop(folder.resolve(), None)
    if handle is not None:
        handle.close()


class RunRecorder:
    """Writes one run's results folder and prints progress.

    Parameters
    ----------
    out_dir
        ``results/<run-name>``; created if missing.
    config
        The run's full configuration (codec configs included) for ``summary.json``.
    model_bytes
        Bytes of the model in fp32, the yardstick of the compression factors.
    private
        A differentially private run: per-client rows are not written, and
        ``release/`` gets the rounds and summary that may be published
        (:mod:`fedcomp.privacy.release`).

    Raises
    ------
    RunFolderBusy
        If another live process holds ``out_dir``'s lock (it is writing a run there).
    """

    def __init__(self, out_dir: str | Path, config: dict[str, Any], *, model_bytes: int,
                 num_rounds: int, verbose: bool = True, private: bool = False) -> None:
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        _lock_folder(self.out_dir)  # before anything in the folder is rewritten
        self.config = config
        self.model_bytes = model_bytes
        self.num_rounds = num_rounds
        self.verbose = verbose
        self.private = private
        self.rows: list[RoundRecord] = []
        self.rejected_by_reason: dict[str, int] = {}
        self.replies_ok = 0
        self.messages_sent = 0
        self.extra: dict[str, Any] = {}
        self.started = time.perf_counter()
        self.initial_accuracy = math.nan
        self._csv_path = self.out_dir / "rounds.csv"
        self._clients_path = self.out_dir / "clients.csv"
        self._clients_fresh = True
        self._last_round_end = time.perf_counter()
        self._rewrite_csv()

    def _rewrite_csv(self) -> None:
        with self._csv_path.open("w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(ROUND_COLUMNS)
            for row in self.rows:
                values = asdict(row)
                writer.writerow([values[c] for c in ROUND_COLUMNS])
        if self.private:
            self._write_release()

    def _write_release(self) -> None:
        """``release/rounds.csv``: the columns a DP run may publish."""
        folder = self.out_dir / "release"
        folder.mkdir(exist_ok=True)
        with (folder / "rounds.csv").open("w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(RELEASED_ROUND_COLUMNS)
            for row in self.rows:
                values = asdict(row)
                writer.writerow([values[c] for c in RELEASED_ROUND_COLUMNS])

    def wire_summary(self) -> dict[str, Any] | None:
        """Bytes on the wire over the run (deployed runs whose nodes report them).

        Per node and round: the mean over the windows measured; the factors compare
        FedAvg's bare fp32 payload (its own wire cost would be higher still) with what
        a node really sent and received.
        """
        windows = sum(r.wire_nodes for r in self.rows)
        if not windows:
            return None
        up = sum(r.wire_up_bytes for r in self.rows)
        down = sum(r.wire_down_bytes for r in self.rows)
        per_up, per_down = up / windows, down / windows
        return {
            "node_rounds": windows,
            "up_bytes": up,
            "down_bytes": down,
            "protocol_up_bytes": sum(r.protocol_up_bytes for r in self.rows),
            "protocol_down_bytes": sum(r.protocol_down_bytes for r in self.rows),
            "up_per_node_round": per_up,
            "down_per_node_round": per_down,
            "uplink_compression": self.model_bytes / per_up if per_up else None,
            "downlink_compression": self.model_bytes / per_down if per_down else None,
            "total_compression": (2 * self.model_bytes / (per_up + per_down)
                                  if per_up + per_down else None),
        }

    def state(self) -> dict[str, Any]:
        """JSON-able progress, for checkpoints."""
        return {"rows": [asdict(r) for r in self.rows],
                "rejected_by_reason": self.rejected_by_reason,
                "replies_ok": self.replies_ok, "messages_sent": self.messages_sent,
                "initial_accuracy": self.initial_accuracy,
                "elapsed_s": time.perf_counter() - self.started}

    def restore(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state`: rows so far are kept, the clock goes on."""
        self.rows = [RoundRecord(**row) for row in state["rows"]]
        self.rejected_by_reason = dict(state["rejected_by_reason"])
        self.replies_ok = int(state["replies_ok"])
        self.messages_sent = int(state.get("messages_sent", 0))  # older checkpoints: none
        self.initial_accuracy = float(state["initial_accuracy"])
        self.started = time.perf_counter() - float(state["elapsed_s"])
        self._clients_fresh = False  # keep the rows of the rounds before the restart
        self._rewrite_csv()
        self._drop_client_rows_after(self.rows[-1].round if self.rows else 0)

    def _drop_client_rows_after(self, last_round: int) -> None:
        """Forget clients.csv rows of rounds the checkpoint does not hold.

        They were written by a run that died after them but before its next
        checkpoint (with ``checkpoint-every`` > 1, or between the two writes); the
        resumed run replays those rounds and writes their rows again.
        """
        if not self._clients_path.exists():
            return
        with self._clients_path.open(newline="") as handle:
            rows = list(csv.reader(handle))
        kept = rows[:1] + [r for r in rows[1:] if r and int(r[0]) <= last_round]
        if len(kept) != len(rows):
            with self._clients_path.open("w", newline="") as handle:
                csv.writer(handle).writerows(kept)

    def record(self, row: RoundRecord, rejected_by_reason: dict[str, int] | None = None,
               clients: dict[int, dict[str, float]] | None = None) -> None:
        """Append a finished round (cumulative columns and wall time are filled in here).

        ``clients`` maps node ids to the metrics each client reported; they go to
        ``clients.csv``.
        """
        now = time.perf_counter()
        row.wall_s, self._last_round_end = now - self._last_round_end, now
        if clients is not None and not self.private:
            self._record_clients(row.round, clients)
        previous = self.rows[-1] if self.rows else None
        row.cum_uplink_bytes = (previous.cum_uplink_bytes if previous else 0) + row.uplink_bytes
        row.cum_downlink_bytes = ((previous.cum_downlink_bytes if previous else 0)
                                  + row.downlink_bytes)
        self.rows.append(row)
        self.replies_ok += row.clients_ok
        self.messages_sent += row.clients_sampled
        for reason, count in (rejected_by_reason or {}).items():
            self.rejected_by_reason[reason] = self.rejected_by_reason.get(reason, 0) + count
        with self._csv_path.open("a", newline="") as handle:
            values = asdict(row)
            csv.writer(handle).writerow([values[c] for c in ROUND_COLUMNS])
        if self.private:
            self._write_release()
        if self.verbose:
            factor = (self.model_bytes * max(row.clients_ok, 1) / row.uplink_bytes
                      if row.uplink_bytes else math.nan)
            evaluated = (f"acc {row.accuracy:.4f} "
                         + (f"(raw {row.raw_accuracy:.4f}) " if math.isfinite(row.raw_accuracy)
                            else "")
                         + f"loss {row.loss:.4f}" if math.isfinite(row.accuracy)
                         else "not evaluated")
            print(
                f"[round {row.round:>3}/{self.num_rounds}] {evaluated} | "
                f"up {row.uplink_bytes / 1e3:,.1f} kB (x{factor:,.0f} "
                f"vs fp32) down {row.downlink_bytes / 1e3:,.1f} kB"
                + (f" | EF residual/update {row.feedback_ratio:.1f}"
                   if math.isfinite(row.feedback_ratio) else "")
                + f" | ok {row.clients_ok} "
                f"failed {row.clients_failed} rejected {row.rejected} late {row.timed_out} | "
                f"{time.perf_counter() - self.started:.1f} s",
                flush=True,
            )

    def _record_clients(self, server_round: int, clients: dict[int, dict[str, float]]) -> None:
        mode = "w" if self._clients_fresh or not self._clients_path.exists() else "a"
        with self._clients_path.open(mode, newline="") as handle:
            writer = csv.writer(handle)
            if mode == "w":
                writer.writerow(CLIENT_COLUMNS)
            for node, metrics in sorted(clients.items(),
                                        key=lambda item: item[1].get("partition-id", 0)):
                writer.writerow([server_round, node]
                                + [metrics.get(c, "") for c in CLIENT_COLUMNS[2:]])
        self._clients_fresh = False

    def summary(self) -> dict[str, Any]:
        accuracies = [r.accuracy for r in self.rows if not math.isnan(r.accuracy)]
        raw = [r.raw_accuracy for r in self.rows if not math.isnan(r.raw_accuracy)]
        last = self.rows[-1] if self.rows else RoundRecord(0)
        # FedAvg in the same rounds: the fp32 model up from every accepted reply and
        # down to every sampled node (headers left out, which favours FedAvg).
        fp32_uplink = self.model_bytes * self.replies_ok
        fp32_downlink = self.model_bytes * self.messages_sent
        total = last.cum_uplink_bytes + last.cum_downlink_bytes
        return {
            "run_name": self.out_dir.name,
            "config": self.config,
            "final_accuracy": accuracies[-1] if accuracies else None,
            "best_accuracy": max(accuracies) if accuracies else None,
            "initial_accuracy": None if math.isnan(self.initial_accuracy)
            else self.initial_accuracy,
            **({"final_raw_accuracy": raw[-1], "best_raw_accuracy": max(raw)} if raw else {}),
            "rounds_completed": len(self.rows),
            "uplink_bytes": last.cum_uplink_bytes,
            "downlink_bytes": last.cum_downlink_bytes,
            "fp32_uplink_bytes": fp32_uplink,
            "uplink_compression": (fp32_uplink / last.cum_uplink_bytes
                                   if last.cum_uplink_bytes else None),
            "fp32_downlink_bytes": fp32_downlink,
            "downlink_compression": (fp32_downlink / last.cum_downlink_bytes
                                     if last.cum_downlink_bytes else None),
            "total_compression": (fp32_uplink + fp32_downlink) / total if total else None,
            "model_bytes_fp32": self.model_bytes,
            "wall_s": time.perf_counter() - self.started,
            "rejected_updates": sum(self.rejected_by_reason.values()),
            "rejected_by_reason": self.rejected_by_reason,
            "encode_s": sum(r.encode_s for r in self.rows),
            "decode_s": sum(r.decode_s for r in self.rows),
            "train_s": sum(r.train_s for r in self.rows),
            **({"wire": wire} if (wire := self.wire_summary()) else {}),
            "machine": machine_facts(),
            **self.extra,
        }

    def finish(self) -> dict[str, Any]:
        """Write ``summary.json``, give up the folder's lock and print the summary
        table; return the summary."""
        summary = self.summary()
        (self.out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        if self.private:
            (self.out_dir / "release" / "summary.json").write_text(
                json.dumps(released_summary(summary), indent=2) + "\n")
        _unlock_folder(self.out_dir)
        if self.verbose:
            print(format_summary_table([summary]) + "\n" + FP32_NOTE, flush=True)
            if wire := summary.get("wire"):
                print(format_wire_line(wire), flush=True)
            print(f"results: {self.out_dir}", flush=True)
        return summary


#: What the table's factors compare with, and how to run it.
FP32_NOTE = ("x fp32: against FedAvg sending the fp32 model up and down in the same rounds;\n"
             "the FedAvg run itself: make run RUN_CONFIG=\"preset='fedavg'\"")


def format_wire_line(wire: dict[str, Any]) -> str:
    """One line of a deployed run's bytes on the wire (see :meth:`RunRecorder.wire_summary`)."""
    per = wire["node_rounds"]
    protocol_up, protocol_down = (wire["protocol_up_bytes"] / per / 1e3,
                                  wire["protocol_down_bytes"] / per / 1e3)
    return (f"on the wire, per node and round ({per} measured): up "
            f"{wire['up_per_node_round'] / 1e3:,.1f} kB ({protocol_up:,.1f} kB protocol), "
            f"down {wire['down_per_node_round'] / 1e3:,.1f} kB "
            f"({protocol_down:,.1f} kB protocol); x fp32 up "
            f"{wire['uplink_compression'] or math.nan:,.1f}, total "
            f"{wire['total_compression'] or math.nan:,.1f}")


def format_summary_table(summaries: list[dict[str, Any]]) -> str:
    """A plain-text table of runs: accuracy, MB up and down, compression vs fp32."""
    header = ["run", "codec", "rounds", "final acc", "best acc", "MB up", "MB down",
              "up x fp32", "down x fp32", "total x fp32"]
    rows = []
    for s in summaries:
        up, down = s["uplink_bytes"], s["downlink_bytes"]
        # Summaries written before the downlink count: FedAvg's downlink equals its uplink.
        fp32_down = s.get("fp32_downlink_bytes", s["fp32_uplink_bytes"])
        fp32_total = s["fp32_uplink_bytes"] + fp32_down
        rows.append([
            s["run_name"], s["config"].get("codec", ""), str(s["rounds_completed"]),
            f"{s['final_accuracy']:.4f}" if s["final_accuracy"] is not None else "-",
            f"{s['best_accuracy']:.4f}" if s["best_accuracy"] is not None else "-",
            f"{up / 1e6:.3f}", f"{down / 1e6:.3f}",
            f"{s['fp32_uplink_bytes'] / up:.1f}" if up else "-",
            f"{fp32_down / down:.1f}" if down else "-",
            f"{fp32_total / (up + down):.1f}" if up + down else "-",
        ])
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) if i < 2 else h.rjust(w)
                       for i, (h, w) in enumerate(zip(header, widths, strict=True)))]
    lines += ["  ".join(c.ljust(w) if i < 2 else c.rjust(w)
                        for i, (c, w) in enumerate(zip(r, widths, strict=True))) for r in rows]
    return "\n".join(lines)
