"""Issue 46 through the whole stack: the sidecar's own feeder sends a batch's line by the token
path (`batches.preempt`), the scheduler stops it for a person's chat that can start nowhere (one
slot, the line's), the feeder resumes it once the person's request has run, and the line's one
answer is the undisturbed one. Real Envoy and sidecar; the fake router's token path
(e2e/fake_tokens.py) pauses the line's stream after a few tokens, so where the stop lands is exact;
while the person runs, GET /queue shows the line waiting with its progress."""

from __future__ import annotations

import asyncio
import pathlib
from typing import Any

import aiohttp

from batches_e2e import batch_config, create, ended, records, sdk, upload
from client import chat
from fake_llama import FakeLlamaServer
from fake_tokens import generate, prompt_text, text_of, tokenize
from preempt_e2e import stop_asked
from harness import activity_records, async_wait_for, get_json, http_get, metric_samples, running_stack

MODEL = "model-a"
MAX_TOKENS = 12
MESSAGES = [{"role": "user", "content": "alpha"}]


def _stops(admin_url: str) -> list[dict[str, Any]]:
    return get_json(f"{admin_url}/activity?event=stop")["activity"]


async def test_a_person_stops_a_running_batch_line_which_resumes_to_its_undisturbed_answer(
        tmp_path: pathlib.Path) -> None:
    fake = FakeLlamaServer(router=True)
    config = batch_config(tmp_path, preempt=True)
    config["upstream"] = {"slots": 1}
    with running_stack(tmp_path, config, fake=fake) as stack:
        fake.tokens.hold_after = 5
        client = sdk(stack)
        line = {"custom_id": "long", "method": "POST", "url": "/v1/chat/completions",
                "body": {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0, "messages": MESSAGES}}
        batch = create(client, upload(client, [line]))
        line_id = f"{batch.id}:long"
        await async_wait_for(lambda: fake.tokens.held == 1, what="the line's stream paused after 5 tokens")
        async with aiohttp.ClientSession() as session:
            # (Held at the upstream once it runs: the line, sent again, then waits behind it.)
            person = asyncio.create_task(chat(session, stack.url, "person", priority="interactive", model=MODEL,
                                              hold=True))
            await async_wait_for(lambda: stop_asked(stack.sidecar.admin_url, line_id), what="the line's stop asked")
            assert _stops(stack.sidecar.admin_url) == []  # (asked, not yet taken: its end may come first)
            # The next token comes, and the feeder hangs up after it; the stream pauses again
            # there, so the feeder's hang-up (a client that left, to Envoy) comes first.
            fake.tokens.hold_after = 6
            fake.tokens.release()
            # The line sent again waits with its progress (GET /queue's `line`): 1 stop, 6 tokens kept.
            waiting = await async_wait_for(
                lambda: [row for row in get_json(f"{stack.sidecar.admin_url}/queue")["waiting"]
                         if row["request_id"] == line_id], what="the stopped line waiting to resume")
            assert waiting[0]["line"] == {"stops": 1, "tokens": 6, "stopping": False}
            [stop] = _stops(stack.sidecar.admin_url)
            assert (stop["request_id"], stop["for_request_id"], stop["serial_band"], stop["for_band"],
                    stop["tokens_kept"]) == (line_id, "person", "batch", "interactive", 6)
            fake.release("person")
            reply = await person
            fake.tokens.hold_after = None
            fake.tokens.release()  # (the resumed part's 6 tokens: it may have paused at its 6th)
        assert reply.status == 200
        finished = await asyncio.to_thread(ended, client, batch.id, "completed")
        [record] = await asyncio.to_thread(records, client, finished.output_file_id)
        prompt = tokenize(prompt_text(MESSAGES))
        body = record["response"]["body"]
        assert body["choices"][0]["message"]["content"] == text_of(generate(prompt, MAX_TOKENS))
        assert body["usage"]["completion_tokens"] == MAX_TOKENS and body["llamaswap"] == {"stops": 1}
        # The stopped part ended `stopped`; the person ran before the line's resumed part.
        parts = [r for r in get_json(f"{stack.sidecar.admin_url}/activity")["activity"]
                 if r.get("request_id") == line_id and r.get("generation") is not None and r["max_tokens"]]
        assert [r["outcome"] for r in parts] == ["stopped", "served"] and all(r["batch_line"] for r in parts)
        person_record = (await asyncio.to_thread(activity_records, stack.sidecar.admin_url, {"person"}))["person"]
        assert person_record["granted_unix_ms"] < parts[1]["granted_unix_ms"]
        status, text = http_get(f"{stack.sidecar.admin_url}/metrics")
        assert status == 200
        assert metric_samples(text.decode())['llamaswap_preemptions_total{band="batch"}'] == 1.0
