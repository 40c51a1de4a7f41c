"""Wire bytes per node and round, from the counters deployed nodes report.

A deployed node's ClientApp worker adds to every reply the TCP bytes its SuperNode has
sent to and received from the SuperLink so far (:mod:`fedcomp.ops.netmeter`). Those
counters only grow; :class:`WireLedger` turns two consecutive ones of a node into the
bytes of the window between them. The window that ends with a node's train reply in
round ``r`` holds:

* up: the node's previous reply (whose payload the ledger remembers), its idle polls
  and heartbeats, and its requests for round ``r``'s message;
* down: round ``r``'s train message (whose payload the server knows) and the answers
  to those requests.

So each window's protocol bytes are its wire bytes less exactly the payloads that
crossed in it. A node's first window starts at its answer to the server's partition
query (or, without one, its first train reply, whose window is then not known). A
node that restarted counts afresh (its counters say since when): its next reply opens
no window. The
counts are what the node reports: they are checked for type and range like every
metric, and a node could misreport them, but they never reach the model.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["WireLedger", "WireWindow"]


@dataclass(frozen=True)
class WireWindow:
    """One node's bytes on the wire between two of its replies, and the payloads in them."""

    up: int
    down: int
    payload_up: int
    payload_down: int

    @property
    def protocol_up(self) -> int:
        """What Flower, HTTP and TLS added to the payloads going up."""
        return self.up - self.payload_up

    @property
    def protocol_down(self) -> int:
        return self.down - self.payload_down


@dataclass
class _Last:
    sent: int
    received: int
    since: float
    payload_up: int


class WireLedger:
    """Each node's last wire counters, turned into windows as replies arrive."""

    def __init__(self) -> None:
        self._last: dict[int, _Last] = {}

    def start(self, node: int, sent: int, received: int, since: float) -> None:
        """A node's counters at a reply that carried no payload (its query reply)."""
        self._last[node] = _Last(int(sent), int(received), float(since), 0)

    def window(self, node: int, sent: int, received: int, since: float, *,
               payload_up: int, payload_down: int) -> WireWindow | None:
        """The window a train reply closes; None for a node's first report, or when its
        counters began anew (``since`` changed, or they went back).

        ``payload_up`` is this reply's payload (it goes up in the next window);
        ``payload_down`` the train message this reply answers.
        """
        last = self._last.get(node)
        self._last[node] = _Last(int(sent), int(received), float(since), int(payload_up))
        if (last is None or since != last.since or sent < last.sent
                or received < last.received):
            return None
        return WireWindow(up=int(sent) - last.sent, down=int(received) - last.received,
                          payload_up=last.payload_up, payload_down=int(payload_down))

    def forget(self, node: int) -> None:
        """A node failed or fell silent: where its counters stand is not known."""
        self._last.pop(node, None)
