"""Seeing evictions (issue 37, several models resident on one GPU): each `Eviction` of a granted
`Decision` is counted in `llamaswap_model_evictions_total{upstream,reason}`, written to the
activity log as an `eviction` record (which model went, where, why, for which request and
model), and is an `llamaswap.evicted` event on the granting request's queue span; how many
models each GPU holds is `llamaswap_models_resident{upstream}`.

The decisions are built by hand with `evicts` set (the scheduler's rule fills it), and given to
the observers as the coordinator gives them (`dispatched` with the ticket).
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from policies import serial
from test_telemetry import by_label, parse_text, value

from llamaswap.core import Band, EvictReason, Eviction, ManualClock, Priority, PrioritySource, Slots
from llamaswap.core.decisions import Decision
from llamaswap.core.policy import GpuPolicy
from llamaswap.core.residency import Residency
from llamaswap.runtime.activity import ActivityLog
from llamaswap.runtime.gpu_projection import GpuProjection, NodeProjection
from llamaswap.runtime.observer import QueuePicture
from llamaswap.runtime.ticket import Arrival, Ticket, TicketState
from llamaswap.simulate.records import parse_activity
from llamaswap.telemetry import EVICTED_EVENT, QUEUE_SPAN, Telemetry
from llamaswap.telemetry import instruments as names

S = 1_000_000_000
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
POLICY = serial(aging_divisor_s=0.0).with_gpus((GpuPolicy("big", Slots(4), residency=Residency(max_loaded=3)),
                                                GpuPolicy("small", Slots(1))))
REASONS = {reason.value for reason in EvictReason}


def picture(*gpus: GpuProjection) -> QueuePicture:
    """The gauges' picture of these GPUs, nothing waiting."""
    return QueuePicture((), (), NodeProjection.of(gpus))


def granted(request_id: str, model: str, clock: ManualClock, *, upstream: str = "big",
            evicts: tuple[Eviction, ...] = (), trace: bool = False) -> Ticket:
    """A ticket granted now on ``upstream``, its decision unloading ``evicts`` first."""
    parent = f"00-{TRACE_ID}-00f067aa0ba902b7-01" if trace else None
    arrival = Arrival(request_id, None, None, model, "peer", parent, None)
    ticket = Ticket(f"token-{request_id}", arrival, Priority(100, PrioritySource.NUMBER), clock.now_ns() - 2 * S)
    ticket.decision = Decision(request_id, 100, Band.INTERACTIVE, 100.0, ticket.arrival_ns, clock.now_ns(), model,
                               False, 0.0, False, True, frozenset({"a", "b", "c"}), frozenset(), (), 0,
                               gpu=upstream, evicts=evicts)
    ticket.state = TicketState.RUNNING
    return ticket


def metrics(telemetry: Telemetry) -> dict:
    return parse_text(telemetry.prometheus_text()[0].decode())


# -- metrics ------------------------------------------------------------------------------------


def test_each_eviction_is_counted_by_upstream_and_reason() -> None:
    clock = ManualClock()
    telemetry = Telemetry(clock=clock)
    telemetry.settings_changed(POLICY)
    samples = metrics(telemetry)
    # Every upstream's series exist from the start, at 0, one per reason.
    for upstream in ("big", "small"):
        assert by_label(samples, names.MODEL_EVICTIONS, "reason", upstream=upstream) == dict.fromkeys(REASONS, 0)
    telemetry.dispatched(granted("r1", "d", clock, evicts=(Eviction("a", EvictReason.NOT_WAITED_FOR),
                                                            Eviction("b", EvictReason.LEAST_NEEDED))), ())
    telemetry.dispatched(granted("r2", "a", clock, evicts=(Eviction("c", EvictReason.NOT_WAITED_FOR),)), ())
    telemetry.dispatched(granted("r3", "x", clock, upstream="small"), ())  # a swap evicts nothing explicitly
    samples = metrics(telemetry)
    assert by_label(samples, names.MODEL_EVICTIONS, "reason", upstream="big") == {
        "not_waited_for": 2, "least_needed": 1, "least_recently_used": 0, "idle": 0}
    assert by_label(samples, names.MODEL_EVICTIONS, "reason", upstream="small") == dict.fromkeys(REASONS, 0)
    assert value(samples, names.SWAPS) == 3  # the grants themselves are counted as before


