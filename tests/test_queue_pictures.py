"""The gauges' picture is built when read (`runtime/publishing.py`, `QueuePictures`): a change
only counts a move; the first read of a moved picture on the loop's thread builds it once and
tells the observers; a reader on another thread (an OTLP exporter collecting) never builds (the
build reads the scheduler) and reads the last built, which the loop keeps fresh within
`FRESH_FOR_OTHER_THREADS_S` while such a reader exists."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from flow import PEER, VirtualTimeLoop, current_loop, virtual_time
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from llamaswap.config import parse_config
from llamaswap.core import NS_PER_S, Band
from llamaswap.runtime.coordinator import Coordinator
from llamaswap.runtime.gpu_projection import GpuProjection, NodeProjection
from llamaswap.runtime.observer import FanOut, NoopObserver, QueuePicture
from llamaswap.runtime.publishing import FRESH_FOR_OTHER_THREADS_S, QueuePictures
from llamaswap.runtime.ticket import Arrival
from llamaswap.telemetry import instruments as names
from llamaswap.telemetry.observer import Telemetry


class Built(NoopObserver):
    """Counts the builds and records each picture the observers were told of."""

    def __init__(self) -> None:
        self.builds = 0
        self.told: list[QueuePicture] = []

    def build(self) -> QueuePicture:
        self.builds += 1
        return QueuePicture(((Band.NORMAL, self.builds),), ((Band.NORMAL, None),),
                            NodeProjection.of((GpuProjection.configured("gpu", 1),)))

    def queue_changed(self, picture: QueuePicture) -> None:
        self.told.append(picture)


def on_another_thread(read: Any) -> Any:
    got: list[Any] = []
    thread = threading.Thread(target=lambda: got.append(read()))
    thread.start()
    thread.join()
    return got[0]


async def run_ready(loop: VirtualTimeLoop, seconds: float = 0.0) -> None:
    """Move the loop's clock and run what is due (timers included)."""
    loop.clock.set_ns(loop.clock.now_ns() + round(seconds * NS_PER_S))
    for _ in range(100):
        if not loop.runnable():
            return
        await asyncio.sleep(0)
    raise AssertionError("the loop never became idle")


@virtual_time
async def test_changes_build_nothing_until_a_read_builds_once() -> None:
    built = Built()
    pictures = QueuePictures(built.build, built, immediate=False)
    assert pictures.latest() is None and built.builds == 0  # nothing published yet
    for _ in range(3):
        pictures.moved()
    await run_ready(current_loop(), 1.0)
    assert built.builds == 0 and pictures.moves == 3
    first = pictures.latest()
    assert first is not None and built.builds == 1 and built.told == [first]
    assert pictures.latest() is first and built.builds == 1  # not moved since: the same picture
    pictures.moved()
    second = pictures.latest()
    assert second is not first and second == built.told[-1] and built.builds == 2


@virtual_time
async def test_another_thread_reads_the_last_built_and_never_builds() -> None:
    built = Built()
    pictures = QueuePictures(built.build, built, immediate=False)
    pictures.moved()
    assert on_another_thread(pictures.latest) is None and built.builds == 0
    first = pictures.latest()
    pictures.moved()
    assert on_another_thread(pictures.latest) is first
    assert built.builds == 1


@virtual_time
async def test_kept_fresh_the_loop_builds_a_moved_picture_once_within_the_refresh() -> None:
    loop = current_loop()
    built = Built()
    pictures = QueuePictures(built.build, built, immediate=False)
    pictures.keep_fresh()
    for _ in range(5):
        pictures.moved()
    await run_ready(loop)
    assert built.builds == 0
    await run_ready(loop, FRESH_FOR_OTHER_THREADS_S)
    assert built.builds == 1  # five moves, one picture
    assert on_another_thread(pictures.latest) is built.told[-1]
    await run_ready(loop, 10 * FRESH_FOR_OTHER_THREADS_S)
    assert built.builds == 1 and loop.next_timer_s() is None  # nothing moved: no timer, no build
    pictures.moved()
    pictures.latest()  # read on the loop first: the refresh then finds nothing moved
    await run_ready(loop, FRESH_FOR_OTHER_THREADS_S)
    assert built.builds == 2


@virtual_time
async def test_kept_fresh_and_immediate_each_move_builds_and_flush_builds_what_moved() -> None:
    built = Built()
    pictures = QueuePictures(built.build, built, immediate=True)
    pictures.keep_fresh()
    pictures.moved()
    pictures.moved()
    assert built.builds == 2
    later = QueuePictures(built.build, built, immediate=False)
    later.moved()
    later.flush()  # not kept fresh: nobody off the loop reads it
    assert built.builds == 2
    later.keep_fresh()
    later.flush()
    assert built.builds == 3


async def admitted(coordinator: Coordinator, request_id: str) -> None:
    ticket = await coordinator.admit(Arrival(request_id, None, None, "a", PEER, None, None, "POST",
                                             "/v1/chat/completions", None, True))
    assert ticket.decision is not None  # granted at once


def slots_busy(reader: InMemoryMetricReader) -> Any:
    data = reader.get_metrics_data()
    assert data is not None
    return next(point.value for resource in data.resource_metrics for scope in resource.scope_metrics
                for metric in scope.metrics if metric.name == names.GPU_SLOTS_BUSY
                for point in metric.data.data_points)


@virtual_time
async def test_the_sidecars_wiring_a_request_builds_no_picture_and_a_scrape_reads_it_now() -> None:
    loop = current_loop()
    built = Built()
    telemetry = Telemetry(clock=loop.clock)
    coordinator = Coordinator(parse_config({"upstream": {"slots": 2}, "envoy": {"leaseSeconds": 1000}}),
                              clock=loop.clock, observer=FanOut(built, telemetry))
    try:
        await admitted(coordinator, "one")
        await admitted(coordinator, "two")
        await run_ready(loop, 1.0)
        assert built.told == []  # no reader: no picture built for either request
        page = telemetry.picker_text()[0].decode()
        assert f"{names.GPU_SLOTS_BUSY} 2" in page.splitlines()
        assert len(built.told) == 1 and built.told[0].node.slots_busy == 2
    finally:
        coordinator.close()


@virtual_time
async def test_the_sidecars_wiring_an_exporters_thread_reads_a_picture_kept_fresh() -> None:
    loop = current_loop()
    reader = InMemoryMetricReader()
    telemetry = Telemetry(clock=loop.clock, metric_readers=[reader])
    coordinator = Coordinator(parse_config({"upstream": {"slots": 2}, "envoy": {"leaseSeconds": 1000}}),
                              clock=loop.clock, observer=telemetry)
    try:
        await admitted(coordinator, "one")
        await run_ready(loop)
        assert on_another_thread(lambda: slots_busy(reader)) == 0  # not yet refreshed: the last built
        await run_ready(loop, FRESH_FOR_OTHER_THREADS_S)
        assert on_another_thread(lambda: slots_busy(reader)) == 1
        await admitted(coordinator, "two")
        assert slots_busy(reader) == 2  # collected on the loop's thread: built now
    finally:
        coordinator.close()
