"""`llamaswap simulate` reads a running request's end as the runtime does (issue 36 items 1, 3): the
node rule is handed `NodeTimes.of_grants` of the scheduler's running grants (never the replay's
own release times, which the runtime cannot know), and a grant whose run was never recorded holds
its GPU for `estimate.grant_end_s` (its run sized by its `max_tokens`, from the ready time its
grant set: after its own load or the load it was granted beside). Each case checks the runtime's
own rule or figure beside the replay.

Every expected number is worked out by hand in the comments next to it.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from llamaswap.core import Estimator, ManualClock, Outcome, Policy, Priority, PrioritySource, Scheduler, Slots
from llamaswap.core.decisions import Decision
from llamaswap.core.estimate import Figures, grant_end_s
from llamaswap.core.estimate_node import Ends, NodeTimes
from llamaswap.core.policy import GpuPolicy
from llamaswap.simulate import engine
from llamaswap.simulate.engine import FixedCosts, prepare, simulate
from llamaswap.simulate.pods import Routing, simulate_pods
from llamaswap.simulate.records import RequestRecord

S = 1_000_000_000
PRIORITY = Priority(0, PrioritySource.NUMBER)


def sized() -> Estimator:
    """A's load takes 12 s (the default), its run 0.01 s per token asked (median run 10 s)."""
    figures = Estimator(default_run_s=2.0, default_swap_s=12.0, samples=5)
    for _ in range(3):
        figures.record("A", run_s=10.0, first_byte_s=None, model_load=False, max_tokens=1000)
    return figures


def arrival(request_id: str, at_s: float, model: str, *, max_tokens: int | None = None, order: int = 0,
            run_s: float | None = None) -> RequestRecord:
    """A request of a recording; ``run_s``: what it took (None: it never ran)."""
    return RequestRecord(request_id, model, 0, Outcome.SERVED, run_s is not None, at_s * 1000, None, None,
                         None if run_s is None else run_s * 1000, 0.0, False, False, order=order,
                         max_tokens=max_tokens)


def two_gpus(slots: int = 1) -> Policy:
    return Policy.serial(aging_divisor_s=60, swap_affinity_bonus=0).with_gpus(
        (GpuPolicy("gpu0", Slots(slots)), GpuPolicy("gpu1", Slots(slots))))


def replayed(records: list[RequestRecord], policy: Policy, costs: Figures) -> dict[str, tuple[int | None, int | None,
                                                                                           str | None]]:
    """(start, release, upstream) of each request."""
    sim = simulate(prepare(records), policy, costs)
    return {r.request.record.request_id: (r.start_ns, r.release_ns, r.gpu) for r in sim.results}


def rule_times(monkeypatch: pytest.MonkeyPatch, records: list[RequestRecord], policy: Policy,
               costs: Figures) -> dict[str, tuple[float, float]]:
    """What the rule was handed of each GPU's running grants, the first time it read them with
    something running there (`NodeTimes`, the replay's only reading of time): when its first
    slot frees and when it drains, in seconds from the first arrival."""
    seen: dict[str, tuple[float, float]] = {}

    read_at = [0]  # the instant the ends were last read at
    ends_of_grants = engine.ends_of_grants

    def read(grants: Sequence[Decision], now_ns: int, figures: Figures) -> Ends:
        read_at[0] = now_ns
        return ends_of_grants(grants, now_ns, figures)

    class Seen(NodeTimes):
        def _of(self) -> Ends:  # (read once an instant, when the rule first asks)
            ends = super()._of()
            for gpu, lefts in ends.items():
                seen.setdefault(gpu, (read_at[0] / S + min(lefts), read_at[0] / S + max(lefts)))
            return ends

    monkeypatch.setattr(engine, "ends_of_grants", read)
    monkeypatch.setattr(engine, "NodeTimes", Seen)
    simulate(prepare(records), policy, costs)
    return seen


def test_a_grant_never_recorded_holds_its_gpu_as_long_as_the_runtime_expects_by_its_max_tokens() -> None:
    """a1 never ran and asks for 3,000 tokens: it loads A (12 s) and runs 30 s, released at 42 s
    (the model's unsized run, as the replay gave it before, would release it at 22 s). b1 takes
    gpu1 (B: 12 s + 2 s). a2 (A) at 1 s: at 14 s gpu0 frees in 28 s, a load of A on gpu1 takes
    12: it loads A on gpu1."""
    figures = sized()
    records = [arrival("a1", 0, "A", max_tokens=3000, order=0), arrival("b1", 0, "B", order=1),
               arrival("a2", 1, "A", max_tokens=100, order=2)]
    got = replayed(records, two_gpus(), figures)
    assert got["a1"] == (0, 42 * S, "gpu0")
    assert got["b1"] == (0, 14 * S, "gpu1")
    assert got["a2"][::2] == (14 * S, "gpu1")

    # The runtime expects the same grant to end then.
    scheduler = Scheduler(two_gpus(), ManualClock(0))
    scheduler.enqueue("a1", PRIORITY, "A", max_tokens=3000)
    decision = scheduler.next(times=NodeTimes.of_grants(tuple, 0, figures))
    assert decision is not None and grant_end_s(figures, decision) == pytest.approx(42.0)


