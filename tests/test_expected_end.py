"""One expected end of a running request (`estimate.expected_end_s`, issue 36 item 3): its run,
sized by its `max_tokens` where given, from its ready time (`Decision.ready_at`, set once at the
grant: after its own load or after the load it was granted beside). The grants (`NodeTimes`), the
estimates (`estimate.remaining_of`), Retry-After
(`Forecast`), the views (GET /queue), the page's state document and `llamaswap simulate` all
give the same figure for the same running request.

The case, worked out by hand: two slots; model A's load takes 12 s (the default), its run 0.01 s
per token asked (three runs of 10 s at 1,000 tokens; its median run is 10 s). ``a1`` asks for
3,000 tokens and arrives at 0: it loads A, expected to end at 12 + 30 = 42 s. ``a2`` asks for
500 and arrives at 1 s: granted beside the load, its run begins when the load ends (12 s),
expected to end at 12 + 5 = 17 s, 16 s after its grant. At 3 s: 39 s and 14 s remain.
"""

from __future__ import annotations

import math

import pytest

from llamaswap.adapters.ui import UiState
from llamaswap.core import Estimator, ManualClock, Outcome, Policy, Priority, PrioritySource, Scheduler, Slots
from llamaswap.core.decisions import Decision
from llamaswap.core.estimate import expected_end_s, grant_end_s, left_s, ready_left_s, remaining_of
from llamaswap.core.estimate_node import NodeTimes
from llamaswap.core.policy import GpuPolicy
from llamaswap.runtime.forecast import Forecast
from llamaswap.runtime.ticket import Arrival, Ticket, TicketState
from llamaswap.runtime.views import QueueViews
from llamaswap.simulate.engine import FixedCosts, prepare, simulate
from llamaswap.simulate.records import RequestRecord
from test_simulate_expected_end import rule_times

S = 1_000_000_000
SIZES = {"a1": 3000, "a2": 500}


def estimator() -> Estimator:
    figures = Estimator(default_run_s=2.0, default_swap_s=12.0, samples=5)
    for _ in range(3):
        figures.record("A", run_s=10.0, first_byte_s=None, model_load=False, max_tokens=1000)
    return figures


def test_the_one_function() -> None:
    figures = estimator()
    assert expected_end_s(figures, "A", max_tokens=3000, ready_at=("A", 0.0)) == pytest.approx(42.0)
    # Not sized: the model's median run.
    assert expected_end_s(figures, "A") == pytest.approx(10.0)
    # Beside a load of A that began 1 s before its grant: the load ends 11 s after the grant.
    assert expected_end_s(figures, "A", max_tokens=500, ready_at=("A", 1.0)) == pytest.approx(16)
    # A load that had ended before the grant: nothing to wait for.
    assert expected_end_s(figures, "A", max_tokens=500, ready_at=("A", 20.0)) == pytest.approx(5)
    assert left_s(16.0, 2.0) == 14.0 and left_s(16.0, 16.0) is None


def _runtime(now_s: float) -> tuple[Scheduler, ManualClock, dict[str, Ticket]]:
    clock = ManualClock(0)
    scheduler = Scheduler(Policy.serial(aging_divisor_s=60, swap_affinity_bonus=0, slots=Slots(2)), clock)
    tickets: dict[str, Ticket] = {}
    for name, at_s in (("a1", 0.0), ("a2", 1.0)):
        clock.set_ns(round(at_s * S))
        priority = Priority(0, PrioritySource.NUMBER)
        ticket = Ticket(name, Arrival(name, None, None, "A", "peer", None, None, max_tokens=SIZES[name]), priority,
                        clock.now_ns())
        tickets[name] = ticket
        scheduler.enqueue(name, priority, "A", max_tokens=SIZES[name])
        decision = scheduler.next()
        assert decision is not None and decision.request_id == name
        ticket.decision = decision
        ticket.state = TicketState.RUNNING
    clock.set_ns(round(now_s * S))
    return scheduler, clock, tickets


def _arrival(request_id: str, at_s: float, model: str, *, max_tokens: int | None = None, order: int = 0,
             run_s: float | None = None) -> RequestRecord:
    """A request of a recording; ``run_s``: what it took (None: it never ran, it takes its model's costs)."""
    return RequestRecord(request_id, model, 0, Outcome.SERVED, False, at_s * 1000, None, None,
                         None if run_s is None else run_s * 1000, 0.0, False, False, order=order,
                         max_tokens=max_tokens)


