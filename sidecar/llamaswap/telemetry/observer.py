"""Telemetry: the Observer that turns scheduling events into spans and metrics.

Spans (one trace per request, joined to Envoy's and so to the client's), both children of
Envoy's `Authorization.Check egress` span, the call the sidecar holds (Envoy puts its
`traceparent` in the Check's gRPC metadata, and the transport keeps it on the ticket):
- `llamaswap.queue`, arrival to grant (or to the end, for a request never granted);
- `llamaswap.run`, grant to release, with the outcome.

Spans are written when they end, with the times the scheduler recorded (its monotonic clock,
turned into wall time by one offset), so a waiting request costs telemetry nothing and a span
lasts exactly as long as the scheduler says the request waited or ran.

Threads: the observer methods run on the coordinator's event loop; metric collection for the
OTLP push runs on the SDK's exporter thread. The gauges' picture is built when read
(`publishing.QueuePictures`): a collection on the loop's thread (`GET /metrics`, the picker's
page) has it built there if the queue moved since; one on the exporter thread reads the last
`QueuePicture` built (immutable), which the loop keeps fresh while an exporter exists, so no
other thread ever touches the scheduler.

Nothing here ever sees prompt or completion text: only the ticket's scheduling fields.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable, Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import AggregationTemporality, MetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, Sampler
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from llamaswap import __version__
from llamaswap.core import NS_PER_S, Band, Clock, EvictReason, MonotonicClock, Outcome, Policy, PrioritySource
from llamaswap.core.estimate import NO_MODEL
from llamaswap.runtime.kept import KeptEvent
from llamaswap.core.policy import IMPLICIT_GPU
from llamaswap.runtime.gpu_projection import GpuProjection, NodeProjection
from llamaswap.runtime.observer import IdleUnloaded, Overtaken, PictureSource, QueuePicture, Settle
from llamaswap.runtime.ticket import Ticket, TicketState
from llamaswap.telemetry.instruments import (
    BAND_LABELS,
    BAND_SERIES,
    DESCRIPTIONS,
    GPU_SLOTS_BUSY,
    OTHER_MODEL,
    MODELS_INFO,
    OUTCOME_SERIES,
    SATURATION,
    WAITING,
    Instruments,
    SeriesKey,
    series_key,
)
from llamaswap.telemetry.batches import BatchTelemetry, PresetIds
from llamaswap.telemetry.histograms import Histograms
from llamaswap.telemetry.models_info import ModelsInfo
from llamaswap.telemetry.prometheus import CONTENT_TYPE, PrometheusTextReader, gauge_family

_log = logging.getLogger(__name__)

QUEUE_SPAN = "llamaswap.queue"
RUN_SPAN = "llamaswap.run"
OVERTOOK_EVENT = "llamaswap.overtook"
# On the overtaken request's own queue span: each request that went ahead of it while it waited
# (the first OVERTAKEN_EVENTS_KEPT; `llamaswap.overtaken_count` counts them all).
OVERTAKEN_BY_EVENT = "llamaswap.overtaken_by"
OVERTAKEN_EVENTS_KEPT = 100
WATCHDOG_EVENT = "llamaswap.watchdog"
# On the queue span of a request whose grant unloads resident models to make room for its own
# (several resident, `Decision.evicts`): one per model that goes, with why it was the one.
EVICTED_EVENT = "llamaswap.evicted"
# A Batch API line stopped for a higher band (`runtime/stops.py`): on the line's run span, the
# request it made room for; on that request's queue span, each line stopped for it.
STOPPED_EVENT = "llamaswap.stopped"
STOPPED_LINE_EVENT = "llamaswap.stopped_line"

INSTRUMENTATION_NAME = "llamaswap"
SCOPE = InstrumentationScope(INSTRUMENTATION_NAME, __version__)  # the meter's, which the histograms join
_PROPAGATOR = TraceContextTextMapPropagator()
# A wait shorter than this counts as this long when the estimate is compared with it.
ESTIMATE_FLOOR_S = 0.1
# Before the first settings: one upstream of one slot, as a configuration of one `upstream:`.
_EMPTY_PICTURE = QueuePicture(tuple((band, 0) for band in Band), tuple((band, None) for band in Band),
                              NodeProjection.of((GpuProjection.configured(IMPLICIT_GPU, 1),)))


def parent_of(ticket: Ticket) -> Context | None:
    """Envoy's span for the Check call, from the ticket's traceparent; None without a valid one."""
    if ticket.trace_parent is None:
        return None
    carrier = {"traceparent": ticket.trace_parent}
    if ticket.trace_state:
        carrier["tracestate"] = ticket.trace_state
    context = _PROPAGATOR.extract(carrier, context=Context())
    if trace.get_current_span(context).get_span_context().is_valid:
        return context
    return None


class Telemetry:
    """An Observer: spans through the TracerProvider, metrics through one MeterProvider.

    The MeterProvider always has a pull reader for `prometheus_text()` (the admin
    `GET /metrics`); push readers (OTLP) and span processors come from the caller, usually
    `from_environment()`. The histograms are kept plain in ``histograms`` (`histograms.py`): the
    pull reader adds them, and so do push readers whose exporter was made with them
    (`exporters_from_environment`); any other reader sees the SDK's instruments alone.
    """

    def __init__(
        self,
        *,
        clock: Clock | None = None,
        resource: Resource | None = None,
        sampler: Sampler | None = None,
        span_processors: Sequence[SpanProcessor] = (),
        metric_readers: Sequence[MetricReader] = (),
        histograms: Histograms | None = None,
    ) -> None:
        from llamaswap.telemetry.environment import default_resource

        self._clock = clock or MonotonicClock()
        self._wall_offset_ns = time.time_ns() - self._clock.now_ns()
        self.resource = resource if resource is not None else default_resource()
        # sampler None: the SDK reads OTEL_TRACES_SAMPLER / OTEL_TRACES_SAMPLER_ARG. With nothing
        # to export spans to, record none.
        if not span_processors:
            sampler = ALWAYS_OFF
        self._tracing = bool(span_processors)
        # A batch's span takes the ids its lines were given as parent (telemetry/batches.py).
        self.span_ids = PresetIds()
        self.tracer_provider = TracerProvider(resource=self.resource, sampler=sampler, id_generator=self.span_ids)
        for processor in span_processors:
            self.tracer_provider.add_span_processor(processor)
        self.histograms = histograms or Histograms(self.resource, SCOPE)
        self._pull = PrometheusTextReader(self.histograms.view(AggregationTemporality.CUMULATIVE))
        self.meter_provider = MeterProvider(resource=self.resource, metric_readers=[self._pull, *metric_readers])
        self._tracer = self.tracer_provider.get_tracer(INSTRUMENTATION_NAME, __version__)
        meter = self.meter = self.meter_provider.get_meter(INSTRUMENTATION_NAME, __version__)
        self._picture = _EMPTY_PICTURE
        self._published = False  # a picture came from the coordinator
        self._pictures: PictureSource | None = None  # where a moved picture is built (`reads_queue`)
        self._pushes = bool(metric_readers)  # an exporter collects on its own thread
        self._aging_divisor_ns = 0
        self._run_parents: dict[str, Context] = {}  # by token, from the grant to the end
        # By request id, while it waits: (when, the event's attributes) of each request that
        # overtook it, and how many did (its queue span is written only when it stops waiting).
        self._overtaken_by: dict[str, tuple[list[tuple[int, dict[str, Any]]], list[int]]] = {}
        # Stops, kept until the span they go on is written: by the stopped line's token (for its
        # run span) and by the token of the request they were for (for its queue span).
        self._stop_of_line: dict[str, tuple[int, dict[str, Any]]] = {}
        self._stops_for: dict[str, list[tuple[int, dict[str, Any]]]] = {}
        self._closed = False
        self._models_info = ModelsInfo(_EMPTY_PICTURE)
        self._upstream_series: dict[str, SeriesKey] = {}  # each configured upstream's `{"upstream": name}`
        self.instruments = Instruments(meter, self.histograms, queue_depth=self._observe_depth,
                                       oldest_wait=self._observe_oldest_wait, gpu_busy=self._observe_busy,
                                       gpu_slots=self._observe_slots,
                                       gpu_slots_busy=self._observe_slots_busy, waiting=self._observe_waiting,
                                       saturation=self._observe_saturation, models_info=self._observe_models_info,
                                       upstream_slots=self._observe_upstream_slots,
                                       upstream_slots_busy=self._observe_upstream_slots_busy,
                                       upstream_busy=self._observe_upstream_busy,
                                       upstream_model=self._observe_upstream_model,
                                       models_resident=self._observe_models_resident)
        self.histograms.mirror(meter)
        # The priority sources counted, by a lookup: `PrioritySource.ABSENT` costs 0.1 us a read.
        self._source_counted = {PrioritySource.UNPARSEABLE: self.instruments.unparseable,
                                PrioritySource.ABSENT: self.instruments.absent}

    @classmethod
    def from_environment(cls, clock: Clock | None = None) -> Telemetry:
        """Providers configured by the standard OTEL_* variables (see telemetry.environment)."""
        from llamaswap.telemetry.environment import default_resource, exporters_from_environment

        resource = default_resource()
        histograms = Histograms(resource, SCOPE)
        span_processors, metric_readers = exporters_from_environment(histograms=histograms)
        return cls(clock=clock, resource=resource, span_processors=span_processors, metric_readers=metric_readers,
                   histograms=histograms)

    def batch_telemetry(self) -> BatchTelemetry:
        """The Batch API's spans and metrics, on these providers."""
        return BatchTelemetry(self._tracer, self.meter, self.span_ids, tracing=self._tracing)

    # -- pull ----------------------------------------------------------------------------

    def prometheus_text(self) -> tuple[bytes, str]:
        """The admin `GET /metrics` body and content type (Prometheus text format 0.0.4)."""
        return self._pull.render(), CONTENT_TYPE

    def picker_text(self) -> tuple[bytes, str]:
        """An endpoint picker's page: its four gauges alone, written from the published picture
        without an SDK collection (microseconds, against milliseconds for the whole page, which a
        picker reading every 50 ms would pay on the event loop). The same families, values and
        text as in `prometheus_text`."""
        options = CallbackOptions()
        observe = ((WAITING, self._observe_waiting), (GPU_SLOTS_BUSY, self._observe_slots_busy),
                   (SATURATION, self._observe_saturation), (MODELS_INFO, self._observe_models_info))
        text = "".join(gauge_family(name, DESCRIPTIONS[name],
                                    [(point.attributes, point.value) for point in callback(options)])
                       for name, callback in observe)
        return text.encode("utf-8"), CONTENT_TYPE

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Flush spans and a last metrics export, then stop the providers. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._current()  # (on the loop's thread: the last export reads the queue as it ends)
        try:
            self.tracer_provider.shutdown()
        except Exception:  # noqa: BLE001 - shutting down must not fail the sidecar's stop
            _log.exception("tracer provider shutdown failed")
        try:
            self.meter_provider.shutdown(timeout_millis=timeout_s * 1000)
        except Exception:  # noqa: BLE001
            _log.exception("meter provider shutdown failed")

    # -- Observer ------------------------------------------------------------------------

    def enqueued(self, ticket: Ticket) -> None:
        # Spans are written when they end; only the waiting models are counted here.
        model = ticket.schedule_model
        if model is not None:
            self._models_info.waiting(ticket.token, model)

    def settings_changed(self, policy: Policy) -> None:
        self._aging_divisor_ns = policy.aging_divisor_ns
        gpus = policy.gpus
        instruments = self.instruments
        for gpu in gpus:  # every upstream's counts exist from the start, at 0
            labels = {"upstream": gpu.name}
            self._upstream_series[gpu.name] = series_key(labels)
            instruments.upstream_dispatched.declare(labels)
            instruments.upstream_swaps.declare(labels)
            instruments.upstream_loads.declare(labels)
            for reason in EvictReason:
                instruments.evictions.declare(_eviction_labels(gpu.name, reason))
        if not self._published:  # before the first picture: each upstream's default slots (the
            # coordinator publishes the resident models' with every change)
            shown = NodeProjection.of([GpuProjection.configured(gpu.name, gpu.slots.default, gpu.residency.max_loaded)
                                       for gpu in gpus])
            self._picture = dataclasses.replace(self._picture, node=shown)
            self._models_info.picture_changed(self._picture)

    def reads_queue(self, pictures: PictureSource) -> None:
        self._pictures = pictures
        if self._pushes:
            pictures.keep_fresh()

    def queue_changed(self, picture: QueuePicture) -> None:
        # (A picture is built when read: a change of the resident models dates `llamaswap_models_info`
        # from the first read after it, or from the loop's refresh while an exporter exists.)
        if (_resident_models(picture) != _resident_models(self._picture)
                or _max_loaded(picture) != _max_loaded(self._picture)):
            self._models_info.picture_changed(picture)
        self._picture = picture
        self._published = True

    def dispatched(self, ticket: Ticket, overtaken: tuple[Overtaken, ...]) -> None:
        self._models_info.left(ticket.token)
        decision = ticket.decision
        if self._closed or decision is None:
            return
        band = BAND_LABELS[decision.band]
        instruments = self.instruments
        instruments.dispatched.add_to(BAND_SERIES[decision.band])
        if decision.reordered_by:
            for cause in sorted(decision.reordered_by):
                instruments.reorders.add(1, {"band": band, "reason": cause.value})
        wait_s = decision.queue_wait_ns / NS_PER_S
        instruments.queue_wait.record(wait_s, band)
        upstream = self._upstream_series.get(decision.gpu) or series_key({"upstream": decision.gpu})
        instruments.upstream_dispatched.add_to(upstream)
        if decision.swap:
            instruments.swaps.add(1)
            instruments.upstream_swaps.add_to(upstream)
        if decision.load:
            instruments.loads.add(1)
            instruments.upstream_loads.add_to(upstream)
        for eviction in decision.evicts:
            instruments.evictions.add(1, _eviction_labels(decision.gpu, eviction.reason))
        if ticket.estimated_wait_s is not None:
            ratio = ticket.estimated_wait_s / max(wait_s, ESTIMATE_FLOOR_S)
            instruments.estimate_ratio.record(ratio, band)
        if not self._tracing:
            return
        attributes = self._attributes(ticket)
        attributes.update(_decision_attributes(ticket))
        parent = parent_of(ticket)
        span = self._tracer.start_span(QUEUE_SPAN, context=parent or Context(), kind=SpanKind.INTERNAL,
                                       attributes=attributes, start_time=self._wall(ticket.arrival_ns))
        # The run span's parent, kept from the grant to the end: Envoy's Check span, or, for a
        # request Envoy did not trace, this queue span (so it is still one trace).
        self._run_parents[ticket.token] = parent or trace.set_span_in_context(span, Context())
        at = self._wall(decision.granted_ns)
        winner: dict[str, Any] = {"llamaswap.request_id": ticket.request_id, "llamaswap.priority": decision.priority,
                                  "llamaswap.band": decision.band.value}
        if ticket.trace_id is not None:
            winner["llamaswap.trace_id"] = ticket.trace_id
        for other in overtaken:
            event: dict[str, Any] = {"llamaswap.request_id": other.request_id, "llamaswap.priority": other.priority,
                                     "llamaswap.band": other.band.value}
            if other.trace_id is not None:
                event["llamaswap.trace_id"] = other.trace_id
            span.add_event(OVERTOOK_EVENT, event, timestamp=at)
            kept, count = self._overtaken_by.setdefault(other.request_id, ([], [0]))
            count[0] += 1
            if len(kept) < OVERTAKEN_EVENTS_KEPT:
                kept.append((at, winner))
        for eviction in decision.evicts:
            span.add_event(EVICTED_EVENT, {"llamaswap.evicted_model": eviction.model,
                                           "llamaswap.evict_reason": eviction.reason.value,
                                           "llamaswap.upstream": decision.gpu}, timestamp=at)
        self._add_overtaken_by(span, ticket.request_id)
        self._add_stops_for(span, ticket.token)
        span.end(end_time=at)

    def _add_stops_for(self, span: Any, token: str) -> None:
        """The Batch API lines stopped to make room for this request, as events on its queue span."""
        for at, line in self._stops_for.pop(token, ()):
            span.add_event(STOPPED_LINE_EVENT, line, timestamp=at)

    def _add_overtaken_by(self, span: Any, request_id: str) -> None:
        """The requests that went ahead of this one while it waited, as events on its queue span."""
        kept, count = self._overtaken_by.pop(request_id, ([], [0]))
        for at, winner in kept:
            span.add_event(OVERTAKEN_BY_EVENT, winner, timestamp=at)
        if count[0]:
            span.set_attribute("llamaswap.overtaken_count", count[0])

    def finished(self, ticket: Ticket) -> None:
        self._models_info.left(ticket.token)
        outcome = ticket.outcome
        if self._closed or outcome is None:
            return
        instruments = self.instruments
        instruments.requests.add_to(OUTCOME_SERIES[outcome])
        if ticket.request_id_replaced:
            instruments.request_id_replaced.add(1)
        source_counted = self._source_counted.get(ticket.priority.source)
        if source_counted is not None:
            source_counted.add(1)
        finished_ns = ticket.ended_ns
        decision = ticket.decision
        if decision is not None:
            ran_ns = finished_ns - decision.granted_ns
            run_s = ran_ns / NS_PER_S if ran_ns > 0 else 0.0  # (not max(0, ...): a builtin call, 0.1 us)
            instruments.run.record(run_s, BAND_LABELS[decision.band])
            label = instruments.model_labels.label(ticket.model or NO_MODEL)
            if label is None:
                instruments.model_label_other.add(1)
            model = label or OTHER_MODEL
            instruments.model_run.record(run_s, model)
            # A non-streamed first byte is the generation's end, not the end of the load.
            if decision.model_load and ticket.streamed and ticket.first_byte_s is not None:
                instruments.model_swap.record(ticket.first_byte_s, model)
        if not self._tracing:
            return
        attributes = self._attributes(ticket)
        attributes["llamaswap.outcome"] = outcome.value
        if decision is None:
            # Never granted (refused, expired, gone): the queue span covers arrival to the end.
            waited_ns = ticket.queue_wait_ns
            attributes["llamaswap.queue_wait_ms"] = waited_ns / 1e6
            attributes["llamaswap.aging"] = waited_ns / self._aging_divisor_ns if self._aging_divisor_ns else 0.0
            name, start_ns = QUEUE_SPAN, ticket.arrival_ns
        else:
            attributes.update(_decision_attributes(ticket))
            if ticket.first_byte_s is not None:
                attributes["llamaswap.first_byte_ms"] = ticket.first_byte_s * 1000
            if ticket.response_status:
                attributes["llamaswap.status"] = ticket.response_status
            name, start_ns = RUN_SPAN, decision.granted_ns
        parent = self._run_parents.pop(ticket.token, None) or parent_of(ticket)
        span = self._tracer.start_span(name, context=parent or Context(), kind=SpanKind.INTERNAL,
                                       attributes=attributes, start_time=self._wall(start_ns))
        if decision is None:
            self._add_overtaken_by(span, ticket.request_id)
            self._add_stops_for(span, ticket.token)
        else:  # (its queue span was written at its grant: a stop taken after that made it no room)
            self._stops_for.pop(ticket.token, None)
        stop = self._stop_of_line.pop(ticket.token, None)
        if stop is not None:
            span.add_event(STOPPED_EVENT, stop[1], timestamp=stop[0])
        if outcome is Outcome.WATCHDOG:
            span.add_event(WATCHDOG_EVENT, {"llamaswap.request_id": ticket.request_id},
                           timestamp=self._wall(finished_ns))
        if outcome.is_error:
            span.set_status(Status(StatusCode.ERROR, outcome.value))
        span.end(end_time=self._wall(finished_ns))

    def watchdog_fired(self, ticket: Ticket) -> None:
        if not self._closed:
            self.instruments.watchdog.add(1)

    def kept_place(self, event: KeptEvent) -> None:
        if not self._closed:
            self.instruments.kept_places.add(1, {"event": event.kind.value})

    def line_stopped(self, line: Ticket, waiting: Ticket | None, tokens_kept: int | None) -> None:
        if self._closed:
            return
        self.instruments.preemptions.add(1, {"band": line.priority.band.value})
        if not self._tracing:
            return
        at = self._wall(self._clock.now_ns())
        made_room: dict[str, Any] = {}
        if waiting is not None:
            made_room = {"llamaswap.for_request_id": waiting.request_id,
                         "llamaswap.for_band": waiting.priority.band.value}
            stopped = {"llamaswap.request_id": line.request_id, "llamaswap.band": line.priority.band.value}
            if line.decision is not None:
                stopped["llamaswap.upstream"] = line.decision.gpu
            if waiting.state is not TicketState.DONE:  # (else its spans are written: nothing to add to)
                self._stops_for.setdefault(waiting.token, []).append((at, stopped))
        self._stop_of_line[line.token] = (at, made_room)

    def idle_unloaded(self, unload: IdleUnloaded) -> None:
        if not self._closed:
            self.instruments.evictions.add(1, _eviction_labels(unload.gpu, EvictReason.IDLE))

    def settled(self, settle: Settle) -> None:
        if not self._closed:
            self.instruments.settle.record(settle.seconds, settle.reason.value, settle.result.value)

    # -- helpers -------------------------------------------------------------------------

    def _wall(self, clock_ns: int) -> int:
        return clock_ns + self._wall_offset_ns

    @staticmethod
    def _attributes(ticket: Ticket) -> dict[str, Any]:
        attributes: dict[str, Any] = {
            "llamaswap.request_id": ticket.request_id,
            "llamaswap.priority": ticket.priority.value,
            "llamaswap.band": ticket.priority.band.value,
            "llamaswap.queue_depth": ticket.queue_depth_at_arrival,
        }
        if ticket.model is not None:
            attributes["llamaswap.model"] = ticket.model
        takeover = ticket.takeover
        if takeover is not None:  # it took over a kept place: its wait counts from that earlier try
            if takeover.from_attempt is not None:
                attributes["llamaswap.kept.from_attempt"] = takeover.from_attempt
            attributes["llamaswap.kept.away_ms"] = takeover.away_ns / 1e6
        return attributes

    # -- gauges --------------------------------------------------------------------------

    def _current(self) -> QueuePicture:
        """The picture to read: on the loop's thread the queue's now (built, and taken in by
        `queue_changed`, if it moved since), on another the last built."""
        if self._pictures is not None:
            self._pictures.latest()
        return self._picture

    def _observe_depth(self, options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(depth, {"band": band.value}) for band, depth in self._current().depth]

    def _observe_oldest_wait(self, options: CallbackOptions) -> Iterable[Observation]:
        now = self._clock.now_ns()
        return [Observation(max(0, now - arrival) / NS_PER_S if arrival is not None else 0.0, {"band": band.value})
                for band, arrival in self._current().oldest_arrival_ns]

    def _observe_busy(self, options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(1 if self._current().node.busy else 0)]

    def _observe_slots(self, options: CallbackOptions) -> Iterable[Observation]:
        picture = self._current()
        # Several upstreams: the node's slots (the busy ones are counted over all of them too).
        return [Observation(picture.node.slots_total)]

    def _observe_slots_busy(self, options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(self._current().node.slots_busy)]

    def _observe_waiting(self, options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(sum(depth for _, depth in self._current().depth))]

    def _observe_saturation(self, options: CallbackOptions) -> Iterable[Observation]:
        # An upstream that a settle or an adopted exchange holds takes no grant: it counts as full.
        gpus = self._current().node.gpus
        total = sum(gpu.slots for gpu in gpus)
        taken = sum(gpu.slots if gpu.blocked else min(gpu.slots_busy, gpu.slots) for gpu in gpus)
        return [Observation(taken / total if total else 0.0)]

    def _observe_models_info(self, options: CallbackOptions) -> Iterable[Observation]:
        self._current()  # (a picture built now may change the resident models)
        labels, changed = self._models_info.current
        return [Observation(changed, labels)]

    def _observe_upstream_slots(self, options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(gpu.slots, {"upstream": gpu.name}) for gpu in self._current().node.gpus]

    def _observe_upstream_slots_busy(self, options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(gpu.slots_busy, {"upstream": gpu.name}) for gpu in self._current().node.gpus]

    def _observe_upstream_busy(self, options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(1 if gpu.slots_busy or gpu.blocked else 0, {"upstream": gpu.name})
                for gpu in self._current().node.gpus]

    def _observe_models_resident(self, options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(len(gpu.resident_models), {"upstream": gpu.name}) for gpu in self._current().node.gpus]

    def _observe_upstream_model(self, options: CallbackOptions) -> Iterable[Observation]:
        # One series per upstream and resident model (model="": none known), whatever the models' names:
        # bounded by the models an upstream holds at once (today one) times the upstreams.
        return [Observation(1, {"upstream": gpu.name, "model": model})
                for gpu in self._current().node.gpus for model in gpu.resident_models or ("",)]


