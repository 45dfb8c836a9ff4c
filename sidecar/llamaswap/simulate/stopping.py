"""Stopped Batch API lines in a replay (`llamaswap simulate --preempt`, issue 46). No I/O.

The scheduler decides which running lines stop (`core/preemption.py`: a line is a request
enqueued ``stoppable``, the records' ``batch_line``); this module keeps what the replay needs to
play the feeder's part: each line's work left, each running part's hold, and the counts.

A line's work is its run without its load and its settle (on the GPU it runs on: a line resumed
on another GPU has its work scaled by the two GPUs' expected runs, as a recorded run is). A part
holds its GPU for its load (where its grant loads the model), then, from the second part on, the
time to read its kept tokens again, then the work left, then (the last part only reaches it) its
settle. Stopped at ``now``, a part keeps the work it did: what it ran past its load and re-read,
at most what was left. The re-read costs ``REREAD_SHARE`` of the work done so far: the resume
sends the prompt and the kept tokens as prompt, which the upstream reads in batches, far faster
than it generated them one by one (``../shared/facts/preemption.md``: on llama-server the resumed
200 of 300 tokens took 4.4 s, the undisturbed 300 took 7.9 s, so reading the first 100 again cost
at most a few percent of generating them; 5% keeps the price of a stop visible without
inventing a slower prefill than was measured).
"""

from __future__ import annotations

import dataclasses
from collections import Counter

from collections.abc import Iterable

from llamaswap.core import Band, Outcome
from llamaswap.core.preemption import Stop
from llamaswap.simulate.records import RequestRecord
from llamaswap.simulate.results import Result, StopMetrics
from llamaswap.simulate.running import NEVER

REREAD_SHARE = 0.05
# The stopped line's place is kept this long: the replay sends it again at the same instant.
GRACE_NS = 1_000_000_000


def one_per_line(records: Iterable[RequestRecord]) -> list[RequestRecord]:
    """The records with each line the runtime stopped made one request again, in file order at
    its last part: a log recorded with stopping has a record per part of such a line (the same
    ``request_id``, each part but the last ``stopped``). The one request arrives with its first
    part (the runtime kept its first arrival and place for it), waited as long as its first part
    did, loaded as its first part did (a later part's load came from the stop) and ran every part's
    run: the work, and what reading its kept tokens again cost (a little more than the undisturbed
    run). It ends as its last part ended. A replay with ``--preempt`` may stop it again, where its
    own rule says so."""
    folded: list[RequestRecord] = []
    open_lines: dict[str, RequestRecord] = {}  # a line's parts so far, merged, by request id
    for record in records:
        earlier = open_lines.pop(record.request_id, None) if record.batch_line else None
        if earlier is not None:
            record = dataclasses.replace(
                record, arrival_ms=earlier.arrival_ms, queue_wait_ms=earlier.queue_wait_ms,
                first_byte_ms=earlier.first_byte_ms, granted_ms=earlier.granted_ms, swap=earlier.swap,
                load=earlier.load, gpu=earlier.gpu, slots_busy=earlier.slots_busy, order=earlier.order,
                run_ms=None if record.run_ms is None or earlier.run_ms is None else earlier.run_ms + record.run_ms)
        if record.batch_line and record.outcome is Outcome.STOPPED:
            open_lines[record.request_id] = record  # its next part follows (or the log ends here)
        else:
            folded.append(record)
    folded.extend(open_lines.values())  # stopped and not resumed within the log: as they ended
    return folded


def part_id(index: int, stops: int) -> str:
    """The scheduler's id of a line's part after its ``stops``-th stop (the first part's id is the
    request's index)."""
    return f"{index}/{stops}"


def index_of(request_id: str) -> int:
    """The request (its index) whose id or part's id this is."""
    return int(request_id.partition("/")[0])


def retry_key(index: int) -> bytes:
    return f"line-{index}".encode()


@dataclasses.dataclass(slots=True)
class _Part:
    """A line's running part: what its hold is made of."""

    start_ns: int  # its grant
    hold_ns: int  # the whole hold
    ready_ns: int  # before it progresses: its load, and reading its kept tokens again
    work_ns: int  # the line's whole work on this GPU
    left_ns: int  # of it, left when the part began


class Lines:
    """The lines of one replay: each running part, each stopped line's work left, the counts."""

    __slots__ = ("_parts", "_left", "_by_band", "_stopped")

    def __init__(self) -> None:
        self._parts: dict[int, _Part] = {}  # by request index, while a part runs
        self._left: dict[int, tuple[int, int]] = {}  # a stopped line's (work_ns, left_ns), until it resumes
        self._by_band = Counter[Band]()
        self._stopped: set[int] = set()

    def resumes(self, index: int) -> bool:
        """Whether ``index`` is a stopped line that waits to resume."""
        return index in self._left

    def started(self, index: int, now_ns: int, hold_ns: int, settle_ns: int, work_ns: int) -> None:
        """A line's first part was granted to hold ``hold_ns``: its load is what the hold has
        beyond its work and settle."""
        self._parts[index] = _Part(now_ns, hold_ns, max(0, hold_ns - settle_ns - work_ns), work_ns, work_ns)

    def resumed(self, index: int, now_ns: int, work_ns: int, load_ns: int, settle_ns: int) -> int:
        """A stopped line granted again, its work on this GPU ``work_ns``: its hold."""
        was_work, left = self._left.pop(index)
        if was_work != work_ns:  # another GPU's pace
            left = round(left * work_ns / was_work) if was_work > 0 else 0
        ready = load_ns + round(REREAD_SHARE * (work_ns - left))
        hold = ready + left + settle_ns
        self._parts[index] = _Part(now_ns, hold, ready, work_ns, left)
        return hold

    def stopped(self, stop: Stop, result: Result, now_ns: int, remaining_ns: int) -> None:
        """``stop`` ended the running part of ``result``'s line at ``now_ns``, ``remaining_ns`` of
        its hold not run: the work it did is kept."""
        index = result.request.index
        part = self._parts.pop(index)
        progress = min(part.left_ns, max(0, part.hold_ns - remaining_ns - part.ready_ns))
        self._left[index] = (part.work_ns, part.left_ns - progress)
        if result.parts is None:
            result.parts = []
        start = result.part_start_ns if result.part_start_ns is not None else result.start_ns
        assert start is not None  # a running part was granted
        result.parts.append((start, now_ns))
        result.stops += 1
        self._by_band[stop.band] += 1
        self._stopped.add(index)

    def ended(self, index: int) -> None:
        """A line's last part ended (or a line's resend was refused)."""
        self._parts.pop(index, None)
        self._left.pop(index, None)

    def ripe_at(self, now_ns: int, min_run_ns: int) -> int:
        """The first instant after ``now_ns`` at which a running part has run ``min_run_ns``
        (`Policy.stop_min_run_s`: not stoppable before); NEVER if none."""
        return min((ripe for part in self._parts.values() if (ripe := part.start_ns + min_run_ns) > now_ns),
                   default=NEVER)

    def metrics(self) -> StopMetrics:
        return StopMetrics(sum(self._by_band.values()), {band.value: self._by_band[band] for band in Band},
                           len(self._stopped))
