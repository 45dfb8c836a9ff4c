"""Issue 46 on a node of two GPUs, through the whole stack (real Envoy, the real sidecar with its
own feeder, two fake routers with the token path as `upstreams:` gpu0 and gpu1, one slot each):
batch lines run on both GPUs, and a person's request that can start nowhere stops a line on
exactly one GPU, the one where the person then runs; the stopped line resumes to its
undisturbed answer and the other line runs on untouched.

Each fake pauses its streams after a few tokens (`tokens.hold_after`) until the test releases
them, so where a stop lands is exact; nothing waits on a timer."""

from __future__ import annotations

import asyncio
import pathlib
from typing import Any

import aiohttp

from batches_e2e import batch_config, create, ended, records, sdk, upload
from client import chat
from fake_llama import FakeLlamaServer
from fake_tokens import generate
from gpu_stack import Node, running_node
from harness import activity_records, async_wait_for
from preempt_e2e import MAX_TOKENS, check_answer, line, parts, prompt_of, stop_records, stopping_rows, waiting_line
from test_gpus import two_fakes


def _config(tmp_path: pathlib.Path) -> dict[str, Any]:
    config = batch_config(tmp_path, preempt=True)
    del config["upstream"]  # each entry of `upstreams:` says its slots
    return config


def _entries(gpu0: FakeLlamaServer, gpu1: FakeLlamaServer,
             models: tuple[list[str], list[str]] | None = None) -> list[dict[str, Any]]:
    out = []
    for index, fake in enumerate((gpu0, gpu1)):
        entry: dict[str, Any] = {"name": f"gpu{index}", "url": fake.url, "slots": 1}
        if models is not None:
            entry["models"] = models[index]
        out.append(entry)
    return out


def _line_on(fakes: dict[str, FakeLlamaServer], content: str) -> str:
    """The GPU whose fake streams the line of ``content`` (its first part)."""
    prompt = prompt_of(content)
    [name] = [name for name, fake in fakes.items() if any(sent == prompt for sent, _ in fake.tokens.completions)]
    return name


async def _stop_and_resume(node: Node, fakes: dict[str, FakeLlamaServer], batch_id: str, person_model: str,
                           contents: dict[str, str], where: str | None) -> tuple[str, str]:
    """Both lines paused at their 5th token, one on each GPU: a person's request of ``person_model``
    stops one of them; the stopped line resumes once the person has run. The GPU of the stop and
    the stopped line's custom_id."""
    admin = node.sidecar.admin_url
    async with aiohttp.ClientSession() as session:
        person = asyncio.create_task(chat(session, node.url, "person", priority="interactive", model=person_model,
                                          hold=True))
        await async_wait_for(lambda: stopping_rows(admin), what="a line's stop asked")
        [asked] = stopping_rows(admin)
        gpu = asked["upstream"]
        assert where is None or gpu == where, asked
        [stopped] = [custom_id for custom_id in contents if asked["request_id"] == f"{batch_id}:{custom_id}"]
        assert _line_on(fakes, contents[stopped]) == gpu  # the line stopped is the one that ran there
        assert stop_records(admin) == []  # (asked, not yet taken)
        # Its next token comes, and the feeder hangs up after it (the stream pauses there again).
        fakes[gpu].tokens.hold_after = 6
        fakes[gpu].tokens.release()
        row = await async_wait_for(lambda: waiting_line(admin, f"{batch_id}:{stopped}"),
                                   what="the stopped line waiting to resume")
        assert row["line"] == {"stops": 1, "tokens": 6, "stopping": False}
        [stop] = stop_records(admin)
        assert (stop["request_id"], stop["upstream"], stop["for_request_id"], stop["serial_band"], stop["for_band"],
                stop["tokens_kept"]) == (asked["request_id"], gpu, "person", "batch", "interactive", 6)
        # The person runs where the line let go, the other GPU's line still paused mid-answer.
        await async_wait_for(lambda: "person" in fakes[gpu].order(), what="the person at the stopped line's GPU")
        other = next(name for name in fakes if name != gpu)
        assert "person" not in fakes[other].order() and fakes[other].tokens.held == 1
        assert len(stop_records(admin)) == 1  # one stop, on one GPU
        fakes[gpu].release("person")
        reply = await person
        assert reply.status == 200
        person_record = (await async_wait_for(lambda: activity_records(admin, {"person"}),
                                              what="the person's record"))["person"]
        assert person_record["upstream"] == gpu and person_record["outcome"] == "served"
    for fake in fakes.values():
        fake.tokens.hold_after = None
        fake.tokens.release()
    return gpu, stopped


