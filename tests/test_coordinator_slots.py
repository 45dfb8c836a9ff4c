"""The coordinator with several slots (upstream.slots > 1), on the fake clock (tests/flow.py):
at most N grants at once and all of one model, a swap drains first, the reserved slot goes only
to interactive work, an abandoned generation holds the GPU until the upstream computes no more
than the grants still running (and `stop` waits for the generations granted beside it), and
leases, the watchdog, a lost Envoy connection and shutdown work per grant."""

from __future__ import annotations

import asyncio

import pytest
from flow import PEER, FakeUpstream, Flow, Request, router, virtual_time
from llamaswap.adapters.admin import queue_document
from llamaswap.commands.queue import render
from llamaswap.config import parse_config
from llamaswap.core import Outcome
from llamaswap.runtime.slot_learning import LEARN_POLL_MAX_S
from llamaswap.runtime.views import RunningRow
from llamaswap.runtime.observer import SettleResult
from llamaswap.runtime.settle import SETTLE_POLL_MAX_S
from llamaswap.runtime.ticket import ExchangeEnd

OTHER_PEER = "ipv4:127.0.0.1:40002"
LONG_LEASE = {"leaseSeconds": 1000}


def slots_flow(slots: int, *, reserved: int = 0, envoy: dict | None = None, upstream: FakeUpstream | None = None,
               **scheduler: object) -> Flow:
    return Flow({"upstream": {"slots": slots}, "envoy": envoy or LONG_LEASE,
                 "routing": {"scheduler": {**scheduler, "settings": {"serial": {"reservedSlots": reserved}}}}},
                upstream=upstream)


def running(flow: Flow) -> set[str]:
    return {t.request_id for t, _ in flow.recorder.grants if t.outcome is None}


@virtual_time
async def test_at_most_n_grants_at_once() -> None:
    flow = slots_flow(2)
    requests = [await flow.arrive(f"r{i}", model="a") for i in range(5)]
    assert [r.granted for r in requests] == [True, True, False, False, False]
    assert flow.coordinator.scheduler.slots_busy == 2
    await flow.complete(requests[0])
    assert running(flow) == {"r1", "r2"}
    await flow.complete(requests[2])
    await flow.complete(requests[1])
    assert running(flow) == {"r3", "r4"}
    assert flow.recorder.most_holders == 2
    assert [t.decision.slots_busy for t, _ in flow.recorder.grants] == [1, 2, 2, 2, 2]


@virtual_time
async def test_one_slot_is_one_grant_at_a_time() -> None:
    flow = slots_flow(1)
    requests = [await flow.arrive(f"r{i}", model="a") for i in range(3)]
    assert [r.granted for r in requests] == [True, False, False]
    await flow.complete(requests[0])
    assert running(flow) == {"r1"} and flow.recorder.most_holders == 1


@virtual_time
async def test_a_swap_drains_the_slots_first_and_is_not_overtaken() -> None:
    flow = slots_flow(3)
    a1 = await flow.arrive("a1", "normal", "a")
    a2 = await flow.arrive("a2", "normal", "a")
    b = await flow.arrive("b", "interactive", "b")  # the best: it needs a swap
    a3 = await flow.arrive("a3", "normal", "a")  # a free slot of the loaded model, but lower-scored
    assert a1.granted and a2.granted and b.waiting and a3.waiting
    await flow.complete(a1)
    assert b.waiting and a3.waiting  # a2 still runs on model a
    await flow.complete(a2)
    assert b.granted and b.ticket.decision.swap and a3.waiting
    models = {t.model for t, _ in flow.recorder.grants if t.outcome is None}
    assert models == {"b"}
    await flow.complete(b)
    assert a3.granted


@virtual_time
async def test_the_reserved_slot_goes_only_to_interactive_work() -> None:
    flow = slots_flow(2, reserved=1)
    batch1 = await flow.arrive("batch1", "batch", "a")
    batch2 = await flow.arrive("batch2", "batch", "a")
    normal = await flow.arrive("normal", "normal", "a")
    assert batch1.granted and batch2.waiting and normal.waiting  # one slot kept for interactive work
    chat = await flow.arrive("chat", "interactive", "a")
    assert chat.granted and batch2.waiting and normal.waiting
    await flow.complete(chat)
    assert normal.waiting and batch2.waiting
    await flow.complete(batch1)
    assert normal.granted and batch2.waiting


