"""The serial and fifo schedulers: the specification's tables and the decision records."""

from __future__ import annotations


import pytest

from core_lines import core_lines
from policies import fifo, serial
from reference import residents

from llamaswap.core import (
    Band,
    ManualClock,
    Policy,
    Priority,
    PrioritySource,
    QueueFull,
    Scheduler,
    SchedulerError,
    UnknownRequest,
    band_of,
    parse_priority,
)

S = 1_000_000_000  # ns per second
MIN = 60 * S


def score_of(s: Scheduler, request_id: str) -> float:
    return next(w.score for w in s.snapshot().waiting if w.request_id == request_id)


def waiting_ids(s: Scheduler) -> list[str]:
    return [w.request_id for w in s.snapshot().waiting]


def P(value: int) -> Priority:
    return Priority(value, PrioritySource.NUMBER)


def make(policy: Policy | None = None) -> tuple[Scheduler, ManualClock]:
    clock = ManualClock()
    return Scheduler(policy if policy is not None else serial(), clock), clock


def dispatch_all(scheduler: Scheduler, clock: ManualClock | None = None, step_s: float = 0.0) -> list[str]:
    """Dispatch and release until the queue is empty; returns the grant order."""
    order = []
    while (decision := scheduler.next()) is not None:
        order.append(decision.request_id)
        if clock is not None and step_s:
            clock.advance(step_s)
        scheduler.release(decision.request_id)
    assert scheduler.depth == 0
    return order


# -- the specification's tables ------------------------------------------------------------


@pytest.mark.parametrize("policy", [serial(), serial(60, 0), serial(0, 99), fifo()])
def test_tier_offsets_order_inside_the_batch_band_and_stay_behind_normal(policy):
    s, clock = make(policy)
    # free, pro and max batch jobs arrive first, a normal request last.
    for rid, prio in [("free", -100), ("pro", -99), ("max", -98), ("normal", 0)]:
        s.enqueue(rid, P(prio))
        clock.advance(1)
    assert dispatch_all(s, clock, step_s=5) == ["normal", "max", "pro", "free"]


def test_tier_offsets_with_headers_and_models():
    s, clock = make(serial(60, 10))
    s.set_residents(frozenset({"qwen"}), as_of=s.dispatches_on("gpu0"), gpu="gpu0")
    s.enqueue("free", parse_priority("-100"), "qwen")
    s.enqueue("pro", parse_priority("-99"), "qwen")
    s.enqueue("max", parse_priority("-98"), "qwen")
    clock.advance(30)
    # Another model, so no affinity for it: the max member's batch job with the
    # bonus (-98 + 10 + aging) still stays below any normal request.
    s.enqueue("normal", parse_priority("normal"), "llama")
    assert dispatch_all(s) == ["normal", "max", "pro", "free"]


def test_batch_overtakes_normal_traffic_that_arrived_more_than_100_minutes_later():
    s, clock = make(serial(60, 10))
    s.enqueue("batch", parse_priority("batch"))
    arrivals_min = [30, 60, 99, 101, 130, 200]
    for minute in arrivals_min:
        clock.set_ns(minute * MIN)
        s.enqueue(f"n{minute}", parse_priority("normal"))
    clock.set_ns(300 * MIN)
    # Step time between dispatches too: the order must not depend on when dispatch runs.
    assert dispatch_all(s, clock, step_s=17 * 60) == ["n30", "n60", "n99", "batch", "n101", "n130", "n200"]


@pytest.mark.parametrize(
    ("gap_ns", "first", "reordered"),
    [
        (100 * MIN + S, "batch", {"aging"}),  # more than 100 minutes later: batch goes first
        (100 * MIN + 1, "batch", {"aging"}),  # one nanosecond more
        (100 * MIN, "batch", {"aging"}),  # equal scores keep arrival order
        (100 * MIN - 1, "normal", set()),  # one nanosecond less
        (99 * MIN, "normal", set()),
        (0, "normal", set()),
    ],
)
def test_batch_versus_normal_at_the_100_minute_boundary(gap_ns, first, reordered):
    s, clock = make(serial(60, 10))
    s.enqueue("batch", P(-100))
    clock.set_ns(gap_ns)
    s.enqueue("normal", P(0))
    clock.advance(5 * 60)
    decision = s.next()
    assert decision.request_id == first
    assert decision.reordered_by == frozenset(reordered)
    waited = clock.now_ns() - (0 if first == "batch" else gap_ns)
    assert decision.queue_wait_ns == waited
    assert decision.score == pytest.approx((-100 if first == "batch" else 0) + waited / (60 * S))


def test_batch_never_overtakes_normal_without_aging():
    s, clock = make(serial(0, 10))
    s.enqueue("batch", P(-100))
    clock.advance(10 * 24 * 3600)
    s.enqueue("normal", P(0))
    d = s.next()
    assert d.request_id == "normal"
    assert d.aging == 0.0
    assert d.reordered_by == frozenset()