def test_the_models_resident_on_each_gpu() -> None:
    telemetry = Telemetry(clock=ManualClock())
    telemetry.settings_changed(POLICY)
    # Before the first picture: nothing known resident anywhere.
    assert by_label(metrics(telemetry), names.MODELS_RESIDENT, "upstream") == {"big": 0, "small": 0}
    telemetry.queue_changed(picture(GpuProjection("big", ("a", "b", "c"), 1, 4),
                                    GpuProjection("small", ("x",), 0, 1)))
    samples = metrics(telemetry)
    assert by_label(samples, names.MODELS_RESIDENT, "upstream") == {"big": 3, "small": 1}
    body = telemetry.prometheus_text()[0].decode()
    assert f"# TYPE {names.MODELS_RESIDENT} gauge" in body
    assert f"# TYPE {names.MODEL_EVICTIONS} counter" in body


# -- the span event -----------------------------------------------------------------------------


def test_the_granting_requests_queue_span_says_what_it_evicted() -> None:
    clock = ManualClock()
    exporter = InMemorySpanExporter()
    telemetry = Telemetry(clock=clock, span_processors=[SimpleSpanProcessor(exporter)], sampler=ALWAYS_ON)
    telemetry.settings_changed(POLICY)
    ticket = granted("r1", "d", clock, trace=True, evicts=(Eviction("a", EvictReason.LEAST_RECENTLY_USED),
                                                           Eviction("b", EvictReason.LEAST_NEEDED)))
    telemetry.dispatched(ticket, ())
    telemetry.dispatched(granted("r2", "a", clock, trace=True), ())
    spans = {span.attributes["llamaswap.request_id"]: span for span in exporter.get_finished_spans()
             if span.name == QUEUE_SPAN}
    events = [event for event in spans["r1"].events if event.name == EVICTED_EVENT]
    assert [dict(event.attributes) for event in events] == [
        {"llamaswap.evicted_model": "a", "llamaswap.evict_reason": "least_recently_used",
         "llamaswap.upstream": "big"},
        {"llamaswap.evicted_model": "b", "llamaswap.evict_reason": "least_needed", "llamaswap.upstream": "big"}]
    assert all(event.timestamp == spans["r1"].end_time for event in events)  # at the grant
    assert spans["r1"].context.trace_id == int(TRACE_ID, 16)  # in the request's own trace
    assert not [event for event in spans["r2"].events if event.name == EVICTED_EVENT]


# -- the activity log ---------------------------------------------------------------------------


def test_each_eviction_is_an_activity_record(tmp_path: pathlib.Path) -> None:
    clock = ManualClock()
    path = tmp_path / "activity.jsonl"
    activity = ActivityLog(clock, path=str(path))
    activity.settings_changed(POLICY)
    ticket = granted("r1", "d", clock, trace=True, evicts=(Eviction("a", EvictReason.NOT_WAITED_FOR),
                                                           Eviction("b", EvictReason.LEAST_RECENTLY_USED)))
    activity.dispatched(ticket, ())
    activity.dispatched(granted("r2", "x", clock, upstream="small"), ())  # evicts nothing: no record
    granted_ms = activity.unix_ms(clock.now_ns())
    evictions = activity.recent(event="eviction")
    common: dict[str, Any] = {
        "event": "eviction", "time": round(granted_ms / 1000, 3), "upstream": "big", "for_model": "d",
        "request_id": "r1", "trace_id": TRACE_ID, "serial_priority": 100, "serial_band": "interactive",
        "granted_unix_ms": round(granted_ms, 3)}
    assert evictions == [{**common, "model": "a", "reason": "not_waited_for"},
                         {**common, "model": "b", "reason": "least_recently_used"}]
    assert activity.recent() == []  # GET /activity lists requests by default
    activity.close()
    lines = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert [line["event"] for line in lines] == ["settings", "eviction", "eviction"]
    assert lines[1:] == evictions
    # A replay reads the settings and requests, and counts the evictions among the other lines.
    replayed = parse_activity(path.read_text(encoding="utf-8").splitlines())
    assert (len(replayed.settings), len(replayed.requests), replayed.malformed) == (1, 0, 0)


