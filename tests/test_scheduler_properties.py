"""Property tests: the heap scheduler against the brute-force reference (tests/reference.py).

Random interleavings of arrivals (any int64 priority, a few models or none, any gap), clock
steps, cancellations, loaded-model changes, reconfigurations, dispatches and releases. After
every dispatch the real scheduler must grant the same request as the reference's full scan,
with the same score (exact Fraction against float, within rounding), the same reorder reasons
and the same decision record; at random points the snapshot must list the queue in the order
the reference would grant it.

The slot machines do the same with several slots (per model, some reserved for interactive
work, changed by reconfiguration while grants run) and releases in any order, and check the
slot rules on their own, beside the reference: never more grants than the slots of the model
they run on, never two models, a grant that loads a model only when nothing runs, a reserved
slot only to an interactive request (non-interactive ones never hold more than slots - reserved),
and no grant while a better request waits for a swap.

Whatever the request's path: requests also arrive as llama-server would take them (a GET whose
query loads a model, a model unload or load, a body's model), turned into what the scheduler sees
by the sidecar's own rule (`adapters.ext_authz.scheduled_as`); what each does at the upstream is
written beside it here, by hand, and no grant ever runs beside a grant of another model or
beside an unload, and a grant that loads a model is made only when nothing runs.
(`tests/test_scheduler_legacy.py` checks that one slot is the scheduler as it was.)
"""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import llamaswap.core.scheduler as scheduler_module
from llamaswap.adapters.ext_authz import scheduled_as
from policies import fifo, serial
from reference import ReferenceScheduler, RefPolicy, float_close, residents

from llamaswap.core import (
    Band,
    ManualClock,
    PrioritySource,
    Scheduler,
    Slots,
    UnknownRequest,
    band_of,
    parse_priority,
)

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MODELS = ("a", "b", "c")

ANCHORS = [-100, -99, -98, -51, -50, -49, -1, 0, 1, 2, 49, 50, 98, 99, 100, 101]
priorities = st.one_of(
    st.sampled_from(ANCHORS),
    st.sampled_from(ANCHORS),
    st.integers(-20, 20),  # near-ties, where swap affinity and aging decide
    st.integers(-3, 3),  # exact ties with small bonuses
    st.integers(-300, 300),
    st.integers(INT64_MIN, INT64_MAX),  # large ones: keys must stay exact
)
models = st.one_of(st.none(), st.sampled_from(MODELS), st.sampled_from(MODELS))
gaps_ns = st.one_of(
    st.sampled_from([0, 0, 1, 2, 3]),  # ties and near-ties at nanosecond divisors
    st.integers(0, 10**9),  # up to a second
    st.integers(0, 10**11),  # minutes
    st.integers(0, 10**13),  # hours
    st.integers(0, 10**16),  # months
)
# Seconds per aging point: 0 disables aging; 1e-9 is one point per nanosecond (ties everywhere).
divisors = st.sampled_from([0, 0, 1e-9, 2e-9, 3e-9, 1e-6, 0.25, 0.5, 1, 7, 60, 3600])
bonuses = st.one_of(st.sampled_from([0, 1, 2, 10, 99]), st.integers(0, 99))
max_waits = st.sampled_from([0.0, 0.0, 1e-6, 1.0, 3600.0])
serial_policies = st.builds(lambda d, b, w: serial(d, b, max_wait_s=w), divisors, bonuses, max_waits)
fifo_policies = st.builds(
    lambda p, w: fifo(p, max_wait_s=w),
    st.dictionaries(st.sampled_from(MODELS), st.one_of(st.integers(-200, 200), st.integers(INT64_MIN, INT64_MAX))),
    max_waits,
)




@st.composite
def slot_settings(draw, most: int = 4, fewest: int = 1) -> Slots:
    default = draw(st.integers(fewest, most), label="slots")
    per_model = draw(st.dictionaries(st.sampled_from(MODELS), st.integers(fewest, most)), label="model slots")
    smallest = min([default, *per_model.values()])
    return Slots(default, per_model, draw(st.integers(max(0, fewest - 1), smallest - 1), label="reserved"))


