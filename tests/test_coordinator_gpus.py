"""The coordinator over a node of two GPUs (`upstreams:`, issue 27), on the fake clock
(tests/flow.py): grants go to a GPU by the node rule and say which; a settle or an adopted
exchange holds its own GPU only; catalogs, learnt slots and single-model servers are per GPU."""

from __future__ import annotations

from flow import FakeUpstream, Flow, router, single, virtual_time
from llamaswap.core import Outcome
from llamaswap.runtime.ticket import ExchangeEnd, ExchangeReport

LONG_LEASE = {"leaseSeconds": 1000}


def two_gpus(*upstreams: FakeUpstream, slots: int | str = 1, models: tuple[list[str] | None, ...] = (None, None),
             **extra: object) -> Flow:
    entries = []
    for index, allowed in enumerate(models):
        entry: dict[str, object] = {"name": f"gpu{index}", "url": f"http://127.0.0.1:{8081 + index}", "slots": slots}
        if allowed is not None:
            entry["models"] = allowed
        entries.append(entry)
    fakes = list(upstreams) or [FakeUpstream(), FakeUpstream()]
    return Flow({"upstreams": entries, "envoy": LONG_LEASE, **extra}, upstreams=fakes)


def on(flow: Flow, request_id: str) -> str:
    decision = flow.requests[request_id].ticket.decision
    assert decision is not None, f"{request_id} was not granted"
    return decision.gpu


@virtual_time
async def test_two_models_run_at_once_on_the_two_gpus() -> None:
    flow = two_gpus()
    a = await flow.arrive("a", model="qwen")
    b = await flow.arrive("b", model="llama")
    c = await flow.arrive("c", model="qwen")
    assert a.granted and b.granted and c.waiting
    assert {on(flow, "a"), on(flow, "b")} == {"gpu0", "gpu1"}
    await flow.complete(b)  # llama's GPU frees: the next qwen request takes it
    assert c.granted and on(flow, "c") == on(flow, "b")
    await flow.complete(a)
    await flow.complete(c)
    assert flow.recorder.outcomes() == {"a": Outcome.SERVED, "b": Outcome.SERVED, "c": Outcome.SERVED}


@virtual_time
async def test_a_request_goes_to_the_gpu_that_has_its_model_loaded() -> None:
    gpu0, gpu1 = FakeUpstream(router("qwen", "llama")), FakeUpstream(router("qwen", "llama"))
    flow = two_gpus(gpu0, gpu1)
    flow.coordinator.observe_catalog(router("qwen", "llama", loaded="llama"), 0, "gpu1")
    flow.coordinator.observe_catalog(router("qwen", "llama", loaded="qwen"), 0, "gpu0")
    await flow.arrive("l", model="llama")
    await flow.arrive("q", model="qwen")
    assert on(flow, "l") == "gpu1" and on(flow, "q") == "gpu0"
    assert not flow.requests["l"].ticket.decision.model_load  # type: ignore[union-attr]


@virtual_time
async def test_an_abandoned_generation_settles_its_own_gpu_while_the_other_serves() -> None:
    gpu0, gpu1 = FakeUpstream(busy=1), FakeUpstream(busy=0)
    flow = two_gpus(gpu0, gpu1)
    first = await flow.arrive("first", model="m")
    assert on(flow, "first") == "gpu0"
    await flow.end(first, ExchangeEnd.CLIENT_LEFT)  # gpu0 goes on computing it
    await flow.advance(0.1)
    assert flow.coordinator.gpus.named("gpu0").settling is not None
    assert flow.coordinator.gpus.named("gpu1").settling is None
    second = await flow.arrive("second", model="m")
    third = await flow.arrive("third", model="m")
    assert second.granted and on(flow, "second") == "gpu1" and third.waiting
    assert gpu0.busy_calls and not gpu1.busy_calls  # only the abandoned generation's upstream is asked
    gpu0.busy_answer = 0
    await flow.advance(1.0)
    assert third.granted and on(flow, "third") == "gpu0"


