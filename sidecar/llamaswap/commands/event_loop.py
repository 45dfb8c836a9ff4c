"""The event loop `serve` and `up` run on: uvloop where it is installed (a dependency on Linux and
macOS), asyncio's own where it is not or where ``LLAMASWAP_EVENT_LOOP=asyncio`` says so.

uvloop runs grpc.aio, aiohttp, signal handlers and worker threads (`asyncio.to_thread`) like
asyncio's loop does, with less CPU per wake-up: in five A/Bs on a shared 2-core machine the
sidecar spent 48-144 us less CPU per request on it (4-11 %; bench/README.md).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, Final, TypeVar

EVENT_LOOP_ENV: Final = "LLAMASWAP_EVENT_LOOP"
CHOICES: Final = ("auto", "uvloop", "asyncio")  # auto: uvloop where it can be imported

_T = TypeVar("_T")


class EventLoopError(Exception):
    """LLAMASWAP_EVENT_LOOP names a loop that cannot be used."""


def loop_factory(environ: Mapping[str, str] = os.environ) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """What makes the loop (`asyncio.Runner`'s ``loop_factory``; None: asyncio's own)."""
    choice = environ.get(EVENT_LOOP_ENV, "").strip().lower() or "auto"
    if choice not in CHOICES:
        raise EventLoopError(f"{EVENT_LOOP_ENV}={environ[EVENT_LOOP_ENV]!r} is not a loop: set it to "
                             f"{', '.join(CHOICES)} (or leave it unset: auto)")
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError as exc:
        if choice == "auto":
            return None
        raise EventLoopError(f"{EVENT_LOOP_ENV}=uvloop, but uvloop cannot be imported ({exc}): install it "
                             f"(pip install uvloop) or set {EVENT_LOOP_ENV}=asyncio") from exc
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def run(main: Coroutine[Any, Any, _T], factory: Callable[[], asyncio.AbstractEventLoop] | None) -> _T:
    """`asyncio.run` on the loop ``factory`` makes (`loop_factory`, asked before ``main`` is made)."""
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)


def loop_name(loop: asyncio.AbstractEventLoop) -> str:
    """``uvloop`` or ``asyncio``: which loop runs (said in the sidecar's start line)."""
    return "uvloop" if type(loop).__module__.startswith("uvloop") else "asyncio"