@pytest.mark.parametrize(
    ("favoured", "rival"),
    [
        (-100, 0),  # batch with the bonus: -1, still behind normal
        (0, 100),  # normal with the bonus: 99, still behind interactive
        (-100, -1),  # -1 against -1: equal scores, the earlier arrival keeps its place
    ],
)
def test_swap_affinity_never_lifts_a_request_into_the_next_band(favoured, rival):
    s, _ = make(serial(60, 99))
    s.set_residents(frozenset({"loaded"}), as_of=s.dispatches_on("gpu0"), gpu="gpu0")
    s.enqueue("rival", P(rival), "other")  # arrives first
    s.enqueue("favoured", P(favoured), "loaded")
    d = s.next()
    assert d.request_id == "rival"
    assert d.band is band_of(rival)
    assert d.reordered_by == frozenset()


def test_swap_affinity_at_99_cannot_beat_the_next_anchor_even_arriving_first():
    s, _ = make(serial(60, 99))
    s.set_residents(frozenset({"loaded"}), as_of=s.dispatches_on("gpu0"), gpu="gpu0")
    s.enqueue("batch-loaded", P(-100), "loaded")
    s.enqueue("normal-loaded", P(0), "loaded")
    s.enqueue("normal-other", P(0), "other")
    s.enqueue("interactive-other", P(100), "other")
    order = dispatch_all(s)
    assert order.index("interactive-other") < order.index("normal-loaded")
    assert order.index("normal-other") < order.index("batch-loaded")


def test_swap_affinity_breaks_near_ties_inside_a_band():
    s, _ = make(serial(60, 10))
    s.set_residents(frozenset({"a"}), as_of=s.dispatches_on("gpu0"), gpu="gpu0")
    s.enqueue("b-first", P(5), "b")
    s.enqueue("a-second", P(0), "a")
    d = s.next()
    assert d.request_id == "a-second"
    assert d.swap_affinity is True
    assert d.swap is False
    assert d.score == 10.0


@pytest.mark.parametrize("divisor", [0, 0.5, 60])
@pytest.mark.parametrize("priority", [0, -100, 100, 7])
def test_bonus_zero_with_uniform_priorities_is_exact_fifo(divisor, priority):
    s, clock = make(serial(divisor, 0))
    models = ["a", "b", None, "c"]
    expected, granted = [], []
    rid = 0
    # Interleave arrivals, dispatches and clock steps; loaded models change all the time.
    for round_ in range(40):
        for _ in range(round_ % 3 + 1):
            name = f"r{rid}"
            s.enqueue(name, P(priority), models[rid % len(models)])
            expected.append(name)
            rid += 1
            clock.advance((rid * 7) % 5)
        s.set_residents(residents(models[(round_ * 3) % len(models)]), as_of=s.dispatches_on("gpu0"), gpu="gpu0")
        d = s.next()
        if d is not None:
            granted.append(d.request_id)
            assert d.swap_affinity is False
            assert d.reordered_by == frozenset()
            assert d.overtook == ()
            s.release(d.request_id)
    granted += dispatch_all(s, clock, 1)
    assert granted == expected


def test_fifo_adds_model_priority_to_the_header():
    s, clock = make(fifo({"m10": 10, "m0": 0, "mneg": -5}))
    s.enqueue("m10-batch", parse_priority("batch"), "m10")  # -90
    assert score_of(s, "m10-batch") == -90
    s.enqueue("m0-minus91", P(-91), "m0")  # -91
    s.enqueue("mneg-minus85", P(-85), "mneg")  # -90, arrived later
    s.enqueue("none-minus89", P(-89), None)  # -89, no model: header only
    s.enqueue("unknown-minus90", P(-90), "not-configured")  # -90, model priority 0
    d = s.next()
    assert (d.request_id, d.score, d.priority, d.band) == ("none-minus89", -89, -89, Band.BATCH)
    s.release(d.request_id)
    order = dispatch_all(s)
    assert order == ["m10-batch", "mneg-minus85", "unknown-minus90", "m0-minus91"]


def test_fifo_model_priority_can_cross_bands_by_configuration():
    s, _ = make(fifo({"vip": 200}))
    s.enqueue("interactive", parse_priority("interactive"), "plain")
    s.enqueue("vip-batch", parse_priority("batch"), "vip")  # -100 + 200 = 100: ties, arrival decides
    s.enqueue("vip-normal", parse_priority("normal"), "vip")  # 200
    d = s.next()
    assert d.request_id == "vip-normal"
    assert d.priority == 0  # the record keeps the caller's priority
    assert d.band is Band.NORMAL
    assert d.score == 200
    s.release("vip-normal")
    assert dispatch_all(s) == ["interactive", "vip-batch"]


