"""Sweep reports: accuracy against bytes, and how many bytes each method needs.

``fedcomp report DIR`` reads a sweep's ``runs.csv`` and every run's ``rounds.csv``. It
groups runs into *methods* (all grid values but the seed), and writes:

* ``accuracy_vs_uplink.png``: accuracy against cumulative uplink MB (log axis),
  the picture this field judges compression methods by;
* ``accuracy_vs_round.png``;
* ``budget_choices.png`` where runs had a byte budget: each tensor's share of
  entries sent, round by round, per budgeted method and direction;
* ``feedback_ratio.png`` where runs had error feedback: the residual a client
  carries into a round over its fresh update, round by round (and a table of it);
* ``report.md`` and a printed table: for a target accuracy (by default the best
  accuracy of the plain FedAvg runs minus one point), the cumulative uplink and
  total bytes at the first round each method reaches it, and the factor against
  plain FedAvg. Means and spread (min-max) over seeds. More targets can be added
  (``--extra-target``): the headline tables of ``experiments/RESULTS.md`` come from it;
* a whole-run table: final and best accuracy, and bytes per round, uplink and total,
  with their factor against plain FedAvg (the per-round compression, which a
  bytes-to-target factor divides by the ratio of rounds each method needed), or
  against the fp32 model in the same rounds where the runs hold no FedAvg run;
* with ``--at-round``, accuracy at chosen rounds (mean over seeds): how short pilots
  are compared, where no method has reached a target yet.

*Plain FedAvg* means ``codec = "none"`` with the FedAvg server rule (``sgd`` at
``server-lr = 1``). An uncompressed run with another server optimizer (FedAdam as a
reference, say) is a method like any other: it neither sets the target nor serves as
the reference, so the baseline stays what the field compares against. Where a sweep
holds several plain FedAvg methods (one with more local epochs, say), ``--reference``
names the one the target and the factors come from. Any method can be the reference
(FedAvg with the same server averaging: the strongest fp32 baseline that costs no
extra bytes); the bytes-to-target table then shows the factors against plain FedAvg
beside those against the reference. ``--reference strongest-fp32`` takes the fp32
method with the highest mean best accuracy, whatever its server rule, averaging or
local epochs.
"""

from __future__ import annotations

import csv
import json
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedcomp.config import RunConfig
from fedcomp.ops.results import TEXT_ROUND_COLUMNS

__all__ = [
    "MethodResult",
    "RunResult",
    "build_report",
    "bytes_to_target",
    "current_encoder",
    "encoder_note",
    "encoder_of",
    "feedback_series",
    "format_accuracy_at_rounds",
    "format_feedback",
    "format_paired_table",
    "format_whole_runs",
    "format_wire",
    "is_plain_fedavg",
    "load_runs",
    "plot_feedback",
    "plot_runs",
    "reference_method",
    "write_report",
]


@dataclass
class RunResult:
    run_id: str
    values: dict[str, Any]
    rounds: list[dict[str, float | str]]
    summary: dict[str, Any]

    @property
    def method(self) -> str:
        parts = [str(v) if k == "method" else f"{k}={v}"
                 for k, v in self.values.items() if k != "seed"]
        return ", ".join(parts) or "base"


@dataclass
class MethodResult:
    method: str
    runs: list[RunResult]
    best_accuracy: list[float] = field(default_factory=list)
    uplink_to_target: list[float | None] = field(default_factory=list)
    total_to_target: list[float | None] = field(default_factory=list)
    round_to_target: list[int | None] = field(default_factory=list)


def _number(text: str) -> float:
    return float(text) if text not in ("", "nan") else math.nan


def _cell(key: str, text: str) -> float | str:
    """A rounds.csv cell: a number, or the text of a column that holds text."""
    return text if key in TEXT_ROUND_COLUMNS else _number(text)