@virtual_time
async def test_an_adopted_exchange_holds_the_gpu_envoy_names() -> None:
    flow = two_gpus()
    flow.coordinator.report("someone-elses", ExchangeReport(final=False, end=None, status=0, first_byte_s=None,
                                                            elapsed_s=1.0, gpu="gpu1"))
    await flow.idle()
    assert flow.coordinator.gpus.named("gpu1").adopted
    one = await flow.arrive("one", model="m")
    two = await flow.arrive("two", model="n")
    assert one.granted and on(flow, "one") == "gpu0" and two.waiting
    flow.coordinator.report("someone-elses", ExchangeReport(final=True, end=ExchangeEnd.COMPLETE, status=200,
                                                            first_byte_s=None, gpu="gpu1"))
    await flow.idle()
    assert two.granted and on(flow, "two") == "gpu1"


@virtual_time
async def test_an_exchange_envoy_places_on_no_gpu_of_several_holds_none() -> None:
    """Issue 45 (item 5): no first GPU stands in for a missing name. An earlier process's
    exchange whose entry names no GPU (it reached no upstream) or one this node does not have
    cannot be placed on one of two GPUs: it holds neither, and both keep granting."""
    flow = two_gpus()
    flow.coordinator.report("nowhere", ExchangeReport(final=False, end=None, status=0, first_byte_s=None,
                                                      elapsed_s=1.0))
    flow.coordinator.report("elsewhere", ExchangeReport(final=False, end=None, status=0, first_byte_s=None,
                                                        elapsed_s=1.0, gpu="gpu7"))
    await flow.idle()
    assert not flow.coordinator.gpus.named("gpu0").adopted and not flow.coordinator.gpus.named("gpu1").adopted
    one = await flow.arrive("one", model="m")
    two = await flow.arrive("two", model="n")
    assert one.granted and two.granted and {on(flow, "one"), on(flow, "two")} == {"gpu0", "gpu1"}


@virtual_time
async def test_an_exchange_envoy_places_on_no_gpu_holds_the_one_gpu_of_a_node_of_one() -> None:
    """On a node of one GPU there is nowhere else it can run: it holds that GPU, named as configured."""
    flow = Flow({"upstreams": [{"name": "big", "url": "http://127.0.0.1:8081"}], "envoy": LONG_LEASE})
    flow.coordinator.report("nowhere", ExchangeReport(final=False, end=None, status=0, first_byte_s=None,
                                                      elapsed_s=1.0))
    await flow.idle()
    assert flow.coordinator.gpus.named("big").adopted == ["nowhere"]
    waiting = await flow.arrive("a", model="m")
    assert waiting.waiting


@virtual_time
async def test_a_lapsed_grant_reported_again_holds_the_gpu_it_was_granted() -> None:
    """Our own lapsed grant is placed by its grant, whatever Envoy's entry names: on gpu1, not on
    the configured order's first."""
    flow = two_gpus(envoy={"leaseSeconds": 2})
    first = await flow.arrive("first", model="m")
    second = await flow.arrive("second", model="n")
    lapsing = first if on(flow, "first") == "gpu1" else second
    other = second if lapsing is first else first
    await flow.renew(other)
    await flow.advance(1.5)
    await flow.renew(other)
    await flow.advance(0.6)  # the lapsing one's lease is over; the other's is renewed
    assert lapsing.outcome is Outcome.LEASE_EXPIRED and other.outcome is None
    await flow.renew(lapsing.ticket.token)  # Envoy still runs it after all (its entry names no GPU)
    assert flow.coordinator.gpus.named("gpu1").adopted == [lapsing.ticket.token]
    assert not flow.coordinator.gpus.named("gpu0").adopted


