"""Telemetry: the Observer that turns scheduling events into spans and metrics.

Spans (one trace per request, joined to Envoy's and so to the client's):
- `llamaswap.queue`, arrival to grant (or to the end, for a request never granted), a child
  of Envoy's `Authorization.Check egress` span — the call the sidecar holds;
- `llamaswap.run`, grant to release, a child of Envoy's `ExternalProcessor.Process egress`
  span — the stream that lives as long as the exchange.
Envoy puts a `traceparent` for each of those spans in the gRPC metadata of the call; the
transport stores the metadata on the ticket (`ticket.trace_context`).

Timestamps are wall-clock nanoseconds derived from the coordinator's monotonic clock (one
offset per ticket, taken when it is first seen), so a span lasts exactly as long as the
scheduler says the request waited or ran, and starts at real wall time.

Threads: the observer methods run on the coordinator's event loop. Metric collection for
`GET /metrics` runs there too, but the OTLP push collects on the SDK's exporter thread, which
must not touch the Scheduler (reading the queue pops dead entries). So the loop publishes an
immutable picture of the queue after every event — depth and oldest arrival per band, and
whether the GPU is busy — and a collection on another thread reads that picture, computing
the oldest wait against the clock at collection time. Every change to the queue is followed
by an observer event, so the picture is exact, not sampled.

Nothing here ever sees prompt or completion text: only the ticket's scheduling fields.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, Sampler
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from llamaswap import __version__
from llamaswap.core import Band, Outcome, PrioritySource
from llamaswap.core.scheduler import NS_PER_S, Decision
from llamaswap.telemetry.instruments import Instruments
from llamaswap.telemetry.prometheus import CONTENT_TYPE, PrometheusTextReader

if TYPE_CHECKING:
    from llamaswap.runtime.coordinator import Coordinator, Ticket

_log = logging.getLogger(__name__)

QUEUE_SPAN = "llamaswap.queue"
RUN_SPAN = "llamaswap.run"
OVERTOOK_EVENT = "llamaswap.overtook"
WATCHDOG_EVENT = "llamaswap.watchdog"

INSTRUMENTATION_NAME = "llamaswap"
_PROPAGATOR = TraceContextTextMapPropagator()
_BANDS = tuple(Band)


def parent_from_metadata(metadata: object) -> Context | None:
    """The W3C trace context in gRPC invocation metadata; None if there is none (or it is bad)."""
    if not metadata:
        return None
    carrier: dict[str, str] = {}
    try:
        for item in metadata:  # type: ignore[attr-defined]
            key, value = item[0], item[1]
            if isinstance(key, str) and isinstance(value, str):
                carrier[key.lower()] = value
    except (TypeError, IndexError):
        return None
    context = _PROPAGATOR.extract(carrier, context=Context())
    if trace.get_current_span(context).get_span_context().is_valid:
        return context
    return None


@dataclasses.dataclass(frozen=True)
class _QueuePicture:
    """What the gauges report, as published by the loop; immutable, so safe to share."""

    depth: tuple[int, ...]  # per band, in _BANDS order
    oldest_arrival_ns: tuple[int | None, ...]  # coordinator clock
    busy: bool


_EMPTY_PICTURE = _QueuePicture(tuple(0 for _ in _BANDS), tuple(None for _ in _BANDS), False)


class _TicketTrace:
    """The spans of one ticket and the offset that turns its clock readings into wall time."""

    __slots__ = ("wall_offset_ns", "queue", "queue_open", "run", "unparseable_counted")

    def __init__(self, wall_offset_ns: int) -> None:
        self.wall_offset_ns = wall_offset_ns
        self.queue: trace.Span | None = None
        self.queue_open = False
        self.run: trace.Span | None = None
        self.unparseable_counted = False

    def wall(self, clock_ns: int) -> int:
        return self.wall_offset_ns + clock_ns


class Telemetry:
    """An Observer: spans through the TracerProvider, metrics through one MeterProvider.

    The MeterProvider always has a pull reader for `prometheus_text()` (the admin
    `GET /metrics`); push readers (OTLP) and span processors come from the caller, usually
    `from_environment()`.
    """

    def __init__(
        self,
        *,
        resource: Resource | None = None,
        sampler: Sampler | None = None,
        span_processors: Sequence[SpanProcessor] = (),
        metric_readers: Sequence[MetricReader] = (),
    ) -> None:
        from llamaswap.telemetry.environment import default_resource

        self.resource = resource if resource is not None else default_resource()
        # sampler None: the SDK reads OTEL_TRACES_SAMPLER / OTEL_TRACES_SAMPLER_ARG. With nothing
        # to export spans to, record none: a non-recording span still carries the trace id (for
        # the activity log) at a fraction of the cost.
        if not span_processors:
            sampler = ALWAYS_OFF
        self.tracer_provider = TracerProvider(resource=self.resource, sampler=sampler)
        for processor in span_processors:
            self.tracer_provider.add_span_processor(processor)
        self._pull = PrometheusTextReader()
        self.meter_provider = MeterProvider(resource=self.resource, metric_readers=[self._pull, *metric_readers])
        self._tracer = self.tracer_provider.get_tracer(INSTRUMENTATION_NAME, __version__)
        meter = self.meter_provider.get_meter(INSTRUMENTATION_NAME, __version__)
        self._coordinator: Coordinator | None = None
        self._owner_thread: int | None = None
        self._picture = _EMPTY_PICTURE
        self._live: dict[str, _TicketTrace] = {}
        self._closed = False
        self.instruments = Instruments(meter, queue_depth=self._observe_depth, oldest_wait=self._observe_oldest_wait,
                                       gpu_busy=self._observe_busy)

    @classmethod
    def from_environment(cls) -> "Telemetry":
        """Providers configured by the standard OTEL_* variables (see telemetry.environment)."""
        from llamaswap.telemetry.environment import exporters_from_environment

        span_processors, metric_readers = exporters_from_environment()
        return cls(span_processors=span_processors, metric_readers=metric_readers)

    def bind(self, coordinator: "Coordinator") -> None:
        """Observe this coordinator's queue; call on the thread that runs its event loop."""
        self._coordinator = coordinator
        self._owner_thread = threading.get_ident()
        self._publish()

    # -- pull ----------------------------------------------------------------------------

    def prometheus_text(self) -> tuple[bytes, str]:
        """The admin `GET /metrics` body and content type (Prometheus text format 0.0.4)."""
        return self._pull.render(), CONTENT_TYPE

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Flush spans and a last metrics export, then stop the providers. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._publish()
        now = self._coordinator.clock.now_ns() if self._coordinator is not None else None
        for state in list(self._live.values()):  # still open: the sidecar stops mid-request
            for span in (state.queue if state.queue_open else None, state.run):
                if span is not None and now is not None:
                    span.add_event("llamaswap.sidecar_shutdown", timestamp=state.wall(now))
                    span.end(end_time=state.wall(now))
        self._live.clear()
        try:
            self.tracer_provider.shutdown()
        except Exception:  # noqa: BLE001 - shutting down must not fail the sidecar's stop
            _log.exception("tracer provider shutdown failed")
        try:
            self.meter_provider.shutdown(timeout_millis=timeout_s * 1000)
        except Exception:  # noqa: BLE001
            _log.exception("meter provider shutdown failed")

    # -- Observer ------------------------------------------------------------------------

    def enqueued(self, ticket: "Ticket", queue_depth: int) -> None:
        if self._closed:  # after shutdown(): the providers are gone
            return
        state = self._state(ticket)
        self._count_unparseable(ticket, state)
        attributes = self._arrival_attributes(ticket)
        attributes["llamaswap.queue_depth"] = queue_depth
        if self._coordinator is not None:
            score = self._coordinator.scheduler.score_of(ticket.token)
            if score is not None:
                attributes["llamaswap.score"] = score  # the score on arrival; replaced at grant
        parent = (parent_from_metadata(ticket.trace_context.get("check_metadata"))
                  or parent_from_metadata(ticket.trace_context.get("ext_proc_metadata")))
        state.queue = self._tracer.start_span(QUEUE_SPAN, context=parent or Context(), kind=SpanKind.INTERNAL,
                                              attributes=attributes, start_time=state.wall(ticket.arrival_ns))
        state.queue_open = True
        span_context = state.queue.get_span_context()
        if span_context.is_valid:
            ticket.extras["trace_id"] = format(span_context.trace_id, "032x")
        self._publish()

    def dispatched(self, ticket: "Ticket", decision: Decision) -> None:
        if self._closed:  # after shutdown(): the providers are gone
            return
        state = self._state(ticket)
        granted_ns = ticket.granted_ns if ticket.granted_ns is not None else self._now()
        at = state.wall(granted_ns)
        band = decision.band.value
        decided = _decision_attributes(decision)
        if state.queue is not None and state.queue_open:
            state.queue.set_attributes(decided)
            for overtaken in decision.overtook:
                state.queue.add_event(OVERTOOK_EVENT, self._overtaken_attributes(overtaken), timestamp=at)
            state.queue.end(end_time=at)
            state.queue_open = False
        parent = (parent_from_metadata(ticket.trace_context.get("ext_proc_metadata"))
                  or parent_from_metadata(ticket.trace_context.get("check_metadata")))
        if parent is None and state.queue is not None and state.queue.get_span_context().is_valid:
            parent = trace.set_span_in_context(state.queue, Context())
        attributes = self._arrival_attributes(ticket)
        attributes["llamaswap.queue_depth"] = ticket.queue_depth_at_arrival
        attributes.update(decided)
        state.run = self._tracer.start_span(RUN_SPAN, context=parent or Context(), kind=SpanKind.INTERNAL,
                                            attributes=attributes, start_time=at)
        instruments = self.instruments
        instruments.dispatched.add(1, {"band": band})
        for reason in sorted(decision.reordered_by):
            instruments.reorders.add(1, {"band": band, "reason": reason})
        instruments.queue_wait.record(decision.queue_wait_ns / NS_PER_S, {"band": band})
        if decision.swap:
            instruments.swaps.add(1)
        self._publish()

    def finished(self, ticket: "Ticket", outcome: Outcome) -> None:
        if self._closed:  # after shutdown(): the providers are gone
            return
        state = self._state(ticket)
        self._count_unparseable(ticket, state)
        finished_ns = ticket.finished_ns if ticket.finished_ns is not None else self._now()
        at = state.wall(finished_ns)
        if state.queue is None:
            # Refused before it could queue (queue full, shutting down): the queue span
            # covers arrival to rejection.
            parent = (parent_from_metadata(ticket.trace_context.get("check_metadata"))
                      or parent_from_metadata(ticket.trace_context.get("ext_proc_metadata")))
            state.queue = self._tracer.start_span(QUEUE_SPAN, context=parent or Context(), kind=SpanKind.INTERNAL,
                                                  attributes=self._arrival_attributes(ticket),
                                                  start_time=state.wall(ticket.arrival_ns))
            state.queue_open = True
            span_context = state.queue.get_span_context()
            if span_context.is_valid:
                ticket.extras.setdefault("trace_id", format(span_context.trace_id, "032x"))
        if state.queue_open and state.queue is not None:
            waited_ns = max(0, finished_ns - ticket.arrival_ns)
            state.queue.set_attributes({
                "llamaswap.queue_wait_ms": waited_ns / 1e6,
                "llamaswap.aging": self._aging(waited_ns),
                "llamaswap.outcome": outcome.value,
            })
            _set_status(state.queue, outcome)
            state.queue.end(end_time=at)
            state.queue_open = False
        if state.run is not None:
            state.run.set_attribute("llamaswap.outcome", outcome.value)
            _set_status(state.run, outcome)
            state.run.end(end_time=at)
            if ticket.granted_ns is not None:
                band = ticket.decision.band.value if ticket.decision is not None else _band_of(ticket)
                self.instruments.run.record(max(0, finished_ns - ticket.granted_ns) / NS_PER_S,
                                            {"band": band} if band else None)
        self.instruments.requests.add(1, {"outcome": outcome.value})
        self._live.pop(ticket.token, None)
        self._publish()

    def watchdog_fired(self, ticket: "Ticket") -> None:
        if self._closed:  # after shutdown(): the providers are gone
            return
        self.instruments.watchdog.add(1)
        state = self._live.get(ticket.token)
        if state is not None and state.run is not None:
            state.run.add_event(WATCHDOG_EVENT, {"llamaswap.request_id": ticket.request_id},
                                timestamp=state.wall(self._now()))

    # -- helpers -------------------------------------------------------------------------

    def _now(self) -> int:
        return self._coordinator.clock.now_ns() if self._coordinator is not None else time.monotonic_ns()

    def _state(self, ticket: "Ticket") -> _TicketTrace:
        state = self._live.get(ticket.token)
        if state is None:
            state = _TicketTrace(time.time_ns() - self._now())
            self._live[ticket.token] = state
        return state

    def _count_unparseable(self, ticket: "Ticket", state: _TicketTrace) -> None:
        priority = ticket.priority
        if not state.unparseable_counted and priority is not None:
            state.unparseable_counted = True
            if priority.source is PrioritySource.UNPARSEABLE:
                self.instruments.unparseable.add(1)

    @staticmethod
    def _arrival_attributes(ticket: "Ticket") -> dict[str, Any]:
        attributes: dict[str, Any] = {"llamaswap.request_id": ticket.request_id}
        if ticket.priority is not None:
            attributes["llamaswap.priority"] = ticket.priority.value
            attributes["llamaswap.band"] = ticket.priority.band.value
        if ticket.model is not None:
            attributes["llamaswap.model"] = ticket.model
        return attributes

    def _overtaken_attributes(self, token: str) -> dict[str, Any]:
        """Who was overtaken, by request id: the scheduler's ids are ticket tokens (secrets)."""
        other = self._coordinator.ticket(token) if self._coordinator is not None else None
        if other is None:
            return {"llamaswap.request_id": "unknown"}
        attributes: dict[str, Any] = {"llamaswap.request_id": other.request_id}
        if other.priority is not None:
            attributes["llamaswap.priority"] = other.priority.value
            attributes["llamaswap.band"] = other.priority.band.value
        trace_id = other.extras.get("trace_id")
        if isinstance(trace_id, str):
            attributes["llamaswap.trace_id"] = trace_id
        return attributes

    def _aging(self, waited_ns: int) -> float:
        if self._coordinator is None:
            return 0.0
        divisor_ns = self._coordinator.scheduler.policy.aging_divisor_ns
        return waited_ns / divisor_ns if divisor_ns else 0.0

    # -- gauges --------------------------------------------------------------------------

    def _publish(self) -> None:
        """Publish the queue picture for collections on other threads (loop thread only)."""
        coordinator = self._coordinator
        if coordinator is None:
            return
        self._picture = self._read_scheduler(coordinator)

    @staticmethod
    def _read_scheduler(coordinator: "Coordinator") -> _QueuePicture:
        scheduler = coordinator.scheduler
        now = coordinator.clock.now_ns()
        stats = scheduler.band_stats()
        depth = tuple(stats[band].depth for band in _BANDS)
        oldest = tuple(now - round(stats[band].oldest_wait_s * NS_PER_S) if stats[band].depth else None
                       for band in _BANDS)
        return _QueuePicture(depth, oldest, scheduler.running_id is not None)

    def _current(self) -> tuple[_QueuePicture, int]:
        """The queue picture and the clock reading to compute waits against."""
        coordinator = self._coordinator
        if coordinator is None:
            return _EMPTY_PICTURE, 0
        if threading.get_ident() == self._owner_thread and not self._closed:
            self._picture = self._read_scheduler(coordinator)
        return self._picture, coordinator.clock.now_ns()

    def _observe_depth(self, options: CallbackOptions) -> Iterable[Observation]:
        picture, _ = self._current()
        return [Observation(depth, {"band": band.value}) for band, depth in zip(_BANDS, picture.depth)]

    def _observe_oldest_wait(self, options: CallbackOptions) -> Iterable[Observation]:
        picture, now = self._current()
        return [Observation(max(0, now - arrival) / NS_PER_S if arrival is not None else 0.0, {"band": band.value})
                for band, arrival in zip(_BANDS, picture.oldest_arrival_ns)]

    def _observe_busy(self, options: CallbackOptions) -> Iterable[Observation]:
        picture, _ = self._current()
        return [Observation(1 if picture.busy else 0)]


def _decision_attributes(decision: Decision) -> dict[str, Any]:
    attributes: dict[str, Any] = {
        "llamaswap.priority": decision.priority,
        "llamaswap.band": decision.band.value,
        "llamaswap.score": decision.score,
        "llamaswap.queue_wait_ms": decision.queue_wait_ns / 1e6,
        "llamaswap.swap_affinity": decision.swap_affinity,
        "llamaswap.aging": decision.aging,
        "llamaswap.swap": decision.swap,
    }
    if decision.reordered_by:
        attributes["llamaswap.reordered_by"] = sorted(decision.reordered_by)
    if decision.model is not None:
        attributes["llamaswap.model"] = decision.model
    return attributes


def _band_of(ticket: "Ticket") -> str | None:
    return ticket.priority.band.value if ticket.priority is not None else None


def _set_status(span: trace.Span, outcome: Outcome) -> None:
    if outcome.is_error:
        span.set_status(Status(StatusCode.ERROR, outcome.value))
