"""A brute-force reference scheduler for the property tests.

It is deliberately naive: every dispatch scans the whole queue and computes each waiting
request's score exactly, as a ``fractions.Fraction``:

    score = priority (+ the model's configured priority, fifo only)
          + swapAffinityBonus, if the request's model is the loaded model (serial only)
          + (now_ns - arrival_ns) / divisor_ns (serial only, divisor 0 disables it)

The best score wins; equal scores keep arrival order. Nothing here is shared with
``llamaswap.core.scheduler``'s heap logic: the only thing read from a ``Policy`` are its
public settings, so a mistake in the real key arithmetic cannot hide in both.

Slots, straight from the issue's words: up to ``slots`` grants run at once (the slots of the
model the running grants name, else of the loaded model, else the default). With nothing
running the best request goes. While some run, the best request goes if it needs the loaded
model or none; if it needs another model nothing goes. A non-interactive request (priority
below 50) goes only while fewer than ``slots - reserved`` non-interactive ones run; when the
best one is held back that way, the best interactive request that needs the loaded model or
none goes instead (one that needs another model holds nothing: only the best holds the GPU).
An interactive grant while non-interactive work holds its whole share says ``reserved_slot``
(it took a slot the share could not). A request that runs alone (a model unload) goes only when
nothing runs, nothing goes beside it, and it loads nothing.

What a release says about the loaded model: a failure (False) makes it unknown if it was the
released request's model; an answer that says nothing (None, a 4xx) keeps it, unless the load
it came from is confirmed by no release yet: then, when its last user ends, it is unknown; a
grant that never reached the upstream, as the last user of an unconfirmed load no user reached
the upstream with, puts back what was loaded before the load.

Kept places (routing.retryGraceSeconds): a waiting request whose client leaves keeps its place
under a key (the first one kept under that key; a request that ran never keeps one); a later
request with that key, the same priority and the same model, before the place's grace period
ends and before maxWaitSeconds since the first arrival, takes it: the first arrival's time and
arrival order, as if it had never left.

Several GPUs (`ReferenceNode`, at the end): one queue over GPUs that each keep the above for
themselves, and the node rule of docs/scheduling.md that says which request starts on which.

Several models resident on a GPU (`maxLoaded`, memory budgets, pinned models, evictions and the
models the best waiting request holds back): tests/reference_resident.py, on the same scores.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from fractions import Fraction
from typing import Protocol

NS_PER_S = 1_000_000_000
OVERTAKEN_LIMIT = 16  # the decision record names at most this many overtaken requests
INTERACTIVE = 50  # the specification's interactive band starts here


@dataclasses.dataclass(frozen=True)
class RefPolicy:
    name: str = "serial"  # "serial" | "fifo"
    aging_divisor_s: float = 60.0
    swap_affinity_bonus: int = 10
    model_priorities: Mapping[str, int] = dataclasses.field(default_factory=dict)
    slots: int = 1
    model_slots: Mapping[str, int] = dataclasses.field(default_factory=dict)
    reserved: int = 0

    divisor_ns: int = dataclasses.field(init=False)
    bonus: int = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        # Configured in seconds; time is integer nanoseconds. fifo neither ages nor favours.
        fifo = self.name == "fifo"
        object.__setattr__(self, "divisor_ns", 0 if fifo else round(Fraction(self.aging_divisor_s) * NS_PER_S))
        object.__setattr__(self, "bonus", 0 if fifo else self.swap_affinity_bonus)

    @classmethod
    def of(cls, policy) -> "RefPolicy":
        """Read the public settings of a real ``Policy`` (nothing else)."""
        return cls(policy.name, policy.aging_divisor_s, policy.swap_affinity_bonus, dict(policy.model_priorities),
                   policy.gpus[0].slots.default, dict(policy.gpus[0].slots.per_model), policy.gpus[0].slots.reserved)

    def slots_of(self, model: str | None) -> int:
        return self.slots if model is None else self.model_slots.get(model, self.slots)


@dataclasses.dataclass
class RefRequest:
    request_id: str
    order: int  # arrival order
    priority: int
    model: str | None
    arrival_ns: int
    alone: bool = False


@dataclasses.dataclass
class RefPlace:
    request: RefRequest  # the request that left, as it waited
    until_ns: int  # the end of its grace period


@dataclasses.dataclass(frozen=True)
class RefDecision:
    request_id: str
    priority: int
    score: Fraction
    aging: Fraction
    queue_wait_ns: int
    model: str | None
    swap_affinity: bool
    load: bool
    swap: bool
    previous_model: str | None
    reordered_by: frozenset[str]
    overtook: tuple[str, ...]
    queue_depth_after: int
    slots_busy: int
    reserved_slot: bool
    alone: bool


@dataclasses.dataclass
class RefGrant:
    request: RefRequest
    previous: str | None  # loaded before it
    origin: "RefGrant | None"  # the grant whose load (or swap) it ran on, if a grant loaded its model
    released: bool = False
    reached: bool = False
    confirmed: bool = False  # (on the grant that loaded) a user's release said the model loaded


class ReferenceScheduler:
    def __init__(self, policy: RefPolicy, now_ns: Callable[[], int]) -> None:
        self.policy = policy
        self._now_ns = now_ns
        self.waiting: list[RefRequest] = []  # kept in arrival order
        self.grants: list[RefGrant] = []  # running, in grant order
        self.log: list[RefGrant] = []  # every grant ever made
        self.loaded_model: str | None = None
        self.loaded_by: RefGrant | None = None  # the grant that loaded the loaded model, while it stays
        self.places: dict[bytes, RefPlace] = {}  # kept places by key
        self.taken: RefPlace | None = None  # the place the latest enqueue took, if any
        self._order = 0

    @property
    def running(self) -> RefRequest | None:
        return self.grants[0].request if self.grants else None

    @staticmethod
    def interactive(request: RefRequest) -> bool:
        return request.priority >= INTERACTIVE

    def running_model(self) -> str | None:
        named = {g.request.model for g in self.grants if g.request.model is not None}
        assert len(named) <= 1, f"two models run at once: {named}"
        return named.pop() if named else None

    def total_slots(self) -> int:
        model = self.running_model()
        return self.policy.slots_of(model if model is not None else self.loaded_model)

    def fits_loaded(self, request: RefRequest) -> bool:
        """It may start beside running grants: it needs the loaded model or none, and does not run alone."""
        return not request.alone and (request.model is None or request.model == self.loaded_model)

    # -- scoring ---------------------------------------------------------------------------

    def base(self, request: RefRequest) -> int:
        if self.policy.name == "fifo" and request.model is not None:
            return request.priority + self.policy.model_priorities.get(request.model, 0)
        return request.priority

    def has_affinity(self, request: RefRequest, loaded_model: str | None = None) -> bool:
        loaded = self.loaded_model if loaded_model is None else loaded_model
        return self.policy.bonus > 0 and request.model is not None and request.model == loaded

    def aging(self, request: RefRequest, now_ns: int) -> Fraction:
        divisor = self.policy.divisor_ns
        return Fraction(now_ns - request.arrival_ns, divisor) if divisor else Fraction(0)

    def score(self, request: RefRequest, now_ns: int, *, aging: bool = True, affinity: bool = True,
              loaded_model: str | None = None) -> Fraction:
        total = Fraction(self.base(request))
        if affinity and self.has_affinity(request, loaded_model):
            total += self.policy.bonus
        if aging:
            total += self.aging(request, now_ns)
        return total

    def pick(self, now_ns: int, *, aging: bool = True, affinity: bool = True,
             among: list[RefRequest] | None = None) -> RefRequest | None:
        """Scan everything; strictly greater wins, so the earliest arrival keeps a tie."""
        best: RefRequest | None = None
        best_score: Fraction | None = None
        for request in self.waiting if among is None else among:  # arrival order
            s = self.score(request, now_ns, aging=aging, affinity=affinity)
            if best_score is None or s > best_score:
                best, best_score = request, s
        return best

    def order(self, now_ns: int) -> list[tuple[RefRequest, Fraction]]:
        """All waiting requests with their scores, best current score first (ties by arrival)."""
        scored = [(r, self.score(r, now_ns)) for r in self.waiting]
        return sorted(scored, key=lambda pair: (-pair[1], pair[0].order))

    def dispatch_order(self, now_ns: int) -> list[tuple[RefRequest, Fraction]]:
        """The order repeated dispatches would grant in if nothing else happened, each with its
        score at its turn: each grant makes its model the loaded one. (Aging adds the same to
        everyone, so when the grants happen does not matter.) Quadratic: a scan per grant."""
        remaining = list(self.waiting)
        loaded = self.loaded_model
        order = []
        while remaining:
            best, best_score = None, None
            for request in remaining:  # arrival order: strictly greater wins
                s = self.score(request, now_ns, loaded_model=loaded)
                if best_score is None or s > best_score:
                    best, best_score = request, s
            remaining.remove(best)
            order.append((best, best_score))
            if best.model is not None and not best.alone:
                loaded = best.model
        return order

    # -- commands --------------------------------------------------------------------------

    def enqueue(self, request_id: str, priority: int, model: str | None = None, alone: bool = False, *,
                key: bytes | None = None, max_wait_ns: int = 0) -> int:
        """Queue a request; its depth on arrival. With `key`, it takes a matching kept place."""
        assert all(r.request_id != request_id for r in self.waiting)
        depth = len(self.waiting)
        now = self._now_ns()
        place = self.places.get(key) if key is not None else None
        if (place is not None and place.request.priority == priority and place.request.model == model
                and now < place.until_ns and not (max_wait_ns and now - place.request.arrival_ns >= max_wait_ns)):
            del self.places[key]
            request = RefRequest(request_id, place.request.order, priority, model, place.request.arrival_ns, alone)
            self.taken = place
        else:
            self._order += 1
            request = RefRequest(request_id, self._order, priority, model, now, alone)
            self.taken = None
        self.waiting.append(request)
        self.waiting.sort(key=lambda r: r.order)
        return depth

    def keep(self, request_id: str, key: bytes, grace_ns: int) -> bool | None:
        """The client of `request_id` left: None if it was not waiting, else whether its place is
        kept (False: another place is kept under `key`)."""
        for request in self.waiting:
            if request.request_id == request_id:
                self.waiting.remove(request)
                if key in self.places:
                    return False
                self.places[key] = RefPlace(request, self._now_ns() + grace_ns)
                return True
        return None

    def expire_kept(self, max_wait_ns: int) -> list[str]:
        """End the places whose grace period or maxWaitSeconds passed; the ids of those that left."""
        now = self._now_ns()
        due = [key for key, place in self.places.items() if place.until_ns <= now
               or (max_wait_ns and now - place.request.arrival_ns >= max_wait_ns)]
        return [self.places.pop(key).request.request_id for key in due]

    def cancel(self, request_id: str) -> bool:
        for index, request in enumerate(self.waiting):
            if request.request_id == request_id:
                del self.waiting[index]
                return True
        return False

    def set_loaded_model(self, model: str | None) -> None:
        """The upstream's report; the real scheduler drops it while a request runs."""
        if not self.grants:
            self.loaded_model = model
            self.loaded_by = None

    def reconfigure(self, policy: RefPolicy) -> None:
        self.policy = policy

    def choose(self, now: int) -> tuple[RefRequest, list[RefRequest] | None] | None:
        """What ``next`` would grant now, and among which requests it was picked (None: all of
        them; a list: the interactive ones, for a reserved slot). None if nothing can start."""
        if not self.waiting:
            return None
        busy = len(self.grants)
        if not busy:
            return self.pick(now), None
        total = self.total_slots()
        if busy >= total or any(g.request.alone for g in self.grants):
            return None
        best = self.pick(now)
        if not self.fits_loaded(best):
            return None  # a swap: the running drain first
        non_interactive = sum(1 for g in self.grants if not self.interactive(g.request))
        if self.interactive(best) or non_interactive < total - self.policy.reserved:
            return best, None
        # Its share used: the reserved slots go to the interactive requests behind it, the first
        # in the order that fits beside what runs (one that needs another model holds nothing:
        # only the best holds the GPU back).
        interactive = [r for r in self.waiting if self.interactive(r)]
        ranked = sorted(interactive, key=lambda r: (-self.score(r, now), r.order))
        fitting = next((r for r in ranked if self.fits_loaded(r)), None)
        return None if fitting is None else (fitting, interactive)

    def next(self) -> RefDecision | None:
        now = self._now_ns()
        chosen = self.choose(now)
        if chosen is None:
            return None
        winner, among = chosen
        # A term changed the pick when, without it, another request tops the candidates. (In a
        # reserved slot the winner is the first interactive request that fits: one ahead of it
        # that does not fit says nothing of a term that is not there at all.)
        reasons = set()
        if self.policy.divisor_ns and self.pick(now, aging=False, among=among) is not winner:
            reasons.add("aging")
        if (self.policy.bonus and self.loaded_model is not None
                and self.pick(now, affinity=False, among=among) is not winner):
            reasons.add("swap_affinity")
        overtook = tuple(r.request_id for r in self.waiting if r.order < winner.order)[:OVERTAKEN_LIMIT]
        previous = self.loaded_model
        non_interactive = sum(1 for g in self.grants if not self.interactive(g.request))
        reserved_slot = (self.interactive(winner) and bool(self.grants)
                         and non_interactive >= self.total_slots() - self.policy.reserved)
        score, affinity = self.score(winner, now), self.has_affinity(winner)
        self.waiting.remove(winner)
        loads = winner.model is not None and not winner.alone and winner.model != previous
        grant = RefGrant(winner, previous, self.loaded_by if winner.model is not None and not winner.alone else None)
        if loads:
            grant.origin = self.loaded_by = grant  # a load of its own
        self.grants.append(grant)
        self.log.append(grant)
        if winner.model is not None and not winner.alone:
            self.loaded_model = winner.model
        return RefDecision(
            request_id=winner.request_id,
            priority=winner.priority,
            score=score,
            aging=self.aging(winner, now),
            queue_wait_ns=now - winner.arrival_ns,
            model=winner.model,
            swap_affinity=affinity,
            load=loads and previous is None,
            swap=loads and previous is not None,
            previous_model=previous,
            reordered_by=frozenset(reasons),
            overtook=overtook,
            queue_depth_after=len(self.waiting),
            slots_busy=len(self.grants),
            reserved_slot=reserved_slot,
            alone=winner.alone,
        )

    def release(self, request_id: str, *, model_loaded: bool | None = True, reached_upstream: bool = True) -> None:
        release_on(self, request_id, model_loaded=model_loaded, reached_upstream=reached_upstream)