def test_fifo_has_no_aging_and_no_affinity():
    s, clock = make(fifo({"a": 0, "b": 0}))
    s.set_residents(frozenset({"a"}), as_of=s.dispatches_on("gpu0"), gpu="gpu0")
    s.enqueue("old-batch", P(-100), "a")
    s.enqueue("b-first", P(0), "b")
    clock.advance(365 * 24 * 3600)  # a year of waiting ages nothing
    s.enqueue("a-second", P(0), "a")  # same score as b-first, model loaded: no bonus
    clock.advance(60)
    d = s.next()
    assert d.request_id == "b-first"
    assert d.swap_affinity is False
    assert d.aging == 0.0
    assert d.score == 0
    assert d.swap is True
    assert d.reordered_by == frozenset()
    s.release(d.request_id)
    assert dispatch_all(s) == ["a-second", "old-batch"]


# -- grant, release, cancel ----------------------------------------------------------------


def test_non_preemptive_one_grant_at_a_time():
    s, clock = make()
    s.enqueue("batch", P(-100))
    first = s.next()
    assert first.request_id == "batch"
    assert next(s.running_ids(), None) == "batch"
    assert s.running_grants == (first,)
    s.enqueue("interactive", P(100))
    clock.advance(3600)
    assert s.next() is None  # the batch job keeps the grant
    assert s.next() is None
    assert s.depth == 1
    released = s.release("batch")
    assert released.request_id == "batch"
    assert released.run_ns == 3600 * S
    assert next(s.running_ids(), None) is None and s.running_grants == ()
    assert s.next().request_id == "interactive"


def test_next_on_an_empty_queue_is_none():
    s, _ = make()
    assert s.next() is None
    assert next(s.running_ids(), None) is None


def test_release_of_a_non_holder_raises():
    s, _ = make()
    with pytest.raises(UnknownRequest):
        s.release("nobody")  # nothing running
    s.enqueue("a", P(0))
    s.enqueue("b", P(0))
    with pytest.raises(UnknownRequest):
        s.release("a")  # waiting, not running
    assert s.next().request_id == "a"
    with pytest.raises(UnknownRequest):
        s.release("b")  # waiting while a runs
    with pytest.raises(UnknownRequest):
        s.release("zzz")
    assert next(s.running_ids(), None) == "a"  # a failed release changes nothing
    s.release("a")
    with pytest.raises(UnknownRequest):
        s.release("a")  # twice
    assert issubclass(UnknownRequest, SchedulerError)


def test_cancel_waiting_unknown_and_running():
    s, clock = make()
    s.enqueue("a", P(-100), "m")
    clock.advance(2)
    s.enqueue("b", P(0))
    s.enqueue("c", P(100))
    clock.advance(3)
    removed = s.cancel("a")
    assert removed is not None
    assert (removed.request_id, removed.priority, removed.band, removed.model) == ("a", -100, Band.BATCH, "m")
    assert removed.queue_wait_ns == 5 * S
    assert s.depth == 2 and "a" not in waiting_ids(s)
    assert s.cancel("a") is None  # twice
    assert s.cancel("never-seen") is None
    d = s.next()
    assert d.request_id == "c"
    assert s.cancel("c") is None  # running, not waiting
    assert next(s.running_ids(), None) == "c"
    s.release("c")
    assert dispatch_all(s) == ["b"]


def test_cancelled_top_is_never_granted_and_id_can_return():
    s, _ = make()
    s.enqueue("top", P(100))
    s.enqueue("low", P(0))
    s.cancel("top")
    assert s.next().request_id == "low"
    s.release("low")
    s.enqueue("top", P(-5))  # same id again after cancel
    assert s.next().request_id == "top"


def test_duplicate_ids_are_refused():
    s, _ = make()
    s.enqueue("x", P(0))
    with pytest.raises(SchedulerError):
        s.enqueue("x", P(5))
    s.next()
    with pytest.raises(SchedulerError):
        s.enqueue("x", P(5))  # running
    assert s.depth == 0


def test_drain_removes_everything_in_arrival_order():
    s, _ = make()
    for rid, prio in [("a", 0), ("b", 100), ("c", -100)]:
        s.enqueue(rid, P(prio))
    assert s.next().request_id == "b"
    removed = s.drain()
    assert [r.request_id for r in removed] == ["a", "c"]
    assert s.depth == 0 and next(s.running_ids(), None) == "b"


# -- decision records ----------------------------------------------------------------------


