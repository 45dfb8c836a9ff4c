"""Telemetry of the Batch API: a trace per batch that its lines join, and two metrics.

- One trace per batch. Its ids are drawn when the batch is created and kept in the store, so a
  restarted sidecar adds to the same trace: each line is a span `llamaswap.batch.line` under
  the batch's span, and the line's request carries its `traceparent` through Envoy, whose span
  (and the sidecar's queue and run spans under it) joins the line's. The batch's own span
  `llamaswap.batch` is written when the batch ends, from its creation, with the kept ids.
- `llamaswap_batch_requests_total{outcome}`: lines ended, by how (`LineOutcome`).
- `llamaswap_batches{status}`: batches in each status now.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterable, Iterator, Mapping

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.metrics import CallbackOptions, Meter, Observation
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.trace import NonRecordingSpan, Span, SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from llamaswap.batches.lifecycle import BatchStatus, LineOutcome
from llamaswap.batches.store import BatchRecord
from llamaswap.batches.validate import InputLine
from llamaswap.telemetry.instruments import Tally

BATCH_REQUESTS = "llamaswap_batch_requests_total"
BATCHES = "llamaswap_batches"
BATCH_SPAN = "llamaswap.batch"
LINE_SPAN = "llamaswap.batch.line"
_PROPAGATOR = TraceContextTextMapPropagator()


class PresetIds(RandomIdGenerator):
    """Random ids, except for a span started inside `preset`: the batch's span gets the ids its
    lines were already given as parent."""

    def __init__(self) -> None:
        self._preset: contextvars.ContextVar[tuple[int, int] | None] = contextvars.ContextVar("preset", default=None)

    @contextlib.contextmanager
    def preset(self, trace_id: int, span_id: int) -> Iterator[None]:
        token = self._preset.set((trace_id, span_id))
        try:
            yield
        finally:
            self._preset.reset(token)

    def generate_trace_id(self) -> int:
        preset = self._preset.get()
        return preset[0] if preset else super().generate_trace_id()

    def generate_span_id(self) -> int:
        preset = self._preset.get()
        return preset[1] if preset else super().generate_span_id()


def new_trace_ids() -> tuple[str, str]:
    """A batch's trace id and span id, as hex (W3C trace context's spelling)."""
    ids = RandomIdGenerator()
    return f"{ids.generate_trace_id():032x}", f"{ids.generate_span_id():016x}"


def _batch_context(batch: BatchRecord) -> Context:
    parent = SpanContext(int(batch.trace_id, 16), int(batch.span_id, 16), is_remote=True,
                         trace_flags=TraceFlags(TraceFlags.SAMPLED))
    return trace.set_span_in_context(NonRecordingSpan(parent), Context())


class BatchTelemetry:
    """The feeder's observer (`batches.feeder.BatchObserver`): spans through ``tracer`` (made with
    ``ids`` as its provider's id generator), metrics on ``meter``."""

    def __init__(self, tracer: trace.Tracer, meter: Meter, ids: PresetIds | None = None, *,
                 tracing: bool = True) -> None:
        self._tracer = tracer
        self._ids = ids
        # Without an exporter no span is made (each line's would cost the sidecar's loop for nothing).
        self._tracing = tracing
        self._lines: dict[tuple[str, int], Span] = {}
        self._statuses: dict[BatchStatus, int] = {status: 0 for status in BatchStatus}
        self.requests = Tally(meter, BATCH_REQUESTS, unit="{request}",
                              description="Lines of batches ended, by outcome (completed, failed, expired, cancelled).",
                              series=[{"outcome": outcome.value} for outcome in LineOutcome])
        meter.create_observable_gauge(BATCHES, [self._observe_batches], unit="{batch}",
                                      description="Batches in each status now.")

    def line_started(self, batch: BatchRecord, line: InputLine, request_id: str) -> dict[str, str]:
        if not self._tracing:
            return {}
        span = self._tracer.start_span(LINE_SPAN, context=_batch_context(batch), kind=SpanKind.CLIENT, attributes={
            "llamaswap.batch.id": batch.id, "llamaswap.batch.custom_id": line.custom_id,
            "llamaswap.batch.line": line.line, "llamaswap.request_id": request_id,
            "llamaswap.priority": batch.priority, "url.path": batch.endpoint})
        previous = self._lines.pop((batch.id, line.line), None)
        if previous is not None:  # an earlier try that never ended (a cancel raced it)
            previous.end()
        self._lines[(batch.id, line.line)] = span
        headers: dict[str, str] = {}
        _PROPAGATOR.inject(headers, context=trace.set_span_in_context(span, Context()))
        return headers

    def line_ended(self, batch: BatchRecord, line: InputLine, outcome: LineOutcome, status_code: int | None,
                   answered_ns: int | None = None) -> None:
        self.requests.add(1, {"outcome": outcome.value})
        span = self._lines.pop((batch.id, line.line), None)
        if span is None:
            return
        span.set_attribute("llamaswap.batch.outcome", outcome.value)
        if status_code is not None:
            span.set_attribute("http.response.status_code", status_code)
        if outcome is not LineOutcome.COMPLETED:
            span.set_status(Status(StatusCode.ERROR, outcome.value))
        span.end(end_time=answered_ns)  # when the answer came: its result may be written later

    def lines_ended(self, outcome: LineOutcome, count: int) -> None:
        """Lines that ended without being answered (expired, cancelled)."""
        if count:
            self.requests.add(count, {"outcome": outcome.value})

    def batch_ended(self, batch: BatchRecord) -> None:
        if not self._tracing:
            return
        for key in [key for key in self._lines if key[0] == batch.id]:
            span = self._lines.pop(key)
            span.set_status(Status(StatusCode.ERROR, "abandoned"))
            span.end()
        ended_at = next((stamp for stamp in (batch.timestamps.get(name) for name in (
            "completed_at", "failed_at", "expired_at", "cancelled_at")) if stamp), None)
        attributes = {"llamaswap.batch.id": batch.id, "llamaswap.batch.status": batch.status.value,
                      "llamaswap.batch.total": batch.total, "llamaswap.priority": batch.priority,
                      "url.path": batch.endpoint, "llamaswap.batch.input_file_id": batch.input_file_id}
        preset = (self._ids.preset(int(batch.trace_id, 16), int(batch.span_id, 16)) if self._ids is not None
                  else contextlib.nullcontext())
        with preset:
            span = self._tracer.start_span(BATCH_SPAN, context=Context(), kind=SpanKind.INTERNAL,
                                           start_time=batch.created_at * 1_000_000_000, attributes=attributes)
        if batch.status is not BatchStatus.COMPLETED:
            span.set_status(Status(StatusCode.ERROR, batch.status.value))
        span.end(end_time=ended_at * 1_000_000_000 if ended_at else None)

    def statuses(self, counts: Mapping[BatchStatus, int]) -> None:
        self._statuses = {status: counts.get(status, 0) for status in BatchStatus}

    def _observe_batches(self, options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(count, {"status": status.value}) for status, count in self._statuses.items()]

