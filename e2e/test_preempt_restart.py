"""Issue 46 on an upstream without llama-server's token path (vLLM, SGLang and others answer
/apply-template with 404): a stoppable chat line is sent as it is, a person's chat that can start
nowhere stops it (its request closed at once), and it is sent again from its beginning, taking
back its place behind the person. Real Envoy and sidecar; the fake upstream without its token
routes holds the line (by its body) so that where the stop lands is made, not timed."""

from __future__ import annotations

import asyncio
import pathlib

import aiohttp

from batches_e2e import batch_config, create, ended, records, sdk, upload
from client import chat
from fake_llama import FakeLlamaServer
from harness import async_wait_for, get_json, running_stack
from preempt_e2e import line, stop_asked, stop_records

MARKER = b"restart me"


async def test_a_stopped_line_the_upstream_cannot_continue_is_sent_again_from_its_beginning(
        tmp_path: pathlib.Path) -> None:
    fake = FakeLlamaServer(router=True, token_path=False)
    config = batch_config(tmp_path, preempt=True)
    config["upstream"] = {"slots": 1}
    with running_stack(tmp_path, config, fake=fake) as stack:
        fake.hold_marked(MARKER)
        client = sdk(stack)
        batch = create(client, upload(client, [line("line", MARKER.decode())]))
        line_id = f"{batch.id}:line"
        await async_wait_for(lambda: fake.marked_count(MARKER) == 1, what="the line sent as it is, running")
        async with aiohttp.ClientSession() as session:
            person = asyncio.create_task(chat(session, stack.url, "person", priority="interactive", hold=True))
            await async_wait_for(lambda: stop_asked(stack.sidecar.admin_url, line_id) or
                                 bool(stop_records(stack.sidecar.admin_url)), what="the line's stop asked")
            # Closed at once (nothing to keep from it): the stop is taken, with no token kept.
            [stop] = await async_wait_for(lambda: stop_records(stack.sidecar.admin_url), what="the stop taken")
            assert (stop["request_id"], stop["for_request_id"], stop["tokens_kept"]) == (line_id, "person", 0)
            waiting = await async_wait_for(
                lambda: [row for row in get_json(f"{stack.sidecar.admin_url}/queue")["waiting"]
                         if row["request_id"] == line_id], what="the line sent again, waiting")
            assert waiting[0]["line"] == {"stops": 1, "tokens": 0, "stopping": False}
            fake.release_marked(MARKER)  # the abandoned send computes to its end: the settle sees it
            await async_wait_for(lambda: "person" in fake.order(), what="the person running where the line was")
            fake.release("person")
            assert (await person).status == 200
        finished = await asyncio.to_thread(ended, client, batch.id, "completed")
        [record] = await asyncio.to_thread(records, client, finished.output_file_id)
        body = record["response"]["body"]
        assert record["response"]["status_code"] == 200 and body["llamaswap"] == {"stops": 1}
        assert body["choices"][0]["message"]["content"] == "ok"
        assert fake.marked_count(MARKER) == 2  # sent twice, whole: the upstream has no token path
        # Each send: its /apply-template answered 404 (not llama-server), then the line as it is.
        sent = [r for r in get_json(f"{stack.sidecar.admin_url}/activity")["activity"]
                if r.get("request_id") == line_id and r.get("event") == "request"]
        assert [r["status"] for r in sent if not r["max_tokens"]] == [404]
        parts = [r for r in sent if r["max_tokens"]]
        assert [r["outcome"] for r in parts] == ["stopped", "served"]
        person_record = [r for r in get_json(f"{stack.sidecar.admin_url}/activity")["activity"]
                         if r.get("request_id") == "person" and r.get("event") == "request"]
        assert person_record[0]["granted_unix_ms"] < parts[1]["granted_unix_ms"]