@virtual_time
async def test_the_scheduler_is_told_what_holds_a_gpu_as_it_begins_and_ends() -> None:
    """Issue 45 (item 2): the core owns the record of what holds each GPU. The runtime tells it at
    the moment a settle or an adoption begins or ends; the scheduler's own holdings say so at
    once, with no read of the coordinator's views, pump or holdings in between."""
    gpu0 = FakeUpstream(busy=1)
    flow = two_gpus(gpu0, FakeUpstream(busy=0))
    scheduler = flow.coordinator.scheduler

    def held(name: str) -> tuple[bool, bool, int]:
        holding = next(holding for holding in scheduler.holdings() if holding.name == name)
        return holding.blocked, holding.settling, holding.adopted

    flow.coordinator.report("foreign", ExchangeReport(final=False, end=None, status=0, first_byte_s=None,
                                                      elapsed_s=1.0, gpu="gpu1"))
    assert held("gpu1") == (True, False, 1) and held("gpu0") == (False, False, 0)
    flow.coordinator.report("foreign", ExchangeReport(final=True, end=ExchangeEnd.COMPLETE, status=200,
                                                      first_byte_s=None, gpu="gpu1"))
    assert held("gpu1") == (False, False, 0)
    first = await flow.arrive("first", model="m")
    assert on(flow, "first") == "gpu0"
    await flow.end(first, ExchangeEnd.CLIENT_LEFT)  # gpu0 goes on computing it: a settle of m begins
    # (Room for one model: the upstream would replace m by itself, so the settle holds the whole GPU.)
    assert held("gpu0") == (True, True, 0)
    gpu0.busy_answer = 0
    await flow.advance(1.0)
    assert flow.coordinator.gpus.named("gpu0").settling is None and held("gpu0") == (False, False, 0)


@virtual_time
async def test_slots_are_learnt_per_gpu() -> None:
    gpu0, gpu1 = FakeUpstream(single("m")), FakeUpstream(single("m"))
    gpu0.slots_answer, gpu1.slots_answer = 2, 1
    flow = two_gpus(gpu0, gpu1, slots="auto")
    await flow.coordinator.learn_slots()
    scheduler = flow.coordinator.scheduler
    assert [gpu.slots.default for gpu in scheduler.policy.gpus] == [2, 1]
    requests = [await flow.arrive(f"r{i}", model="m") for i in range(4)]
    assert [r.granted for r in requests] == [True, True, True, False]
    assert sorted(on(flow, f"r{i}") for i in range(3)) == ["gpu0", "gpu0", "gpu1"]


@virtual_time
async def test_single_model_servers_get_only_their_model() -> None:
    gpu0, gpu1 = FakeUpstream(single("qwen")), FakeUpstream(single("llama"))
    flow = two_gpus(gpu0, gpu1)
    flow.coordinator.observe_catalog(single("qwen"), 0, "gpu0")
    flow.coordinator.observe_catalog(single("llama"), 0, "gpu1")
    l1 = await flow.arrive("l1", model="llama")
    l2 = await flow.arrive("l2", model="llama")
    assert l1.granted and on(flow, "l1") == "gpu1" and l2.waiting  # gpu0 idles: it serves qwen only
    unknown = await flow.arrive("x", model="mistral")
    assert unknown.refusal.outcome is Outcome.REJECTED_UNKNOWN_MODEL


@virtual_time
async def test_single_model_servers_answer_only_the_names_their_entries_list() -> None:
    """Issue 45: where every GPU is a single-model server of the same model, every request is
    scheduled on that model; the entries' ``models`` lists still say which names the GPUs
    answer. A listed alias is served (as the one model), a name no entry lists is refused as
    unknown, as it was before the lists and the scheduler's rule were one (docs/configuration.md:
    ``upstreams[i].models``)."""
    gpu0, gpu1 = FakeUpstream(single("m")), FakeUpstream(single("m"))
    flow = two_gpus(gpu0, gpu1, models=(["m", "alias"], ["m", "alias"]))
    flow.coordinator.observe_catalog(single("m"), 0, "gpu0")
    flow.coordinator.observe_catalog(single("m"), 0, "gpu1")
    alias = await flow.arrive("alias", model="alias")
    assert alias.granted and alias.ticket.schedule_model == "m"
    unlisted = await flow.arrive("unlisted", model="other")
    assert unlisted.refusal.outcome is Outcome.REJECTED_UNKNOWN_MODEL


