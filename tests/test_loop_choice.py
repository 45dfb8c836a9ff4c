"""Which event loop `serve` and `up` run on (`commands/event_loop.py`): LLAMASWAP_EVENT_LOOP read
by `loop_factory`, the loop `run` starts, and the name the start line gives it."""

from __future__ import annotations

import asyncio
import sys

import pytest

from llamaswap.commands.event_loop import EVENT_LOOP_ENV, EventLoopError, loop_factory, loop_name, run


async def _running_loop() -> asyncio.AbstractEventLoop:
    return asyncio.get_running_loop()


@pytest.mark.parametrize("setting", [None, "", "auto", "uvloop", " UVLoop "])
def test_uvloop_runs_unless_turned_off(setting: str | None) -> None:
    uvloop = pytest.importorskip("uvloop")
    environ = {} if setting is None else {EVENT_LOOP_ENV: setting}
    loop = run(_running_loop(), loop_factory(environ))
    assert isinstance(loop, uvloop.Loop)
    assert loop_name(loop) == "uvloop"


def test_asyncio_turns_it_off() -> None:
    loop = run(_running_loop(), loop_factory({EVENT_LOOP_ENV: "asyncio"}))
    assert type(loop).__module__.startswith("asyncio")
    assert loop_name(loop) == "asyncio"


def test_without_uvloop_auto_falls_back_and_asking_for_it_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # `import uvloop` raises ImportError
    assert loop_factory({}) is None
    with pytest.raises(EventLoopError, match=f"{EVENT_LOOP_ENV}=uvloop, but uvloop cannot be imported"):
        loop_factory({EVENT_LOOP_ENV: "uvloop"})


def test_a_value_that_names_no_loop_is_refused_with_the_choices() -> None:
    with pytest.raises(EventLoopError, match="is not a loop: set it to auto, uvloop, asyncio"):
        loop_factory({EVENT_LOOP_ENV: "trio"})
