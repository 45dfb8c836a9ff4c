"""A brute-force reference scheduler for the property tests.

It is deliberately naive: every dispatch scans the whole queue and computes each waiting
request's score exactly, as a ``fractions.Fraction``:

    score = priority (+ the model's configured priority, fifo only)
          + swapAffinityBonus, if the request's model is the loaded model (serial only)
          + (now_ns - arrival_ns) / divisor_ns (serial only, divisor 0 disables it)

The best score wins; equal scores keep arrival order. Nothing here is shared with
``llamaswap.core.scheduler``'s heap logic: the only thing read from a ``Policy`` are its
public settings, so a mistake in the real key arithmetic cannot hide in both.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from fractions import Fraction

NS_PER_S = 1_000_000_000
OVERTAKEN_LIMIT = 16  # the decision record names at most this many overtaken requests


@dataclasses.dataclass(frozen=True)
class RefPolicy:
    name: str = "serial"  # "serial" | "fifo"
    aging_divisor_s: float = 60.0
    swap_affinity_bonus: int = 10
    model_priorities: Mapping[str, int] = dataclasses.field(default_factory=dict)

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
        return cls(policy.name, policy.aging_divisor_s, policy.swap_affinity_bonus, dict(policy.model_priorities))


@dataclasses.dataclass
class RefRequest:
    request_id: str
    order: int  # arrival order
    priority: int
    model: str | None
    arrival_ns: int


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


class ReferenceScheduler:
    def __init__(self, policy: RefPolicy, now_ns: Callable[[], int]) -> None:
        self.policy = policy
        self._now_ns = now_ns
        self.waiting: list[RefRequest] = []  # kept in arrival order
        self.running: RefRequest | None = None
        self.previous_of_running: str | None = None
        self.loaded_model: str | None = None
        self._order = 0

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

    def pick(self, now_ns: int, *, aging: bool = True, affinity: bool = True) -> RefRequest | None:
        """Scan everything; strictly greater wins, so the earliest arrival keeps a tie."""
        best: RefRequest | None = None
        best_score: Fraction | None = None
        for request in self.waiting:  # arrival order
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
            if best.model is not None:
                loaded = best.model
        return order

    # -- commands --------------------------------------------------------------------------

    def enqueue(self, request_id: str, priority: int, model: str | None = None) -> int:
        assert all(r.request_id != request_id for r in self.waiting)
        depth = len(self.waiting)
        self._order += 1
        self.waiting.append(RefRequest(request_id, self._order, priority, model, self._now_ns()))
        return depth

    def cancel(self, request_id: str) -> bool:
        for index, request in enumerate(self.waiting):
            if request.request_id == request_id:
                del self.waiting[index]
                return True
        return False

    def set_loaded_model(self, model: str | None) -> None:
        """The upstream's report; the real scheduler drops it while a request runs."""
        if self.running is None:
            self.loaded_model = model

    def reconfigure(self, policy: RefPolicy) -> None:
        self.policy = policy

    def next(self) -> RefDecision | None:
        if self.running is not None or not self.waiting:
            return None
        now = self._now_ns()
        winner = self.pick(now)
        assert winner is not None
        reasons = set()
        if self.pick(now, aging=False) is not winner:
            reasons.add("aging")
        if self.pick(now, affinity=False) is not winner:
            reasons.add("swap_affinity")
        overtook = tuple(r.request_id for r in self.waiting if r.order < winner.order)[:OVERTAKEN_LIMIT]
        previous = self.loaded_model
        decision = RefDecision(
            request_id=winner.request_id,
            priority=winner.priority,
            score=self.score(winner, now),
            aging=self.aging(winner, now),
            queue_wait_ns=now - winner.arrival_ns,
            model=winner.model,
            swap_affinity=self.has_affinity(winner),
            load=winner.model is not None and previous is None,
            swap=winner.model is not None and previous is not None and winner.model != previous,
            previous_model=previous,
            reordered_by=frozenset(reasons),
            overtook=overtook,
            queue_depth_after=len(self.waiting) - 1,
        )
        self.waiting.remove(winner)
        self.running = winner
        self.previous_of_running = previous
        if winner.model is not None:
            self.loaded_model = winner.model
        return decision

    def release(self, request_id: str, *, model_loaded: bool = True, reached_upstream: bool = True) -> None:
        assert self.running is not None and self.running.request_id == request_id
        if not reached_upstream:
            self.loaded_model = self.previous_of_running  # never used: nothing changed upstream
        elif not model_loaded and self.running.model is not None and self.loaded_model == self.running.model:
            self.loaded_model = None  # the upstream failed it: its model is not known to be loaded
        self.running = None


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
