"""Expected run and swap times per model, and estimated starts along the dispatch order on one GPU
(`estimate_node.starts_of_node` over a node of one; several GPUs: test_estimate_node)."""

from __future__ import annotations

import math
import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llamaswap.core import Estimator, ManualClock, Policy, Priority, PrioritySource, Scheduler, Slots
from llamaswap.core.decisions import QueueSnapshot, RunningView, WaitingView
from llamaswap.core.holding import GpuHolding
from llamaswap.core.estimate import expected_end_s, left_s
from llamaswap.core.estimate_node import starts_of_node
from llamaswap.core.policy import IMPLICIT_GPU, PolicyName
from llamaswap.core.priority import Band


def make(**kwargs: float) -> Estimator:
    return Estimator(default_run_s=kwargs.get("run", 10.0), default_swap_s=kwargs.get("swap", 5.0),
                     samples=int(kwargs.get("samples", 5)))


def residents(model: str | None) -> frozenset[str]:
    return frozenset() if model is None else frozenset((model,))


def starts_on_one_gpu(e: Estimator, models: list[str | None], *, loaded: str | None, busy_s: float = 0.0,
           remaining_s: tuple[float, ...] | list[float] = (), remaining_interactive: tuple[bool, ...] | list[bool] = (),
           slots: Slots | None = None, interactive: list[bool] | None = None) -> list[float]:
    """The estimated starts of a waiting order (``interactive``: which are in that band) on one
    GPU that has ``loaded`` loaded, beside running grants of no model: one per value of
    ``busy_s`` and ``remaining_s`` above 0, each with that time left (`math.inf`: unknown),
    ``remaining_interactive`` saying which serve the interactive band (missing: not)."""
    lefts = [*([busy_s] if busy_s > 0 else []), *remaining_s]
    flags = [*([False] if busy_s > 0 else []), *remaining_interactive,
             *[False] * (len(remaining_s) - len(remaining_interactive))]
    end = e.expected_request_run_s(None, None, IMPLICIT_GPU)
    grants = tuple(RunningView(f"g{i}", 50 if flag else 0, Band.INTERACTIVE if flag else Band.NORMAL, 0.0, None,
                               False, 0.0, end + 1.0 if math.isinf(left) else end - left)
                   for i, (left, flag) in enumerate(zip(lefts, flags, strict=True)))
    bands = interactive if interactive is not None else [False] * len(models)
    waiting = tuple(WaitingView(f"w{i}", i + 1, 0, Band.INTERACTIVE if flag else Band.NORMAL, 0.0, False, 0.0, model)
                    for i, (model, flag) in enumerate(zip(models, bands, strict=True)))
    slots = slots if slots is not None else Slots()
    snapshot = QueueSnapshot(PolicyName.SERIAL, waiting, {}, grants)
    gpu = GpuHolding(IMPLICIT_GPU, slots, None, residents(loaded))
    return [start for start, _ in starts_of_node(e, snapshot, [gpu])]


def starts_of(e: Estimator, s: Scheduler, snapshot: QueueSnapshot | None = None, blocked_s: float = 0.0) -> list[float]:
    """The estimated starts of a scheduler's waiting order (its snapshot), its GPU held by work
    it did not grant for ``blocked_s``."""
    gpus = s.holdings()
    return [start for start, _ in starts_of_node(e, snapshot if snapshot is not None else s.snapshot(), gpus,
                                                 {gpu.name: blocked_s for gpu in gpus})]


def test_defaults_before_any_measurement():
    e = make(run=12.0, swap=3.0)
    assert e.expected_run_s("a") == 12.0
    assert e.expected_swap_s("a") == 3.0
    assert e.expected_run_s(None) == 12.0


def test_run_is_a_rolling_median_of_warm_runs():
    e = make(samples=3)
    for run in (1.0, 100.0, 2.0):  # one runaway generation does not move the median far
        e.record("a", run_s=run, first_byte_s=0.1, model_load=False)
    assert e.expected_run_s("a") == 2.0
    for run in (4.0, 4.0, 4.0):  # only the last 3 count
        e.record("a", run_s=run, first_byte_s=0.1, model_load=False)
    assert e.expected_run_s("a") == 4.0
    assert e.expected_run_s("b") == 10.0  # other models keep the default


