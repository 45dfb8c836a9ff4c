"""The publishing of pictures: every change counted (the views and the pages that poll read the
count), the gauges' picture sent once per loop turn, and the observers run after the step that
made the change (`deferred.py`), so no handoff waits for telemetry."""

from __future__ import annotations

from collections.abc import Callable

from llamaswap.core import Scheduler
from llamaswap.runtime.deferred import Deferred
from llamaswap.runtime.observer import Observer, queue_picture
from llamaswap.runtime.views import QueueViews


class Version:
    """A change counter: it moves whenever the queue, a grant or a GPU's state does."""

    def __init__(self) -> None:
        self._count = 0

    def current(self) -> int:
        return self._count

    def moved(self) -> None:
        self._count += 1


class Publisher:
    """``immediate``: everything runs at once (tests that read telemetry synchronously)."""

    def __init__(self, *, version: Version, scheduler: Scheduler, observer: Observer,
                 views: QueueViews, immediate: bool) -> None:
        self._version = version
        self._scheduler = scheduler
        self._observer = observer
        self._views = views
        self._deferred = Deferred(self.publish_now, immediate=immediate)

    def changed(self) -> None:
        self._version.moved()
        self.publish()

    def publish(self) -> None:
        self._deferred.publish()

    def publish_now(self) -> None:
        """The gauges' picture (`observer.queue_picture`; `deferred.py` sends it once per loop turn)."""
        self._observer.queue_changed(queue_picture(self._scheduler, self._views.gpus()))

    def observe(self, callback: Callable[..., None], *args: object) -> None:
        """Observers run after the step (`deferred.py`): no handoff waits for telemetry."""
        self._deferred.observe(callback, *args)

    def flush(self) -> None:
        """Run what waits now (the loop is about to stop)."""
        self._deferred.run()
