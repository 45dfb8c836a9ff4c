"""Telemetry (spans, metrics, Prometheus text) as an Observer of a real Coordinator, in memory.

The coordinator runs on a virtual-time loop (tests/flow.py): waits, runs and span durations
are exact. Spans are written when they end: `llamaswap.queue` (arrival to grant, or to the end
of a request never granted) and `llamaswap.run` (grant to finish), both children of Envoy's
Check span named by the Check's traceparent.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import threading
import time
from typing import Any

import pytest
from flow import PEER, FakeServicerContext, FakeUpstream, Flow, check_request, clock, virtual_time
from llamaswap.config import parse_config
from llamaswap.core import Outcome, ReorderCause
from llamaswap.commands.queue import format_duration, render
from llamaswap.runtime.observer import SettleReason, SettleResult
from llamaswap.runtime.ticket import Arrival, ExchangeEnd, Ticket
from llamaswap.telemetry import (OVERTAKEN_BY_EVENT, OVERTOOK_EVENT, QUEUE_SPAN, RUN_SPAN, Telemetry,
                                 exporters_from_environment, parent_of)
from llamaswap.telemetry import instruments as names
from llamaswap.telemetry.prometheus import CONTENT_TYPE, metric_names
from opentelemetry.sdk.metrics.export import InMemoryMetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from opentelemetry.trace import StatusCode
from test_coordinator import ENDINGS, RaisesOnEnqueue, Scenario, internal_error

S = 1_000_000_000
BANDS = {"interactive", "normal", "batch"}
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CHECK_SPAN = "00f067aa0ba902b7"
OTHER_TRACE = "0af7651916cd43dd8448eb211c80319c"
LONG_LEASE = {"envoy": {"leaseSeconds": 1000}}
# The outcomes a span reports as an error, spelled out (not read from Outcome.is_error).
ERRORS = {Outcome.REJECTED_FULL, Outcome.REJECTED_UNKNOWN_MODEL, Outcome.EXPIRED, Outcome.UPSTREAM_ERROR,
          Outcome.SHUTDOWN, Outcome.WATCHDOG, Outcome.LEASE_EXPIRED, Outcome.PROXY_GONE, Outcome.INTERNAL_ERROR}


def traceparent(trace_id: str = TRACE_ID, span_id: str = CHECK_SPAN, flags: str = "01") -> str:
    return f"00-{trace_id}-{span_id}-{flags}"


class Traced:
    """A Flow observed by a Telemetry that exports spans to memory."""

    def __init__(self, config: dict[str, Any] | None = None, *, telemetry: Telemetry | None = None,
                 exporter: InMemorySpanExporter | None = None, readers: tuple[Any, ...] = (),
                 upstream: FakeUpstream | None = None, observers: tuple[Any, ...] = ()) -> None:
        self.spans = exporter or InMemorySpanExporter()
        self.telemetry = telemetry or Telemetry(clock=clock(), span_processors=[SimpleSpanProcessor(self.spans)],
                                                sampler=ALWAYS_ON, metric_readers=readers)
        self.flow = Flow(config, observers=(*observers, self.telemetry), upstream=upstream)

    def finished_spans(self, name: str | None = None) -> list[ReadableSpan]:
        return [s for s in self.spans.get_finished_spans() if name is None or s.name == name]

    def span(self, name: str, request_id: str) -> ReadableSpan:
        found = [s for s in self.finished_spans(name) if s.attributes.get("llamaswap.request_id") == request_id]
        assert len(found) == 1, (name, request_id, found)
        return found[0]

    def metrics(self) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
        body, content_type = self.telemetry.prometheus_text()
        assert content_type == CONTENT_TYPE
        return parse_text(body.decode())


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_text(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    samples = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        assert match, f"not a sample line: {line!r}"
        labels = frozenset(_LABEL.findall(match.group(2) or ""))
        key = (match.group(1), labels)
        assert key not in samples, f"duplicate sample {key}"
        samples[key] = float(match.group(3))
    return samples


def value(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def by_label(samples: dict, name: str, label: str, **labels: str) -> dict[str, float]:
    out = {}
    for (sample_name, sample_labels), number in samples.items():
        found = dict(sample_labels)
        if sample_name == name and set(found) == {label, *labels} and all(found[k] == v for k, v in labels.items()):
            out[found[label]] = number
    return out


# -- spans -----------------------------------------------------------------------------------


@virtual_time
async def test_spans_join_envoys_trace_with_the_decision() -> None:
    before = time.time_ns()
    traced = Traced(LONG_LEASE)
    after = time.time_ns()
    flow = traced.flow
    blocker = await flow.arrive("blocker", model="a")
    early = await flow.arrive("early", "normal", "b", trace_parent=traceparent(OTHER_TRACE, "b7ad6b7169203331"))
    winner = await flow.arrive("winner", "interactive", "a", trace_parent=traceparent(),
                               trace_state="vendor=1")
    await flow.advance(2.5)
    await flow.complete(blocker)
    assert winner.granted
    queue = traced.span(QUEUE_SPAN, "winner")  # written at the grant
    assert traced.finished_spans(RUN_SPAN) == [traced.span(RUN_SPAN, "blocker")]
    await flow.advance(4.0)
    await flow.complete(winner, 200, first_byte_s=0.3)
    run = traced.span(RUN_SPAN, "winner")

    for span in (queue, run):  # children of Envoy's Check span, in its trace
        assert format(span.context.trace_id, "032x") == TRACE_ID
        assert format(span.parent.span_id, "016x") == CHECK_SPAN and span.parent.is_remote
        assert span.context.trace_state.get("vendor") == "1"
    # Wall time, durations exactly the scheduler's.
    assert before <= queue.start_time <= after
    assert queue.end_time - queue.start_time == round(2.5 * S)
    assert run.start_time == queue.end_time
    assert run.end_time - run.start_time == 4 * S

    for span in (queue, run):
        attributes = dict(span.attributes)
        assert attributes["llamaswap.request_id"] == "winner"
        assert attributes["llamaswap.priority"] == 100
        assert attributes["llamaswap.band"] == "interactive"
        assert attributes["llamaswap.model"] == "a"
        assert attributes["llamaswap.queue_depth"] == 1  # `early` was waiting
        assert attributes["llamaswap.queue_wait_ms"] == 2500.0
        assert attributes["llamaswap.swap_affinity"] is True  # the blocker loaded a
        assert attributes["llamaswap.swap"] is False and attributes["llamaswap.load"] is False
        assert attributes["llamaswap.aging"] == pytest.approx(2.5 / 60)
        assert attributes["llamaswap.score"] == pytest.approx(100 + 10 + 2.5 / 60)
        # The estimate at arrival: the blocker (a load: 10 + 5 s) had 14.95 s left at the batch.
        assert attributes["llamaswap.estimated_wait_ms"] == pytest.approx(15_000)
        assert "llamaswap.reordered_by" not in attributes  # the best score anyway
    assert "llamaswap.outcome" not in queue.attributes
    assert run.attributes["llamaswap.outcome"] == "served"
    assert run.attributes["llamaswap.first_byte_ms"] == pytest.approx(300)
    assert run.attributes["llamaswap.status"] == 200
    assert run.status.status_code is StatusCode.UNSET
    # The winner overtook `early`: one event naming it by request id and trace, never by ticket.
    events = [e for e in queue.events if e.name == OVERTOOK_EVENT]
    assert [dict(e.attributes) for e in events] == [{
        "llamaswap.request_id": "early", "llamaswap.priority": 0, "llamaswap.band": "normal",
        "llamaswap.trace_id": OTHER_TRACE}]
    assert events[0].timestamp == queue.end_time

    # `early`'s own queue span, written at its grant, names who went ahead of it.
    queue_early = traced.span(QUEUE_SPAN, "early")
    taken = [e for e in queue_early.events if e.name == OVERTAKEN_BY_EVENT]
    assert [dict(e.attributes) for e in taken] == [{
        "llamaswap.request_id": "winner", "llamaswap.priority": 100, "llamaswap.band": "interactive",
        "llamaswap.trace_id": TRACE_ID}]
    assert taken[0].timestamp == queue.end_time and queue_early.attributes["llamaswap.overtaken_count"] == 1
    assert "llamaswap.overtaken_count" not in queue.attributes

    await flow.complete(early, 502)
    run_early = traced.span(RUN_SPAN, "early")
    assert run_early.attributes["llamaswap.outcome"] == "upstream_error"
    assert run_early.status.status_code is StatusCode.ERROR
    assert format(run_early.parent.span_id, "016x") == "b7ad6b7169203331"
    tokens = {r.ticket.token for r in flow.requests.values()}
    for span in traced.finished_spans():
        text = repr(dict(span.attributes)) + repr([dict(e.attributes) for e in span.events])
        assert not any(token in text for token in tokens)
    # The blocker had no traceparent: its queue span is a root, its run span under it, one trace.
    blocker_queue = traced.span(QUEUE_SPAN, "blocker")
    blocker_run = traced.span(RUN_SPAN, "blocker")
    assert blocker_queue.parent is None
    assert blocker_run.parent is not None and blocker_run.parent.span_id == blocker_queue.context.span_id
    assert blocker_run.context.trace_id == blocker_queue.context.trace_id


@virtual_time
async def test_the_spans_of_a_retry_that_took_a_kept_place_say_from_which_try_and_how_long_away() -> None:
    traced = Traced(LONG_LEASE)  # routing.retryGraceSeconds: its default
    flow = traced.flow

    async def arrive(request_id: str, attempt: int | None, key: bytes | None = b"k" * 16):
        return await flow.admit(Arrival(request_id, None, None, "a", PEER, None, None, "POST",
                                        "/v1/chat/completions", retry_key=key, attempt=attempt))

    blocker = await arrive("blocker", None, key=None)
    first = await arrive("job", 0)
    await flow.advance(1)
    await flow.cancel(first)
    await flow.advance(0.75)
    retry = await arrive("job", 1)
    await flow.complete(blocker)
    assert retry.granted
    await flow.complete(retry)
    # Two queue spans carry its id: the first try's (it left) and the retry's, which took the place.
    queues = [s for s in traced.finished_spans(QUEUE_SPAN) if s.attributes.get("llamaswap.request_id") == "job"]
    assert ["llamaswap.kept.away_ms" in s.attributes for s in queues] == [False, True]
    for attributes in (queues[1].attributes, traced.span(RUN_SPAN, "job").attributes):
        assert attributes["llamaswap.kept.from_attempt"] == 0
        assert attributes["llamaswap.kept.away_ms"] == 750.0
    # The request that did not take a place says nothing of one.
    assert "llamaswap.kept.away_ms" not in traced.span(RUN_SPAN, "blocker").attributes


@virtual_time
async def test_reordered_spans_name_the_cause() -> None:
    traced = Traced({**LONG_LEASE, "routing": {"scheduler": {"settings": {"serial": {"agingDivisor": 1}}}}})
    flow = traced.flow
    blocker = await flow.arrive("blocker", model="a")
    old = await flow.arrive("old", "0", "b")
    await flow.advance(10)
    young = await flow.arrive("young", "5", "b")
    await flow.complete(blocker)
    assert old.granted and young.waiting  # 0 + 10 s of aging beats 5
    assert traced.span(QUEUE_SPAN, "old").attributes["llamaswap.reordered_by"] == ("aging",)
    assert old.ticket.decision.reordered_by == frozenset({ReorderCause.AGING})


@pytest.mark.parametrize(("scenario", "outcome"), ENDINGS, ids=[s.__name__ for s, _ in ENDINGS])
@virtual_time
async def test_each_ending_is_one_span_with_its_outcome(scenario: Scenario, outcome: Outcome) -> None:
    config = {"routing": {"scheduler": {"maxQueued": 1, "maxWaitSeconds": 2, "maxRunSeconds": 4}}}
    observers = (RaisesOnEnqueue("it"),) if scenario is internal_error else ()
    traced = Traced(config, observers=observers)
    it = await scenario(traced.flow)
    ticket = it.ticket
    assert ticket.outcome is outcome
    name = QUEUE_SPAN if ticket.decision is None else RUN_SPAN
    span = traced.span(name, "it")
    assert span.attributes["llamaswap.outcome"] == outcome.value
    assert span.status.status_code is (StatusCode.ERROR if outcome in ERRORS else StatusCode.UNSET)
    start = ticket.arrival_ns if ticket.decision is None else ticket.decision.granted_ns
    assert span.end_time - span.start_time == ticket.finished_ns - start
    if ticket.decision is None:
        assert span.attributes["llamaswap.queue_wait_ms"] == (ticket.finished_ns - ticket.arrival_ns) / 1e6
        assert [s for s in traced.finished_spans(RUN_SPAN) if s.attributes["llamaswap.request_id"] == "it"] == []
    else:
        assert len([s for s in traced.finished_spans(QUEUE_SPAN) if s.attributes["llamaswap.request_id"] == "it"]) == 1
    # requests_total agrees with the outcomes of everything that finished.
    samples = traced.metrics()
    counts = {o: 0 for o in Outcome}
    for t in traced.flow.recorder.ended:
        counts[t.outcome] += 1
    assert {o: value(samples, names.REQUESTS, outcome=o.value) for o in Outcome} == counts
    assert counts[outcome] >= 1


@virtual_time
async def test_a_request_never_granted_gets_the_aging_it_had() -> None:
    traced = Traced(LONG_LEASE)
    flow = traced.flow
    await flow.arrive("blocker", model="a")
    gone = await flow.arrive("gone", model="a")
    await flow.advance(3)
    await flow.cancel(gone)
    span = traced.span(QUEUE_SPAN, "gone")
    assert span.attributes["llamaswap.queue_wait_ms"] == 3000.0
    assert span.attributes["llamaswap.aging"] == pytest.approx(3 / 60)
    assert span.end_time - span.start_time == 3 * S
    flow.coordinator.reconfigure(parse_config({**LONG_LEASE, "routing": {"scheduler": {"settings": {
        "serial": {"agingDivisor": 30}}}}}))  # settings_changed
    later = await flow.arrive("later", model="a")
    await flow.advance(3)
    await flow.cancel(later)
    assert traced.span(QUEUE_SPAN, "later").attributes["llamaswap.aging"] == pytest.approx(3 / 30)


@virtual_time
async def test_a_traceparent_that_is_not_sampled_records_no_span() -> None:
    exporter = InMemorySpanExporter()
    # The SDK's default sampler (parent-based): Envoy's decision is kept.
    telemetry = Telemetry(clock=clock(), span_processors=[SimpleSpanProcessor(exporter)])
    traced = Traced(telemetry=telemetry, exporter=exporter)
    quiet = await traced.flow.arrive("quiet", model="a", trace_parent=traceparent(flags="00"))
    loud = await traced.flow.arrive("loud", model="a", trace_parent=traceparent(OTHER_TRACE, flags="01"))
    await traced.flow.complete(quiet)
    await traced.flow.complete(loud)
    assert {s.attributes["llamaswap.request_id"] for s in exporter.get_finished_spans()} == {"loud"}


@virtual_time
async def test_the_sampler_from_the_environment_is_respected(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")
    exporter = InMemorySpanExporter()
    traced = Traced(telemetry=Telemetry(clock=clock(), span_processors=[SimpleSpanProcessor(exporter)]),
                    exporter=exporter)
    ticket = await traced.flow.arrive("quiet", model="a", trace_parent=traceparent())
    await traced.flow.complete(ticket)
    assert exporter.get_finished_spans() == ()
    assert value(traced.metrics(), names.REQUESTS, outcome="served") == 1  # metrics are not sampled


@virtual_time
async def test_without_span_processors_no_span_is_recorded_but_metrics_are() -> None:
    telemetry = Telemetry(clock=clock())
    flow = Flow(LONG_LEASE, observers=[telemetry])
    a = await flow.arrive("a", model="a", trace_parent=traceparent())
    await flow.complete(a)
    assert telemetry.tracer_provider.get_tracer("probe").start_span("x").is_recording() is False
    assert value(parse_text(telemetry.prometheus_text()[0].decode()), names.DISPATCHED, band="normal") == 1


def test_parent_of_reads_the_tickets_traceparent() -> None:
    from llamaswap.runtime.ticket import Arrival

    def ticket(parent: str | None, state: str | None = None) -> Ticket:
        policy = parse_config({}).priority_policy()
        return Ticket("t", Arrival("r", None, None, None, PEER, parent, state), policy.resolve(None), 0)

    context = parent_of(ticket(traceparent(), "a=b"))
    assert context is not None
    from opentelemetry import trace

    span_context = trace.get_current_span(context).get_span_context()
    assert format(span_context.trace_id, "032x") == TRACE_ID and span_context.is_remote
    assert span_context.trace_state.get("a") == "b"
    assert parent_of(ticket(None)) is None
    assert parent_of(ticket("garbage")) is None
    assert parent_of(ticket(traceparent("0" * 32))) is None  # the invalid all-zero trace id
    assert ticket(traceparent()).trace_id == TRACE_ID
    assert ticket(traceparent("0" * 32)).trace_id is None
    assert ticket("garbage").trace_id is None


# -- metrics ---------------------------------------------------------------------------------


@virtual_time
async def test_metric_values_after_scripted_traffic() -> None:
    traced = Traced(LONG_LEASE)
    flow = traced.flow
    samples = traced.metrics()
    # Every labelled series exists from the start, at 0.
    for name in (names.QUEUE_DEPTH, names.QUEUE_OLDEST_WAIT, names.DISPATCHED):
        assert by_label(samples, name, "band") == {band: 0.0 for band in BANDS}, name
    for cause in ("aging", "swap_affinity"):
        assert by_label(samples, names.REORDERS, "band", reason=cause) == {band: 0.0 for band in BANDS}
    for name in (names.GPU_BUSY, names.SWAPS, names.LOADS, names.UNPARSEABLE, names.ABSENT, names.WATCHDOG):
        assert value(samples, name) == 0, name
    assert by_label(samples, names.REQUESTS, "outcome") == {o.value: 0.0 for o in Outcome}
    assert set(metric_names(traced.telemetry.prometheus_text()[0].decode())) == set(names.ALL) - {
        names.QUEUE_WAIT, names.RUN, names.MODEL_SWAP, names.MODEL_RUN, names.ESTIMATE_RATIO, names.SETTLE}

    a = await flow.arrive("a", None, "a")  # absent header; granted at once: a load
    await flow.advance(1)
    b = await flow.arrive("b", "batch", "a")
    await flow.advance(1)
    n = await flow.arrive("n", "soon please", "b")  # unparseable: 0, normal
    await flow.advance(1)
    i = await flow.arrive("i", "interactive", "b")
    i2 = await flow.arrive("i2", "interactive", "a")
    await flow.advance(0.5)
    samples = traced.metrics()
    assert by_label(samples, names.QUEUE_DEPTH, "band") == {"interactive": 2, "normal": 1, "batch": 1}
    assert by_label(samples, names.QUEUE_OLDEST_WAIT, "band") == {"interactive": 0.5, "normal": 1.5, "batch": 2.5}
    assert value(samples, names.GPU_BUSY) == 1
    assert by_label(samples, names.DISPATCHED, "band") == {"interactive": 0, "normal": 1, "batch": 0}
    assert value(samples, names.LOADS) == 1 and value(samples, names.SWAPS) == 0

    await flow.complete(a, 200, first_byte_s=0.4)  # ran 3.5 s
    # a loaded model a: i2 (interactive, a) overtakes the earlier i by swap affinity.
    assert i2.granted and i2.ticket.decision.reordered_by == frozenset({ReorderCause.SWAP_AFFINITY})
    first_bytes = {"i2": None, "i": 1.2, "n": None, "b": None}
    for request in (i2, i, n, b):
        assert request.granted
        await flow.advance(2)
        await flow.complete(request, 200, first_byte_s=first_bytes[request.id])

    samples = traced.metrics()
    assert by_label(samples, names.DISPATCHED, "band") == {"interactive": 2, "normal": 2, "batch": 1}
    assert by_label(samples, names.REORDERS, "band", reason="swap_affinity") == {
        "interactive": 1, "normal": 0, "batch": 0}
    assert by_label(samples, names.REORDERS, "band", reason="aging") == {band: 0 for band in BANDS}
    assert by_label(samples, names.QUEUE_DEPTH, "band") == {band: 0 for band in BANDS}
    assert by_label(samples, names.QUEUE_OLDEST_WAIT, "band") == {band: 0 for band in BANDS}
    assert value(samples, names.GPU_BUSY) == 0
    # A load (nothing -> a), then swaps a -> b (i) and b -> a (b); i2 and n kept the model.
    assert value(samples, names.LOADS) == 1
    assert value(samples, names.SWAPS) == 2
    assert value(samples, names.ABSENT) == 1
    assert value(samples, names.UNPARSEABLE) == 1
    assert value(samples, names.REQUESTS, outcome="served") == 5
    assert value(samples, f"{names.QUEUE_WAIT}_count", band="interactive") == 2
    assert value(samples, f"{names.QUEUE_WAIT}_sum", band="interactive") == pytest.approx(0.5 + 2.5)
    assert value(samples, f"{names.QUEUE_WAIT}_count", band="batch") == 1
    assert value(samples, f"{names.QUEUE_WAIT}_sum", band="batch") == pytest.approx(8.5)
    assert value(samples, f"{names.RUN}_count", band="interactive") == 2
    assert value(samples, f"{names.RUN}_sum", band="interactive") == pytest.approx(4.0)
    assert value(samples, f"{names.RUN}_bucket", band="interactive", le="2.5") == 2
    assert value(samples, f"{names.RUN}_bucket", band="interactive", le="1") == 0
    assert value(samples, f"{names.RUN}_bucket", band="interactive", le="+Inf") == 2
    assert value(samples, f"{names.RUN}_sum", band="normal") == pytest.approx(3.5 + 2)
    # By model: a ran 3.5 + 2 + 2 s, b 2 + 2 s; the swap histogram has the loads with a first byte.
    assert value(samples, f"{names.MODEL_RUN}_count", model="a") == 3
    assert value(samples, f"{names.MODEL_RUN}_sum", model="a") == pytest.approx(7.5)
    assert value(samples, f"{names.MODEL_RUN}_count", model="b") == 2
    assert value(samples, f"{names.MODEL_RUN}_sum", model="b") == pytest.approx(4.0)
    assert value(samples, f"{names.MODEL_SWAP}_count", model="a") == 1
    assert value(samples, f"{names.MODEL_SWAP}_sum", model="a") == pytest.approx(0.4)
    assert value(samples, f"{names.MODEL_SWAP}_count", model="b") == 1
    assert value(samples, f"{names.MODEL_SWAP}_sum", model="b") == pytest.approx(1.2)
    # The estimate of b: made at its batch (a, a load of 10 + 5 s, had 13.95 s left, nothing
    # ahead) 0.05 + 13.95 = 14 s; it waited 8.5 s.
    assert b.ticket.estimated_wait_s == pytest.approx(14.0)
    assert value(samples, f"{names.ESTIMATE_RATIO}_count", band="batch") == 1
    assert value(samples, f"{names.ESTIMATE_RATIO}_sum", band="batch") == pytest.approx(14 / 8.5)
    # Over- and underestimates alike are recorded (a histogram takes no negative value).
    ratios = {r.id: r.ticket.estimated_wait_s / max(r.ticket.decision.queue_wait_ns / S, 0.1) for r in (i, i2, n)}
    assert any(ratio > 1 for ratio in ratios.values())
    assert value(samples, f"{names.ESTIMATE_RATIO}_count", band="interactive") == 2
    assert value(samples, f"{names.ESTIMATE_RATIO}_sum", band="interactive") == pytest.approx(
        ratios["i"] + ratios["i2"])
    assert value(samples, f"{names.ESTIMATE_RATIO}_count", band="normal") == 1  # a was never estimated
    assert value(samples, f"{names.ESTIMATE_RATIO}_sum", band="normal") == pytest.approx(ratios["n"])

    body = traced.telemetry.prometheus_text()[0].decode()
    assert set(metric_names(body)) == set(names.ALL) - {names.SETTLE}  # no settle happened
    declared = dict(re.findall(r"^# TYPE (\S+) (\S+)$", body, re.MULTILINE))
    for name in (names.QUEUE_DEPTH, names.QUEUE_OLDEST_WAIT, names.GPU_BUSY):
        assert declared[name] == "gauge"
    for name in (names.DISPATCHED, names.REORDERS, names.SWAPS, names.LOADS, names.REQUESTS, names.UNPARSEABLE,
                 names.ABSENT, names.WATCHDOG):
        assert declared[name] == "counter"
    for name in (names.QUEUE_WAIT, names.RUN, names.MODEL_SWAP, names.MODEL_RUN, names.ESTIMATE_RATIO):
        assert declared[name] == "histogram"
    # docs/observability.md's metric table names each metric's labels.
    documented = documented_metric_labels()
    for name in set(metric_names(body)):
        assert documented[name] == labels_of(body, name), name


@virtual_time
async def test_settles_are_measured_by_reason_and_result() -> None:
    upstream = FakeUpstream(busy=True)
    traced = Traced(upstream=upstream)
    flow = traced.flow
    flow.coordinator.begin_startup_settle()
    await flow.advance(1)
    upstream.busy_answer = None  # cannot tell: unsupported
    await flow.advance(1)
    a = await flow.arrive("a", model="a")
    assert a.granted
    upstream.busy_answer = True
    await flow.end(a, ExchangeEnd.CLIENT_LEFT)
    await flow.advance(2)
    upstream.busy_answer = False
    await flow.advance(1)
    startup, abandoned = flow.recorder.settles
    assert (startup.reason, startup.result) == (SettleReason.STARTUP, SettleResult.UNSUPPORTED)
    assert (abandoned.reason, abandoned.result) == (SettleReason.ABANDONED, SettleResult.IDLE)
    samples = traced.metrics()
    assert value(samples, f"{names.SETTLE}_count", reason="startup", result="unsupported") == 1
    assert value(samples, f"{names.SETTLE}_sum", reason="startup", result="unsupported") == pytest.approx(
        startup.seconds)
    assert 1 <= startup.seconds <= 1.25
    assert value(samples, f"{names.SETTLE}_count", reason="abandoned", result="idle") == 1
    assert value(samples, f"{names.SETTLE}_sum", reason="abandoned", result="idle") == pytest.approx(
        abandoned.seconds)
    assert 2 <= abandoned.seconds <= 2.25
    assert {labels for name, labels in samples if name == f"{names.SETTLE}_count"} == {
        frozenset({("reason", "startup"), ("result", "unsupported")}),
        frozenset({("reason", "abandoned"), ("result", "idle")})}


@virtual_time
async def test_the_watchdog_is_counted_and_marked() -> None:
    traced = Traced({"routing": {"scheduler": {"maxRunSeconds": 2}}})
    ticket = await traced.flow.arrive("runaway", model="a")
    await traced.flow.advance(2)
    assert ticket.outcome is Outcome.WATCHDOG
    samples = traced.metrics()
    assert value(samples, names.WATCHDOG) == 1
    assert value(samples, names.REQUESTS, outcome="watchdog") == 1
    run = traced.span(RUN_SPAN, "runaway")
    assert [e.name for e in run.events] == ["llamaswap.watchdog"]
    assert run.events[0].timestamp == run.end_time
    assert run.status.status_code is StatusCode.ERROR


@virtual_time
async def test_gauges_collected_on_another_thread_read_the_published_picture() -> None:
    """The OTLP push collects on the SDK's thread: it reads the picture the loop published."""
    reader = InMemoryMetricReader()
    traced = Traced(LONG_LEASE, readers=(reader,))
    flow = traced.flow
    await flow.arrive("running", model="a")
    await flow.arrive("waiting-1", "batch", model="a")
    await flow.advance(3.0)
    await flow.arrive("waiting-2", "batch", model="a")
    await flow.advance(1.5)  # no event since: the oldest wait must still be current
    published = flow.recorder.pictures[-1]

    touched: list[int] = []
    scheduler = flow.coordinator.scheduler
    for method in ("band_stats", "snapshot"):
        original = getattr(scheduler, method)

        def spy(*args: Any, _original: Any = original) -> Any:
            touched.append(threading.get_ident())
            return _original(*args)

        setattr(scheduler, method, spy)
    collected: list[Any] = []
    thread = threading.Thread(target=lambda: collected.append(reader.get_metrics_data()))
    thread.start()
    thread.join()
    assert touched == []
    assert flow.recorder.pictures[-1] is published  # nothing published meanwhile
    points = {}
    for resource_metrics in collected[0].resource_metrics:
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                for point in getattr(metric.data, "data_points", []):
                    points[(metric.name, tuple(sorted((point.attributes or {}).items())))] = getattr(
                        point, "value", None)
    assert points[(names.QUEUE_DEPTH, (("band", "batch"),))] == 2
    assert points[(names.QUEUE_DEPTH, (("band", "normal"),))] == 0
    assert points[(names.QUEUE_OLDEST_WAIT, (("band", "batch"),))] == 4.5
    assert points[(names.QUEUE_OLDEST_WAIT, (("band", "normal"),))] == 0
    assert points[(names.GPU_BUSY, ())] == 1


