"""The only module of ``fedcomp`` that imports Flower: conversions to Flower records.

Keeping Flower out of the rest of the library lets every codec, the wire format and
the feedback memories be tested without Flower running, and confines API changes of
Flower (which moves fast between minor releases) to this file.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord

__all__ = ["PAYLOAD_KEY", "payload_from_record", "payload_to_record", "record_to_state",
           "state_to_record"]

#: Key of the compressed update inside a reply's ConfigRecord.
PAYLOAD_KEY = "payload"


def state_to_record(state: Mapping[str, np.ndarray]) -> ArrayRecord:
    """Wrap a feedback ``state_dict()`` as an ArrayRecord for ``context.state``."""
    return ArrayRecord({name: Array(np.ascontiguousarray(value))
                        for name, value in state.items()})


def record_to_state(record: ArrayRecord) -> dict[str, np.ndarray]:
    """Inverse of :func:`state_to_record`."""
    return {name: record[name].numpy() for name in record}


def payload_to_record(payload: bytes) -> ConfigRecord:
    """Put payload bytes in a ConfigRecord: 63 bytes of framing against 490 as an Array."""
    return ConfigRecord({PAYLOAD_KEY: payload})


def payload_from_record(record: ConfigRecord) -> bytes:
    """Extract payload bytes; a missing or non-bytes value raises ``ValueError``."""
    value = record.get(PAYLOAD_KEY)
    if not isinstance(value, bytes):
        raise ValueError(f"reply has no {PAYLOAD_KEY!r} bytes (got {type(value).__name__})")
    return value