class GrantRecord(Protocol):
    """What one GPU's record of its grants holds (`ReferenceScheduler`, `RefGpu`)."""

    grants: list[RefGrant]
    log: list[RefGrant]
    loaded_model: str | None
    loaded_by: RefGrant | None


def release_on(record: GrantRecord, request_id: str, *, model_loaded: bool | None, reached_upstream: bool) -> None:
    """End a running grant on one GPU, and what its answer says about that GPU's loaded model."""
    grant = next(g for g in record.grants if g.request.request_id == request_id)
    record.grants.remove(grant)
    grant.released = True
    grant.reached = reached_upstream
    model = grant.request.model
    origin = grant.origin
    pending = origin is not None and origin is record.loaded_by and not origin.confirmed
    if reached_upstream and model_loaded is True:
        if pending:
            origin.confirmed = True  # the load happened
    elif reached_upstream and model_loaded is False:
        if model is not None and record.loaded_model == model:
            record.loaded_model = None  # the upstream failed it: its model is not known to be loaded
            record.loaded_by = None
    elif pending and not any(g.origin is origin for g in record.grants):
        # The last user of a load none confirmed: if none reached the upstream the load never
        # happened; if some did and were told nothing, nothing is known.
        users = [g for g in record.log if g.origin is origin]
        record.loaded_model = None if any(g.reached for g in users) else origin.previous
        record.loaded_by = None


