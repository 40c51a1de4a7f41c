"""Wire counters into windows: each window's protocol bytes are its wire bytes less
exactly the payloads that crossed in it."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from fedcomp.federated.wire_bytes import WireLedger, WireWindow


def test_windows_pair_the_previous_reply_up_and_this_rounds_message_down():
    ledger = WireLedger()
    ledger.start(7, sent=1_000, received=5_000, since=1.0)  # the query reply: no payload
    first = ledger.window(7, 3_000, 20_000, 1.0, payload_up=400, payload_down=11_000)
    assert first == WireWindow(up=2_000, down=15_000, payload_up=0, payload_down=11_000)
    second = ledger.window(7, 6_500, 32_000, 1.0, payload_up=450, payload_down=9_000)
    # Round 1's reply (400 bytes) went up in the window that round 2's reply closes.
    assert second == WireWindow(up=3_500, down=12_000, payload_up=400, payload_down=9_000)
    assert (second.protocol_up, second.protocol_down) == (3_100, 3_000)


def test_a_first_report_a_restarted_counter_or_a_forgotten_node_opens_no_window():
    ledger = WireLedger()
    assert ledger.window(1, 100, 100, 1.0, payload_up=10, payload_down=10) is None
    assert ledger.window(1, 50, 500, 1.0, payload_up=10, payload_down=10) is None  # went back
    assert ledger.window(1, 80, 900, 1.0, payload_up=10, payload_down=10) is not None
    # A restarted node counts afresh: even counts above the last open no window.
    assert ledger.window(1, 90, 950, 2.0, payload_up=10, payload_down=10) is None
    assert ledger.window(1, 95, 990, 2.0, payload_up=10, payload_down=10) is not None
    ledger.forget(1)  # it failed: its last window's payloads are not known
    assert ledger.window(1, 200, 2_000, 2.0, payload_up=10, payload_down=10) is None
    assert ledger.window(2, 1, 1, 1.0, payload_up=0, payload_down=0) is None  # nodes apart


@given(st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 10**6),
                          st.integers(0, 10**5), st.integers(0, 10**5)), min_size=1,
                max_size=20))
def test_windows_add_up_to_the_counters_and_the_payloads_sent_before_the_last(steps):
    """Over any run of replies, the windows sum to the last counters less the first,
    their payloads up to every reply's payload but the last (still to go up), their
    payloads down to every message's."""
    ledger, sent, received = WireLedger(), 0, 0
    ledger.start(3, 0, 0, 5.0)
    windows = []
    for add_up, add_down, payload_up, payload_down in steps:
        sent, received = sent + add_up, received + add_down
        windows.append(ledger.window(3, sent, received, 5.0, payload_up=payload_up,
                                     payload_down=payload_down))
    assert sum(w.up for w in windows) == sent
    assert sum(w.down for w in windows) == received
    assert sum(w.payload_up for w in windows) == sum(s[2] for s in steps[:-1])
    assert sum(w.payload_down for w in windows) == sum(s[3] for s in steps)
