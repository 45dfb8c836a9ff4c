"""Stopping Batch API lines for a higher band, the runtime's side (issue 46, `runtime/stops.py`):
a real Coordinator on virtual time asks the lines' owner to stop a line, ends it as stopped when
its stream closes, and gives the line sent again its first place back."""

from __future__ import annotations

import dataclasses
import pathlib

import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from flow import FakeUpstream, Flow, Request, clock, virtual_time

from llamaswap.config import ConfigError, parse_config
from llamaswap.core import Outcome
from llamaswap.runtime.activity import STOP, ActivityLog
from llamaswap.runtime.observer import SettleReason, SettleResult
from llamaswap.runtime.settle import SETTLE_POLL_FIRST_S
from llamaswap.runtime.ticket import ExchangeEnd
from llamaswap.telemetry import instruments as names
from llamaswap.telemetry.observer import Telemetry
from test_telemetry import by_label, parse_text


@dataclasses.dataclass(frozen=True)
class Kept:
    """A line's progress as its owner tells it (`stops.LineProgress`)."""

    stops: int
    tokens: int
    stopping: bool = False


class FakeLines:
    """The feeder's side: which request ids are stoppable lines, the stops asked of it, and each
    line's progress: its stops so far (counted as the feeder counts them: once the stopped part
    let go, `let_go`), its tokens (set by the test: what the line has generated) and whether a
    stop asked of it has not let go yet."""

    def __init__(self, *request_ids: str, refuse: bool = False, stops_left: bool = True) -> None:
        self.lines = set(request_ids)
        self.refuse = refuse
        self.stops_left = stops_left  # False: each line was stopped batches.maxPreemptions times
        self.stopped: list[str] = []
        self.stopping: set[str] = set()  # asked to stop, not yet let go (the test says when it did)
        self.let_go_of: list[str] = []  # stops taken: the feeder counts a stop once its part let go
        self.tokens: dict[str, int] = {}

    def key_of(self, request_id: str) -> bytes | None:
        return f"line:{request_id}".encode() if request_id in self.lines else None

    def may_stop(self, request_id: str) -> bool:
        return request_id in self.lines and self.stops_left

    def stop(self, request_id: str) -> bool:
        if self.refuse or request_id not in self.lines:
            return False
        self.stopped.append(request_id)
        self.stopping.add(request_id)
        return True

    def let_go(self, request_id: str) -> None:
        """The line's stopped part has let go (the feeder closed its stream): no longer stopping."""
        self.stopping.discard(request_id)
        self.let_go_of.append(request_id)

    def progress(self, request_id: str) -> Kept | None:
        if request_id not in self.lines:
            return None
        return Kept(self.let_go_of.count(request_id), self.tokens.get(request_id, 0), request_id in self.stopping)


def stops_seen(flow: Flow) -> list[object]:
    return [detail for kind, detail in flow.recorder.events if kind == "line_stopped"]


@virtual_time
async def test_a_person_stops_a_line_which_ends_stopped_and_comes_back_to_its_first_place() -> None:
    lines = FakeLines("batch_1:line-a", "batch_1:line-b")
    activity = ActivityLog(clock())
    telemetry = Telemetry(clock=clock())
    flow = Flow(lines=lines, observers=(activity, telemetry))
    line = await flow.arrive("batch_1:line-a", "batch", model="m")
    assert line.granted
    first_arrival = line.ticket.arrival_ns
    for _ in range(5):  # (Envoy's periodic entries keep its lease)
        await flow.advance(1)
        await flow.renew(line)
    later_line = await flow.arrive("batch_1:line-b", "batch", model="m")
    person = await flow.arrive("person", "interactive", model="m")
    assert lines.stopped == ["batch_1:line-a"]
    # Asked, not yet taken: its end could still come first (then it was no stop). Nothing seen yet.
    assert stops_seen(flow) == [] and activity.recent(event=STOP) == []
    samples = parse_text(telemetry.prometheus_text()[0].decode())
    assert by_label(samples, names.PREEMPTIONS, "band")["batch"] == 0.0
    lines.tokens["batch_1:line-a"] = 7  # what the feeder read before it closed the stream
    await flow.end(line, ExchangeEnd.CLIENT_LEFT)  # the feeder closed the line's stream
    assert line.ticket.outcome is Outcome.STOPPED and line.ticket.abandoned
    assert stops_seen(flow) == [("batch_1:line-a", "person", 7)]
    [record] = activity.recent(event=STOP)
    assert (record["request_id"], record["for_request_id"], record["serial_band"], record["for_band"],
            record["ran_ms"], record["tokens_kept"]) == ("batch_1:line-a", "person", "batch", "interactive",
                                                         5000.0, 7)
    samples = parse_text(telemetry.prometheus_text()[0].decode())
    assert by_label(samples, names.PREEMPTIONS, "band") == {"interactive": 0.0, "normal": 0.0, "batch": 1.0}
    assert by_label(samples, names.REQUESTS, "outcome")["stopped"] == 1.0
    await flow.advance(1)  # the settle's poll: the upstream has let go
    assert person.granted and not later_line.granted
    resumed = await flow.arrive("batch_1:line-a", "batch", model="m")
    assert resumed.ticket.takeover is not None and resumed.ticket.arrival_ns == first_arrival
    assert flow.waiting_ids() == ["batch_1:line-a", "batch_1:line-b"]  # ahead of the line that came after it
    await flow.complete(person)
    await flow.advance(1)
    assert resumed.granted and not later_line.granted
    assert lines.stopped == ["batch_1:line-a"]  # asked once
    telemetry.shutdown()


