"""What the runtime tells the outside world (ports): telemetry and the activity log implement
`Observer`, tests record it. Each event carries what its observers need; none of them reads
the coordinator or the scheduler.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from typing import Protocol


from llamaswap.core import Band, Outcome, Policy, Scheduler
from llamaswap.core.policy import IMPLICIT_GPU
from llamaswap.runtime.gpu_projection import NodeProjection
from llamaswap.runtime.kept import KeptEvent
from llamaswap.runtime.ticket import Ticket

_log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class Overtaken:
    """A request that a dispatched one went ahead of (for the queue span's events)."""

    request_id: str
    priority: int
    band: Band
    trace_id: str | None


def overtaken_by(ticket: Ticket | None) -> Overtaken:
    """What the queue span says of an overtaken request (gone already: a placeholder)."""
    if ticket is None:
        return Overtaken("-", 0, Band.NORMAL, None)
    return Overtaken(ticket.request_id, ticket.priority.value, ticket.priority.band, ticket.trace_id)


@dataclasses.dataclass(frozen=True, slots=True)
class QueuePicture:
    """The gauges' view of the queue, built when read after a change (`publishing.QueuePictures`).
    Immutable, so an exporter thread may read it while the event loop moves on."""

    depth: tuple[tuple[Band, int], ...]
    oldest_arrival_ns: tuple[tuple[Band, int | None], ...]  # the coordinator's clock
    # Every GPU and the node (`gpu_projection.py`): the projection GET /queue shows.
    node: NodeProjection


def queue_picture(scheduler: Scheduler, node: NodeProjection) -> QueuePicture:
    """The gauges' picture of the scheduler's queue now, with the GPUs' projection (`QueueViews.gpus`)."""
    stats = scheduler.band_stats()
    depth = tuple((band, s.depth) for band, s in stats.items())
    oldest = tuple((band, s.oldest_arrival_ns) for band, s in stats.items())
    return QueuePicture(depth, oldest, node)


@dataclasses.dataclass(frozen=True, slots=True)
class IdleUnloaded:
    """A resident model unloaded because it sat idle its idle time (`models.<id>.ttl`,
    `upstream.idleUnloadSeconds`): an eviction with the reason `idle` (`runtime/idle.py`)."""

    gpu: str
    model: str
    idle_s: float  # how long it had sat idle when its unload began
    after_s: float  # its idle time (the setting)
    at_ns: int  # when its unload began (the coordinator's clock)


class SettleReason(str, enum.Enum):
    """Why the GPU waited for the upstream to be idle before the next grant."""

    ABANDONED = "abandoned"  # a granted exchange ended without a complete response
    STARTUP = "startup"  # a new sidecar does not know what the upstream is doing
    ADOPTED = "adopted"  # Envoy reports an exchange granted by an earlier sidecar process
    STOPPED = "stopped"  # a line of the Batch API was stopped for a higher band (it lets go at its next token)

    def __str__(self) -> str:
        return self.value

    @classmethod
    def after(cls, outcome: str) -> SettleReason:
        """Why a grant that ended as ``outcome`` (an `Outcome`, or its value as the activity log
        keeps it) and may leave the upstream computing is settled."""
        return cls.STOPPED if outcome == Outcome.STOPPED else cls.ABANDONED


class SettleResult(str, enum.Enum):
    IDLE = "idle"  # the upstream said it computes nothing
    STOPPED = "stopped"  # the abandoned generation was stopped (upstream.abandonedGeneration: stop)
    TIMEOUT = "timeout"  # still busy at the deadline; the next request goes anyway
    UNSUPPORTED = "unsupported"  # the upstream cannot tell (no GET /slots): nothing to wait for
    UNANSWERED = "unanswered"  # the upstream never answered until the deadline; the next request goes anyway
    ENDED = "ended"  # the adopted exchange ended (its final access-log entry arrived)
    LAPSED = "lapsed"  # Envoy stopped reporting the adopted exchange for envoy.leaseSeconds
    WATCHDOG = "watchdog"  # the adopted exchange outlived routing.scheduler.maxRunSeconds: let go

    def __str__(self) -> str:
        return self.value


@dataclasses.dataclass(frozen=True, slots=True)
class Settle:
    reason: SettleReason
    result: SettleResult
    model: str | None
    request_id: str  # the abandoned (or adopted) request, "-" at startup
    started_ns: int
    ended_ns: int
    gpu: str = IMPLICIT_GPU  # the GPU that waited (the others keep serving)

    @property
    def seconds(self) -> float:
        return (self.ended_ns - self.started_ns) / 1e9


class PictureSource(Protocol):
    """Where the gauges' picture is read (`publishing.QueuePictures`)."""

    def latest(self) -> QueuePicture | None:
        """On the loop's thread the picture of now, elsewhere the last built (None: none yet)."""

    def keep_fresh(self) -> None:
        """A reader off the loop's thread may read: the loop keeps the last built one fresh."""


class Observer(Protocol):
    def enqueued(self, ticket: Ticket) -> None:
        """A request joined the queue."""

    def dispatched(self, ticket: Ticket, overtaken: tuple[Overtaken, ...]) -> None:
        """A request was granted the GPU (``ticket.decision`` says why)."""

    def finished(self, ticket: Ticket) -> None:
        """Called exactly once per ticket, however it ended (``ticket.outcome``)."""

    def reads_queue(self, pictures: PictureSource) -> None:
        """Where the gauges' picture is read; given once, as the coordinator is built."""

    def queue_changed(self, picture: QueuePicture) -> None:
        """A new picture of the queue was built (when read, or kept fresh: `PictureSource`)."""

    def watchdog_fired(self, ticket: Ticket) -> None: ...

    def settled(self, settle: Settle) -> None:
        """The GPU waited for the upstream to become idle; how long and how it ended."""

    def settings_changed(self, policy: Policy) -> None:
        """The scheduler's settings at start and after each reload (for replays)."""

    def kept_place(self, event: KeptEvent) -> None:
        """A place was kept for a client's retry, taken over by one, or ended untaken."""

    def line_stopped(self, line: Ticket, waiting: Ticket | None, tokens_kept: int | None) -> None:
        """A running Batch API line was stopped for ``waiting`` (None: it left since), a request
        of a higher band that started nowhere, keeping ``tokens_kept`` tokens (None: not known),
        as its stopped part ended (`stops.py`; a line whose own end came first was not stopped)."""

    def idle_unloaded(self, unload: IdleUnloaded) -> None:
        """A resident model's idle unload began (an eviction with the reason `idle`)."""


class NoopObserver:
    def enqueued(self, ticket: Ticket) -> None:
        pass

    def dispatched(self, ticket: Ticket, overtaken: tuple[Overtaken, ...]) -> None:
        pass

    def finished(self, ticket: Ticket) -> None:
        pass

    def reads_queue(self, pictures: PictureSource) -> None:
        pass

    def queue_changed(self, picture: QueuePicture) -> None:
        pass

    def watchdog_fired(self, ticket: Ticket) -> None:
        pass

    def settled(self, settle: Settle) -> None:
        pass

    def settings_changed(self, policy: Policy) -> None:
        pass

    def kept_place(self, event: KeptEvent) -> None:
        pass

    def line_stopped(self, line: Ticket, waiting: Ticket | None, tokens_kept: int | None) -> None:
        pass

    def idle_unloaded(self, unload: IdleUnloaded) -> None:
        pass


class FanOut:
    """Several observers behind one; a failing observer never breaks scheduling."""

    def __init__(self, *observers: Observer) -> None:
        self._observers = observers

    def _each(self, method: str, *args: object) -> None:
        for observer in self._observers:
            try:
                getattr(observer, method)(*args)
            except Exception:  # noqa: BLE001 - telemetry must not take the scheduler down
                _log.exception("observer %s.%s failed", type(observer).__name__, method)

    def enqueued(self, ticket: Ticket) -> None:
        self._each("enqueued", ticket)

    def dispatched(self, ticket: Ticket, overtaken: tuple[Overtaken, ...]) -> None:
        self._each("dispatched", ticket, overtaken)

    def finished(self, ticket: Ticket) -> None:
        self._each("finished", ticket)

    def reads_queue(self, pictures: PictureSource) -> None:
        self._each("reads_queue", pictures)

    def queue_changed(self, picture: QueuePicture) -> None:
        self._each("queue_changed", picture)

    def watchdog_fired(self, ticket: Ticket) -> None:
        self._each("watchdog_fired", ticket)

    def settled(self, settle: Settle) -> None:
        self._each("settled", settle)

    def settings_changed(self, policy: Policy) -> None:
        self._each("settings_changed", policy)

    def kept_place(self, event: KeptEvent) -> None:
        self._each("kept_place", event)

    def line_stopped(self, line: Ticket, waiting: Ticket | None, tokens_kept: int | None) -> None:
        self._each("line_stopped", line, waiting, tokens_kept)

    def idle_unloaded(self, unload: IdleUnloaded) -> None:
        self._each("idle_unloaded", unload)
