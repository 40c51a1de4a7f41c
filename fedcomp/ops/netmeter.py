"""Bytes a process's TCP connections carried, as the Linux kernel counts them.

A deployed node's real cost is what crosses the network, not only fedcomp's payloads:
Flower adds HTTP requests, headers, TLS records and polls. The SuperNode's traffic is
Flower's own (its HTTP client lives in the ``flower-supernode`` process), so fedcomp
cannot count it where it is written. The kernel can: every TCP socket keeps
``tcpi_bytes_sent`` and ``tcpi_bytes_received`` (``struct tcp_info``, Linux 4.19+),
the bytes of TCP payload it sent (retransmissions included) and received, which is
what a packet capture would count above the TCP header. :class:`TcpByteMeter` reads
them through the kernel's socket-diagnostics netlink interface (what ``ss -ti``
uses; no privilege needed), for the sockets one process holds towards one remote
port, and keeps the last counts of connections that close (Flower's HTTP client
opens a new one after an idle timeout), so its totals only grow.

Written by hand because no library on the package index reads ``tcp_info`` of
another process's sockets (``psutil`` lists connections without byte counts), and
the netlink request is a few structs.

Sampling is exact for a connection that is still open or was idle when last sampled;
a connection that carries bytes and closes within one ``interval`` would lose them,
which Flower's keep-alive connections do not do.
"""

from __future__ import annotations

import os
import socket
import struct
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["TcpByteMeter", "TcpCounts", "meter_available", "process_socket_inodes",
           "tcp_sockets"]

_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLM_F_REQUEST, _NLM_F_DUMP = 0x1, 0x300
_NLMSG_ERROR, _NLMSG_DONE = 2, 3
_INET_DIAG_INFO = 2
_NLMSG_HEADER = struct.Struct("=IHHII")
#: ``struct inet_diag_req_v2`` with an all-zero socket id: every TCP socket, every state.
_REQUEST = struct.Struct("=BBBBI48x")
#: ``struct inet_diag_msg``: family, state, timer, retrans, then ``inet_diag_sockid``
#: (ports big-endian, addresses, interface, cookie), expires, rqueue, wqueue, uid, inode.
_DIAG_MSG_SIZE = 72
_PORTS = struct.Struct("!HH")
_COOKIE = struct.Struct("=Q")
_INODE = struct.Struct("=I")
_ATTRIBUTE = struct.Struct("=HH")
#: Offsets in ``struct tcp_info``: ``tcpi_bytes_received`` and ``tcpi_bytes_sent``.
_BYTES_RECEIVED_AT, _BYTES_SENT_AT = 128, 200
_U64 = struct.Struct("=Q")


@dataclass(frozen=True)
class TcpCounts:
    """TCP payload bytes sent and received (one socket, or a total)."""

    sent: int = 0
    received: int = 0

    def __add__(self, other: TcpCounts) -> TcpCounts:
        return TcpCounts(self.sent + other.sent, self.received + other.received)


@dataclass(frozen=True)
class TcpSocket:
    """One TCP socket as the kernel reports it."""

    cookie: int
    inode: int
    local_port: int
    remote_port: int
    counts: TcpCounts


def _dump(family: int) -> list[TcpSocket]:
    request = _REQUEST.pack(family, socket.IPPROTO_TCP, 1 << (_INET_DIAG_INFO - 1), 0,
                            0xFFFFFFFF)
    header = _NLMSG_HEADER.pack(_NLMSG_HEADER.size + len(request), _SOCK_DIAG_BY_FAMILY,
                                _NLM_F_REQUEST | _NLM_F_DUMP, 1, 0)
    found: list[TcpSocket] = []
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, _NETLINK_SOCK_DIAG) as link:
        link.sendto(header + request, (0, 0))
        while True:
            data = link.recv(1 << 17)
            if not data:
                return found
            offset = 0
            while offset + _NLMSG_HEADER.size <= len(data):
                length, kind = _NLMSG_HEADER.unpack_from(data, offset)[:2]
                if kind == _NLMSG_DONE:
                    return found
                if kind == _NLMSG_ERROR:
                    raise OSError("the kernel refused the socket-diagnostics request")
                body = data[offset + _NLMSG_HEADER.size:offset + length]
                if len(body) >= _DIAG_MSG_SIZE:
                    found.append(_socket(body))
                offset += (length + 3) & ~3