@virtual_time
async def test_a_client_s_own_request_is_never_stopped() -> None:
    lines = FakeLines()
    flow = Flow(lines=lines)
    batch = await flow.arrive("a-client", "batch")
    person = await flow.arrive("person", "interactive")
    await flow.advance(1)
    assert batch.granted and person.waiting
    assert lines.stopped == [] and stops_seen(flow) == []


@virtual_time
async def test_a_line_that_ends_before_its_stop_ends_as_it_ended_and_keeps_no_place() -> None:
    lines = FakeLines("batch_1:line-a")
    flow = Flow(lines=lines)
    line = await flow.arrive("batch_1:line-a", "batch")
    person = await flow.arrive("person", "interactive")
    assert lines.stopped == ["batch_1:line-a"]
    await flow.complete(line)  # its last token came before the stop
    assert line.ticket.outcome is Outcome.SERVED
    assert person.granted and flow.coordinator.view().kept == ()
    # The end won: it was no stop (no record, not counted, no span events).
    assert stops_seen(flow) == []


@virtual_time
async def test_a_line_its_owner_will_not_stop_runs_on() -> None:
    lines = FakeLines("batch_1:line-a", refuse=True)
    flow = Flow(lines=lines)
    line = await flow.arrive("batch_1:line-a", "batch")
    person = await flow.arrive("person", "interactive")
    assert stops_seen(flow) == [] and person.waiting
    await flow.end(line, ExchangeEnd.CLIENT_LEFT)
    assert line.ticket.outcome is Outcome.CANCELLED_RUNNING
    assert flow.coordinator.view().kept == ()


@virtual_time
async def test_a_line_sent_again_before_its_stopped_part_has_ended_waits_for_that_end_and_takes_its_place() -> None:
    lines = FakeLines("batch_1:line-a", "batch_1:line-b")
    flow = Flow(lines=lines)
    line = await flow.arrive("batch_1:line-a", "batch", model="m")
    first_arrival = line.ticket.arrival_ns
    await flow.advance(1)
    later_line = await flow.arrive("batch_1:line-b", "batch", model="m")
    person = await flow.arrive("person", "interactive", model="m")
    assert lines.stopped == ["batch_1:line-a"]
    resumed = await flow.arrive("batch_1:line-a", "batch", model="m")  # the feeder was quicker than Envoy's report
    assert flow.waiting_ids() == ["person", "batch_1:line-b"]  # not queued yet: it waits for the stopped part
    await flow.end(line, ExchangeEnd.CLIENT_LEFT)
    assert line.ticket.outcome is Outcome.STOPPED
    assert resumed.ticket.takeover is not None and resumed.ticket.arrival_ns == first_arrival
    await flow.advance(1)
    assert person.granted and not later_line.granted
    assert flow.waiting_ids() == ["batch_1:line-a", "batch_1:line-b"]


async def _two_slots_one_line_stopped() -> tuple[Flow, Request, Request]:
    """Two slots, both computing a line (the upstream says 2); a person arrives and one line is
    stopped (the stopped one), and its stream closes; the other runs on."""
    lines = FakeLines("batch_1:line-a", "batch_1:line-b")
    flow = Flow({"upstream": {"slots": 2}, "envoy": {"leaseSeconds": 1000}}, upstream=FakeUpstream(busy=2),
                lines=lines)
    await flow.arrive("batch_1:line-a", "batch", model="m")
    await flow.arrive("batch_1:line-b", "batch", model="m")
    await flow.advance(2)  # past the minimum run
    person = await flow.arrive("person", "interactive", model="m")
    [stopped_id] = lines.stopped  # (either: they ran as long)
    stopped = flow.requests[stopped_id]
    await flow.end(stopped, ExchangeEnd.CLIENT_LEFT)
    assert stopped.ticket.outcome is Outcome.STOPPED and person.waiting
    return flow, stopped, person