async def three_slots_one_abandoned() -> tuple[Flow, tuple[Request, ...]]:
    """Three slots computing a1, a2, a3 (the upstream says 3), a4 waiting; a1's client left."""
    flow = slots_flow(3, upstream=FakeUpstream(busy=3))
    requests = tuple([await flow.arrive(f"a{i}", model="a") for i in range(1, 5)])
    await flow.end(requests[0], ExchangeEnd.CLIENT_LEFT)
    return flow, requests


@virtual_time
async def test_an_abandoned_generation_holds_its_slot_until_it_ended() -> None:
    """While it computes, nothing is granted; once the upstream computes no more than the grants
    still running, the next one goes beside them (issue 25: it waited for the whole upstream)."""
    flow, (a1, a2, a3, a4) = await three_slots_one_abandoned()
    assert a1.outcome is Outcome.CANCELLED_RUNNING and a1.ticket.abandoned
    await flow.advance(5)
    assert a4.waiting and flow.coordinator.gpu_state == "running"  # a slot is free, but a1 still computes
    flow.upstream.busy_answer = 2  # a1 ended; a2 and a3 compute on
    await flow.advance(SETTLE_POLL_MAX_S)
    assert a4.waiting  # two computing, two held: but which two, one answer cannot tell
    await flow.advance(SETTLE_POLL_MAX_S)
    assert a4.granted and a2.outcome is None and a3.outcome is None  # the second answer agrees
    [settle] = flow.recorder.settles
    assert settle.result is SettleResult.IDLE


@virtual_time
async def test_a_held_generation_that_ended_upstream_is_not_taken_for_the_abandoned_one() -> None:
    """Two held beside the abandoned one; a2 ends at the upstream before its exchange's end reaches
    the sidecar, so the upstream computes two (a3 and the abandoned a1) while two are held: the
    count fits, but the abandoned generation still takes a slot. The next answer, after a2's end
    came, shows it (CI saw a grant in that gap, 1 ms before a2's end)."""
    flow, (a1, a2, a3, a4) = await three_slots_one_abandoned()
    await flow.advance(5)
    flow.upstream.busy_answer = 2  # a2 done upstream, its end not here yet; a1 and a3 compute
    await flow.advance(SETTLE_POLL_MAX_S)
    await flow.complete(a2)  # its end arrives
    await flow.advance(SETTLE_POLL_MAX_S)
    assert a4.waiting and not flow.recorder.settles  # 2 computing, 1 held: a1 still computes
    flow.upstream.busy_answer = 1  # a1 ended
    await flow.advance(2 * SETTLE_POLL_MAX_S)
    assert a4.granted and a3.outcome is None
    [settle] = flow.recorder.settles
    assert settle.result is SettleResult.IDLE


@virtual_time
async def test_a_request_waiting_for_a_settle_is_estimated_to_start_when_it_ends() -> None:
    """A free slot does not start anything while a settle runs (`GpuHolding.blocked`), so the
    estimate waits for the settle too: the estimated start is the abandoned generation's
    expected end, not now (the walk used to count the settle as one more busy slot)."""
    flow = Flow({"upstream": {"slots": 3}, "envoy": LONG_LEASE,
                 "estimates": {"defaultRunSeconds": 10, "defaultSwapSeconds": 0}}, upstream=FakeUpstream(busy=3))
    a1 = await flow.arrive("a1", model="a")
    a2 = await flow.arrive("a2", model="a")
    await flow.advance(1)
    await flow.end(a1, ExchangeEnd.CLIENT_LEFT)
    a3 = await flow.arrive("a3", model="a")
    await flow.advance(0.5)
    assert a2.granted and a3.waiting and flow.coordinator.gpu_state == "running"
    [row] = flow.coordinator.view().waiting
    assert row.estimated_start_s == pytest.approx(8.5)  # a1's 10 s run, 1.5 s gone


