"""Issue 46: a batch cancelled while its line is stopped and waiting to resume, or while its
resumed part streams, through the whole stack (real Envoy, the real sidecar with its own feeder,
the fake router's token path, one slot). The line ends once, `batch_cancelled` in the error file;
a waiting resume leaves the queue without reaching the upstream, a streaming one is cut; the
person it was stopped for is served; and the node serves the next batch's line whole."""

from __future__ import annotations

import asyncio
import pathlib

from batches_e2e import create, ended, records, upload
from harness import async_wait_for, get_json
from preempt_e2e import CONTENT, MAX_TOKENS, Stopping, check_answer, line, prompt_of, resume_paused, stop_kept, stopping

PROMPT = prompt_of(CONTENT)


def _cancelled_once(state: Stopping) -> None:
    state.client.batches.cancel(state.batch_id)
    finished = ended(state.client, state.batch_id, "cancelled")
    assert records(state.client, finished.output_file_id) == []
    [record] = records(state.client, finished.error_file_id)
    assert (record["custom_id"], record["error"]["code"]) == ("line", "batch_cancelled")


def _next_batch_whole(state: Stopping) -> None:
    """A line of a new batch runs to its whole answer, never stopped."""
    batch = create(state.client, upload(state.client, [line("next", "bravo")]))
    finished = ended(state.client, batch.id, "completed")
    [record] = records(state.client, finished.output_file_id)
    check_answer(record, "bravo", "model-a", stops=0)


async def test_a_cancel_while_a_stopped_line_waits_to_resume_ends_it_once(tmp_path: pathlib.Path) -> None:
    async with stopping(tmp_path) as state:
        await stop_kept(state)  # the line waits behind the person, 6 tokens kept
        await asyncio.to_thread(_cancelled_once, state)
        await async_wait_for(lambda: not [row for row in get_json(f"{state.stack.sidecar.admin_url}/queue")["waiting"]
                                          if row["request_id"] == state.line_id],
                             what="the line's resume out of the queue")
        state.fake.release("person")
        assert (await state.person).status == 200
        state.fake.tokens.hold_after = None
        state.fake.tokens.release()
        await asyncio.to_thread(_next_batch_whole, state)
        # The resume never reached the upstream: its first part and the next batch's line did.
        assert state.fake.tokens.completions == [(PROMPT, MAX_TOKENS), (prompt_of("bravo"), MAX_TOKENS)]


async def test_a_cancel_while_a_stopped_line_s_resume_streams_ends_it_once(tmp_path: pathlib.Path) -> None:
    async with stopping(tmp_path) as state:
        resumed = await resume_paused(state)
        await asyncio.to_thread(_cancelled_once, state)
        state.fake.tokens.hold_after = None
        state.fake.tokens.release()
        await asyncio.to_thread(_next_batch_whole, state)
        assert state.fake.tokens.completions == [(PROMPT, MAX_TOKENS), resumed, (prompt_of("bravo"), MAX_TOKENS)]
