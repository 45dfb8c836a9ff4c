"""Observability through the real Envoy and the real sidecar: joined traces over OTLP, metrics
scraped by a real Prometheus and pushed over OTLP, the activity log, /queue, `llamaswap queue`.

Every wait is a poll with a deadline; no assertion depends on how long anything took.
"""

from __future__ import annotations

import asyncio
import os
import pathlib
import secrets
import signal
import sys
from typing import Any

import aiohttp
import pytest

from client import chat
from fake_llama import FakeLlamaServer
from harness import async_wait_for, get_json, http_get, metric_samples, running_stack
from otlp import ReceivedSpan, otlp_receiver
from prometheus import prometheus_binary, running_prometheus

from llamaswap.telemetry import instruments as names

BANDS = ("interactive", "normal", "batch")
ENVOY_SERVICE = "llamaswap-envoy"
SIDECAR_SERVICE = "llamaswap"
CHECK_EGRESS = "async envoy.service.auth.v3.Authorization.Check egress"

# Behind a held blocker (normal, model-a), in this arrival order: (request id, header, model, band).
TRAFFIC = [
    ("b1", "batch", "model-a", "batch"),
    ("b2", "batch", "model-a", "batch"),
    ("n1", "soon please", "model-b", "normal"),  # unparseable: priority 0
    ("n2", "normal", "model-a", "normal"),
    ("i1", "interactive", "model-a", "interactive"),
    ("i2", "interactive", "model-b", "interactive"),
    ("i3", "interactive", "model-a", "interactive"),
]
PRIORITY = {"batch": -100, "normal": 0, "interactive": 100}
DEPTH_WHILE_QUEUED = {"interactive": 3.0, "normal": 2.0, "batch": 2.0}
# With model-a loaded, i3 overtakes i2 by swap affinity; once i2 has loaded model-b, n1 goes
# before n2. The blocker loads model-a (nothing was loaded); swaps: a -> b (i2), b -> a (n2).
DISPATCH_ORDER = ["blocker", "i1", "i3", "i2", "n1", "n2", "b1", "b2"]
# /queue lists the waiting in dispatch order (the scheduler simulates the model loads).
QUEUE_ORDER = DISPATCH_ORDER[1:]
DISPATCHED = {"interactive": 3.0, "normal": 3.0, "batch": 2.0}
REORDERS = {(band, reason): 0.0 for band in BANDS for reason in ("aging", "swap_affinity")}
REORDERS["interactive", "swap_affinity"] = 1.0
SWAPS = 2.0
LOADS = 1.0


def sidecar_otlp_env(endpoint: str) -> dict[str, str]:
    return {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100",
            "OTEL_METRIC_EXPORT_INTERVAL": "500", "OTEL_TRACES_SAMPLER": "parentbased_always_on"}


async def queue_traffic(stack: Any, session: aiohttp.ClientSession) -> tuple[asyncio.Task, dict[str, asyncio.Task]]:
    """Hold a blocker at the upstream, then queue TRAFFIC one by one (arrival order matters).

    The requests carry their x-request-id (Envoy keeps it when it does not trace), so the
    activity log and /queue name them as the test does.
    """
    blocker = asyncio.create_task(chat(session, stack.url, "blocker", hold=True, model="model-a",
                                       extra_headers={"x-request-id": "blocker"}))
    await async_wait_for(lambda: stack.upstream.order() == ["blocker"], what="blocker at the upstream")
    tasks = {}
    for index, (request_id, header, model, _) in enumerate(TRAFFIC):
        # Streamed: a streamed first byte is what times a model load (llamaswap_model_swap_seconds).
        tasks[request_id] = asyncio.create_task(chat(session, stack.url, request_id, priority=header, model=model,
                                                     stream=True, extra_headers={"x-request-id": request_id}))
        await async_wait_for(lambda n=index + 1: len(stack.sidecar.queue()["waiting"]) == n,
                             what=f"{request_id} in the queue")
    return blocker, tasks


async def drain(stack: Any, blocker: asyncio.Task, tasks: dict[str, asyncio.Task]) -> None:
    stack.upstream.release("blocker")
    replies = await asyncio.gather(blocker, *tasks.values())
    assert [reply.status for reply in replies] == [200] * len(replies)
    assert stack.upstream.order() == DISPATCH_ORDER
    assert stack.upstream.max_active == 1