def _socket(body: bytes) -> TcpSocket:
    local_port, remote_port = _PORTS.unpack_from(body, 4)
    cookie = _COOKIE.unpack_from(body, 4 + 4 + 32 + 4)[0]
    inode = _INODE.unpack_from(body, _DIAG_MSG_SIZE - 4)[0]
    counts = TcpCounts()
    offset = _DIAG_MSG_SIZE
    while offset + _ATTRIBUTE.size <= len(body):
        length, kind = _ATTRIBUTE.unpack_from(body, offset)
        if length < _ATTRIBUTE.size:
            break
        if kind == _INET_DIAG_INFO and length - 4 >= _BYTES_SENT_AT + 8:
            info = body[offset + 4:offset + length]
            counts = TcpCounts(sent=_U64.unpack_from(info, _BYTES_SENT_AT)[0],
                               received=_U64.unpack_from(info, _BYTES_RECEIVED_AT)[0])
        offset += (length + 3) & ~3
    return TcpSocket(cookie, inode, local_port, remote_port, counts)


def tcp_sockets() -> list[TcpSocket]:
    """Every TCP socket of this host (IPv4 and IPv6) with its byte counts."""
    return _dump(socket.AF_INET) + _dump(socket.AF_INET6)


def process_socket_inodes(pid: int) -> set[int]:
    """Inodes of the sockets process ``pid`` holds open (its ``/proc/<pid>/fd``)."""
    inodes = set()
    folder = Path(f"/proc/{pid}/fd")
    for entry in folder.iterdir():
        try:
            target = os.readlink(entry)
        except OSError:  # closed between listing and reading
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def meter_available() -> bool:
    """Whether this host lets :func:`tcp_sockets` read byte counts (Linux 4.19+)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        _dump(socket.AF_INET)
    except OSError:
        return False
    return True


class TcpByteMeter:
    """Bytes one process's TCP connections to one remote port carried, per direction.

    Parameters
    ----------
    pid
        The process whose sockets count (a SuperNode).
    remote_port
        The port its connections dial (the SuperLink's).
    interval
        Seconds between two samples while :meth:`start`-ed: connections that close are
        kept at their last sampled counts.

    Notes
    -----
    :meth:`totals` samples once more, so a total read at a moment is exact for the
    connections open then. Counts only grow; they start at the meter's creation
    (connections already open count from their first byte).
    """

    def __init__(self, pid: int, remote_port: int, *, interval: float = 0.2) -> None:
        if not 0 < remote_port < 65536:
            raise ValueError(f"remote_port must be in 1-65535, got {remote_port}")
        if not 0.0 < interval <= 60.0:
            raise ValueError(f"interval must be in (0, 60] seconds, got {interval}")
        self.pid, self.remote_port, self.interval = pid, remote_port, interval
        #: When counting began (seconds since the epoch): tells this meter's totals
        #: from those of a meter that a restarted node began afresh.
        self.started_at = time.time()
        self._open: dict[int, TcpCounts] = {}
        self._closed = TcpCounts()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> TcpCounts:
        """Read the kernel's counts now; return the totals so far."""
        inodes = process_socket_inodes(self.pid)
        seen = {s.cookie: s.counts for s in tcp_sockets()
                if s.remote_port == self.remote_port and s.inode in inodes}
        with self._lock:
            for cookie, counts in self._open.items():
                if cookie not in seen:  # closed since the last sample
                    self._closed = self._closed + counts
            self._open = seen
            total = self._closed
            for counts in seen.values():
                total = total + counts
            return total

    def totals(self) -> TcpCounts:
        """The totals now (an alias of :meth:`sample` that reads as what it returns)."""
        return self.sample()

    def start(self) -> TcpByteMeter:
        """Sample every ``interval`` seconds in a daemon thread until :meth:`stop`."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="tcp-byte-meter",
                                            daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.sample()
            except OSError:  # the process is gone: the last counts stand
                return
