"""Which clients train in a round: drawn from the run's seed, by the data they hold.

Why. Flower gives every node a random 64-bit id (``os.urandom``) each time a run
starts. Drawing positions in the sorted list of *node ids* therefore picks other
data partitions every time a run is repeated: the same seed did not give the same
run, and two methods of a sweep compared under one seed trained on different
clients. Ordering nodes by the partition they hold before drawing makes the draw a
function of the seed alone, and pairs a sweep's methods: under one seed each method
sees the same clients in the same rounds, so their curves differ by the method, not
by the luck of the draw.

The partition ids come from the nodes (a Flower query message), so they are
untrusted input: :func:`parse_partition_id` accepts only a non-negative integer in
range. Nodes whose id is unknown (no answer, a bad answer) are ordered after the
known ones by node id, so a run still goes on without them being reproducible.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

__all__ = ["MAX_PARTITION_ID", "order_nodes", "parse_partition_id", "sample_nodes"]

#: Largest partition id accepted from a node (Flower node configs are int64 at most).
MAX_PARTITION_ID = 2**31 - 1


def parse_partition_id(value: Any) -> int:
    """A node's reported partition id as an int; ``ValueError`` naming the bad value.

    Flower may carry integers as floats (``MetricRecord``); an integral float is
    accepted, anything else (bools, fractions, NaN, negative or huge values) is not.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"partition id must be a number, got {value!r}")
    if isinstance(value, (float, np.floating)):
        if not math.isfinite(value) or value != int(value):
            raise ValueError(f"partition id must be a whole number, got {value!r}")
        value = int(value)
    if not 0 <= int(value) <= MAX_PARTITION_ID:
        raise ValueError(f"partition id must be in [0, {MAX_PARTITION_ID}], got {value!r}")
    return int(value)


def order_nodes(node_ids: Iterable[int], partition_of: Mapping[int, int]) -> list[int]:
    """Nodes by (partition id, node id); nodes of unknown partition last, by node id."""
    nodes = sorted(set(node_ids))
    known = sorted((n for n in nodes if n in partition_of), key=lambda n: (partition_of[n], n))
    return known + [n for n in nodes if n not in partition_of]


def sample_nodes(rng: np.random.Generator, node_ids: Iterable[int],
                 partition_of: Mapping[int, int], wanted: int) -> list[int]:
    """Draw ``wanted`` nodes without replacement (all of them if ``wanted`` is 0 or more).

    Positions are drawn from ``rng`` in the order of :func:`order_nodes`, so the same
    generator state and the same partitions give the same partitions whatever the ids.
    Positions rather than ids are drawn because ids are uint64 and numpy would round
    them through float64 when they straddle 2**63.
    """
    nodes = order_nodes(node_ids, partition_of)
    if wanted <= 0 or wanted >= len(nodes):
        return nodes
    chosen = rng.choice(len(nodes), size=wanted, replace=False)
    return [nodes[i] for i in sorted(chosen)]
