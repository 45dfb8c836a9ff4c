"""A brute-force reference for several models resident on each GPU (docs/scheduling.md, "Several
models on one GPU", and docs/glossary.md: room, evict, held back, pinned), for the property tests
of tests/test_resident_properties.py. `maxLoaded: 1` is the same rule here: a GPU with room for one
model, where a load replaces the one idle resident (a swap, not an eviction) and the best waiting
request's wait holds the whole GPU (the glossary's claim).

Nothing is shared with `llamaswap.core`: the only things read from the real configuration are its
public settings (`RefResidentGpuPolicy.of`). Every choice is made by trying every candidate and
taking the best by the comparator the documents give:

- A waiting request's score: priority (+ its model's priority, fifo) + the swap-affinity bonus if
  its model is resident on a GPU that takes work now + aging; best first, then arrival.
- Per GPU, for one request of model m (requests here always name a model and never run alone):
  nothing runs: it starts there ("idle"); m resident: a free slot of m is its ("free"), unless m's
  slots are all taken ("full") or it is below the interactive band and m's non-interactive work
  holds its whole share (``slots - reserved``: "share"); m not resident: "room" if m fits beside
  the residents (count and memory: a model of unknown size weighs the whole budget), "evict" if it
  fits once every model that may go has gone, else "other" (it waits).
- A model may go (be evicted) when it is resident, not pinned, nothing runs on it, and the best
  waiting request does not hold it back.
- Which models go for a load: of the sets of models that may go whose leaving makes m fit, the one
  that keeps the models the queue needs most: models ranked least needed first (need: the best
  waiting request for it, by score without the bonus then earlier arrival; nothing waiting:
  least), then least recently used (last granted on that GPU; never: first), then by name (a tie
  the documents leave open); two sets compare by the highest-ranked model in which they differ,
  the set that keeps it wins. (So no model goes that the load does not need: "as many as the
  load needs, and no more"; a large one that goes last puts back the smaller ones before it.)
  Its reason: ``least_needed`` if something waits for it; else ``least_recently_used`` if some
  model that may go and ranks after it is not waited for either (recency decided); else
  ``not_waited_for``.
- Over the node, for one request (the order above, each request asked over the GPUs no request
  ahead of it claimed): 1. a free slot where m is resident, the least busy GPU first; 2. else a
  GPU where it may start now (idle, room or evict): one where m is resident first, else the
  cheapest (no eviction first, then the fewest waiting requests for the models that may go, then
  the least busy), unless a GPU where m is resident (no slot for it now) frees one sooner than the
  load takes; 3. else it waits for the GPU where m is resident that frees a slot first, else for
  the GPU that drains first (then the least busy). Ties: the configured order.
- Only the best waiting request holds anything back. Where it waits on a GPU of ``maxLoaded`` 1,
  it claims the whole GPU. Where several models may be resident: for a slot of its own resident
  model, that model; for a load, the models chosen to go as above, but ranking the idle ones
  first, then the busy ones (so it waits for as few busy ones as it can); none would do: the whole
  GPU. While the same request stays the best and waits on the same GPU, it keeps holding the same
  models as long as they are still resident and their leaving still makes room. Where it waits
  only for its share (non-interactive, only reserved slots free), the reserved slots stay open to
  interactive requests: the GPU (``maxLoaded`` 1) or its model (several) takes no non-interactive
  request meanwhile.
- The best claims only where some GPU takes work (`RefResidentGpu.takes_work`): while none does,
  the claim made last stays as it was, and what is shown held back is the claim the best would
  make then (shown, never kept).

Releases here are answers that say the model served (it stays resident); reports of the resident
models are taken while nothing runs on the GPU.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Mapping, Sequence
from fractions import Fraction

from reference import INTERACTIVE, RefGpuPolicy, RefNoTimes, RefPolicy, RefTimes

NOT_WAITED_FOR = "not_waited_for"
LEAST_NEEDED = "least_needed"
LEAST_RECENTLY_USED = "least_recently_used"


@dataclasses.dataclass(frozen=True)
class RefResidency:
    max_loaded: int = 1
    pinned: frozenset[str] = frozenset()
    memory: int | None = None  # None: count only
    sizes: Mapping[str, int] = dataclasses.field(default_factory=dict)

    def size(self, model: str) -> int:
        """A model of unknown size weighs the whole budget."""
        return self.sizes[model] if model in self.sizes else (self.memory or 0)

    def fits(self, models: frozenset[str] | set[str]) -> bool:
        if len(models) > self.max_loaded:
            return False
        return self.memory is None or sum(self.size(model) for model in models) <= self.memory


@dataclasses.dataclass(frozen=True)
class RefResidentGpuPolicy(RefGpuPolicy):
    """One GPU as the configuration describes it (`reference.RefGpuPolicy`), with its residency."""

    residency: RefResidency = RefResidency()

    @classmethod
    def of(cls, gpu) -> "RefResidentGpuPolicy":
        """Read the public settings of a real ``GpuPolicy`` (nothing else)."""
        base = RefGpuPolicy.of(gpu)
        residency = gpu.residency
        return cls(base.name, base.slots, base.model_slots, base.reserved, base.models,
                   RefResidency(residency.max_loaded, frozenset(residency.pinned), residency.memory_bytes,
                                dict(residency.model_bytes)))

    def may_serve(self, model: str | None) -> bool:
        """Its ``models`` allow it, and it can ever be resident there beside the pinned ones."""
        if not super().may_serve(model):
            return False
        if model is None:
            return True
        pinned = self.residency.pinned
        return model in pinned or self.residency.fits(pinned | {model})


@dataclasses.dataclass
class RefWaiting:
    request_id: str
    order: int
    priority: int
    model: str
    arrival_ns: int

    @property
    def interactive(self) -> bool:
        return self.priority >= INTERACTIVE


class RefResidentGpu:
    def __init__(self, policy: RefResidentGpuPolicy) -> None:
        self.policy = policy
        self.residents: set[str] = set()
        self.running: list[RefWaiting] = []  # its grants, in grant order
        self.last_used: dict[str, int] = {}  # model -> when it was last granted here
        self.blocked = False

    @property
    def name(self) -> str:
        return self.policy.name

    @property
    def residency(self) -> RefResidency:
        return self.policy.residency

    def busy_of(self, model: str) -> tuple[int, int]:
        """The grants of ``model`` running here, and how many of them are below the interactive band."""
        mine = [r for r in self.running if r.model == model]
        return len(mine), sum(1 for r in mine if not r.interactive)

    def has_free_slot(self, model: str) -> bool:
        return self.busy_of(model)[0] < self.policy.slots_of(model)

    def takes_work(self) -> bool:
        """Some request could start here now: nothing runs, a resident model has a free slot, or
        a place is free for another model."""
        if self.blocked:
            return False
        if not self.running:
            return True
        return (any(self.has_free_slot(model) for model in self.residents)
                or len(self.residents) < self.residency.max_loaded)

    def may_go(self, held: set[str]) -> set[str]:
        running = {r.model for r in self.running}
        return {m for m in self.residents if m not in self.residency.pinned and m not in running and m not in held}


@dataclasses.dataclass(frozen=True)
class RefResidentDecision:
    request_id: str
    gpu: str
    model: str
    score: Fraction
    swap_affinity: bool
    load: bool
    swap: bool
    reserved_slot: bool
    slots_busy: int  # on its GPU, itself included
    evicts: frozenset[tuple[str, str]]  # (model, reason)
    residents_after: frozenset[str]


def spare_the_most_needed(ranked: Sequence[str], works: Callable[[frozenset[str]], bool]) -> frozenset[str] | None:
    """Of the sets of ``ranked`` (least needed first) for which ``works`` holds, the one that keeps
    the most needed models: sets compare by the highest-ranked model in which they differ, the one
    without it wins. None if no set works. Brute force: every subset."""
    best: frozenset[str] | None = None
    best_weight = None
    for size in range(len(ranked) + 1):
        for chosen in itertools.combinations(range(len(ranked)), size):
            going = frozenset(ranked[i] for i in chosen)
            if not works(going):
                continue
            weight = sum(2**i for i in chosen)
            if best_weight is None or weight < best_weight:
                best, best_weight = going, weight
    return best


class ReferenceResidentNode:
    """The rule by brute force over GPUs that each keep one or more models resident."""

    def __init__(self, policy: RefPolicy, gpus: Sequence[RefResidentGpuPolicy], now_ns: Callable[[], int]) -> None:
        self.policy = policy
        self.gpus = [RefResidentGpu(gpu) for gpu in gpus]
        self._now_ns = now_ns
        self.waiting: list[RefWaiting] = []  # arrival order
        self.running: dict[str, RefResidentGpu] = {}
        self._order = 0
        # What the best held back at the latest `next` where a GPU took work: (its request, the
        # GPU, the models; () for the whole GPU), or None.
        self.hold: tuple[str, str, frozenset[str]] | None = None
        self._times: RefTimes = RefNoTimes()  # those of the latest `next`, for what is shown held back

    def gpu(self, name: str) -> RefResidentGpu:
        return next(gpu for gpu in self.gpus if gpu.name == name)

    # -- commands --------------------------------------------------------------------------

    def enqueue(self, request_id: str, priority: int, model: str) -> None:
        self._order += 1
        self.waiting.append(RefWaiting(request_id, self._order, priority, model, self._now_ns()))

    def cancel(self, request_id: str) -> bool:
        for request in self.waiting:
            if request.request_id == request_id:
                self.waiting.remove(request)
                return True
        return False

    def release(self, request_id: str) -> None:
        """An answer that says its model served: it stays resident."""
        gpu = self.running.pop(request_id)
        gpu.running = [r for r in gpu.running if r.request_id != request_id]

    def report(self, gpu: str, models: frozenset[str]) -> None:
        record = self.gpu(gpu)
        assert not record.running, "a report is taken only while nothing runs"
        record.residents = set(models)

    # -- scores and needs ------------------------------------------------------------------

    def base(self, request: RefWaiting) -> Fraction:
        total = Fraction(request.priority)
        if self.policy.name == "fifo":
            total += self.policy.model_priorities.get(request.model, 0)
        if self.policy.divisor_ns:
            total += Fraction(self._now_ns() - request.arrival_ns, self.policy.divisor_ns)
        return total

    def warm(self) -> set[str]:
        """Models resident on a GPU that takes work now: their requests have the bonus."""
        return {model for gpu in self.gpus if gpu.takes_work() for model in gpu.residents}

    def score(self, request: RefWaiting, warm: set[str]) -> Fraction:
        return self.base(request) + (self.policy.bonus if request.model in warm else 0)

    def need(self, model: str, waiting: Sequence[RefWaiting]) -> tuple:
        """How much the queue needs ``model``: its best waiting request's score (no bonus), then
        earlier arrival; least of all when nothing waits for it."""
        mine = [(self.base(r), -r.order) for r in waiting if r.model == model]
        return (1, max(mine)) if mine else (0,)

    def ranked(self, gpu: RefResidentGpu, models: set[str], waiting: Sequence[RefWaiting]) -> list[str]:
        """Least needed first, then least recently used, then by name."""
        return sorted(models, key=lambda m: (self.need(m, waiting), gpu.last_used.get(m, -1), m))

    # -- the rule --------------------------------------------------------------------------

    def verdict(self, gpu: RefResidentGpu, request: RefWaiting, held: set[str], share_kept: bool) -> str:
        m = request.model
        if not gpu.running:
            return "idle"
        if m in gpu.residents:
            busy, below = gpu.busy_of(m)
            if busy >= gpu.policy.slots_of(m):
                return "full"
            if not request.interactive and (share_kept or below >= gpu.policy.slots_of(m) - gpu.policy.reserved):
                return "share"
            return "free"
        if gpu.residency.fits(gpu.residents | {m}):
            return "room"
        if gpu.residency.fits((gpu.residents - gpu.may_go(held)) | {m}):
            return "evict"
        return "other"

    def where(self, request: RefWaiting, closed: set[str], held: dict[str, set[str]],
              share_kept: set[tuple[str, str | None]], times: RefTimes) -> tuple[str, RefResidentGpu] | None:
        """("start", gpu), ("wait", gpu) or ("wait for share", gpu); None: nowhere it may go."""
        m = request.model
        rank = {gpu.name: i for i, gpu in enumerate(self.gpus)}
        mine = [gpu for gpu in self.gpus if not gpu.blocked and gpu.name not in closed
                and gpu.policy.may_serve(m) and m not in held.get(gpu.name, set())]
        can = {gpu.name: self.verdict(gpu, request, held.get(gpu.name, set()),
                                      (gpu.name, None) in share_kept or (gpu.name, m) in share_kept)
               for gpu in mine}
        free = [gpu for gpu in mine if can[gpu.name] == "free"]
        if free:
            return "start", min(free, key=lambda g: (len(g.running), rank[g.name]))
        having = [gpu for gpu in mine if m in gpu.residents and gpu.running]  # no slot for it now
        soonest = min(having, key=lambda g: (times.slot_free_in_s(g.name), rank[g.name]), default=None)

        def wait(gpu: RefResidentGpu) -> tuple[str, RefResidentGpu]:
            return ("wait for share" if can[gpu.name] == "share" else "wait"), gpu

        startable = [gpu for gpu in mine if can[gpu.name] in ("idle", "room", "evict")]
        if startable:
            warm = [gpu for gpu in startable if m in gpu.residents]
            if warm:
                return "start", warm[0]

            def cost(g: RefResidentGpu) -> tuple:
                evicts = not g.residency.fits(g.residents | {m})
                wanted = sum(1 for r in self.waiting for other in g.may_go(held.get(g.name, set()))
                             if r.model == other) if evicts else 0
                return evicts, wanted, len(g.running), rank[g.name]

            target = min(startable, key=cost)
            if soonest is not None and times.slot_free_in_s(soonest.name) < times.swap_s(m, target.name):
                return wait(soonest)
            return "start", target
        if soonest is not None:
            return wait(soonest)
        busy = [gpu for gpu in mine if gpu.running]
        if not busy:
            return None
        return wait(min(busy, key=lambda g: (times.drained_in_s(g.name), len(g.running), rank[g.name])))

    def holds_for(self, gpu: RefResidentGpu, request: RefWaiting) -> frozenset[str]:
        """What the best request, waiting on ``gpu``, holds back there (empty: the whole GPU)."""
        m = request.model
        residency = gpu.residency
        if residency.max_loaded == 1:
            return frozenset()
        if m in gpu.residents:
            return frozenset({m})
        unpinned = gpu.residents - residency.pinned
        if self.hold is not None and self.hold[:2] == (request.request_id, gpu.name):
            kept = self.hold[2]
            if kept and kept <= unpinned and residency.fits((gpu.residents - kept) | {m}):
                return kept
        idle = gpu.may_go(set())
        ranked = self.ranked(gpu, idle, self.waiting) + self.ranked(gpu, unpinned - idle, self.waiting)
        going = spare_the_most_needed(ranked, lambda s: residency.fits((gpu.residents - s) | {m}))
        return going if going is not None else frozenset()

    def choose(self, times: RefTimes) -> tuple[RefWaiting, RefResidentGpu, dict[str, set[str]]] | None:
        warm = self.warm()
        order = sorted(self.waiting, key=lambda r: (-self.score(r, warm), r.order))
        closed: set[str] = set()
        held: dict[str, set[str]] = {}
        share_kept: set[tuple[str, str | None]] = set()
        for rank, request in enumerate(order):
            found = self.where(request, closed, held, share_kept, times)
            if found is None:
                if rank == 0:
                    self.hold = None
                continue
            step, gpu = found
            if step == "start":
                if rank == 0:
                    self.hold = None
                return request, gpu, held
            if rank == 0:
                models = self.holds_for(gpu, request)
                self.hold = (request.request_id, gpu.name, models)
                if step == "wait for share":
                    share_kept.update((gpu.name, model) for model in models) if models else share_kept.add(
                        (gpu.name, None))
                elif models:
                    held[gpu.name] = set(models)
                else:
                    closed.add(gpu.name)
        return None

    def held_back(self) -> dict[str, frozenset[str]]:
        """The models shown held back, by GPU (a whole-GPU claim holds no model): the last claim;
        while no GPU takes work, the claim the best would make now (not kept)."""
        if not self.waiting:
            return {}
        hold = self.hold
        if not any(gpu.takes_work() for gpu in self.gpus):
            assert self.choose(self._times) is None  # (nothing starts; it sets the claim)
            hold, self.hold = self.hold, hold
        if hold is None or not hold[2]:
            return {}
        return {hold[1]: hold[2]}

    def next(self, times: RefTimes | None = None) -> RefResidentDecision | None:
        times = times if times is not None else RefNoTimes()
        self._times = times
        if not self.waiting:
            self.hold = None
            return None
        if not any(gpu.takes_work() for gpu in self.gpus):
            return None  # nothing starts, and the best claims nothing
        chosen = self.choose(times)
        if chosen is None:
            return None
        winner, gpu, held = chosen
        m = winner.model
        before = frozenset(gpu.residents)
        affinity = bool(self.policy.bonus) and m in before
        score = self.base(winner) + (self.policy.bonus if affinity else 0)
        busy, below = gpu.busy_of(m)
        reserved_slot = winner.interactive and busy > 0 and below >= gpu.policy.slots_of(m) - gpu.policy.reserved
        self.waiting.remove(winner)
        evicts: frozenset[tuple[str, str]] = frozenset()
        if m not in before:
            residency = gpu.residency
            if residency.max_loaded == 1:
                gpu.residents = {m}  # the load replaces the resident model: a swap
            else:
                may_go = gpu.may_go(held.get(gpu.name, set()))
                ranked = self.ranked(gpu, may_go, self.waiting)
                going = spare_the_most_needed(ranked, lambda s: residency.fits((before - s) | {m}))
                assert going is not None, "the rule started a load with no room"
                evicts = frozenset((victim, self._reason(victim, ranked)) for victim in going)
                gpu.residents = set(before - going) | {m}
        loads = m not in before
        swap = loads and bool(before - gpu.residents)
        gpu.running.append(winner)
        gpu.last_used[m] = self._now_ns()
        self.running[winner.request_id] = gpu
        return RefResidentDecision(winner.request_id, gpu.name, m, score, affinity, loads and not swap, swap,
                                   reserved_slot, len(gpu.running), evicts, frozenset(gpu.residents))

    def _reason(self, victim: str, ranked: list[str]) -> str:
        waited = {r.model for r in self.waiting}
        if victim in waited:
            return LEAST_NEEDED
        after = ranked[ranked.index(victim) + 1:]
        return LEAST_RECENTLY_USED if any(other not in waited for other in after) else NOT_WAITED_FOR