def residents(model: str | None) -> frozenset[str]:
    """The reference's one loaded model (None: none known) as the scheduler's resident models."""
    return frozenset() if model is None else frozenset((model,))


def float_close(real: float, exact: Fraction, *, magnitude: Fraction | int | float = 0) -> bool:
    """Is a float computed from the exact terms within a few ulps of the exact value?

    ``magnitude`` is the sum of the absolute values of the terms that were added: with
    cancellation (a huge negative priority plus a huge aging) the rounding error is relative
    to the terms, not to the result.
    """
    if real == float(exact):  # float(Fraction) is correctly rounded
        return True
    scale = max(abs(Fraction(real)), abs(exact), abs(Fraction(magnitude)), Fraction(1))
    return abs(Fraction(real) - exact) <= scale * Fraction(8, 2**53)


# -- several GPUs: one queue for the node ----------------------------------------------------
#
# The node rule, from docs/scheduling.md ("Several GPUs: one queue for the node") and the
# docstrings of core/dispatch.py, core/node.py and core/scheduler.py, written out per GPU and
# per request with nothing shared with `llamaswap.core`: no index, no walk, no `choose`.
#
# Each GPU keeps what holds for one: its grants (at most the slots of the model they name, else
# of its loaded model, else its default), one model at a time, a load only when nothing runs
# there, a request that runs alone only when nothing runs there and nothing beside it, its own
# reserved slots, and its own record of the loaded model (what a release says: `release_on`).
# A GPU's `models` limit what it may serve (a request of no model: any GPU). A blocked GPU (a
# settle or an adopted exchange holds it) takes nothing.
#
# One `next`: every waiting request, sorted once by score (swap affinity for a model loaded on an
# open GPU with a free slot now, whatever that GPU runs: the bonus is for starting without a
# swap), then arrival. Down that order, each request is asked where it can start, over the GPUs
# that no request ahead of it has claimed; the first that can start, starts. For one request:
#
#   (an unload runs on a GPU that has its model loaded, if one of those it may use has)
#   1. a free slot on a GPU that has its model loaded (or, for a request of no model, any GPU
#      that runs something), the least busy first: the fewest running grants;
#   2. else an idle GPU: one that has its model loaded first; else one with nothing loaded, then
#      the one whose loaded model the fewest waiting requests name; unless a GPU that has its
#      model (busy, no slot for it now) frees a slot sooner than the load takes (`times`);
#   3. else it waits: for the GPU that has its model and frees a slot first; else for the busy
#      GPU expected to drain first (by `times`, then the fewest running grants).
#   Ties go to the configured order of the GPUs.
#
# Only the best request (the first in the order) holds a GPU back: the GPU it waits for takes
# nothing else in this `next`, unless all it waits for there is its share (a non-interactive
# request that fits beside what runs, but only slots kept for the interactive band are free):
# then that GPU's reserved slots stay open to interactive requests, as with one GPU. Lower
# requests start where the rule lets them, or wait without holding anything.