def load_runs(out_dir: str | Path) -> list[RunResult]:
    """Completed runs of a sweep folder, in runs.csv order; or, in a folder that is no
    sweep, the run it is or the runs it holds (each its own method, by folder name)."""
    out = Path(out_dir)
    if not (out / "runs.csv").exists():
        return _loose_runs(out)
    with (out / "runs.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    columns = json.loads((out / "sweep.json").read_text())["columns"]
    results = []
    for row in rows:
        if row["status"] != "complete":
            continue
        run = _load_run(out / row["run_id"])
        run.values = {k: row[k] if k == "method" else run.summary["config"].get(k, row.get(k))
                      for k in columns}
        results.append(run)
    return results


def _load_run(run_dir: Path) -> RunResult:
    with (run_dir / "rounds.csv").open() as handle:
        rounds = [{k: _cell(k, v) for k, v in r.items()} for r in csv.DictReader(handle)]
    summary = json.loads((run_dir / "summary.json").read_text())
    return RunResult(run_dir.name, {"method": run_dir.name}, rounds, summary)


def _loose_runs(out: Path) -> list[RunResult]:
    """Runs outside a sweep (``fedcomp simulate``, ``fedcomp deploy run``): a finished
    run's folder, or a folder of them (``results/``)."""
    if (out / "summary.json").exists():
        return [_load_run(out)]
    runs = [_load_run(d) for d in sorted(out.iterdir())
            if (d / "summary.json").exists() and (d / "rounds.csv").exists()]
    if not runs:
        raise ValueError(f"{out} holds no sweep (runs.csv) and no finished run "
                         "(summary.json)")
    return runs


def bytes_to_target(rounds: list[dict[str, float]], target: float
                    ) -> tuple[int, float, float] | None:
    """(round, cumulative uplink, cumulative total bytes) when accuracy first >= target."""
    for row in rounds:
        if row["accuracy"] >= target:
            return (int(row["round"]), row["cum_uplink_bytes"],
                    row["cum_uplink_bytes"] + row["cum_downlink_bytes"])
    return None


def is_plain_fedavg(config: dict[str, Any]) -> bool:
    """Whether a run's config is plain FedAvg: no codec, the averaging server rule, and
    the server's own model evaluated (no ``server-average``).

    Configs written before these settings existed lack their keys; they were FedAvg.
    """
    return (config.get("codec") == "none"
            and config.get("server-optimizer", "sgd") == "sgd"
            and float(config.get("server-lr", 1.0)) == 1.0
            and float(config.get("server-average", 0.0)) == 0.0)


#: The ``--reference`` that picks the strongest fp32 baseline of the sweep
#: (:func:`is_fp32_baseline`) rather than naming one.
STRONGEST_FP32 = "strongest-fp32"


def is_fp32_baseline(config: dict[str, Any]) -> bool:
    """Whether a run sends every update and every model in fp32, with no privacy noise:
    a baseline that costs no extra bytes over plain FedAvg, whatever its server rule,
    averaging or local epochs.

    Configs written before a setting existed lack its key; they did not use it.
    """
    return (config.get("codec") == "none"
            and config.get("small-codec", "none") == "none"
            and not config.get("codec-overrides", "")
            and not config.get("uplink-budget", "")
            and config.get("downlink-codec", "none") == "none"
            and not config.get("downlink-codec-overrides", "")
            and not config.get("downlink-budget", "")
            and config.get("dp", "none") == "none")


def reference_method(methods: list[MethodResult], name: str | None = None
                     ) -> MethodResult | None:
    """The method others are compared with: ``name``, or the one plain FedAvg method.

    A sweep may hold several plain FedAvg methods (with more local epochs, say); then
    the reference must be named, since the target and every factor depend on it.
    :data:`STRONGEST_FP32` (where no method has that name) picks the fp32 baseline
    (:func:`is_fp32_baseline`) with the highest mean best accuracy, the first in the
    sweep's order among equals: the strongest baseline that costs no extra bytes
    among those the sweep ran, so that the reference is a rule, not a choice made
    after seeing the factors.
    """
    if name is not None:
        for method in methods:
            if method.method == name:
                return method
        if name == STRONGEST_FP32:
            baselines = [m for m in methods if is_fp32_baseline(m.runs[0].summary["config"])]
            if not baselines:
                raise ValueError("no fp32 baseline in this sweep (codec and downlink codec "
                                 "\"none\", no budget, no override, no DP) to take as the "
                                 "strongest")
            return max(baselines, key=lambda m: statistics.mean(m.best_accuracy))
        raise ValueError(f"reference method {name!r} is not in this sweep; its methods: "
                         + ", ".join(repr(m.method) for m in methods))
    plain = [m for m in methods if is_plain_fedavg(m.runs[0].summary["config"])]
    if len(plain) > 1:
        raise ValueError("several plain FedAvg methods ("
                         + ", ".join(repr(m.method) for m in plain)
                         + "): name the reference (--reference)")
    return plain[0] if plain else None


def build_report(runs: list[RunResult], target: float | None = None,
                 reference: str | None = None) -> tuple[float, list[MethodResult]]:
    """Group runs into methods and compute bytes-to-target; return (target, methods).

    The default target is the reference method's mean best accuracy minus one point
    (see :func:`reference_method`).
    """
    methods: dict[str, MethodResult] = {}
    for run in runs:
        method = methods.setdefault(run.method, MethodResult(run.method, []))
        method.runs.append(run)
        method.best_accuracy.append(run.summary["best_accuracy"])
    baseline = reference_method(list(methods.values()), reference)
    if target is None:
        if baseline is None:
            raise ValueError("no plain FedAvg run (codec = \"none\", server-optimizer = "
                             "\"sgd\", server-lr = 1, server-average = 0) to take the target "
                             "from: pass --target")
        # Rounded: 0.8985 - 0.01 is 0.8885000000000001 in floats, and a run that
        # scores the printed target, 0.8885, must count as reaching it.
        target = round(statistics.mean(baseline.best_accuracy) - 0.01, 10)
    for method in methods.values():
        for run in method.runs:
            reached = bytes_to_target(run.rounds, target)
            method.round_to_target.append(reached[0] if reached else None)
            method.uplink_to_target.append(reached[1] if reached else None)
            method.total_to_target.append(reached[2] if reached else None)
    return target, list(methods.values())


def _mean(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.mean(present) if present and len(present) == len(values) else None


def _spread(values: list[float | None]) -> str:
    present = [v for v in values if v is not None]
    if len(present) < 2:
        return ""
    return f" [{min(present) / 1e6:.3g}-{max(present) / 1e6:.3g}]"


def format_table(target: float, methods: list[MethodResult],
                 reference_name: str | None = None) -> str:
    """A markdown table: accuracy, bytes to target, factor against the reference."""
    reference = reference_method(methods, reference_name)
    # A named reference that is not plain FedAvg (FedAvg with the same server
    # averaging, FedAdam): the factors against plain FedAvg go beside its own.
    plain = [m for m in methods if is_plain_fedavg(m.runs[0].summary["config"])]
    beside = plain[0] if len(plain) == 1 and plain[0] is not reference else None
    against = [reference, beside] if beside is not None else [reference]
    sums = [(_mean(r.uplink_to_target), _mean(r.total_to_target)) if r else (None, None)
            for r in against]
    header = "| method | seeds | best acc | rounds to target | uplink MB to target | " \
             "total MB to target | uplink x | total x |"
    if beside is not None:
        header += f" uplink x vs {beside.method} | total x vs {beside.method} |"
    lines = [
        f"Target accuracy: {target:.4f}. Bytes are means over seeds (min-max in brackets); "
        "a method that misses the target in any seed shows '-'."
        + (f" Factors against {reference.method}, then against {beside.method}."
           if beside is not None and reference is not None else ""),
        "",
        header,
        "|---" * header.count(" |") + "|",
    ]
    for m in methods:
        up, total = _mean(m.uplink_to_target), _mean(m.total_to_target)
        rounds = _mean([float(r) if r is not None else None for r in m.round_to_target])
        factors = "".join(
            f" {'-' if up is None or not ref_up else f'{ref_up / up:.1f}'} |"
            f" {'-' if total is None or not ref_total else f'{ref_total / total:.1f}'} |"
            for ref_up, ref_total in sums)
        lines.append(
            f"| {m.method} | {len(m.runs)} | {statistics.mean(m.best_accuracy):.4f} | "
            f"{'-' if rounds is None else f'{rounds:.1f}'} | "
            f"{'-' if up is None else f'{up / 1e6:.4g}{_spread(m.uplink_to_target)}'} | "
            f"{'-' if total is None else f'{total / 1e6:.4g}{_spread(m.total_to_target)}'} |"
            + factors)
    return "\n".join(lines)


def format_paired_table(target: float, methods: list[MethodResult],
                        reference_name: str | None = None) -> str:
    """A markdown table: each run's factors against the reference run of its seed.

    The main table compares means over seeds, as the issue's goal is stated; this one
    shows how the factor holds seed by seed, where the reference's own crossing round
    (one noisy evaluation) moves each factor. Cells are ``uplink x / total x``; ``-``:
    the run misses the target; ``n/a``: the reference has no run of that seed, or its
    run misses the target.
    """
    reference = reference_method(methods, reference_name)
    if reference is None:
        raise ValueError("a paired table needs a reference method (plain FedAvg or "
                         "--reference)")

    def seed_of(run: RunResult) -> int:
        return int(run.summary["config"]["seed"])

    ref_by_seed = {seed_of(run): (up, total) for run, up, total in
                   zip(reference.runs, reference.uplink_to_target,
                       reference.total_to_target, strict=True)}
    seeds = sorted({seed_of(run) for m in methods for run in m.runs})
    lines = [
        f"Paired by seed, target {target:.4f}: each run's uplink x / total x against "
        f"{reference.method!r} with the same seed ('-': the run misses the target; "
        "'n/a': no reference run of that seed reaches it; 'not run': the method has no "
        "run of that seed).",
        "",
        "| method | " + " | ".join(f"seed {s}" for s in seeds) + " |",
        "|---|" + "---|" * len(seeds),
    ]
    for m in methods:
        cells = {}
        for run, up, total in zip(m.runs, m.uplink_to_target, m.total_to_target,
                                  strict=True):
            ref_up, ref_total = ref_by_seed.get(seed_of(run), (None, None))
            if ref_up is None or ref_total is None:
                cells[seed_of(run)] = "n/a"
            elif up is None or total is None:
                cells[seed_of(run)] = "-"
            else:
                cells[seed_of(run)] = f"{ref_up / up:.1f} / {ref_total / total:.1f}"
        lines.append(f"| {m.method} | " + " | ".join(cells.get(s, "not run") for s in seeds)
                     + " |")
    return "\n".join(lines)


def _fp32_factors(method: MethodResult) -> tuple[float | None, float | None]:
    """Uplink and total factors of a method's runs against sending the fp32 model in
    the same rounds (``summary.json``'s ``uplink_compression`` and
    ``total_compression``: the model's size times the replies accepted, up, and the
    nodes sampled, down, over the bytes sent), mean over seeds; None where a run has
    no such factor."""
    factors = [(r.summary.get("uplink_compression"), r.summary.get("total_compression"))
               for r in method.runs]
    if any(up is None or total is None for up, total in factors):
        return None, None
    return (statistics.mean(up for up, _ in factors),
            statistics.mean(total for _, total in factors))


def format_whole_runs(methods: list[MethodResult], reference_name: str | None = None) -> str:
    """A markdown table of whole runs: accuracy and bytes per round against plain FedAvg
    (the reference), or, where the runs hold none, against the fp32 model sent both
    ways in the same rounds.

    Bytes per round (rather than per run) keep runs of different lengths comparable.
    """
    def per_round(run: RunResult, key: str) -> float:
        completed = [r for r in run.rounds if math.isfinite(r[key])]
        return completed[-1][key] / len(completed) if completed else math.nan

    def mean_per_round(m: MethodResult, keys: tuple[str, ...]) -> float:
        return statistics.mean(sum(per_round(r, k) for k in keys) for r in m.runs)

    up_keys, total_keys = ("cum_uplink_bytes",), ("cum_uplink_bytes", "cum_downlink_bytes")
    reference = reference_method(methods, reference_name)
    ref_up = mean_per_round(reference, up_keys) if reference else None
    ref_total = mean_per_round(reference, total_keys) if reference else None
    lines = [
        "| method | seeds | rounds | final acc | best acc | uplink kB/round | "
        "total kB/round | uplink x | total x |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for m in methods:
        up, total = mean_per_round(m, up_keys), mean_per_round(m, total_keys)
        final = statistics.mean(math.nan if r.summary["final_accuracy"] is None
                                else r.summary["final_accuracy"] for r in m.runs)
        rounds = statistics.mean(len(r.rounds) for r in m.runs)
        if reference is not None:
            up_x = ref_up / up if ref_up and up else None
            total_x = ref_total / total if ref_total and total else None
        else:  # no FedAvg run to divide by: the fp32 model's bytes in the same rounds
            up_x, total_x = _fp32_factors(m)
        lines.append(
            f"| {m.method} | {len(m.runs)} | {rounds:.0f} | {final:.4f} | "
            f"{statistics.mean(m.best_accuracy):.4f} | {up / 1e3:,.1f} | {total / 1e3:,.1f} | "
            f"{'-' if up_x is None else f'{up_x:,.0f}'} | "
            f"{'-' if total_x is None else f'{total_x:,.1f}'} |")
    return "\n".join(lines)


def format_wire(methods: list[MethodResult]) -> str | None:
    """A markdown table of deployed runs' bytes on the wire beside their payloads.

    Per node and round (means over the rounds measured and the seeds): the payload
    compression factors against FedAvg's fp32 model, then the same factors for what a
    node really sent and received over TCP (Flower's requests, headers, polls and TLS
    included). FedAvg's own wire bytes would exceed its payload, so the on-the-wire
    factors understate the saving. None when no run measured its wire bytes.
    """
    rows = []
    for m in methods:
        wired = [r.summary["wire"] for r in m.runs if r.summary.get("wire")]
        if not wired:
            continue
        payload = [r.summary for r in m.runs if r.summary.get("wire")]

        def mean(values: list[float | None]) -> str:
            kept = [v for v in values if v is not None]
            return f"{statistics.mean(kept):,.1f}" if kept else "-"

        rows.append(
            f"| {m.method} | {sum(w['node_rounds'] for w in wired)} | "
            f"{mean([w['up_per_node_round'] / 1e3 for w in wired])} | "
            f"{mean([w['protocol_up_bytes'] / w['node_rounds'] / 1e3 for w in wired])} | "
            f"{mean([w['down_per_node_round'] / 1e3 for w in wired])} | "
            f"{mean([w['protocol_down_bytes'] / w['node_rounds'] / 1e3 for w in wired])} | "
            f"{mean([s.get('uplink_compression') for s in payload])} | "
            f"{mean([w['uplink_compression'] for w in wired])} | "
            f"{mean([s.get('total_compression') for s in payload])} | "
            f"{mean([w['total_compression'] for w in wired])} |")
    if not rows:
        return None
    return "\n".join([
        "| method | node-rounds | wire up kB | protocol up kB | wire down kB | "
        "protocol down kB | payload up x | wire up x | payload total x | wire total x |",
        "|---|---|---|---|---|---|---|---|---|---|", *rows])


def _tensor_shares(text: Any) -> dict[str, float]:
    """A ``name=share;...`` cell of ``rounds.csv`` as a mapping (empty when blank)."""
    if not isinstance(text, str) or not text:
        return {}
    return {name: float(value) for name, _, value in
            (item.partition("=") for item in text.split(";"))}


def _mean_tensor_shares(rows: Sequence[Mapping[str, Any]], column: str) -> dict[str, float]:
    """Each tensor's mean over ``rows`` of a ``name=share;...`` text column."""
    shares: dict[str, list[float]] = {}
    for row in rows:
        for name, value in _tensor_shares(row.get(column)).items():
            shares.setdefault(name, []).append(value)
    return {name: statistics.mean(values) for name, values in shares.items()}


def budget_choice_series(method: MethodResult, direction: str
                         ) -> dict[str, tuple[list[int], list[float]]]:
    """What a budget chose round by round: each tensor's share of entries sent
    (``rounds.csv``'s ``{direction}_tensor_density``), mean over the seeds that
    recorded the round, as ``{tensor: (rounds, shares)}``; empty without a budget."""
    by_round: dict[int, dict[str, list[float]]] = {}
    for run in method.runs:
        for row in run.rounds:
            for name, value in _tensor_shares(row.get(f"{direction}_tensor_density")).items():
                by_round.setdefault(int(row["round"]), {}).setdefault(name, []).append(value)
    series: dict[str, tuple[list[int], list[float]]] = {}
    for rnd in sorted(by_round):
        for name, values in by_round[rnd].items():
            rounds, shares = series.setdefault(name, ([], []))
            rounds.append(rnd)
            shares.append(statistics.mean(values))
    return series


def format_budget_choices(methods: list[MethodResult]) -> str | None:
    """Markdown tables of what byte budgets chose: one per budgeted method (its name in
    bold above it), a row per tensor and a column per budgeted direction (``uplink``
    for ``uplink-budget``, ``downlink`` for ``downlink-budget``), each cell the share
    of the tensor's entries sent and, where the runs recorded it, the share of
    payloads that carried the tensor at all ("0.5% in 40%"); a last row the bits a
    kept value cost (means over rounds, payloads and seeds, from ``rounds.csv``'s
    ``*_tensor_density``, ``*_tensor_sent`` and ``*_value_bits``). One table per
    method keeps the table as narrow as a model has budgeted directions, however
    many methods a sweep compares. None when no run had a budget."""

    def cell(name: str, shares: dict[str, float], carried: dict[str, float]) -> str:
        if name not in shares:
            return "-"
        text = f"{100 * shares[name]:.3g}%"
        return text + (f" in {100 * carried[name]:.3g}%" if name in carried else "")

    tables = []
    for m in methods:
        rows = [row for run in m.runs for row in run.rounds]
        columns: list[tuple[str, dict[str, float], dict[str, float], float | None]] = []
        names: list[str] = []
        for direction in ("uplink", "downlink"):
            shares = _mean_tensor_shares(rows, f"{direction}_tensor_density")
            carried = _mean_tensor_shares(rows, f"{direction}_tensor_sent")
            bits = [value for row in rows
                    if isinstance(value := row.get(f"{direction}_value_bits"), float)
                    and math.isfinite(value)]
            if shares:
                names += [n for n in shares if n not in names]
                columns.append((direction, shares, carried,
                                statistics.mean(bits) if bits else None))
        if not columns:
            continue
        lines = [f"**{m.method}**", "",
                 "| tensor | " + " | ".join(label for label, _, _, _ in columns) + " |",
                 "|---|" + "---|" * len(columns)]
        for name in names:
            lines.append(f"| `{name}` | " + " | ".join(
                cell(name, shares, carried) for _, shares, carried, _ in columns) + " |")
        lines.append("| bits a kept value | " + " | ".join(
            "-" if value_bits is None else f"{value_bits:.2f}"
            for _, _, _, value_bits in columns) + " |")
        tables.append("\n".join(lines))
    return "\n\n".join(tables) if tables else None


def feedback_series(method: MethodResult, column: str = "feedback_ratio"
                    ) -> tuple[list[int], list[float]]:
    """``rounds.csv``'s ``column`` (``feedback_ratio`` or ``feedback_residual``) round by
    round, mean over the seeds that recorded it, as ``(rounds, values)``; empty for
    runs without error feedback and for runs recorded before the column existed."""
    by_round: dict[int, list[float]] = {}
    for run in method.runs:
        for row in run.rounds:
            value = row.get(column)
            if isinstance(value, float) and math.isfinite(value):
                by_round.setdefault(int(row["round"]), []).append(value)
    rounds = sorted(by_round)
    return rounds, [statistics.mean(by_round[r]) for r in rounds]


def _quarter_means(rounds: list[int], values: list[float]) -> list[float | None]:
    """Means of ``values`` over each quarter of the rounds up to the last."""
    last = rounds[-1]
    quarters = [[v for r, v in zip(rounds, values, strict=True)
                 if q * last / 4 < r <= (q + 1) * last / 4] for q in range(4)]
    return [statistics.mean(q) if q else None for q in quarters]


def format_feedback(methods: list[MethodResult]) -> str | None:
    """A markdown table of each error-feedback method's ``feedback_ratio`` (a client's
    residual over its fresh update, see :class:`fedcomp.ops.results.RoundRecord`),
    mean over each quarter of its rounds and over seeds, and how much the residual
    itself grew from the second quarter to the fourth (the first holds clients' first
    rounds, which carry none): a ratio that grows with the residual means the uplink
    carries less than the clients learn; one that grows while the residual does not,
    that the fresh updates shrink as training converges. None when no run recorded
    the ratio."""
    lines = []
    for m in methods:
        rounds, ratios = feedback_series(m)
        if not rounds:
            continue
        cells = [f"{q:.2f}" if q is not None else "-" for q in _quarter_means(rounds, ratios)]
        residual_rounds, residuals = feedback_series(m, "feedback_residual")
        growth = "-"
        if residual_rounds:
            second, fourth = _quarter_means(residual_rounds, residuals)[1::2]
            if second and fourth is not None:
                growth = f"{fourth / second:.2f}"
        lines.append(f"| {m.method} | {len(m.runs)} | " + " | ".join(cells)
                     + f" | {growth} |")
    if not lines:
        return None
    return "\n".join(["| method | seeds | ratio, 1st quarter of the rounds | 2nd | 3rd | 4th "
                      "| residual, 4th quarter over 2nd |",
                      "|---|---|---|---|---|---|---|", *lines])


def plot_feedback(methods: list[MethodResult], out_dir: Path) -> Path | None:
    """Write ``feedback_ratio.png``: each error-feedback method's residual over fresh
    update against the round (mean over seeds). None when no run recorded it."""
    series = [(index, m, feedback_series(m)) for index, m in enumerate(methods)]
    series = [(index, m, s) for index, m, s in series if s[0]]
    if not series:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=100)
    for index, m, (rounds, ratios) in series:
        ax.plot(rounds, ratios, label=m.method, lw=1.5, **_line_style(index))
    ax.set_xlabel("round")
    ax.set_ylabel("error-feedback residual / fresh update")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(0.0, -0.14),
              ncol=1 if len(series) > 6 else 2, frameon=False)
    path = out_dir / "feedback_ratio.png"
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)
    return path


