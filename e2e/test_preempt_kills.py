"""Issue 46: a part of the stack killed while a batch line is being stopped or resumed, through the
whole stack (real Envoy, the real sidecar with its own feeder, the fake router's token path, one
slot). Whatever dies, the batch finishes with one record per line, the line's answer whole (the
fake's model is deterministic: e2e/fake_tokens.py), nothing doubled:

- the sidecar SIGKILLed after a stop was kept: the next one resumes the line from the progress in
  its database (the prompt and kept tokens, no template or tokenize asked again);
- the sidecar SIGKILLed during a stop, before it took effect: nothing was kept, the line is sent
  again from its start;
- Envoy SIGKILLed during a stop: the line's stream breaks while its stop was asked: the tokens read
  are kept, counted as its stop, and it resumes once Envoy is back;
- the upstream killed (every connection reset, its port closed) during a stop: as for Envoy; while
  a stopped line's resume streams: the tokens read are kept, not counted as a stop; either way the
  line is sent again until an upstream answers on that port.

The fake pauses its streams after a few tokens (`tokens.hold_after`) until the test releases them,
so each kill lands exactly where it says; nothing waits on a timer."""

from __future__ import annotations

import asyncio
import pathlib
import signal

import aiohttp
import yaml

from client import Reply
from fake_llama import FakeLlamaServer
from fake_tokens import generate
from harness import EnvoyProcess, SidecarProcess, Stack
from preempt_e2e import CONTENT, MAX_TOKENS, check_answer, prompt_of, resume_paused, stop_kept, stop_records, stopping


async def _status(reply: asyncio.Task[Reply]) -> int | None:
    """A request's status; None: its connection was cut (Envoy gone)."""
    try:
        return (await reply).status
    except aiohttp.ClientError:
        return None


def _kill_sidecar(stack: Stack) -> None:
    stack.sidecar.signal(signal.SIGKILL)
    stack.sidecar.popen.wait(timeout=30)
    stack.sidecar.stop()
    stack.sidecar = SidecarProcess(stack.config_path, stack.workdir, name="sidecar-again")


def _kill_fake(fake: FakeLlamaServer) -> None:
    """As if its process were killed: every connection reset, its port closed, nothing more done."""
    loop, runner = fake._loop, fake._runner
    assert loop is not None and runner is not None

    async def _kill() -> None:
        for site in runner.sites:
            site._server.close()  # type: ignore[union-attr]
        assert runner.server is not None
        for transport in list(runner.server._connections.values()):
            transport.abort()

    asyncio.run_coroutine_threadsafe(_kill(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    assert fake._thread is not None
    fake._thread.join(10)
    fake._loop = None  # (its `close` has nothing left to do)


PROMPT = prompt_of(CONTENT)


async def test_a_sidecar_killed_after_a_stop_resumes_the_line_from_its_kept_tokens(tmp_path: pathlib.Path) -> None:
    async with stopping(tmp_path) as state:
        await stop_kept(state)
        _kill_sidecar(state.stack)
        state.fake.release("person")
        assert (await state.person).status == 200  # (it ran past the sidecar: granted before the kill)
        state.fake.tokens.hold_after = None
        state.fake.tokens.release()
        record = await asyncio.to_thread(state.output)
        check_answer(record, CONTENT, "model-a", stops=1)
        # The restarted sidecar went on from the database: the prompt and its 6 kept tokens.
        assert state.fake.tokens.completions == [(PROMPT, MAX_TOKENS), (PROMPT + generate(PROMPT, 6), MAX_TOKENS - 6)]
        assert len(state.fake.tokens.templates) == len(state.fake.tokens.tokenized) == 1


async def test_a_sidecar_killed_during_a_stop_sends_the_line_again_from_its_start(tmp_path: pathlib.Path) -> None:
    async with stopping(tmp_path) as state:
        # The stop is asked, the line's next token not yet read: nothing is kept when it dies.
        state.fake.tokens.hold_after = None
        _kill_sidecar(state.stack)
        state.fake.tokens.release()  # (the cut stream learns its client left)
        # The person waited in the killed sidecar's queue: Envoy answered it 503 (its check failed).
        assert await _status(state.person) == 503
        record = await asyncio.to_thread(state.output)
        check_answer(record, CONTENT, "model-a", stops=0)
        assert state.fake.tokens.completions == [(PROMPT, MAX_TOKENS), (PROMPT, MAX_TOKENS)]
        assert len(state.fake.tokens.templates) == 2


async def test_envoy_killed_during_a_stop_keeps_the_tokens_read_and_resumes_once_it_is_back(
        tmp_path: pathlib.Path) -> None:
    async with stopping(tmp_path) as state:
        stack = state.stack
        bootstrap = yaml.safe_load(stack.envoy.config_path.read_text())
        stack.envoy.signal(signal.SIGKILL)
        stack.envoy.popen.wait(timeout=30)
        stack.envoy.stop()
        assert await _status(state.person) is None  # it waited in Envoy: cut with it
        state.fake.tokens.hold_after = None
        state.fake.tokens.release()
        stack.envoy = EnvoyProcess(bootstrap, stack.workdir, name="envoy-again")
        record = await asyncio.to_thread(state.output)
        # The stream broke with its stop asked: its 5 tokens were kept, counted as its stop.
        check_answer(record, CONTENT, "model-a", stops=1)
        assert state.fake.tokens.completions == [(PROMPT, MAX_TOKENS), (PROMPT + generate(PROMPT, 5), MAX_TOKENS - 5)]
        assert len(stop_records(stack.sidecar.admin_url)) == 1


async def test_the_upstream_killed_during_a_resume_keeps_the_tokens_read_and_the_line_ends_whole(
        tmp_path: pathlib.Path) -> None:
    async with stopping(tmp_path) as state:
        await resume_paused(state)
        port = state.fake.port
        _kill_fake(state.fake)
        again = FakeLlamaServer(port, router=True).started()
        try:
            record = await asyncio.to_thread(state.output)
            # The broken resume kept its 3 tokens (not a stop); the upstream started on that port
            # was asked the 3 left.
            check_answer(record, CONTENT, "model-a", stops=1)
            assert again.tokens.completions == [(PROMPT + generate(PROMPT, 9), MAX_TOKENS - 9)]
            assert again.tokens.templates == []
        finally:
            again.close()


async def test_the_upstream_killed_during_a_stop_keeps_the_tokens_read_and_the_line_ends_whole(
        tmp_path: pathlib.Path) -> None:
    async with stopping(tmp_path) as state:
        port = state.fake.port
        _kill_fake(state.fake)  # the line's stop asked, its next token never comes
        again = FakeLlamaServer(port, router=True).started()
        again.release("person")  # (the person may reach it, or find no upstream yet: not what this asks)
        try:
            record = await asyncio.to_thread(state.output)
            # The stream broke with its stop asked: its 5 tokens were kept, counted as its stop.
            check_answer(record, CONTENT, "model-a", stops=1)
            assert again.tokens.completions == [(PROMPT + generate(PROMPT, 5), MAX_TOKENS - 5)]
            assert again.tokens.templates == [] and len(stop_records(state.stack.sidecar.admin_url)) == 1
        finally:
            again.close()
