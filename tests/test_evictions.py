"""Several resident models in the runtime (issue 37), on the fake clock (tests/flow.py): a grant
that evicts resident models is held until the upstream has unloaded them (`runtime/evictions.py`),
a failed unload answers 503 and never lets the load through, a client may leave meanwhile, and
the resident set, settles and slot learning read every resident model."""

from __future__ import annotations

import asyncio
import dataclasses


from flow import FakeUpstream, Flow, virtual_time
from llamaswap.core import Outcome
from llamaswap.core.residency import Residency
from llamaswap.runtime.evictions import UNLOAD_TIMEOUT_S
from llamaswap.runtime.observer import SettleReason
from llamaswap.runtime.ticket import ExchangeEnd, ExchangeReport
from llamaswap.runtime.upstream import Catalog, UpstreamKind

MODELS = ("a", "b", "c", "d")


def loaded(*models: str) -> Catalog:
    """A router that lists MODELS and has ``models`` loaded."""
    return Catalog(UpstreamKind.ROUTER, frozenset(MODELS), frozenset(models), True)


def resident_flow(upstream: FakeUpstream, *, max_loaded: int = 2, slots: int | str = 1, **config: object) -> Flow:
    """A node of one GPU that keeps up to ``max_loaded`` models resident (the scheduler's policy
    told so directly: the configuration's maxLoaded is not what is tested here), with what the
    upstream's catalog says loaded accepted."""
    flow = Flow({"upstream": {"slots": slots}, "envoy": {"leaseSeconds": 3}, **config}, upstream=upstream)
    scheduler = flow.coordinator.scheduler
    policy = scheduler.policy
    scheduler.reconfigure(policy.with_gpus(tuple(dataclasses.replace(gpu, residency=Residency(max_loaded))
                                                 for gpu in policy.gpus)))
    if upstream.catalog_answer is not None:
        flow.coordinator.observe_catalog(upstream.catalog_answer, scheduler.dispatches_on("gpu0"), "gpu0")
    return flow


def gated(*models: str) -> FakeUpstream:
    upstream = FakeUpstream(loaded(*models))
    upstream.unload_gate = asyncio.Event()
    return upstream


@virtual_time
async def test_several_loaded_are_accepted_as_the_resident_set() -> None:
    flow = resident_flow(FakeUpstream(loaded("a", "b")))
    assert flow.coordinator.scheduler.residents_on("gpu0") == {"a", "b"}
    a = await flow.arrive("a1", model="a")
    b = await flow.arrive("b1", model="b")
    assert a.granted and b.granted  # each in its own model's slot, no swap, no unload
    assert not a.ticket.decision.model_load and not b.ticket.decision.model_load  # type: ignore[union-attr]
    assert flow.upstream.unload_calls == []


@virtual_time
async def test_with_room_for_one_model_a_swap_evicts_it_and_unloads_nothing() -> None:
    """One rule (issue 45): with room for one model the load evicts the idle resident one, and the
    upstream replaces it by itself (`Residency.replaces_by_itself`): nothing is unloaded first."""
    flow = resident_flow(FakeUpstream(loaded("a")), max_loaded=1)
    b = await flow.arrive("b1", model="b")
    decision = b.ticket.decision
    assert b.granted and decision is not None and decision.swap and decision.evicts == ()
    assert flow.coordinator.scheduler.residents_on("gpu0") == {"b"}
    assert flow.upstream.unload_calls == []


@virtual_time
async def test_a_load_with_room_goes_at_once() -> None:
    flow = resident_flow(FakeUpstream(loaded("a")))
    c = await flow.arrive("c1", model="c")
    assert c.granted and c.ticket.decision.evicts == ()  # type: ignore[union-attr]
    assert flow.upstream.unload_calls == []


@virtual_time
async def test_a_grant_that_evicts_goes_once_the_model_is_unloaded() -> None:
    upstream = gated("a", "b")
    flow = resident_flow(upstream)
    c = await flow.arrive("c1", model="c")
    assert c.waiting and upstream.unload_calls == ["a"]  # granted, held while "a" unloads
    decision = flow.coordinator.scheduler.running_grants[0]
    assert [eviction.model for eviction in decision.evicts] == ["a"]
    await flow.advance(10.0)  # longer than the lease: it is held for the unload, not lapsed
    assert c.waiting and flow.recorder.outcomes() == {}
    assert upstream.unload_gate is not None
    upstream.unload_gate.set()
    await flow.idle()
    assert c.granted
    await flow.advance(2.0)  # its lease counts from now
    assert c.ticket.outcome is None
    await flow.complete(c)
    assert flow.recorder.outcomes() == {"c1": Outcome.SERVED}


