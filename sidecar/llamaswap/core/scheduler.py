"""The serial and fifo schedulers over a node's GPUs: on each, up to its slots of grants of the
model in effect there, best score first.

score = priority + swap affinity + aging, where aging = waited_seconds / agingDivisor.

Why heaps work although scores change with time: with one divisor for everyone, every
waiting request gains aging at the same rate, so

    score_i(t) * D = (priority_i + bonus_i) * D - arrival_i + t

and the `t` term is common to all. Ordering by the time-free key
``(priority + bonus) * D - arrival`` therefore orders by current score. The only bonus is
swap affinity, which applies to exactly the requests whose model is resident on a GPU that
takes work now (`order.warm_models`); those live in per-model heaps, so the winner is the
better of the top of the global heap and the top of each such model's heap plus the bonus
(`order.pick`). Integer nanoseconds: the comparison is exact, equal scores go by arrival.

The rule is `dispatch.choose` (each GPU read by `dispatch.turn`, one form whatever
``maxLoaded``), walked down the order by `node.find` (one GPU is a node of one); the estimates'
walk runs the same rule. Policy: `policy.py`; heaps: `index.py`; decisions and views: `decisions.py`.

Invariants, enforced here (by applying the rule to the one record of the grants):
- on a GPU, at most each resident model's slots of grants of it; a load only where there is
  room or idle models go for it (room for one model: once nothing runs); nothing beside a
  request that runs alone (``enqueue(alone=True)``: an unload);
- a request is either waiting, running, or gone; never two at once;
- the order ``snapshot`` shows is the order ``next`` grants in, one at a time (the same
  ``order.pick``; a reserved slot can let an interactive request start ahead);
- a report of the resident models older than the latest grant is ignored (``set_residents``);
- removed entries are deleted lazily from heaps and compacted when they outnumber the living
  (all at once when none is left: `index.QueueIndexes.clear`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Final

from llamaswap.core import idle, node, order
from llamaswap.core.arrivals import Arrivals
from llamaswap.core.clock import NS_PER_S, Clock
from llamaswap.core.decisions import (
    OVERTAKEN_LIMIT, BandStats, Decision, Queued, QueueSnapshot, Released, Removed, ReorderCause, RunningView,
    WaitingView, new_decision, new_queued, new_released,
)
from llamaswap.core.dispatch import NO_TIMES, GpuTimes, in_reserved_slot
from llamaswap.core.eviction import NOT_WAITED_FOR, Eviction, victims
from llamaswap.core.holding import GpuHolding
from llamaswap.core.errors import InvalidSlots, QueueFull, SchedulerError, UnknownRequest
from llamaswap.core.index import Entry, Index, QueueIndexes, entry_of
from llamaswap.core.kept import KeptPlace, KeptPlaces
from llamaswap.core.gpu_record import GpuRecord, NodeHolding
from llamaswap.core.policy import Policy, PolicyName
from llamaswap.core.preemption import Stop, Stopping
from llamaswap.core.priority import Band, Priority
from llamaswap.core.slots import Slots

# The scheduler's names, where they were before the rooms were split (imported from here too).
__all__ = ["NS_PER_S", "OVERTAKEN_LIMIT", "BandStats", "Decision", "InvalidSlots", "Policy", "PolicyName",
           "QueueFull", "QueueSnapshot", "Queued", "Released", "Removed", "ReorderCause", "RunningView",
           "Scheduler", "SchedulerError", "Slots", "UnknownRequest", "WaitingView"]

# Rebuild heaps once dead entries outnumber living ones by this much.
_COMPACT_SLACK: Final = 1024

# A grant's reasons by (aging changed the pick, swap affinity did): built once, not per grant.
_REASONS: Final = {
    (aging, affinity): frozenset((ReorderCause.AGING,) * aging + (ReorderCause.SWAP_AFFINITY,) * affinity)
    for aging in (False, True) for affinity in (False, True)}
_NOBODY: Final[tuple[str, ...]] = ()  # the requests a grant overtook where it waited alone


class Scheduler(idle.IdleUnloading):
    """Non-preemptive priority queue over a node's GPUs (one GPU is a node of one), each serving
    up to its slots of generations of its resident model at once (one, by default: the size-1
    resource of the specification)."""

    def __init__(self, policy: Policy, clock: Clock) -> None:
        self._clock = clock
        self._seq = 0
        self._gpus: list[GpuRecord] = []  # the GPUs, in the configured order
        self._gpu_of: dict[str, GpuRecord] = {}  # running request -> the GPU it runs on
        self._loads = 0  # model loads begun by grants so far: each pending load's number
        self._wanted: dict[str | None, int] = {}  # waiting requests per model they name
        self._kept = KeptPlaces()
        self._stops = Stopping()  # the stoppable grants running, and those ordered stopped (`preemption.py`)
        # The models the best waiting request holds back, by GPU (no new grants for them until
        # they drain and go), as the last `next` where a GPU took work found them: a claim is
        # made only there, so the grants never depend on anything else.
        self._held_back = node.HeldBackModels()
        self._shut_times: GpuTimes = NO_TIMES  # the times the last `next` that found no GPU taking work had
        self._apply_policy(policy)
        self._reset_queue()

    def _apply_policy(self, policy: Policy) -> None:
        self._policy = policy
        gpus = policy.gpus
        known = {gpu.name: gpu for gpu in self._gpus}
        if self._gpus and set(known) != {gpu.name for gpu in gpus}:
            raise SchedulerError("the GPUs cannot change while the scheduler runs")
        for gpu_policy in gpus:
            if gpu_policy.name in known:
                known[gpu_policy.name].apply(gpu_policy)
        if not self._gpus:
            self._gpus = [GpuRecord(gpu_policy, self._clock) for gpu_policy in gpus]
        names = [gpu.name for gpu in gpus]
        self._gpus.sort(key=lambda gpu: names.index(gpu.name))
        # What the GPUs hold (every change goes through a grant, a release, a loaded-model
        # report, `blocked_by` or the policy, each of which tells it).
        self._holding = NodeHolding(self._gpus)
        self._divisor_ns = policy.aging_divisor_ns  # cached: read several times per dispatch
        self._max_wait_ns = policy.max_wait_ns  # cached: the expiry timer reads it per request (a property that rounds)
        self._bonus = policy.swap_affinity_bonus
        self._indexes = QueueIndexes(self._divisor_ns, policy.reserves_slots)
        # Its members, as read at every grant (the same objects for as long as the policy stays).
        self._aged, self._plain, self._reserved = self._indexes.aged, self._indexes.plain, self._indexes.reserved

    def _reset_queue(self) -> None:
        self._waiting: dict[str, Entry] = {}
        self._wanted = {}
        self._dead_in_heaps = 0
        self._indexes.clear()
        self._arrivals = Arrivals()

    # -- state ---------------------------------------------------------------------------

    @property
    def policy(self) -> Policy:
        return self._policy

    @property
    def gpus(self) -> tuple[str, ...]:
        """The GPUs' names, in the configured order."""
        return tuple(gpu.name for gpu in self._gpus)

    def _gpu(self, gpu: str) -> GpuRecord:
        for record in self._gpus:
            if record.name == gpu:
                return record
        raise UnknownRequest(f"no GPU is named {gpu!r}")

    def residents_on(self, gpu: str) -> frozenset[str]:
        """The models resident on a GPU."""
        return self._gpu(gpu).residents

    def dispatches_on(self, gpu: str) -> int:
        """Grants so far on a GPU: the generation a loaded-model report was asked at."""
        return self._gpu(gpu).dispatches

    def set_residents(self, models: frozenset[str], *, as_of: int, gpu: str) -> bool:
        """The models an upstream reports as loaded (empty: none), asked when its ``dispatches_on`` was ``as_of``.

        A report that a grant has overtaken, or that arrives while requests run there
        (`GpuRecord.may_accept_report` says when one may), describes a past the scheduler
        has already moved on from: it is dropped. True if applied.
        """
        record = self._gpu(gpu)
        if as_of != record.dispatches or not record.may_accept_report(models):
            return False
        record.accept_report(models)
        self._holding.changed(residents=True)
        return True

    @property
    def depth(self) -> int:
        return len(self._waiting)

    @property
    def running_grants(self) -> tuple[Decision, ...]:
        """Every running grant, earliest first."""
        return tuple(gpu.grants[request_id].decision for request_id, gpu in self._gpu_of.items())

    def running_ids(self) -> Iterator[str]:
        """The requests of the running grants, earliest first."""
        return iter(self._gpu_of)

    def is_running(self, request_id: str) -> bool:
        return request_id in self._gpu_of

    def gpu_of(self, request_id: str) -> str | None:
        """The GPU a running request runs on (None: it does not run)."""
        gpu = self._gpu_of.get(request_id)
        return gpu.name if gpu is not None else None

    @property
    def slots_busy(self) -> int:
        """Grants running, over every GPU."""
        return len(self._gpu_of)

    def slots_busy_on(self, gpu: str) -> int:
        return len(self._gpu(gpu).grants)

    def holdings(self) -> tuple[GpuHolding, ...]:
        """What every GPU holds, in the configured order."""
        return self._holding.now()[0]

    def holding_of(self, gpu: str) -> GpuHolding:
        """What the GPU of that name holds."""
        return next(holding for holding in self.holdings() if holding.name == gpu)

    def not_unloaded(self, gpu: str, models: frozenset[str]) -> None:
        """Models a grant evicted that the upstream did not unload (`Decision.evicts`): counted
        resident again, whatever runs (fewer than it holds would let a load make it evict by itself)."""
        record = self._gpu(gpu)
        record.set_residents(record.residents | models)
        self._holding.changed(residents=True)

    def blocked_by(self, gpu: str, *, settling: bool, adopted: int,
                settling_model: str | None = None) -> bool:
        """The work the scheduler did not grant that holds a GPU now, as
        the runtime knows it: a settle under way there (of ``settling_model``'s abandoned
        generation, where known), and how many adopted exchanges run there. Nothing is granted
        there while either does; a settle of a known model holds only that model
        (`GpuHolding.settling_model`). True if that changed."""
        if not self._gpu(gpu).blocked_by(settling=settling, adopted=adopted, settling_model=settling_model):
            return False
        self._holding.changed(residents=True)  # (what it holds idle changed too)
        return True

    # -- commands ------------------------------------------------------------------------

    def enqueue(self, request_id: str, priority: Priority, model: str | None = None, *,
                priority_model: str | None = None, alone: bool = False,
                retry_key: bytes | None = None, max_tokens: int | None = None, stoppable: bool = False) -> Queued:
        """Add a waiting request; says the queue depth it found and its arrival time.

        ``model`` is what it is scheduled on; ``priority_model`` (default: the same) is the name
        whose per-model priority it gets, which differs where a single-model upstream puts every
        request on its one model whatever name the client sent. ``alone``: it changes what the
        upstream has loaded under any generation (an unload of ``model``): granted only when
        nothing runs, nothing is granted beside it, and it loads nothing (its release says
        whether ``model`` is still loaded). A ``retry_key`` under which a place is kept (`keep`)
        with the same priority and model takes that place over: the place's arrival time and
        arrival order, so its aging, position and max wait. ``stoppable``: once granted, it may be
        stopped for a higher band (a Batch API line: `preemption.py`)."""
        if request_id in self._waiting or request_id in self._gpu_of:
            raise SchedulerError(f"request {request_id!r} is already known")
        named = priority_model if priority_model is not None else model
        depth = len(self._waiting)
        now = self._clock.now_ns()
        place = None
        if retry_key is not None:
            place = self._kept.take_over(retry_key, priority, model, now, self._max_wait_ns)
        if place is None:
            limit = self._policy.max_queued
            if limit and depth + len(self._kept) >= limit:
                raise QueueFull(depth + len(self._kept), limit)
            self._seq += 1
            seq, arrival_ns = self._seq, now
        else:
            seq, arrival_ns = place.seq, place.arrival_ns
        entry = Entry(request_id, seq, priority, self._policy.base_priority(priority.value, named), model,
                      arrival_ns, named, alone, max_tokens, stoppable, place is not None and place.stopped)
        self._waiting[request_id] = entry
        self._wanted[model] = self._wanted.get(model, 0) + 1
        self._indexes.push(entry)
        if place is None:
            self._arrivals.add(entry)
        else:
            self._arrivals.add_in_order(entry)
        return new_queued(depth, entry.arrival_ns, place)

    def keep(self, request_id: str, key: bytes, grace_ns: int) -> tuple[Removed, KeptPlace | None] | None:
        """A waiting request's client left: remove it, and keep its place under ``key`` for
        ``grace_ns`` (unless a place is already kept under that key). None if it is not waiting:
        a request that got the GPU never has a place kept."""
        entry = self._waiting.get(request_id)
        if entry is None:
            return None
        self._remove(entry)
        now = self._clock.now_ns()
        place = KeptPlace.of(entry, key, now, grace_ns)
        return Removed.of(entry, now), place if self._kept.add(place) else None

    def expire_kept(self) -> list[KeptPlace]:
        """End every kept place whose grace period is over or that waited ``max_wait_s`` since
        its first arrival."""
        return self._kept.due(self._clock.now_ns(), self._max_wait_ns)

    def drain_kept(self) -> list[KeptPlace]:
        """End every kept place (shutdown), oldest first."""
        return self._kept.drain()

    @property
    def kept(self) -> tuple[KeptPlace, ...]:
        """The kept places, oldest first."""
        return self._kept.places()

    @property
    def kept_count(self) -> int:
        return len(self._kept)

    def cancel(self, request_id: str) -> Removed | None:
        """Remove a waiting request; None if it is not waiting (already granted or gone)."""
        entry = self._waiting.get(request_id)
        if entry is None:
            return None
        self._remove(entry)
        return Removed.of(entry, self._clock.now_ns())

    def next(self, times: GpuTimes = NO_TIMES) -> Decision | None:
        """Grant the best waiting request if a slot is free for it; None if nothing can start.
        A GPU that work the scheduler did not grant holds (`blocked_by`) takes nothing.

        The node rule (`dispatch.choose`, each GPU read by `dispatch.turn`) asked down the
        order (`node.find`; one GPU is a node of one): a request of a resident model (or none)
        takes a free slot of it, another model loads where there is room or idle models may go,
        else waits for the drain, as does a request that runs alone; a non-interactive request
        past its share (``slots - reserved``) leaves the reserved slots to the interactive ones
        behind it (their grant says ``reserved_slot``). ``times``: what the rule may know of run
        times and swap costs (it chooses among GPUs by them).
        """
        if not self._waiting:
            self._held_back.clear()  # (nobody waits to hold anything back)
            return None
        holdings, open_gpus, warm = self._holding.now()
        if not open_gpus:
            # Nothing starts and the best claims nothing (`node.find`; `held_back` shows what it would).
            self._shut_times = times
            return self._nothing_starts(warm) if self._stops.running else None
        # The one waiting request is the best (`order.pick` of a queue of one): no heap is read.
        first = self._arrivals.oldest if len(self._waiting) == 1 else order.pick(self._aged, warm, self._bonus)
        assert first is not None
        # (The requests the walk passed over are put back before the grant: its reasons read the
        # whole order.)
        found = node.find(holdings, first, self._aged, self._reserved[0] if self._reserved is not None else None,
                          warm, self._bonus, self._wanted, times, self._resume, self._need, self._held_back)
        if found is None:
            return self._nothing_starts(warm)
        index, winner, first = found
        gpu = self._gpus[index]
        holding = holdings[index]  # what it holds now (`gpu.holding`)
        reserved_slot = in_reserved_slot(holding, winner)
        if winner is not first and reserved_slot:
            # Ahead of a better-scored request that used up its share: it won among the
            # interactive requests, so why it won is said among them.
            assert self._reserved is not None
            aged, plain = self._reserved
        else:
            aged, plain = self._aged, self._plain
        # Models the best holds back for its own load go for its load only.
        keep = () if winner is first else self._held_back.models.get(gpu.name, ())
        return self._grant(gpu, holding, winner, aged, plain, reserved_slot, warm, keep)

    def _nothing_starts(self, warm: frozenset[str]) -> Decision | None:
        """The best waits and starts nowhere: where stoppable grants run, it may order stops."""
        if self._stops.running:
            self._stops.ask(self._gpus, order.pick(self._aged, warm, self._bonus), self._clock.now_ns(),
                            self._policy.stop_min_run_ns)
        return None

    def stops(self) -> list[Stop]:
        """The running grants ordered stopped since the last call, each said once (`preemption.py`)."""
        return self._stops.orders()

    def _need(self, model: str) -> tuple[float, float]:
        """How much the queue needs ``model``: its best waiting request's key, then arrival
        (`eviction.Need`)."""
        top = self._aged.top_of(model)
        return NOT_WAITED_FOR if top is None else (-top[0], -top[1])

    @property
    def held_back(self) -> Mapping[str, str | None]:
        """The resident model the best waiting request holds back on a GPU (by name), the busy
        one it waits for: no new grants for it until it drains and goes (`_holding_back`)."""
        return self._holding_back().shown()

    def _holding_back(self) -> node.HeldBackModels:
        """What the picture shows held back: the claim in force, as the last `next` where a GPU
        took work made it; where none takes work now, the claim the best would make (worked out
        at each read and never kept: `node.would_hold`)."""
        if not self._waiting:
            return node.HeldBackModels()
        holdings, open_gpus, warm = self._holding.now()
        if open_gpus:
            return self._held_back
        first = order.pick(self._aged, warm, self._bonus)
        return node.would_hold(holdings, first, self._shut_times, self._wanted, self._need, self._held_back)

    def _resume(self, suspended: list[Entry]) -> None:
        """Put the requests a node walk passed over back in the indexes. Their old items, where
        no prune met them, stay as twins: counted as dead, so compaction clears them."""
        for entry in suspended:
            entry.alive = True
            self._indexes.push(entry)
        self._dead_in_heaps += len(suspended)
        suspended.clear()
        if self._dead_in_heaps > len(self._waiting) + _COMPACT_SLACK:
            self._compact()

    def _grant(self, gpu: GpuRecord, holding: GpuHolding, winner: Entry, aged: Index, plain: Index | None,
               reserved_slot: bool, warm: frozenset[str], keep: Sequence[str | None]) -> Decision:
        now = self._clock.now_ns()
        residents = gpu.residents
        reasons, overtook = _REASONS[False, False], _NOBODY  # it waited alone: nothing reordered it, it overtook nobody
        if len(self._waiting) > 1:
            reasons = _REASONS[plain is not None and order.pick(plain, warm, self._bonus) is not winner,
                               bool(self._bonus and residents) and entry_of(aged.top()) is not winner]
            overtook = self._arrivals.before(winner, OVERTAKEN_LIMIT)
        self._remove(winner)
        model = winner.model
        alone = winner.alone
        loads = model is not None and not alone and model not in residents
        gone: tuple[Eviction, ...] = ()  # the resident models its load makes room by (room for one: the one)
        if loads:
            assert model is not None
            found = victims(holding, model, self._need, keep)
            assert found is not None, "the rule starts a load only where it has room or idle models may go"
            gone = found
        # The affinity bonus and the aging term, inline: this runs once per grant.
        affinity = self._bonus if model is not None and model in residents else 0
        divisor = self._divisor_ns
        aging = (now - winner.arrival_ns) / divisor if divisor else 0.0
        gpu.dispatches += 1
        # Its ready time, set here once (`Decision.ready_at`): its own load's end, else its model's
        # load under way; with no model, it shares what is in effect there: the first load under way.
        if model is None:
            loading = holding.loading
        else:
            loader = gpu.loaders.get(model)
            loading = (model, now) if loads else None if loader is None else (model, loader.granted_ns)
        # Every field, in the order of Decision's (`decisions.built_by_assignment`: 2 us less a grant).
        decision = new_decision(
            winner.request_id,  # request_id
            winner.priority.value,  # priority
            winner.priority.band,  # band
            winner.base + affinity + aging,  # score
            winner.arrival_ns,  # arrival_ns
            now,  # granted_ns
            model,  # model
            affinity > 0,  # swap_affinity
            aging,  # aging
            loads and not gone,  # load
            loads and bool(gone),  # swap
            residents,  # residents_before
            reasons,  # reordered_by
            overtook,  # overtook
            len(self._waiting),  # queue_depth_after
            holding.running.busy + 1,  # slots_busy
            reserved_slot,  # reserved_slot
            alone,  # alone
            gpu.name,  # gpu
            loading,  # ready_at
            winner.max_tokens,  # max_tokens
            () if holding.residency.replaces_by_itself else gone,  # evicts: those unloaded first
        )
        if loads:
            self._loads += 1
        gpu.granted(winner, decision, holding, self._loads if loads else None, gone)
        self._gpu_of[winner.request_id] = gpu
        self._stops.running += winner.stoppable  # (`Stopping.granted`, inline: this runs at every grant)
        self._holding.changed(residents=loads)
        return decision

    def release(self, request_id: str, *, model_loaded: bool | None = True,
                reached_upstream: bool = True, keep_as: bytes | None = None, grace_ns: int = 0) -> Released:
        """End one running request's grant.

        ``model_loaded=False`` says the upstream failed the request (or unloaded its model), so
        its model is not known to be loaded: the loaded model becomes unknown until the upstream
        reports it. ``model_loaded=None`` says the upstream's answer tells nothing about the
        model (a 4xx, `core.model_stays_loaded`): what was loaded stays so, unless this grant
        used a load that no release has confirmed (it may never have happened: a model name the
        upstream does not know), below.
        ``reached_upstream=False`` says the grant was never used (its client left as it was
        given). A grant that loaded its model, and the grants of that model made while it stayed
        loaded, are that load's users: when the last of them is released and none confirmed the
        load, what was loaded before the load still is if none reached the upstream, and nothing
        is known to be loaded if some did with an answer that said nothing. (With one slot: a
        grant that never reached the upstream leaves the model loaded before it.) ``keep_as``: a
        stopped grant, whose request comes back to resume: its place is kept under that key for
        ``grace_ns`` (`keep`), its first arrival and order with it.
        """
        gpu = self._gpu_of.pop(request_id, None)
        if gpu is None:
            raise UnknownRequest(f"request {request_id!r} does not hold the grant")
        grant = gpu.grants.pop(request_id)
        now = self._clock.now_ns()
        if grant.entry.stoppable and self._stops.released(grant.entry, gpu) and keep_as is not None:
            self._kept.add(KeptPlace.of(grant.entry, keep_as, now, grace_ns, stopped=True))
        gpu.renew()
        residents = gpu.residents
        gpu.released(grant, now, model_loaded=model_loaded, reached_upstream=reached_upstream)
        self._holding.released(not self._gpu_of, gpu.residents is not residents)
        return new_released(request_id, grant.entry.model, grant.decision.granted_ns, now)

    def expire_overdue(self) -> list[Removed]:
        """Remove every request that has waited longer than ``max_wait_s``."""
        limit_ns = self._max_wait_ns
        if not limit_ns:
            return []
        now = self._clock.now_ns()
        expired: list[Removed] = []
        while True:
            entry = self._arrivals.oldest
            if entry is None or now - entry.arrival_ns < limit_ns:
                return expired
            self._remove(entry)
            expired.append(Removed.of(entry, now))

    def next_deadline_ns(self) -> int | None:
        """When the oldest waiting request will be overdue, or a kept place falls due
        (`expire_overdue`, `expire_kept`); None if neither can happen."""
        limit_ns = self._max_wait_ns
        entry = self._arrivals.oldest if limit_ns else None
        waiting = None if entry is None else entry.arrival_ns + limit_ns
        kept = self._kept.next_deadline_ns(limit_ns) if self._kept else None
        if waiting is None or kept is None:
            return waiting if kept is None else kept
        return min(waiting, kept)

    def reconfigure(self, policy: Policy, priority_models: Mapping[str, str | None] | None = None) -> None:
        """Apply new settings to the waiting requests, keeping their arrival times. Running
        grants keep their slots; with fewer slots than run, nothing starts until enough end.
        ``priority_models`` gives waiting requests the ``models.<id>`` entry that is theirs under
        the new settings (an entry added by the reload; None: their scheduled model's)."""
        alive = self._arrivals.order()
        self._apply_policy(policy)
        for entry in alive:
            if priority_models is not None and entry.request_id in priority_models:
                named = priority_models[entry.request_id]
                entry.priority_model = named if named is not None else entry.model
            entry.base = policy.base_priority(entry.priority.value, entry.priority_model)
        self._indexes.rebuild(alive)
        self._dead_in_heaps = 0

    def drain(self) -> list[Removed]:
        """Remove every waiting request (shutdown), oldest first."""
        now = self._clock.now_ns()
        removed = [Removed.of(entry, now) for entry in self._arrivals.order()]
        for entry in self._waiting.values():
            entry.alive = False
        self._reset_queue()
        return removed

    # -- inspection ----------------------------------------------------------------------

    def snapshot(self) -> QueueSnapshot:
        """A read-only picture (`order.snapshot`): O(n log n), so keep it off hot paths."""
        return order.snapshot(self._policy, self._gpus, self._aged, len(self._waiting), self.running_grants,
                              self._arrivals, self._clock.now_ns(), self._holding_back().models,
                              self._held_back.claim_in_force() if self._waiting else None)

    def band_stats(self) -> dict[Band, BandStats]:
        """Depth and oldest wait per band in O(1) amortised (for metrics)."""
        return order.band_stats(self._arrivals, self._clock.now_ns())

    # -- internals -----------------------------------------------------------------------

    def _remove(self, entry: Entry) -> None:
        entry.alive = False
        self._arrivals.remove(entry)
        del self._waiting[entry.request_id]
        left = self._wanted[entry.model] - 1
        if left:
            self._wanted[entry.model] = left
        else:
            del self._wanted[entry.model]
        self._dead_in_heaps += 1
        if not self._waiting:  # every item in the heaps is dead: they all go at once
            self._indexes.clear()
            self._dead_in_heaps = 0
        elif self._dead_in_heaps > len(self._waiting) + _COMPACT_SLACK:
            self._compact()

    def _compact(self) -> None:
        alive = self._arrivals.order()
        self._indexes.rebuild(alive)
        self._arrivals.compact(alive)
        self._dead_in_heaps = 0