class RefTimes(Protocol):
    """What the node rule may know of time: the same object the real scheduler is given."""

    def slot_free_in_s(self, gpu: str) -> float: ...

    def drained_in_s(self, gpu: str) -> float: ...

    def swap_s(self, model: str | None, gpu: str) -> float: ...


class RefNoTimes:
    """Nothing known: no slot is expected to free (so a load never waits for one), no GPU is
    expected to drain before another, a load costs nothing."""

    def slot_free_in_s(self, gpu: str) -> float:
        return float("inf")

    def drained_in_s(self, gpu: str) -> float:
        return float("inf")

    def swap_s(self, model: str | None, gpu: str) -> float:
        return 0.0


@dataclasses.dataclass(frozen=True)
class RefGpuPolicy:
    """One GPU as the configuration describes it."""

    name: str
    slots: int = 1
    model_slots: Mapping[str, int] = dataclasses.field(default_factory=dict)
    reserved: int = 0
    models: frozenset[str] | None = None  # None: any

    @classmethod
    def of(cls, gpu) -> "RefGpuPolicy":
        """Read the public settings of a real ``GpuPolicy`` (nothing else)."""
        return cls(gpu.name, gpu.slots.default, dict(gpu.slots.per_model), gpu.slots.reserved,
                   None if gpu.models is None else frozenset(gpu.models))

    def slots_of(self, model: str | None) -> int:
        return self.slots if model is None else self.model_slots.get(model, self.slots)

    def may_serve(self, model: str | None) -> bool:
        return model is None or self.models is None or model in self.models