@virtual_time
async def test_a_failed_unload_answers_503_and_reads_the_models_again() -> None:
    upstream = FakeUpstream(loaded("a", "b"))
    upstream.unloads = False
    flow = resident_flow(upstream)
    asked = upstream.catalog_calls
    c = await flow.arrive("c1", model="c")
    refusal = c.refusal
    assert (refusal.outcome, refusal.model, refusal.evicting) == (Outcome.UPSTREAM_ERROR, "c", "a")
    assert flow.recorder.outcomes() == {"c1": Outcome.UPSTREAM_ERROR}
    assert flow.coordinator.scheduler.running_grants == ()
    assert upstream.catalog_calls == asked + 1  # what it has loaded, read again
    assert flow.coordinator.scheduler.residents_on("gpu0") == {"a", "b"}


@virtual_time
async def test_the_grants_beside_an_evicting_load_wait_for_it_and_fail_with_it() -> None:
    upstream = gated("a", "b")
    upstream.unloads = False
    flow = resident_flow(upstream, slots=2)
    first = await flow.arrive("c1", model="c")
    second = await flow.arrive("c2", model="c")
    assert first.waiting and second.waiting
    assert flow.coordinator.scheduler.running_grants[1].ready_at is not None
    assert upstream.unload_calls == ["a"]  # one unload for both
    assert upstream.unload_gate is not None
    upstream.unload_gate.set()
    await flow.idle()
    assert first.refusal.evicting == second.refusal.evicting == "a"
    assert flow.recorder.outcomes() == {"c1": Outcome.UPSTREAM_ERROR, "c2": Outcome.UPSTREAM_ERROR}


@virtual_time
async def test_the_grants_beside_an_evicting_load_go_with_it() -> None:
    upstream = gated("a", "b")
    flow = resident_flow(upstream, slots=2)
    first = await flow.arrive("c1", model="c")
    second = await flow.arrive("c2", model="c")
    assert first.waiting and second.waiting
    assert upstream.unload_gate is not None
    upstream.unload_gate.set()
    await flow.idle()
    assert first.granted and second.granted


@virtual_time
async def test_a_resident_model_goes_while_another_unloads() -> None:
    upstream = gated("a", "b")
    flow = resident_flow(upstream, slots=2)
    c = await flow.arrive("c1", model="c")
    b = await flow.arrive("b1", model="b")
    assert c.waiting and b.granted  # "b" stays: nothing to wait for


@virtual_time
async def test_a_busy_model_is_never_unloaded() -> None:
    upstream = gated("a", "b")
    flow = resident_flow(upstream)
    a = await flow.arrive("a1", model="a")
    assert a.granted
    c = await flow.arrive("c1", model="c")
    assert upstream.unload_calls == ["b"]  # "a" runs: the idle one goes
    assert upstream.unload_gate is not None
    upstream.unload_gate.set()
    await flow.idle()
    assert c.granted


@virtual_time
async def test_a_client_that_leaves_during_the_unload_leaves_it_running() -> None:
    upstream = gated("a", "b")
    flow = resident_flow(upstream)
    c = await flow.arrive("c1", model="c")
    await flow.cancel(c)
    assert flow.recorder.outcomes() == {"c1": Outcome.CANCELLED_WAITING}
    assert flow.coordinator.scheduler.running_grants == ()
    assert flow.coordinator.scheduler.residents_on("gpu0") == {"b"}  # "a" is going, "c" never came
    d = await flow.arrive("d1", model="d")  # room now: its load waits for the unload under way
    assert d.waiting and upstream.unload_calls == ["a"]
    assert upstream.unload_gate is not None
    upstream.unload_gate.set()
    await flow.idle()
    assert d.granted


@virtual_time
async def test_an_unload_that_fails_after_its_client_left_counts_the_model_again() -> None:
    """Nobody waits for the unload when it fails: the scheduler still counts the model again (it
    counted it gone at the grant), or a later load would make the router evict by itself."""
    upstream = gated("a", "b")
    flow = resident_flow(upstream)
    c = await flow.arrive("c1", model="c")
    await flow.cancel(c)
    assert flow.coordinator.scheduler.residents_on("gpu0") == {"b"}
    upstream.unloads = False
    assert upstream.unload_gate is not None
    upstream.unload_gate.set()
    await flow.idle()
    assert flow.coordinator.scheduler.residents_on("gpu0") == {"a", "b"}
    await flow.arrive("d1", model="d")  # no room now: it must evict explicitly again (and fails again)
    await flow.idle()
    assert len(upstream.unload_calls) == 2 and flow.recorder.outcomes()["d1"] is Outcome.UPSTREAM_ERROR
    assert flow.coordinator.scheduler.residents_on("gpu0") == {"a", "b"}


@virtual_time
async def test_a_grant_whose_client_left_a_moment_before_still_unloads() -> None:
    """Granted as Envoy cancels its Check (before the handler's clean-up): the scheduler counts the
    evicted model gone, so the unload happens all the same."""
    upstream = FakeUpstream(loaded("a", "b"))
    flow = resident_flow(upstream)
    a = await flow.arrive("a1", model="a")
    b = await flow.arrive("b1", model="b")
    c = await flow.arrive("c1", model="c")
    assert a.granted and b.granted and c.waiting  # every resident model busy: "c" waits
    c.task.cancel()
    flow.coordinator.report(a.ticket.token, ExchangeReport(final=True, end=ExchangeEnd.COMPLETE, status=200,
                                                                     first_byte_s=None))
    await flow.idle()
    assert flow.recorder.outcomes()["c1"] is Outcome.CANCELLED_WAITING
    assert upstream.unload_calls == ["a"]
    assert flow.coordinator.scheduler.residents_on("gpu0") == {"b"}


