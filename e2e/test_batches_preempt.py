"""A batch line stopped at a token and resumed (issue 46, the feeder's side), through the real Envoy
and sidecar to the fake upstream's token path (e2e/fake_tokens.py: a deterministic model, so the
undisturbed answer is known), and a cancel while a line is stopped. The feeder runs in the test's
process, on its own store, sending to the stack's listener, so that the test can call
`Feeder.stop_line` itself; the sidecar schedules each of its requests like any other.

A stream is paused by the fake after a given number of tokens (`hold_after`) until the test
releases it: where a stop lands is then exact, never a race with the generation."""

from __future__ import annotations

import json
import pathlib
from collections.abc import AsyncIterator
from typing import Any

import pytest

from batches_e2e import Feeding, batch_config
from fake_llama import FakeLlamaServer
from fake_tokens import generate
from harness import Stack, async_wait_for, get_json, running_stack
from preempt_e2e import MAX_TOKENS, check_answer, messages, prompt_of
from llamaswap.batches.lifecycle import BatchStatus

MODEL = "model-a"
Fed = tuple[FakeLlamaServer, Feeding, Stack]


@pytest.fixture
async def fed(tmp_path: pathlib.Path) -> AsyncIterator[Fed]:
    fake = FakeLlamaServer(router=True)
    config = batch_config(tmp_path)
    del config["batches"]  # the sidecar's own feeder stays off: this test's feeder sends the lines
    with running_stack(tmp_path, config, fake=fake) as stack:
        feeding = Feeding(stack.url, tmp_path / "batches")
        try:
            yield fake, feeding, stack
        finally:
            fake.tokens.hold_after = None
            fake.tokens.release()
            await feeding.stop()
            feeding.store.close()


def _line(content: str, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0, "messages": messages(content), **extra}


async def test_a_line_stopped_at_a_token_resumes_to_the_undisturbed_answer(
        fed: Fed) -> None:
    fake, feeding, stack = fed
    fake.tokens.hold_after = 5
    batch_id = feeding.batch([("stopped", _line("alpha"))])
    request_id = f"{batch_id}:stopped"
    feeding.start()
    await async_wait_for(lambda: fake.tokens.held == 1, what="the line's stream paused after 5 tokens")
    await async_wait_for(lambda: (state := feeding.feeder.line_state(request_id)) is not None and state.tokens == 5,
                         what="the feeder to have read the 5 tokens")
    state = feeding.feeder.line_state(request_id)
    assert state is not None and state.stops == 0 and state.stoppable
    assert feeding.feeder.stop_line(request_id)
    assert not feeding.feeder.stop_line(f"{batch_id}:nobody")
    fake.tokens.hold_after = None
    fake.tokens.release()  # the next token comes, and the feeder hangs up after it
    output = await feeding.output(batch_id)
    check_answer(output["stopped"], "alpha", MODEL, stops=1)
    prompt = prompt_of("alpha")
    kept = generate(prompt, 6)
    # The resume asked for the tokens left on the prompt and the 6 kept tokens; the first part's
    # client left; the prompt was templated and tokenized once.
    assert fake.tokens.completions == [(prompt, MAX_TOKENS), (prompt + kept, MAX_TOKENS - 6)]
    assert len(fake.tokens.templates) == len(fake.tokens.tokenized) == 1
    assert fake.tokens.templates[0] == {"model": MODEL, "messages": messages("alpha")}
    assert feeding.feeder.line_state(request_id) is None and feeding.store.progress(batch_id, 1) is None
    # Every part went through the queue as a request of the line's model, at the batch priority.
    records = [record for record in get_json(f"{stack.sidecar.admin_url}/activity")["activity"]
               if record.get("request_id") == request_id]
    assert {(record["model"], record["serial_priority"]) for record in records} == {(MODEL, -100)}
    # template and tokenize (no generation), then the two parts, each scheduled with its n_predict
    assert sorted((record["generation"], record["max_tokens"] or 0) for record in records) == [
        (False, 0), (False, 0), (True, MAX_TOKENS - 6), (True, MAX_TOKENS)]


async def test_the_lines_end_wins_over_a_stop_that_comes_with_it(fed: Fed) -> None:
    fake, feeding, _ = fed
    fake.tokens.hold_after = MAX_TOKENS  # every token sent, the stream's end not yet
    batch_id = feeding.batch([("ending", _line("beta"))])
    request_id = f"{batch_id}:ending"
    feeding.start()
    await async_wait_for(lambda: (state := feeding.feeder.line_state(request_id)) is not None
                         and state.tokens == MAX_TOKENS, what="the feeder to have read every token")
    assert feeding.feeder.stop_line(request_id)  # a part in flight: asked to stop at its next event
    fake.tokens.release()  # that event is the end: the end wins
    output = await feeding.output(batch_id)
    check_answer(output["ending"], "beta", MODEL, stops=0)
    assert len(fake.tokens.completions) == 1 and fake.tokens.left == []