class RefGpu:
    """One GPU's record: its running grants (grant order), every grant made on it, its loaded
    model and the grant that loaded it (`release_on` reads these)."""

    def __init__(self, policy: RefGpuPolicy) -> None:
        self.policy = policy
        self.grants: list[RefGrant] = []
        self.log: list[RefGrant] = []
        self.loaded_model: str | None = None
        self.loaded_by: RefGrant | None = None

    @property
    def name(self) -> str:
        return self.policy.name

    @property
    def busy(self) -> int:
        return len(self.grants)

    def runs_alone(self) -> bool:
        return any(g.request.alone for g in self.grants)

    def running_model(self) -> str | None:
        named = {g.request.model for g in self.grants if g.request.model is not None}
        assert len(named) <= 1, f"two models run at once on {self.name}: {named}"
        return named.pop() if named else None

    def total_slots(self) -> int:
        model = self.running_model()
        return self.policy.slots_of(model if model is not None else self.loaded_model)

    def has_a_free_slot(self) -> bool:
        """A slot is free for a request of its loaded model now (nothing alone, not full)."""
        return not self.runs_alone() and self.busy < self.total_slots()

    def share_used(self) -> bool:
        """Non-interactive requests hold all the slots they may (``slots - reserved``)."""
        non_interactive = sum(1 for g in self.grants if not ReferenceScheduler.interactive(g.request))
        return non_interactive >= self.total_slots() - self.policy.reserved

    def slot_for(self, request: RefRequest, share_kept: bool) -> str:
        """What this GPU can do for the request now: "idle" (nothing runs), "free" (a slot is
        its to take beside what runs), "share" (it fits beside what runs, but only slots kept
        for the interactive band are free, or ``share_kept``: the best waits for this GPU's
        share), "other" (a slot is free, but what runs must drain first) or "full"."""
        if not self.grants:
            return "idle"
        if not self.has_a_free_slot():
            return "full"
        if request.alone or request.model not in (None, self.loaded_model):
            return "other"
        if ReferenceScheduler.interactive(request):
            return "free"
        return "share" if share_kept or self.share_used() else "free"


