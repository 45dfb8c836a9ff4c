"""Issue 46 with several models resident on one GPU, through the whole stack (real Envoy, the real
sidecar with its own feeder, the fake router with the token path, `maxLoaded: 2`): model-a (two
slots) and model-b (one) are resident with batch lines on every slot, and a person asks for
model-c, which can start only once one of them has gone. The rule drains the model whose going
stops the fewest lines (model-b's one line, though it ran longest), model-b is unloaded only after
its line let go, model-a's lines run on untouched, and every line's one answer is whole.

The fake pauses its streams after a few tokens (`tokens.hold_after`) until the test releases them,
so where the stop lands is exact; it records which streams were still open at each unload asked (its
token path keeps no residency of its own: what llamaswap asks of the router tells)."""

from __future__ import annotations

import asyncio
import pathlib
from typing import Any

import aiohttp
from aiohttp import web

from batches_e2e import batch_config, create, ended, records, sdk, upload
from client import chat
from fake_llama import FakeLlamaServer
from fake_tokens import TokenRoutes
from harness import activity_records, async_wait_for, get_json, running_stack
from preempt_e2e import check_answer, line, parts, prompt_of, stop_records, waiting_line

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

    def __init__(self) -> None:
        super().__init__(router=True, models=MODELS, models_max=2)
        self.tokens = _Streams()
        self.open_at_unload: list[tuple[str, list[int]]] = []

    async def _unload_request(self, request: web.Request) -> web.Response:
        model = (await request.json()).get("model")
        assert isinstance(self.tokens, _Streams)
        self.open_at_unload.append((model, self.tokens.open_streams()))
        return await super()._unload_request(request)


def _config(tmp_path: pathlib.Path) -> dict[str, Any]:
    config = batch_config(tmp_path, preempt=True, inFlight=4)
    config["upstream"] = {"maxLoaded": 2, "slots": 1}
    config["models"] = {"model-a": {"slots": 2}}
    return config


async def test_a_person_s_load_drains_the_resident_model_whose_going_stops_fewest_lines(
        tmp_path: pathlib.Path) -> None:
    fake = _Router()
    with running_stack(tmp_path, _config(tmp_path), fake=fake) as stack:
        admin = stack.sidecar.admin_url
        fake.tokens.hold_after = 5
        client = sdk(stack)
        # model-b's line first (it runs longest), then model-a's two: every slot busy.
        batch_b = create(client, upload(client, [line("b", "bravo", "model-b")]))
        await async_wait_for(lambda: fake.tokens.held == 1, what="model-b's line paused mid-answer")
        contents_a = {"a1": "alpha one", "a2": "alpha two two"}
        batch_a = create(client, upload(client, [line(custom_id, content, "model-a")
                                                 for custom_id, content in contents_a.items()]))
        await async_wait_for(lambda: fake.tokens.held == 3, what="model-a's two lines paused mid-answer too")
        residents = get_json(f"{admin}/queue")["gpus"][0]["resident_models"]
        assert residents == ["model-a", "model-b"]
        line_b = f"{batch_b.id}:b"
        async with aiohttp.ClientSession() as session:
            person = asyncio.create_task(chat(session, stack.url, "person", priority="interactive",
                                              model="model-c", hold=True))
            await async_wait_for(lambda: stop_records(admin), what="a stop")
            [stop] = stop_records(admin)
            assert (stop["request_id"], stop["model"], stop["for_request_id"]) == (line_b, "model-b", "person")
            # model-b's line reads its next token and lets go; model-a's pause there again.
            fake.tokens.hold_after = 6
            fake.tokens.release()
            row = await async_wait_for(lambda: waiting_line(admin, line_b), what="model-b's line waiting to resume")
            assert row["line"] == {"stops": 1, "tokens": 6}
            await async_wait_for(lambda: "person" in fake.order(), what="the person at the router")
            # model-b went, and only once its line had let go: model-a's two streams were open then.
            # (The token path's fake keeps no residency: the unloads asked are what tells.)
            await async_wait_for(lambda: fake.open_at_unload, what="model-b's unload")  # (the load waits for it)
            streams_a = sorted(len(prompt_of(content)) for content in contents_a.values())
            assert fake.open_at_unload == [("model-b", streams_a)]
            assert fake.tokens.open_streams() == streams_a and len(stop_records(admin)) == 1  # model-a's run on
            fake.release("person")
            reply = await person
            assert reply.status == 200
        person_record = (await async_wait_for(lambda: activity_records(admin, {"person"}),
                                              what="the person's record"))["person"]
        assert person_record["outcome"] == "served"
        assert [evicted["model"] for evicted in person_record["evicted"]] == ["model-b"]
        fake.tokens.hold_after = None
        fake.tokens.release()
        finished_b = await asyncio.to_thread(ended, client, batch_b.id, "completed")
        finished_a = await asyncio.to_thread(ended, client, batch_a.id, "completed")
        [record_b] = await asyncio.to_thread(records, client, finished_b.output_file_id)
        check_answer(record_b, "bravo", "model-b", stops=1)
        output_a = {record["custom_id"]: record for record in await asyncio.to_thread(records, client,
                                                                                      finished_a.output_file_id)}
        assert sorted(output_a) == sorted(contents_a)
        for custom_id, content in contents_a.items():
            check_answer(output_a[custom_id], content, "model-a", stops=0)
            assert [part["outcome"] for part in parts(admin, f"{batch_a.id}:{custom_id}")] == ["served"]
        assert [part["outcome"] for part in parts(admin, line_b)] == ["stopped", "served"]
        assert len(stop_records(admin)) == 1
        # model-b came back for its line's resume in place of the idle model-c (model-a ran on).
        assert [model for model, _ in fake.open_at_unload] == ["model-b", "model-c"]
        client.close()
