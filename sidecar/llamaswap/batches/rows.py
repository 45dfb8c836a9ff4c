"""The values of the batch store's rows that its readers share (the store, the end of a batch,
the feeder, the writer, the documents): a leaf, so that none of them imports another for a type."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from llamaswap.batches.lifecycle import BatchStatus, LineOutcome
from llamaswap.batches.validate import InputLine


@dataclasses.dataclass(frozen=True, slots=True)
class BatchRecord:
    id: str
    endpoint: str
    input_file_id: str
    completion_window: str
    created_at: int
    expires_at: int
    status: BatchStatus
    metadata: dict[str, str] | None
    priority: int
    errors: list[dict[str, Any]] | None
    output_file_id: str | None
    error_file_id: str | None
    total: int
    timestamps: dict[str, int | None]
    trace_id: str
    span_id: str
    # Who created it (None: before callers were told apart) and the most its lines may run at
    # (the creator's trusted priority; None: none given).
    owner: str | None = None
    priority_ceiling: int | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class Counts:
    total: int
    completed: int
    failed: int  # failed, expired and cancelled lines: all that went to the error file

    @property
    def done(self) -> int:
        return self.completed + self.failed


@dataclasses.dataclass(frozen=True, slots=True)
class Result:
    """One line's result to record: its outcome, its line of the output or error file (JSON text
    on one line, serialised before it reaches the store: its lock is never held for that), when
    it ended."""

    batch_id: str
    line: InputLine
    outcome: LineOutcome
    record: str
    ended_at: float


def record_text(record: dict[str, Any]) -> str:
    """A record as its line of the output or error file."""
    return json.dumps(record, separators=(",", ":"))