async def _two_lines_and_a_person(tmp_path: pathlib.Path, person_model: str,
                                  models: tuple[list[str], list[str]] | None = None, where: str | None = None) -> None:
    """A line on each GPU, a person of ``person_model``: one line stopped (on ``where``, if said)
    and resumed, each answer whole and once."""
    contents = {"first": "alpha", "second": "bravo"}
    with two_fakes() as (gpu0, gpu1), running_node(tmp_path, _entries(gpu0, gpu1, models), _config(tmp_path)) as node:
        fakes = {"gpu0": gpu0, "gpu1": gpu1}
        for fake in fakes.values():
            fake.tokens.hold_after = 5
        client = sdk(node)  # type: ignore[arg-type]
        batch = create(client, upload(client, [line(custom_id, content) for custom_id, content in contents.items()]))
        await async_wait_for(lambda: gpu0.tokens.held == 1 and gpu1.tokens.held == 1,
                             what="a line paused mid-answer on each GPU")
        gpu, stopped = await _stop_and_resume(node, fakes, batch.id, person_model, contents, where)
        finished = await asyncio.to_thread(ended, client, batch.id, "completed")
        output = {record["custom_id"]: record for record in await asyncio.to_thread(records, client,
                                                                                    finished.output_file_id)}
        assert sorted(output) == sorted(contents)
        for custom_id, content in contents.items():
            check_answer(output[custom_id], content, "model-a", stops=int(custom_id == stopped))
        # The stopped line's parts: stopped on its GPU, then resumed on the prompt and its 6 kept tokens.
        line_parts = parts(node.sidecar.admin_url, f"{batch.id}:{stopped}")
        assert [(part["outcome"], part["max_tokens"]) for part in line_parts] == [
            ("stopped", MAX_TOKENS), ("served", MAX_TOKENS - 6)]
        assert line_parts[0]["upstream"] == gpu
        # The other GPU's line ran once, its stream never cut; the one stream cut is the stop's.
        stopped_prompt = prompt_of(contents[stopped])
        other_prompt = prompt_of(contents[next(custom_id for custom_id in contents if custom_id != stopped)])
        sent = [part for fake in fakes.values() for part in fake.tokens.completions]
        assert [part for part in sent if part[0] == other_prompt] == [(other_prompt, MAX_TOKENS)]
        assert [prompt for fake in fakes.values() for prompt, _ in fake.tokens.left] == [len(stopped_prompt)]
        assert (stopped_prompt + generate(stopped_prompt, 6), MAX_TOKENS - 6) in sent  # resumed on its 6 kept tokens
        client.close()


async def test_a_person_stops_one_line_on_the_gpu_where_it_then_runs(tmp_path: pathlib.Path) -> None:
    await _two_lines_and_a_person(tmp_path, "model-a")


async def test_a_person_whose_model_one_gpu_serves_stops_the_line_there_and_not_the_other(
        tmp_path: pathlib.Path) -> None:
    # gpu1 may not serve model-b: the person loads it on gpu0, where its line must let go.
    await _two_lines_and_a_person(tmp_path, "model-b", (["model-a", "model-b"], ["model-a"]), where="gpu0")
