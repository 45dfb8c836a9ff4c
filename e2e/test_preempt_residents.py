"""Issue 46 with several models resident on one GPU, through the whole stack (real Envoy, the real
sidecar with its own feeder, the fake router with the token path, `maxLoaded: 2`): model-a (two
slots) and model-b (one) are resident with batch lines on every slot, and a person asks for
model-c, which can start only once one of them has gone. The rule drains the model whose going
stops the fewest lines (model-b's one line, though it ran longest), model-b is unloaded only after
its line let go, model-a's lines run on untouched, and every line's one answer is whole. A person
of model-a instead stops one of model-a's lines and evicts nothing.

The fake pauses its streams after a few tokens (`tokens.hold_after`) until the test releases them,
so where the stop lands is exact; it records which streams were still open at each unload asked (its
token path keeps no residency of its own: what llamaswap asks of the router tells)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import pathlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from aiohttp import web

from batches_e2e import batch_config, create, ended, records, sdk, upload
from client import chat
from fake_llama import FakeLlamaServer
from fake_tokens import TokenRoutes
from harness import Stack, activity_records, async_wait_for, get_json, running_stack
from preempt_e2e import check_answer, line, parts, prompt_of, stop_records, stopping_rows, waiting_line

MODELS = ("model-a", "model-b", "model-c")


class _Streams(TokenRoutes):
    """The token path, knowing each /completion stream's prompt length and whether it is still
    open (its handler not ended, its connection not gone)."""

    def __init__(self) -> None:
        super().__init__()
        self.streams: list[tuple[int, web.Request, list[bool]]] = []

    async def _completion(self, request: web.Request) -> web.StreamResponse:
        ended: list[bool] = []
        self.streams.append((len((await request.json())["prompt"]), request, ended))
        try:
            return await super()._completion(request)
        finally:
            ended.append(True)

    def open_streams(self) -> list[int]:
        """The prompt lengths of the streams still open now."""
        return sorted(length for length, request, ended in self.streams
                      if not ended and request.transport is not None and not request.transport.is_closing())


class _Router(FakeLlamaServer):
    """The router with `--models-max 2`, recording at each unload the streams still open."""

    tokens: _Streams

    def __init__(self) -> None:
        super().__init__(router=True, models=MODELS, models_max=2)
        self.tokens = _Streams()
        self.open_at_unload: list[tuple[str, list[int]]] = []

    async def _unload_request(self, request: web.Request) -> web.Response:
        model = (await request.json()).get("model")
        self.open_at_unload.append((model, self.tokens.open_streams()))
        return await super()._unload_request(request)


def _config(tmp_path: pathlib.Path) -> dict[str, Any]:
    config = batch_config(tmp_path, preempt=True, inFlight=4)
    config["upstream"] = {"maxLoaded": 2, "slots": 1}
    config["models"] = {"model-a": {"slots": 2}}
    return config


@dataclasses.dataclass
class _Busy:
    stack: Stack
    fake: _Router
    client: Any
    batch_b: str  # model-b's one line, `b`
    batch_a: str  # model-a's two lines
    contents_a: dict[str, str]

    @property
    def admin(self) -> str:
        return self.stack.sidecar.admin_url

    def line_id(self, custom_id: str) -> str:
        return f"{self.batch_b if custom_id == 'b' else self.batch_a}:{custom_id}"

    def answers(self, stops: dict[str, int]) -> None:
        """Each batch completed with each line's one whole answer, its stops as said (0 if not)."""
        for batch_id, contents, model in ((self.batch_b, {"b": "bravo"}, "model-b"),
                                          (self.batch_a, self.contents_a, "model-a")):
            finished = ended(self.client, batch_id, "completed")
            output = {record["custom_id"]: record for record in records(self.client, finished.output_file_id)}
            assert sorted(output) == sorted(contents)
            for custom_id, content in contents.items():
                check_answer(output[custom_id], content, model, stops=stops.get(custom_id, 0))
                assert [part["outcome"] for part in parts(self.admin, self.line_id(custom_id))] == (
                    ["stopped", "served"] if stops.get(custom_id) else ["served"])