slotted_serial = st.builds(lambda d, b, w, slots: serial(d, b, max_wait_s=w, slots=slots), divisors, bonuses,
                           max_waits, slot_settings())
slotted_fifo = st.builds(
    lambda p, w, slots: fifo(p, max_wait_s=w, slots=slots),
    st.dictionaries(st.sampled_from(MODELS), st.one_of(st.integers(-200, 200), st.integers(INT64_MIN, INT64_MAX))),
    max_waits, slot_settings(),
)
# Requests by path, with what each makes router-mode llama-server do, written out by hand: the
# model it uses or loads (None: none) and whether it unloads that model. (method, path, body's
# model, what it uses or loads, unloads)
PathRequest = tuple[str, str, "str | None", "str | None", bool]


@st.composite
def path_requests(draw, models) -> PathRequest:
    model = draw(st.sampled_from(MODELS), label="named model")
    body = draw(models, label="body model")
    return draw(st.sampled_from([
        ("GET", f"/props?model={model}", None, model, False),
        ("GET", f"/slots?model={model}", None, model, False),
        ("GET", f"/metrics?model={model}&x=1", None, model, False),
        ("GET", f"/slots?model={model}&autoload=false", None, None, False),  # loads nothing
        ("GET", f"/props?autoload=0&model={model}", None, None, False),
        ("GET", "/slots", None, None, False),
        ("POST", "/models/unload", model, model, True),
        ("POST", "/models/unload?x=1", model, model, True),
        ("POST", "/models/load", model, model, False),
        ("POST", f"/v1/chat/completions?model={model}", body, body if body is not None else model, False),
        ("POST", "/v1/completions", body, body, False),
    ]), label="request")


# Interactive and non-interactive requests in about equal numbers, so reserved slots matter.
slot_priorities = st.one_of(st.sampled_from(ANCHORS), st.integers(40, 60), st.integers(-20, 20), priorities)