@virtual_time
async def test_a_stopped_line_s_settle_ends_at_the_first_answer_that_counts_only_what_is_held() -> None:
    """A stopped line lets go at its next token: one answer of the upstream within the grants still
    running (line-b) ends its settle, where a client that left takes a second one."""
    flow, _, person = await _two_slots_one_line_stopped()
    await flow.advance(SETTLE_POLL_FIRST_S)
    assert person.waiting  # line-a is still at its token: 2 compute
    asks = len(flow.upstream.busy_calls)
    flow.upstream.busy_answer = 1  # line-a let go; line-b computes on
    await flow.advance(SETTLE_POLL_FIRST_S)
    assert person.granted and len(flow.upstream.busy_calls) == asks + 1
    [settle] = flow.recorder.settles
    assert (settle.reason, settle.result) == (SettleReason.STOPPED, SettleResult.IDLE)


@virtual_time
async def test_a_stopped_line_is_never_stopped_by_unloading_its_model() -> None:
    """upstream.abandonedGeneration: stop unloads a model whose abandoned generation runs alone;
    a stopped line lets go by itself, and a reload would cost more than its token."""
    lines = FakeLines("batch_1:line-a")
    flow = Flow({"upstream": {"abandonedGeneration": "stop"}, "envoy": {"leaseSeconds": 1000}},
                upstream=FakeUpstream(busy=True), lines=lines)
    line = await flow.arrive("batch_1:line-a", "batch", model="m")
    await flow.advance(2)
    person = await flow.arrive("person", "interactive", model="m")
    await flow.end(line, ExchangeEnd.CLIENT_LEFT)
    await flow.advance(0.3)
    assert person.waiting and flow.upstream.stop_calls == []
    flow.upstream.busy_answer = False
    await flow.advance(SETTLE_POLL_FIRST_S)
    assert person.granted and not person.ticket.decision.load
    [settle] = flow.recorder.settles
    assert (settle.reason, settle.result) == (SettleReason.STOPPED, SettleResult.IDLE)


@virtual_time
async def test_a_stopped_line_s_settle_that_covers_a_client_that_left_takes_two_answers() -> None:
    """The settle under way covers a generation abandoned meanwhile, which may run on: from then on
    an answer within what is held is believed only when the next one agrees."""
    lines = FakeLines("batch_1:line-a", "batch_1:line-b")
    flow = Flow({"upstream": {"slots": 3}, "envoy": {"leaseSeconds": 1000}}, upstream=FakeUpstream(busy=3),
                lines=lines)
    for request_id in ("batch_1:line-a", "batch_1:line-b"):
        await flow.arrive(request_id, "batch", model="m")
    client = await flow.arrive("client", "batch", model="m")
    await flow.advance(2)
    person = await flow.arrive("person", "interactive", model="m")
    [stopped_id] = lines.stopped
    await flow.end(flow.requests[stopped_id], ExchangeEnd.CLIENT_LEFT)
    await flow.end(client, ExchangeEnd.CLIENT_LEFT)  # abandoned while the stopped line settles
    assert client.ticket.abandoned
    flow.upstream.busy_answer = 1  # one computes, one line is held: the held one, or the client's?
    await flow.advance(SETTLE_POLL_FIRST_S)
    assert person.waiting
    await flow.advance(SETTLE_POLL_FIRST_S)
    assert person.granted  # the second answer agrees
    [settle] = flow.recorder.settles
    assert settle.reason is SettleReason.STOPPED


@virtual_time
async def test_a_stopped_line_s_settle_that_covers_a_client_that_left_stops_that_one() -> None:
    """upstream.abandonedGeneration: stop: the settle under way for a stopped line comes to cover a
    client's abandoned generation, which may run on: that one is stopped as any would be."""
    lines = FakeLines("batch_1:line-a")
    flow = Flow({"upstream": {"slots": 2, "abandonedGeneration": "stop"}, "envoy": {"leaseSeconds": 1000}},
                upstream=FakeUpstream(busy=2), lines=lines)
    line = await flow.arrive("batch_1:line-a", "batch", model="m")
    client = await flow.arrive("client", "batch", model="m")
    await flow.advance(2)
    person = await flow.arrive("person", "interactive", model="m")
    assert lines.stopped == ["batch_1:line-a"]
    await flow.end(line, ExchangeEnd.CLIENT_LEFT)
    await flow.advance(0.1)
    assert flow.upstream.stop_calls == [] and person.waiting  # the line lets go by itself
    await flow.end(client, ExchangeEnd.CLIENT_LEFT)
    flow.upstream.busy_answer = 1  # the client's generation runs on, alone
    await flow.advance(0.1)
    assert flow.upstream.stop_calls == ["m"]
    assert person.granted and person.ticket.decision.load  # stopping unloaded the model
    [settle] = flow.recorder.settles
    assert (settle.reason, settle.result) == (SettleReason.STOPPED, SettleResult.STOPPED)