@virtual_time
async def test_retry_after_while_settling_beside_a_free_slot_counts_the_settle() -> None:
    """A full queue during a settle: the next grant waits for the settle, free slot or not, so
    Retry-After is the settle's expected rest (it was the minimum, as if a grant came at once)."""
    flow = Flow({"upstream": {"slots": 3}, "envoy": LONG_LEASE, "routing": {"scheduler": {"maxQueued": 1}},
                 "estimates": {"defaultRunSeconds": 10, "defaultSwapSeconds": 0}}, upstream=FakeUpstream(busy=3))
    a1 = await flow.arrive("a1", model="a")
    a2 = await flow.arrive("a2", model="a")
    await flow.advance(1)
    await flow.end(a1, ExchangeEnd.CLIENT_LEFT)
    a3 = await flow.arrive("a3", model="a")
    await flow.advance(2)
    assert a2.granted and a3.waiting
    assert (await flow.arrive("a4", model="a")).refusal.retry_after_s == 7  # a1's 10 s run, 3 s gone


@virtual_time
async def test_an_abandoned_generation_outliving_its_neighbours_holds_the_gpu() -> None:
    flow = slots_flow(2, upstream=FakeUpstream(busy=2))
    a1 = await flow.arrive("a1", model="a")
    a2 = await flow.arrive("a2", model="a")
    a3 = await flow.arrive("a3", model="a")
    await flow.end(a1, ExchangeEnd.CLIENT_LEFT)
    await flow.complete(a2)
    flow.upstream.busy_answer = 1  # a2 ended, a1 has not
    await flow.advance(5)
    assert a3.waiting and flow.coordinator.gpu_state == "settling"
    flow.upstream.busy_answer = 0
    await flow.advance(SETTLE_POLL_MAX_S)
    assert a3.granted and len(flow.recorder.settles) == 1


@virtual_time
async def test_a_second_abandonment_joins_the_settle_under_way() -> None:
    flow = slots_flow(2, upstream=FakeUpstream(busy=2))
    a1 = await flow.arrive("a1", model="a")
    a2 = await flow.arrive("a2", model="a")
    a3 = await flow.arrive("a3", model="a")
    await flow.end(a1, ExchangeEnd.CLIENT_LEFT)
    await flow.end(a2, ExchangeEnd.CLIENT_LEFT)
    assert a2.ticket.abandoned and a3.waiting
    flow.upstream.busy_answer = 1  # one of them still computes: no grant
    await flow.advance(5)
    assert a3.waiting
    flow.upstream.busy_answer = 0
    await flow.advance(SETTLE_POLL_MAX_S)
    assert a3.granted and len(flow.recorder.settles) == 1


async def _abandoned_beside_another(*, settle_timeout_s: float) -> tuple[Flow, Request, Request]:
    """abandonedGeneration: stop, two slots: a1's client left while a2 runs beside it and a3 waits."""
    flow = Flow({"upstream": {"slots": 2, "abandonedGeneration": "stop", "settleTimeoutSeconds": settle_timeout_s},
                 "envoy": LONG_LEASE}, upstream=FakeUpstream(busy=2))
    a1 = await flow.arrive("a1", model="a")
    a2 = await flow.arrive("a2", model="a")
    a3 = await flow.arrive("a3", model="a")
    await flow.end(a1, ExchangeEnd.CLIENT_LEFT)
    return flow, a2, a3


@virtual_time
async def test_stop_waits_for_the_generations_granted_beside_the_abandoned_one() -> None:
    """Unloading the model (router mode's stop) would cut a2 too: a1 is stopped once a2 ended."""
    flow, a2, a3 = await _abandoned_beside_another(settle_timeout_s=60)
    await flow.advance(5)
    assert flow.upstream.stop_calls == [] and a2.outcome is None and a3.waiting
    await flow.complete(a2)
    flow.upstream.busy_answer = 1  # a1 alone
    await flow.advance(SETTLE_POLL_MAX_S)
    assert flow.upstream.stop_calls == ["a"]
    assert a3.granted and a3.ticket.decision.load  # stopping unloaded the model
    [settle] = flow.recorder.settles
    assert settle.result is SettleResult.STOPPED