class SchedulerMachine(RuleBasedStateMachine):
    """Drives the real Scheduler and the reference with the same operations."""

    policies = st.one_of(serial_policies, fifo_policies)
    priorities = priorities
    gaps = gaps_ns
    models = models

    def __init__(self) -> None:
        super().__init__()
        self.clock = ManualClock()
        self.real: Scheduler | None = None
        self.ref: ReferenceScheduler | None = None
        self.count = 0
        # What each request does at the upstream: (the model it uses or loads, unloads it).
        self.effects: dict[str, tuple[str | None, bool]] = {}
        self._saved_slack = scheduler_module._COMPACT_SLACK
        self._shrunk = False  # a reconfiguration left more grants running than slots

    # -- set-up --------------------------------------------------------------------------

    @initialize(data=st.data(), start=st.integers(0, 10**18), slack=st.sampled_from([0, 1, 1024]))
    def setup(self, data, start, slack):
        policy = data.draw(type(self).policies, label="policy")
        # A small slack makes the heaps compact themselves often, as a long-running queue would.
        scheduler_module._COMPACT_SLACK = slack
        self.clock.set_ns(start)
        self.real = Scheduler(policy, self.clock)
        self.ref = ReferenceScheduler(RefPolicy.of(policy), self.clock.now_ns)

    def teardown(self) -> None:
        scheduler_module._COMPACT_SLACK = self._saved_slack

    # -- operations ----------------------------------------------------------------------

    @rule(data=st.data(), size=st.integers(1, 12))
    def enqueue_several(self, data, size):
        for _ in range(size):
            self.enqueue(data)

    @rule(data=st.data())
    def enqueue(self, data):
        priority = data.draw(type(self).priorities, label="priority")
        model = data.draw(type(self).models, label="model")
        gap = data.draw(type(self).gaps, label="gap")
        as_text = data.draw(st.booleans(), label="as_text")
        self.clock.set_ns(self.clock.now_ns() + gap)
        self.count += 1
        rid = f"r{self.count}"
        prio = parse_priority(str(priority) if as_text else f" {priority:+d} ")
        assert prio.value == priority and prio.source is PrioritySource.NUMBER
        queued = self.real.enqueue(rid, prio, model)
        assert queued.depth == self.ref.enqueue(rid, priority, model)
        assert queued.arrival_ns == self.clock.now_ns()
        self.effects[rid] = (model, False)

    @rule(data=st.data())
    def enqueue_by_path(self, data):
        method, path, body, uses, unloads = data.draw(path_requests(type(self).models), label="path request")
        scheduled = scheduled_as(method, path, body)
        priority = data.draw(type(self).priorities, label="priority")
        self.clock.set_ns(self.clock.now_ns() + data.draw(type(self).gaps, label="gap"))
        self.count += 1
        rid = f"r{self.count}"
        event(f"enqueue_by_path: {method} {path.split('?')[0]}")
        prio = parse_priority(str(priority))
        queued = self.real.enqueue(rid, prio, scheduled.model, alone=scheduled.alone)
        assert queued.depth == self.ref.enqueue(rid, priority, scheduled.model, scheduled.alone)
        self.effects[rid] = (uses, unloads)

    # -- kept places (routing.retryGraceSeconds) -----------------------------------------

    keys = st.sampled_from([b"k1", b"k2", b"k3"])
    graces = st.one_of(st.integers(1, 5), st.integers(1, 10**12))

    def _max_wait_ns(self) -> int:
        return round(Fraction(self.real.policy.max_wait_s) * 1_000_000_000)

    @rule(data=st.data(), key=keys)
    def client_leaves(self, data, key):
        """A request's client leaves: a waiting one keeps its place under `key`; a granted one never."""
        candidates = [r.request_id for r in self.ref.waiting] + [g.request.request_id for g in self.ref.grants]
        rid = data.draw(st.sampled_from(candidates + ["ghost"]), label="leaves")
        grace_ns = data.draw(type(self).graces, label="grace")
        kept = self.real.keep(rid, key, grace_ns)
        expected = self.ref.keep(rid, key, grace_ns)
        if expected is None:
            assert kept is None
        else:
            assert kept is not None and kept[0].request_id == rid
            assert (kept[1] is not None) == expected
            event(f"client_leaves: place {'kept' if expected else 'not kept (key taken)'}")
        assert self.real.kept_count == len(self.ref.places)

    @rule(data=st.data(), key=keys)
    def retry(self, data, key):
        """A request arrives with a key: the same request as the one kept under it (same priority
        and model), or not; with a path, so a retry of an unload or a query runs as it would."""
        if self.ref.places and data.draw(st.booleans(), label="a kept key"):
            key = data.draw(st.sampled_from(sorted(self.ref.places)), label="key")
        place = self.ref.places.get(key)
        if place is not None and data.draw(st.booleans(), label="same request"):
            priority, model, alone = place.request.priority, place.request.model, place.request.alone
            effect = self.effects[place.request.request_id]
        else:
            method, path, body, uses, unloads = data.draw(path_requests(type(self).models), label="path request")
            scheduled = scheduled_as(method, path, body)
            priority = data.draw(type(self).priorities, label="priority")
            model, alone, effect = scheduled.model, scheduled.alone, (uses, unloads)
        # Often at once: a retry within the grace period, ahead of whatever arrives after it.
        self.clock.set_ns(self.clock.now_ns() + data.draw(st.one_of(st.just(0), type(self).gaps), label="gap"))
        self.count += 1
        rid = f"r{self.count}"
        queued = self.real.enqueue(rid, parse_priority(str(priority)), model, alone=alone, retry_key=key)
        depth = self.ref.enqueue(rid, priority, model, alone, key=key, max_wait_ns=self._max_wait_ns())
        assert queued.depth == depth
        taken = self.ref.taken
        assert (queued.taken is None) == (taken is None)
        if taken is not None:
            event("retry: took a kept place over")
            assert queued.taken.request_id == taken.request.request_id
            assert queued.arrival_ns == taken.request.arrival_ns
        else:
            assert queued.arrival_ns == self.clock.now_ns()
        assert self.real.kept_count == len(self.ref.places)
        self.effects[rid] = effect

    @rule(data=st.data(), key=keys, later=st.integers(0, 4))
    def leave_then_retry(self, data, key, later):
        """A waiting request's client leaves, others arrive, then its retry (the SDK's way)."""
        if not self.ref.waiting:
            return
        request = data.draw(st.sampled_from(self.ref.waiting), label="leaves")
        if self.ref.keep(request.request_id, key, 10**15) is not True:
            self.real.keep(request.request_id, key, 10**15)
            return
        assert self.real.keep(request.request_id, key, 10**15) is not None
        for _ in range(later):
            self.enqueue(data)
        self.count += 1
        rid = f"r{self.count}"
        queued = self.real.enqueue(rid, parse_priority(str(request.priority)), request.model, alone=request.alone,
                                   retry_key=key)
        self.ref.enqueue(rid, request.priority, request.model, request.alone, key=key, max_wait_ns=self._max_wait_ns())
        assert (queued.taken is None) == (self.ref.taken is None)
        assert queued.arrival_ns == (request.arrival_ns if self.ref.taken is not None else self.clock.now_ns())
        self.effects[rid] = self.effects[request.request_id]

    @rule()
    def expire_kept(self):
        ended = [place.request_id for place in self.real.expire_kept()]
        assert sorted(ended) == sorted(self.ref.expire_kept(self._max_wait_ns()))
        assert self.real.kept_count == len(self.ref.places)

    @rule(data=st.data())
    def advance(self, data):
        self.clock.set_ns(self.clock.now_ns() + data.draw(type(self).gaps, label="gap"))

    @rule(data=st.data())
    def cancel(self, data):
        candidates = [r.request_id for r in self.ref.waiting] + ["ghost"]
        candidates += [g.request.request_id for g in self.ref.grants]
        rid = data.draw(st.sampled_from(candidates))
        removed = self.real.cancel(rid)
        was_waiting = self.ref.cancel(rid)
        assert (removed is not None) == was_waiting
        if removed is not None:
            assert removed.request_id == rid

    @rule(model=models)
    def set_loaded_model(self, model):
        applied = self.real.set_residents(residents(model), as_of=self.real.dispatches_on("gpu0"), gpu="gpu0")
        assert applied == (not self.ref.grants)
        self.ref.set_loaded_model(model)

    @rule(model=models)
    def stale_loaded_model_report_is_dropped(self, model):
        # Asked before the latest grant: whatever it says, the scheduler has moved on.
        if self.real.dispatches_on("gpu0"):
            before = self.real.residents_on("gpu0")
            stale = self.real.dispatches_on("gpu0") - 1
            assert not self.real.set_residents(residents(model), as_of=stale, gpu="gpu0")
            assert self.real.residents_on("gpu0") == before

    @rule(data=st.data())
    def reconfigure(self, data):
        policy = data.draw(type(self).policies, label="policy")
        self.real.reconfigure(policy)
        self.ref.reconfigure(RefPolicy.of(policy))
        # Fewer slots than grants run: they keep their slots, and nothing starts until enough end.
        self._shrunk = self._shrunk or self.real.slots_busy > self.real.holdings()[0].slots_in_effect
        if self.real.slots_busy > self.real.holdings()[0].slots_in_effect:
            event("reconfigure: fewer slots than running grants")

    @rule()
    def dispatch(self):
        self._dispatch()

    @rule(data=st.data())
    def dispatch_and_release(self, data):
        decision = self._dispatch()
        if decision is not None:
            self.clock.set_ns(self.clock.now_ns() + data.draw(type(self).gaps, label="gap"))
            self.real.release(decision.request_id)
            self.ref.release(decision.request_id)

    @rule(data=st.data(), model_loaded=st.sampled_from([True, False, None]), reached_upstream=st.booleans())
    def release(self, data, model_loaded, reached_upstream):
        if not self.ref.grants:
            with pytest.raises(UnknownRequest):
                self.real.release("ghost")
            return
        rid = data.draw(st.sampled_from([g.request.request_id for g in self.ref.grants]), label="release")
        if len(self.ref.grants) > 1:
            event(f"release: one of {len(self.ref.grants)} running, reached_upstream={reached_upstream}")
        loaded = self.real.residents_on("gpu0")
        released = self.real.release(rid, model_loaded=model_loaded, reached_upstream=reached_upstream)
        if not reached_upstream and self.real.residents_on("gpu0") != loaded:
            event(f"release: a load undone, {len(self.ref.grants) - 1} still running")
        self.ref.release(rid, model_loaded=model_loaded, reached_upstream=reached_upstream)
        assert released.request_id == rid
        with pytest.raises(UnknownRequest):
            self.real.release(rid)

    @rule()
    def release_a_non_holder(self):
        for rid in [r.request_id for r in self.ref.waiting[:3]] + ["ghost"]:
            with pytest.raises(UnknownRequest):
                self.real.release(rid)

    @rule()
    def expire(self):
        expired = [r.request_id for r in self.real.expire_overdue()]
        limit_ns = round(Fraction(self.real.policy.max_wait_s) * 1_000_000_000)
        now = self.clock.now_ns()
        expected = [r.request_id for r in self.ref.waiting if limit_ns and now - r.arrival_ns >= limit_ns]
        assert sorted(expired) == sorted(expected)
        for rid in expected:
            self.ref.cancel(rid)

    def _dispatch(self):
        now = self.clock.now_ns()
        ranked = [r for r, _ in self.ref.order(now)]  # best current score first, before the grant
        loaded_before, busy_before = self.ref.loaded_model, len(self.ref.grants)
        if not self.ref.grants and self.ref.waiting:
            scores = [self.ref.score(r, now) for r in self.ref.waiting]
            if scores.count(max(scores)) > 1:
                event("dispatch: equal top scores, arrival decides")
                favoured = {self.ref.has_affinity(r) for r, s in zip(self.ref.waiting, scores) if s == max(scores)}
                if len(favoured) == 2:
                    event("dispatch: the loaded model's best ties another model's best")
            depth = len(scores)
            event(f"dispatch: depth {'1' if depth == 1 else '2-5' if depth <= 5 else '6-20' if depth <= 20 else '21+'}")
        real = self.real.next()
        ref = self.ref.next()
        if ref is None:
            assert real is None
            if self.ref.waiting and busy_before:
                best = ranked[0]
                why = "a swap waits" if not (best.model is None or best.model == loaded_before) else "no free slot"
                event(f"dispatch: nothing while {busy_before} run ({why})")
            return None
        assert real is not None
        assert real.request_id == ref.request_id
        event(f"dispatch: {self.ref.policy.name} reordered_by={sorted(ref.reordered_by)}")
        assert real.reordered_by == ref.reordered_by
        base = ref.score - ref.aging - (self.ref.policy.bonus if ref.swap_affinity else 0)
        magnitude = abs(base) + self.ref.policy.bonus + ref.aging
        assert float_close(real.score, ref.score, magnitude=magnitude), (real.score, ref.score)
        assert float_close(real.aging, ref.aging), (real.aging, ref.aging)
        assert real.priority == ref.priority
        assert real.band is band_of(ref.priority)
        assert real.queue_wait_ns == ref.queue_wait_ns
        assert real.model == ref.model
        assert real.swap_affinity == ref.swap_affinity
        assert real.swap == ref.swap
        assert real.load == ref.load
        assert real.residents_before == residents(ref.previous_model)
        assert real.overtook == ref.overtook
        assert real.queue_depth_after == ref.queue_depth_after
        assert (real.slots_busy, real.reserved_slot, real.alone) == (ref.slots_busy, ref.reserved_slot, ref.alone)
        assert self.real.holdings()[0].slots_in_effect == self.ref.total_slots()
        self._slot_rules(real, ranked, loaded_before, busy_before)
        return real

    def _slot_rules(self, decision, ranked, loaded_before, busy_before):
        """The issue's rules for one grant, checked on their own (not through the reference)."""
        slots = self.real.policy.gpus[0].slots
        total = self.real.holdings()[0].slots_in_effect  # the slots it was counted against (unchanged by its grant)
        assert decision.slots_busy == busy_before + 1 <= total
        if decision.slots_busy > 1:
            event(f"dispatch: {decision.slots_busy} running{' (reserved slot)' if decision.reserved_slot else ''}")
            # A model loads only with nothing running: the running drain before a swap.
            assert not decision.model_load
            assert decision.model is None or decision.model == loaded_before
            assert not decision.alone  # an unload only with nothing running
        # Non-interactive work uses at most slots - reserved: the reserved ones go to interactive work only.
        non_interactive = sum(1 for d in self.real.running_grants if d.band is not Band.INTERACTIVE)
        if decision.band is not Band.INTERACTIVE:
            assert non_interactive <= total - slots.reserved
        if decision.reserved_slot:
            assert decision.band is Band.INTERACTIVE and decision.slots_busy > 1
        # Whatever still waits with a better score was held back by the reserved slots: the best
        # needs the loaded model (a swap would have stopped every grant), and none of them is an
        # interactive request that could start beside what runs (only the best holds the GPU).
        ahead = ranked[:[r.request_id for r in ranked].index(decision.request_id)]
        if ahead:
            assert decision.reserved_slot, (decision, ahead[0])
            assert ahead[0].model is None or ahead[0].model == loaded_before
            assert all(request.priority < 50 or request.alone or request.model not in (None, loaded_before)
                       for request in ahead)

    # -- invariants ----------------------------------------------------------------------

    @invariant()
    def same_state(self):
        if self.real is None:
            return
        assert self.real.depth == len(self.ref.waiting)
        assert next(self.real.running_ids(), None) == (self.ref.running.request_id if self.ref.running else None)
        assert [d.request_id for d in self.real.running_grants] == [g.request.request_id for g in self.ref.grants]
        assert self.real.slots_busy == len(self.ref.grants)
        assert self.real.residents_on("gpu0") == residents(self.ref.loaded_model)
        if self.ref.choose(self.clock.now_ns()) is None:
            assert self.real.next() is None  # non-preemptive: no slot for the best request

    @invariant()
    def slots_hold(self):
        if self.real is None:
            return
        named = {d.model for d in self.real.running_grants if d.model is not None}
        assert len(named) <= 1, f"two models run at once: {named}"
        if named:
            assert self.real.slots_busy <= self.real.policy.gpus[0].slots.of(named.pop()) or self._shrunk
        if self.real.policy.gpus[0].slots.single:
            assert self.real.slots_busy <= 1 or self._shrunk

    @invariant()
    def one_model_at_the_upstream_whatever_the_path(self):
        """What the running grants do at the upstream, by their paths: one model, and nothing
        beside an unload."""
        if self.real is None:
            return
        effects = [self.effects[d.request_id] for d in self.real.running_grants]
        used = {model for model, _ in effects if model is not None}
        assert len(used) <= 1, f"two models at the upstream at once: {used}"
        if any(unloads for _, unloads in effects):
            assert len(effects) == 1, "a grant beside an unload"

    @rule()
    def snapshot_ranks_like_the_reference(self):
        # A rule rather than an invariant: exact sorting is slow, and random points suffice.
        now = self.clock.now_ns()
        snap = self.real.snapshot()
        expected = self.ref.dispatch_order(now)
        assert [w.request_id for w in snap.waiting] == [r.request_id for r, _ in expected]
        assert [w.position for w in snap.waiting] == list(range(1, len(expected) + 1))
        for view, (request, exact) in zip(snap.waiting, expected):
            # The score at its turn in this order: it was the best of those left at that point.
            if view.score != float(exact):
                magnitude = abs(self.ref.base(request)) + self.ref.policy.bonus + self.ref.aging(request, now)
                assert float_close(view.score, exact, magnitude=magnitude), (view, exact)
        depths = {band: 0 for band in snap.bands}
        for request in self.ref.waiting:
            depths[band_of(request.priority)] += 1
        assert {band: stats.depth for band, stats in snap.bands.items()} == depths
        for band, stats in snap.bands.items():
            arrivals = [r.arrival_ns for r in self.ref.waiting if band_of(r.priority) is band]
            oldest = (now - min(arrivals)) / 1e9 if arrivals else 0.0
            assert stats.oldest_wait_s == pytest.approx(oldest, rel=1e-12, abs=1e-9)


    @rule()
    def dispatch_until_full(self):
        while self._dispatch() is not None:
            pass

    @rule()
    def snapshot_lists_every_grant(self):
        snap = self.real.snapshot()
        assert [g.request_id for g in snap.grants] == [g.request.request_id for g in self.ref.grants]
        assert snap.slots_busy == len(snap.grants)
        assert snap.running == (snap.grants[0] if snap.grants else None)
        assert snap.gpus[0].slots == self.ref.total_slots()