def test_swap_cost_is_the_extra_time_to_first_byte_of_a_load():
    e = make()
    e.record("a", run_s=2.0, first_byte_s=0.2, model_load=False)
    e.record("a", run_s=4.0, first_byte_s=2.7, model_load=True)
    assert e.expected_swap_s("a") == pytest.approx(2.5)
    # The run learnt from a load is the run without its load.
    e2 = make(swap=1.0)
    e2.record("b", run_s=5.0, first_byte_s=None, model_load=True)
    assert e2.expected_run_s("b") == pytest.approx(4.0)


def test_unstreamed_loads_measure_the_swap_by_their_run_beyond_their_tokens():
    # Batch clients seldom stream: no first byte times the load, so the default would stay forever.
    e = make(swap=5.0)
    e.record("a", run_s=1.0, first_byte_s=None, model_load=False, max_tokens=1000)  # 1 ms per token
    e.record("a", run_s=0.25, first_byte_s=None, model_load=True, max_tokens=100)  # 0.1 s of tokens + the load
    assert e.expected_swap_s("a") == pytest.approx(0.15)
    # That load's run is learnt without the measured swap, not without the 5 s default.
    assert e.expected_request_run_s("a", 100) == pytest.approx(0.1)
    # Per GPU as the first bytes are: gpu1's own loads are slower.
    e.record("a", run_s=1.0, first_byte_s=None, model_load=False, max_tokens=1000, gpu="gpu1")
    e.record("a", run_s=1.1, first_byte_s=None, model_load=True, max_tokens=100, gpu="gpu1")
    assert e.expected_swap_s("a", "gpu1") == pytest.approx(1.0)


def _grows(tokens: int) -> float:
    """A run whose every token reads the context before it: 0.1 ms a token, plus 0.25 us per token
    of context (this machine's tiny model on one thread: 0.38 s for 1,024 tokens, 4.1 s for 4,000)."""
    return 1e-4 * tokens + 2.5e-7 * tokens * tokens


def test_runs_that_grow_with_the_context_are_fitted_not_scaled_by_their_median_per_token():
    e = make(samples=10)
    for tokens in (300, 1000, 700, 2000, 500, 1200):
        e.record("a", run_s=_grows(tokens), first_byte_s=None, model_load=False, max_tokens=tokens)
    # The median per token (about 0.31 ms) says 1.2 s for 4,000 tokens; they take 4.4 s.
    assert e.expected_request_run_s("a", 4000) == pytest.approx(_grows(4000), rel=1e-6)
    assert e.expected_request_run_s("a", 128) == pytest.approx(_grows(128), rel=1e-6)


def test_a_curve_waits_for_five_runs():
    e = make(samples=10)
    for tokens in (300, 1000, 2000, 500):
        e.record("a", run_s=_grows(tokens), first_byte_s=None, model_load=False, max_tokens=tokens)
    median_per_token = sorted(_grows(n) / n for n in (300, 1000, 2000, 500))[1:3]
    assert e.expected_request_run_s("a", 4000) == pytest.approx(4000 * sum(median_per_token) / 2)
    e.record("a", run_s=_grows(1200), first_byte_s=None, model_load=False, max_tokens=1200)
    assert e.expected_request_run_s("a", 4000) == pytest.approx(_grows(4000), rel=1e-6)


def test_runs_in_proportion_to_their_tokens_keep_the_median_per_token():
    e = make(samples=10)
    for tokens in (300, 1000, 700, 2000, 500, 1200):
        e.record("a", run_s=0.002 * tokens, first_byte_s=None, model_load=False, max_tokens=tokens)
    assert e.expected_request_run_s("a", 4000) == 0.002 * 4000


def test_runs_that_stopped_short_of_their_max_tokens_do_not_bend_the_runs():
    # Two of six stopped early (an end of text well before max_tokens): the median holds, though
    # a least-squares curve through them bends (it would say 1.6 s).
    e = make(samples=10)
    for tokens, run_s in ((1000, 1.0), (2000, 0.2), (4000, 4.0), (500, 0.5), (1500, 0.15), (3000, 3.0)):
        e.record("a", run_s=run_s, first_byte_s=None, model_load=False, max_tokens=tokens)
    assert e.expected_request_run_s("a", 2500) == pytest.approx(2.5)


def test_an_unstreamed_long_load_measures_its_swap_beyond_the_fitted_run():
    e = make(swap=5.0, samples=10)
    for tokens in (300, 1000, 700, 2000, 500, 1200):
        e.record("a", run_s=_grows(tokens), first_byte_s=None, model_load=False, max_tokens=tokens)
    e.record("a", run_s=_grows(4000) + 0.15, first_byte_s=None, model_load=True, max_tokens=4000)
    # By the median per token the load would have measured 3.3 s.
    assert e.expected_swap_s("a") == pytest.approx(0.15, abs=1e-6)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 100_000), st.floats(0.0, 10_000.0)), min_size=1, max_size=12),
       st.integers(1, 100_000))