@virtual_time
async def test_a_model_goes_only_where_the_configuration_lets_it() -> None:
    flow = two_gpus(models=(["small"], None))
    big1 = await flow.arrive("big1", model="big")
    big2 = await flow.arrive("big2", model="big")
    small = await flow.arrive("small", model="small")
    assert big1.granted and on(flow, "big1") == "gpu1" and big2.waiting
    assert small.granted and on(flow, "small") == "gpu0"


@virtual_time
async def test_reserved_slots_hold_per_gpu_with_each_ones_slots() -> None:
    # upstream.slots stays 1; the entries' 2 and 3 slots carry the reservation of one.
    flow = two_gpus(slots=2, routing={"scheduler": {"settings": {"serial": {"reservedSlots": 1}}}})
    gpus = flow.coordinator.scheduler.policy.gpus
    assert [(gpu.slots.default, gpu.slots.reserved) for gpu in gpus] == [(2, 1), (2, 1)]
    batch = [await flow.arrive(f"b{i}", "batch", "m") for i in range(3)]
    assert [b.granted for b in batch] == [True, True, False]  # one per GPU: the other slot is kept
    chat = await flow.arrive("chat", "interactive", "m")
    assert chat.granted and chat.ticket.decision.reserved_slot  # type: ignore[union-attr]


@virtual_time
async def test_the_grant_reads_a_run_beside_a_load_as_the_estimates_do() -> None:
    # Two slots per GPU, runs 10 s, loads 10 s. x1 loads x on gpu0 at 0 (expected to end at 20);
    # x2, granted beside it at 1, runs once the load ends: until 20, not 11. At 3 gpu0 is full
    # and frees a slot in 17 s, later than a load (10 s): x3 loads x on the idle gpu1. (Read as
    # 10 s from its grant, x2 would free its slot in 8 s and x3 would wait for gpu0.)
    flow = two_gpus(slots=2, estimates={"defaultRunSeconds": 10, "defaultSwapSeconds": 10})
    await flow.arrive("x1", model="x")
    await flow.advance(1)
    await flow.arrive("x2", model="x")
    assert on(flow, "x1") == on(flow, "x2") == "gpu0"
    await flow.advance(2)
    x3 = await flow.arrive("x3", model="x")
    assert x3.granted and on(flow, "x3") == "gpu1"


@virtual_time
async def test_the_estimated_start_reads_every_gpu() -> None:
    # Both GPUs run m (expected 30 s each); gpu0's grant is 10 s older, so the one waiting
    # starts when gpu0 frees: in 20 s.
    flow = two_gpus(estimates={"defaultRunSeconds": 30, "defaultSwapSeconds": 0})
    await flow.arrive("a", model="m")
    await flow.advance(10)
    await flow.arrive("b", model="m")
    waiting = await flow.arrive("c", model="m")
    assert waiting.waiting and {on(flow, "a"), on(flow, "b")} == {"gpu0", "gpu1"}
    found = flow.coordinator.status_of("c")
    assert found is not None
    _, row = found
    assert row.estimated_start_s == 20.0  # type: ignore[union-attr]
    # An adopted exchange on the GPU that frees first holds it for a time nobody can tell: gpu1's end counts.
    # (Adopted as Envoy's entry arrives: the scheduler is told then, and the change makes a new walk.)
    flow.coordinator.report("someone", ExchangeReport(final=False, end=None, status=0, first_byte_s=None,
                                                      elapsed_s=1.0, gpu=on(flow, "a")))
    _, row = flow.coordinator.status_of("c")  # type: ignore[misc]
    assert row.estimated_start_s == 30.0  # type: ignore[union-attr]


