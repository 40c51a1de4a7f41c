"""What a differentially private run releases, and what its clients send.

The guarantee covers the sequence of models the server computes (each round's noisy
mean goes through the server optimizer) and whatever is computed from them and from
public data: test accuracy and loss, the adaptive clipping norm (itself a noisy
release, accounted), epsilon (a function of public settings). A value measured on a
client's data and sent or written without noise is not covered, so under DP:

* a client's reply carries its payload and only :data:`DP_CLIENT_METRICS`: which
  partition it serves and how far its replica is (bookkeeping the server needs), and
  the DP mechanism's own inputs. No loss, example count, norm, timing or byte count.
  The server then weights every update equally.
* the results folder's ``release/`` holds what may be published:
  ``rounds.csv`` with :data:`RELEASED_ROUND_COLUMNS` and ``summary.json`` with
  :data:`RELEASED_SUMMARY_KEYS`. The folder's own ``rounds.csv`` and ``summary.json``
  are the operator's records, with exact participant counts, bytes and timings (they
  reveal how many clients took part in each round); ``clients.csv`` is not written.

Dataset sizes are treated as public, as in Opacus (DP-SGD's sampling rate is the batch
size over the client's example count, and each client reports it for accounting), and
so is the number of clients (the sampling rate of client-level DP is the expected
clients per round over the clients connected).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = [
    "DP_CLIENT_METRICS",
    "RELEASED_ROUND_COLUMNS",
    "RELEASED_SUMMARY_KEYS",
    "released_client_metrics",
    "released_summary",
]

#: What a reply may carry under DP besides its payload and replica digest.
DP_CLIENT_METRICS = frozenset({
    "partition-id", "replica-round", "state-from-file",   # bookkeeping
    "dp-unclipped",                                        # adaptive clipping's bit
    "dp-sample-rate", "dp-steps",                          # DP-SGD's accounting
})

#: The columns of ``release/rounds.csv``.
RELEASED_ROUND_COLUMNS = ("round", "accuracy", "loss", "raw_accuracy", "epsilon", "dp_clip")

#: The keys of ``release/summary.json``.
RELEASED_SUMMARY_KEYS = (
    "run_name", "config", "final_accuracy", "best_accuracy", "initial_accuracy",
    "final_raw_accuracy", "best_raw_accuracy", "rounds_completed", "model_bytes_fp32",
    "epsilon", "dp_delta", "dp_accountant", "dp_noise", "dp_final_clip", "stopped_early",
)


def released_client_metrics(metrics: Mapping[str, float]) -> dict[str, float]:
    """The metrics a client may send under DP (the others are dropped)."""
    return {k: v for k, v in metrics.items() if k in DP_CLIENT_METRICS}


def released_summary(summary: Mapping[str, Any]) -> dict[str, Any]:
    """The part of a run's summary a DP run releases."""
    return {k: summary[k] for k in RELEASED_SUMMARY_KEYS if k in summary}