def test_a_run_by_tokens_is_never_negative_nor_unbounded(runs: list[tuple[int, float]], asked: int):
    e = make(samples=8)
    for tokens, run_s in runs:
        e.record("a", run_s=run_s, first_byte_s=None, model_load=False, max_tokens=tokens)
    expected = e.expected_request_run_s("a", asked)
    assert 0.0 <= expected < math.inf


def test_unstreamed_loads_without_tokens_or_a_run_per_token_keep_the_default_swap():
    e = make(swap=5.0)
    e.record("a", run_s=3.0, first_byte_s=None, model_load=True, max_tokens=100)  # no run per token yet
    e.record("a", run_s=3.0, first_byte_s=None, model_load=True)  # tokens not said
    assert e.expected_swap_s("a") == 5.0


def test_streamed_loads_measure_the_swap_by_their_first_byte_before_unstreamed_runs():
    e = make(swap=5.0)
    e.record("a", run_s=1.0, first_byte_s=0.1, model_load=False, max_tokens=1000)
    e.record("a", run_s=3.0, first_byte_s=None, model_load=True, max_tokens=1000)  # by its run: 2 s
    e.record("a", run_s=1.6, first_byte_s=0.6, model_load=True, max_tokens=1000)  # by its first byte: 0.5 s
    assert e.expected_swap_s("a") == pytest.approx(0.5)


def test_swap_cost_never_negative():
    e = make()
    e.record("a", run_s=1.0, first_byte_s=1.0, model_load=False)
    e.record("a", run_s=1.0, first_byte_s=0.5, model_load=True)
    assert e.expected_swap_s("a") == 0.0


def test_starts_walk_the_order_adding_runs_and_swaps():
    e = make(run=10.0, swap=5.0)
    e.record("a", run_s=2.0, first_byte_s=None, model_load=False)
    e.record("b", run_s=3.0, first_byte_s=None, model_load=False)
    starts = starts_on_one_gpu(e, ["a", "a", "b", None, "a"], loaded="a", busy_s=1.5)
    # a (loaded): 1.5; a: +2; b: +2 -> 5.5, then swap 5 + run 3; None: +10 (default, no swap); a: swap again
    assert starts == [1.5, 3.5, 5.5, 13.5, 23.5]


def test_a_grant_past_its_expected_run_makes_the_starts_behind_it_unknown():
    """Issue 25: an overdue grant still runs; "starts in 0 s" behind it would be known wrong."""
    e = make(run=10.0, swap=5.0)
    assert left_s(expected_end_s(e, "a"), 4.0) == 6.0
    assert left_s(expected_end_s(e, "a"), 10.0) is None
    assert starts_on_one_gpu(e, ["a", "a"], loaded="a", busy_s=math.inf) == [math.inf, math.inf]
    # Two slots, one held for an unknown time: the other still serves the queue, in turn.
    assert starts_on_one_gpu(e, ["a", "a", "b"], loaded="a", remaining_s=[math.inf],
                             slots=Slots(2)) == [0.0, 10.0, math.inf]
    clock = ManualClock()
    s = Scheduler(Policy.serial(aging_divisor_s=60, swap_affinity_bonus=10), clock)
    for name in ("run", "next"):
        s.enqueue(name, Priority(0, PrioritySource.NUMBER), "a")
    s.next()
    clock.advance(30)  # the load and run expected: 15 s
    assert starts_of(e, s) == [math.inf]


def test_remaining_of_a_running_grant():
    e = make(run=10.0, swap=5.0)
    assert left_s(expected_end_s(e, "a"), 4.0) == 6.0
    assert left_s(expected_end_s(e, "a", ready_at=("a", 0.0)), 4.0) == 11.0  # after its own load
    assert left_s(expected_end_s(e, "a"), 40.0) is None  # outrun: for how long, unknown


def test_samples_must_be_positive():
    with pytest.raises(ValueError):
        Estimator(default_run_s=1.0, default_swap_s=1.0, samples=0)


# -- several slots: one server per slot ----------------------------------------------------


def test_with_slots_the_slot_that_frees_first_takes_the_next_request():
    e = make(run=10.0, swap=5.0)
    starts = starts_on_one_gpu(e, ["a", "a", "a", "a"], loaded="a", remaining_s=[3.0], slots=Slots(2))
    # a slot is free now; the next frees at 3 (the running grant), then 10, 13
    assert starts == [0.0, 3.0, 10.0, 13.0]


