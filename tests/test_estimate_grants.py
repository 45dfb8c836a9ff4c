"""Property: the estimated starts are the grants' times when every grant takes its expected time.

The estimates' walk (`estimate_node.starts_of_node`, over one GPU here; several:
test_estimate_node.py) and `Scheduler.next` run one dispatch rule (`dispatch.choose`); this
ties the two together end to end. A random queue is played on a
`ManualClock` against a real scheduler (serial with aging and swap affinity, or fifo with
per-model priorities; several models and none; priorities in every band; slots per model and
reserved ones): requests arrive, are granted whenever `next` allows, and each grant is released
exactly at its expected end. At one instant after the last arrival the snapshot's waiting
requests get their estimated starts; the play then goes on with no new arrival, and each
waiting request must be granted exactly at that instant plus its estimate.

What the estimator promises (its docstring) and so what is played: every grant takes its
expected time (`expected_request_run_s` of its model, no size said; the learnt run of a model
that has one, else the default), a grant that loads a model holds its slot for the swap
(`expected_swap_s`, the default, known to the estimator) and then its run, and a grant made
beside it while the model loads begins its run when the load ends (the walk's ``ready_at``).
Times are whole seconds, so every sum is exact in floats and nanoseconds.

A grant made beside a load begins its run when the load ends, also once the grant that loaded
has ended: the snapshot says when that load was granted (`RunningView.ready_at`).

Left out, on purpose: requests that run alone (an unload: "the estimate's order carries no
unload", `_Waiting.alone`), failed or unanswered releases (the loaded model is then not known,
a picture the estimate does not predict), and max_wait (a request that expires is never
granted). Aging needs no restriction: with one divisor every waiting request gains it at the
same rate, so it never reorders the waiting between the instant and the grants (the heap key
is time-free; scheduler.py).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from policies import fifo, serial

from llamaswap.core import Estimator, ManualClock, Policy, Priority, PrioritySource, Scheduler, Slots
from llamaswap.core.estimate_node import starts_of_node

MODELS = ("a", "b", "c")
NS = 1_000_000_000


@dataclass(frozen=True)
class Case:
    policy: Policy
    default_run_s: int
    swap_s: int
    learnt_runs: dict[str, int]  # models whose run the estimator has measured
    arrivals: list[tuple[int, int, str | None]]  # (gap in seconds, priority, model)
    look_after_s: int  # the instant the estimates are taken: this long after the last arrival


@st.composite
def cases(draw: st.DrawFn) -> Case:
    default = draw(st.integers(1, 3))
    per_model = draw(st.dictionaries(st.sampled_from(MODELS), st.integers(1, 4), max_size=3))
    fewest = min([default, *per_model.values()])
    slots = Slots(default, per_model, draw(st.integers(0, fewest - 1)))
    if draw(st.booleans()):
        policy = serial(draw(st.sampled_from([0, 1, 7, 60])), draw(st.sampled_from([0, 1, 10, 99])), slots=slots)
    else:
        policy = fifo(draw(st.dictionaries(st.sampled_from(MODELS), st.sampled_from([-60, -10, 0, 10, 60]))),
                      slots=slots)
    priority = st.one_of(st.sampled_from([-100, -60, -50, -49, -1, 0, 1, 10, 49, 50, 51, 60, 99, 100]),
                         st.integers(-3, 3))
    model = st.one_of(st.none(), st.sampled_from(MODELS), st.sampled_from(MODELS))
    arrivals = draw(st.lists(st.tuples(st.integers(0, 4), priority, model), min_size=1, max_size=14))
    return Case(policy, default, draw(st.sampled_from([0, 0, 3, 5])),
                draw(st.dictionaries(st.sampled_from(MODELS), st.integers(1, 9))), arrivals,
                draw(st.integers(0, 6)))


class Play:
    """A scheduler and the grants it made, each released at its expected end."""

    def __init__(self, case: Case, estimator: Estimator) -> None:
        self.clock = ManualClock()
        self.scheduler = Scheduler(case.policy, self.clock)
        self.estimator = estimator
        self.ends: list[tuple[int, str]] = []  # (end ns, request id): a heap
        self.ready_ns = 0  # when the model the last load began is loaded
        self.granted_ns: dict[str, int] = {}

    def run_until(self, t_ns: int) -> None:
        """Release and grant everything due up to and including ``t_ns``; the clock ends there."""
        while True:
            self.grant_all()
            if not self.ends or self.ends[0][0] > t_ns:
                break
            end, request_id = heapq.heappop(self.ends)
            self.clock.set_ns(end)
            self.scheduler.release(request_id)
        self.clock.set_ns(t_ns)
        self.grant_all()

    def grant_all(self) -> None:
        while (decision := self.scheduler.next()) is not None:
            now = self.clock.now_ns()
            if decision.model_load:
                self.ready_ns = now + round(self.estimator.expected_swap_s(decision.model) * NS)
            run_ns = round(self.estimator.expected_request_run_s(decision.model, None) * NS)
            heapq.heappush(self.ends, (max(now, self.ready_ns) + run_ns, decision.request_id))
            self.granted_ns[decision.request_id] = now


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_estimated_starts_are_the_grant_times(case: Case) -> None:
    estimator = Estimator(default_run_s=case.default_run_s, default_swap_s=case.swap_s, samples=3)
    for model, run_s in case.learnt_runs.items():
        estimator.record(model, run_s=run_s, first_byte_s=None, model_load=False)
    play = Play(case, estimator)
    t_ns = 0
    for number, (gap_s, value, model) in enumerate(case.arrivals):
        t_ns += gap_s * NS
        play.run_until(t_ns)
        play.scheduler.enqueue(f"r{number}", Priority(value, PrioritySource.NUMBER), model)
    look_ns = t_ns + case.look_after_s * NS
    play.run_until(look_ns)

    snapshot = play.scheduler.snapshot()
    estimates = [start for start, _ in starts_of_node(estimator, snapshot, play.scheduler.holdings())]
    expected = {view.request_id: look_ns + round(start * NS) if math.isfinite(start) else None
                for view, start in zip(snapshot.waiting, estimates, strict=True)}
    while play.ends:  # no new arrival: play every grant out
        play.run_until(play.ends[0][0])
    assert not play.scheduler.snapshot().waiting
    actual = {request_id: play.granted_ns[request_id] for request_id in expected}
    assert actual == expected


def test_a_grant_beside_a_finished_load_is_not_read_as_overdue() -> None:
    """Two slots, swap 5 s, run 2 s (a: 1 s). a0 loads at 0 and ends at 6; n1, granted at 1
    beside it, runs 5..7; n2 is granted at 6 and runs until 8. At 6, n3 waits for the first slot
    to free: n1's, at 7 (1 s). The snapshot says n1 was granted beside a0's load (granted 6 s
    ago, 5 s swap): its run began at 5, so it is not overdue (read so, n3 went in n2's slot at 8)."""
    case = Case(fifo(slots=Slots(2)), 2, 5, {"a": 1},
                [(0, -100, "a"), (1, -100, None), (2, -100, None), (2, -100, None)], 1)
    estimator = Estimator(default_run_s=2, default_swap_s=5, samples=3)
    estimator.record("a", run_s=1, first_byte_s=None, model_load=False)
    play = Play(case, estimator)
    t_ns = 0
    for number, (gap_s, value, model) in enumerate(case.arrivals):
        t_ns += gap_s * NS
        play.run_until(t_ns)
        play.scheduler.enqueue(f"r{number}", Priority(value, PrioritySource.NUMBER), model)
    play.run_until(6 * NS)
    snapshot = play.scheduler.snapshot()
    assert [w.request_id for w in snapshot.waiting] == ["r3"]
    assert starts_of_node(estimator, snapshot, play.scheduler.holdings()) == [(1.0, "gpu0")]
