"""Telemetry (spans, metrics, Prometheus text) driven by a real Coordinator, in memory.

The coordinator runs on the test's event loop with a manual clock, so waits and span
durations are exact; tickets are opened, admitted and closed the way the transport does.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import threading
import time
from typing import Any

import pytest
from opentelemetry.sdk.metrics.export import InMemoryMetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from opentelemetry.trace import StatusCode

from llamaswap.config import parse_config
from llamaswap.core import ManualClock, Outcome
from llamaswap.queue_cli import format_duration, render
from llamaswap.runtime.coordinator import Coordinator, Ticket, TicketState
from llamaswap.telemetry import Telemetry, exporters_from_environment, parent_from_metadata
from llamaswap.telemetry import instruments as names
from llamaswap.telemetry.prometheus import CONTENT_TYPE, metric_names

PROMPT = "SECRET-PROMPT-TEXT-never-in-telemetry"
BANDS = {"interactive", "normal", "batch"}
START_NS = 1_000 * 1_000_000_000

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CHECK_SPAN = "00f067aa0ba902b7"
EXT_PROC_SPAN = "a3ce929d0e0e4736"


def traceparent(trace_id: str, span_id: str) -> str:
    return f"00-{trace_id}-{span_id}-01"


# -- a fake transport ------------------------------------------------------------------------


class Flow:
    """Opens, admits and closes tickets the way ext_proc + ext_authz do."""

    def __init__(self, config: dict[str, Any] | None = None, *, exporter: InMemorySpanExporter | None = None,
                 readers: tuple[Any, ...] = (), telemetry: Telemetry | None = None) -> None:
        self.clock = ManualClock(START_NS)
        self.spans = exporter or InMemorySpanExporter()
        self.telemetry = telemetry or Telemetry(span_processors=[SimpleSpanProcessor(self.spans)], sampler=ALWAYS_ON,
                                                metric_readers=readers)
        # Telemetry synchronously, so each step's spans and metrics can be read at once.
        self.coordinator = Coordinator(parse_config(config or {}), clock=self.clock, observer=self.telemetry,
                                       observe_after_grant=False)
        self.telemetry.bind(self.coordinator)
        self.tasks: dict[str, asyncio.Task[Any]] = {}

    async def arrive(self, request_id: str, priority: str | None = None, model: str | None = "model-a", *,
                     check: str | None = None, ext_proc: str | None = None) -> Ticket:
        ticket = self.coordinator.open(request_id)
        ticket.trace_context["ext_proc_metadata"] = _metadata(request_id, ext_proc)
        ticket.trace_context["check_metadata"] = _metadata(request_id, check)
        headers = {"x-llamaswap-priority": priority} if priority is not None else {}
        document: dict[str, Any] = {"messages": [{"role": "user", "content": PROMPT}]}
        if model is not None:
            document["model"] = model
        self.tasks[request_id] = asyncio.create_task(
            self.coordinator.admit(ticket.token, headers, json.dumps(document).encode()))
        await until(lambda: ticket.state is not TicketState.OPEN)
        return ticket

    def finish(self, ticket: Ticket, status: int | None = 200) -> None:
        if status is not None:
            self.coordinator.record_response(ticket.token, status)
        self.coordinator.close(ticket.token)

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


def _metadata(request_id: str, parent: str | None) -> tuple[tuple[str, str], ...]:
    items = [(":authority", "sidecar"), ("x-request-id", request_id), ("user-agent", "envoy")]
    if parent is not None:
        items.append(("traceparent", parent))
    return tuple(items)


async def until(predicate: Any, rounds: int = 1000) -> None:
    for _ in range(rounds):
        if predicate():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition not reached")


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
        samples[(match.group(1), labels)] = float(match.group(3))
    return samples


def value(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def by_band(samples: dict, name: str, **labels: str) -> dict[str, float]:
    out = {}
    for (sample_name, sample_labels), number in samples.items():
        found = dict(sample_labels)
        if sample_name == name and all(found.get(k) == v for k, v in labels.items()):
            out[found["band"]] = number
    return out


# -- spans -----------------------------------------------------------------------------------


async def test_spans_join_envoys_trace_with_decision_attributes() -> None:
    flow = Flow()
    blocker = await flow.arrive("blocker", model="model-a")
    early = await flow.arrive("early", "normal", "model-b")
    before = time.time_ns()
    winner = await flow.arrive("winner", "interactive", "model-a", check=traceparent(TRACE_ID, CHECK_SPAN),
                               ext_proc=traceparent(TRACE_ID, EXT_PROC_SPAN))
    after = time.time_ns()
    assert winner.state is TicketState.WAITING
    assert winner.extras["trace_id"] == TRACE_ID  # for the activity log
    flow.clock.advance(2.5)
    flow.finish(blocker)
    assert (await flow.tasks["winner"]).decision is not None
    flow.clock.advance(4.0)
    flow.finish(winner)

    queue = flow.span("llamaswap.queue", "winner")
    run = flow.span("llamaswap.run", "winner")
    # Parents: Envoy's Check egress span for the hold, its ext_proc egress span for the run.
    assert format(queue.context.trace_id, "032x") == TRACE_ID
    assert format(run.context.trace_id, "032x") == TRACE_ID
    assert format(queue.parent.span_id, "016x") == CHECK_SPAN and queue.parent.is_remote
    assert format(run.parent.span_id, "016x") == EXT_PROC_SPAN and run.parent.is_remote
    # Real wall time, durations exactly the scheduler's.
    assert before <= queue.start_time <= after
    assert queue.end_time - queue.start_time == 2_500_000_000
    assert run.start_time == queue.end_time
    assert run.end_time - run.start_time == 4_000_000_000

    for span in (queue, run):
        attributes = dict(span.attributes)
        assert attributes["llamaswap.request_id"] == "winner"
        assert attributes["llamaswap.priority"] == 100
        assert attributes["llamaswap.band"] == "interactive"
        assert attributes["llamaswap.model"] == "model-a"
        assert attributes["llamaswap.queue_depth"] == 1  # `early` was waiting
        assert attributes["llamaswap.queue_wait_ms"] == 2500.0
        assert attributes["llamaswap.swap_affinity"] is True  # the blocker loaded model-a
        assert attributes["llamaswap.aging"] == pytest.approx(2.5 / 60)
        assert attributes["llamaswap.score"] == pytest.approx(100 + 10 + 2.5 / 60)
    assert run.attributes["llamaswap.outcome"] == "served"
    assert run.status.status_code is StatusCode.UNSET
    # The winner overtook `early`: one event naming it by request id, never by ticket.
    events = [e for e in queue.events if e.name == "llamaswap.overtook"]
    assert [e.attributes["llamaswap.request_id"] for e in events] == ["early"]
    assert events[0].attributes["llamaswap.band"] == "normal"
    assert events[0].timestamp == queue.end_time
    tokens = {blocker.token, early.token, winner.token}
    for span in flow.finished_spans():
        text = repr(dict(span.attributes)) + repr([dict(e.attributes) for e in span.events])
        assert not any(token in text for token in tokens)
        assert PROMPT not in text

    flow.finish(early, 502)
    run_early = flow.span("llamaswap.run", "early")
    assert run_early.attributes["llamaswap.outcome"] == "upstream_error"
    assert run_early.status.status_code is StatusCode.ERROR
    # No traceparent anywhere: still one trace for the two spans of the request.
    queue_early = flow.span("llamaswap.queue", "early")
    assert queue_early.parent is None
    assert run_early.context.trace_id == queue_early.context.trace_id
    assert run_early.parent.span_id == queue_early.context.span_id


async def test_rejection_and_expiry_end_the_queue_span_with_error() -> None:
    flow = Flow({"routing": {"scheduler": {"maxQueued": 1}}})
    blocker = await flow.arrive("blocker")
    waiting = await flow.arrive("waiting", "batch")
    flow.clock.advance(1.0)
    refused = await flow.arrive("refused", "interactive", check=traceparent(TRACE_ID, CHECK_SPAN))
    admission = await flow.tasks["refused"]
    assert admission.rejected is not None and admission.rejected.outcome is Outcome.REJECTED_FULL
    span = flow.span("llamaswap.queue", "refused")
    assert span.status.status_code is StatusCode.ERROR
    assert span.attributes["llamaswap.outcome"] == "rejected_full"
    assert span.attributes["llamaswap.band"] == "interactive"
    assert format(span.parent.span_id, "016x") == CHECK_SPAN
    assert refused.extras["trace_id"] == TRACE_ID
    assert not [s for s in flow.finished_spans("llamaswap.run") if s.attributes["llamaswap.request_id"] == "refused"]

    # A client that leaves while waiting is not an error.
    flow.clock.advance(2.0)
    flow.finish(waiting, None)
    gone = flow.span("llamaswap.queue", "waiting")
    assert gone.attributes["llamaswap.outcome"] == "cancelled_waiting"
    assert gone.attributes["llamaswap.queue_wait_ms"] == 3000.0
    assert gone.status.status_code is StatusCode.UNSET
    assert gone.end_time - gone.start_time == 3_000_000_000

    flow.coordinator.stop_admitting()
    await flow.arrive("late")
    assert (await flow.tasks["late"]).rejected.outcome is Outcome.SHUTDOWN
    assert flow.span("llamaswap.queue", "late").status.status_code is StatusCode.ERROR
    flow.finish(blocker)
    samples = flow.metrics()
    assert value(samples, names.REQUESTS, outcome="rejected_full") == 1
    assert value(samples, names.REQUESTS, outcome="cancelled_waiting") == 1
    assert value(samples, names.REQUESTS, outcome="shutdown") == 1
    assert value(samples, names.REQUESTS, outcome="served") == 1


async def test_expired_request_is_an_error_span() -> None:
    flow = Flow({"routing": {"scheduler": {"maxWaitSeconds": 0.01}}})
    blocker = await flow.arrive("blocker")
    await flow.arrive("slow")
    flow.clock.advance(1.0)  # overdue; the expiry timer (10 ms of real time) notices
    admission = await asyncio.wait_for(flow.tasks["slow"], 30)
    assert admission.rejected.outcome is Outcome.EXPIRED
    span = flow.span("llamaswap.queue", "slow")
    assert span.status.status_code is StatusCode.ERROR
    assert span.attributes["llamaswap.outcome"] == "expired"
    flow.finish(blocker)


async def test_sampler_from_environment_is_respected(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")
    exporter = InMemorySpanExporter()
    flow = Flow(exporter=exporter, telemetry=Telemetry(span_processors=[SimpleSpanProcessor(exporter)]))
    ticket = await flow.arrive("quiet", check=traceparent(TRACE_ID, CHECK_SPAN))
    flow.finish(ticket)
    assert exporter.get_finished_spans() == ()
    assert ticket.extras["trace_id"] == TRACE_ID  # the activity log still names Envoy's trace


def test_parent_from_metadata() -> None:
    context = parent_from_metadata((("traceparent", traceparent(TRACE_ID, CHECK_SPAN)), ("grpc-accept-encoding", "gzip")))
    assert context is not None
    assert parent_from_metadata(()) is None
    assert parent_from_metadata((("traceparent", "garbage"),)) is None
    assert parent_from_metadata(None) is None
    assert parent_from_metadata((("bin-bin", b"\x00"),)) is None


# -- metrics ---------------------------------------------------------------------------------


async def test_metric_names_and_values() -> None:
    flow = Flow()
    samples = flow.metrics()
    # The four specified series, every band, from the start.
    for name in (names.QUEUE_DEPTH, names.QUEUE_OLDEST_WAIT, names.DISPATCHED):
        assert by_band(samples, name) == {band: 0.0 for band in BANDS}, name
    for reason in ("aging", "swap_affinity"):
        assert by_band(samples, names.REORDERS, reason=reason) == {band: 0.0 for band in BANDS}
    assert value(samples, names.GPU_BUSY) == 0
    assert value(samples, names.SWAPS) == 0
    assert value(samples, names.UNPARSEABLE) == 0
    assert value(samples, names.WATCHDOG) == 0
    assert {value(samples, names.REQUESTS, outcome=o.value) for o in Outcome} == {0.0}

    blocker = await flow.arrive("blocker", model="model-a")
    flow.clock.advance(1.0)
    b = await flow.arrive("b", "batch", "model-a")
    flow.clock.advance(1.0)
    n = await flow.arrive("n", "soon please", "model-b")  # unparseable: normal
    flow.clock.advance(1.0)
    i = await flow.arrive("i", "interactive", "model-b")
    i2 = await flow.arrive("i2", "interactive", "model-a")
    flow.clock.advance(0.5)
    samples = flow.metrics()
    assert by_band(samples, names.QUEUE_DEPTH) == {"interactive": 2, "normal": 1, "batch": 1}
    assert by_band(samples, names.QUEUE_OLDEST_WAIT) == pytest.approx(
        {"interactive": 0.5, "normal": 1.5, "batch": 2.5}, abs=1e-6)
    assert value(samples, names.GPU_BUSY) == 1
    assert value(samples, names.UNPARSEABLE) == 1
    assert by_band(samples, names.DISPATCHED) == {"interactive": 0, "normal": 1, "batch": 0}

    # model-a is loaded: i2 (interactive, model-a) overtakes the earlier i by swap affinity.
    flow.finish(blocker)
    await until(lambda: i2.state is TicketState.RUNNING)
    assert i2.decision is not None and i2.decision.reordered_by == frozenset({"swap_affinity"})
    for ticket in (i2, i, n, b):
        await until(lambda t=ticket: t.state is TicketState.RUNNING)
        flow.clock.advance(2.0)
        flow.finish(ticket)

    samples = flow.metrics()
    assert by_band(samples, names.DISPATCHED) == {"interactive": 2, "normal": 2, "batch": 1}
    assert by_band(samples, names.REORDERS, reason="swap_affinity") == {"interactive": 1, "normal": 0, "batch": 0}
    assert by_band(samples, names.REORDERS, reason="aging") == {band: 0 for band in BANDS}
    assert by_band(samples, names.QUEUE_DEPTH) == {band: 0 for band in BANDS}
    assert by_band(samples, names.QUEUE_OLDEST_WAIT) == {band: 0 for band in BANDS}
    assert value(samples, names.GPU_BUSY) == 0
    # Swaps: (none) -> a, a -> b (i), b -> a (b); i2 and n kept the loaded model.
    assert value(samples, names.SWAPS) == 3
    assert value(samples, names.REQUESTS, outcome="served") == 5
    assert value(samples, f"{names.QUEUE_WAIT}_count", band="interactive") == 2
    assert value(samples, f"{names.QUEUE_WAIT}_count", band="batch") == 1
    assert value(samples, f"{names.RUN}_count", band="interactive") == 2
    assert value(samples, f"{names.RUN}_sum", band="interactive") == pytest.approx(4.0)
    assert value(samples, f"{names.RUN}_bucket", band="interactive", le="2.5") == 2
    assert value(samples, f"{names.RUN}_bucket", band="interactive", le="1") == 0
    assert value(samples, f"{names.RUN}_bucket", band="interactive", le="+Inf") == 2
    body = flow.telemetry.prometheus_text()[0].decode()
    assert PROMPT not in body
    assert set(metric_names(body)) == set(names.ALL)
    declared = dict(re.findall(r"^# TYPE (\S+) (\S+)$", body, re.M))
    assert declared[names.QUEUE_DEPTH] == "gauge"
    assert declared[names.QUEUE_OLDEST_WAIT] == "gauge"
    assert declared[names.DISPATCHED] == "counter"
    assert declared[names.REORDERS] == "counter"
    assert declared[names.QUEUE_WAIT] == "histogram"


async def test_watchdog_is_counted_and_marked() -> None:
    flow = Flow()
    ticket = await flow.arrive("runaway")
    flow.coordinator._watchdog_fire(ticket.token)  # what maxRunSeconds' timer calls
    samples = flow.metrics()
    assert value(samples, names.WATCHDOG) == 1
    assert value(samples, names.REQUESTS, outcome="watchdog") == 1
    run = flow.span("llamaswap.run", "runaway")
    assert [e.name for e in run.events] == ["llamaswap.watchdog"]
    assert run.status.status_code is StatusCode.ERROR


async def test_gauges_collected_on_another_thread_do_not_touch_the_scheduler() -> None:
    """The OTLP push collects on the SDK's thread; it reads the loop's published picture."""
    reader = InMemoryMetricReader()
    flow = Flow(readers=(reader,))
    await flow.arrive("running")
    await flow.arrive("waiting-1", "batch")
    flow.clock.advance(3.0)
    await flow.arrive("waiting-2", "batch")
    flow.clock.advance(1.5)  # no event since: the waits must still be current

    callers: list[int] = []
    band_stats = flow.coordinator.scheduler.band_stats

    def spy() -> Any:
        callers.append(threading.get_ident())
        return band_stats()

    flow.coordinator.scheduler.band_stats = spy  # type: ignore[method-assign]
    collected: list[Any] = []
    thread = threading.Thread(target=lambda: collected.append(reader.get_metrics_data()))
    thread.start()
    thread.join(30)
    assert callers == []
    points = {}
    for resource_metrics in collected[0].resource_metrics:
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                for point in getattr(metric.data, "data_points", []):
                    points[(metric.name, tuple(sorted((point.attributes or {}).items())))] = getattr(
                        point, "value", None)
    assert points[(names.QUEUE_DEPTH, (("band", "batch"),))] == 2
    assert points[(names.QUEUE_OLDEST_WAIT, (("band", "batch"),))] == pytest.approx(4.5, abs=1e-6)
    assert points[(names.QUEUE_OLDEST_WAIT, (("band", "normal"),))] == 0
    assert points[(names.GPU_BUSY, ())] == 1
    # On the loop's own thread the scheduler is read directly.
    flow.metrics()
    assert callers and set(callers) == {threading.get_ident()}


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian package prometheus) not installed")
async def test_text_passes_promtool_lint() -> None:
    flow = Flow()
    ticket = await flow.arrive("one", "interactive")
    flow.finish(ticket)
    body, _ = flow.telemetry.prometheus_text()
    result = subprocess.run(["promtool", "check", "metrics"], input=body, capture_output=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


# -- providers from the environment ----------------------------------------------------------


def _clear_otel(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for key in list(os.environ):
        if key.startswith("OTEL_"):
            monkeypatch.delenv(key)


async def test_without_endpoint_nothing_is_exported_and_metrics_still_work(monkeypatch: pytest.MonkeyPatch) -> None:
    _clear_otel(monkeypatch)
    assert exporters_from_environment() == ([], [])
    telemetry = Telemetry.from_environment()
    assert telemetry.resource.attributes["service.name"] == "llamaswap"
    flow = Flow(telemetry=telemetry)
    ticket = await flow.arrive("plain")
    flow.finish(ticket)
    assert value(flow.metrics(), names.DISPATCHED, band="normal") == 1
    assert len(ticket.extras["trace_id"]) == 32
    telemetry.shutdown()
    telemetry.shutdown()  # idempotent


def test_endpoint_and_service_name_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
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


async def test_shutdown_flushes_spans() -> None:
    exporter = InMemorySpanExporter()
    telemetry = Telemetry(span_processors=[BatchSpanProcessor(exporter, schedule_delay_millis=3_600_000)],
                          sampler=ALWAYS_ON)
    flow = Flow(exporter=exporter, telemetry=telemetry)
    ticket = await flow.arrive("flushed")
    flow.finish(ticket)
    still_running = await flow.arrive("cut-short")
    assert exporter.get_finished_spans() == ()
    telemetry.shutdown()
    names_seen = sorted((s.name, s.attributes["llamaswap.request_id"]) for s in exporter.get_finished_spans())
    assert names_seen == [("llamaswap.queue", "cut-short"), ("llamaswap.queue", "flushed"),
                          ("llamaswap.run", "cut-short"), ("llamaswap.run", "flushed")]
    assert still_running.state is TicketState.RUNNING


# -- the queue table -------------------------------------------------------------------------


def test_queue_table() -> None:
    document = {
        "policy": "serial", "loaded_model": "model-a",
        "running": {"request_id": "run-1", "priority": 0, "band": "normal", "score": 0.0, "model": "model-a",
                    "queue_wait_s": 0.25, "running_s": 3725.0},
        "waiting": [
            {"request_id": "req-i", "position": 1, "priority": 100, "band": "interactive", "score": 110.01,
             "waited_s": 61.0, "model": "model-a"},
            {"request_id": "req-b", "position": 2, "priority": -100, "band": "batch", "score": -99.5,
             "waited_s": 90061.0, "model": None},
        ],
        "bands": {"interactive": {"depth": 1}, "normal": {"depth": 0}, "batch": {"depth": 1}},
    }
    lines = render(document).splitlines()
    assert "2 waiting" in lines[0] and "model-a" in lines[0]
    assert lines[1].split() == ["POS", "ST", "REQUEST_ID", "PRIORITY", "BAND", "SCORE", "WAIT", "TIME", "MODEL"]
    assert lines[2].split() == ["-", "R", "run-1", "0", "normal", "0.000", "0:00", "1:02:05", "model-a"]
    assert lines[3].split() == ["1", "PD", "req-i", "100", "interactive", "110.010", "1:01", "model-a"]
    assert lines[4].split() == ["2", "PD", "req-b", "-100", "batch", "-99.500", "1-01:01:01", "-"]
    assert format_duration(59.9) == "0:59"
    empty = render({"policy": "serial", "running": None, "waiting": []})
    assert "GPU idle" in empty and len(empty.splitlines()) == 2


async def test_without_span_exporters_spans_are_not_recorded_but_trace_ids_are_kept() -> None:
    telemetry = Telemetry(span_processors=())
    flow = Flow(telemetry=telemetry)
    blocker = await flow.arrive("blocker")
    joined = await flow.arrive("joined", check=traceparent(TRACE_ID, CHECK_SPAN))
    alone = await flow.arrive("alone")
    assert joined.extras["trace_id"] == TRACE_ID  # the activity log still links to Envoy's trace
    assert len(alone.extras["trace_id"]) == 32 and alone.extras["trace_id"] != TRACE_ID
    flow.finish(blocker)
    assert (await flow.tasks["joined"]).decision is not None
    state = telemetry._live[joined.token]
    assert state.run is not None and not state.run.is_recording()
    # Metrics are unaffected: the blocker and `joined` were dispatched, both normal.
    assert value(flow.metrics(), "llamaswap_scheduler_dispatched_total", band="normal") == 2