@contextlib.asynccontextmanager
async def _every_slot_busy(tmp_path: pathlib.Path) -> AsyncIterator[_Busy]:
    """model-b's line first (it runs longest), then model-a's two: every slot busy, each paused
    mid-answer."""
    fake = _Router()
    with running_stack(tmp_path, _config(tmp_path), fake=fake) as stack:
        fake.tokens.hold_after = 5
        client = sdk(stack)
        batch_b = create(client, upload(client, [line("b", "bravo", "model-b")]))
        await async_wait_for(lambda: fake.tokens.held == 1, what="model-b's line paused mid-answer")
        contents_a = {"a1": "alpha one", "a2": "alpha two two"}
        batch_a = create(client, upload(client, [line(custom_id, content, "model-a")
                                                 for custom_id, content in contents_a.items()]))
        await async_wait_for(lambda: fake.tokens.held == 3, what="model-a's two lines paused mid-answer too")
        assert get_json(f"{stack.sidecar.admin_url}/queue")["gpus"][0]["resident_models"] == ["model-a", "model-b"]
        try:
            yield _Busy(stack, fake, client, batch_b.id, batch_a.id, contents_a)
        finally:
            fake.tokens.hold_after = None
            fake.tokens.release()
            client.close()


async def test_a_person_s_load_drains_the_resident_model_whose_going_stops_fewest_lines(
        tmp_path: pathlib.Path) -> None:
    async with _every_slot_busy(tmp_path) as busy, aiohttp.ClientSession() as session:
        fake, admin, line_b = busy.fake, busy.admin, busy.line_id("b")
        person = asyncio.create_task(chat(session, busy.stack.url, "person", priority="interactive",
                                          model="model-c", hold=True))
        await async_wait_for(lambda: stopping_rows(admin), what="a stop asked")
        [asked] = stopping_rows(admin)
        assert (asked["request_id"], asked["model"]) == (line_b, "model-b")
        # model-b's line reads its next token and lets go; model-a's pause there again.
        fake.tokens.hold_after = 6
        fake.tokens.release()
        row = await async_wait_for(lambda: waiting_line(admin, line_b), what="model-b's line waiting to resume")
        assert row["line"] == {"stops": 1, "tokens": 6, "stopping": False}
        [stop] = stop_records(admin)
        assert (stop["request_id"], stop["model"], stop["for_request_id"], stop["tokens_kept"]) == (
            line_b, "model-b", "person", 6)
        await async_wait_for(lambda: "person" in fake.order(), what="the person at the router")
        # model-b went, and only once its line had let go: model-a's two streams were open then.
        # (The token path's fake keeps no residency: the unloads asked are what tells.)
        await async_wait_for(lambda: fake.open_at_unload, what="model-b's unload")  # (the load waits for it)
        streams_a = sorted(len(prompt_of(content)) for content in busy.contents_a.values())
        assert fake.open_at_unload == [("model-b", streams_a)]
        assert fake.tokens.open_streams() == streams_a and len(stop_records(admin)) == 1  # model-a's run on
        fake.release("person")
        assert (await person).status == 200
        person_record = (await async_wait_for(lambda: activity_records(admin, {"person"}),
                                              what="the person's record"))["person"]
        assert person_record["outcome"] == "served"
        assert [evicted["model"] for evicted in person_record["evicted"]] == ["model-b"]
        fake.tokens.hold_after = None
        fake.tokens.release()
        await asyncio.to_thread(busy.answers, {"b": 1})
        assert len(stop_records(admin)) == 1
        # model-b came back for its line's resume in place of the idle model-c (model-a ran on).
        assert [model for model, _ in fake.open_at_unload] == ["model-b", "model-c"]


async def test_a_person_of_a_resident_model_stops_one_of_its_lines_and_evicts_nothing(
        tmp_path: pathlib.Path) -> None:
    async with _every_slot_busy(tmp_path) as busy, aiohttp.ClientSession() as session:
        fake, admin = busy.fake, busy.admin
        person = asyncio.create_task(chat(session, busy.stack.url, "person", priority="interactive",
                                          model="model-a", hold=True))
        await async_wait_for(lambda: stopping_rows(admin), what="a stop asked")
        [asked] = stopping_rows(admin)
        [stopped] = [custom_id for custom_id in busy.contents_a if asked["request_id"] == busy.line_id(custom_id)]
        assert asked["model"] == "model-a"
        fake.tokens.hold_after = 6
        fake.tokens.release()
        row = await async_wait_for(lambda: waiting_line(admin, asked["request_id"]),
                                   what="the stopped line waiting to resume")
        assert row["line"] == {"stops": 1, "tokens": 6, "stopping": False}
        [stop] = stop_records(admin)
        assert (stop["request_id"], stop["model"], stop["for_request_id"]) == (asked["request_id"], "model-a", "person")
        await async_wait_for(lambda: "person" in fake.order(), what="the person at the router")
        # A slot of model-a's was enough: model-b's line runs on and nothing was unloaded.
        assert fake.open_at_unload == [] and len(stop_records(admin)) == 1
        fake.release("person")
        assert (await person).status == 200
        fake.tokens.hold_after = None
        fake.tokens.release()
        await asyncio.to_thread(busy.answers, {stopped: 1})
        assert fake.open_at_unload == [] and len(stop_records(admin)) == 1
