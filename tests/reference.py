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
best one is held back that way, the best interactive request goes instead, if it needs the
loaded model or none. A request that runs alone (a model unload) goes only when nothing runs,
nothing goes beside it, and it loads nothing.

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
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from fractions import Fraction

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
                   policy.slots.default, dict(policy.slots.per_model), policy.slots.reserved)

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
        interactive = [r for r in self.waiting if self.interactive(r)]
        if not interactive:
            return None
        best = self.pick(now, among=interactive)
        if not self.fits_loaded(best):
            return None
        return best, interactive

    def next(self) -> RefDecision | None:
        now = self._now_ns()
        chosen = self.choose(now)
        if chosen is None:
            return None
        winner, among = chosen
        reasons = set()
        if self.pick(now, aging=False, among=among) is not winner:
            reasons.add("aging")
        if self.pick(now, affinity=False, among=among) is not winner:
            reasons.add("swap_affinity")
        overtook = tuple(r.request_id for r in self.waiting if r.order < winner.order)[:OVERTAKEN_LIMIT]
        previous = self.loaded_model
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
            reserved_slot=among is not None,
            alone=winner.alone,
        )

    def release(self, request_id: str, *, model_loaded: bool | None = True, reached_upstream: bool = True) -> None:
        grant = next(g for g in self.grants if g.request.request_id == request_id)
        self.grants.remove(grant)
        grant.released = True
        grant.reached = reached_upstream
        model = grant.request.model
        origin = grant.origin
        pending = origin is not None and origin is self.loaded_by and not origin.confirmed
        if reached_upstream and model_loaded is True:
            if pending:
                origin.confirmed = True  # the load happened
        elif reached_upstream and model_loaded is False:
            if model is not None and self.loaded_model == model:
                self.loaded_model = None  # the upstream failed it: its model is not known to be loaded
                self.loaded_by = None
        elif pending and not any(g.origin is origin for g in self.grants):
            # The last user of a load none confirmed: if none reached the upstream the load never
            # happened; if some did and were told nothing, nothing is known.
            users = [g for g in self.log if g.origin is origin]
            self.loaded_model = None if any(g.reached for g in users) else origin.previous
            self.loaded_by = None


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