def test_with_slots_a_swap_waits_until_every_slot_is_free_and_its_model_loads_once():
    e = make(run=10.0, swap=5.0)
    starts = starts_on_one_gpu(e, ["a", "b", "b"], loaded="a", remaining_s=[3.0, 8.0], slots=Slots(2))
    # a takes the slot free at 3 and ends at 13; b waits for both slots (13), loads until 18
    # and runs to 28; the second b starts beside it at 13 (its run begins when the load ends).
    assert starts == [3.0, 13.0, 13.0]
    assert starts_on_one_gpu(e, ["b", "b", "b"], loaded="a", slots=Slots(2)) == [0.0, 0.0, 15.0]


def test_with_slots_the_slots_of_the_model_in_effect_count():
    e = make(run=10.0, swap=5.0)
    starts = starts_on_one_gpu(e, ["a", "a", "b", "b", "b"], loaded="a", slots=Slots(1, {"b": 2}))
    assert starts == [0.0, 10.0, 20.0, 20.0, 35.0]


def test_a_reserved_slot_lets_an_interactive_request_start_before_a_held_back_one():
    e = make(run=10.0, swap=5.0)
    slots = Slots(2, reserved=1)
    # A batch job holds the only slot non-interactive work may use for 100 s.
    assert starts_on_one_gpu(e, ["a", "a"], loaded="a", remaining_s=[100.0], slots=slots,
                    interactive=[False, True]) == [100.0, 0.0]
    # Without knowing who is interactive, nobody takes the reserved slot: one at a time.
    assert starts_on_one_gpu(e, ["a", "a"], loaded="a", remaining_s=[100.0], slots=slots) == [100.0, 110.0]
    # An interactive request that needs another model takes no reserved slot: it is a swap.
    assert starts_on_one_gpu(e, ["a", "b"], loaded="a", remaining_s=[100.0], slots=slots,
                    interactive=[False, True]) == [100.0, 110.0]
    # A running interactive grant does not count against the non-interactive share.
    assert starts_on_one_gpu(e, ["a"], loaded="a", remaining_s=[50.0], remaining_interactive=[True],
                             slots=slots) == [0.0]


def test_starts_of_a_snapshot_walk_its_running_grants_and_order():
    clock = ManualClock()
    s = Scheduler(Policy.serial(aging_divisor_s=60, swap_affinity_bonus=10, slots=Slots(2)), clock)
    s.enqueue("a1", Priority(0, PrioritySource.NUMBER), "a")
    s.next()  # loads a: expected to hold its slot for swap 5 + run 10
    clock.advance(4)
    for rid, model in [("a2", "a"), ("b1", "b"), ("a3", "a")]:
        s.enqueue(rid, Priority(0, PrioritySource.NUMBER), model)
    e = make(run=10.0, swap=5.0)
    snapshot = s.snapshot()
    assert [w.request_id for w in snapshot.waiting] == ["a2", "a3", "b1"]
    # a2 now beside a1 (11 s left), its run once a's load ends (in 1 s) until 11; a3 at 11;
    # b1 once both drain, at 21.
    assert starts_of(e, s, snapshot) == [0.0, 11.0, 21.0]
    # Work the scheduler did not grant (a settle) holds the GPU for 30 s: nothing is granted
    # until it ends (`GpuHolding.blocked`), then a2 and a3 (a1 ended at 11), b1
    # once they drain at 40.
    assert starts_of(e, s, snapshot, 30.0) == [30.0, 30.0, 40.0]
    assert starts_of(e, s, snapshot, math.inf) == [math.inf] * 3  # held for a time unknown


def test_starts_of_wait_for_a_grant_that_runs_alone():
    """Nothing starts beside a running unload (`dispatch.turn`, `Scheduler.next`); the estimate
    waits for it too, though a slot is free and the waiting request needs the loaded model."""
    clock = ManualClock()
    s = Scheduler(Policy.serial(aging_divisor_s=60, swap_affinity_bonus=10, slots=Slots(2)), clock)
    s.set_residents(frozenset({"a"}), as_of=s.dispatches_on("gpu0"), gpu="gpu0")
    s.enqueue("unload", Priority(0, PrioritySource.NUMBER), "a", alone=True)
    assert s.next() is not None
    clock.advance(4)
    s.enqueue("a1", Priority(0, PrioritySource.NUMBER), "a")
    assert s.next() is None  # the rule: nothing beside it
    e = make(run=10.0, swap=5.0)
    assert starts_of(e, s) == [6.0]  # when the unload is expected to end


