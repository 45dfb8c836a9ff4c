"""Kept places in the runtime (`routing.retryGraceSeconds`): what makes two requests "the same
request", and what is remembered of a place while it is kept.

The same request is the same caller (the Authorization header, and the client's address) and
either the same client-chosen x-request-id, or, without one, the same body. The adapter hashes
these with a key drawn once per process (`RetryKeys`): the body is never stored, and a digest
means nothing outside this process. The core compares the digest, the priority and the model
(`core/kept.py`). The coordinator keeps a place when a waiting request's Check is cancelled
(`Admitter.cancelled`) and offers the digest of each arrival while a place is kept
(`Admitter._admit`); the digest is computed only then (`Ticket.retry_key`).
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import hmac
import os

from collections.abc import Callable

from llamaswap.core import NS_PER_S, Band, Clock, Removed, Scheduler
from llamaswap.core.kept import KeptPlace
from llamaswap.runtime.ticket import Takeover, Ticket

__all__ = ["KeptEvent", "KeptEventKind", "KeptLedger", "KeptRow", "PlaceKeeper", "RetryKeys", "Takeover",
           "parse_attempt"]

# An attempt number beyond this is not one (the SDKs send 0, 1, 2...).
_MAX_ATTEMPT = 1000


def parse_attempt(value: str | None) -> int | None:
    """The SDK's `x-stainless-retry-count`: which try this is (0 the first), if it says."""
    if value is None or not value.isdigit() or len(value) > 4:
        return None
    attempt = int(value)
    return attempt if attempt <= _MAX_ATTEMPT else None


class RetryKeys:
    """Keyed hashes of requests, with a key drawn once per process (HMAC-SHA256, which OpenSSL
    computes about twice as fast as keyed BLAKE2b on this machine: bench/retry.py): equal for the
    same request from the same caller, unguessable and unlinkable elsewhere."""

    def __init__(self, secret: bytes | None = None) -> None:
        self._secret = secret if secret is not None else os.urandom(32)

    def digest(self, *, caller: str, client_request_id: str | None, body: bytes | None,
               body_length: str | None = None, route: str = "") -> bytes | None:
        """The request's digest: by the client's own x-request-id if it chose one, else by its
        body (and the body's full length, when Envoy sent only its beginning) and its `route`
        (method and path: a load and an unload of one model send the same body). None without
        either: such a request never has a place kept."""
        if client_request_id is None and body is None:
            return None
        mac = hmac.new(self._secret, digestmod=hashlib.sha256)
        by_body = client_request_id is None
        for part in (caller.encode(), b"body" if by_body else b"id",
                     (body or b"") if client_request_id is None else client_request_id.encode(),
                     (body_length or "").encode() if by_body else b"", route.encode() if by_body else b""):
            mac.update(len(part).to_bytes(8, "big"))  # length-prefixed: no two splits hash alike
            mac.update(part)
        return mac.digest()[:16]


class KeptEventKind(str, enum.Enum):
    KEPT = "kept"  # a waiting request's client left: its place is kept
    TAKEN_OVER = "taken_over"  # a retry took a kept place over
    EXPIRED = "expired"  # nobody took it: its grace period or its maxWaitSeconds passed, or shutdown

    def __str__(self) -> str:
        return self.value


@dataclasses.dataclass(frozen=True, slots=True)
class KeptEvent:
    """What observers learn of a kept place (the counter counts these by kind)."""

    kind: KeptEventKind
    request_id: str  # the client's id of the try that left
    attempt: int | None  # which try left (x-stainless-retry-count), if the client said
    band: Band
    model: str | None
    at_ns: int


@dataclasses.dataclass(frozen=True, slots=True)
class KeptRow:
    """A kept place as /queue and the page show it."""

    request_id: str
    attempt: int | None
    priority: int
    band: Band
    model: str | None
    waited_s: float  # since the first try arrived
    away_s: float  # since its client left
    expires_in_s: float  # until its grace period ends


@dataclasses.dataclass(frozen=True, slots=True)
class _Left:
    request_id: str
    attempt: int | None
    model: str | None


