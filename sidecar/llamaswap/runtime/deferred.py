"""Telemetry off the request's way: observers run after the step that made the change (the
gauges' picture is built when read: `publishing.QueuePictures`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class Deferred:
    """With ``immediate`` (tests that read telemetry synchronously) everything runs at once."""

    def __init__(self, *, immediate: bool) -> None:
        self._immediate = immediate
        self._deferred: list[tuple[Callable[..., None], tuple[object, ...]]] = []
        self._flush_scheduled = False

    def observe(self, callback: Callable[..., None], *args: object) -> None:
        """Observers run in one callback two loop turns on: after the step's wake-ups and after
        what those schedule in turn (the next Check's answer going out to Envoy), so no
        handoff waits for spans, metrics or log lines."""
        if self._immediate:
            callback(*args)
            return
        self._deferred.append((callback, args))
        if not self._flush_scheduled:  # (inline: each grant and each end asks)
            self._flush_scheduled = True
            loop = asyncio.get_running_loop()
            loop.call_soon(loop.call_soon, self.run)

    def run(self) -> None:
        """Run what waits now (also at close: the loop is about to stop)."""
        self._flush_scheduled = False
        deferred, self._deferred = self._deferred, []
        for callback, args in deferred:
            callback(*args)
