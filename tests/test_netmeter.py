"""The kernel's TCP byte counts: exact for known traffic, kept when a connection closes."""

from __future__ import annotations

import os
import socket

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedcomp.ops.netmeter import (
    TcpByteMeter,
    TcpCounts,
    meter_available,
    process_socket_inodes,
    tcp_sockets,
)

pytestmark = pytest.mark.skipif(not meter_available(),
                                reason="no socket diagnostics (Linux 4.19+) on this host")


@pytest.fixture()
def listener():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    yield server
    server.close()


def _exchange(listener: socket.socket, up: int, down: int) -> tuple[socket.socket, socket.socket]:
    """A connection to ``listener`` that sent ``up`` bytes and received ``down``."""
    client = socket.create_connection(listener.getsockname())
    accepted, _ = listener.accept()
    client.sendall(b"u" * up)
    got = 0
    while got < up:
        got += len(accepted.recv(1 << 16))
    accepted.sendall(b"d" * down)
    got = 0
    while got < down:
        got += len(client.recv(1 << 16))
    return client, accepted


def test_a_socket_reports_the_bytes_it_carried(listener):
    client, accepted = _exchange(listener, 1000, 500)
    try:
        mine = [s for s in tcp_sockets() if s.local_port == client.getsockname()[1]]
        assert [s.counts for s in mine] == [TcpCounts(sent=1000, received=500)]
        assert mine[0].inode == os.fstat(client.fileno()).st_ino
        assert mine[0].inode in process_socket_inodes(os.getpid())
    finally:
        client.close()
        accepted.close()


@settings(max_examples=10, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 200_000), st.integers(0, 50_000)),
                min_size=1, max_size=4))
def test_the_meter_totals_every_connection_also_after_it_closed(exchanges):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    meter = TcpByteMeter(os.getpid(), server.getsockname()[1])
    try:
        assert meter.sample() == TcpCounts()
        expected = TcpCounts()
        for up, down in exchanges:
            client, accepted = _exchange(server, up, down)
            expected = expected + TcpCounts(up, down)
            # The server side of the connection dials no one: it does not count.
            assert meter.sample() == expected
            client.close()
            accepted.close()
        assert meter.sample() == expected  # closed connections keep their counts
    finally:
        server.close()


def test_only_the_given_process_and_port_count(listener):
    other = socket.socket()
    other.bind(("127.0.0.1", 0))
    other.listen()
    client, accepted = _exchange(other, 300, 300)
    try:
        assert TcpByteMeter(os.getpid(), listener.getsockname()[1]).sample() == TcpCounts()
        parent = TcpByteMeter(os.getppid(), other.getsockname()[1])
        assert parent.sample() == TcpCounts()
        assert TcpByteMeter(os.getpid(), other.getsockname()[1]).sample() == TcpCounts(300, 300)
    finally:
        for sock in (client, accepted, other):
            sock.close()


def test_a_background_meter_keeps_a_connection_that_closed_between_reads(listener):
    meter = TcpByteMeter(os.getpid(), listener.getsockname()[1], interval=0.01).start()
    try:
        client, accepted = _exchange(listener, 4096, 2048)
        meter.sample()
        client.close()
        accepted.close()
        assert meter.totals() == TcpCounts(4096, 2048)
    finally:
        meter.stop()


@pytest.mark.parametrize("kwargs", [{"remote_port": 0}, {"remote_port": 70000},
                                    {"remote_port": 80, "interval": 0.0}])
def test_bad_settings_are_refused_by_name(kwargs):
    name = "interval" if "interval" in kwargs else "remote_port"
    with pytest.raises(ValueError, match=name):
        TcpByteMeter(os.getpid(), **kwargs)