def format_accuracy_at_rounds(methods: list[MethodResult], rounds: Sequence[int]) -> str:
    """A markdown table of each method's accuracy at the given rounds, mean over seeds.

    A round that some seed did not evaluate (``eval-every``) or did not reach shows '-':
    a mean over fewer seeds than the method has would not compare like with like.
    """
    def at(run: RunResult, rnd: int) -> float:
        found = [r["accuracy"] for r in run.rounds if int(r["round"]) == rnd]
        return found[0] if found else math.nan

    lines = ["| method | seeds | " + " | ".join(f"round {r}" for r in rounds) + " |",
             "|---|---|" + "---|" * len(rounds)]
    for m in methods:
        cells = []
        for rnd in rounds:
            values = [at(run, rnd) for run in m.runs]
            ok = all(math.isfinite(v) for v in values)
            cells.append(f"{statistics.mean(values):.4f}" if ok else "-")
        lines.append(f"| {m.method} | {len(m.runs)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


#: Line styles and markers that stay apart in grey print and for colour-blind readers.
_DASHES = ("-", "--", "-.", ":")
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


def _line_style(index: int) -> dict[str, Any]:
    """The index-th method's colour, dash and marker: no two of the first 40 alike."""
    return {"color": f"C{index % 10}", "ls": _DASHES[(index // 10 + index) % 4],
            "marker": _MARKERS[index % 8], "markevery": 0.1, "markersize": 4}


def select_methods(methods: list[MethodResult], names: Sequence[str]) -> list[MethodResult]:
    """The methods named, in the order named (all of them when ``names`` is empty)."""
    if not names:
        return methods
    by_name = {m.method: m for m in methods}
    missing = [n for n in names if n not in by_name]
    if missing:
        raise ValueError(f"no method named {', '.join(map(repr, missing))} in these runs; "
                         f"there are: {', '.join(map(repr, by_name))}")
    return [by_name[n] for n in names]


def plot_runs(methods: list[MethodResult], out_dir: Path, target: float) -> list[Path]:
    """Write the two PNG plots; return their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for name, x_key, x_label, log_x in (
        ("accuracy_vs_uplink.png", "cum_uplink_bytes", "cumulative uplink MB (log)", True),
        ("accuracy_vs_round.png", "round", "round", False),
    ):
        fig, ax = plt.subplots(figsize=(7, 4.5), dpi=100)
        for index, m in enumerate(methods):
            length = min(len(r.rounds) for r in m.runs)
            if length == 0:
                continue
            style = _line_style(index)
            # Rounds without an evaluation (eval-every > 1) have no accuracy: skip them.
            evaluated = [i for i in range(length)
                         if all(math.isfinite(r.rounds[i]["accuracy"]) for r in m.runs)]
            xs = [statistics.mean(r.rounds[i][x_key] for r in m.runs) for i in evaluated]
            if x_key != "round":
                xs = [x / 1e6 for x in xs]
            accs = [[r.rounds[i]["accuracy"] for r in m.runs] for i in evaluated]
            if not evaluated:
                continue
            line, = ax.plot(xs, [statistics.mean(a) for a in accs], label=m.method, lw=1.5,
                            **style)
            if len(m.runs) > 1:
                ax.fill_between(xs, [min(a) for a in accs], [max(a) for a in accs],
                                color=line.get_color(), alpha=0.15)
        ax.axhline(target, color="grey", ls="--", lw=1, label=f"target {target:.3f}")
        if log_x:
            ax.set_xscale("log")
        ax.set_xlabel(x_label)
        ax.set_ylabel("test accuracy")
        ax.grid(alpha=0.3)
        # Below the axes, not on them: with many methods an inside legend hides the
        # curves; bbox_inches="tight" grows the figure to hold it.
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(0.0, -0.14),
                  ncol=1 if len(methods) > 6 else 2, frameon=False)
        path = out_dir / name
        fig.savefig(path, bbox_inches="tight")
        plt.close(fig)
        paths.append(path)
    return paths


def plot_budget_choices(methods: list[MethodResult], out_dir: Path) -> Path | None:
    """Write ``budget_choices.png``: a panel per budgeted method and direction, each
    tensor's share of entries sent against the round (log axis; a round where every
    payload left a tensor out has no point), so a reader sees how the controller
    moves bytes between tensors as training goes. None when no run had a budget."""
    panels = [(f"{m.method}: {direction}", series) for m in methods
              for direction in ("uplink", "downlink")
              if (series := budget_choice_series(m, direction))]
    if not panels:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(panels), 1, figsize=(7, 2.8 * len(panels)), dpi=100,
                             sharex=True, squeeze=False)
    names = list(dict.fromkeys(name for _, series in panels for name in series))
    for ax, (title, series) in zip(axes[:, 0], panels, strict=True):
        never = [name for name, (_, shares) in series.items() if not any(shares)]
        for name, (rounds, shares) in series.items():
            if name not in never:
                ax.plot(rounds, [s if s > 0 else math.nan for s in shares], lw=1.0,
                        label=name, **_line_style(names.index(name)))
        ax.set_yscale("log")
        ax.set_ylabel("share of entries sent")
        # A tensor left out of every payload has no point on a log axis: named instead.
        ax.set_title(title + (f" (never sent: {', '.join(never)})" if never else ""),
                     fontsize=9, wrap=True)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("round")
    handles = {h.get_label(): h for ax in axes[:, 0] for h in ax.get_lines()}
    shown = [n for n in names if n in handles]
    axes[-1, 0].legend([handles[n] for n in shown], shown, fontsize=7, loc="upper left",
                       bbox_to_anchor=(0.0, -0.25), ncol=2 if len(shown) > 8 else 1,
                       frameon=False)
    path = out_dir / "budget_choices.png"
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)
    return path


def encoder_note(runs: Sequence[RunResult],
                 fingerprint: Callable[[Mapping[str, Any]], str] | None = None) -> str:
    """A warning when some runs' bytes did not come from this code; else ``""``.

    Each run records the fingerprint of the code that encoded it (``encoder`` in
    ``summary.json``; absent in runs older than the fingerprint). The fingerprint is
    of the run's own codecs, so runs of different methods always differ: what tells
    whether two runs' bytes compare one to one is whether each was encoded by the
    same code. With ``fingerprint`` (the current code's fingerprint of a run config,
    as :func:`current_encoder` computes it) each run is checked against that; without,
    only runs of one method are compared with each other. Accuracy does not depend
    on it for lossless changes, but byte counts do.
    """
    unrecorded = [r.run_id for r in runs if not r.summary.get("encoder")]
    other: dict[str, list[str]] = {}
    if fingerprint is not None:
        for run in runs:
            recorded = run.summary.get("encoder")
            if recorded and recorded != fingerprint(run.summary.get("config", {})):
                other.setdefault(run.method, []).append(run.run_id)
    else:
        by_method: dict[str, set[str]] = {}
        for run in runs:
            if run.summary.get("encoder"):
                by_method.setdefault(run.method, set()).add(run.summary["encoder"])
        other = {m: [r.run_id for r in runs if r.method == m]
                 for m, codes in by_method.items() if len(codes) > 1}
    if not unrecorded and not other:
        return ""
    parts = []
    if unrecorded:
        parts.append(f"{len(unrecorded)} run{'s' * (len(unrecorded) > 1)} record no encoder "
                     "(made before runs recorded it)")
    if other:
        count = sum(len(ids) for ids in other.values())
        what = ("by other code than this checkout's" if fingerprint is not None
                else "by more than one encoder within one method")
        parts.append(f"{count} run{'s' * (count > 1)} were encoded {what} ("
                     + "; ".join(f"{m}: {len(ids)}" for m, ids in other.items()) + ")")
    return (f"Note: of these {len(runs)} runs, " + ", and ".join(parts) + ". Rerun now, "
            "their bytes could differ: compare their byte counts with the others' with care.")


def current_encoder(config: Mapping[str, Any]) -> str:
    """This code's encoder fingerprint for a run config (``summary.json``'s ``config``).

    ``""`` where the config no longer parses (a run older than a renamed key), so such
    a run counts as encoded by other code.
    """
    try:
        parsed = RunConfig.from_recorded(
            {k: v for k, v in config.items() if not k.endswith("-config")})
    except (ValueError, TypeError):  # SpecError is a ValueError
        return ""
    return encoder_of(parsed)


_ENCODERS: dict[tuple[str, str, str], str] = {}


def encoder_of(config: RunConfig) -> str:
    """The current code's fingerprint of ``config``'s two policies, computed once each.

    Keyed by the dataset and the policies' descriptions, which name everything that
    shapes their payloads (specs, overrides, the small-tensor threshold).
    """
    key = (config.task_name, config.uplink_policy.description,
           config.downlink_policy.description)
    if key not in _ENCODERS:
        # Imported here: the report's tables need no torch model, the fingerprint does.
        from fedcomp.tasks.models import model_shapes

        _ENCODERS[key] = config.encoder_fingerprint(model_shapes(config.task_name))
    return _ENCODERS[key]


def write_report(out_dir: str | Path, target: float | None = None,
                 extra_targets: Sequence[float] = (),
                 at_rounds: Sequence[int] = (),
                 reference: str | None = None,
                 fingerprint: Callable[[Mapping[str, Any]], str] | None = None,
                 paired: bool = False,
                 plot_methods: Sequence[str] = ()) -> tuple[str, list[Path]]:
    """Build the report of a sweep folder; write report.md and the plots.

    ``target`` (default: plain FedAvg's mean best accuracy minus one point) draws the
    line in the plots; each of ``extra_targets`` adds one more bytes-to-target table,
    and ``at_rounds`` a table of accuracy at those rounds. ``reference`` names the
    method the factors are against (needed where several are plain FedAvg).
    ``fingerprint`` (e.g. :func:`current_encoder`) checks each run's recorded encoder
    against this code's (see :func:`encoder_note`). ``paired`` follows each
    bytes-to-target table with its seed-by-seed factors (:func:`format_paired_table`).
    ``plot_methods`` names the methods the plots draw (default: all), since a plot of
    more than about eight lines cannot be read.
    """
    out = Path(out_dir)
    runs = load_runs(out)
    target, methods = build_report(runs, target, reference)
    tables = []
    for this_target, these_methods in [(target, methods)] + [
            build_report(runs, extra, reference) for extra in extra_targets]:
        tables.append(format_table(this_target, these_methods, reference))
        if paired:
            tables.append(format_paired_table(this_target, these_methods, reference))
    against = ("plain FedAvg" if reference_method(methods, reference) is not None else
               "the fp32 model sent both ways in the same rounds (no plain FedAvg run here)")
    tables.append(f"Whole runs: accuracy, and bytes per round against {against}.\n\n"
                  + format_whole_runs(methods, reference))
    if (wire := format_wire(methods)) is not None:
        tables.append("On the wire (deployed runs): kB per node and round, and factors "
                      "against FedAvg's fp32 payload.\n\n" + wire)
    if (choices := format_budget_choices(methods)) is not None:
        tables.append("What the byte budgets chose: the share of each tensor's entries "
                      "sent, \"in\" the share of payloads that carried the tensor at all, "
                      "and the bits a kept value cost (means over rounds, clients and "
                      "seeds).\n\n" + choices)
    if (feedback := format_feedback(methods)) is not None:
        tables.append("Error feedback: the residual a client carries into a round over "
                      "its fresh update (median over the round's clients; means over "
                      "each quarter of the rounds and over seeds), and how much the "
                      "residual itself grew. A ratio that grows with the residual means "
                      "the uplink carries less than the clients learn; one that grows "
                      "while the residual does not, that the updates shrink as training "
                      "converges.\n\n" + feedback)
    if at_rounds:
        tables.append("Accuracy at chosen rounds (mean over seeds).\n\n"
                      + format_accuracy_at_rounds(methods, at_rounds))
    note = encoder_note(runs, fingerprint)
    table = "\n\n".join(([note] if note else []) + tables)
    selected = select_methods(methods, plot_methods)
    paths = plot_runs(selected, out, target)
    if (choices_plot := plot_budget_choices(selected, out)) is not None:
        paths.append(choices_plot)
    if (feedback_plot := plot_feedback(selected, out)) is not None:
        paths.append(feedback_plot)
    (out / "report.md").write_text(table + "\n\n" + "\n".join(
        f"![{p.stem}]({p.name})" for p in paths) + "\n")
    return table, paths
