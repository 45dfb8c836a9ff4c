"""The OpenAI Batch API end to end: the real `openai` SDK through the real Envoy to the sidecar,
whose lines go back through Envoy's listener to the fake upstream (router mode, so the models
it serves are known). The sidecar killed mid-batch and started again; cancel; bad files; the
line limit."""

from __future__ import annotations

import collections
import concurrent.futures
import json
import pathlib
import signal
from typing import Any

import openai
import pytest
import yaml

from fake_llama import FakeLlamaServer
from harness import (
    EnvoyProcess,
    SidecarProcess,
    Stack,
    get_json,
    http_get,
    metric_samples,
    running_stack,
    free_port,
    wait_for,
)

GATE = "wait-for-the-gate"


def _config(workdir: pathlib.Path, **batches: Any) -> dict[str, Any]:
    # Fixed ports: a sidecar started again must be where Envoy's bootstrap says, and the feeder
    # must know Envoy's listener.
    return {"listen": {"http": f"127.0.0.1:{free_port()}", "grpc": f"127.0.0.1:{free_port()}",
                       "admin": f"127.0.0.1:{free_port()}"},
            "upstream": {"slots": 4},  # the fake's: lines run side by side
            "batches": {"dir": str(workdir / "batches"), **batches}}


def _line(custom_id: str, content: str = "hi", *, model: str = "model-a", url: str = "/v1/chat/completions",
          method: str = "POST") -> dict[str, Any]:
    return {"custom_id": custom_id, "method": method, "url": url,
            "body": {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": content}]}}


def _jsonl(lines: list[Any]) -> bytes:
    return b"".join((line if isinstance(line, bytes) else json.dumps(line).encode()) + b"\n" for line in lines)


def _client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=30)


def _upload(client: openai.OpenAI, lines: list[Any]) -> str:
    return client.files.create(file=("input.jsonl", _jsonl(lines)), purpose="batch").id


def _finished(client: openai.OpenAI, batch_id: str, status: str = "completed") -> Any:
    def ended() -> Any:
        batch = client.batches.retrieve(batch_id)
        return batch if batch.status in ("completed", "failed", "expired", "cancelled") else None
    batch = wait_for(ended, what=f"batch {batch_id} to end")
    assert batch.status == status, batch
    return batch


def _records(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def test_the_sdk_uploads_creates_polls_and_downloads(tmp_path: pathlib.Path) -> None:
    fake = FakeLlamaServer(router=True)
    with running_stack(tmp_path, _config(tmp_path), fake=fake) as stack:
        client = _client(stack)
        lines = [_line(f"request-{n}", f"question {n}", model="model-a" if n % 2 else "model-b") for n in range(12)]
        file_id = _upload(client, lines)
        assert client.files.retrieve(file_id).bytes == len(_jsonl(lines))
        created = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                        completion_window="24h", metadata={"team": "search"})
        assert created.status in ("validating", "in_progress")
        batch = _finished(client, created.id)
        assert batch.request_counts is not None
        assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (12, 12, 0)
        assert batch.metadata == {"team": "search"}
        assert batch.in_progress_at is not None and batch.completed_at is not None
        output = _records(client, batch.output_file_id)
        assert [record["custom_id"] for record in output] == [f"request-{n}" for n in range(12)]
        assert all(record["response"]["status_code"] == 200 and record["error"] is None for record in output)
        assert batch.error_file_id is None
        # Each line went through Envoy and the queue at the batch priority, as its own request.
        activity = {record["request_id"]: record for record in get_json(f"{stack.sidecar.admin_url}/activity")
                    ["activity"]}
        for record in output:
            scheduled = activity[record["response"]["request_id"]]
            assert record["response"]["request_id"] == f"{batch.id}:{record['custom_id']}"
            assert (scheduled["serial_priority"], scheduled["serial_band"]) == (-100, "batch")
        prompts = [json.loads(body)["messages"][0]["content"] for body in fake.bodies]
        assert sorted(prompts) == sorted(f"question {n}" for n in range(12))
        listed = client.batches.list(limit=5)
        assert [item.id for item in listed.data] == [batch.id]
        samples = metric_samples(http_get(f"{stack.sidecar.admin_url}/metrics")[1].decode())
        assert samples['llamaswap_batch_requests_total{outcome="completed"}'] == 12
        assert samples['llamaswap_batches{status="completed"}'] == 1
        client.close()


def test_a_batch_in_flight_never_holds_more_than_in_flight_lines(tmp_path: pathlib.Path) -> None:
    fake = FakeLlamaServer(router=True)
    markers = [f"held-{n};".encode() for n in range(10)]
    for marker in markers:
        fake.hold_marked(marker)
    with running_stack(tmp_path, _config(tmp_path, inFlight=3), fake=fake) as stack:
        client = _client(stack)
        batch = client.batches.create(input_file_id=_upload(client, [_line(f"r{n}", markers[n].decode())
                                                                     for n in range(10)]),
                                      endpoint="/v1/chat/completions", completion_window="24h")
        # The lines are let go one at a time, so the feeder fills its places ten times over; the
        # upstream (four slots: a fourth line would run) counts the most it computes at once.
        # The sidecar hears of a line's end through Envoy's access log, a moment after the upstream
        # has answered, so its queue and the batch's count are polled until they agree; every read
        # on the way must still be within inFlight.
        seen_in_queue: list[int] = []

        def lines_in_queue() -> int:
            queue = stack.sidecar.queue()
            count = sum(1 for row in queue["running_all"] + queue["waiting"] if row["request_id"].startswith(batch.id))
            seen_in_queue.append(count)
            return count

        for n in range(10):
            expected = min(3, 10 - n)
            wait_for(lambda: fake.active == expected and len(fake.bodies) == n + expected,  # noqa: B023
                     what=f"lines {n} to {n + expected - 1} at the upstream")
            wait_for(lambda: lines_in_queue() == expected,  # noqa: B023
                     what=f"{expected} line(s) of the batch in the sidecar's queue")
            wait_for(lambda: client.batches.retrieve(batch.id).model_extra["llamaswap"]["in_flight"] == expected,  # type: ignore[index] # noqa: B023
                     what=f"the batch counting {expected} line(s) in flight")
            fake.release_marked(markers[n])
        assert max(seen_in_queue) == 3
        _finished(client, batch.id)
        assert len(fake.bodies) == 10
        # Counted at every arrival, under the fake's lock: never more than inFlight at any moment.
        assert fake.max_active == 3
        client.close()


def test_a_sidecar_killed_mid_batch_resumes_and_writes_each_line_once(tmp_path: pathlib.Path) -> None:
    fake = FakeLlamaServer(router=True)
    fake.gate_marker = GATE.encode()
    config = _config(tmp_path, inFlight=4)
    with running_stack(tmp_path, config, fake=fake) as stack:
        client = _client(stack)
        lines = [_line(f"line-{n}", f"{GATE} {n}" if n >= 8 else f"quick {n}") for n in range(16)]
        batch = client.batches.create(input_file_id=_upload(client, lines), endpoint="/v1/chat/completions",
                                      completion_window="24h")
        # Eight lines answered, four held at the upstream: kill the sidecar there.
        wait_for(lambda: client.batches.retrieve(batch.id).request_counts.completed == 8  # type: ignore[union-attr]
                 and sum(GATE.encode() in body for body in fake.bodies) == 4, what="eight done and four running")
        stack.sidecar.signal(signal.SIGKILL)
        stack.sidecar.popen.wait(timeout=30)
        before = len(fake.bodies)
        stack.sidecar = SidecarProcess(stack.config_path, tmp_path, name="sidecar-again")
        # The kill landed mid-batch: the restarted sidecar finds eight results kept (every line
        # left is held at the gate, so none can end before this is read).
        resumed = client.batches.retrieve(batch.id)
        assert resumed.status == "in_progress" and resumed.request_counts is not None
        assert (resumed.request_counts.completed, resumed.request_counts.failed) == (8, 0)
        fake.open_gate()
        done = _finished(client, batch.id)
        assert done.request_counts is not None and done.request_counts.completed == 16
        output = _records(client, done.output_file_id)
        assert sorted(record["custom_id"] for record in output) == sorted(f"line-{n}" for n in range(16))
        assert _records(client, done.error_file_id) == []
        # The lines running at the kill were sent again: the upstream saw them twice, the file once.
        sent = collections.Counter(json.loads(body)["messages"][0]["content"] for body in fake.bodies)
        assert before == 12
        assert {content for content, count in sent.items() if count == 2} == {f"{GATE} {n}" for n in range(8, 12)}
        assert max(sent.values()) == 2
        client.close()


def test_cancel_stops_sending_and_ends_every_line_once(tmp_path: pathlib.Path) -> None:
    fake = FakeLlamaServer(router=True)
    fake.gate_marker = GATE.encode()
    with running_stack(tmp_path, _config(tmp_path, inFlight=2), fake=fake) as stack:
        client = _client(stack)
        lines = [_line("first", "quick")] + [_line(f"held-{n}", GATE) for n in range(9)]
        batch = client.batches.create(input_file_id=_upload(client, lines), endpoint="/v1/chat/completions",
                                      completion_window="24h")
        wait_for(lambda: sum(GATE.encode() in body for body in fake.bodies) == 2, what="two held lines")
        assert client.batches.cancel(batch.id).status in ("cancelling", "cancelled")
        done = _finished(client, batch.id, "cancelled")
        assert done.cancelling_at is not None and done.cancelled_at is not None
        assert done.request_counts is not None
        assert (done.request_counts.completed, done.request_counts.failed) == (1, 9)
        assert [record["custom_id"] for record in _records(client, done.output_file_id)] == ["first"]
        errors = _records(client, done.error_file_id)
        assert [record["custom_id"] for record in errors] == [f"held-{n}" for n in range(9)]
        assert {record["error"]["code"] for record in errors} == {"batch_cancelled"}
        # Nothing was sent after the cancel, and the abandoned lines left the queue.
        assert sum(GATE.encode() in body for body in fake.bodies) == 2
        wait_for(lambda: not any(row["request_id"].startswith(batch.id) for row in
                                 stack.sidecar.queue()["running_all"] + stack.sidecar.queue()["waiting"]),
                 what="the cancelled lines gone from the queue")
        fake.open_gate()
        with pytest.raises(openai.ConflictError):
            client.batches.cancel(_finished(client, client.batches.create(
                input_file_id=_upload(client, [_line("again")]), endpoint="/v1/chat/completions",
                completion_window="24h").id).id)
        client.close()


def test_a_bad_file_fails_its_batch_naming_each_line(tmp_path: pathlib.Path) -> None:
    with running_stack(tmp_path, _config(tmp_path), fake=FakeLlamaServer(router=True)) as stack:
        client = _client(stack)
        lines: list[Any] = [
            _line("good"),
            b"{not json",
            {k: v for k, v in _line("x").items() if k != "custom_id"},
            _line("good"),
            _line("elsewhere", url="/v1/embeddings"),
            _line("get", method="GET"),
            _line("unknown", model="no-such-model"),
        ]
        batch = client.batches.create(input_file_id=_upload(client, lines), endpoint="/v1/chat/completions",
                                      completion_window="24h")
        failed = _finished(client, batch.id, "failed")
        assert failed.errors is not None and failed.errors.data is not None
        found = [(error.line, error.code) for error in failed.errors.data]
        assert found == [(2, "invalid_json_line"), (3, "missing_required_parameter"), (4, "duplicate_custom_id"),
                         (5, "invalid_url"), (6, "invalid_method"), (7, "model_not_found")]
        assert failed.output_file_id is None and failed.failed_at is not None
        # Requests that cannot make a batch are refused at once, in the OpenAI error shape.
        with pytest.raises(openai.BadRequestError) as refused:
            client.batches.create(input_file_id=batch.input_file_id, endpoint="/v1/responses",  # type: ignore[arg-type]
                                  completion_window="24h")
        assert refused.value.code == "invalid_endpoint"
        with pytest.raises(openai.NotFoundError):
            client.batches.create(input_file_id="file-none", endpoint="/v1/chat/completions",
                                  completion_window="24h")
        with pytest.raises(openai.BadRequestError) as refused:
            client.batches.create(input_file_id=batch.input_file_id, endpoint="/v1/chat/completions",
                                  completion_window="24h", metadata={"priority": "urgent"})
        assert refused.value.code == "invalid_priority"
        client.close()


def test_a_file_over_the_line_limit_is_refused_and_nothing_kept(tmp_path: pathlib.Path) -> None:
    with running_stack(tmp_path, _config(tmp_path), fake=FakeLlamaServer(router=True)) as stack:
        client = _client(stack)
        line = json.dumps(_line("{}")).replace('"{}"', '"r%d"')
        data = "".join(line % n + "\n" for n in range(50_001)).encode()
        with pytest.raises(openai.BadRequestError) as refused:
            client.files.create(file=("big.jsonl", data), purpose="batch")
        assert refused.value.code == "too_many_requests"
        assert "50001" in str(refused.value) and "batches.maxRequests" in str(refused.value)
        assert client.files.list().data == []
        assert [path.name for path in (tmp_path / "batches" / "files").iterdir()] == []
        # One line fewer is taken.
        kept = client.files.create(file=("fits.jsonl", data[:data.rindex(b"\n", 0, len(data) - 1) + 1]),
                                   purpose="batch")
        assert [item.id for item in client.files.list().data] == [kept.id]
        client.close()


def test_interactive_requests_go_ahead_of_waiting_batch_lines(tmp_path: pathlib.Path) -> None:
    fake = FakeLlamaServer(router=True)
    fake.gate_marker = GATE.encode()
    config = _config(tmp_path, inFlight=2)
    config["upstream"] = {"slots": 1}
    with running_stack(tmp_path, config, fake=fake) as stack:
        client = _client(stack)
        batch = client.batches.create(input_file_id=_upload(client, [_line(f"b{n}", f"{GATE} b{n}") for n in range(3)]),
                                      endpoint="/v1/chat/completions", completion_window="24h")
        # One line runs (held), one waits; an interactive request arrives behind both.
        wait_for(lambda: len(fake.bodies) == 1 and len(stack.sidecar.queue()["waiting"]) == 1, what="b0 runs, b1 waits")
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            chat = pool.submit(lambda: openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0,
                                                     default_headers={"x-llamaswap-priority": "interactive"})
                               .chat.completions.create(model="model-a", messages=[{"role": "user", "content": "now"}]))
            wait_for(lambda: len(stack.sidecar.queue()["waiting"]) == 2, what="the interactive request waiting")
            assert [row["band"] for row in stack.sidecar.queue()["waiting"]] == ["interactive", "batch"]
            fake.open_gate()
            chat.result(timeout=30)
        _finished(client, batch.id)
        # The line that ran first and the one that waited are whichever reached the queue first.
        order = [json.loads(body)["messages"][0]["content"] for body in fake.bodies]
        assert order[1] == "now" and sorted(order[:1] + order[2:]) == [f"{GATE} b{n}" for n in range(3)]
        client.close()