# -- the walk is what the scheduler does when every grant takes its expected time ------------


@st.composite
def _workloads(draw):
    reserved_room = draw(st.booleans())
    fewest = 2 if reserved_room else 1
    default = draw(st.integers(fewest, 4))
    per_model = draw(st.dictionaries(st.sampled_from("abc"), st.integers(fewest, 4)))
    slots = Slots(default, per_model, draw(st.integers(0, min([default, *per_model.values()]) - 1)))
    fifo = draw(st.booleans())
    policy = (Policy.fifo(model_priorities=draw(st.dictionaries(st.sampled_from("abc"), st.integers(-60, 60))),
                          slots=slots) if fifo
              # No swap-affinity bonus: then the order does not depend on which model is loaded
              # when a reserved slot lets an interactive request go early.
              else Policy.serial(aging_divisor_s=draw(st.sampled_from([0, 1, 60])), swap_affinity_bonus=0,
                                 slots=slots))
    requests = draw(st.lists(st.tuples(st.sampled_from([-100, 0, 49, 50, 100]),
                                       st.sampled_from(["a", "a", "b", "c", None])), max_size=25))
    granted_first = draw(st.integers(0, 4))
    runs = draw(st.fixed_dictionaries({m: st.integers(1, 20) for m in ("a", "b", "c", "")}))
    swaps = draw(st.fixed_dictionaries({m: st.integers(0, 10) for m in ("a", "b", "c")}))
    return policy, requests, granted_first, runs, swaps


@settings(max_examples=300, deadline=None)
@given(_workloads())
def test_estimated_starts_are_the_starts_of_grants_that_take_their_expected_time(workload):
    policy, requests, granted_first, runs, swaps = workload
    e = make(run=1.0, swap=0.0, samples=1)
    for model, run in runs.items():  # whole seconds: every sum below is exact
        e.record(model or None, run_s=float(run), first_byte_s=1.0, model_load=False)
    for model, swap in swaps.items():
        e.record(model, run_s=float(runs[model] + swap), first_byte_s=1.0 + swap, model_load=True)
    assert all(e.expected_swap_s(m) == swaps[m] and e.expected_run_s(m) == runs[m] for m in swaps)
    clock = ManualClock()
    s = Scheduler(policy, clock)
    for index, (priority, model) in enumerate(requests):
        s.enqueue(f"r{index}", Priority(priority, PrioritySource.NUMBER), model)
    ends: dict[str, float] = {}  # running grant -> when it ends
    ready_at = 0.0
    for _ in range(granted_first):  # some already run: they end when the estimator expects
        decision = s.next()
        if decision is not None:  # one made beside a load begins its run when the load ends
            if decision.model_load:
                ready_at = e.expected_swap_s(decision.model)
            ends[decision.request_id] = ready_at + e.expected_run_s(decision.model)
    snapshot = s.snapshot()
    expected = dict(zip([w.request_id for w in snapshot.waiting], starts_of(e, s, snapshot)))

    # Run it: release each grant at its end; grant whatever can start; a grant made while its
    # model loads (after the grant that loads it) begins its run when the load ends.
    starts: dict[str, float] = {}
    now = 0.0
    while s.depth or ends:
        while (decision := s.next()) is not None:
            starts[decision.request_id] = now
            if decision.model_load:
                ready_at = now + e.expected_swap_s(decision.model)
            ends[decision.request_id] = max(now, ready_at) + e.expected_run_s(decision.model)
        now = min(ends.values())
        clock.set_ns(round(now * 1_000_000_000))
        for request_id in [r for r, end in ends.items() if end == now]:
            s.release(request_id)
            del ends[request_id]
    assert starts == expected


