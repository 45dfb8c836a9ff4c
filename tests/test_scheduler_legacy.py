"""One slot is the scheduler as it was: today's core against a frozen copy of the core before slots.

`tests/legacy_scheduler.py` and `tests/legacy_estimate.py` are the scheduler and estimator of
main at d77fb0f, unchanged. Random interleavings of every command (arrivals, clock steps,
cancellations, loaded-model reports, reconfigurations, dispatches, releases of every kind,
expiry, drain) drive both with the same operations under policies whose slots are the default
(one, none reserved; built with and without an explicit `Slots()`). After every step both
must answer alike: each decision record field for field, each release, removal and expiry,
the snapshot (order, scores, running view, band statistics), and the estimated starts from the
same measurements.
"""

from __future__ import annotations

import dataclasses
import enum

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import legacy_estimate
import legacy_scheduler
import llamaswap.core.scheduler as scheduler_module
from test_scheduler_properties import fifo_policies, gaps_ns, models, priorities, serial_policies

from llamaswap.core import Estimator, ManualClock, Policy, Priority, PrioritySource, QueueFull, Scheduler, Slots
from llamaswap.core import UnknownRequest

LEGACY_FIELDS = {cls: [f.name for f in dataclasses.fields(cls)] for cls in (
    legacy_scheduler.Decision, legacy_scheduler.Queued, legacy_scheduler.Removed, legacy_scheduler.Released,
    legacy_scheduler.WaitingView, legacy_scheduler.RunningView, legacy_scheduler.BandStats)}


def legacy_policy(policy: Policy) -> legacy_scheduler.Policy:
    """The same settings for the old scheduler (which has no slots)."""
    assert policy.slots == Slots()
    return legacy_scheduler.Policy(legacy_scheduler.PolicyName(policy.name.value), policy.aging_divisor_s,
                                   policy.swap_affinity_bonus, dict(policy.model_priorities), policy.max_queued,
                                   policy.max_wait_s)


def same(new: object, old: object) -> None:
    """Every field the old record has is equal in the new one (enums compared by value)."""
    if old is None:
        assert new is None
        return
    assert new is not None
    for name in LEGACY_FIELDS[type(old)]:
        assert _plain(getattr(new, name)) == _plain(getattr(old, name)), (name, new, old)


def _plain(value: object) -> object:
    if isinstance(value, frozenset):
        return frozenset(str(v) for v in value)
    return value.value if isinstance(value, enum.Enum) else value


# Explicit one-slot settings must be the same as none at all.
with_slots = st.builds(lambda policy, explicit: dataclasses.replace(policy, slots=Slots(1, {}, 0)) if explicit
                       else policy, st.one_of(serial_policies, fifo_policies), st.booleans())
limited = st.builds(lambda policy, limit: dataclasses.replace(policy, max_queued=limit), with_slots,
                    st.sampled_from([0, 0, 1, 3, 8]))


class LegacyMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = ManualClock()
        self.count = 0
        self.saved = scheduler_module._COMPACT_SLACK, legacy_scheduler._COMPACT_SLACK
        self.new_estimator = Estimator(default_run_s=10.0, default_swap_s=5.0, samples=5)
        self.old_estimator = legacy_estimate.Estimator(default_run_s=10.0, default_swap_s=5.0, samples=5)

    @initialize(policy=limited, start=st.integers(0, 10**18), slack=st.sampled_from([0, 1, 1024]))
    def setup(self, policy, start, slack):
        scheduler_module._COMPACT_SLACK = legacy_scheduler._COMPACT_SLACK = slack
        self.clock.set_ns(start)
        self.new = Scheduler(policy, self.clock)
        self.old = legacy_scheduler.Scheduler(legacy_policy(policy), self.clock)

    def teardown(self) -> None:
        scheduler_module._COMPACT_SLACK, legacy_scheduler._COMPACT_SLACK = self.saved

    def _ids(self) -> list[str]:
        return [f"r{i}" for i in range(1, self.count + 1)] + ["ghost"]

    @rule(priority=priorities, model=models, gap=gaps_ns, size=st.integers(1, 6))
    def enqueue(self, priority, model, gap, size):
        for _ in range(size):
            self.clock.set_ns(self.clock.now_ns() + gap)
            self.count += 1
            rid = f"r{self.count}"
            prio = Priority(priority, PrioritySource.NUMBER)
            try:
                queued = self.new.enqueue(rid, prio, model)
            except QueueFull as full:
                with pytest.raises(legacy_scheduler.QueueFull) as old_full:
                    self.old.enqueue(rid, prio, model)
                assert (full.depth, full.limit) == (old_full.value.depth, old_full.value.limit)
            else:
                same(queued, self.old.enqueue(rid, prio, model))

    @rule(gap=gaps_ns)
    def advance(self, gap):
        self.clock.set_ns(self.clock.now_ns() + gap)

    @rule(data=st.data())
    def cancel(self, data):
        rid = data.draw(st.sampled_from(self._ids()))
        same(self.new.cancel(rid), self.old.cancel(rid))

    @rule(model=models, stale=st.booleans())
    def set_loaded_model(self, model, stale):
        as_of = self.new.dispatches - (1 if stale else 0)
        assert self.new.set_loaded_model(model, as_of=as_of) == self.old.set_loaded_model(model, as_of=as_of)

    @rule(policy=limited)
    def reconfigure(self, policy):
        self.new.reconfigure(policy)
        self.old.reconfigure(legacy_policy(policy))

    @rule(repeat=st.integers(1, 3))
    def dispatch(self, repeat):
        for _ in range(repeat):
            new, old = self.new.next(), self.old.next()
            same(new, old)
            if new is not None:
                assert (new.slots_busy, new.reserved_slot, self.new.slots_total) == (1, False, 1)

    @rule(data=st.data(), gap=gaps_ns, model_loaded=st.booleans(), reached_upstream=st.booleans(),
          first_byte=st.one_of(st.none(), st.floats(0, 100)))
    def release(self, data, gap, model_loaded, reached_upstream, first_byte):
        self.clock.set_ns(self.clock.now_ns() + gap)
        running = self.old.running_id
        rid = running if running is not None and data.draw(st.booleans()) else data.draw(st.sampled_from(self._ids()))
        try:
            old = self.old.release(rid, model_loaded=model_loaded, reached_upstream=reached_upstream)
        except legacy_scheduler.UnknownRequest as error:
            with pytest.raises(UnknownRequest) as new_error:
                self.new.release(rid, model_loaded=model_loaded, reached_upstream=reached_upstream)
            assert str(new_error.value) == str(error)
            return
        decision = self.new.running
        new = self.new.release(rid, model_loaded=model_loaded, reached_upstream=reached_upstream)
        same(new, old)
        for estimator in (self.new_estimator, self.old_estimator):
            estimator.record(new.model, run_s=new.run_ns / 1e9, first_byte_s=first_byte,
                             model_load=decision.model_load)

    @rule()
    def expire(self):
        new, old = self.new.expire_overdue(), self.old.expire_overdue()
        assert len(new) == len(old)
        for a, b in zip(new, old):
            same(a, b)

    @precondition(lambda self: self.count % 7 == 0)
    @rule()
    def drain(self):
        new, old = self.new.drain(), self.old.drain()
        assert len(new) == len(old)
        for a, b in zip(new, old):
            same(a, b)

    @rule()
    def snapshot(self):
        new, old = self.new.snapshot(), self.old.snapshot()
        assert new.policy.value == old.policy.value and new.loaded_model == old.loaded_model
        same(new.running, old.running)
        assert new.grants == (() if new.running is None else (new.running,))
        assert (new.slots, new.slots_busy) == (1, len(new.grants))
        assert len(new.waiting) == len(old.waiting)
        for a, b in zip(new.waiting, old.waiting):
            same(a, b)
        assert list(new.bands) == list(old.bands)  # the same Band (core/priority.py is unchanged)
        for band in new.bands:
            same(new.bands[band], old.bands[band])
        # The estimated starts: the old walk, the new one with and without one explicit slot,
        # and the one built from the snapshot (the running grant's remaining time first).
        waiting_models = [w.model for w in new.waiting]
        busy = 0.0
        if new.running is not None:
            busy = self.new_estimator.remaining_s(new.running.model, model_load=new.running.model_load,
                                                  running_s=new.running.running_s)
        old_starts = self.old_estimator.starts(waiting_models, loaded=old.loaded_model, busy_s=busy)
        interactive = [w.band.value == "interactive" for w in new.waiting]
        assert self.new_estimator.starts(waiting_models, loaded=new.loaded_model, busy_s=busy) == old_starts
        assert self.new_estimator.starts(waiting_models, loaded=new.loaded_model, remaining_s=[busy], slots=Slots(),
                                         interactive=interactive) == old_starts
        assert self.new_estimator.starts_of(new, Slots()) == old_starts

    @invariant()
    def same_state(self):
        if not hasattr(self, "new"):
            return
        assert self.new.depth == self.old.depth
        assert self.new.running_id == self.old.running_id
        same(self.new.running, self.old.running)
        assert self.new.loaded_model == self.old.loaded_model
        assert self.new.dispatches == self.old.dispatches
        assert self.new.next_deadline_ns() == self.old.next_deadline_ns()
        assert self.new.slots_busy == (0 if self.old.running_id is None else 1)


TestOneSlotIsTheOldScheduler = LegacyMachine.TestCase
TestOneSlotIsTheOldScheduler.settings = settings(max_examples=300, deadline=None, stateful_step_count=60,
                                                 suppress_health_check=[HealthCheck.too_slow,
                                                                        HealthCheck.filter_too_much])
