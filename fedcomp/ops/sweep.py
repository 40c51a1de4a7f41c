"""Sweeps: a grid of run configs, one Flower simulation each, resumable.

A sweep file is TOML::

    [base]         # run-config keys shared by all runs ([tool.flwr.app.config] keys)
    dataset = "digits"
    num-server-rounds = 3
    [grid]         # each key maps to a list; the runs are their Cartesian product
    codec = ["none", "topk:ratio=0.01|quant:bits=4"]
    seed = [0, 1]
    [simulation]   # how to simulate: the number of virtual clients
    num-supernodes = 10

Methods that need several settings changed together (a codec with its own feedback
or downlink) are written as ``[[method]]`` tables, each with a ``name`` and its
overrides. The runs are then every method times every grid combination, and the
method's name is a column of ``runs.csv``::

    [[method]]
    name = "STC"
    codec = "topk:ratio=0.001|ternary:mode=mean"
    downlink-codec = "topk:ratio=0.001|ternary:mode=mean"

Each run's id is a hash of its full settings (``r-`` + 10 hex digits), so the same
combination always lands in the same folder ``OUT/<run-id>/``. A run with a
``summary.json`` is complete and skipped on a rerun. A run with only a checkpoint was
interrupted, and is resumed from it. A run that raises is recorded as failed with its
error, and the sweep goes on. ``OUT/runs.csv`` (one row per run: its grid values and
summary figures) is rewritten after every run.

The run id covers the settings, not the code: a complete run encoded by an older
version of a codec or of the wire format keeps its byte counts. Given a
``fingerprint`` function, the sweep compares each skipped run's recorded ``encoder``
(:meth:`~fedcomp.config.RunConfig.encoder_fingerprint`) with the current code's and
says which runs would encode differently if rerun; ``runs.csv`` carries the column.

The runner that actually simulates is passed in (:func:`run_sweep`), so this module
stays free of Flower; ``fedcomp sweep`` passes one that runs ``flwr run`` on the
local SuperLink (tests pass in-process ones).
"""

from __future__ import annotations

import csv
import hashlib
import itertools
import json
import os
import tomllib
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedcomp.config import RunConfig
from fedcomp.errors import SpecError

__all__ = ["RUN_COLUMNS", "Sweep", "SweepRun", "run_sweep"]

#: Summary figures copied into ``runs.csv`` beside each run's grid values.
RUN_COLUMNS = ["final_accuracy", "best_accuracy", "rounds_completed", "uplink_bytes",
               "downlink_bytes", "uplink_compression", "rejected_updates", "wall_s",
               "encoder"]
_RESERVED = {"run-name", "results-dir", "resume"}


@dataclass(frozen=True)
class SweepRun:
    """One combination of the grid."""

    run_id: str
    values: dict[str, Any]
    config: RunConfig
    num_supernodes: int


@dataclass(frozen=True)
class Sweep:
    """A parsed sweep file."""

    base: dict[str, Any]
    grid: dict[str, list[Any]]
    num_supernodes: int = 10
    name: str = "sweep"
    methods: list[dict[str, Any]] = field(default_factory=list)
    runs: list[SweepRun] = field(init=False, repr=False)

    @property
    def columns(self) -> list[str]:
        """The keys that tell runs apart (``method`` first when there are methods)."""
        return (["method"] if self.methods else []) + list(self.grid)

    def __post_init__(self) -> None:
        method_keys = {k for m in self.methods for k in m if k != "name"}
        for key in set(self.base) | set(self.grid) | method_keys:
            if key in _RESERVED:
                raise SpecError(f"sweep key {key!r} is set by the sweep itself")
        names = [m.get("name") for m in self.methods]
        if any(not isinstance(n, str) or not n for n in names) or len(set(names)) != len(names):
            raise SpecError("every [[method]] needs a distinct non-empty name")
        for key, values in self.grid.items():
            if not isinstance(values, list) or not values:
                raise SpecError(f"grid key {key!r} must map to a non-empty list, got {values!r}")
        if self.num_supernodes < 1:
            raise SpecError(f"num-supernodes must be >= 1, got {self.num_supernodes}")
        runs = []
        keys = list(self.grid)
        # Grid outer, methods inner: an interrupted sweep has already compared every
        # method on the first seed.
        for combo, method in itertools.product(itertools.product(*(self.grid[k] for k in keys)),
                                               self.methods or [{}]):
            overrides = {k: v for k, v in method.items() if k != "name"}
            values = ({"method": method["name"]} if method else {}) | dict(
                zip(keys, combo, strict=True))
            grid_values = {k: v for k, v in values.items() if k != "method"}
            # validates every key and value
            # Only the keys the sweep file sets: each wins over a preset, even at its
            # default (the runner then passes the expanded config without the preset).
            config = RunConfig.from_mapping({**self.base, **overrides, **grid_values},
                                            explicit=True)
            runs.append(SweepRun(run_id_for(config, self.num_supernodes), values, config,
                                 self.num_supernodes))
        ids = [r.run_id for r in runs]
        if len(set(ids)) != len(ids):
            raise SpecError("two grid combinations give the same settings (duplicate values?)")
        object.__setattr__(self, "runs", runs)

    @property
    def notices(self) -> list[str]:
        """Each method's :attr:`RunConfig.notices <fedcomp.config.RunConfig.notices>`
        once, prefixed with the method's name: printed before the first run, since a
        sweep's runs print theirs only into their own logs."""
        seen: dict[str, None] = {}
        for run in self.runs:
            method = run.values.get("method")
            for notice in run.config.notices:
                seen.setdefault(f"{method}: {notice}" if method else notice, None)
        return list(seen)

    @classmethod
    def load(cls, path: str | Path) -> Sweep:
        path = Path(path)
        try:
            data = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise SpecError(f"cannot read sweep file {path}: {exc}") from None
        unknown = set(data) - {"base", "grid", "simulation", "method"}
        if unknown:
            raise SpecError(f"{path}: unknown tables {sorted(unknown)}; use base, grid, "
                            "method, simulation")
        simulation = data.get("simulation", {})
        extra = set(simulation) - {"num-supernodes"}
        if extra:
            raise SpecError(f"{path}: unknown [simulation] keys {sorted(extra)}")
        return cls(base=data.get("base", {}), grid=data.get("grid", {}),
                   num_supernodes=int(simulation.get("num-supernodes", 10)), name=path.stem,
                   methods=list(data.get("method", [])))


