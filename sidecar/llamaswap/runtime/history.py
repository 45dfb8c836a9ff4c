"""The GPU's recent history for the page at /ui: what the queue view and the activity log's
`recent` records do not keep.

- the timeline of the last day: one entry per grant (the activity log's record of the request,
  plus the requests it overtook), per request that never got the GPU (a refusal, an expiry, a
  client gone while waiting: a mark), and per settle (the GPU waiting for the upstream);
- counters since the sidecar started: grants per band, reorders per cause, swaps and loads,
  endings per outcome, settles per reason, and how actual waits compare with their estimates.

An Observer, after the activity log in the observers' order: a request's record is the one the
log built when it finished (`ActivityLog.finished_record`: one format, one time base, built and
encoded once per request). Each entry is encoded to JSON once (a request's when it is first
read: never while no page reads the timeline) and kept in end-time order, bounded by age and
by count, so serving the last hour again is a join of bytes.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import statistics
from collections.abc import Iterator, Sequence
from typing import Any

from llamaswap.core import Band, Clock, Outcome, Policy
from llamaswap.runtime import json_line
from llamaswap.runtime.activity import ActivityLog
from llamaswap.runtime.kept import KeptEvent
from llamaswap.runtime.observer import IdleUnloaded, Overtaken, PictureSource, QueuePicture, Settle, SettleReason
from llamaswap.runtime.ticket import Ticket

# The timeline reaches back a day at most, and holds at most this many entries (about 1 KB each).
TIMELINE_SECONDS = 24 * 3600
TIMELINE_CAPACITY = 20_000
# Actual-to-estimated wait ratios kept for the counters' median; waits estimated below
# RATIO_MIN_ESTIMATE_S (a grant expected at once) say nothing about the estimator.
RATIO_SAMPLES = 1000
RATIO_MIN_ESTIMATE_S = 0.1
_encode = json_line.line
# An activity log file is read backwards in blocks of this size, for its last entries only.
_TAIL_BLOCK = 1 << 16
_log = logging.getLogger(__name__)


class Entry:
    """One timeline entry; never changed once made. A request's entry keeps its record's members
    (from the activity log's line) and joins its JSON (`body`) when first read, not when made:
    one is made per request, and none is read while no page is open (a page reads each once: the
    bytes are kept then). What it keeps until then is no object the garbage collector tracks (a
    grant that overtook nobody)."""

    __slots__ = ("seq", "kind", "request_id", "end_ms", "_body", "_members", "_start_ms", "_overtook")

    def __init__(self, seq: int, kind: str, request_id: str, end_ms: float, *, body: bytes | None = None,
                 members: bytes | None = None, start_ms: float | None = None,
                 overtook: Sequence[dict[str, Any]] = ()) -> None:
        self.seq = seq
        self.kind = kind  # grant | mark | settle
        self.request_id = request_id
        self.end_ms = end_ms  # Unix milliseconds
        self._body = body  # the entry as a JSON object, once made
        # Until then, a request's: its record's members (its line without the braces), and a
        # grant's start and the requests it overtook.
        self._members = members
        self._start_ms = start_ms
        self._overtook = overtook

    @property
    def body(self) -> bytes:
        """The entry as a JSON object."""
        body = self._body
        if body is None:
            body = self._body = self._joined()
            self._members, self._overtook = None, ()  # in the body now
        return body

    def document(self) -> dict[str, Any]:
        decoded: dict[str, Any] = json.loads(self.body)
        return decoded

    def _joined(self) -> bytes:
        """The bytes the encoder writes for {"seq", "kind", *the record's members, *the entry's own
        (a grant's start, end and overtaken requests; a mark's end)}: the record's members taken
        whole, comma-separated (no record names an entry's own key)."""
        record_members = self._members
        assert record_members is not None
        own: dict[str, Any]
        if self._start_ms is None:
            own = {"end_ms": self.end_ms}
        else:  # (an empty tuple is written as [], like a list)
            own = {"start_ms": self._start_ms, "end_ms": self.end_ms, "overtook": self._overtook}
        members = [b'{"seq":%d,"kind":"%b"' % (self.seq, self.kind.encode())]  # (`kind`: ASCII)
        if record_members:
            members.append(record_members)
        members.append(_encode(own)[1:-1])
        return b",".join(members) + b"}"


class _GpuCounts:
    """One upstream's (GPU's) grants, swaps and loads since the sidecar started."""

    __slots__ = ("dispatched", "swaps", "loads")

    def __init__(self) -> None:
        self.dispatched = self.swaps = self.loads = 0


class History:
    """An Observer that keeps the timeline and the counters the page shows."""

    def __init__(self, clock: Clock, activity: ActivityLog, *, capacity: int = TIMELINE_CAPACITY,
                 window_s: float = TIMELINE_SECONDS) -> None:
        self._clock = clock
        self._activity = activity
        self._capacity = max(1, capacity)
        self._window_ms = window_s * 1000
        self._entries: collections.deque[Entry] = collections.deque()
        self._seq = 0
        # What each running grant overtook, by its ticket's token, until it finishes (none: not kept).
        self._overtook: dict[str, list[dict[str, Any]]] = {}
        self._dispatched: collections.Counter[str] = collections.Counter({band.value: 0 for band in Band})
        self._reorders: collections.Counter[str] = collections.Counter()
        self._outcomes: collections.Counter[str] = collections.Counter()
        self._kept: collections.Counter[str] = collections.Counter()  # kept places, by event
        self._settles: collections.Counter[str] = collections.Counter()
        # Per upstream (GPU): grants, swaps and loads, in the order the upstreams first got one
        # (the node's swaps and loads are their sums).
        self._counts_by_gpu: dict[str, _GpuCounts] = {}
        self._ratios: collections.deque[float] = collections.deque(maxlen=RATIO_SAMPLES)
        self._actual_wait_s = 0.0
        self._estimated_wait_s = 0.0

    @property
    def seq(self) -> int:
        """The last entry's sequence number: it changes whenever the timeline or a counter does."""
        return self._seq

    def now_ms(self) -> float:
        return self._activity.unix_ms(self._clock.now_ns())

    def entries(self, *, since_ms: float | None = None, after_seq: int = 0) -> list[Entry]:
        """Entries that ended at or after `since_ms` with a sequence number above `after_seq`, oldest first."""
        picked: list[Entry] = []
        for entry in reversed(self._entries):
            if entry.seq <= after_seq or (since_ms is not None and entry.end_ms < since_ms):
                break
            picked.append(entry)
        picked.reverse()
        return picked

    def of_request(self, request_id: str) -> Iterator[Entry]:
        """The entries of one request id, oldest first (an id a client reused has several)."""
        return (entry for entry in self._entries if entry.request_id == request_id)

    def counters(self) -> dict[str, Any]:
        ratios = list(self._ratios)
        estimated_s = self._estimated_wait_s
        return {
            "dispatched": dict(self._dispatched),
            "reorders": dict(self._reorders),
            "swaps": sum(counts.swaps for counts in self._counts_by_gpu.values()),
            "loads": sum(counts.loads for counts in self._counts_by_gpu.values()),
            "upstreams": {name: {"dispatched": counts.dispatched, "swaps": counts.swaps, "loads": counts.loads}
                          for name, counts in self._counts_by_gpu.items()},
            "outcomes": dict(self._outcomes),
            "kept_places": dict(self._kept),
            "settles": dict(self._settles),
            "estimate": {
                # Actual wait / estimated wait at arrival, over the last RATIO_SAMPLES grants that had one.
                "median_ratio": round(statistics.median(ratios), 3) if ratios else None,
                "samples": len(ratios),
                "total_ratio": round(self._actual_wait_s / estimated_s, 3) if estimated_s else None,
            },
        }

    def load(self, path: str) -> int:
        """Seed the timeline with the last day of an activity log file (`activity.path`), so a
        restarted sidecar still shows it; the counters stay those of this process. Returns how
        many entries it added. The file has no overtaken requests and settles only as the
        abandoned requests' `settle_ms` (a stopped line's: reason `stopped`)."""
        try:
            lines = _last_lines(path, self._capacity)
        except OSError as exc:
            _log.warning("the timeline starts empty: reading the activity log %s failed: %s", path, exc)
            return 0
        oldest_ms = self.now_ms() - self._window_ms
        added = 0
        for line in lines:
            try:
                record = json.loads(line)
                if not isinstance(record, dict) or record.get("event") != "request":
                    continue
                request_id = str(record["request_id"])
                end_ms = float(record["time"]) * 1000
                granted_ms = record.get("granted_unix_ms")
                settle_ms = float(record.get("settle_ms") or 0.0)
            except (ValueError, KeyError, TypeError):
                continue  # a torn or foreign line: the rest still counts
            if end_ms < oldest_ms:
                continue
            if record.get("dispatched") and isinstance(granted_ms, (int, float)):
                self._add("grant", request_id, end_ms, record,
                          {"start_ms": granted_ms, "end_ms": end_ms, "overtook": []})
                if settle_ms > 0:
                    reason = SettleReason.after(str(record.get("outcome")))
                    self._add("settle", request_id, end_ms + settle_ms, {
                        "request_id": request_id, "reason": reason.value, "result": "-", "model": record.get("model"),
                        "upstream": record.get("upstream"), "start_ms": end_ms, "end_ms": round(end_ms + settle_ms, 3),
                        "settle_ms": settle_ms})
                    added += 1
            else:
                self._add("mark", request_id, end_ms, record, {"end_ms": end_ms})
            added += 1
        return added

    # -- Observer ------------------------------------------------------------------------

    def enqueued(self, ticket: Ticket) -> None:
        pass

    def dispatched(self, ticket: Ticket, overtaken: tuple[Overtaken, ...]) -> None:
        if overtaken:  # (most grants overtake nobody: nothing kept, `finished` reads none)
            self._overtook[ticket.token] = [{"request_id": o.request_id, "priority": o.priority,
                                             "band": o.band.value} for o in overtaken]
        # Counted at the grant, so the running grants are in the counters too.
        decision = ticket.decision
        if decision is not None:
            # (`_value_`: the member's value, without the Enum property's Python call)
            self._dispatched[decision.band._value_] += 1
            for cause in decision.reordered_by:
                self._reorders[str(cause)] += 1
            counts = self._counts_by_gpu.get(decision.gpu)
            if counts is None:
                counts = self._counts_by_gpu[decision.gpu] = _GpuCounts()
            counts.dispatched += 1
            if decision.swap:  # (most grants neither swap nor load)
                counts.swaps += 1
            if decision.load:
                counts.loads += 1

    def reads_queue(self, pictures: PictureSource) -> None:
        pass

    def queue_changed(self, picture: QueuePicture) -> None:
        pass

    def watchdog_fired(self, ticket: Ticket) -> None:
        pass

    def settings_changed(self, policy: Policy) -> None:
        pass

    def kept_place(self, event: KeptEvent) -> None:
        self._kept[event.kind.value] += 1

    def line_stopped(self, line: Ticket, waiting: Ticket | None, tokens_kept: int | None) -> None:
        pass  # (its end, stopped, is in the timeline)

    def idle_unloaded(self, unload: IdleUnloaded) -> None:
        pass  # (the activity log keeps it: GET /activity?event=eviction)

    def finished(self, ticket: Ticket) -> None:
        record, line = self._activity.finished_record(ticket)  # the activity log's, built and encoded once
        outcome = ticket.outcome or Outcome.INTERNAL_ERROR
        self._outcomes[outcome._value_] += 1
        decision = ticket.decision
        end_ms = self._activity.unix_ms_rounded(ticket.ended_ns)  # `time` is in whole milliseconds
        if decision is None:
            self._add_record("mark", ticket.request_id, end_ms, line)
            return
        estimated = ticket.estimated_wait_s
        if estimated is not None and estimated >= RATIO_MIN_ESTIMATE_S:
            actual = decision.queue_wait_ns / 1e9
            self._ratios.append(actual / estimated)
            self._actual_wait_s += actual
            self._estimated_wait_s += estimated
        # (None overtaken, most: the empty tuple, nothing for the garbage collector to track)
        self._add_record("grant", ticket.request_id, end_ms, line, record["granted_unix_ms"],
                         self._overtook.pop(ticket.token, ()))

    def settled(self, settle: Settle) -> None:
        self._settles[settle.reason.value] += 1
        start_ms = self._activity.unix_ms_rounded(settle.started_ns)
        end_ms = self._activity.unix_ms_rounded(settle.ended_ns)
        self._add("settle", settle.request_id, end_ms, {
            "request_id": settle.request_id, "reason": settle.reason.value, "result": settle.result.value,
            "model": settle.model, "upstream": settle.gpu, "start_ms": start_ms, "end_ms": end_ms,
            "settle_ms": round(settle.seconds * 1000, 3),
        })

    # -- internals -----------------------------------------------------------------------

    def _add(self, kind: str, request_id: str, end_ms: float, document: dict[str, Any],
             extra: dict[str, Any] | None = None) -> None:
        """An entry encoded now: `document` with `extra` after it, which wins where both name a key."""
        self._seq += 1
        encoded = _encode({"seq": self._seq, "kind": kind, **document, **(extra or {})})
        # Kept as a copy of its size: orjson's bytes hold on to its buffer, two pages where the line
        # is about 1 KB (a day's timeline loaded from the file: 176 MB more peak memory, not 36).
        self._keep(Entry(self._seq, kind, request_id, end_ms, body=bytes(memoryview(encoded))))

    def _add_record(self, kind: str, request_id: str, end_ms: float, line: bytes, start_ms: float | None = None,
                    overtook: Sequence[dict[str, Any]] = ()) -> None:
        """A request's entry from the activity log's line of its record (not encoded again), with
        a grant's start and overtaken requests (`start_ms` None: a mark)."""
        self._seq += 1
        # A copy of the members, not the line: the line holds on to orjson's buffer (two pages),
        # and keeping it left each next line's buffer to fresh memory, two page faults a request.
        self._keep(Entry(self._seq, kind, request_id, end_ms, members=line[1:-1], start_ms=start_ms,
                         overtook=overtook))

    def _keep(self, entry: Entry) -> None:
        entries = self._entries
        entries.append(entry)
        oldest_ms = entry.end_ms - self._window_ms
        while entries and (len(entries) > self._capacity or entries[0].end_ms < oldest_ms):
            entries.popleft()


def _last_lines(path: str, count: int) -> list[bytes]:
    """The last `count` lines of a file, reading only as much of its end as they take."""
    with open(path, "rb") as file:
        end = file.seek(0, os.SEEK_END)
        position = end
        data = b""
        while position > 0 and data.count(b"\n") <= count:
            step = min(_TAIL_BLOCK, position)
            position -= step
            file.seek(position)
            data = file.read(step) + data
    lines = data.split(b"\n")
    if position > 0:
        lines = lines[1:]  # the first one is cut
    return [line for line in lines if line.strip()][-count:]
