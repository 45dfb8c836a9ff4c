"""A grant's ready time is set once, at the grant (`Decision.ready_at`, issue 45 item 3): when the
load it waits for ends (its own, or the one under way that it was granted beside), or at once.
Every reader of a running request's end reads that field (`estimate.grant_end_s`,
`estimate.remaining_of`, `NodeTimes`, and through them the views, Retry-After and `llamaswap
simulate`), and the estimates' walk gives each start the ready time its grant would set. The
cases where a reader decided another way are pinned here (issue 45's closing note lists them):
the walk's start of no model beside loads, and the pods' recorded run beside a load.

Every number is worked out by hand in the comments next to it.
"""

from __future__ import annotations

import dataclasses

from llamaswap.core import ManualClock, Outcome, Priority, PrioritySource, Residency, Scheduler, Slots
from llamaswap.core.decisions import RunningView
from llamaswap.core.estimate import grant_end_s, remaining_of
from llamaswap.core.estimate_node import NodeTimes, starts_of_node
from llamaswap.core.policy import GpuPolicy
from llamaswap.simulate.engine import FixedCosts
from llamaswap.simulate.pods import Routing, simulate_pods
from llamaswap.simulate.records import RequestRecord
from policies import serial

S = 1_000_000_000
# A loads in 1 s, B in 10 s; every run takes 10 s.
COSTS = FixedCosts({}, {"A": 1.0, "B": 10.0}, default_run_s=10.0)


def prio(value: int) -> Priority:
    return Priority(value, PrioritySource.NUMBER)


def scheduler(slots: int) -> tuple[Scheduler, ManualClock]:
    clock = ManualClock()
    gpu = GpuPolicy("gpu0", Slots(slots, {}, 0), None, Residency(2, frozenset(), None, {}))
    return Scheduler(serial(aging_divisor_s=0.0, swap_affinity_bonus=0).with_gpus((gpu,)), clock), clock


def test_each_grant_sets_its_ready_time_once() -> None:
    s, clock = scheduler(slots=4)
    s.enqueue("a1", prio(10), "A")
    a1 = s.next()
    clock.set_ns(2 * S)
    s.enqueue("b1", prio(10), "B")
    s.enqueue("b2", prio(10), "B")
    b1, b2 = s.next(), s.next()
    assert a1 is not None and b1 is not None and b2 is not None
    assert a1.ready_at == ("A", 0)  # its own load, begun at its grant
    assert b1.ready_at == b2.ready_at == ("B", 2 * S)  # b1's load; b2 was granted beside it
    # The ends read the field: a1 at 1 + 10 s, b1 and b2 at 10 + 10 s after their grant.
    assert [grant_end_s(COSTS, d) for d in (a1, b1, b2)] == [11.0, 20.0, 20.0]
    # The field is what they read, never inferred from model_load: said otherwise, they follow.
    assert grant_end_s(COSTS, dataclasses.replace(a1, ready_at=None)) == 10.0
    clock.set_ns(5 * S)
    views = [RunningView.of(d, clock.now_ns()) for d in (a1, b1, b2)]
    # At 5 s: a1 ran 5 of its 11 s, b1 and b2 3 of their 20.
    assert remaining_of(COSTS, views) == [6.0, 17.0, 17.0]
    times = NodeTimes.of_grants(lambda: s.running_grants, clock.now_ns(), COSTS)
    assert (times.slot_free_in_s("gpu0"), times.drained_in_s("gpu0")) == (6.0, 17.0)


def test_a_start_of_no_model_in_the_walk_has_the_ready_time_its_grant_would_set() -> None:
    """Two slots a model. A's load (1 s) began at 0 and is over, its grant a1 still runs (to 11 s);
    B's load began at 2 s and runs to 12 s (b1 to 22 s). At 2 s four requests of no model wait.

    A grant of no model shares what is in effect there: the first load whose grant still runs.
    w0 and w1 start now beside a1, so their ready time is A's load, over: they end 10 s from now.
    w2 takes a1's slot at 9 s, when B's load is the first whose grant runs: it ends at 20 s. w3
    starts when w0 and w1 end, at 10 s. Before, the walk ran w0 and w1 after the first load not
    yet over, B's (ending 20 s from now), and told w3 it would start at 20 s."""
    s, clock = scheduler(slots=2)
    s.enqueue("a1", prio(10), "A")
    assert s.next() is not None
    clock.set_ns(2 * S)
    s.enqueue("b1", prio(10), "B")
    assert s.next() is not None
    for index in range(4):
        s.enqueue(f"w{index}", prio(5), None)
    walked = starts_of_node(COSTS, s.snapshot(), s.holdings())
    assert walked == [(0.0, "gpu0"), (0.0, "gpu0"), (9.0, "gpu0"), (10.0, "gpu0")]

    # The grants, each released at its expected end, say the same.
    granted: dict[str, float] = {}
    ends = {"a1": 11 * S, "b1": 22 * S}
    while len(granted) < 4:
        while (decision := s.next()) is not None:
            granted[decision.request_id] = (decision.granted_ns - 2 * S) / S
            ends[decision.request_id] = decision.granted_ns + round(grant_end_s(COSTS, decision) * S)
        at, first = min((end, request_id) for request_id, end in ends.items())
        clock.set_ns(at)
        s.release(first)
        del ends[first]
    assert granted == {"w0": 0.0, "w1": 0.0, "w2": 9.0, "w3": 10.0}


def test_the_pods_run_a_recorded_run_from_its_grants_ready_time() -> None:
    """One pod of one GPU with two slots; A loads in 10 s. a1 (recorded run 5 s) loads A at 0 and
    holds its slot to 15 s; a2 (1 s) is granted at 0 beside that load, so it runs from 10 s to
    11 s; a3 (1 s) waits for the first slot to free: at 11 s. Before, the pods ran a2 at once (a
    recorded run counted a swap only for a grant that loads), released it at 1 s and granted a3
    then."""
    policy = serial(aging_divisor_s=0.0, swap_affinity_bonus=0, slots=Slots(2))
    records = [RequestRecord(name, "A", 0, Outcome.SERVED, True, 0.0, None, None, run_s * 1000, 0.0, False, False,
                             order=order) for order, (name, run_s) in enumerate((("a1", 5.0), ("a2", 1.0),
                                                                                  ("a3", 1.0)))]
    costs = FixedCosts({}, {"A": 10.0})
    result = simulate_pods(records, policy, costs, pods=1, gpus=1, routing=Routing.ONE_QUEUE)
    assert (result.granted, result.loads) == (3, 1)
    assert result.wait_p95_s == 11.0  # a3's wait, the longest of the three (0, 0, 11 s)