def test_decision_record_fields():
    s, clock = make(serial(60, 10))
    s.set_residents(frozenset({"qwen"}), as_of=s.dispatches_on("gpu0"), gpu="gpu0")
    s.enqueue("early", P(0), "llama")
    clock.advance(90)
    s.enqueue("chat", parse_priority("interactive"), "qwen")
    clock.advance(2.5)
    d = s.next()
    assert d.request_id == "chat"
    assert d.priority == 100
    assert d.band is Band.INTERACTIVE
    assert d.queue_wait_ns == 2_500_000_000
    assert d.model == "qwen"
    assert d.swap_affinity is True
    assert d.aging == pytest.approx(2.5 / 60)
    assert d.score == pytest.approx(100 + 10 + 2.5 / 60)
    assert d.swap is False
    assert d.residents_before == {"qwen"}
    assert d.reordered_by == frozenset()
    assert d.overtook == ("early",)
    assert d.queue_depth_after == 1
    s.release("chat")
    d2 = s.next()
    assert d2.request_id == "early"
    assert d2.swap is True and d2.residents_before == {"qwen"} and d2.model == "llama"
    assert d2.swap_affinity is False
    assert d2.aging == pytest.approx(92.5 / 60)
    assert d2.score == pytest.approx(92.5 / 60)
    assert d2.overtook == ()
    assert d2.queue_depth_after == 0
    assert s.residents_on("gpu0") == frozenset({"llama"})


def test_loaded_model_follows_dispatch_and_set_loaded_model_overrides():
    s, _ = make(serial(60, 10))
    assert s.residents_on("gpu0") == frozenset()
    s.enqueue("a1", P(0), "a")
    d = s.next()
    assert d.load is True and d.swap is False and d.residents_before == frozenset() and d.swap_affinity is False
    assert s.residents_on("gpu0") == frozenset({"a"})
    s.release("a1")
    s.enqueue("nomodel", P(0), None)
    d = s.next()
    assert d.swap is False and d.model is None
    assert s.residents_on("gpu0") == frozenset({"a"})  # a request without a model leaves it alone
    s.release("nomodel")
    s.set_residents(frozenset({"b"}), as_of=s.dispatches_on("gpu0"), gpu="gpu0")  # the upstream says otherwise
    assert s.residents_on("gpu0") == frozenset({"b"})
    s.enqueue("a2", P(5), "a")
    s.enqueue("b1", P(0), "b")
    d = s.next()
    assert d.request_id == "b1" and d.swap_affinity is True and d.residents_before == {"b"}
    s.release("b1")
    s.set_residents(frozenset(), as_of=s.dispatches_on("gpu0"), gpu="gpu0")
    d = s.next()
    assert d.request_id == "a2" and d.load is True and d.swap is False and d.residents_before == frozenset()


def test_reordered_by_nothing():
    s, clock = make(serial(60, 10))
    s.set_residents(frozenset({"a"}), as_of=s.dispatches_on("gpu0"), gpu="gpu0")
    s.enqueue("best", P(100), "a")  # best by priority, with or without either term
    s.enqueue("other", P(0), "b")
    clock.advance(600)
    d = s.next()
    assert d.request_id == "best"
    assert d.reordered_by == frozenset()


def test_reordered_by_aging_only():
    s, clock = make(serial(60, 10))
    s.enqueue("old", P(0))
    clock.advance(120)  # two points of aging
    s.enqueue("new", P(1))
    d = s.next()
    assert d.request_id == "old"  # 2 > 1; without aging "new" wins, the bonus plays no part
    assert d.reordered_by == frozenset({"aging"})
    assert d.aging == pytest.approx(2.0)
    assert d.swap_affinity is False


def test_reordered_by_swap_affinity_only():
    s, _ = make(serial(60, 10))
    s.set_residents(frozenset({"a"}), as_of=s.dispatches_on("gpu0"), gpu="gpu0")
    s.enqueue("other", P(5), "b")
    s.enqueue("loaded", P(0), "a")  # same instant: no aging difference
    d = s.next()
    assert d.request_id == "loaded"  # 10 > 5; without the bonus "other" wins
    assert d.reordered_by == frozenset({"swap_affinity"})
    assert d.swap_affinity is True
    assert d.overtook == ("other",)


def test_reordered_by_aging_and_swap_affinity():
    s, clock = make(serial(60, 10))
    s.set_residents(frozenset({"a"}), as_of=s.dispatches_on("gpu0"), gpu="gpu0")
    s.enqueue("winner", P(0), "a")
    clock.advance(180)  # 3 points: 0 + 10 + 3 = 13
    s.enqueue("rival", P(12), "b")  # 12; wins without aging (10 < 12) and without bonus (3 < 12)
    d = s.next()
    assert d.request_id == "winner"
    assert d.score == pytest.approx(13.0)
    assert d.reordered_by == frozenset({"aging", "swap_affinity"})


def test_an_aging_reorder_with_a_model_loaded_is_not_an_affinity_reorder():
    s, clock = make(serial(60, 10))
    s.set_residents(frozenset({"a"}), as_of=s.dispatches_on("gpu0"), gpu="gpu0")  # nobody waiting uses it
    s.enqueue("aged", P(0), "b")
    clock.advance(20 * 60)  # 20 points
    s.enqueue("fresh", P(5), "c")
    d = s.next()
    assert d.request_id == "aged"
    # Without the bonus the pick is the same; only aging changed it.
    assert d.reordered_by == frozenset({"aging"})