def test_a_grant_beside_a_load_holds_its_slot_until_the_load_ends_and_its_run_after() -> None:
    """Two slots; A runs 10 s, loads in 5. a1 loads A at 0 (ends at 15 s). a2, granted at 1 s
    beside that load, runs once the load ends: 5 + 10 = 15 s (before: its bare run, 11 s). a3 at
    2 s finds both slots taken and starts when the first frees: at 15 s (before: 11 s)."""
    costs = FixedCosts({"A": 10.0}, {"A": 5.0})
    policy = Policy.serial(aging_divisor_s=60, swap_affinity_bonus=0, slots=Slots(2))
    records = [arrival("a1", 0, "A", order=0), arrival("a2", 1, "A", order=1), arrival("a3", 2, "A", order=2)]
    got = replayed(records, policy, costs)
    assert got["a1"][:2] == (0, 15 * S)
    assert got["a2"][:2] == (1 * S, 15 * S)
    assert got["a3"][:2] == (15 * S, 25 * S)

    # The runtime's figure of a2's grant: 14 s after it.
    clock = ManualClock(0)
    scheduler = Scheduler(policy, clock)
    scheduler.enqueue("a1", PRIORITY, "A")
    assert scheduler.next() is not None
    clock.set_ns(S)
    scheduler.enqueue("a2", PRIORITY, "A")
    decision = scheduler.next()
    assert decision is not None and decision.ready_at == ("A", 0)  # when a1's load ends
    assert grant_end_s(costs, decision) == pytest.approx(14.0)


def test_the_rule_reads_each_grants_expected_end(monkeypatch: pytest.MonkeyPatch) -> None:
    """The times handed to the rule are the grants' `grant_end_s`: a1 at 42 s (sized by its
    3,000 tokens, after its load; it really ran 50 s, which the runtime cannot know), b1 at 14 s.
    Three GPUs: at 1 s a2 (A) may load A on the idle gpu2 or wait for gpu0, so the rule reads
    the times (it reads none while a free slot decides, or while every GPU is full)."""
    records = [arrival("a1", 0, "A", max_tokens=3000, run_s=50, order=0), arrival("b1", 0, "B", order=1),
               arrival("a2", 1, "A", max_tokens=100, order=2)]
    three = Policy.serial(aging_divisor_s=60, swap_affinity_bonus=0).with_gpus(
        tuple(GpuPolicy(f"gpu{index}", Slots(1)) for index in range(3)))
    ends = rule_times(monkeypatch, records, three, sized())
    # a1 alone on gpu0 ends at 42 s, b1 alone on gpu1 at 14 s (each GPU's first slot frees and it
    # drains then).
    assert ends["gpu0"] == pytest.approx((42.0, 42.0)) and ends["gpu1"] == pytest.approx((14.0, 14.0))


def test_pods_read_the_expected_ends_not_the_recorded_release() -> None:
    """One pod of two GPUs; A runs 10 s, loads in 5; B runs 1 s, loads at once. a1 loads A on
    gpu0 and really ran 30 s (released at 35 s); b1 takes gpu1 until 1 s. a2 (A) at 12 s: the
    runtime expects a1 to end at 15 s, in 3 s, sooner than a load of A on gpu1 (5 s): a2 waits
    for gpu0 and starts there at 35 s, warm. (Before, the pods read the recorded release, 23 s
    away, which the runtime cannot know, and loaded A on gpu1 at 12 s: a swap, no wait.)"""
    costs = FixedCosts({"A": 10.0, "B": 1.0}, {"A": 5.0, "B": 0.0})
    policy = Policy.serial(aging_divisor_s=60, swap_affinity_bonus=0)
    records = [arrival("a1", 0, "A", run_s=30, order=0), arrival("b1", 0, "B", run_s=1, order=1),
               arrival("a2", 12, "A", run_s=1, order=2)]
    result = simulate_pods(records, policy, costs, pods=1, gpus=2, routing=Routing.ONE_QUEUE)
    assert (result.granted, result.loads, result.swaps) == (3, 2, 0)
    assert result.wait_p95_s == pytest.approx(23.0)  # a2: 12 s to 35 s

    # The runtime's rule at 12 s, on what the runtime knows: a2 does not start.
    clock = ManualClock(0)
    scheduler = Scheduler(two_gpus(), clock)
    for name, model in (("a1", "A"), ("b1", "B")):
        scheduler.enqueue(name, PRIORITY, model)
        assert scheduler.next(times=NodeTimes.of_grants(lambda: scheduler.running_grants, 0, costs)) is not None
    clock.set_ns(S)
    scheduler.release("b1", model_loaded=True)
    clock.set_ns(12 * S)
    scheduler.enqueue("a2", PRIORITY, "A")
    assert scheduler.next(times=NodeTimes.of_grants(lambda: scheduler.running_grants, 12 * S, costs)) is None


def test_stated_costs_are_figures_as_the_estimator_is() -> None:
    """One protocol of figures (`estimate.Figures`): the stated costs are read as they are, with no
    `Estimator` made of them (simulate composes the figures it is given, it subclasses nothing)."""
    costs = FixedCosts({"A": 10.0}, {"A": 5.0})
    figures: Figures = costs
    assert (figures.expected_request_run_s("A", 4000, "gpu1"), figures.expected_swap_s("A", "gpu1")) == (10.0, 5.0)
    assert figures.expected_run_s("B") == costs.default_run_s
    assert NodeTimes(dict, costs).swap_s("A", "gpu1") == 5.0
    learnt: Figures = sized()
    assert NodeTimes(dict, learnt).swap_s("A", "gpu1") == 12.0
    assert not [kind for kind in vars(engine).values()
                if isinstance(kind, type) and issubclass(kind, Estimator) and kind is not Estimator]