def _eviction_labels(gpu: str, reason: EvictReason) -> dict[str, str]:
    """An eviction series' labels, in the one order its counts are kept under."""
    return {"upstream": gpu, "reason": reason.value}


def _max_loaded(picture: QueuePicture) -> tuple[int, ...]:
    """Each upstream's `maxLoaded`, in the configured order (a reload may change it)."""
    return tuple(gpu.max_loaded for gpu in picture.node.gpus)


def _resident_models(picture: QueuePicture) -> tuple[tuple[str, ...], ...]:
    """Each upstream's resident models, in the configured order."""
    return tuple(gpu.resident_models for gpu in picture.node.gpus)


def _decision_attributes(ticket: Ticket) -> dict[str, Any]:
    decision = ticket.decision
    assert decision is not None
    attributes: dict[str, Any] = {
        "llamaswap.score": decision.score,
        "llamaswap.queue_wait_ms": decision.queue_wait_ns / 1e6,
        "llamaswap.swap_affinity": decision.swap_affinity,
        "llamaswap.aging": decision.aging,
        "llamaswap.swap": decision.swap,
        "llamaswap.load": decision.load,
        "llamaswap.serial_slots_busy": decision.slots_busy,  # running grants, this one included
        "llamaswap.upstream": decision.gpu,  # the upstream (GPU) it runs on
    }
    if decision.reordered_by:
        attributes["llamaswap.reordered_by"] = sorted(cause.value for cause in decision.reordered_by)
    if ticket.estimated_wait_s is not None:
        attributes["llamaswap.estimated_wait_ms"] = ticket.estimated_wait_s * 1000
    return attributes