def test_reorders_are_not_counted_when_the_term_is_off():
    s, clock = make(serial(0, 0))
    s.set_residents(frozenset({"a"}), as_of=s.dispatches_on("gpu0"), gpu="gpu0")
    s.enqueue("x", P(0), "b")
    clock.advance(1000)
    s.enqueue("y", P(0), "a")
    d = s.next()
    assert d.request_id == "x"
    assert d.reordered_by == frozenset()
    assert d.swap_affinity is False  # bonus 0: affinity never applies


def test_overtook_lists_earlier_waiting_arrivals_up_to_16():
    s, _ = make()
    for i in range(20):
        s.enqueue(f"n{i}", P(0))
    s.cancel("n3")
    s.enqueue("vip", P(100))
    d = s.next()
    assert d.request_id == "vip"
    expected = [f"n{i}" for i in range(20) if i != 3][:16]
    assert list(d.overtook) == expected
    s.release("vip")
    d = s.next()
    assert d.request_id == "n0" and d.overtook == ()


# -- limits --------------------------------------------------------------------------------


def test_max_queued_raises_queue_full():
    s, _ = make(serial(max_queued=2))
    assert s.enqueue("a", P(0)).depth == 0
    assert s.enqueue("b", P(0)).depth == 1
    with pytest.raises(QueueFull) as info:
        s.enqueue("c", P(100))
    assert (info.value.depth, info.value.limit) == (2, 2)
    assert isinstance(info.value, SchedulerError)
    assert s.depth == 2 and "c" not in waiting_ids(s)
    assert s.next().request_id == "a"  # the running request does not count
    assert s.enqueue("c", P(100)).depth == 1
    with pytest.raises(QueueFull):
        s.enqueue("d", P(0))
    assert s.cancel("b") is not None
    assert s.enqueue("d", P(0)).depth == 1


def test_unlimited_queue_by_default():
    s, _ = make()
    for i in range(5000):
        s.enqueue(f"r{i}", P(0))
    assert s.depth == 5000


def test_max_wait_expires_overdue_requests():
    s, clock = make(serial(max_wait_s=30))
    assert s.next_deadline_ns() is None  # nothing waiting
    s.enqueue("a", P(-100))
    clock.advance(10)
    s.enqueue("b", P(0))
    s.enqueue("c", P(100))
    assert s.next_deadline_ns() == 30 * S
    clock.set_ns(30 * S - 1)
    assert s.expire_overdue() == []
    clock.advance(5)
    expired = s.expire_overdue()
    assert [r.request_id for r in expired] == ["a"]
    assert expired[0].queue_wait_ns == 35 * S - 1
    assert expired[0].band is Band.BATCH
    assert s.depth == 2 and "a" not in waiting_ids(s)
    assert s.next_deadline_ns() == 40 * S
    s.cancel("b")  # the oldest leaves: the deadline moves on
    assert s.next_deadline_ns() == 40 * S  # c arrived with b
    d = s.next()
    assert d.request_id == "c"
    clock.advance(3600)
    assert s.expire_overdue() == []  # the running request never expires
    assert s.next_deadline_ns() is None
    assert next(s.running_ids(), None) == "c"


def test_expire_at_next_deadline_makes_progress():
    # A timer armed for next_deadline_ns() must find something to expire when it fires.
    s, clock = make(serial(max_wait_s=2.5))
    for i in range(5):
        s.enqueue(f"r{i}", P(0))
        clock.advance(1)
    seen = []
    while (deadline := s.next_deadline_ns()) is not None:
        clock.set_ns(max(deadline, clock.now_ns()))
        expired = s.expire_overdue()
        assert expired, "fired at the deadline and expired nothing"
        seen += [r.request_id for r in expired]
        assert all(r.queue_wait_ns >= 2_500_000_000 for r in expired)
    assert seen == [f"r{i}" for i in range(5)]


def test_no_wait_limit_never_expires():
    s, clock = make(serial(max_wait_s=0))
    s.enqueue("a", P(0))
    clock.advance(10**7)
    assert s.expire_overdue() == []
    assert s.next_deadline_ns() is None
    assert s.depth == 1


# -- reconfigure ---------------------------------------------------------------------------


def test_reconfigure_keeps_the_queue_and_arrival_times():
    s, clock = make(serial(60, 10))
    s.enqueue("m10-batch", P(-100), "m10")
    clock.advance(60 * 60)  # 60 points of aging for the batch job
    s.enqueue("plain-normal", P(-50), "x")
    s.enqueue("m0-normal", P(-95), "m0")
    # serial: -100 + 60 = -40 beats -50 and -95
    assert [w.request_id for w in s.snapshot().waiting] == ["m10-batch", "plain-normal", "m0-normal"]
    s.reconfigure(fifo({"m10": 10, "m0": 50}))
    assert s.depth == 3
    assert s.policy.name == "fifo"
    # fifo: -90, -50, -45; no aging
    assert [w.request_id for w in s.snapshot().waiting] == ["m0-normal", "plain-normal", "m10-batch"]
    clock.advance(1)
    d = s.next()
    assert d.request_id == "m0-normal" and d.score == -45 and d.queue_wait_ns == S
    s.release(d.request_id)
    s.reconfigure(serial(1, 0))  # back to serial: one point per second of waiting
    d = s.next()
    assert d.request_id == "m10-batch"
    assert d.queue_wait_ns == 3601 * S  # arrival time kept across both reconfigurations
    assert d.score == pytest.approx(-100 + 3601)