# -- (1) one trace: client, Envoy, sidecar ---------------------------------------------------


def _one(spans: list[ReceivedSpan], name: str, service: str) -> ReceivedSpan:
    found = [s for s in spans if s.name == name and s.service == service]
    assert len(found) == 1, (name, service, [(s.service, s.name) for s in spans])
    return found[0]


def _trace_complete(receiver: Any, trace_id: str) -> list[ReceivedSpan] | None:
    spans = receiver.spans(trace_id=trace_id)
    wanted = {(ENVOY_SERVICE, "ingress"), (ENVOY_SERVICE, CHECK_EGRESS),
              (SIDECAR_SERVICE, "llamaswap.queue"), (SIDECAR_SERVICE, "llamaswap.run")}
    return spans if wanted <= {(s.service, s.name) for s in spans} else None


async def test_one_trace_holds_client_envoy_and_sidecar_spans(tmp_path: pathlib.Path) -> None:
    client_trace = secrets.token_hex(16)
    client_span = secrets.token_hex(8)
    config = {"routing": {"scheduler": {"maxQueued": 2}}}
    with otlp_receiver() as receiver, running_stack(tmp_path, config, otlp_endpoint=receiver.endpoint,
                                                    sidecar_env=sidecar_otlp_env(receiver.endpoint),
                                                    fake=FakeLlamaServer(router=True)) as stack:
        async with aiohttp.ClientSession() as session:
            # The winner brings its own non-UUID x-request-id: it must still be traced
            # (request_id_extension with use_request_id_for_trace_sampling off).
            blocker = asyncio.create_task(chat(session, stack.url, "blocker", hold=True, model="model-a"))
            await async_wait_for(lambda: stack.upstream.order() == ["blocker"], what="blocker at the upstream")
            early = asyncio.create_task(chat(session, stack.url, "early", priority="normal", model="model-b"))
            await async_wait_for(lambda: len(stack.sidecar.queue()["waiting"]) == 1, what="early in the queue")
            winner = asyncio.create_task(chat(
                session, stack.url, "winner", priority="interactive", model="model-a",
                extra_headers={"traceparent": f"00-{client_trace}-{client_span}-01",
                               "x-request-id": "winner-request"}))
            await async_wait_for(lambda: len(stack.sidecar.queue()["waiting"]) == 2, what="winner in the queue")
            refused = await chat(session, stack.url, "refused", priority="batch",
                                 extra_headers={"traceparent": f"00-{secrets.token_hex(16)}-{client_span}-01"})
            assert refused.status == 429
            stack.upstream.release("blocker")
            replies = await asyncio.gather(blocker, early, winner)
        assert [r.status for r in replies] == [200, 200, 200]
        assert stack.upstream.order() == ["blocker", "winner", "early"]

        spans = await async_wait_for(lambda: _trace_complete(receiver, client_trace),
                                     what="Envoy's and the sidecar's spans in the client's trace")
        ingress = _one(spans, "ingress", ENVOY_SERVICE)
        check = _one(spans, CHECK_EGRESS, ENVOY_SERVICE)
        queue = _one(spans, "llamaswap.queue", SIDECAR_SERVICE)
        run = _one(spans, "llamaswap.run", SIDECAR_SERVICE)
        assert ingress.parent_span_id == client_span  # Envoy continued the client's trace
        assert check.parent_span_id == ingress.span_id
        # The hold and the run, both under the Check call: the one call the sidecar holds.
        assert queue.parent_span_id == check.span_id
        assert run.parent_span_id == check.span_id
        request_id = ingress.attributes["guid:x-request-id"]
        assert request_id == "winner-request"
        assert ingress.start_time_unix_nano <= queue.start_time_unix_nano <= queue.end_time_unix_nano
        assert queue.end_time_unix_nano == run.start_time_unix_nano <= run.end_time_unix_nano

        for span in (queue, run):
            attributes = span.attributes
            assert attributes["llamaswap.request_id"] == request_id
            assert attributes["llamaswap.priority"] == 100
            assert attributes["llamaswap.band"] == "interactive"
            assert attributes["llamaswap.model"] == "model-a"
            assert attributes["llamaswap.queue_depth"] == 1
            assert attributes["llamaswap.swap_affinity"] is True
            assert attributes["llamaswap.queue_wait_ms"] > 0
            assert attributes["llamaswap.aging"] >= 0
            assert attributes["llamaswap.score"] >= 110
            assert not span.is_error
        assert run.attributes["llamaswap.outcome"] == "served"

        # The winner overtook `early`, named by its request id (from its own trace).
        early_queue = await async_wait_for(
            lambda: [s for s in receiver.spans(name="llamaswap.queue")
                     if s.attributes.get("llamaswap.priority") == 0
                     and s.attributes.get("llamaswap.model") == "model-b"],
            what="early's queue span")
        early_id = early_queue[0].attributes["llamaswap.request_id"]
        overtook = [e for e in queue.events if e.name == "llamaswap.overtook"]
        assert [e.attributes["llamaswap.request_id"] for e in overtook] == [early_id]

        # The refused request: a queue span with error status, in its own client trace.
        rejected = await async_wait_for(
            lambda: [s for s in receiver.spans(name="llamaswap.queue")
                     if s.attributes.get("llamaswap.outcome") == "rejected_full"], what="the rejected queue span")
        assert rejected[0].is_error and rejected[0].attributes["llamaswap.band"] == "batch"
        rejected_check = await async_wait_for(
            lambda: receiver.spans(trace_id=rejected[0].trace_id, name=CHECK_EGRESS), what="the rejected Check span")
        assert [s.span_id for s in rejected_check] == [rejected[0].parent_span_id]

        # The activity log names the trace.
        activity = await async_wait_for(lambda: _activity(stack, 3), what="the activity records")
        record = next(r for r in activity if r["request_id"] == request_id)
        assert record["trace_id"] == client_trace
        assert record["serial_band"] == "interactive" and record["outcome"] == "served"


