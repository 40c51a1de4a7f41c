"""PromptGrid: replies collected as soon as they arrive, within the timeout."""

from __future__ import annotations

from types import SimpleNamespace

from fedcomp.flower.grid import POLL_INTERVALS, PromptGrid


class FakeGrid:
    """Replies to message i become available after ``ready[i]`` seconds."""

    def __init__(self, ready: list[float], clock: list[float]) -> None:
        self.ready, self.clock, self.pulls = ready, clock, 0

    def push_messages(self, messages):
        return [f"m{i}" for i, _ in enumerate(messages)]

    def pull_messages(self, ids):
        self.pulls += 1
        now = self.clock[0]
        return [SimpleNamespace(metadata=SimpleNamespace(reply_to_message_id=i))
                for i in sorted(ids) if self.ready[int(i[1:])] <= now]

    def get_node_ids(self):
        return [1, 2]


def _grid(ready):
    clock = [0.0]

    def sleep(seconds):
        clock[0] += seconds

    inner = FakeGrid(ready, clock)
    return PromptGrid(inner, sleep=sleep, clock=lambda: clock[0]), inner, clock


def test_replies_are_collected_within_one_short_poll_of_arriving():
    grid, _, clock = _grid([0.0, 0.7, 1.3])
    replies = grid.send_and_receive([object()] * 3, timeout=600)
    assert sorted(r.metadata.reply_to_message_id for r in replies) == ["m0", "m1", "m2"]
    # Flower's deployment grid would have returned at its 3-second tick.
    assert 1.3 <= clock[0] <= 1.3 + POLL_INTERVALS[-1]
    assert grid.get_node_ids() == [1, 2]  # everything else is the wrapped grid's


def test_the_timeout_ends_the_wait_with_what_arrived_after_a_last_poll():
    grid, _, clock = _grid([0.1, 5.0, float("inf")])
    replies = grid.send_and_receive([object()] * 3, timeout=5.0)
    assert sorted(r.metadata.reply_to_message_id for r in replies) == ["m0", "m1"]
    assert clock[0] == 5.0


def test_without_a_timeout_it_waits_for_every_reply():
    grid, inner, _ = _grid([30.0])
    assert len(grid.send_and_receive([object()], timeout=None)) == 1
    # About one pull per 0.2 s of waiting: never a busy loop, never a 3-second nap.
    assert abs(inner.pulls - 30.0 / POLL_INTERVALS[-1]) <= len(POLL_INTERVALS) + 1