def test_reconfigure_aging_off_and_on():
    s, clock = make(serial(60, 10))
    s.enqueue("old", P(0))
    clock.advance(600)
    s.enqueue("new", P(5))
    s.reconfigure(serial(0, 10))
    assert score_of(s, "old") == 0 and score_of(s, "new") == 5
    assert [w.request_id for w in s.snapshot().waiting] == ["new", "old"]
    s.reconfigure(serial(60, 10))
    assert score_of(s, "old") == pytest.approx(10.0)
    d = s.next()
    assert d.request_id == "old" and d.reordered_by == frozenset({"aging"})


def test_reconfigure_to_a_smaller_limit_keeps_what_waits():
    s, _ = make()
    for i in range(4):
        s.enqueue(f"r{i}", P(0))
    s.reconfigure(serial(max_queued=2))
    assert s.depth == 4
    with pytest.raises(QueueFull):
        s.enqueue("r4", P(0))
    assert dispatch_all(s) == ["r0", "r1", "r2", "r3"]


# -- snapshot and band statistics ----------------------------------------------------------


def _mixed_queue(s: Scheduler, clock: ManualClock, models=("a", "b", None)) -> None:
    prios = [-100, -99, -98, 0, 1, 100, 0, -100, 50, -50, 3, 0]
    for i, prio in enumerate(prios * 3):
        s.enqueue(f"r{i}", P(prio), models[i % len(models)])
        clock.advance(37 * (i % 4))


@pytest.mark.parametrize("policy", [serial(60, 0), serial(1, 0), serial(0, 0),
                                    fifo({"a": 20, "b": -20})])
def test_snapshot_order_equals_dispatch_order(policy):
    s, clock = make(policy)
    s.set_residents(frozenset({"a"}), as_of=s.dispatches_on("gpu0"), gpu="gpu0")
    _mixed_queue(s, clock)
    snap = s.snapshot()
    assert [w.position for w in snap.waiting] == list(range(1, len(snap.waiting) + 1))
    scores = [w.score for w in snap.waiting]
    assert scores == sorted(scores, reverse=True)  # without the bonus, the order is by current score
    assert snap.policy == policy.name
    assert dispatch_all(s, clock, step_s=45) == [w.request_id for w in snap.waiting]


@pytest.mark.parametrize("policy", [serial(60, 10), serial(1, 99), serial(0, 5)])
@pytest.mark.parametrize("loaded", ["a", "b", None])
def test_snapshot_order_equals_dispatch_order_with_affinity_and_model_switches(policy, loaded):
    s, clock = make(policy)
    s.set_residents(residents(loaded), as_of=s.dispatches_on("gpu0"), gpu="gpu0")
    _mixed_queue(s, clock, models=("a", "b", None, "c", "a"))
    expected = [w.request_id for w in s.snapshot().waiting]
    assert dispatch_all(s, clock, step_s=120) == expected


def test_snapshot_order_equals_dispatch_order_with_affinity_on_one_model():
    s, clock = make(serial(60, 10))
    s.set_residents(frozenset({"a"}), as_of=s.dispatches_on("gpu0"), gpu="gpu0")
    _mixed_queue(s, clock, models=("a", None))  # dispatch never changes the loaded model
    expected = [w.request_id for w in s.snapshot().waiting]
    assert dispatch_all(s, clock, step_s=300) == expected


def test_snapshot_order_equals_dispatch_order_when_dispatch_switches_the_model():
    s, _ = make(serial(60, 10))
    s.set_residents(frozenset({"a"}), as_of=s.dispatches_on("gpu0"), gpu="gpu0")
    s.enqueue("r1", P(20), "b")
    s.enqueue("r2", P(5), "a")
    s.enqueue("r3", P(0), "b")
    snap = s.snapshot()
    # r1 goes first and loads b; then r3 (0 + 10) beats r2 (5, no longer loaded).
    assert [w.request_id for w in snap.waiting] == ["r1", "r3", "r2"]
    assert [w.position for w in snap.waiting] == [1, 2, 3]
    # Each score is the one it has at its turn in this order: r3 gets the bonus because r1 will
    # have loaded b by then, r2 loses it. (They used to be scored against today's model, which
    # showed r3 at 0 ranked above r2 at 15.)
    assert [w.score for w in snap.waiting] == [20.0, 10.0, 5.0]
    assert [w.swap_affinity for w in snap.waiting] == [False, True, False]
    assert dispatch_all(s) == ["r1", "r3", "r2"]