def test_every_reader_gives_the_same_expected_end(monkeypatch: pytest.MonkeyPatch) -> None:
    figures = estimator()
    scheduler, clock, tickets = _runtime(now_s=3.0)
    decisions: dict[str, Decision] = {name: t.decision for name, t in tickets.items() if t.decision is not None}
    # Each ready time set at its grant: a1 when its own load ends, a2 when that same load ends.
    assert decisions["a1"].ready_at == decisions["a2"].ready_at == ("A", 0)
    ends = {name: grant_end_s(figures, d) for name, d in decisions.items()}
    assert ends == pytest.approx({"a1": 42.0, "a2": 16.0})
    left = {"a1": 39.0, "a2": 14.0}

    # The estimates (and the times the grants read: `NodeTimes`).
    snapshot = scheduler.snapshot()
    remaining = remaining_of(figures, snapshot.grants)
    assert dict(zip([g.request_id for g in snapshot.grants], remaining)) == pytest.approx(left)
    loader = next(grant for grant in snapshot.grants if grant.model_load)  # the load under way
    assert ready_left_s(figures, loader) == pytest.approx(9.0)
    times = NodeTimes.of_grants(lambda: scheduler.running_grants, clock.now_ns(), figures)
    assert (times.slot_free_in_s("gpu0"), times.drained_in_s("gpu0")) == pytest.approx((14.0, 39.0))

    # Retry-After: both slots taken, a place frees when a2 ends.
    forecast = Forecast(clock, scheduler, figures, schedule_model=lambda model: model)
    assert forecast.busy_s() == pytest.approx(14.0)

    # The views (GET /queue): the end from the grant and what remains of it.
    views = QueueViews(scheduler, figures, clock, tickets, {t.request_id: t for t in tickets.values()},
                       version=lambda: 1, blocked=dict)
    rows = {row.request_id: row for row in views.view().running}
    assert {name: row.expected_end_s for name, row in rows.items()} == pytest.approx(ends)
    assert {name: row.expected_remaining_s for name, row in rows.items()} == pytest.approx(left)

    # The page's state document: the end it draws is the grant's time plus that.
    now_ms = 1_000_000.0
    for name, row in rows.items():
        document = UiState._running_row(row, now_ms)
        assert document["expected_end_ms"] - document["granted_ms"] == pytest.approx(ends[name] * 1000)
        assert document["expected_remaining_s"] == pytest.approx(left[name])

    # `llamaswap simulate` over the same requests and figures.
    # A second GPU, so that the rule reads the times: a3 finds gpu0's two slots taken and may
    # load A on gpu1 or wait for gpu0 (with one GPU, or while a free slot decides, it reads none).
    records = [_arrival("a1", 0, "A", max_tokens=3000, run_s=60), _arrival("a2", 1, "A", max_tokens=500, run_s=60),
               _arrival("a3", 2, "A", order=2)]
    node = Policy.serial(aging_divisor_s=60, swap_affinity_bonus=0).with_gpus(
        (GpuPolicy("gpu0", Slots(2)), GpuPolicy("gpu1", Slots(1))))
    simulated = rule_times(monkeypatch, records, node, figures)
    assert simulated["gpu0"] == pytest.approx((17.0, 42.0))  # a2's end frees a slot, a1's drains gpu0


def test_the_simulator_sizes_a_running_grant_by_its_max_tokens_as_the_runtime_does() -> None:
    """Two GPUs; A's load takes 12 s, its run 0.01 s per token asked (median run 10 s). a1 asks
    for 3,000 tokens and loads A on gpu0: the runtime expects it to end at 42 s (10 s unsized
    would say 22). b1 loads B on gpu1 (12 s + 2 s). At 14 s a2 (A) is waiting and gpu1 is free:
    gpu0 frees A in 28 s, later than a load of A on gpu1 (12 s), so the runtime's node rule loads
    A on gpu1 at 14 s. Unsized, gpu0 would free in 8 s, sooner than the load: a2 would wait for
    gpu0 until a1 really ends (12 + 30 s recorded: 42 s)."""
    figures = estimator()
    policy = Policy.serial(aging_divisor_s=60, swap_affinity_bonus=0).with_gpus(
        (GpuPolicy("gpu0", Slots(1)), GpuPolicy("gpu1", Slots(1))))
    records = [_arrival("a1", 0, "A", max_tokens=3000, run_s=30, order=0), _arrival("b1", 0, "B", order=1),
               _arrival("a2", 1, "A", max_tokens=100, order=2)]
    sim = simulate(prepare(records), policy, figures)
    got = {r.request.record.request_id: (r.start_ns, r.gpu) for r in sim.results}
    assert got == {"a1": (0, "gpu0"), "b1": (0, "gpu1"), "a2": (14 * S, "gpu1")}

    # The runtime's own rule, on what the runtime knows at 14 s, decides the same.
    clock = ManualClock(0)
    scheduler = Scheduler(policy, clock)
    priority = Priority(0, PrioritySource.NUMBER)
    sizes: dict[str, int | None] = {"a1": 3000, "b1": None}
    for name, model in (("a1", "A"), ("b1", "B")):
        scheduler.enqueue(name, priority, model, max_tokens=sizes[name])
        assert scheduler.next(times=NodeTimes.of_grants(lambda: scheduler.running_grants, 0, figures)) is not None
    clock.set_ns(S)
    scheduler.enqueue("a2", priority, "A")
    clock.set_ns(14 * S)
    scheduler.release("b1", model_loaded=True)
    times = NodeTimes.of_grants(lambda: scheduler.running_grants, clock.now_ns(), figures)
    decision = scheduler.next(times=times)
    assert decision is not None and (decision.request_id, decision.gpu) == ("a2", "gpu1")


def test_a_stated_cost_is_a_requests_whatever_its_size() -> None:
    costs = FixedCosts({"A": 10.0}, {"A": 5.0})
    assert costs.expected_request_run_s("A", 4000) == 10.0
    assert expected_end_s(costs, "A", max_tokens=4000, ready_at=("A", 0.0)) == 15.0
    assert math.isfinite(expected_end_s(costs, None))