@dataclasses.dataclass(frozen=True)
class RefNodeDecision:
    request_id: str
    gpu: str
    model: str | None
    score: Fraction
    swap_affinity: bool
    load: bool
    swap: bool
    previous_model: str | None
    reserved_slot: bool
    alone: bool
    slots_busy: int  # on its GPU, itself included
    queue_depth_after: int


class ReferenceNode:
    """The node rule by brute force: one queue over several GPUs (see the comment above)."""

    def __init__(self, policy: RefPolicy, gpus: Sequence[RefGpuPolicy], now_ns: Callable[[], int]) -> None:
        assert len({gpu.name for gpu in gpus}) == len(gpus) >= 1
        self.policy = policy
        self.gpus = [RefGpu(gpu) for gpu in gpus]  # the configured order
        self._now_ns = now_ns
        self.waiting: list[RefRequest] = []  # arrival order
        self.running: dict[str, RefGpu] = {}  # request -> the GPU it runs on
        self._order = 0

    def gpu(self, name: str) -> RefGpu:
        return next(gpu for gpu in self.gpus if gpu.name == name)

    # -- commands --------------------------------------------------------------------------

    def enqueue(self, request_id: str, priority: int, model: str | None = None, alone: bool = False) -> None:
        assert all(r.request_id != request_id for r in self.waiting) and request_id not in self.running
        self._order += 1
        self.waiting.append(RefRequest(request_id, self._order, priority, model, self._now_ns(), alone))

    def cancel(self, request_id: str) -> bool:
        for request in self.waiting:
            if request.request_id == request_id:
                self.waiting.remove(request)
                return True
        return False

    def set_loaded_model(self, model: str | None, gpu: str) -> None:
        """The GPU's report, taken only while nothing runs there."""
        record = self.gpu(gpu)
        if not record.grants:
            record.loaded_model = model
            record.loaded_by = None

    def release(self, request_id: str, *, model_loaded: bool | None = True, reached_upstream: bool = True) -> None:
        gpu = self.running.pop(request_id)
        release_on(gpu, request_id, model_loaded=model_loaded, reached_upstream=reached_upstream)

    # -- the rule --------------------------------------------------------------------------

    def score(self, request: RefRequest, now_ns: int, warm: set[str]) -> Fraction:
        total = Fraction(request.priority)
        if self.policy.name == "fifo" and request.model is not None:
            total += self.policy.model_priorities.get(request.model, 0)
        if self.policy.bonus and request.model in warm:
            total += self.policy.bonus
        if self.policy.divisor_ns:
            total += Fraction(now_ns - request.arrival_ns, self.policy.divisor_ns)
        return total

    def warm(self, blocked: frozenset[str]) -> set[str]:
        """The models whose requests get the swap-affinity bonus: loaded on an open GPU with a
        free slot now."""
        return {gpu.loaded_model for gpu in self.gpus
                if gpu.name not in blocked and gpu.loaded_model is not None and gpu.has_a_free_slot()}

    def order(self, blocked: frozenset[str] = frozenset()) -> list[RefRequest]:
        now, warm = self._now_ns(), self.warm(blocked)
        return sorted(self.waiting, key=lambda r: (-self.score(r, now, warm), r.order))

    def wanted(self, model: str | None) -> int:
        return sum(1 for r in self.waiting if r.model == model)

    def where(self, request: RefRequest, gpus: list[RefGpu], share_kept: set[str],
              times: RefTimes) -> tuple[str, RefGpu] | None:
        """Where one request goes among ``gpus`` (open, not claimed): ("start", gpu), ("wait",
        gpu) or ("wait for share", gpu); None: no GPU it may use can do anything for it."""
        model = request.model
        mine = [gpu for gpu in gpus if gpu.policy.may_serve(model)]
        if request.alone and model is not None and any(gpu.loaded_model == model for gpu in mine):
            mine = [gpu for gpu in mine if gpu.loaded_model == model]  # an unload: where its model is
        can = {gpu.name: gpu.slot_for(request, gpu.name in share_kept) for gpu in mine}
        rank = {gpu.name: index for index, gpu in enumerate(self.gpus)}

        def wait(gpu: RefGpu) -> tuple[str, RefGpu]:
            return ("wait for share" if can[gpu.name] == "share" else "wait"), gpu

        free = [gpu for gpu in mine if can[gpu.name] == "free"]
        if free:  # 1: the least busy first
            return "start", min(free, key=lambda g: (g.busy, rank[g.name]))
        # GPUs that have its model loaded and run something, but have no slot for it now.
        having = [gpu for gpu in mine if model is not None and gpu.loaded_model == model and gpu.busy]
        soonest = min(having, key=lambda g: (times.slot_free_in_s(g.name), rank[g.name]), default=None)
        idle = [gpu for gpu in mine if can[gpu.name] == "idle"]
        if idle:  # 2
            warm = [gpu for gpu in idle if model is not None and gpu.loaded_model == model]
            if warm:
                return "start", warm[0]
            target = min(idle, key=lambda g: (g.loaded_model is not None, self.wanted(g.loaded_model),
                                              rank[g.name]))
            if soonest is not None and times.slot_free_in_s(soonest.name) < times.swap_s(model, target.name):
                return wait(soonest)
            return "start", target
        if soonest is not None:  # 3
            return wait(soonest)
        busy = [gpu for gpu in mine if gpu.busy]  # a full one too
        if not busy:
            return None
        drains = min(busy, key=lambda g: (times.drained_in_s(g.name), g.busy, rank[g.name]))
        return wait(drains)

    def choose(self, blocked: frozenset[str] = frozenset(),
               times: RefTimes | None = None) -> tuple[RefRequest, RefGpu] | None:
        """What ``next`` would grant now, and where; None if nothing can start."""
        times = times if times is not None else RefNoTimes()
        order = self.order(blocked)
        held: set[str] = set()  # the GPU the best waits for
        share_kept: set[str] = set()  # or the GPU whose share it waits for
        for rank, request in enumerate(order):
            open_gpus = [gpu for gpu in self.gpus if gpu.name not in blocked and gpu.name not in held]
            found = self.where(request, open_gpus, share_kept, times)
            if found is None:
                continue
            step, gpu = found
            if step == "start":
                return request, gpu
            if rank == 0:  # only the best holds a GPU back
                (share_kept if step == "wait for share" else held).add(gpu.name)
        return None

    def next(self, blocked: frozenset[str] = frozenset(), times: RefTimes | None = None) -> RefNodeDecision | None:
        chosen = self.choose(blocked, times)
        if chosen is None:
            return None
        winner, gpu = chosen
        now = self._now_ns()
        previous = gpu.loaded_model
        model = winner.model
        affinity = bool(self.policy.bonus) and model is not None and model == previous
        reserved_slot = (ReferenceScheduler.interactive(winner) and gpu.policy.reserved > 0 and gpu.busy > 0
                         and gpu.share_used())
        score = self.score(winner, now, {previous} if affinity else set())
        self.waiting.remove(winner)
        loads = model is not None and not winner.alone and model != previous
        if gpu.grants:
            assert not loads and not winner.alone and not gpu.runs_alone(), "the rule granted beside a drain"
        grant = RefGrant(winner, previous, gpu.loaded_by if model is not None and not winner.alone else None)
        if loads:
            grant.origin = gpu.loaded_by = grant  # a load of its own
        gpu.grants.append(grant)
        gpu.log.append(grant)
        if model is not None and not winner.alone:
            gpu.loaded_model = model
        self.running[winner.request_id] = gpu
        return RefNodeDecision(winner.request_id, gpu.name, model, score, affinity, loads and previous is None,
                               loads and previous is not None, previous, reserved_slot, winner.alone, gpu.busy,
                               len(self.waiting))
