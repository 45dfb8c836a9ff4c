"""What the feeder is given (`batches/feeder.py`): its settings, and the observer telemetry
gives it (a no-op by default)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Protocol

from llamaswap.batches.lifecycle import BatchStatus, LineOutcome
from llamaswap.batches.rows import BatchRecord
from llamaswap.batches.validate import MAX_LINE_BYTES_DEFAULT, InputLine
from llamaswap.config.batches import MAX_ANSWER_BYTES_DEFAULT
from llamaswap.core.priority import HEADER as PRIORITY_HEADER


class BatchObserver(Protocol):
    """What telemetry learns from the feeder (a no-op by default)."""

    def line_started(self, batch: BatchRecord, line: InputLine, request_id: str) -> dict[str, str]:
        """A line is about to be sent: the headers that join it to its batch's trace."""
        ...

    def line_ended(self, batch: BatchRecord, line: InputLine, outcome: LineOutcome, status_code: int | None,
                   answered_ns: int | None = None) -> None:
        """A line's result was recorded; ``answered_ns``: when its answer came (time.time_ns()),
        where that was before now (results are written together)."""
        ...

    def lines_ended(self, outcome: LineOutcome, count: int) -> None:
        """Lines that ended unanswered (expired, cancelled)."""
        ...

    def batch_ended(self, batch: BatchRecord) -> None:
        ...

    def statuses(self, counts: Mapping[BatchStatus, int]) -> None:
        """How many batches are in each status now."""
        ...


class NoBatchObserver:
    def line_started(self, batch: BatchRecord, line: InputLine, request_id: str) -> dict[str, str]:
        return {}

    def line_ended(self, batch: BatchRecord, line: InputLine, outcome: LineOutcome, status_code: int | None,
                   answered_ns: int | None = None) -> None:
        pass

    def lines_ended(self, outcome: LineOutcome, count: int) -> None:
        pass

    def batch_ended(self, batch: BatchRecord) -> None:
        pass

    def statuses(self, counts: Mapping[BatchStatus, int]) -> None:
        pass


@dataclasses.dataclass(frozen=True, slots=True)
class FeedSettings:
    """Where lines go and how they are marked. ``in_flight`` is read at each look (a reload may
    change batches.inFlight); ``priority_header`` is the header that carries the priority
    (security.priority.trustedHeader where set, else X-LlamaSwap-Priority)."""

    target_url: str
    in_flight: Callable[[], int]
    max_requests: Callable[[], int]
    priority_header: str = PRIORITY_HEADER
    # Sent with every line: the upstream's key (upstream.apiKey), which the Batch API's callers
    # had to show (batches/api.py), as llama-server wants it of every request.
    headers: Mapping[str, str] = dataclasses.field(default_factory=dict)
    # batches.maxLineBytes: a longer input line is an error of its own, never read whole.
    max_line_bytes: Callable[[], int] = lambda: MAX_LINE_BYTES_DEFAULT
    # batches.maxAnswerBytes: a longer answer is not read; the line ends with answer_too_large.
    max_answer_bytes: Callable[[], int] = lambda: MAX_ANSWER_BYTES_DEFAULT
    # The priority a batch's lines are sent at now (the API's BatchService.line_priority: the
    # policy in force, the creator's ceiling); None: the one the batch was created with.
    line_priority: Callable[[BatchRecord], int] | None = None
    # batches.preempt: chat lines that can be continued exactly take the token path (stoppable at a
    # token, `batches/tokenpath.py`); off: every line is sent as it is (never stopped).
    preempt: Callable[[], bool] = lambda: False
    # batches.maxPreemptions: a line stopped that many times runs to its end.
    max_preemptions: Callable[[], int] = lambda: 10