def test_envoy_killed_mid_batch_and_started_again_loses_and_doubles_nothing(tmp_path: pathlib.Path) -> None:
    fake = FakeLlamaServer(router=True)
    fake.gate_marker = GATE.encode()
    with running_stack(tmp_path, _config(tmp_path, inFlight=3), fake=fake) as stack:
        client = _client(stack)
        lines = [_line(f"e{n}", f"{GATE} {n}" if n >= 4 else f"quick {n}") for n in range(10)]
        batch = client.batches.create(input_file_id=_upload(client, lines), endpoint="/v1/chat/completions",
                                      completion_window="24h")
        # Mid-batch: four lines answered, three held at the upstream, three not sent.
        wait_for(lambda: sum(GATE.encode() in body for body in fake.bodies) == 3
                 and client.batches.retrieve(batch.id).request_counts.completed == 4,  # type: ignore[union-attr]
                 what="four lines done and three held upstream")
        client.close()
        bootstrap = stack.envoy.config_path.read_text()
        stack.envoy.signal(signal.SIGKILL)
        stack.envoy.popen.wait(timeout=30)
        fake.open_gate()
        stack.envoy = EnvoyProcess(yaml.safe_load(bootstrap), tmp_path, name="envoy-again")
        client = _client(stack)
        done = _finished(client, batch.id)
        custom_ids = sorted(r["custom_id"] for r in _records(client, done.output_file_id))
        assert custom_ids == sorted(f"e{n}" for n in range(10))
        assert _records(client, done.error_file_id) == []
        # The three whose answers the kill cut were sent again; the others went once.
        sent = collections.Counter(json.loads(body)["messages"][0]["content"] for body in fake.bodies)
        assert {content for content, count in sent.items() if count > 1} == {f"{GATE} {n}" for n in range(4, 7)}
        assert sorted(sent) == sorted(line["body"]["messages"][0]["content"] for line in lines)
        client.close()


