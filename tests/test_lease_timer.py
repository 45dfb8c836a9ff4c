"""The one lease timer (`runtime/leases.py`) stays armed across grants and releases: a timer armed
for an earlier deadline fires, finds nothing due, and arms for the earliest deadline then. These
say that leases still lapse exactly at their own deadline and that an early firing does nothing."""

from __future__ import annotations

from flow import Flow, virtual_time
from llamaswap.config import parse_config
from llamaswap.core import NS_PER_S, Outcome

LEASE = {"envoy": {"leaseSeconds": 3}}


@virtual_time
async def test_a_lease_lapses_at_its_own_deadline_though_the_timer_was_armed_for_a_released_grant() -> None:
    flow = Flow(LEASE)
    first = await flow.arrive("first", model="a")
    await flow.advance(1)
    await flow.complete(first)  # the timer armed for its lease (at 3 s) stays
    second = await flow.arrive("second", model="a")
    assert second.granted
    granted_ns = flow.now_ns
    await flow.advance(2.999)
    assert second.outcome is None  # the timer fired at 3 s: nothing was due
    await flow.advance(0.001)
    assert second.outcome is Outcome.LEASE_EXPIRED
    assert second.ticket.finished_ns == granted_ns + 3 * NS_PER_S


@virtual_time
async def test_a_timer_left_armed_after_the_last_release_fires_with_no_effect() -> None:
    flow = Flow(LEASE)
    only = await flow.arrive("only", model="a")
    await flow.complete(only)
    flow.recorder.picture()
    pictures, events = len(flow.recorder.pictures), len(flow.recorder.events)
    await flow.advance(10)
    flow.recorder.picture()  # (a read builds a picture only if the queue moved since the last)
    assert (len(flow.recorder.pictures), len(flow.recorder.events)) == (pictures, events)
    assert flow.coordinator.view().running == ()


@virtual_time
async def test_a_deadline_earlier_than_the_armed_one_moves_the_timer() -> None:
    two_slots = {"upstream": {"slots": 2}}
    flow = Flow({**two_slots, "envoy": {"leaseSeconds": 100}})
    long = await flow.arrive("long", model="a")
    flow.coordinator.reconfigure(parse_config({**two_slots, "envoy": {"leaseSeconds": 2}}))
    short = await flow.arrive("short", model="a")
    assert long.granted and short.granted
    await flow.advance(1.999)
    assert short.outcome is None
    await flow.advance(0.001)
    assert short.outcome is Outcome.LEASE_EXPIRED and long.outcome is None


async def test_a_grant_or_release_while_a_timer_is_armed_arms_none_and_reads_no_deadline() -> None:
    # Every grant and release tells the leases (issue 49: they did read every deadline each time).
    import asyncio

    from llamaswap.core import ManualClock
    from llamaswap.runtime.leases import Leases

    class Grant:
        def __init__(self, deadline_ns: int) -> None:
            self.lease_deadline_ns = deadline_ns

    running: list[Grant] = []
    reads: list[int] = []

    def listed() -> list[Grant]:
        reads.append(len(running))
        return running

    loop = asyncio.get_running_loop()
    timers: list[float] = []
    call_later = loop.call_later

    def counted(delay: float, callback, *args):  # type: ignore[no-untyped-def]
        timers.append(delay)
        return call_later(delay, callback, *args)

    loop.call_later = counted  # type: ignore[method-assign]
    leases = Leases(ManualClock(), lambda: None, listed)  # type: ignore[arg-type]
    try:
        running.append(Grant(3 * NS_PER_S))
        leases.granted(3 * NS_PER_S)
        assert timers == [3.0] and len(reads) == 1
        running.append(Grant(4 * NS_PER_S))
        leases.granted(4 * NS_PER_S)  # later than the armed one: nothing read, nothing armed
        running.pop(0)
        leases.released()  # the armed timer stays: it fires, finds nothing due, arms for 4 s
        assert timers == [3.0] and len(reads) == 1
        running.append(Grant(2 * NS_PER_S))  # (a shorter envoy.leaseSeconds since)
        leases.granted(2 * NS_PER_S)  # earlier: the timer moves
        assert timers == [3.0, 2.0]
    finally:
        leases.cancel()
        loop.call_later = call_later  # type: ignore[method-assign]
