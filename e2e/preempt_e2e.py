"""What the whole-stack stopping tests share (e2e/test_preempt_*.py, issue 46): a line of a
batch by the token path, the undisturbed answer it must come to (the fake's deterministic model,
e2e/fake_tokens.py), reading the sidecar's `stop` records and a line's parts, and a one-slot
stack where a person's request has just stopped a line (`stopping`)."""

from __future__ import annotations

import asyncio
import contextlib
import pathlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

from batches_e2e import batch_config, create, ended, records, sdk, upload
from client import Reply, chat
from fake_llama import FakeLlamaServer
from fake_tokens import generate, prompt_text, text_of, tokenize
from harness import Stack, async_wait_for, get_json, running_stack

MAX_TOKENS = 12
CONTENT = "alpha"  # the line of `stopping`


def messages(content: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": content}]


def line(custom_id: str, content: str, model: str = "model-a") -> dict[str, Any]:
    """A chat line that can be continued exactly (temperature 0, text only): it takes the token path."""
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model, "max_tokens": MAX_TOKENS, "temperature": 0, "messages": messages(content)}}


def prompt_of(content: str) -> list[int]:
    return tokenize(prompt_text(messages(content)))


def check_answer(record: dict[str, Any], content: str, model: str, stops: int) -> None:
    """The line's one record is the undisturbed run's whole answer, with its stops counted."""
    prompt = prompt_of(content)
    assert record["response"]["status_code"] == 200 and record["error"] is None, record
    body = record["response"]["body"]
    assert body["object"] == "chat.completion" and body["model"] == model
    assert body["choices"][0]["message"] == {"role": "assistant", "content": text_of(generate(prompt, MAX_TOKENS))}
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": MAX_TOKENS,
                             "total_tokens": len(prompt) + MAX_TOKENS}
    assert body["llamaswap"] == {"stops": stops}


def stop_records(admin_url: str) -> list[dict[str, Any]]:
    return get_json(f"{admin_url}/activity?event=stop")["activity"]


def parts(admin_url: str, request_id: str) -> list[dict[str, Any]]:
    """The request records of a line's generating parts (its /completion sends), oldest first."""
    return [record for record in get_json(f"{admin_url}/activity")["activity"]
            if record.get("request_id") == request_id and record.get("generation") and record.get("max_tokens")]


def stopping_rows(admin_url: str) -> list[dict[str, Any]]:
    """The running lines a stop was asked of that have not let go yet: their rows in GET /queue's
    running list say ``stopping`` (the `stop` record comes once one has let go)."""
    return [row for row in get_json(f"{admin_url}/queue")["running_all"]
            if (row.get("line") or {}).get("stopping") is True]


def stop_asked(admin_url: str, request_id: str) -> bool:
    return any(row["request_id"] == request_id for row in stopping_rows(admin_url))


def waiting_line(admin_url: str, request_id: str) -> dict[str, Any] | None:
    """The line's row in GET /queue's waiting list (a stopped line waiting to resume), if there."""
    rows = [row for row in get_json(f"{admin_url}/queue")["waiting"] if row["request_id"] == request_id]
    return rows[0] if rows else None


class Stopping:
    """A one-slot stack with one line of a batch paused mid-answer (at its 5th token unless said)
    and a person's held request that made the scheduler stop it (asked: the line's running row
    says ``stopping``; its `stop` record comes when the line lets go, `stop_kept`)."""

    def __init__(self, stack: Stack, fake: FakeLlamaServer, client: Any, batch_id: str,
                 person: asyncio.Task[Reply]) -> None:
        self.stack, self.fake, self.client, self.batch_id, self.person = stack, fake, client, batch_id, person
        self.line_id = f"{batch_id}:line"

    def output(self) -> dict[str, Any]:
        """The batch's one record, once it completed (its error file empty)."""
        finished = ended(self.client, self.batch_id, "completed")
        assert records(self.client, finished.error_file_id) == []
        [record] = records(self.client, finished.output_file_id)
        assert record["custom_id"] == "line"
        return record


@contextlib.asynccontextmanager
async def stopping(tmp_path: pathlib.Path, paused_at: int = 5) -> AsyncIterator[Stopping]:
    fake = FakeLlamaServer(router=True)
    config = batch_config(tmp_path, preempt=True)
    config["upstream"] = {"slots": 1}
    with running_stack(tmp_path, config, fake=fake) as stack:
        fake.tokens.hold_after = paused_at
        client = sdk(stack)
        batch = create(client, upload(client, [line("line", CONTENT)]))
        await async_wait_for(lambda: fake.tokens.held == 1, what="the line's stream paused mid-answer")
        async with aiohttp.ClientSession() as session:
            person = asyncio.create_task(chat(session, stack.url, "person", priority="interactive", hold=True))
            state = Stopping(stack, fake, client, batch.id, person)
            await async_wait_for(lambda: stop_asked(stack.sidecar.admin_url, state.line_id),
                                 what="the line's stop asked")
            assert stop_records(stack.sidecar.admin_url) == []  # (not yet taken: its end may come first)
            try:
                yield state
            finally:
                if fake._loop is not None:  # (not killed by the test)
                    fake.release("person")
                    fake.tokens.hold_after = None
                    fake.tokens.release()
                with contextlib.suppress(Exception):
                    await person
                client.close()


async def stop_kept(state: Stopping) -> None:
    """The stop takes effect: the line reads its 6th token and lets go, its progress kept."""
    state.fake.tokens.hold_after = 6
    state.fake.tokens.release()
    row = await async_wait_for(lambda: waiting_line(state.stack.sidecar.admin_url, state.line_id),
                               what="the stopped line waiting to resume")
    assert row["line"] == {"stops": 1, "tokens": 6, "stopping": False}
    [stop] = stop_records(state.stack.sidecar.admin_url)
    assert (stop["request_id"], stop["for_request_id"], stop["tokens_kept"]) == (state.line_id, "person", 6)
    await async_wait_for(lambda: "person" in state.fake.order(), what="the person running where the line let go")


async def resume_paused(state: Stopping) -> tuple[list[int], int]:
    """The stop takes effect (`stop_kept`), the person runs and ends, and the line's resume
    streams until it pauses after 3 of its 6 tokens left. The resume as the upstream was asked
    it: the prompt and the 6 kept tokens, and the tokens left."""
    await stop_kept(state)
    state.fake.tokens.hold_after = 3  # the resume pauses after 3 of its 6 tokens
    state.fake.tokens.release()  # (the stopped part's stream, paused at 6, learns it was left)
    state.fake.release("person")  # (only then may the resume start: one slot)
    assert (await state.person).status == 200
    prompt = prompt_of(CONTENT)
    resumed = (prompt + generate(prompt, 6), MAX_TOKENS - 6)
    await async_wait_for(lambda: resumed in state.fake.tokens.completions and state.fake.tokens.held == 1,
                         what="the resume paused after 3 tokens")
    return resumed