class KeptLedger:
    """What the runtime remembers of each kept place, by the scheduler id of the try that left:
    its client's request id, its attempt and the model it named (the core keeps the place)."""

    def __init__(self) -> None:
        self._left: dict[str, _Left] = {}

    def __len__(self) -> int:
        return len(self._left)

    def kept(self, ticket: Ticket, place: KeptPlace) -> KeptEvent:
        self._left[place.request_id] = _Left(ticket.request_id, ticket.attempt, ticket.model)
        return KeptEvent(KeptEventKind.KEPT, ticket.request_id, ticket.attempt, place.priority.band, ticket.model,
                         place.left_ns)

    def taken(self, ticket: Ticket, place: KeptPlace, now_ns: int) -> tuple[Takeover, KeptEvent]:
        left = self._left.pop(place.request_id, None)
        attempt = left.attempt if left is not None else None
        takeover = Takeover(attempt, place.left_ns, now_ns)
        return takeover, KeptEvent(KeptEventKind.TAKEN_OVER, ticket.request_id, attempt, place.priority.band,
                                   ticket.model, now_ns)

    def ended(self, place: KeptPlace, now_ns: int) -> KeptEvent:
        left = self._left.pop(place.request_id, None)
        return KeptEvent(KeptEventKind.EXPIRED, left.request_id if left is not None else "-",
                         left.attempt if left is not None else None, place.priority.band,
                         left.model if left is not None else place.model, now_ns)

    def rows(self, places: tuple[KeptPlace, ...], now_ns: int) -> tuple[KeptRow, ...]:
        rows = []
        for place in places:
            if place.until_ns <= now_ns:
                continue  # due: its timer reports it in a moment
            left = self._left.get(place.request_id)
            rows.append(KeptRow(left.request_id if left is not None else "-",
                                left.attempt if left is not None else None, place.priority.value, place.priority.band,
                                left.model if left is not None else place.model,
                                (now_ns - place.arrival_ns) / NS_PER_S, (now_ns - place.left_ns) / NS_PER_S,
                                max(0.0, (place.until_ns - now_ns) / NS_PER_S)))
        return tuple(rows)


class PlaceKeeper:
    """The coordinator's side of kept places: a place kept when a waiting client leaves, taken
    over by its retry, ended when due or at shutdown. The scheduler keeps the places; the ledger
    remembers who left them; ``observe`` tells the observers; ``grace_ns`` reads
    routing.retryGraceSeconds (0: no place is kept)."""

    def __init__(self, scheduler: Scheduler, clock: Clock, *, grace_ns: Callable[[], int],
                 observe: Callable[[KeptEvent], None]) -> None:
        self._scheduler = scheduler
        self._clock = clock
        self._grace_ns = grace_ns
        self._observe = observe
        self.ledger = KeptLedger()

    def retry_key(self, ticket: Ticket) -> bytes | None:
        """What an arrival offers to take a place over with: None with no grace period, and None
        while no place is kept (nothing to take over: its digest is not computed for it)."""
        return ticket.retry_key if self._scheduler.kept_count and self._grace_ns() else None

    def keep(self, ticket: Ticket, *, admitting: bool) -> Removed | None:
        """The client of a waiting request left: keep its place for its retry, if it can be
        recognised (a digest) and a grace period is set. The ticket itself ends as
        cancelled_waiting; the place lives on in the scheduler. None if no place is kept."""
        grace_ns = self._grace_ns()
        if not grace_ns or ticket.retry_key is None or not admitting:
            return None
        kept = self._scheduler.keep(ticket.token, ticket.retry_key, grace_ns)
        if kept is None:
            return None
        removed, place = kept
        if place is not None:
            self._observe(self.ledger.kept(ticket, place))
        return removed

    def took_over(self, ticket: Ticket, place: KeptPlace) -> None:
        ticket.takeover, event = self.ledger.taken(ticket, place, self._clock.now_ns())
        self._observe(event)

    def ended(self, places: list[KeptPlace]) -> bool:
        """Places that ended without a taker; True if there were any."""
        now = self._clock.now_ns()
        for place in places:
            self._observe(self.ledger.ended(place, now))
        return bool(places)

    def rows(self) -> tuple[KeptRow, ...]:
        """The kept places as the queue view shows them (`QueueView.kept`), oldest first."""
        if not self._scheduler.kept_count:
            return ()
        return self.ledger.rows(self._scheduler.kept, self._clock.now_ns())