# -- (2) a real Prometheus scrapes /metrics --------------------------------------------------


@pytest.fixture
def prometheus_installed() -> None:
    if prometheus_binary() is None:
        if os.environ.get("CI"):
            pytest.fail("CI is set but Prometheus is not installed (apt-get install prometheus)")
        pytest.skip("Prometheus is not installed (Debian package `prometheus`); CI installs it")


@pytest.mark.prometheus
async def test_prometheus_scrapes_the_specified_series(tmp_path: pathlib.Path, prometheus_installed: None) -> None:
    with running_stack(tmp_path, fake=FakeLlamaServer(router=True)) as stack, \
            running_prometheus(tmp_path, [f"127.0.0.1:{stack.sidecar.admin_port}"]) as prometheus:
        await async_wait_for(lambda: prometheus.targets_up("llamaswap"), what="the sidecar target up")
        # The four series, every band, present before any traffic.
        for name in (names.QUEUE_DEPTH, names.QUEUE_OLDEST_WAIT, names.DISPATCHED):
            assert set(prometheus.values(name, "band")) == set(BANDS), name
        assert {(item["metric"]["band"], item["metric"]["reason"])
                for item in prometheus.query(names.REORDERS)} == set(REORDERS)

        async with aiohttp.ClientSession() as session:
            blocker, tasks = await queue_traffic(stack, session)

            def queued_scrape() -> bool:
                depth = prometheus.values(names.QUEUE_DEPTH, "band")
                oldest = prometheus.values(names.QUEUE_OLDEST_WAIT, "band")
                return depth == DEPTH_WHILE_QUEUED and all(oldest[band] > 0 for band in BANDS)

            await async_wait_for(queued_scrape, what="Prometheus to see the queue depth by band")
            assert prometheus.values(names.GPU_BUSY, "job") == {"llamaswap": 1.0}
            await drain(stack, blocker, tasks)

        await async_wait_for(lambda: prometheus.values(names.DISPATCHED, "band") == DISPATCHED,
                             what="Prometheus to see the dispatched counts")
        await async_wait_for(lambda: prometheus.values(names.QUEUE_DEPTH, "band") == {b: 0.0 for b in BANDS},
                             what="an empty queue in Prometheus")
        reorders = {(item["metric"]["band"], item["metric"]["reason"]): float(item["value"][1])
                    for item in prometheus.query(names.REORDERS)}
        assert reorders == REORDERS
        assert prometheus.values(names.SWAPS, "job") == {"llamaswap": SWAPS}
        assert prometheus.values(names.LOADS, "job") == {"llamaswap": LOADS}
        assert prometheus.values(names.UNPARSEABLE, "job") == {"llamaswap": 1.0}
        # Counted when each exchange's stream closes, which can trail the client's reply.
        await async_wait_for(
            lambda: prometheus.values(f'{names.REQUESTS}{{outcome="served"}}', "outcome") == {"served": 8.0},
            what="Prometheus to see every request served")
        assert prometheus.values(f"{names.QUEUE_WAIT}_count", "band") == DISPATCHED