@virtual_time
async def test_stop_never_cuts_a_generation_granted_beside_it_even_at_the_deadline() -> None:
    flow, a2, a3 = await _abandoned_beside_another(settle_timeout_s=2)
    await flow.advance(2 + SETTLE_POLL_MAX_S)
    assert flow.upstream.stop_calls == [] and a2.outcome is None
    assert a3.granted and not a3.ticket.decision.load  # the deadline freed the slot; the model stayed
    [settle] = flow.recorder.settles
    assert settle.result is SettleResult.TIMEOUT


@virtual_time
async def test_each_grant_has_its_own_lease() -> None:
    flow = slots_flow(2, envoy={"leaseSeconds": 3.0})
    a1 = await flow.arrive("a1", model="a")
    await flow.advance(1)
    a2 = await flow.arrive("a2", model="a")
    await flow.advance(1.5)
    await flow.renew(a2)
    await flow.advance(0.5)  # a1's lease lapses at 3 s; a2's was renewed at 2.5 s
    assert a1.outcome is Outcome.LEASE_EXPIRED
    assert a2.ticket.outcome is None and running(flow) == {"a2"}
    await flow.advance(3)
    assert a2.ticket.outcome is Outcome.LEASE_EXPIRED


@virtual_time
async def test_each_grant_has_its_own_watchdog() -> None:
    flow = slots_flow(2, maxRunSeconds=5.0)
    a1 = await flow.arrive("a1", model="a")
    await flow.advance(2)
    a2 = await flow.arrive("a2", model="a")
    a3 = await flow.arrive("a3", model="a")
    await flow.advance(3)
    assert a1.outcome is Outcome.WATCHDOG and a2.ticket.outcome is None and a3.granted
    await flow.advance(2)
    assert a2.ticket.outcome is Outcome.WATCHDOG and a3.ticket.outcome is None
    assert [t.request_id for t in flow.recorder.watchdogs] == ["a1", "a2"]


@virtual_time
async def test_a_lost_envoy_connection_releases_only_its_grants() -> None:
    flow = slots_flow(3)
    mine1 = await flow.arrive("mine1", model="a")
    other = await flow.arrive("other", model="a", peer=OTHER_PEER)
    mine2 = await flow.arrive("mine2", model="a")
    await flow.peer_gone(PEER)
    assert mine1.outcome is Outcome.PROXY_GONE and mine2.outcome is Outcome.PROXY_GONE
    assert other.ticket.outcome is None and running(flow) == {"other"}


@virtual_time
async def test_shutdown_waits_for_every_slot_and_cuts_them_all_off() -> None:
    flow = slots_flow(2)
    a1 = await flow.arrive("a1", model="a")
    a2 = await flow.arrive("a2", model="a")
    flow.coordinator.stop_admitting()
    assert not await flow.coordinator.wait_idle(0)
    await flow.complete(a1)
    assert not await flow.coordinator.wait_idle(0)
    flow.coordinator.abandon_running()
    await flow.idle()
    assert a2.ticket.outcome is Outcome.SHUTDOWN
    assert flow.coordinator.gpu_state == "idle" and running(flow) == set()


@virtual_time
async def test_the_view_shows_every_running_request_and_the_slots() -> None:
    flow = slots_flow(2)
    a1 = await flow.arrive("a1", model="a")
    await flow.advance(2)
    await flow.arrive("a2", model="a")
    for i in range(3, 6):
        await flow.arrive(f"a{i}", model="a")
    view = flow.coordinator.view()
    assert [row.request_id for row in view.running] == ["a1", "a2"]
    assert (view.slots_busy, view.slots_total) == (2, 2)
    # Two servers: a1 (5 s load + 10 s run, 2 s in) frees its slot in 13 s; a2, granted beside
    # the load, runs once it ends (in 3 s) and also frees in 13 s: a3 and a4 then, a5 at 23.
    assert [row.estimated_start_s for row in view.waiting] == pytest.approx([13, 13, 23])
    ticket, row = flow.coordinator.status_of("a2")
    assert row.request_id == "a2" and isinstance(row, RunningRow)
    document = queue_document(view)
    assert document["running"]["request_id"] == "a1"  # the earliest, as before slots
    assert [r["request_id"] for r in document["running_all"]] == ["a1", "a2"]
    assert (document["slots_busy"], document["slots_total"]) == (2, 2)
    table = render(document)
    assert "2 running, slots 2/2" in table
    assert [line.split()[2] for line in table.splitlines() if " R " in line] == ["a1", "a2"]
    await flow.complete(a1)


