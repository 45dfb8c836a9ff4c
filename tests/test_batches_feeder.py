"""The feeder's rules, exactly, against a stand-in for Envoy's listener: how many lines are in
flight, which answers are a line's result and which send it again, expiry and cancel, and the
telemetry a line carries."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import pathlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from llamaswap.batches import writer as writer_module
from llamaswap.batches.feeder import Feeder, FeedSettings
from llamaswap.batches.lifecycle import BatchStatus
from llamaswap.batches.store import BatchRecord, Store
from llamaswap.telemetry.batches import BatchTelemetry, PresetIds, new_trace_ids

ENDPOINT = "/v1/chat/completions"
Answer = Callable[[web.Request, dict[str, Any]], Awaitable[web.Response]]


class Listener:
    """Envoy's listener as the feeder sees it: answers each line as `answer` says."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.requests: list[tuple[dict[str, str], dict[str, Any]]] = []
        self.active = 0
        self.most_active = 0
        self.gate = asyncio.Event()
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        async def handle(request: web.Request) -> web.Response:
            body = await request.json()
            self.requests.append(({name.lower(): value for name, value in request.headers.items()}, body))
            self.active += 1
            self.most_active = max(self.most_active, self.active)
            try:
                return await self.answer(request, body)
            finally:
                self.active -= 1

        app = web.Application()
        app.router.add_post(ENDPOINT, handle)
        # A client that leaves cancels its handler, as Envoy resets the stream of a client that leaves.
        self._runner = web.AppRunner(app, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        self.gate.set()
        if self._runner is not None:
            await self._runner.cleanup()

    def tries_of(self, content: str) -> int:
        return sum(body["messages"][0]["content"] == content for _, body in self.requests)


async def ok(_: web.Request, body: dict[str, Any]) -> web.Response:
    return web.json_response({"echo": body["messages"][0]["content"]})


class Clock:
    def __init__(self) -> None:
        self.now = 10_000.0

    def __call__(self) -> float:
        return self.now


async def wait_until(predicate: Callable[[], Any], what: str, timeout_s: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


class Rig:
    def __init__(self, tmp_path: pathlib.Path, listener: Listener, in_flight: int = 2) -> None:
        self.clock = Clock()
        self.store = Store(tmp_path / "batches", now=self.clock)
        self.listener = listener
        self.spans = InMemorySpanExporter()
        self.ids = PresetIds()
        tracer_provider = TracerProvider(id_generator=self.ids)
        tracer_provider.add_span_processor(SimpleSpanProcessor(self.spans))
        self.metrics = InMemoryMetricReader()
        meter = MeterProvider(metric_readers=[self.metrics]).get_meter("test")
        self.telemetry = BatchTelemetry(tracer_provider.get_tracer("test"), meter, self.ids)
        self.in_flight = in_flight
        self.feeder = Feeder(self.store, FeedSettings(listener.url, lambda: self.in_flight, lambda: 1000,
                                                      priority_header="x-trusted-priority",
                                                      headers={"authorization": "Bearer upstream-key"}),
                             observer=self.telemetry)
        self.task: asyncio.Task[None] | None = None
        self.tmp_path = tmp_path

    def batch(self, contents: list[str], priority: int = -100) -> str:
        upload = self.tmp_path / "upload"
        upload.write_text("".join(json.dumps({"custom_id": f"id-{content}", "method": "POST", "url": ENDPOINT, "body": {
            "model": "m", "messages": [{"role": "user", "content": content}]}}) + "\n" for content in contents))
        record = self.store.add_file(upload, filename="in.jsonl", purpose="batch")
        trace_id, span_id = new_trace_ids()
        batch = self.store.create_batch(endpoint=ENDPOINT, input_file_id=record.id, completion_window="24h",
                                        window_s=3600, metadata=None, priority=priority, trace_id=trace_id,
                                        span_id=span_id)
        self.feeder.wake()
        return batch.id

    def start(self) -> None:
        self.task = asyncio.create_task(self.feeder.run())

    def record(self, batch_id: str) -> BatchRecord:
        batch = self.store.batch(batch_id)
        assert batch is not None
        return batch

    async def ended(self, batch_id: str) -> BatchRecord:
        await wait_until(lambda: self.record(batch_id).status.ended, f"{batch_id} to end")
        return self.record(batch_id)

    def lines_of(self, file_id: str | None) -> list[dict[str, Any]]:
        if file_id is None:
            return []
        return [json.loads(text) for text in self.store.file_path(file_id).read_text().splitlines()]

    def counted(self) -> dict[tuple[str, tuple[tuple[str, Any], ...]], float]:
        found = {}
        data = self.metrics.get_metrics_data()
        assert data is not None
        for resource in data.resource_metrics:
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    for point in metric.data.data_points:
                        found[(metric.name, tuple(sorted(point.attributes.items())))] = point.value
        return found

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
        self.store.close()


@contextlib.asynccontextmanager
async def listeners() -> AsyncIterator[Callable[[Answer], Awaitable[Listener]]]:
    """Makes listeners, each stopped at the end (the fixture below, for other test modules too)."""
    started: list[Listener] = []

    async def make(answer: Answer) -> Listener:
        listener = Listener(answer)
        await listener.start()
        started.append(listener)
        return listener

    try:
        yield make
    finally:
        for listener in started:
            await listener.stop()


@pytest.fixture
async def listener_with() -> AsyncIterator[Callable[[Answer], Awaitable[Listener]]]:
    async with listeners() as make:
        yield make


async def test_lines_run_a_few_at_a_time_at_the_batch_priority_and_end_once(
        tmp_path: pathlib.Path, listener_with: Callable[[Answer], Awaitable[Listener]]) -> None:
    async def held(request: web.Request, body: dict[str, Any]) -> web.Response:
        await listener.gate.wait()
        return await ok(request, body)

    listener = await listener_with(held)
    rig = Rig(tmp_path, listener, in_flight=3)
    batch_id = rig.batch([f"q{n}" for n in range(8)], priority=-42)
    rig.start()
    await wait_until(lambda: listener.active == 3, "three lines in flight")
    assert rig.feeder.in_flight(batch_id) == 3
    listener.gate.set()
    batch = await rig.ended(batch_id)
    assert batch.status is BatchStatus.COMPLETED and listener.most_active == 3
    output = rig.lines_of(batch.output_file_id)
    assert [record["custom_id"] for record in output] == [f"id-q{n}" for n in range(8)]
    assert [record["response"]["body"]["echo"] for record in output] == [f"q{n}" for n in range(8)]
    headers = [headers for headers, _ in listener.requests]
    assert {h["x-trusted-priority"] for h in headers} == {"-42"}
    assert {h["authorization"] for h in headers} == {"Bearer upstream-key"}
    assert sorted(h["x-request-id"] for h in headers) == sorted(f"{batch_id}:id-q{n}" for n in range(8))
    # Each line's span is a child of the batch's span, whose ids were kept since its creation.
    # The batch's span ends as the feeder learns of the end it committed (a moment after it).
    await wait_until(lambda: any(span.name == "llamaswap.batch" for span in rig.spans.get_finished_spans()),
                     "the batch's span to end")
    spans = rig.spans.get_finished_spans()
    batch_span = next(span for span in spans if span.name == "llamaswap.batch")
    lines = [span for span in spans if span.name == "llamaswap.batch.line"]
    assert f"{batch_span.context.trace_id:032x}" == batch.trace_id
    assert f"{batch_span.context.span_id:016x}" == batch.span_id
    assert len(lines) == 8 and {span.parent.span_id for span in lines if span.parent} == {batch_span.context.span_id}
    # A line's span ends when its answer came, not when its result was written with others.
    assert all(span.start_time is not None and span.end_time is not None and span.start_time <= span.end_time
               for span in lines)
    # The traceparent each line was sent with names the line's span: Envoy's span joins it.
    sent = {h["traceparent"].split("-")[2] for h in headers}
    assert sent == {f"{span.context.span_id:016x}" for span in lines}
    assert rig.counted()[("llamaswap_batch_requests_total", (("outcome", "completed"),))] == 8
    await rig.close()


async def test_an_answer_over_max_answer_bytes_ends_its_line_answer_too_large_never_sent_again(
        tmp_path: pathlib.Path, listener_with: Callable[[Answer], Awaitable[Listener]]) -> None:
    most = 64 * 1024

    async def sized(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        content = body["messages"][0]["content"]
        if content == "huge":  # its content-length passes the bound
            return web.json_response({"data": "x" * (2 * most)})
        if content == "streamed":  # chunked: its bytes so far pass the bound
            response = web.StreamResponse(headers={"content-type": "application/json"})
            response.enable_chunked_encoding()
            await response.prepare(request)
            for _ in range(4):
                await response.write(b" " * (most // 2))
            await response.write_eof()
            return response
        return await ok(request, body)

    listener = await listener_with(sized)
    rig = Rig(tmp_path, listener)
    rig.feeder.settings = dataclasses.replace(rig.feeder.settings, max_answer_bytes=lambda: most)
    batch_id = rig.batch(["huge", "fine", "streamed"])
    rig.start()
    batch = await rig.ended(batch_id)
    assert batch.status is BatchStatus.COMPLETED
    assert [record["response"]["body"]["echo"] for record in rig.lines_of(batch.output_file_id)] == ["fine"]
    errors = rig.lines_of(batch.error_file_id)
    assert [(record["custom_id"], record["error"]["code"]) for record in errors] == [
        ("id-huge", "answer_too_large"), ("id-streamed", "answer_too_large")]
    assert all("batches.maxAnswerBytes" in record["error"]["message"] and record["response"] is None
               for record in errors)
    assert (listener.tries_of("huge"), listener.tries_of("streamed"), listener.tries_of("fine")) == (1, 1, 1)
    await rig.close()


async def test_a_line_whose_sending_fails_otherwise_ends_line_failed_and_the_batch_ends(
        tmp_path: pathlib.Path, listener_with: Callable[[Answer], Awaitable[Listener]]) -> None:
    # Any failure that is neither an answer nor a lost connection (here: a header value that would
    # break HTTP/1.1's framing) ends the line with line_failed: none stays in flight for ever.
    listener = await listener_with(ok)
    rig = Rig(tmp_path, listener)
    rig.feeder.settings = dataclasses.replace(rig.feeder.settings, headers={"authorization": "Bearer a\r\nx: y"})
    batch_id = rig.batch(["a", "b"])
    rig.start()
    batch = await rig.ended(batch_id)
    assert batch.status is BatchStatus.COMPLETED and batch.output_file_id is None and listener.requests == []
    errors = rig.lines_of(batch.error_file_id)
    assert [(record["custom_id"], record["error"]["code"]) for record in errors] == [
        ("id-a", "line_failed"), ("id-b", "line_failed")]
    assert all("ValueError" in record["error"]["message"] and "Bearer" not in record["error"]["message"]
               for record in errors)  # the failure is named, the key's value is not
    assert rig.feeder.in_flight(batch_id) == 0
    await rig.close()


async def test_refusals_that_say_nothing_about_the_line_send_it_again(
        tmp_path: pathlib.Path, listener_with: Callable[[Answer], Awaitable[Listener]]) -> None:
    async def flaky(request: web.Request, body: dict[str, Any]) -> web.Response:
        content = body["messages"][0]["content"]
        tries = listener.tries_of(content)
        if content == "busy" and tries <= 2:
            return web.json_response({"error": {"message": "queue full"}}, status=429, headers={"retry-after-ms": "1"})
        if content == "stopping" and tries == 1:
            return web.json_response({"error": {"message": "shutting down"}}, status=503,
                                     headers={"retry-after-ms": "1"})
        if content == "bad":
            return web.json_response({"error": {"message": "context too long", "code": 400}}, status=400)
        return await ok(request, body)

    listener = await listener_with(flaky)
    rig = Rig(tmp_path, listener, in_flight=4)
    batch_id = rig.batch(["busy", "stopping", "bad", "fine"])
    rig.start()
    batch = await rig.ended(batch_id)
    assert (listener.tries_of("busy"), listener.tries_of("stopping"), listener.tries_of("bad")) == (3, 2, 1)
    assert [record["custom_id"] for record in rig.lines_of(batch.output_file_id)] == ["id-busy", "id-stopping",
                                                                                      "id-fine"]
    [failed] = rig.lines_of(batch.error_file_id)
    assert failed["custom_id"] == "id-bad" and failed["response"]["status_code"] == 400
    assert failed["error"] == {"code": "http_400", "message": "context too long"}
    counts = rig.store.counts(batch_id, batch.total)
    assert (counts.completed, counts.failed) == (3, 1)
    await rig.close()


async def test_a_line_is_sent_again_when_the_listener_cannot_be_reached(
        tmp_path: pathlib.Path, listener_with: Callable[[Answer], Awaitable[Listener]]) -> None:
    listener = await listener_with(ok)
    url = listener.url
    await listener.stop()  # Envoy down: connections refused
    rig = Rig(tmp_path, listener)
    batch_id = rig.batch(["one"])
    rig.start()
    await wait_until(lambda: rig.feeder.in_flight(batch_id) == 1, "the line sent (and refused)")
    assert rig.record(batch_id).status is BatchStatus.IN_PROGRESS
    received: list[dict[str, Any]] = []

    async def handle(request: web.Request) -> web.Response:
        body = await request.json()
        received.append(body)
        return await ok(request, body)

    app = web.Application()
    app.router.add_post(ENDPOINT, handle)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", int(url.rsplit(":", 1)[1])).start()  # Envoy back on its port
    batch = await rig.ended(batch_id)
    assert batch.status is BatchStatus.COMPLETED and len(received) == 1
    await runner.cleanup()
    await rig.close()


async def test_the_window_end_abandons_what_runs_and_expires_the_rest(
        tmp_path: pathlib.Path, listener_with: Callable[[Answer], Awaitable[Listener]]) -> None:
    async def held(request: web.Request, body: dict[str, Any]) -> web.Response:
        if body["messages"][0]["content"] != "quick":
            await listener.gate.wait()
        return await ok(request, body)

    listener = await listener_with(held)
    rig = Rig(tmp_path, listener, in_flight=2)
    batch_id = rig.batch(["quick", "slow1", "slow2", "slow3"])
    rig.start()
    await wait_until(lambda: listener.active == 2 and len(listener.requests) == 3, "one done, two held")
    rig.clock.now += 3600
    rig.feeder.wake()
    batch = await rig.ended(batch_id)
    assert batch.status is BatchStatus.EXPIRED and batch.timestamps["expired_at"] == int(rig.clock.now)
    assert [r["custom_id"] for r in rig.lines_of(batch.output_file_id)] == ["id-quick"]
    errors = rig.lines_of(batch.error_file_id)
    assert [(r["custom_id"], r["error"]["code"], r["response"]) for r in errors] == [
        ("id-slow1", "batch_expired", None), ("id-slow2", "batch_expired", None), ("id-slow3", "batch_expired", None)]
    await wait_until(lambda: listener.active == 0, "the abandoned lines' connections closed")
    assert len(listener.requests) == 3  # slow3 was never sent
    assert rig.counted()[("llamaswap_batch_requests_total", (("outcome", "expired"),))] == 3
    await rig.close()


async def test_cancel_abandons_lines_in_flight_and_sends_no_more(
        tmp_path: pathlib.Path, listener_with: Callable[[Answer], Awaitable[Listener]]) -> None:
    async def held(request: web.Request, body: dict[str, Any]) -> web.Response:
        await listener.gate.wait()
        return await ok(request, body)

    listener = await listener_with(held)
    rig = Rig(tmp_path, listener, in_flight=2)
    batch_id = rig.batch([f"q{n}" for n in range(5)])
    rig.start()
    await wait_until(lambda: listener.active == 2, "two in flight")
    assert rig.store.set_status(batch_id, BatchStatus.CANCELLING, only_from=(BatchStatus.IN_PROGRESS,))
    rig.feeder.wake()
    batch = await rig.ended(batch_id)
    assert batch.status is BatchStatus.CANCELLED and batch.output_file_id is None
    assert [r["error"]["code"] for r in rig.lines_of(batch.error_file_id)] == ["batch_cancelled"] * 5
    assert len(listener.requests) == 2 and rig.feeder.in_flight(batch_id) == 0
    # the statuses' gauge is set as the look that ended it finishes (after a read in a worker thread)
    await wait_until(lambda: rig.counted().get(("llamaswap_batches", (("status", "cancelled"),))) == 1,
                     "the gauge of batches by status to count it")
    await rig.close()


async def test_a_paused_feeder_starts_no_line(
        tmp_path: pathlib.Path, listener_with: Callable[[Answer], Awaitable[Listener]]) -> None:
    listener = await listener_with(ok)
    rig = Rig(tmp_path, listener)
    rig.feeder.pause()
    batch_id = rig.batch(["a", "b"])
    rig.start()
    await wait_until(lambda: rig.record(batch_id).status is BatchStatus.IN_PROGRESS, "validated")
    await rig.feeder.look()
    assert listener.requests == [] and rig.feeder.in_flight(batch_id) == 0
    await rig.close()


async def test_results_are_written_together_and_a_stop_writes_those_answered(
        tmp_path: pathlib.Path, listener_with: Callable[[Answer], Awaitable[Listener]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(writer_module, "RESULTS_S", 3600.0)  # written by a stop or a look only

    async def held(request: web.Request, body: dict[str, Any]) -> web.Response:
        if body["messages"][0]["content"] == "held":
            await listener.gate.wait()
        return await ok(request, body)

    listener = await listener_with(held)
    rig = Rig(tmp_path, listener, in_flight=3)
    batch_id = rig.batch(["a", "b", "held"])
    rig.start()
    await wait_until(lambda: len(listener.requests) == 3 and listener.active == 1, "a and b answered, held running")
    assert rig.store.counts(batch_id, 3).done == 0  # answered, kept to be written with others
    assert rig.task is not None
    rig.task.cancel()  # the sidecar stops: the answered lines' results are written, held's line abandoned
    await asyncio.gather(rig.task, return_exceptions=True)
    assert [line.custom_id for line in rig.store.unfinished_lines(batch_id)] == ["id-held"]
    assert rig.store.counts(batch_id, 3).completed == 2
    await wait_until(lambda: listener.active == 0, "held's connection closed")
    # Started again: only the line without a result is sent again, and the batch ends with each line once.
    listener.gate.set()
    rig.feeder = Feeder(rig.store, rig.feeder.settings, observer=rig.telemetry)
    rig.start()
    batch = await rig.ended(batch_id)
    assert [r["custom_id"] for r in rig.lines_of(batch.output_file_id)] == ["id-a", "id-b", "id-held"]
    assert [listener.tries_of(content) for content in ("a", "b", "held")] == [1, 1, 2]
    assert rig.counted()[("llamaswap_batch_requests_total", (("outcome", "completed"),))] == 3
    await rig.close()