def test_llamaswap_up_killed_mid_batch_resumes_when_started_again(tmp_path: pathlib.Path) -> None:
    from test_up import Up

    ports = {key: free_port() for key in ("http", "grpc", "admin", "upstream")}
    # The upstream is this test's (its gate holds lines): `up` starts none, and finds it at upstream.url.
    fake = FakeLlamaServer(ports["upstream"])
    fake.gate_marker = GATE.encode()
    fake.started()
    extra = {"batches": {"dir": str(tmp_path / "batches"), "inFlight": 1}}
    stand_in = {"command": None}
    up = Up(tmp_path, ports=ports, extra=extra, upstream=stand_in)
    try:
        up.wait_up()
        client = openai.OpenAI(base_url=f"{up.url}/v1", api_key="unused", max_retries=0, timeout=30)
        lines = [_line(f"u{n}", f"{GATE} {n}" if n >= 5 else f"quick {n}") for n in range(12)]
        batch = client.batches.create(input_file_id=_upload(client, lines), endpoint="/v1/chat/completions",
                                      completion_window="24h")
        wait_for(lambda: client.batches.retrieve(batch.id).request_counts.completed == 5  # type: ignore[union-attr]
                 and fake.marked_count(GATE.encode()) == 1, what="five lines done and the sixth held")
        up.process.kill()  # SIGKILL: Envoy and the sidecar in it end with it
        up.process.wait(30)
        client.close()
        up.stop()
        up = Up(tmp_path, "up-again", ports=ports, extra=extra, upstream=stand_in)
        up.wait_up()
        client = openai.OpenAI(base_url=f"{up.url}/v1", api_key="unused", max_retries=0, timeout=30)
        # Resumed, not begun again: five results kept (the lines left wait at the gate).
        resumed = client.batches.retrieve(batch.id)
        assert resumed.request_counts is not None and resumed.request_counts.completed == 5
        fake.open_gate()
        done = _finished(client, batch.id)
        output = _records(client, done.output_file_id)
        assert sorted(record["custom_id"] for record in output) == sorted(f"u{n}" for n in range(12))
        assert done.request_counts is not None and done.request_counts.completed == 12
        sent = collections.Counter(json.loads(body)["messages"][0]["content"] for body in fake.bodies)
        assert {content for content, count in sent.items() if count > 1} == {f"{GATE} 5"}
        client.close()
    finally:
        up.stop()
        fake.close()