def test_the_queue_command_reads_a_document_from_before_slots() -> None:
    document = {"policy": "serial", "loaded_model": "a", "gpu": "running", "waiting": [], "bands": {},
                "running": {"request_id": "only", "priority": 0, "band": "normal", "score": 0.0, "model": "a",
                            "queue_wait_s": 0.0, "running_s": 1.0, "expected_remaining_s": 2.0}}
    table = render(document)
    assert "1 running" in table and "slots" not in table and "loaded model a," in table
    assert [line.split()[2] for line in table.splitlines() if " R " in line] == ["only"]


@virtual_time
async def test_auto_slots_are_what_the_upstream_says() -> None:
    upstream = FakeUpstream()
    upstream.slots_answer = 3
    flow = Flow({"upstream": {"slots": "auto"}, "envoy": LONG_LEASE}, upstream=upstream)
    assert flow.coordinator.scheduler.policy.gpus[0].slots.default == 1  # before it is asked
    await flow.coordinator.learn_slots()
    assert flow.coordinator.scheduler.policy.gpus[0].slots.default == 3
    requests = [await flow.arrive(f"r{i}", model="a") for i in range(4)]
    assert [r.granted for r in requests] == [True, True, True, False]


@virtual_time
async def test_auto_slots_fall_back_to_one_and_fit_the_reservation(caplog) -> None:
    upstream = FakeUpstream()
    flow = Flow({"upstream": {"slots": "auto"}, "envoy": LONG_LEASE,
                 "routing": {"scheduler": {"settings": {"serial": {"reservedSlots": 2}}}}}, upstream=upstream)
    with caplog.at_level("INFO", logger="llamaswap.runtime.slot_learning"):
        await flow.coordinator.learn_slots()  # the upstream cannot tell
    assert flow.coordinator.scheduler.policy.gpus[0].slots.default == 1
    assert "does not say how many slots it has; scheduling with 1" in caplog.text
    upstream.slots_answer = 2
    caplog.clear()
    with caplog.at_level("INFO", logger="llamaswap.runtime.slot_learning"):
        await flow.coordinator.learn_slots()
    slots = flow.coordinator.scheduler.policy.gpus[0].slots
    assert (slots.default, slots.reserved) == (2, 1)
    assert "too few for 2 reserved" in caplog.text and "reserving 1" in caplog.text


@virtual_time
async def test_configured_slots_never_ask_the_upstream() -> None:
    flow = slots_flow(2)
    await flow.coordinator.learn_slots()
    assert "total_slots" not in [name for name, _ in flow.upstream.calls]


@virtual_time
async def test_auto_slots_in_router_mode_are_asked_for_each_model_once_it_is_loaded() -> None:
    upstream = FakeUpstream(router("a", "b", "c"))
    flow = Flow({"upstream": {"slots": "auto"}, "envoy": LONG_LEASE, "models": {"c": {"slots": 1}}},
                upstream=upstream)
    await flow.coordinator.learn_slots()  # nothing loaded: nothing to ask about
    assert flow.coordinator.scheduler.policy.gpus[0].slots.default == 1
    assert [model for name, model in upstream.calls if name == "total_slots"] == []
    upstream.slots_answer = {"a": 3, "b": 2, "c": 4}
    flow.coordinator.observe_catalog(router("a", "b", "c", loaded="a"),
                                     flow.coordinator.scheduler.dispatches_on("gpu0"), "gpu0")
    flow.coordinator.observe_catalog(router("a", "b", "c", loaded="a"),
                                     flow.coordinator.scheduler.dispatches_on("gpu0"), "gpu0")
    await flow.idle()
    slots = flow.coordinator.scheduler.policy.gpus[0].slots
    assert (slots.of("a"), slots.of("b")) == (3, 3)  # b not asked yet: the last number learnt
    flow.coordinator.observe_catalog(router("a", "b", "c", loaded="b"),
                                     flow.coordinator.scheduler.dispatches_on("gpu0"), "gpu0")
    await flow.idle()
    flow.coordinator.observe_catalog(router("a", "b", "c", loaded="c"),
                                     flow.coordinator.scheduler.dispatches_on("gpu0"), "gpu0")
    await flow.idle()
    slots = flow.coordinator.scheduler.policy.gpus[0].slots
    assert (slots.of("a"), slots.of("b"), slots.of("c")) == (3, 2, 1)  # c's configured slots win
    # Each model asked once, by name, only while loaded, and never one whose slots are configured.
    assert [model for name, model in upstream.calls if name == "total_slots"] == ["a", "b"]
    requests = [await flow.arrive(f"r{i}", model="a") for i in range(4)]
    assert [r.granted for r in requests] == [True, True, True, False]


