"""A batch's life, as pure values: its statuses, how each line ends, the priority its lines run
at, and the ids. No I/O: the store keeps these, the feeder and the API act on them."""

from __future__ import annotations

import enum
import re
import secrets
import urllib.parse

from llamaswap.core.priority import ALIASES, PriorityMode, PriorityPolicy, PrioritySource, parse_priority
from llamaswap.envoy.contract import MAX_REQUEST_ID

# The OpenAI Batch API's endpoints a batch may name (its `endpoint`, each line's `url`).
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
COMPLETION_WINDOWS = {"24h": 24 * 3600}
# metadata: at most 16 pairs, keys up to 64 characters, values up to 512 (the OpenAI API's limits).
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512
# metadata.priority: the priority a batch's lines run at (a number or an alias); `batch` by default.
PRIORITY_KEY = "priority"
DEFAULT_PRIORITY = ALIASES["batch"]
# A line's x-request-id is BATCH_ID:CUSTOM_ID while it fits the request-id bound the sidecar
# keeps (MAX_REQUEST_ID), else BATCH_ID:line-N; characters outside the unreserved set are
# percent-encoded.


class BatchStatus(str, enum.Enum):
    """Every status of the OpenAI Batch API. Ended: failed, completed, expired, cancelled."""

    VALIDATING = "validating"
    FAILED = "failed"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"

    @property
    def ended(self) -> bool:
        return self in ENDED

    @property
    def feeding(self) -> bool:
        """Whether lines of a batch in this status may still be sent."""
        return self is BatchStatus.IN_PROGRESS


ENDED = frozenset({BatchStatus.FAILED, BatchStatus.COMPLETED, BatchStatus.EXPIRED, BatchStatus.CANCELLED})
# The timestamp each status sets when a batch enters it (None: none).
STATUS_TIMESTAMP = {
    BatchStatus.VALIDATING: None,
    BatchStatus.FAILED: "failed_at",
    BatchStatus.IN_PROGRESS: "in_progress_at",
    BatchStatus.FINALIZING: "finalizing_at",
    BatchStatus.COMPLETED: "completed_at",
    BatchStatus.EXPIRED: "expired_at",
    BatchStatus.CANCELLING: "cancelling_at",
    BatchStatus.CANCELLED: "cancelled_at",
}


class LineOutcome(str, enum.Enum):
    """Every way one line of a batch ends: the metric label (llamaswap_batch_requests_total),
    the file it goes to and its error code. Each line ends exactly once (the store's key)."""

    COMPLETED = "completed"  # the upstream answered 2xx: the output file
    FAILED = "failed"  # the upstream (or llamaswap, for good) refused it: the error file, with its status
    EXPIRED = "expired"  # not done within the completion window: the error file
    CANCELLED = "cancelled"  # not done when the batch was cancelled: the error file

    @property
    def in_output(self) -> bool:
        return self is LineOutcome.COMPLETED

    @property
    def error_code(self) -> str | None:
        return {LineOutcome.EXPIRED: "batch_expired", LineOutcome.CANCELLED: "batch_cancelled"}.get(self)


def ended_status(expired: bool, cancelled: bool) -> BatchStatus:
    """What a batch becomes once none of its lines is left to send or running."""
    if cancelled:
        return BatchStatus.CANCELLED
    if expired:
        return BatchStatus.EXPIRED
    return BatchStatus.COMPLETED


class BadPriority(ValueError):
    """metadata.priority is neither an integer nor an alias."""


def batch_priority(metadata: dict[str, str] | None, policy: PriorityPolicy) -> int:
    """The priority a batch's lines run at, under the operator's policy as a header would be:
    metadata.priority (a number or an alias) with `trust`, clamped into [min, max] with `clamp`;
    `batch` when metadata names none, and always with `strip` (a caller's claim is dropped; the
    batch's own default is not a claim). The feeder sends the result in the trusted header where
    one is set (security.priority.trustedHeader), so it must be final here."""
    raw = (metadata or {}).get(PRIORITY_KEY)
    if raw is None or policy.mode is PriorityMode.STRIP:
        return DEFAULT_PRIORITY
    text = raw.strip().lower()
    if text in ALIASES:
        value = ALIASES[text]
    elif re.fullmatch(r"[+-]?\d{1,18}", text):
        value = int(text)
    else:
        raise BadPriority(f"metadata.priority must be an integer or one of {', '.join(ALIASES)}, got {raw!r}")
    if policy.mode is PriorityMode.CLAMP:
        value = min(max(value, policy.minimum), policy.maximum)
    return value


def trusted_ceiling(trusted: str | None, policy: PriorityPolicy) -> int | None:
    """The priority the operator's proxy gave the caller who creates a batch (its trusted header,
    security.priority.trustedHeader): the most that batch's lines may run at. None: no such
    header configured or sent (or not a priority)."""
    if policy.trusted_header is None or trusted is None:
        return None
    granted = parse_priority(trusted)
    return granted.value if granted.source in (PrioritySource.NUMBER, PrioritySource.ALIAS) else None


def bounded_priority(metadata: dict[str, str] | None, ceiling: int | None, policy: PriorityPolicy) -> int:
    """The priority a batch's lines run at now: its metadata.priority under the policy in force
    (`batch_priority`, so a reload that tightens the clamp bounds running batches too), never
    above its creator's trusted ceiling. A metadata.priority no longer readable runs at the
    batch default (it was checked at creation)."""
    try:
        value = batch_priority(metadata, policy)
    except BadPriority:
        value = DEFAULT_PRIORITY
    return value if ceiling is None else min(value, ceiling)


def new_id(prefix: str) -> str:
    """An id in the OpenAI style (``file-...``, ``batch_...``): unguessable, URL-safe."""
    return f"{prefix}{secrets.token_hex(12)}"


def line_request_id(batch_id: str, custom_id: str, line: int) -> str:
    """The x-request-id a line is sent with: how it shows in the queue, the page and the activity log."""
    quoted = urllib.parse.quote(custom_id, safe="-_.~")
    request_id = f"{batch_id}:{quoted}"
    return request_id if len(request_id) <= MAX_REQUEST_ID else f"{batch_id}:line-{line}"


def batch_of_request(request_id: str) -> str | None:
    """The batch a request id belongs to (None: a client's own request)."""
    head, sep, _ = request_id.partition(":")
    return head if sep and head.startswith("batch_") else None


# Line ends behind a batch's estimated finish: the recent rate, not the whole history's.
RATE_WINDOW = 50


def estimated_finish(now: float, recent_ends: list[float], remaining: int) -> float | None:
    """When the rest of a batch should be done, at the rate its latest lines ended (``recent_ends``,
    any order); None before two lines ended or with nothing left."""
    if remaining <= 0 or len(recent_ends) < 2:
        return None
    newest, oldest = max(recent_ends), min(recent_ends)
    if newest <= oldest:
        return None
    # The recent rate, not the whole history's: a batch that waited behind interactive work
    # speeds up again when the interactive traffic stops.
    rate = (len(recent_ends) - 1) / (newest - oldest)
    return now + remaining / rate