# -- (3) metrics pushed over OTLP ------------------------------------------------------------


async def test_metrics_pushed_over_otlp_with_the_same_names(tmp_path: pathlib.Path) -> None:
    with otlp_receiver() as receiver, running_stack(tmp_path, sidecar_env=sidecar_otlp_env(receiver.endpoint),
                                                    fake=FakeLlamaServer(router=True)) as stack:
        # Histograms appear with their first measurement; everything else is there from the start.
        by_traffic = {names.QUEUE_WAIT, names.RUN, names.MODEL_SWAP, names.MODEL_RUN, names.ESTIMATE_RATIO}
        await async_wait_for(lambda: set(names.ALL) - by_traffic <= receiver.metric_names(),
                             what="the metrics over OTLP")

        def latest_by_band(metric: str, **labels: str) -> dict[str, float]:
            out = {}
            for band in BANDS:
                point = receiver.latest(metric, band=band, **labels)
                if point is not None:
                    out[band] = point.value
            return out

        async with aiohttp.ClientSession() as session:
            blocker, tasks = await queue_traffic(stack, session)
            # Collected on the SDK's exporter thread: the loop's published picture.
            await async_wait_for(lambda: latest_by_band(names.QUEUE_DEPTH) == DEPTH_WHILE_QUEUED,
                                 what="the queue depth over OTLP")
            await drain(stack, blocker, tasks)
        await async_wait_for(lambda: latest_by_band(names.DISPATCHED) == DISPATCHED, what="dispatched over OTLP")
        await async_wait_for(lambda: latest_by_band(names.QUEUE_DEPTH) == {b: 0.0 for b in BANDS},
                             what="an empty queue over OTLP")
        for band, reason in REORDERS:
            assert receiver.latest(names.REORDERS, band=band, reason=reason).value == REORDERS[band, reason]

        # The same names as the pulled text, with the right kinds.
        status, body = http_get(f"{stack.sidecar.admin_url}/metrics")
        assert status == 200
        pulled = {line.split()[2] for line in body.decode().splitlines() if line.startswith("# TYPE ")}
        assert receiver.metric_names(service=SIDECAR_SERVICE) == pulled == set(names.ALL)
        kinds = {p.metric: (p.kind, p.monotonic) for p in receiver.points()}
        assert kinds[names.QUEUE_DEPTH] == ("gauge", None)
        assert kinds[names.QUEUE_OLDEST_WAIT] == ("gauge", None)
        assert kinds[names.DISPATCHED] == ("sum", True)
        assert kinds[names.REORDERS] == ("sum", True)
        assert kinds[names.QUEUE_WAIT] == ("histogram", None)


# -- (4) activity log and /queue, (5) /metrics through Envoy, (6) `llamaswap queue` -----------


def _activity(stack: Any, count: int) -> list[dict[str, Any]] | None:
    records = get_json(f"{stack.sidecar.admin_url}/activity")["activity"]
    return records if len(records) >= count else None


async def _llamaswap(*args: str, ignore_sigint: bool = False) -> asyncio.subprocess.Process:
    def ignore() -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    return await asyncio.create_subprocess_exec(sys.executable, "-m", "llamaswap", *args,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                                                preexec_fn=ignore if ignore_sigint else None)