@virtual_time
async def test_the_unloads_are_bounded_by_a_deadline() -> None:
    upstream = FakeUpstream(loaded("a", "b"))
    flow = resident_flow(upstream)
    assert flow.coordinator._evictions.timeout_s == UNLOAD_TIMEOUT_S  # what the adapter is given
    seen: list[float] = []

    async def unload(model: str, *, timeout_s: float) -> bool:
        seen.append(timeout_s)
        return True

    upstream.unload = unload  # type: ignore[method-assign]
    c = await flow.arrive("c1", model="c")
    assert c.granted and seen == [UNLOAD_TIMEOUT_S]


@virtual_time
async def test_an_unload_that_raises_is_a_failed_unload() -> None:
    upstream = FakeUpstream(loaded("a", "b"))
    flow = resident_flow(upstream)

    async def unload(model: str, *, timeout_s: float) -> bool:
        raise ConnectionError("refused")

    upstream.unload = unload  # type: ignore[method-assign]
    c = await flow.arrive("c1", model="c")
    assert c.refusal.outcome is Outcome.UPSTREAM_ERROR


@virtual_time
async def test_an_abandoned_generation_settles_only_its_own_model() -> None:
    upstream = FakeUpstream(loaded("a", "b"), busy=1)
    flow = resident_flow(upstream, slots=2)
    a = await flow.arrive("a1", model="a")
    b = await flow.arrive("b1", model="b")
    await flow.end(a, ExchangeEnd.CLIENT_LEFT)
    await flow.idle()
    settling = flow.coordinator.gpus.named("gpu0").settling
    assert settling is not None and settling.model == "a"
    assert upstream.busy_calls and set(upstream.busy_calls) == {"a"}  # "b"'s process is not asked about
    upstream.busy_answer = 0
    await flow.advance(1.0)
    assert flow.coordinator.gpus.named("gpu0").settling is None
    assert b.granted and b.ticket.outcome is None  # "b" ran on beside the settle of "a"


@virtual_time
async def test_a_startup_settle_asks_about_every_loaded_model() -> None:
    upstream = FakeUpstream(loaded("a", "b"), busy=0)
    flow = resident_flow(upstream)
    flow.coordinator.begin_startup_settle()
    await flow.advance(1.0)
    assert upstream.busy_calls[0] is None  # several loaded: no one model stands for the GPU
    settled = [s for s in flow.recorder.settles if s.reason is SettleReason.STARTUP]
    assert settled and settled[0].model is None
    assert flow.coordinator.scheduler.residents_on("gpu0") == {"a", "b"}  # read from the catalog, accepted


@virtual_time
async def test_slot_learning_asks_each_resident_model() -> None:
    upstream = FakeUpstream(loaded("a", "b"))
    upstream.slots_answer = {"a": 2, "b": 3}
    flow = resident_flow(upstream, slots="auto")
    await flow.idle()
    learnt = flow.coordinator.gpus.named("gpu0").slots.learnt
    assert learnt == {"a": 2, "b": 3}
    assert sorted(model for name, model in upstream.calls if name == "total_slots") == ["a", "b"]


@virtual_time
async def test_after_a_failed_unload_beside_running_work_the_models_read_again_are_accepted() -> None:
    upstream = FakeUpstream(loaded("a", "b"))
    upstream.unloads = False
    flow = resident_flow(upstream)
    a = await flow.arrive("a1", model="a")
    c = await flow.arrive("c1", model="c")
    assert a.granted and c.refusal.evicting == "b"
    await flow.idle()
    # "b" is still loaded (its unload failed): a load of "c" now would make the router evict by itself.
    assert flow.coordinator.scheduler.residents_on("gpu0") == {"a", "b"}


@virtual_time
async def test_a_model_that_can_never_fit_beside_the_pinned_ones_is_refused_at_once() -> None:
    upstream = FakeUpstream(loaded("a", "b"))
    flow = Flow({"upstream": {"slots": 1}}, upstream=upstream)
    scheduler = flow.coordinator.scheduler
    policy = scheduler.policy
    scheduler.reconfigure(policy.with_gpus(tuple(
        dataclasses.replace(gpu, residency=Residency(2, frozenset({"a", "b"}))) for gpu in policy.gpus)))
    c = await flow.arrive("c1", model="c")  # both places pinned: "c" would wait for ever
    assert c.refusal.outcome is Outcome.REJECTED_UNKNOWN_MODEL
    a = await flow.arrive("a1", model="a")
    assert a.granted