def test_one_trace_per_batch_holds_each_line_with_envoy_and_the_sidecar_under_it(tmp_path: pathlib.Path) -> None:
    from otlp import otlp_receiver
    from test_observability import CHECK_EGRESS, ENVOY_SERVICE, SIDECAR_SERVICE, sidecar_otlp_env

    with otlp_receiver() as receiver, running_stack(tmp_path, _config(tmp_path), otlp_endpoint=receiver.endpoint,
                                                    sidecar_env=sidecar_otlp_env(receiver.endpoint),
                                                    fake=FakeLlamaServer(router=True)) as stack:
        client = _client(stack)
        batch = client.batches.create(input_file_id=_upload(client, [_line(f"t{n}") for n in range(3)]),
                                      endpoint="/v1/chat/completions", completion_window="24h")
        _finished(client, batch.id)
        client.close()

        def whole_trace() -> list[Any] | None:
            roots = receiver.spans(name="llamaswap.batch")
            if not roots:
                return None
            spans = receiver.spans(trace_id=roots[0].trace_id)
            names = collections.Counter((span.service, span.name) for span in spans)
            # Envoy's ingress span ends (and is exported) after the response: wait for it too.
            wanted = [(SIDECAR_SERVICE, "llamaswap.batch.line"), (ENVOY_SERVICE, "ingress"),
                      (ENVOY_SERVICE, CHECK_EGRESS), (SIDECAR_SERVICE, "llamaswap.queue"),
                      (SIDECAR_SERVICE, "llamaswap.run")]
            return spans if all(names[key] >= 3 for key in wanted) else None

        spans = wait_for(whole_trace, what="the batch's trace with its lines, Envoy's and the sidecar's spans")
        by_id = {span.span_id: span for span in spans}
        [root] = [span for span in spans if span.name == "llamaswap.batch"]
        assert root.attributes["llamaswap.batch.id"] == batch.id and root.parent_span_id == ""
        lines = [span for span in spans if span.name == "llamaswap.batch.line"]
        assert {span.parent_span_id for span in lines} == {root.span_id}
        assert sorted(span.attributes["llamaswap.batch.custom_id"] for span in lines) == ["t0", "t1", "t2"]
        for run in (span for span in spans if span.name == "llamaswap.run"):
            # The sidecar's run span, under Envoy's Check, under Envoy's ingress, under one line.
            ancestor = by_id[run.parent_span_id]
            while ancestor.name != "llamaswap.batch.line":
                ancestor = by_id[ancestor.parent_span_id]
            custom_id = ancestor.attributes["llamaswap.batch.custom_id"]
            assert run.attributes["llamaswap.request_id"] == f"{batch.id}:{custom_id}"