def test_snapshot_views():
    s, clock = make(serial(60, 10))
    s.enqueue("run", P(100), "a")
    clock.advance(4)
    s.next()
    s.enqueue("w1", P(0), "a")
    clock.advance(6)
    s.enqueue("w2", P(-100), "b")
    clock.advance(30)
    snap = s.snapshot()
    assert snap.gpus[0].resident_models == ("a",)
    assert snap.running is not None
    r = snap.running
    assert (r.request_id, r.priority, r.band, r.model) == ("run", 100, Band.INTERACTIVE, "a")
    assert r.queue_wait_s == 4.0 and r.running_s == 36.0
    assert r.score == pytest.approx(100 + 4 / 60)
    w1, w2 = snap.waiting
    assert (w1.request_id, w1.position, w1.priority, w1.band, w1.model) == ("w1", 1, 0, Band.NORMAL, "a")
    assert w1.waited_s == 36.0
    assert w1.score == pytest.approx(10 + 36 / 60)
    assert score_of(s, "w1") == pytest.approx(w1.score)
    assert (w2.request_id, w2.position, w2.band) == ("w2", 2, Band.BATCH)
    assert w2.waited_s == 30.0
    assert w2.score == pytest.approx(-100 + 0.5)
    assert "run" not in waiting_ids(s) and "nobody" not in waiting_ids(s)
    # a snapshot is a picture: later changes do not touch it
    s.cancel("w1")
    assert len(snap.waiting) == 2
    assert snap.bands[Band.NORMAL].depth == 1


def test_band_stats_depth_and_oldest_wait():
    s, clock = make()
    stats = s.band_stats()
    assert set(stats) == set(Band)
    assert all(v.depth == 0 and v.oldest_wait_s == 0.0 for v in stats.values())
    s.enqueue("b1", P(-100))
    clock.advance(10)
    s.enqueue("n1", P(0))
    s.enqueue("b2", P(-98))
    clock.advance(5)
    s.enqueue("i1", P(100))
    s.enqueue("n2", P(49))
    clock.advance(1)
    stats = s.band_stats()
    assert {b: v.depth for b, v in stats.items()} == {Band.BATCH: 2, Band.NORMAL: 2, Band.INTERACTIVE: 1}
    assert {b: v.depth for b, v in s.band_stats().items()} == {Band.BATCH: 2, Band.NORMAL: 2, Band.INTERACTIVE: 1}
    assert stats[Band.BATCH].oldest_wait_s == 16.0
    assert stats[Band.NORMAL].oldest_wait_s == 6.0
    assert stats[Band.INTERACTIVE].oldest_wait_s == 1.0
    s.cancel("b1")  # the oldest batch leaves: the next oldest is b2
    d = s.next()  # i1 runs: interactive is empty now
    assert d.request_id == "i1"
    clock.advance(4)
    stats = s.band_stats()
    assert stats[Band.BATCH].depth == 1 and stats[Band.BATCH].oldest_wait_s == 10.0
    assert stats[Band.INTERACTIVE].depth == 0 and stats[Band.INTERACTIVE].oldest_wait_s == 0.0
    assert stats[Band.NORMAL].depth == 2 and stats[Band.NORMAL].oldest_wait_s == 10.0
    s.release("i1")
    assert s.next().request_id == "n2"  # 49 beats the older 0
    stats = s.band_stats()
    assert stats[Band.NORMAL].depth == 1 and stats[Band.NORMAL].oldest_wait_s == 10.0


def test_band_stats_survive_compaction():
    # Enough removals to make the heaps compact themselves; the counts must still add up.
    s, clock = make()
    for i in range(3000):
        s.enqueue(f"r{i}", P([-100, 0, 100][i % 3]))
        clock.advance(1)
    for i in range(0, 3000, 2):
        s.cancel(f"r{i}")
    assert s.depth == 1500
    depths = {b: v.depth for b, v in s.band_stats().items()}
    assert sum(depths.values()) == 1500
    assert depths == {Band.INTERACTIVE: 500, Band.NORMAL: 500, Band.BATCH: 500}
    stats = s.band_stats()
    # r_i arrived at t=i with priority [-100, 0, 100][i % 3]; the odd ones live on.
    assert stats[Band.NORMAL].oldest_wait_s == 3000 - 1  # r1
    assert stats[Band.BATCH].oldest_wait_s == 3000 - 3  # r3
    assert stats[Band.INTERACTIVE].oldest_wait_s == 3000 - 5  # r5
    living = [i for i in range(3000) if i % 2]
    expected = [f"r{i}" for band in (2, 1, 0) for i in living if i % 3 == band]
    assert dispatch_all(s) == expected


# -- cost ----------------------------------------------------------------------------------