@virtual_time
async def test_a_line_stopped_its_most_times_runs_to_its_end() -> None:
    lines = FakeLines("batch_1:line-a", stops_left=False)
    flow = Flow(lines=lines)
    line = await flow.arrive("batch_1:line-a", "batch", model="m")
    person = await flow.arrive("person", "interactive", model="m")
    assert line.granted and person.waiting
    assert lines.stopped == [] and stops_seen(flow) == []


def test_the_minimum_run_and_the_most_stops_are_read_and_checked(tmp_path: pathlib.Path) -> None:
    config = parse_config({"batches": {"dir": str(tmp_path), "minRunSeconds": 2.5, "maxPreemptions": 1}})
    assert config.policy().stop_min_run_s == 2.5 and config.batches.max_preemptions == 1
    assert parse_config({"batches": {"dir": str(tmp_path)}}).policy().stop_min_run_s == 1.0
    assert parse_config({"batches": {"dir": str(tmp_path)}}).batches.max_preemptions == 10
    for key, value in (("minRunSeconds", -1), ("maxPreemptions", -1), ("maxPreemptions", "3")):
        with pytest.raises(ConfigError, match=f"batches.{key}"):
            parse_config({"batches": {"dir": str(tmp_path), key: value}})


@virtual_time
async def test_a_stop_is_an_event_on_the_line_s_run_span_and_on_the_person_s_queue_span() -> None:
    exporter = InMemorySpanExporter()
    telemetry = Telemetry(clock=clock(), span_processors=[SimpleSpanProcessor(exporter)])
    lines = FakeLines("batch_1:line-a")
    flow = Flow(lines=lines, observers=(telemetry,))
    line = await flow.arrive("batch_1:line-a", "batch", model="m")
    person = await flow.arrive("person", "interactive", model="m")
    await flow.end(line, ExchangeEnd.CLIENT_LEFT)
    await flow.advance(1)
    assert person.granted
    spans = {(span.name, span.attributes["llamaswap.request_id"]): span for span in exporter.get_finished_spans()}
    [stopped] = spans["llamaswap.run", "batch_1:line-a"].events
    assert (stopped.name, dict(stopped.attributes)) == (
        "llamaswap.stopped", {"llamaswap.for_request_id": "person", "llamaswap.for_band": "interactive"})
    [made_room] = [e for e in spans["llamaswap.queue", "person"].events if e.name == "llamaswap.stopped_line"]
    assert dict(made_room.attributes) == {"llamaswap.request_id": "batch_1:line-a", "llamaswap.band": "batch",
                                          "llamaswap.upstream": "gpu0"}
    telemetry.shutdown()


@virtual_time
async def test_a_stop_taken_after_its_person_ran_elsewhere_adds_nothing_to_the_person_s_spans() -> None:
    """Two slots, a line in each: a person's request stops one; the other line ends on its own
    first and the person takes its slot. When the stopped line lets go, its run span says it
    was stopped for the person, whose queue span, written at its grant, has no event of it; and
    nothing is left waiting for a span that was already written."""
    exporter = InMemorySpanExporter()
    telemetry = Telemetry(clock=clock(), span_processors=[SimpleSpanProcessor(exporter)])
    lines = FakeLines("batch_1:line-a", "batch_1:line-b")
    flow = Flow({"upstream": {"slots": 2}}, lines=lines, observers=(telemetry,))
    line_a = await flow.arrive("batch_1:line-a", "batch", model="m")
    line_b = await flow.arrive("batch_1:line-b", "batch", model="m")
    person = await flow.arrive("person", "interactive", model="m")
    [asked] = lines.stopped
    stopped, other = (line_a, line_b) if asked == "batch_1:line-a" else (line_b, line_a)
    await flow.complete(other)  # its own end came first: the person takes its slot
    assert person.granted
    lines.let_go(asked)
    await flow.end(stopped, ExchangeEnd.CLIENT_LEFT)
    await flow.complete(person)
    await flow.advance(1)
    spans = {(span.name, span.attributes["llamaswap.request_id"]): span for span in exporter.get_finished_spans()}
    assert [e.name for e in spans["llamaswap.run", asked].events] == ["llamaswap.stopped"]
    assert [e.name for e in spans["llamaswap.queue", "person"].events if e.name == "llamaswap.stopped_line"] == []
    assert telemetry._stops_for == {}  # (nothing kept for a span already written)
    telemetry.shutdown()
