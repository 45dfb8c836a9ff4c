"""The activity log: one JSON line per finished request (dispatched or not), one per resident
model a grant unloaded to make room for its own (an `eviction`, at the grant) or that was
unloaded for idleness (an `eviction` with the reason `idle`, as its unload began), and the
scheduler's settings at start and after every reload; the most recent request records are kept
for GET /activity, and the most recent evictions for GET /activity?event=eviction.

Lines go to the logger `llamaswap.activity` and, with `activity.path` (or `--activity-log`),
to a file of pure JSON lines, which is what `llamaswap simulate` replays. A line carries its own
time, so where the logger's handlers are the CLI's `LineHandler`s (the message alone, a line
each) and the file, the log writes each line to them itself, at once (a write and a flush to a
handler's stream, one unbuffered write to the file: `tail -f` sees it at once, a crash loses
none), without a LogRecord per line; where nothing takes a line (a log level above INFO and no
file) it is not even encoded. A line is encoded once (`json_line`), and the page's timeline
entry for the request is made from the same bytes. Every timestamp of a
record comes from the runtime's one monotonic clock, turned into Unix time by one offset taken
when the log starts, so arrivals and grants stay consistent with each other even if the wall
clock steps.
"""

from __future__ import annotations

import collections
import io
import logging
import os
import time
from typing import Any, TextIO

from llamaswap.core import NS_PER_S, Clock, EvictReason, Eviction, Policy
from llamaswap.core.residency import Residency
from llamaswap.runtime import json_line
from llamaswap.runtime.kept import KeptEvent
from llamaswap.runtime.observer import IdleUnloaded, Overtaken, PictureSource, QueuePicture, Settle
from llamaswap.runtime.ticket import Ticket

LOGGER_NAME = "llamaswap.activity"
_log = logging.getLogger(LOGGER_NAME)
_errors = logging.getLogger(__name__)
# Every line's encoder (a module global, read at each use).
_encode = json_line.line
_NS_PER_MS = NS_PER_S / 1000
# The record kinds kept for GET /activity (its `event` query): each its own recent list.
REQUEST = "request"
EVICTION = "eviction"
STOP = "stop"
KEPT_EVENTS = (REQUEST, EVICTION, STOP)


def thousandths(value: float) -> float:
    """round(value, 3), the same float, for a positive finite value, in about two thirds of round's
    time where the value has many digits (a Unix time in milliseconds: round's exact decimal
    conversion works through all 16). The thousandth nearest the value's exact binary fraction,
    a tie to the even one (as round breaks it), as the nearest float: the division of two ints is
    correctly rounded, as round's conversion back from its decimal digits is."""
    numerator, denominator = value.as_integer_ratio()
    quotient, remainder = divmod(numerator * 1000, denominator)
    remainder += remainder
    if remainder > denominator or (remainder == denominator and quotient & 1):
        quotient += 1
    return quotient / 1000


def _residency_fields(residency: Residency) -> dict[str, Any]:
    """An upstream's residency in its settings entry (issue 37), for a replay: maxLoaded, the
    pinned models, the memory budget (null: none) and, with a budget, each model's size."""
    budget = residency.memory_bytes
    return {"max_loaded": residency.max_loaded, "pinned": sorted(residency.pinned), "memory_bytes": budget,
            "model_bytes": dict(residency.model_bytes) if budget is not None else {}}


class LineHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """The activity logger's handler as the CLI sets it up: a record's message alone, a line each
    (to stderr by default). While every handler of that logger is one, `ActivityLog` writes its
    lines to their streams itself: the same bytes, without a LogRecord per line."""

    def __init__(self, stream: TextIO | None = None) -> None:
        super().__init__(stream)
        self.setFormatter(logging.Formatter("%(message)s"))


def _line_handlers(logger: logging.Logger) -> tuple[LineHandler, ...] | None:
    """The handlers an activity line can be written to directly, or None when the logger must
    format it (other handlers, filters, or propagation to the root's: a test's caplog, an
    embedding application's own logging). Read once, when the log starts."""
    handlers = logger.handlers
    if logger.propagate or logger.filters or not all(
            type(handler) is LineHandler and not handler.filters and handler.level <= logging.INFO
            for handler in handlers):
        return None
    return tuple(handler for handler in handlers if isinstance(handler, LineHandler))