async def test_activity_queue_table_and_metrics_through_envoy(tmp_path: pathlib.Path) -> None:
    with running_stack(tmp_path, fake=FakeLlamaServer(router=True)) as stack:  # models swap by name
        async with aiohttp.ClientSession() as session:
            blocker, tasks = await queue_traffic(stack, session)

            document = stack.sidecar.queue()
            assert document["running"]["request_id"] == "blocker"
            waiting = document["waiting"]
            assert [w["request_id"] for w in waiting] == QUEUE_ORDER
            assert [w["position"] for w in waiting] == list(range(1, len(TRAFFIC) + 1))
            sent = {request_id: (band, model) for request_id, _, model, band in TRAFFIC}
            for item in waiting:
                band, model = sent[item["request_id"]]
                assert (item["band"], item["model"], item["priority"]) == (band, model, PRIORITY[band])
                assert item["waited_s"] > 0
            assert {band: stats["depth"] for band, stats in document["bands"].items()} == DEPTH_WHILE_QUEUED

            # `llamaswap queue`: the table, running first, then the waiting in dispatch order.
            process = await _llamaswap("queue", "--admin", stack.sidecar.admin_url)
            out, err = await asyncio.wait_for(process.communicate(), 60)
            assert process.returncode == 0, err.decode()
            lines = out.decode().splitlines()
            assert lines[1].split()[:3] == ["POS", "ST", "REQUEST_ID"]
            table = [line.split() for line in lines[2:]]
            assert table[0][:3] == ["-", "R", "blocker"]
            assert [(row[0], row[1], row[2]) for row in table[1:]] == [
                (str(position), "PD", request_id) for position, request_id in enumerate(QUEUE_ORDER, 1)]
            for row in table[1:]:
                band, model = sent[row[2]]
                assert row[3:5] == [str(PRIORITY[band]), band] and row[-1] == model

            # --watch refreshes until stopped: by SIGTERM, and by SIGINT even when it was started
            # with SIGINT ignored, as a background job inherits it.
            for signum in (signal.SIGTERM, signal.SIGINT):
                watcher = await _llamaswap("queue", "--admin", stack.sidecar.admin_url, "--watch", "0.2",
                                           ignore_sigint=True)
                frames = 0
                assert watcher.stdout is not None
                while frames < 2:
                    line = await asyncio.wait_for(watcher.stdout.readline(), 60)
                    assert line, (await watcher.stderr.read()).decode()
                    frames += line.startswith(b"POS ")
                watcher.send_signal(signum)
                await asyncio.wait_for(watcher.wait(), 60)
                assert watcher.returncode == 0

            await drain(stack, blocker, tasks)

        # The activity log: one record per dispatched request, in dispatch order. A record is
        # written when the exchange's stream closes, which can be just after the client's reply.
        activity = await async_wait_for(lambda: _activity(stack, len(DISPATCH_ORDER)), what="all activity records")
        assert [r["request_id"] for r in activity] == DISPATCH_ORDER
        for record in activity:
            band, model = sent.get(record["request_id"], ("normal", "model-a"))
            assert record["serial_band"] == band and record["model"] == model
            assert record["serial_priority"] == PRIORITY[band]
            assert record["outcome"] == "served"
            assert {"serial_score", "serial_queue_wait_ms", "trace_id"} <= set(record)
        reordered = {r["request_id"]: r["reordered_by"] for r in activity if r["reordered_by"]}
        assert reordered == {"i3": ["swap_affinity"]}

        # GET /metrics through Envoy's listener: the scheduler metrics.
        status, body = http_get(f"{stack.url}/metrics")
        assert status == 200
        samples = metric_samples(body.decode())
        for band in BANDS:
            assert samples[f'{names.DISPATCHED}{{band="{band}"}}'] == DISPATCHED[band]
            assert samples[f'{names.QUEUE_DEPTH}{{band="{band}"}}'] == 0
            assert samples[f'{names.QUEUE_OLDEST_WAIT}{{band="{band}"}}'] == 0
        assert samples[f'{names.REORDERS}{{band="interactive",reason="swap_affinity"}}'] == 1
        assert stack.upstream.metrics_asked == []  # answered by the sidecar