class SerialMachine(SchedulerMachine):
    policies = serial_policies


class FifoMachine(SchedulerMachine):
    policies = fifo_policies


class TieMachine(SchedulerMachine):
    """A narrow world where scores collide all the time: the tie-breaks must agree."""

    priorities = st.integers(-2, 2)
    gaps = st.integers(0, 3)  # nanoseconds
    policies = st.one_of(
        st.builds(serial, st.sampled_from([0, 1e-9, 2e-9]), st.integers(0, 3)),
        st.builds(fifo, st.dictionaries(st.sampled_from(MODELS), st.integers(-2, 2))),
    )


class SlotsMachine(SchedulerMachine):
    """Several slots, per model, some reserved; reconfigured to other slots while grants run."""

    policies = st.one_of(slotted_serial, slotted_fifo)
    priorities = slot_priorities


class ReservedMachine(SchedulerMachine):
    """At least two slots everywhere and at least one reserved: interactive requests behind
    non-interactive ones that have used up their share."""

    policies = st.one_of(
        st.builds(lambda d, b, slots: serial(d, b, slots=slots), divisors, bonuses, slot_settings(4, fewest=2)),
        st.builds(lambda p, slots: fifo(p, slots=slots), st.dictionaries(st.sampled_from(MODELS), st.integers(-60, 60)),
                  slot_settings(4, fewest=2)),
    )
    priorities = st.sampled_from([-100, -50, 0, 10, 49, 50, 100, 101])
    models = st.sampled_from(["a", "a", "a", "a", None, "b"])  # mostly the loaded model: slots fill up