@virtual_time
async def test_one_named_upstream_is_a_node_of_one_with_its_own_name_and_slots() -> None:
    upstream = FakeUpstream(busy=2)  # a's generation goes on beside b's
    flow = Flow({"upstreams": [{"name": "big", "url": "http://127.0.0.1:8081", "slots": 2}], "envoy": LONG_LEASE},
                upstreams=[upstream])
    a = await flow.arrive("a", model="m")
    b = await flow.arrive("b", model="m")
    assert a.granted and b.granted  # the entry's 2 slots, not upstream.slots' 1
    assert on(flow, "a") == on(flow, "b") == "big"
    # A generation left behind settles that GPU: the runtime tells the scheduler by its name.
    await flow.end(a, ExchangeEnd.CLIENT_LEFT)
    await flow.advance(0.1)
    assert flow.coordinator.gpus.named("big").settling is not None
    assert [(gpu.name, gpu.settling) for gpu in flow.coordinator.scheduler.holdings()] == [("big", True)]
    c = await flow.arrive("c", model="m")
    assert c.waiting  # nothing is granted beside the settle
    upstream.busy_answer = 1  # only b's now
    await flow.advance(1.0)
    assert c.granted and on(flow, "c") == "big"


@virtual_time
async def test_retry_after_follows_the_gpu_that_can_take_a_request_soonest() -> None:
    """One GPU settles an abandoned generation expected to run 99 s more, the other is full with
    a grant expected to end in 19 s: a refused client comes back when the sooner one frees."""
    flow = two_gpus(FakeUpstream(busy=1), FakeUpstream(busy=0),
                    routing={"scheduler": {"maxQueued": 1}},
                    estimates={"defaultRunSeconds": 100, "defaultSwapSeconds": 0})
    for _ in range(3):
        flow.coordinator.estimator.record("short", run_s=20.0, first_byte_s=None, model_load=False, gpu="gpu1")
    long = await flow.arrive("long", model="long")
    short = await flow.arrive("short", model="short")
    assert on(flow, "long") == "gpu0" and on(flow, "short") == "gpu1"
    await flow.advance(1)
    await flow.end(long, ExchangeEnd.CLIENT_LEFT)  # gpu0 goes on computing it: a settle
    assert (await flow.arrive("waits", model="short")).waiting
    assert flow.coordinator.gpus.named("gpu0").settling is not None and short.granted
    assert (await flow.arrive("refused", model="short")).refusal.retry_after_s == 19


@virtual_time
async def test_a_model_is_served_only_where_a_gpu_that_may_run_it_lists_it() -> None:
    """One rule per GPU (`Gpus.serves`): the GPU the scheduler may send the model to must list it.
    gpu0 lists c, but keeps a and b pinned in its two places, so c can never run there; gpu1 may
    run c, but its upstream does not list it. Refused at once (before, gpu0's list and gpu1's
    place were asked apart, and c was queued for gpu1, whose upstream has no c)."""
    models = {"a": {"pinned": True}, "b": {"pinned": True}}
    gpu0, gpu1 = FakeUpstream(router("a", "b", "c")), FakeUpstream(router("a", "b"))
    entries = [{"name": "gpu0", "url": "http://127.0.0.1:8081", "maxLoaded": 2},
               {"name": "gpu1", "url": "http://127.0.0.1:8082", "models": ["c"]}]
    flow = Flow({"upstreams": entries, "models": models, "envoy": LONG_LEASE}, upstreams=[gpu0, gpu1])
    flow.coordinator.observe_catalog(router("a", "b", "c"), 0, "gpu0")
    flow.coordinator.observe_catalog(router("a", "b"), 0, "gpu1")
    c = await flow.arrive("c", model="c")
    assert c.refusal.outcome is Outcome.REJECTED_UNKNOWN_MODEL
    gpu1.catalog_answer = router("a", "b", "c")  # gpu1's upstream gets c: asked again on a miss
    again = await flow.arrive("c2", model="c")
    assert again.granted and on(flow, "c2") == "gpu1"