def test_starts_of_fill_the_slots_of_the_running_model_while_none_is_known_loaded():
    """After a failed release nothing is known loaded, yet the grants of model a still run: the
    scheduler fills a's slots (`slots_in_effect` reads the running model), and so does the walk."""
    clock = ManualClock()
    s = Scheduler(Policy.serial(aging_divisor_s=60, swap_affinity_bonus=10, slots=Slots(2, {"a": 4})), clock)
    for rid in ("a1", "a2"):
        s.enqueue(rid, Priority(0, PrioritySource.NUMBER), "a")
        assert s.next() is not None
    clock.advance(1)
    s.release("a1", model_loaded=False)  # the upstream failed it: a is not known loaded
    assert s.residents_on("gpu0") == frozenset()
    for rid in ("n1", "n2", "n3", "n4", "n5"):
        s.enqueue(rid, Priority(0, PrioritySource.NUMBER), None)
    assert [s.next() is not None for _ in range(4)] == [True, True, True, False]  # a's 4 slots
    clock.advance(1)
    e = make(run=10.0, swap=5.0)
    for _ in range(3):
        e.record("a", run_s=20.0, first_byte_s=None, model_load=False)
    # a2 has 18 s left, n1..n3 9 s: when they end, a2 still runs, so n4 and n5 both go (4 slots).
    assert starts_of(e, s) == [9.0, 9.0]


def test_starts_of_a_grant_made_beside_a_load_runs_after_the_load():
    """A grant made beside the grant that loads its model begins its run when the load ends (the
    walk reads the ones it starts so), so its slot frees a run after the load, not after its grant."""
    clock = ManualClock()
    s = Scheduler(Policy.serial(aging_divisor_s=0, swap_affinity_bonus=0, slots=Slots(2)), clock)
    for rid, model in (("a0", "a"), ("n1", None), ("n2", None)):
        s.enqueue(rid, Priority(0, PrioritySource.NUMBER), model)
    assert [d.request_id if (d := s.next()) else None for _ in range(3)] == ["a0", "n1", None]
    clock.advance(1)
    e = make(run=2.0, swap=5.0)
    # a0 loads until 5 and runs until 7; n1 waits for the load and also runs until 7.
    assert starts_of(e, s) == [6.0]


def test_starts_of_requests_started_beside_a_load_under_way_run_after_it():
    """The walk starts a request beside a load that is under way: its run, too, begins when
    the load ends, so the slot it takes frees a run after the load."""
    clock = ManualClock()
    s = Scheduler(Policy.serial(aging_divisor_s=0, swap_affinity_bonus=0, slots=Slots(3)), clock)
    for rid, model in (("a0", "a"), ("n1", None)):
        s.enqueue(rid, Priority(0, PrioritySource.NUMBER), model)
        assert s.next() is not None
    clock.advance(1)
    for rid in ("n2", "n3"):
        s.enqueue(rid, Priority(0, PrioritySource.NUMBER), None)
    e = make(run=2.0, swap=5.0)
    # a0 loads until 5 and runs until 7; n1 and n2 (in the free slot now) run 5..7: n3 at 7.
    assert starts_of(e, s) == [0.0, 6.0]


def test_each_gpu_learns_its_own_run_and_swap_the_node_learns_from_all() -> None:
    e = Estimator(default_run_s=9.0, default_swap_s=1.0, samples=5)
    e.record("m", run_s=2.0, first_byte_s=0.5, model_load=False, gpu="fast")
    e.record("m", run_s=8.0, first_byte_s=0.5, model_load=False, gpu="slow")
    e.record("m", run_s=12.0, first_byte_s=4.5, model_load=True, gpu="slow")  # a 4 s load on slow
    assert e.expected_run_s("m", "fast") == 2.0
    assert e.expected_run_s("m", "slow") == 8.0  # its warm run, the load taken off the other
    assert e.expected_swap_s("m", "slow") == 4.0
    assert e.expected_swap_s("m", "fast") == 4.0  # no load seen there: the node's figure
    assert e.expected_run_s("m", "new") == e.expected_run_s("m") == 8.0  # the median of 2, 8 and 8
    assert e.expected_run_s("other", "fast") == 9.0  # nothing known: the default


# Runs as a release gives them: non-negative, repeats likely (the window drops one of equal values).
_RUNS = st.one_of(st.sampled_from([0.0, 0.5, 1.0, 2.0]),
                  st.floats(min_value=0.0, max_value=1e6, allow_nan=False),
                  st.just(math.inf))


@settings(max_examples=300)
@given(runs=st.lists(_RUNS, min_size=1, max_size=40), samples=st.integers(min_value=1, max_value=9))
def test_the_expected_run_is_the_median_of_the_window_after_every_release(runs: list[float], samples: int) -> None:
    # The window is kept sorted as values arrive and leave; its median must be statistics.median's
    # of the same last `samples` runs exactly, after each one.
    e = make(samples=samples)
    for count, run in enumerate(runs, start=1):
        e.record("m", run_s=run, first_byte_s=None, model_load=False)
        assert e.expected_run_s("m") == statistics.median(runs[max(0, count - samples):count])
