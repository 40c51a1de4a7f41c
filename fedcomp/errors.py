"""The two error types of fedcomp.

Two kinds of bad input reach the library, and they need different handling:

* :class:`SpecError` -- a user typed a bad codec spec or config (a typo in
  ``topk:ratio=2``). It is raised at start-up, before any round runs, and should stop
  the program with a message naming the bad value.
* :class:`PayloadError` -- bytes that arrived over the network are malformed,
  truncated, inconsistent or hostile. The server catches exactly this type, rejects
  that one update and goes on with the round. Every decoder in fedcomp turns every
  problem with untrusted input into this type and no other.

Both subclass :class:`ValueError`, so callers that already catch ``ValueError`` keep
working.
"""

from __future__ import annotations

__all__ = ["PayloadError", "SpecError"]


class SpecError(ValueError):
    """A codec spec string or codec config is invalid (user input, not network input)."""


class PayloadError(ValueError):
    """A payload received from the network is invalid and must be rejected.

    Parameters
    ----------
    message
        What was wrong, naming the field and the offending value.
    reason
        A short machine-readable tag (``"checksum"``, ``"truncated"``, ``"header"``,
        ``"shape"``, ``"indices"``, ``"non-finite"``, ``"size"``, ...) used to count
        rejections by reason in a run's results.
    """

    def __init__(self, message: str, *, reason: str = "invalid") -> None:
        super().__init__(message)
        self.reason = reason
