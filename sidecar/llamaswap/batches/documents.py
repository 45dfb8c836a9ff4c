"""The JSON shapes of the Batch API that the openai SDK parses: file and batch objects, lists."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from llamaswap.batches.files import FileRecord
from llamaswap.batches.store import BatchRecord, Counts

LIST_DEFAULT = 20
LIST_MOST = 100
T = TypeVar("T")


def file_document(record: FileRecord) -> dict[str, Any]:
    return {"id": record.id, "object": "file", "bytes": record.bytes, "created_at": record.created_at,
            "filename": record.filename, "purpose": record.purpose, "status": "processed",
            "expires_at": record.expires_at,
            "status_details": None}


def batch_document(record: BatchRecord, counts: Counts, *, in_flight: int,
                   estimated_finish_at: float | None, priority: int | None = None) -> dict[str, Any]:
    """A batch as the OpenAI API shows it, and llamaswap's own fields under ``llamaswap``: the
    priority its lines run at (``priority``, now; else the one it was created with), lines in
    flight now, and when it should finish."""
    errors = {"object": "list", "data": record.errors} if record.errors else None
    return {
        "id": record.id, "object": "batch", "endpoint": record.endpoint, "errors": errors,
        "input_file_id": record.input_file_id, "completion_window": record.completion_window,
        "status": record.status.value, "output_file_id": record.output_file_id,
        "error_file_id": record.error_file_id, "created_at": record.created_at, "expires_at": record.expires_at,
        **record.timestamps,
        "request_counts": {"total": counts.total, "completed": counts.completed, "failed": counts.failed},
        "metadata": record.metadata,
        "llamaswap": {"priority": record.priority if priority is None else priority, "in_flight": in_flight,
                      "estimated_finish_at": None if estimated_finish_at is None else int(estimated_finish_at)},
    }


def list_page(items: Sequence[T], *, after: str | None, limit: int, key: Callable[[T], str],
              document: Callable[[T], dict[str, Any]]) -> dict[str, Any] | None:
    """One page of a list, newest first, after the item ``after`` (a cursor); None when ``after``
    names nothing in the list."""
    start = 0
    if after is not None:
        ids = [key(item) for item in items]
        if after not in ids:
            return None
        start = ids.index(after) + 1
    page = items[start:start + limit]
    data = [document(item) for item in page]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": start + limit < len(items)}