async def test_a_restart_resumes_a_stopped_line_from_the_store(fed: Fed) -> None:
    fake, feeding, _ = fed
    fake.tokens.hold_after = 4
    batch_id = feeding.batch([("kept", _line("gamma"))])
    request_id = f"{batch_id}:kept"
    feeding.start()
    await async_wait_for(lambda: (state := feeding.feeder.line_state(request_id)) is not None and state.tokens == 4,
                         what="the feeder to have read 4 tokens")
    first_sent_at = feeding.feeder.line_state(request_id).first_sent_at  # type: ignore[union-attr]
    key = feeding.feeder.line_key(request_id)
    assert key is not None
    assert feeding.feeder.stop_line(request_id)
    fake.tokens.release()
    # The resume is held after 4 more tokens; the feeder is stopped then, as a kill would.
    await async_wait_for(lambda: len(fake.tokens.completions) == 2 and fake.tokens.held == 1,
                         what="the resumed part to pause")
    assert feeding.feeder.line_key(request_id) == key  # the resume's place is the stopped part's
    kept = feeding.store.progress_of_request(request_id)
    assert kept is not None and (len(kept.kept), kept.stops, kept.first_sent_at) == (5, 1, first_sent_at)
    fake.tokens.hold_after = None
    await feeding.restart()
    fake.tokens.release()
    output = await feeding.output(batch_id)
    check_answer(output["kept"], "gamma", MODEL, stops=1)
    prompt = prompt_of("gamma")
    # After the restart the line went on from its tokens: the 5 kept at the stop and the 4 its
    # resumed part had read when the feeder stopped; no new template or tokenize.
    assert fake.tokens.completions[-1] == (prompt + generate(prompt, 9), MAX_TOKENS - 9)
    assert len(fake.tokens.templates) == 1


async def test_lines_that_cannot_be_continued_are_sent_as_they_are_and_never_stopped(
        fed: Fed) -> None:
    fake, feeding, _ = fed
    marker = b"tool-line;"
    fake.hold_marked(marker)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    batch_id = feeding.batch([("tools", _line(marker.decode(), tools=tools))])
    feeding.start()
    await async_wait_for(lambda: fake.marked_count(marker) == 1, what="the tool line to reach the upstream")
    assert not feeding.feeder.stop_line(f"{batch_id}:tools")
    fake.release_marked(marker)
    output = await feeding.output(batch_id)
    assert output["tools"]["response"]["body"]["choices"][0]["message"]["content"] == "ok"  # the fake's chat answer
    assert fake.tokens.completions == [] and fake.tokens.templates == []


async def test_with_preempt_off_every_line_is_sent_as_it_is(fed: Fed) -> None:
    fake, feeding, _ = fed
    feeding.preempt = False
    batch_id = feeding.batch([("plain", _line("delta"))])
    feeding.start()
    output = await feeding.output(batch_id)
    assert output["plain"]["response"]["body"]["choices"][0]["message"]["content"] == "ok"
    assert "llamaswap" not in output["plain"]["response"]["body"]
    assert fake.tokens.completions == [] and fake.tokens.templates == []


async def test_a_cancel_while_a_line_is_stopped_ends_it_once_and_drops_its_progress(fed: Fed) -> None:
    fake, feeding, _ = fed
    fake.tokens.hold_after = 3
    batch_id = feeding.batch([("cancelled", _line("epsilon"))])
    request_id = f"{batch_id}:cancelled"
    feeding.start()
    await async_wait_for(lambda: (state := feeding.feeder.line_state(request_id)) is not None and state.tokens == 3,
                         what="the feeder to have read 3 tokens")
    assert feeding.feeder.stop_line(request_id)
    fake.tokens.release()
    await async_wait_for(lambda: len(fake.tokens.completions) == 2 and fake.tokens.held == 1,
                         what="the resumed part to pause")
    assert feeding.store.progress(batch_id, 1) is not None
    assert feeding.store.set_status(batch_id, BatchStatus.CANCELLING, only_from=(BatchStatus.IN_PROGRESS,))
    feeding.feeder.stop_feeding(batch_id)

    def ended() -> Any:
        batch = feeding.store.batch(batch_id)
        return batch if batch is not None and batch.status.ended else None
    batch = await async_wait_for(ended, what="the batch to end cancelled")
    assert batch.status is BatchStatus.CANCELLED and batch.output_file_id is None
    [record] = [json.loads(text) for text in feeding.store.file_path(batch.error_file_id).read_text().splitlines()]
    assert (record["custom_id"], record["error"]["code"]) == ("cancelled", "batch_cancelled")
    assert feeding.store.progress(batch_id, 1) is None and feeding.feeder.line_state(request_id) is None
