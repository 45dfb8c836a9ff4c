"""Stopping Batch API lines for a higher band, the runtime's side (issue 46): the scheduler says
which running grants to stop (`core/preemption.py`); their owner stops them, and the place of each
is kept for the line sent again to resume where it stopped.

- Which requests may be stopped: those `Lines.key_of` gives a key (a line of the Batch API that
  its feeder can stop at a token and send again), asked once at admission (`key_of`). A line is
  queued with that key as its retry key, so a line sent again after a stop takes back the place
  its stop kept: its first arrival and order (the kept places' rule, `core/kept.py`).
- The stops: after each round of grants (`Grants.pump`), each stop the scheduler ordered is asked
  of the lines' owner (`Lines.stop`, by the line's x-request-id). One it refuses (the line is
  ending, or cannot be stopped after all) runs on; the scheduler's order ends with its release.
- Its end: the feeder closes the line's stream, so Envoy reports a client that left. That end,
  of a line being stopped, is `Outcome.STOPPED` (the upstream may still be at its token: settled,
  `SettleReason.STOPPED`, without unloading, and one answer of the upstream ends that settle:
  `Settling.lets_go_at_token`), and the release keeps the line's place under its key for
  ``grace_ns`` (`routing.retryGraceSeconds`, at least a minute: the feeder sends it again at once).
  A line that ended on its own first ends as it ended: nothing doubled.
- Seen: each line's progress (`Lines.progress`: its stops so far and its tokens) is on its row of
  the queue (`views.py`), so GET /queue, the page and `llamaswap queue` show a stopped line
  waiting with the tokens it kept.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Protocol

from llamaswap.core import NS_PER_S, Scheduler
from llamaswap.runtime.ticket import ExchangeEnd, Ticket

_log = logging.getLogger(__name__)

# The least a stopped line's place is kept: it is sent again as soon as its stream has closed.
KEEP_STOPPED_MIN_NS = 60 * NS_PER_S


class LineProgress(Protocol):
    """How far a line has come (the feeder's `LineState` is one)."""

    @property
    def stops(self) -> int:
        """The times it was stopped so far."""

    @property
    def tokens(self) -> int:
        """Its answer's tokens so far: those its stops kept while it waits; with those its running
        part has read while it runs."""

    @property
    def stopping(self) -> bool:
        """A stop was asked of its running part, which has not let go yet (it stops at its next
        token; its own end may still come first)."""


class Lines(Protocol):
    """The lines in flight that their owner can stop and resume (the Batch API's feeder)."""

    def key_of(self, request_id: str) -> bytes | None:
        """The key a stoppable line's place is kept under (the same for each of its sends);
        None: not such a line."""

    def may_stop(self, request_id: str) -> bool:
        """A line with a key that may still be stopped (not yet stopped batches.maxPreemptions
        times: after that it runs to its end, its key still taking its place back)."""

    def stop(self, request_id: str) -> bool:
        """Stop the running line ``request_id`` at its next token and send it again to resume;
        False: not a running stoppable line (it may be ending)."""

    def progress(self, request_id: str) -> LineProgress | None:
        """The line's progress now; None: not a line its owner can stop (any other request)."""


class NoLines:
    """No Batch API: nothing is ever stopped."""

    def key_of(self, request_id: str) -> bytes | None:
        return None

    def may_stop(self, request_id: str) -> bool:
        return False

    def stop(self, request_id: str) -> bool:
        return False

    def progress(self, request_id: str) -> LineProgress | None:
        return None


@dataclasses.dataclass(frozen=True, slots=True)
class StopTaken:
    """A stop that took effect (the line's part ended stopped, not at its own end): the key its
    place is kept under, the request it made room for (None: that one left since) and the
    tokens the line keeps (None: its owner no longer says)."""

    key: bytes
    waiting: Ticket | None
    tokens_kept: int | None


class LineStops:
    """The stops asked of the lines' owner and not yet ended, by ticket token."""

    def __init__(self, scheduler: Scheduler, tickets: dict[str, Ticket], lines: Lines) -> None:
        self._scheduler = scheduler
        self._tickets = tickets
        self._lines = lines
        # token -> the line being stopped, and the request it is stopped for
        self._stopping: dict[str, tuple[Ticket, Ticket | None]] = {}
        # By line key: done when the stopped part's grant has ended (its place is kept by then).
        self._ends: dict[bytes, asyncio.Future[None]] = {}

    def key_of(self, ticket: Ticket) -> bytes | None:
        """At admission: the key of a stoppable line (its retry key), None for any other request."""
        if ticket.request_id == "-":
            return None
        return self._lines.key_of(ticket.request_id)

    def may_stop(self, ticket: Ticket) -> bool:
        """At admission, for a line (a key): whether its grant may be stopped."""
        return ticket.line_key is not None and self._lines.may_stop(ticket.request_id)

    def ask(self) -> int:
        """The scheduler's new stop orders, each asked of the lines' owner; how many it took. A
        stop is seen (its record, the count, the span events) once it took effect (`ended`): a
        line that comes to its own end first was not stopped."""
        asked = 0
        for stop in self._scheduler.stops():
            line = self._tickets.get(stop.request_id)
            if line is None or line.line_key is None:
                continue  # ended meanwhile
            if not self._lines.stop(line.request_id):
                _log.info("line %s was not stopped (ending, or not stoppable after all)", line.request_id)
                continue
            self._stopping[line.token] = (line, self._tickets.get(stop.for_request))
            if line.line_key is not None:
                self._ends[line.line_key] = asyncio.get_running_loop().create_future()
            asked += 1
        return asked

    def stopping(self, ticket: Ticket) -> bool:
        return ticket.token in self._stopping

    def ending(self, line_key: bytes | None) -> asyncio.Future[None] | None:
        """While a part of the line ``line_key`` is being stopped: done once it has ended (its
        place kept); None otherwise. Its next part waits for it before it is queued."""
        if line_key is None:
            return None
        end = self._ends.get(line_key)
        return None if end is None or end.done() else asyncio.shield(end)

    def ended(self, ticket: Ticket) -> StopTaken | None:
        """A line's grant ends: the stop, if it was being stopped and did not come to its own end
        first (an exchange that completed is the line's answer: nothing to resume)."""
        stopping = self._stopping.pop(ticket.token, None)
        if stopping is None:
            return None
        end = self._ends.pop(ticket.line_key, None) if ticket.line_key is not None else None
        if end is not None and not end.done():
            end.set_result(None)  # (its next part is queued after this release: `Admitter`)
        if ticket.end is ExchangeEnd.COMPLETE or ticket.line_key is None:
            return None
        progress = self._lines.progress(ticket.request_id)
        return StopTaken(ticket.line_key, stopping[1], progress.tokens if progress is not None else None)