def run_id_for(config: RunConfig, num_supernodes: int) -> str:
    """Stable id of a run: a hash of every setting that shapes its results."""
    blob = f"{config.digest()}|{num_supernodes}".encode()
    return "r-" + hashlib.sha256(blob).hexdigest()[:10]


Runner = Callable[[RunConfig, int], dict[str, Any]]


def run_sweep(sweep: Sweep, out_dir: str | Path, runner: Runner, *,
              log: Callable[[str], None] = print,
              fingerprint: Callable[[RunConfig], str] | None = None) -> list[dict[str, Any]]:
    """Run every missing run of ``sweep`` under ``out_dir``; return the runs.csv rows.

    ``fingerprint(config)`` (optional) is the encoder fingerprint the current code
    gives a run's config; complete runs recorded with another one are reported.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.json").write_text(json.dumps(
        {"name": sweep.name, "base": sweep.base, "grid": sweep.grid, "methods": sweep.methods,
         "columns": sweep.columns, "num_supernodes": sweep.num_supernodes}, indent=2))
    rows: list[dict[str, Any]] = []
    total = len(sweep.runs)
    for index, run in enumerate(sweep.runs, 1):
        run_dir = out / run.run_id
        label = ", ".join(f"{k}={v}" for k, v in run.values.items()) or "base"
        summary_path = run_dir / "summary.json"
        status, error, summary = "complete", "", None
        if summary_path.exists():
            log(f"[run {index}/{total}] {run.run_id} ({label}): complete, skipped")
            summary = json.loads(summary_path.read_text())
            if fingerprint is not None:
                current, recorded = fingerprint(run.config), summary.get("encoder")
                if recorded != current:
                    by = (f"encoder {recorded}" if recorded
                          else "a version that did not record its encoder")
                    log(f"  warning: {run.run_id} was encoded by {by}; this code encodes "
                        f"its config as {current}, so a rerun's bytes may differ (move "
                        f"{run_dir} away to rerun it)")
        else:
            resume = (run_dir / "checkpoint.npz").exists()
            log(f"[run {index}/{total}] {run.run_id} ({label})"
                + (": resuming from its checkpoint" if resume else ""))
            config = run.config.replace(results_dir=str(out), run_name=run.run_id,
                                        resume=resume)
            try:
                summary = runner(config, run.num_supernodes)
            except Exception as exc:
                status, error = "failed", f"{type(exc).__name__}: {exc}"
                run_dir.mkdir(parents=True, exist_ok=True)
                (run_dir / "error.txt").write_text(traceback.format_exc())
                log(f"[run {index}/{total}] {run.run_id} FAILED: {error}")
        row: dict[str, Any] = {"run_id": run.run_id, "status": status, **run.values}
        for column in RUN_COLUMNS:
            row[column] = (summary or {}).get(column)
        row["error"] = error
        rows.append(row)
        _write_rows(out / "runs.csv", rows, sweep.columns)
    return rows


def _write_rows(path: Path, rows: list[dict[str, Any]], grid_keys: list[str]) -> None:
    columns = ["run_id", "status", *grid_keys, *RUN_COLUMNS, "error"]
    tmp = path.with_suffix(".csv.tmp")
    with tmp.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    os.replace(tmp, path)