@virtual_time
async def text_after_traffic() -> bytes:
    """Every family, histograms included, after a little of everything."""
    traced = Traced(upstream=FakeUpstream(busy=None))
    flow = traced.flow
    one = await flow.arrive("one", "interactive", "a")
    two = await flow.arrive("two", "batch", "b")
    await flow.advance(1)
    await flow.end(one, ExchangeEnd.CLIENT_LEFT)  # a settle
    assert two.granted and two.ticket.decision.swap  # a client leaving keeps model a loaded
    await flow.complete(two, 200, first_byte_s=0.1)
    return traced.telemetry.prometheus_text()[0]


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian package prometheus) not installed")
def test_the_text_passes_promtool() -> None:
    body = text_after_traffic()
    assert set(metric_names(body.decode())) == set(names.ALL)
    result = subprocess.run(["promtool", "check", "metrics"], input=body, capture_output=True, timeout=60,
                            check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout + result.stderr == b""  # not even a lint warning


# -- nothing secret --------------------------------------------------------------------------


@virtual_time
async def test_headers_other_than_the_read_ones_never_appear() -> None:
    from llamaswap.runtime.activity import ActivityLog

    secret = "SECRET-bearer-token-never-in-telemetry"
    activity = ActivityLog(clock())
    traced = Traced(LONG_LEASE, observers=(activity,))
    flow = traced.flow
    headers = {"x-request-id": "r-1", "x-llamaswap-priority": "interactive", "authorization": f"Bearer {secret}",
               "cookie": f"session={secret}", "x-api-key": secret}
    context = FakeServicerContext(metadata=(("traceparent", traceparent()), ("x-envoy-secret", secret)))
    first = await flow.check(check_request(headers, model="a"), context)
    second = await flow.check(check_request({**headers, "x-request-id": "r-2"}, model="a"), context)
    assert first.granted and second.waiting
    await flow.advance(1)
    await flow.complete(first)
    await flow.end(second, ExchangeEnd.CLIENT_LEFT)
    text = traced.telemetry.prometheus_text()[0].decode()
    for span in traced.finished_spans():
        text += repr(dict(span.attributes)) + repr([dict(e.attributes) for e in span.events])
        text += repr(dict(span.resource.attributes)) + span.name
    text += repr(activity.recent())
    assert "r-1" in text and "r-2" in text  # what is read is there
    assert secret not in text


# -- providers from the environment ----------------------------------------------------------


def _clear_otel(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key.startswith("OTEL_"):
            monkeypatch.delenv(key)


@virtual_time
async def test_without_an_endpoint_nothing_is_exported_and_metrics_still_work(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _clear_otel(monkeypatch)
    assert exporters_from_environment() == ([], [])
    telemetry = Telemetry.from_environment(clock())
    assert telemetry.resource.attributes["service.name"] == "llamaswap"
    flow = Flow(observers=[telemetry])
    ticket = await flow.arrive("plain", model="a")
    await flow.complete(ticket)
    assert value(parse_text(telemetry.prometheus_text()[0].decode()), names.DISPATCHED, band="normal") == 1
    telemetry.shutdown()
    telemetry.shutdown()  # idempotent


def test_endpoint_and_service_name_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    _clear_otel(monkeypatch)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4317")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "gpu-7")
    span_processors, metric_readers = exporters_from_environment()
    assert [type(p) for p in span_processors] == [BatchSpanProcessor]
    assert [type(r) for r in metric_readers] == [PeriodicExportingMetricReader]
    for processor in span_processors:
        processor.shutdown()
    for reader in metric_readers:
        reader.shutdown(timeout_millis=1000)
    from llamaswap.telemetry import default_resource

    assert default_resource().attributes["service.name"] == "gpu-7"

    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "http://127.0.0.1:4317")
    span_processors, metric_readers = exporters_from_environment()
    assert span_processors == [] and len(metric_readers) == 1
    metric_readers[0].shutdown(timeout_millis=1000)
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "none")
    assert exporters_from_environment() == ([], [])


def test_console_and_unknown_exporters_from_the_environment(monkeypatch: pytest.MonkeyPatch,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    _clear_otel(monkeypatch)
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console,zipkin")
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "prometheus")
    span_processors, metric_readers = exporters_from_environment()
    assert [type(p) for p in span_processors] == [BatchSpanProcessor]
    assert metric_readers == []  # `prometheus` is the admin GET /metrics, always on
    assert "OTEL_TRACES_EXPORTER=zipkin is not supported" in caplog.text
    for processor in span_processors:
        processor.shutdown()
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://127.0.0.1:4317")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "carrier-pigeon")
    assert exporters_from_environment() == ([], [])  # a bad protocol is left out, not fatal
    assert "could not be set up" in caplog.text


@virtual_time
async def test_shutdown_flushes_the_spans() -> None:
    exporter = InMemorySpanExporter()
    processor = BatchSpanProcessor(exporter, schedule_delay_millis=3_600_000)
    telemetry = Telemetry(clock=clock(), span_processors=[processor], sampler=ALWAYS_ON)
    flow = Flow(observers=[telemetry])
    ticket = await flow.arrive("flushed", model="a")
    await flow.complete(ticket)
    still_running = await flow.arrive("cut-short", model="a")
    assert exporter.get_finished_spans() == ()
    telemetry.shutdown()
    seen = sorted((s.name, s.attributes["llamaswap.request_id"]) for s in exporter.get_finished_spans())
    # Spans are written when they end: the running request's queue span ended at its grant.
    assert seen == [(QUEUE_SPAN, "cut-short"), (QUEUE_SPAN, "flushed"), (RUN_SPAN, "flushed")]
    assert still_running.granted
    await flow.complete(still_running)  # after shutdown: nothing recorded, nothing raised
    assert len(exporter.get_finished_spans()) == 3


# -- the queue table (llamaswap queue) -------------------------------------------------------


def test_the_queue_table() -> None:
    document = {
        "policy": "serial", "resident_models": ["model-a"], "gpu": "running",
        "running": {"request_id": "run-1", "priority": 0, "band": "normal", "score": 0.0, "model": "model-a",
                    "queue_wait_s": 0.25, "running_s": 3725.0, "expected_end_s": 4000.0,
                    "expected_remaining_s": 275.0},
        "waiting": [
            {"request_id": "req-i", "position": 1, "priority": 100, "band": "interactive", "score": 110.01,
             "waited_s": 61.0, "model": "model-a", "estimated_start_s": 275.0},
            {"request_id": "req-b", "position": 2, "priority": -100, "band": "batch", "score": -99.5,
             "waited_s": 90061.0, "model": None, "estimated_start_s": 3875.0},
        ],
        "bands": {"interactive": {"depth": 1}, "normal": {"depth": 0}, "batch": {"depth": 1}},
    }
    lines = render(document).splitlines()
    assert lines[0] == ("policy serial, loaded model model-a, 1 running, 2 waiting "
                        "(interactive 1, normal 0, batch 1)")
    assert lines[1].split() == ["POS", "ST", "REQUEST_ID", "PRIORITY", "BAND", "SCORE", "WAIT", "TIME", "START",
                                "MODEL"]
    assert lines[2].split() == ["-", "R", "run-1", "0", "normal", "0.000", "0:00", "1:02:05", "+4:35", "model-a"]
    assert lines[3].split() == ["1", "PD", "req-i", "100", "interactive", "110.010", "1:01", "+4:35", "model-a"]
    assert lines[4].split() == ["2", "PD", "req-b", "-100", "batch", "-99.500", "1-01:01:01", "+1:04:35", "-"]
    assert len(lines) == 5
    # Right-aligned numbers: the START column ends at the same place on every row.
    ends = {line.index(cell) + len(cell) for line, cell in zip(lines[2:], ["+4:35", "+4:35", "+1:04:35"])}
    assert len(ends) == 1


@pytest.mark.parametrize(("gpu", "line"), [
    ("idle", "GPU idle"),
    ("settling", "GPU settling (the upstream finishes an abandoned generation)"),
    ("adopted", "GPU busy with an exchange granted before this sidecar started"),
])
def test_the_queue_tables_gpu_line(gpu: str, line: str) -> None:
    text = render({"policy": "fifo", "resident_models": [], "gpu": gpu, "running": None, "waiting": []})
    assert text.splitlines()[0] == f"policy fifo, loaded model -, {line}, 0 waiting"
    assert len(text.splitlines()) == 2


def test_the_queue_table_lists_several_resident_models() -> None:
    text = render({"policy": "fifo", "resident_models": ["a", "b"], "gpu": "idle", "running": None, "waiting": []})
    assert text.splitlines()[0] == "policy fifo, loaded models a,b, GPU idle, 0 waiting"


@virtual_time
async def test_the_queue_table_renders_the_live_queue() -> None:
    from llamaswap.adapters.admin import queue_document

    flow = Flow(LONG_LEASE)
    await flow.arrive("run-1", model="a")
    await flow.arrive("req-1", "interactive", "b")
    await flow.advance(2)
    lines = render(queue_document(flow.coordinator.view())).splitlines()
    assert lines[0] == "policy serial, loaded model a, 1 running, 1 waiting (interactive 1, normal 0, batch 0)"
    assert lines[2].split() == ["-", "R", "run-1", "0", "normal", "0.000", "0:00", "0:02", "+0:13", "a"]
    assert lines[3].split() == ["1", "PD", "req-1", "100", "interactive", "100.033", "0:02", "+0:13", "b"]


@pytest.mark.parametrize(("seconds", "text"), [
    (None, ""), (0, "0:00"), (59.9, "0:59"), (60, "1:00"), (3599, "59:59"), (3600, "1:00:00"),
    (86399, "23:59:59"), (86400, "1-00:00:00"), (90061, "1-01:01:01"), (-5, "0:00"),
])
def test_format_duration(seconds: float | None, text: str) -> None:
    assert format_duration(seconds) == text


@virtual_time
async def test_an_underestimated_wait_is_recorded_too() -> None:
    """The blocker runs far longer than the 10 s (+5 s load) default: b waited longer than said."""
    traced = Traced(LONG_LEASE)
    flow = traced.flow
    a = await flow.arrive("a", None, "a")
    b = await flow.arrive("b", "batch", "a")
    await flow.advance(40)
    await flow.complete(a, 200)
    assert b.granted
    estimated, waited = b.ticket.estimated_wait_s, b.ticket.decision.queue_wait_ns / S
    assert estimated == pytest.approx(15.0) and waited == pytest.approx(40.0)
    samples = traced.metrics()
    assert value(samples, f"{names.ESTIMATE_RATIO}_count", band="batch") == 1
    assert value(samples, f"{names.ESTIMATE_RATIO}_sum", band="batch") == pytest.approx(estimated / waited)
    assert value(samples, f"{names.ESTIMATE_RATIO}_bucket", band="batch", le="0.5") == 1


# -- bounded labels and ids --------------------------------------------------------------------


@virtual_time
async def test_the_model_label_keeps_the_first_models_and_counts_the_rest_as_other() -> None:
    traced = Traced(LONG_LEASE)
    flow = traced.flow
    models = [f"m{i:02d}-" + "x" * 400 for i in range(names.MAX_MODEL_LABELS + 5)]
    for model in [*models, models[0]]:  # the first model again: still its own series
        request = await flow.arrive(model[:3], model=model)
        await flow.advance(1)
        await flow.complete(request)
    run_by_model = by_label(traced.metrics(), names.MODEL_RUN + "_count", "model")
    assert set(run_by_model) == {*models[:names.MAX_MODEL_LABELS], names.OTHER_MODEL}
    assert run_by_model[models[0]] == 2 and run_by_model[names.OTHER_MODEL] == 5
    assert value(traced.metrics(), names.MODEL_LABEL_OTHER) == 5


@virtual_time
async def test_a_long_request_id_is_replaced_by_envoys_and_counted() -> None:
    traced = Traced(LONG_LEASE)
    flow = traced.flow
    longest = "r" * 128
    kept = await flow.check(check_request({"x-request-id": longest}, http_id="101"))
    await flow.complete(kept)
    replaced = await flow.check(check_request({"x-request-id": "r" * 129}, http_id="102"))
    assert replaced.ticket.request_id == "102"  # Envoy's id for the stream, from the Check
    await flow.complete(replaced)
    assert kept.ticket.request_id == longest
    assert value(traced.metrics(), names.REQUEST_ID_REPLACED) == 1
    assert {s.attributes.get("llamaswap.request_id") for s in traced.finished_spans(RUN_SPAN)} == {longest, "102"}


@virtual_time
async def test_slot_gauges_and_the_running_count_at_grant() -> None:
    traced = Traced({"upstream": {"slots": 3}, "envoy": {"leaseSeconds": 1000}})
    flow = traced.flow
    samples = traced.metrics()
    assert (value(samples, names.GPU_SLOTS), value(samples, names.GPU_SLOTS_BUSY)) == (3, 0)
    a = await flow.arrive("a", None, "a")
    b = await flow.arrive("b", None, "a")
    samples = traced.metrics()
    assert (value(samples, names.GPU_SLOTS), value(samples, names.GPU_SLOTS_BUSY)) == (3, 2)
    await flow.complete(a)
    assert value(traced.metrics(), names.GPU_SLOTS_BUSY) == 1
    await flow.complete(b)
    assert value(traced.metrics(), names.GPU_SLOTS_BUSY) == 0
    assert [traced.span(RUN_SPAN, rid).attributes["llamaswap.serial_slots_busy"] for rid in ("a", "b")] == [1, 2]


@virtual_time
async def test_one_slot_by_default_in_the_gauges() -> None:
    traced = Traced(LONG_LEASE)
    a = await traced.flow.arrive("a", None, "a")
    samples = traced.metrics()
    assert (value(samples, names.GPU_SLOTS), value(samples, names.GPU_SLOTS_BUSY)) == (1, 1)
    await traced.flow.complete(a)



def labels_of(body: str, name: str) -> set[str]:
    """The label names a metric's samples carry in a Prometheus text (a histogram's le aside)."""
    found: set[str] = set()
    for line in body.splitlines():
        match = _SAMPLE.match(line)
        if match and match.group(1) in (name, f"{name}_bucket", f"{name}_sum", f"{name}_count"):
            found |= {label for label, _ in _LABEL.findall(match.group(2) or "")} - {"le"}
    return found


def documented_metric_labels() -> dict[str, set[str]]:
    """docs/observability.md's metric table: {metric: its labels column}. A row may name several
    metrics, a later one by its suffix after the first two words of the one before
    (`llamaswap_scheduler_swaps_total` / `_loads_total`)."""
    import pathlib

    text = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "observability.md").read_text()
    table: dict[str, set[str]] = {}
    for line in text.splitlines():
        cells = [cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
        if len(cells) != 4 or not cells[0].startswith("`llamaswap_"):
            continue
        labels = {label.strip(" `") for label in cells[2].split(",")} if cells[2] not in ("", "-") else set()
        full = ""
        for name in re.findall(r"`([a-z_]+)", cells[0]):
            full = "_".join(full.split("_")[:2]) + name if name.startswith("_") else name
            table[full] = labels
    return table
