"""A Grid that collects replies as soon as they arrive.

Flower 1.42's deployment grid (``flwr/superlink/grid/http_grid.py``) sleeps 3 s between
reply polls in ``send_and_receive``, so a round whose replies are all in after 0.5 s
still waits until the next 3-second tick. :class:`PromptGrid` wraps any grid and
implements ``send_and_receive`` with Flower's public ``push_messages`` and
``pull_messages``, polling after 0.05, 0.1, then every 0.2 s. On loopback a pull is a
few milliseconds; against a remote SuperLink, five small signed requests a second
while a round is open. Everything else goes to the wrapped grid unchanged.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from flwr.app import Message
from flwr.serverapp import Grid
from flwr.supercore.run import Run

__all__ = ["POLL_INTERVALS", "PromptGrid"]

#: Seconds between reply polls: the first ones short, then this many seconds each.
POLL_INTERVALS = (0.05, 0.1, 0.2)


class PromptGrid(Grid):
    """``grid`` with a ``send_and_receive`` that polls every 0.2 s (see the module)."""

    def __init__(self, grid: Grid, *, sleep: Callable[[float], None] = time.sleep,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.inner = grid
        self._sleep = sleep
        self._clock = clock

    def set_run(self, run: Run) -> None:
        self.inner.set_run(run)

    @property
    def run(self) -> Run:
        return self.inner.run

    def create_message(self, *args: Any, **kwargs: Any) -> Message:
        return self.inner.create_message(*args, **kwargs)

    def get_node_ids(self) -> Iterable[int]:
        return self.inner.get_node_ids()

    def get_nodes(self) -> Iterable[Any]:
        return self.inner.get_nodes()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        return self.inner.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return self.inner.pull_messages(message_ids)

    def send_and_receive(self, messages: Iterable[Message], *,
                         timeout: float | None = None) -> Iterable[Message]:
        """Push ``messages``, then pull replies until all arrived or ``timeout``
        seconds passed (None: wait for all), as Flower's own grids do."""
        waiting = set(self.push_messages(messages))
        deadline = None if timeout is None else self._clock() + timeout
        replies: list[Message] = []
        polls = 0
        while waiting:
            pulled = list(self.pull_messages(waiting))
            replies.extend(pulled)
            waiting.difference_update(m.metadata.reply_to_message_id for m in pulled)
            if not waiting:
                break
            pause = POLL_INTERVALS[min(polls, len(POLL_INTERVALS) - 1)]
            polls += 1
            if deadline is not None:
                left = deadline - self._clock()
                if left <= 0:
                    break
                pause = min(pause, left)
            self._sleep(pause)
        return replies