@virtual_time
async def test_auto_slots_learnt_while_a_reload_applies_are_applied() -> None:
    """The answer comes back after a reload replaced the settings it was asked under (issue 25:
    it was stored but never applied)."""
    upstream = FakeUpstream()
    upstream.slots_answer = 3
    flow = Flow({"upstream": {"slots": "auto"}, "envoy": LONG_LEASE}, upstream=upstream)
    upstream.slots_gate = asyncio.Event()  # the ask is under way while the reload applies
    asking = asyncio.ensure_future(flow.coordinator.learn_slots())
    await flow.idle()
    assert ("total_slots", None) in upstream.calls
    flow.coordinator.reconfigure(parse_config({"upstream": {"slots": "auto"}, "envoy": LONG_LEASE,
                                               "routing": {"scheduler": {"maxQueued": 50}}}))
    upstream.slots_gate.set()
    await asking
    assert flow.coordinator.scheduler.policy.gpus[0].slots.default == 3
    assert flow.coordinator.scheduler.policy.max_queued == 50


@virtual_time
async def test_auto_slots_of_a_model_swapped_in_under_steady_traffic_are_learnt_while_it_runs() -> None:
    """Router mode: the GPU is never idle, yet the model swapped in gets its own slots (issue 25:
    it kept the last model's until the GPU was idle once)."""
    upstream = FakeUpstream(router("a", "b", loaded="a"))
    upstream.slots_answer = {"a": 2, "b": 4}
    flow = Flow({"upstream": {"slots": "auto"}, "envoy": LONG_LEASE}, upstream=upstream)
    await flow.coordinator.learn_slots()
    await flow.idle()
    assert flow.coordinator.scheduler.policy.gpus[0].slots.of("a") == 2
    a1 = await flow.arrive("a1", "normal", "a")
    b1 = await flow.arrive("b1", "interactive", "b")
    b_more = [await flow.arrive(f"b{i}", "normal", "b") for i in range(2, 5)]
    await flow.complete(a1)
    assert b1.granted and b1.ticket.decision.swap
    upstream.catalog_answer = router("a", "b", loaded="b")  # the upstream has swapped
    await flow.advance(LEARN_POLL_MAX_S)
    assert flow.coordinator.scheduler.policy.gpus[0].slots.of("b") == 4
    assert b1.outcome is None and all(r.granted for r in b_more)  # four of b at once, beside b1
    assert ("total_slots", "b") in upstream.calls


@virtual_time
async def test_auto_slots_are_not_asked_of_a_model_before_the_upstream_has_it_loaded() -> None:
    upstream = FakeUpstream(router("a", "b", loaded="a"))
    upstream.slots_answer = {"a": 2, "b": 4}
    flow = Flow({"upstream": {"slots": "auto"}, "envoy": LONG_LEASE}, upstream=upstream)
    await flow.coordinator.learn_slots()
    b1 = await flow.arrive("b1", model="b")
    assert b1.granted
    await flow.advance(LEARN_POLL_MAX_S)  # the catalog still says a: b is not asked about (it would load)
    assert [model for name, model in upstream.calls if name == "total_slots"] == ["a"]
    await flow.complete(b1)
    await flow.advance(10 * LEARN_POLL_MAX_S)  # b ended before it was seen loaded: the asking stops
    calls = len(upstream.calls)
    await flow.advance(10 * LEARN_POLL_MAX_S)
    assert len(upstream.calls) == calls