def _core_lines_per_dispatch(waiting: int, *, old_request_first: bool, dispatches: int = 20) -> float:
    """Python lines the core executes per next()+release(), counted with a tracer.

    Heap operations run in C and count nothing, so an O(log n) dispatch executes a number
    of lines that does not depend on the queue's length; a scan over entries does.
    """
    s, _ = make(serial(60, 10))
    if old_request_first:
        s.enqueue("old-batch", P(-100))  # waits while normal traffic passes it
    for i in range(waiting):
        s.enqueue(f"n{i}", P(0))
    for _ in range(waiting // 4):  # granted and gone, but not yet compacted away
        s.release(s.next().request_id)
    last: list[str] = []

    def dispatch() -> None:
        for _ in range(dispatches):
            d = s.next()
            assert d is not None
            s.release(d.request_id)
            last[:] = [d.request_id]

    count = core_lines(dispatch)
    assert last[0].startswith("n")
    return count / dispatches


def test_dispatch_cost_does_not_grow_with_the_queue():
    small = _core_lines_per_dispatch(1_000, old_request_first=False)
    large = _core_lines_per_dispatch(10_000, old_request_first=False)
    assert small > 0
    assert large <= 2 * small + 20


def test_dispatch_cost_does_not_grow_behind_an_old_waiting_request():
    small = _core_lines_per_dispatch(1_000, old_request_first=True)
    large = _core_lines_per_dispatch(10_000, old_request_first=True)
    assert small > 0
    assert large <= 2 * small + 20


# -- what the upstream reports, and what a failed dispatch leaves --------------------------


def test_a_loaded_model_report_asked_before_a_grant_is_dropped():
    """The reconcile race: a /models answer in flight across a grant and its release must not
    overwrite the model that grant just loaded."""
    s, _ = make(serial(60, 10))
    assert s.set_residents(frozenset({"a"}), as_of=s.dispatches_on("gpu0"), gpu="gpu0")
    asked_at = s.dispatches_on("gpu0")  # the reconcile loop sends GET /models now ...
    s.enqueue("b1", P(0), "b")
    s.next()
    s.release("b1")  # ... and b is loaded by the time the answer (still "a") arrives
    assert not s.set_residents(frozenset({"a"}), as_of=asked_at, gpu="gpu0")
    assert s.residents_on("gpu0") == frozenset({"b"})
    assert s.set_residents(frozenset(), as_of=s.dispatches_on("gpu0"), gpu="gpu0")  # a fresh answer applies
    assert s.residents_on("gpu0") == frozenset()


def test_a_loaded_model_report_while_a_request_runs_is_dropped():
    s, _ = make(serial(60, 10))
    s.enqueue("b1", P(0), "b")
    s.next()
    assert not s.set_residents(frozenset({"a"}), as_of=s.dispatches_on("gpu0"), gpu="gpu0")
    assert s.residents_on("gpu0") == frozenset({"b"})


def test_a_failed_dispatch_does_not_leave_its_model_loaded():
    s, _ = make(serial(60, 10))
    s.enqueue("a1", P(0), "a")
    s.next()
    s.release("a1")
    s.enqueue("bogus", P(0), "no-such-model")
    d = s.next()
    assert d.swap is True and s.residents_on("gpu0") == frozenset({"no-such-model"})
    s.release("bogus", model_loaded=False)
    assert s.residents_on("gpu0") == frozenset()  # unknown until the upstream says, not the bogus name
    s.enqueue("a2", P(0), "a")
    assert s.next().load is True  # from unknown: a load, not a swap


def test_loads_and_swaps_are_told_apart():
    s, _ = make(serial(60, 10))
    kinds = []
    for rid, model in [("r1", "a"), ("r2", "a"), ("r3", None), ("r4", "b"), ("r5", "a")]:
        s.enqueue(rid, P(0), model)
        d = s.next()
        kinds.append((d.load, d.swap))
        s.release(rid)
    assert kinds == [(True, False), (False, False), (False, False), (False, True), (False, True)]


def test_drain_resets_the_queue_and_it_works_afterwards():
    s, clock = make(serial(60, 10))
    for i in range(50):
        s.enqueue(f"r{i}", P(i % 7), "a" if i % 2 else "b")
    removed = s.drain()
    assert [r.request_id for r in removed] == [f"r{i}" for i in range(50)]
    assert s.depth == 0 and s.snapshot().waiting == ()
    assert all(stats.depth == 0 for stats in s.band_stats().values())
    s.enqueue("after", P(0), "a")
    assert s.next().request_id == "after"


def test_a_grant_that_never_reached_the_upstream_changes_no_loaded_model():
    s, _ = make(serial(60, 10))
    s.enqueue("a1", P(0), "a")
    s.next()
    s.release("a1")
    s.enqueue("b1", P(0), "b")
    assert s.next().swap is True and s.residents_on("gpu0") == frozenset({"b"})
    s.release("b1", reached_upstream=False)  # its client left as it was granted
    assert s.residents_on("gpu0") == frozenset({"a"})