class _LinesFile:
    """`activity.path`: JSON lines appended to a file, each with one write at once (unbuffered:
    nothing waits in the process for a flush). Before each line the path is checked, as
    logging's WatchedFileHandler does, and the file reopened when logrotate has moved or
    removed it."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._file: io.FileIO | None = None
        self._identity: tuple[int, int] | None = None
        self._open()  # a path that cannot be opened fails the start, as before

    def _open(self) -> None:
        self._file = open(self._path, "ab", buffering=0)  # noqa: SIM115 - open until close()
        status = os.fstat(self._file.fileno())
        self._identity = (status.st_dev, status.st_ino)

    def write(self, data: bytes) -> None:
        try:
            try:
                status = os.stat(self._path)
                identity: tuple[int, int] | None = (status.st_dev, status.st_ino)
            except FileNotFoundError:
                identity = None
            if self._file is None or identity != self._identity:
                self.close()
                self._open()
            assert self._file is not None
            written = self._file.write(data)
            while written < len(data):  # a short write (rare on a file): the rest, not lost
                written += self._file.write(data[written:])
        except (OSError, ValueError) as exc:  # a full disk, a removed directory: the sidecar goes on
            _errors.warning("writing the activity log %s failed: %s", self._path, exc)

    def close(self) -> None:
        if self._file is not None:
            file, self._file = self._file, None
            file.close()


class ActivityLog:
    """An Observer that writes each request's record when it ends."""

    def __init__(self, clock: Clock, *, capacity: int = 1000, path: str | None = None) -> None:
        self._clock = clock
        self._wall_offset_ns = time.time_ns() - clock.now_ns()
        self._recent: dict[str, collections.deque[dict[str, Any]]] = {
            event: collections.deque(maxlen=capacity) for event in KEPT_EVENTS}
        # Records of abandoned requests wait for their settle, whose time they include.
        self._awaiting_settle: dict[str, dict[str, Any]] = {}
        # The last finished ticket's record and its line (None: not written yet): the page's
        # history (the next observer) reads them instead of building and encoding its own.
        self._finished: tuple[Ticket, dict[str, Any], bytes | None] | None = None
        # The file holds nothing but records (no prefix, no other lines).
        self._file = _LinesFile(path) if path else None
        self._line_handlers = _line_handlers(_log)

    def recent(self, limit: int | None = None, event: str = REQUEST) -> list[dict[str, Any]]:
        """The most recent records of one kind (``request`` or ``eviction``), oldest first."""
        kept = self._recent.get(event)
        items = list(kept) if kept is not None else []
        return items[-limit:] if limit else items

    def close(self) -> None:
        for record in self._awaiting_settle.values():
            self._write(record)
        self._awaiting_settle.clear()
        if self._file is not None:
            self._file.close()
            self._file = None

    # -- Observer ------------------------------------------------------------------------

    def enqueued(self, ticket: Ticket) -> None:
        pass

    def dispatched(self, ticket: Ticket, overtaken: tuple[Overtaken, ...]) -> None:
        decision = ticket.decision
        if decision is None:
            return
        for eviction in decision.evicts:
            self._write(self.eviction_record(ticket, eviction))

    def reads_queue(self, pictures: PictureSource) -> None:
        pass

    def queue_changed(self, picture: QueuePicture) -> None:
        pass

    def watchdog_fired(self, ticket: Ticket) -> None:
        pass

    def kept_place(self, event: KeptEvent) -> None:
        pass

    def line_stopped(self, line: Ticket, waiting: Ticket | None, tokens_kept: int | None) -> None:
        """A running Batch API line stopped for a higher band, as its stopped part ended: which,
        where, after how long, the tokens it keeps and the request it made room for (`stops.py`)."""
        decision = line.decision
        assert decision is not None
        now = self._clock.now_ns()
        self._write({
            "event": STOP,
            "time": round(self.unix_ms(now) / 1000, 3),
            "upstream": decision.gpu,
            "model": decision.model,
            "request_id": line.request_id,  # the line stopped
            "trace_id": line.trace_id,
            "serial_band": decision.band.value,
            "ran_ms": round((now - decision.granted_ns) / 1e6, 3),
            "tokens_kept": tokens_kept,
            "for_request_id": waiting.request_id if waiting is not None else None,
            "for_band": waiting.priority.band.value if waiting is not None else None,
        })

    def idle_unloaded(self, unload: IdleUnloaded) -> None:
        """An idle unload: an `eviction` record with the reason `idle` (no request made room by it)."""
        self._write({
            "event": EVICTION,
            "time": round(self.unix_ms(unload.at_ns) / 1000, 3),
            "upstream": unload.gpu,
            "model": unload.model,
            "reason": EvictReason.IDLE.value,
            "idle_s": round(unload.idle_s, 3),  # how long it had sat idle
            "idle_unload_s": unload.after_s,  # its idle time (models.<id>.ttl, upstream.idleUnloadSeconds)
        })

    def settings_changed(self, policy: Policy) -> None:
        self._write({
            "event": "settings",
            "time": round(self.unix_ms(self._clock.now_ns()) / 1000, 3),
            "scheduler": policy.name.value,
            "aging_divisor_s": policy.aging_divisor_s,
            "swap_affinity_bonus": policy.swap_affinity_bonus,
            "max_queued": policy.max_queued,
            "max_wait_s": policy.max_wait_s,
            "model_priorities": dict(policy.model_priorities),
            # Compatibility for readers of logs written before each GPU's slots were recorded (an
            # older `llamaswap simulate` gives these every GPU): the first GPU's slots. This
            # version's simulate reads each GPU's own from `upstreams`, these only where a log
            # has no `upstreams`.
            "slots": policy.gpus[0].slots.default,
            "model_slots": dict(policy.gpus[0].slots.per_model),
            # The node's reservation (routing.scheduler.settings.<use>.reservedSlots; a GPU where
            # `auto` learnt fewer slots holds a lower one, and a replay lowers it to fit the same way).
            "reserved_slots": max(gpu.slots.reserved for gpu in policy.gpus),
            # The node's upstreams (issue 27), in the configured order, each with its own slots
            # (after `auto` learnt them), models and residency: a replay runs with the same.
            "upstreams": [{"name": gpu.name, "slots": gpu.slots.default, "model_slots": dict(gpu.slots.per_model),
                           "models": sorted(gpu.models) if gpu.models is not None else None,
                           **_residency_fields(gpu.residency)}
                          for gpu in policy.gpus],
        })

    def finished(self, ticket: Ticket) -> None:
        record = self.record(ticket)
        line = None
        if ticket.abandoned:
            self._awaiting_settle[ticket.request_id] = record
        else:
            line = self._write(record)
        self._finished = (ticket, record, line)

    def settled(self, settle: Settle) -> None:
        record = self._awaiting_settle.pop(settle.request_id, None)
        if record is not None:
            record["settle_ms"] = round(settle.seconds * 1000, 3)
            self._write(record)

    # -- records -------------------------------------------------------------------------

    def record(self, ticket: Ticket) -> dict[str, Any]:
        # Built once per request: one branch on whether it was granted, the time base read once.
        decision = ticket.decision
        outcome = ticket.outcome
        finished_ns = ticket.ended_ns
        arrival_ns = ticket.arrival_ns
        offset_ns = self._wall_offset_ns
        priority = ticket.priority
        takeover = ticket.takeover
        first_byte_s = ticket.first_byte_s
        estimated_wait_s = ticket.estimated_wait_s
        arrival_unix_ms = thousandths((arrival_ns + offset_ns) / _NS_PER_MS)
        if decision is None:
            score: float | None = None
            slots_busy: int | None = None
            gpu: str | None = None
            granted_unix_ms: float | None = None
            run_ms: float | None = None
            settle_ms: float | None = None
            swap = load = swap_affinity = False
            aging: float | None = None
            reordered_by: list[str] = []
            evicted: list[dict[str, str]] = []
        else:
            granted_ns = decision.granted_ns
            score = round(decision.score, 3)
            slots_busy = decision.slots_busy
            gpu = decision.gpu
            # Granted as it arrived (an idle GPU): the same number, not rounded again.
            granted_unix_ms = arrival_unix_ms if granted_ns == arrival_ns else thousandths(
                (granted_ns + offset_ns) / _NS_PER_MS)
            run_ms = round((finished_ns - granted_ns) / 1e6, 3)
            settle_ms = 0.0
            swap, load, swap_affinity = decision.swap, decision.load, decision.swap_affinity
            aging = round(decision.aging, 6)
            reordered_by = sorted(str(cause) for cause in decision.reordered_by) if decision.reordered_by else []
            evicted = [{"model": eviction.model, "reason": eviction.reason.value} for eviction in decision.evicts]
        return {
            "event": REQUEST,
            "time": round((finished_ns + offset_ns) / _NS_PER_MS / 1000, 3),
            "request_id": ticket.request_id,
            "trace_id": ticket.trace_id,
            "model": ticket.model,
            # What the scheduler keyed it on (a single-model upstream: one key for every name),
            # and what says whether its run and first byte measure a generation.
            "scheduled_model": ticket.schedule_model,
            "max_tokens": ticket.max_tokens,
            "streamed": ticket.streamed,
            "generation": ticket.generation,
            # A Batch API line that may be stopped for a higher band (`stops.py`): simulate --preempt replays its stops.
            "batch_line": ticket.line_key is not None,
            "outcome": outcome._value_ if outcome is not None else None,  # (no Enum property call)
            "dispatched": decision is not None,
            "serial_priority": priority.value,
            "serial_band": priority.band._value_,
            "serial_score": score,
            "serial_queue_wait_ms": round(ticket.queue_wait_ns / 1e6, 3),
            "serial_slots_busy": slots_busy,
            # The upstream (GPU) its grant ran on (None: never dispatched): a replay runs with the log's upstreams.
            "upstream": gpu,
            "arrival_unix_ms": arrival_unix_ms,
            "granted_unix_ms": granted_unix_ms,
            "first_byte_ms": round(first_byte_s * 1000, 3) if first_byte_s is not None else None,
            "run_ms": run_ms,
            "settle_ms": settle_ms,
            "swap": swap,
            "load": load,
            "swap_affinity": swap_affinity,
            "aging": aging,
            "reordered_by": reordered_by,
            # The resident models its grant unloaded to make room for its own, each with why (each
            # also an `eviction` record, written at the grant).
            "evicted": evicted,
            "estimated_wait_ms": round(estimated_wait_s * 1000, 3) if estimated_wait_s is not None else None,
            "status": ticket.response_status,
            # routing.retryGraceSeconds: it took over the place of an earlier try of the same
            # request (its arrival and wait are that try's): which try, and how long the client was away.
            "kept_from_attempt": takeover.from_attempt if takeover is not None else None,
            "kept_away_ms": round(takeover.away_ns / 1e6, 3) if takeover is not None else None,
        }

    def finished_record(self, ticket: Ticket) -> tuple[dict[str, Any], bytes]:
        """The record `finished` built for this ticket and its JSON line as it ended (one of each
        per request, whoever reads them), or new ones where this log did not see it finish.
        Shared: a reader copies what it changes."""
        last = self._finished
        if last is not None and last[0] is ticket:
            record, line = last[1], last[2]
            return record, line if line is not None else _encode(record)
        record = self.record(ticket)
        return record, _encode(record)

    def eviction_record(self, ticket: Ticket, eviction: Eviction) -> dict[str, Any]:
        """A resident model that a grant unloads before its load (several resident, `maxLoaded`):
        which, where, why it was the one to go, and the request whose model it made room for."""
        decision = ticket.decision
        assert decision is not None
        return {
            "event": EVICTION,
            "time": round(self.unix_ms(decision.granted_ns) / 1000, 3),
            "upstream": decision.gpu,
            "model": eviction.model,  # the model unloaded
            "reason": eviction.reason.value,
            "for_model": decision.model,  # the model it made room for (what the request is scheduled on)
            "request_id": ticket.request_id,  # the granted request whose load it made room for
            "trace_id": ticket.trace_id,
            "serial_priority": decision.priority,
            "serial_band": decision.band.value,
            "granted_unix_ms": self.unix_ms_rounded(decision.granted_ns),
        }

    def unix_ms(self, clock_ns: int) -> float:
        """A time of the runtime's clock in Unix milliseconds: the time base of every record."""
        return (clock_ns + self._wall_offset_ns) / _NS_PER_MS

    def unix_ms_rounded(self, clock_ns: int) -> float:
        """`unix_ms` rounded to 3 decimals (a record's `arrival_unix_ms`)."""
        return thousandths(self.unix_ms(clock_ns))

    def _write(self, record: dict[str, Any]) -> bytes | None:
        """Keep the record and write its line where one is taken: the line, or None if none is."""
        kept = self._recent.get(record["event"])
        if kept is not None:
            kept.append(record)
        logged = _log.isEnabledFor(logging.INFO)  # --log-level above INFO: not to the process log
        handlers = self._line_handlers
        if self._file is None and (not logged or handlers == ()):
            return None  # no destination takes the line
        line = _encode(record)
        if logged:
            if handlers is None:
                _log.info(line.decode())
            else:
                text = line.decode() + "\n"  # ASCII (`json_line`)
                for handler in handlers:
                    try:
                        handler.stream.write(text)
                        handler.stream.flush()
                    except (OSError, ValueError) as exc:  # a closed stderr: the file still gets it
                        _errors.warning("writing an activity line to the process log failed: %s", exc)
        if self._file is not None:
            self._file.write(line + b"\n")
        return line