class SlotTieMachine(SchedulerMachine):
    """Several slots in the narrow world of ties: interactive and not, same and other models."""

    priorities = st.sampled_from([-1, 0, 1, 49, 50, 51])
    gaps = st.integers(0, 3)
    policies = st.one_of(
        st.builds(lambda d, b, slots: serial(d, b, slots=slots), st.sampled_from([0, 1e-9, 2e-9]),
                  st.integers(0, 3), slot_settings(3)),
        st.builds(lambda p, slots: fifo(p, slots=slots), st.dictionaries(st.sampled_from(MODELS), st.integers(-2, 2)),
                  slot_settings(3)),
    )


class KeptMachine(SchedulerMachine):
    """Kept places often taken over: short gaps (grace periods outlast them), few models, slots."""

    priorities = st.sampled_from([-1, 0, 1, 49, 50, 51])
    gaps = st.integers(0, 5)
    graces = st.integers(1, 50)
    policies = st.one_of(
        st.builds(lambda d, b, w, slots: serial(d, b, max_wait_s=w, slots=slots), st.sampled_from([0, 1e-9, 1]),
                  st.integers(0, 3), st.sampled_from([0.0, 0.0, 5e-9]), slot_settings(3)),
        st.builds(lambda p, slots: fifo(p, slots=slots), st.dictionaries(st.sampled_from(MODELS), st.integers(-2, 2)),
                  slot_settings(3)),
    )


_settings = settings(max_examples=200, deadline=None, stateful_step_count=60,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])

TestSerialAgainstReference = SerialMachine.TestCase
TestSerialAgainstReference.settings = _settings
TestFifoAgainstReference = FifoMachine.TestCase
TestFifoAgainstReference.settings = _settings
TestMixedPoliciesAgainstReference = SchedulerMachine.TestCase
TestMixedPoliciesAgainstReference.settings = _settings
TestTiesAgainstReference = TieMachine.TestCase
TestTiesAgainstReference.settings = settings(_settings, max_examples=100)
TestSlotsAgainstReference = SlotsMachine.TestCase
TestSlotsAgainstReference.settings = _settings
TestReservedSlotsAgainstReference = ReservedMachine.TestCase
TestReservedSlotsAgainstReference.settings = _settings
TestSlotTiesAgainstReference = SlotTieMachine.TestCase
TestSlotTiesAgainstReference.settings = settings(_settings, max_examples=100)
TestKeptPlacesAgainstReference = KeptMachine.TestCase
TestKeptPlacesAgainstReference.settings = _settings