def test_get_activity_answers_the_evictions_when_asked() -> None:
    import asyncio

    from aiohttp.test_utils import make_mocked_request

    from llamaswap.adapters.admin import build_admin_app

    clock = ManualClock()
    activity = ActivityLog(clock)
    activity.dispatched(granted("r1", "d", clock, evicts=(Eviction("a", EvictReason.LEAST_NEEDED),)), ())

    async def get(query: str) -> tuple[int, dict]:
        app = build_admin_app(None, activity)  # type: ignore[arg-type]  # /activity reads only the log
        request = make_mocked_request("GET", f"/activity{query}", app=app)
        match = await app.router.resolve(request)
        request._match_info = match
        match.add_app(app)
        response = await match.handler(request)
        return response.status, json.loads(response.body)

    status, body = asyncio.run(get("?event=eviction"))
    assert status == 200 and [(r["model"], r["reason"], r["request_id"]) for r in body["activity"]] == [
        ("a", "least_needed", "r1")]
    assert asyncio.run(get("")) == (200, {"activity": []})
    status, body = asyncio.run(get("?event=nonsense"))
    assert status == 400 and body["error"]["code"] == "unknown_event"


# -- with the scheduler's own decisions ---------------------------------------------------------


def test_the_schedulers_evictions_reach_the_metrics_and_the_log() -> None:
    """Two models resident at most: a third model's grant evicts the idle one, and the observers
    see it as the scheduler decided it."""
    from llamaswap.core import Scheduler

    clock = ManualClock()
    policy = serial(aging_divisor_s=0.0).with_gpus((GpuPolicy("gpu0", Slots(1), residency=Residency(max_loaded=2)),))
    scheduler = Scheduler(policy, clock)
    telemetry = Telemetry(clock=clock)
    activity = ActivityLog(clock)
    for observer in (telemetry, activity):
        observer.settings_changed(policy)
    tickets: dict[str, Ticket] = {}

    def arrive(request_id: str, model: str) -> None:
        arrival = Arrival(request_id, None, None, model, "peer", None, None)
        ticket = tickets[request_id] = Ticket(request_id, arrival, Priority(0, PrioritySource.NUMBER),
                                              clock.now_ns())
        scheduler.enqueue(ticket.token, ticket.priority, model)

    def grant() -> list[str]:
        granted = []
        while (decision := scheduler.next()) is not None:
            ticket = tickets[decision.request_id]
            ticket.decision = decision
            for observer in (telemetry, activity):
                observer.dispatched(ticket, ())
            granted.append(decision.request_id)
        return granted

    arrive("a1", "a")
    arrive("b1", "b")
    assert grant() == ["a1", "b1"]  # b loads beside a: room for two
    scheduler.release("a1")
    clock.advance(1)
    arrive("c1", "c")
    assert grant() == ["c1"]
    assert tickets["c1"].decision.evicts == (Eviction("a", EvictReason.NOT_WAITED_FOR),)
    samples = metrics(telemetry)
    assert by_label(samples, names.MODEL_EVICTIONS, "reason", upstream="gpu0") == {
        "not_waited_for": 1, "least_needed": 0, "least_recently_used": 0, "idle": 0}
    assert [(r["model"], r["reason"], r["for_model"], r["request_id"]) for r in activity.recent(event="eviction")] == [
        ("a", "not_waited_for", "c", "c1")]
    # The request's own record, at its end, names what its grant evicted (the page's timeline shows it).
    ticket = tickets["c1"]
    ticket.finished_ns = clock.now_ns()
    assert activity.record(ticket)["evicted"] == [{"model": "a", "reason": "not_waited_for"}]
    assert activity.record(tickets["b1"])["evicted"] == []


def test_the_pickers_max_lora_is_every_gpus_max_loaded() -> None:
    """The pod holds each GPU's `maxLoaded` models at once: an endpoint picker's `max_lora`."""
    from picker import parse_exposition, parse_spec, read_adapters

    telemetry = Telemetry(clock=ManualClock())
    telemetry.settings_changed(POLICY)  # big keeps 3, small 1

    def adapters() -> Any:
        found = read_adapters(parse_exposition(telemetry.picker_text()[0].decode()), parse_spec(names.MODELS_INFO))
        assert found is not None
        return found

    assert adapters().max_adapters == 4
    telemetry.queue_changed(picture(GpuProjection("big", ("a", "b"), 0, 4, max_loaded=3),
                                    GpuProjection("small", ("x",), 0, 1)))
    assert adapters().max_adapters == 4 and adapters().running == ("a", "b", "x")
    telemetry.queue_changed(picture(GpuProjection("big", ("a", "b"), 0, 4, max_loaded=2),
                                    GpuProjection("small", ("x",), 0, 1)))
    assert adapters().max_adapters == 3  # a reload changed maxLoaded
