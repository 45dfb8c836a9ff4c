"""The publishing of pictures: every change counted (the views and the pages that poll read the
count), the gauges' picture built when read (`QueuePictures`), and the observers run after the
step that made the change (`deferred.py`), so no handoff waits for telemetry."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

from llamaswap.core import Scheduler
from llamaswap.runtime.deferred import Deferred
from llamaswap.runtime.observer import Observer, QueuePicture, queue_picture
from llamaswap.runtime.views import QueueViews

# While a reader off the loop's thread may read the picture (`QueuePictures.keep_fresh`: an OTLP
# exporter collecting), a moved picture is built on the loop at most this long after the move.
FRESH_FOR_OTHER_THREADS_S = 0.1


class Version:
    """A change counter: it moves whenever the queue, a grant or a GPU's state does."""

    def __init__(self) -> None:
        self._count = 0

    def current(self) -> int:
        return self._count

    def moved(self) -> None:
        self._count += 1


class QueuePictures:
    """The gauges' picture of the queue (`observer.QueuePicture`), built when read rather than on
    every change: a change only counts a move (`moved`); the first read of a moved picture on the
    loop's thread builds it and tells the observers (`Observer.queue_changed`), so a request that
    nobody reads the gauges during costs no picture at all.

    Only the loop's thread (the one that moves it) builds: the build reads the scheduler. A reader
    on another thread (the OTLP exporter's collection) reads the last picture built, immutable;
    while such a reader may read (`keep_fresh`), the loop builds a moved picture within
    `FRESH_FOR_OTHER_THREADS_S` of the move (``immediate``: at the move), so what it reads is
    never older than that. Before the first move there is none (`latest` is None)."""

    def __init__(self, build: Callable[[], QueuePicture], observer: Observer, *, immediate: bool) -> None:
        self._build = build
        self._observer = observer
        self._immediate = immediate
        self._moves = 0
        self._built = 0  # the move the last picture was built at
        self._last: QueuePicture | None = None
        self._thread: int | None = None  # the loop's thread: the one that moved it first
        self._fresh = False  # a reader off the loop's thread may read
        self._refresh_armed = False

    @property
    def moves(self) -> int:
        """How many times the picture has moved (a change, a GPU freed)."""
        return self._moves

    def moved(self) -> None:
        """Something the picture shows changed (on the loop's thread)."""
        self._moves += 1
        if self._thread is None:
            self._thread = threading.get_ident()
        if self._fresh:
            if self._immediate:
                self._build_now()
            elif not self._refresh_armed:
                self._refresh_armed = True
                asyncio.get_running_loop().call_later(FRESH_FOR_OTHER_THREADS_S, self._refresh)

    def keep_fresh(self) -> None:
        """A reader off the loop's thread may read from now on: keep its picture fresh."""
        self._fresh = True

    def latest(self) -> QueuePicture | None:
        """On the loop's thread, the picture of now (built here if it moved since the last);
        elsewhere the last built. None: nothing was published yet."""
        if self._built != self._moves and threading.get_ident() == self._thread:
            self._build_now()
        return self._last

    def flush(self) -> None:
        """A moved picture built now for a reader off the loop's thread (the loop is about to
        stop: its last export reads it)."""
        if self._fresh and self._built != self._moves:
            self._build_now()

    def _refresh(self) -> None:
        self._refresh_armed = False
        if self._built != self._moves:
            self._build_now()

    def _build_now(self) -> None:
        self._built = self._moves
        picture = self._last = self._build()
        self._observer.queue_changed(picture)


class Publisher:
    """``immediate``: everything runs at once (tests that read telemetry synchronously)."""

    def __init__(self, *, version: Version, scheduler: Scheduler, observer: Observer,
                 views: QueueViews, immediate: bool) -> None:
        self._version = version
        self._deferred = Deferred(immediate=immediate)
        self.pictures = QueuePictures(lambda: queue_picture(scheduler, views.gpus()), observer, immediate=immediate)
        observer.reads_queue(self.pictures)

    def changed(self) -> None:
        self._version.moved()
        self.pictures.moved()

    def publish(self) -> None:
        """The gauges' picture moved (what holds a GPU did) without a change the views count."""
        self.pictures.moved()

    def observe(self, callback: Callable[..., None], *args: object) -> None:
        """Observers run after the step (`deferred.py`): no handoff waits for telemetry."""
        self._deferred.observe(callback, *args)

    def flush(self) -> None:
        """Run what waits now (the loop is about to stop), and build a moved picture for a last
        export off the loop's thread."""
        self._deferred.run()
        self.pictures.flush()
