"""Estimated starts: which waiting request starts when, and on which GPU.

This walks the rule `Scheduler.next` asks (`dispatch.choose`, down the order as `node.find`
does) for one GPU as for several, so a grant and an estimate say the same. The walk keeps,
per GPU, what runs there (each running grant's expected end, its band, its model, whether
it runs alone), its loaded model, when a load under way there ends and until when a settle
blocks it. At each instant it asks the rule for one start at a time, like repeated calls of
`next`: the first request in the order is the best; if it cannot start it may claim one
GPU (which then takes nothing else, or only interactive requests where it waits for its
share), and the first request after it that the rule starts does; none: the walk moves to the
next end of a grant or of a settle. A request that loads its model holds its slot for the swap
and its run, and those started beside the load run once it ends. A slot that frees first takes
the next request; a request that needs another model waits until every slot of its GPU is
free, or (several models resident) loads beside the others where it has room or idle models may
go (a load counts only where it happens: each model's runs wait for its own load), and the
best's claim there holds back one model, as `node.claim_on` says. A start's ready time is the
one its grant would set (`Scheduler`'s `Decision.ready_at`): its own load's end, else its
model's load under way there, else (no model) the first load under way there whose grant still
runs. The rule reads time as one type, `NodeTimes`: from the walk's own state here, from the
running grants in the runtime and `llamaswap simulate`, so every reader reads one picture. All
of it is typed against `estimate.Figures`: learnt (`Estimator`) or stated.

Exact when every grant takes its expected time and the order does not change as models load
(swap affinity 0: with a bonus, the order moves with the loaded models, which the snapshot's
order cannot say in advance). Pure: no clock, no I/O.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence

from llamaswap.core.decisions import Decision, QueueSnapshot, RunningView
from llamaswap.core.dispatch import HeldBack, Step, choose, takes_nothing
from llamaswap.core.eviction import NOT_WAITED_FOR, after_load, victims
from llamaswap.core.holding import GpuHolding, running_of
from llamaswap.core.node import HeldBackModels
from llamaswap.core.estimate import Figures, ready_left_s, remaining_of


class _Item:
    """A slot held on a GPU, until ``end`` seconds from the walk's start (inf: unknown)."""

    __slots__ = ("end", "interactive", "model", "alone")

    def __init__(self, end: float, interactive: bool, model: str | None, alone: bool) -> None:
        self.end = end
        self.interactive = interactive
        self.model = model
        self.alone = alone


class _Waiting:
    """A waiting request as the rule reads it (a `dispatch.Candidate`)."""

    __slots__ = ("model", "interactive")
    alone = False  # the snapshot's order carries no unload

    def __init__(self, model: str | None, interactive: bool) -> None:
        self.model = model
        self.interactive = interactive


class _GpuWalk:
    """One GPU during the walk."""

    __slots__ = ("holding", "residents", "items", "loads", "blocked_until")

    def __init__(self, gpu: GpuHolding, blocked_until: float) -> None:
        self.holding = gpu
        self.residents = gpu.residents
        self.items: list[_Item] = []
        # The loads whose grant still runs, the earliest begun first: the loader's slot, that
        # model and when its load ends (`Scheduler`'s loaders there).
        self.loads: list[tuple[_Item, str, float]] = []
        self.blocked_until = blocked_until

    def passed(self, now: float) -> None:
        """What has ended by ``now`` goes: the grants, and the loads whose grant has ended."""
        self.items = [item for item in self.items if item.end > now]
        if self.loads:
            self.loads = [load for load in self.loads if load[0].end > now]

    def ready_of(self, model: str | None) -> float:
        """When a run of ``model`` granted now may begin, as its grant's ready time says: once its
        model's load under way ends; a request of no model, once the first load under way there
        ends (it shares whatever is in effect there); else at once (0)."""
        for _, loading, end in self.loads:
            if model is None or loading == model:
                return end
        return 0.0

    def view(self, now: float) -> GpuHolding:
        """What it holds at ``now``, as the rule reads it."""
        gpu = self.holding
        # (The rule reads whether work it did not grant holds the GPU, not which: until
        # ``blocked_until`` it is told a settle does. The walk keeps its loads in ``loads``.)
        blocked = self.blocked_until > now
        # The record's ``blocked`` (a settle of a known model holds that model only); a GPU it was
        # told is held, with no model named, is held whole.
        settling_model = gpu.settling_model if blocked else None
        return GpuHolding(gpu.name, gpu.slots, gpu.models, self.residents, running_of(self.items), None,
                          blocked, 0, blocked and (gpu.blocked or settling_model is None), gpu.residency,
                          gpu.last_used, settling_model)


# Per GPU, the expected ends of what runs there, in seconds from the moment the rule asks
# (`math.inf`: unknown).
Ends = Mapping[str, Sequence[float]]


def ends_of_grants(grants: Sequence[Decision], now_ns: int, figures: Figures) -> Ends:
    """Per GPU, the expected ends of the running ``grants`` at ``now_ns`` (`NodeTimes.of_grants`)."""
    return remaining_by_gpu([RunningView.of(decision, now_ns) for decision in grants], figures)


class NodeTimes:
    """`dispatch.GpuTimes`, the one type of what the rule knows of time: per GPU, the expected
    ends of what runs there (``read``, called once, the first time the rule asks: nothing is
    built where a free slot decides or there is one GPU, since `dispatch.choose` reads time only
    to choose among GPUs) and ``figures`` for the swaps. Per GPU the first slot frees after the
    smallest expected end (inf when none is known), it drains after the largest (inf if any is
    unknown); 0 with nothing running. Built from the running grants (`of_grants`: the runtime's
    grants and Retry-After, `llamaswap simulate`), a snapshot (`of_snapshot`) or the walk's own
    state (`_Walk`)."""

    __slots__ = ("_read", "_ends", "_figures")

    def __init__(self, read: Callable[[], Ends], figures: Figures) -> None:
        self._read = read
        self._ends: Ends | None = None
        self._figures = figures

    def forget(self) -> None:
        """What it read is stale (the running grants or the instant changed): read again if asked."""
        self._ends = None

    @classmethod
    def of_snapshot(cls, snapshot: QueueSnapshot, figures: Figures) -> NodeTimes:
        """From a scheduler's snapshot: its running grants' expected remaining times."""
        return cls(lambda: remaining_by_gpu(snapshot.grants, figures), figures)

    @classmethod
    def of_grants(cls, grants: Callable[[], Sequence[Decision]], now_ns: int, figures: Figures) -> NodeTimes:
        """From the running grants (`Scheduler.running_grants`, asked for only when the rule reads
        time) at ``now_ns``, without the snapshot's dispatch order: what a grant on the hot path
        can afford."""
        return cls(lambda: ends_of_grants(grants(), now_ns, figures), figures)

    def _of(self) -> Ends:
        ends = self._ends
        if ends is None:
            ends = self._ends = self._read()
        return ends

    def slot_free_in_s(self, gpu: str) -> float:
        return min(self._of().get(gpu, ()), default=0.0)

    def drained_in_s(self, gpu: str) -> float:
        return max(self._of().get(gpu, ()), default=0.0)

    def soonest_end_s(self, gpu: str) -> float:
        """When the first running grant there is expected to end, as a client is told to come
        back (Retry-After): one that outran its expected time may end at any moment (0), where
        the rule reads it as unknown (`slot_free_in_s`: inf)."""
        return min((0.0 if math.isinf(left) else left for left in self._of().get(gpu, ())), default=0.0)

    def swap_s(self, model: str | None, gpu: str) -> float:
        return self._figures.expected_swap_s(model, gpu)


def remaining_by_gpu(grants: Iterable[RunningView], figures: Figures) -> dict[str, list[float]]:
    """Per GPU, the expected remaining time of each of its running grants (`estimate.remaining_of`)."""
    return {gpu_name: remaining_of(figures, of) for gpu_name, of in _by_gpu(grants).items()}


def _by_gpu(grants: Iterable[RunningView]) -> dict[str, list[RunningView]]:
    out: dict[str, list[RunningView]] = {}
    for grant in grants:
        out.setdefault(grant.gpu, []).append(grant)
    return out


def starts_of_node(figures: Figures, snapshot: QueueSnapshot, gpus: Sequence[GpuHolding],
                   blocked_s: Mapping[str, float] | None = None) -> list[tuple[float, str | None]]:
    """Each waiting request's estimated start, in seconds from now (`math.inf` where it cannot be
    told: it waits for a slot held for a time unknown), and the GPU it is expected to start
    on (None where not known). ``gpus`` in the configured order (their slots, the models they
    may serve and their loaded model; what runs there is read from the snapshot's grants),
    ``blocked_s`` how long a settle still holds a GPU (inf: unknown; a GPU whose holding
    is ``blocked`` and not in it: unknown). Each request, waiting or running, is sized by the output
    tokens it asked for, where it said (`max_tokens` of the snapshot's views)."""
    blocked_s = blocked_s or {}
    # A GPU held by work the scheduler did not grant (`GpuHolding.blocked`) with no time said: for how long, unknown.
    walks = {gpu.name: _GpuWalk(gpu, blocked_s.get(gpu.name, math.inf if gpu.blocked or gpu.settling_model else 0.0))
             for gpu in gpus}
    for gpu_name, grants in _by_gpu(snapshot.grants).items():
        walk = walks.get(gpu_name)
        if walk is None:  # a GPU no longer configured: nothing new starts there
            continue
        remaining = remaining_of(figures, grants)
        for grant, left in zip(grants, remaining, strict=True):
            item = _Item(left, grant.band.interactive, grant.model, grant.alone)
            walk.items.append(item)
            if grant.model_load and grant.model is not None:  # a load under way holds back its model's runs
                walk.loads.append((item, grant.model, ready_left_s(figures, grant)))
    waiting = [_Waiting(view.model, view.band.interactive) for view in snapshot.waiting]
    node_walk = _Walk(figures, list(walks.values()), waiting, [view.max_tokens for view in snapshot.waiting])
    # The claim in force: its holder keeps holding those models while it stays the best, as in
    # `node.find` (where no GPU takes work now, the best claims only once one does).
    claim = snapshot.claim
    if claim is not None and claim.gpu in walks:
        holder = next((position for position, view in enumerate(snapshot.waiting)
                       if view.request_id == claim.holder), None)
        if holder is not None:
            node_walk.held.hold(holder, claim.gpu, claim.models)
    return node_walk.run()


class _Walk:
    """The walk's state: the requests not started yet, by what the rule reads of one (its model and
    band: `dispatch.choose` answers every request of such a key alike, the best's claim once made),
    each key's in the order. So each instant asks the best, then the first of each key behind it:
    a few questions, however deep the queue (asking each request in turn was quadratic in it
    wherever the GPUs stay open to other models' loads)."""

    def __init__(self, figures: Figures, gpus: list[_GpuWalk], waiting: list[_Waiting],
                 sizes: Sequence[int | None]) -> None:
        self._figures = figures
        self._gpus = gpus
        self._waiting = waiting
        self._sizes = sizes
        # Not started yet, per key in the order (places in ``waiting``, the order's own).
        self._pending: dict[tuple[str | None, bool], deque[int]] = {}
        self._wanted: dict[str | None, int] = {}
        for request, candidate in enumerate(waiting):
            self._pending.setdefault((candidate.model, candidate.interactive), deque()).append(request)
            self._wanted[candidate.model] = self._wanted.get(candidate.model, 0) + 1
        self._left = len(waiting)
        self._starts: list[tuple[float, str | None]] = [(math.inf, None)] * len(waiting)
        self.held = HeldBackModels()  # the models the best holds back (its holder: its place in ``waiting``)

    def run(self) -> list[tuple[float, str | None]]:
        now = 0.0
        while self._left:
            for gpu in self._gpus:
                gpu.passed(now)
            found = self._find(now)
            if found is not None:
                self._start(now, *found)
                continue
            now = min((t for gpu in self._gpus
                       for t in (*(item.end for item in gpu.items), gpu.blocked_until) if t > now),
                      default=math.inf)
            if math.isinf(now):
                break  # the rest wait for slots held for an unknown time
        return self._starts

    def _find(self, now: float) -> tuple[int, int, bool] | None:
        """`node.find`: (place in ``waiting``, GPU, whether it is the best) of the next start:
        the best, or the first in the order of the keys' first requests behind it that the rule starts."""
        views = [gpu.view(now) for gpu in self._gpus]
        full = {i for i, view in enumerate(views) if takes_nothing(view)}
        closed: set[int] = set()
        interactive_only: set[int | HeldBack] = set()
        held_back: set[HeldBack] = set()
        gpus = self._gpus
        times = NodeTimes(lambda: {gpu.holding.name: [item.end - now for item in gpu.items] for gpu in gpus},
                          self._figures)
        if len(full) >= len(views):
            return None  # (nothing starts, and the best claims nothing: as `Scheduler.next`)
        best = min(queue[0] for queue in self._pending.values() if queue)
        candidate = self._waiting[best]
        step, gpu = choose(views, candidate, closed, interactive_only, times, self._wanted, held_back)
        if step is Step.START:
            assert gpu is not None
            self.held.clear()  # (as `node.find`: the best starts, and the claim in force ends)
            return best, gpu, True
        if gpu is None:
            self.held.clear()  # (as `node.find`: the best holds nothing back)
        else:  # only the best claims (at every instant where a GPU takes work, as `Scheduler.next`)
            claim = self.held.claim(views, gpu, candidate, best, self._need)
            if isinstance(claim, tuple):
                (held_back if step is Step.CLAIM else interactive_only).update(claim)
            else:
                (closed if step is Step.CLAIM else interactive_only).add(claim)
        if len(closed | full) >= len(views):
            return None
        found: tuple[int, int, bool] | None = None
        for queue in self._pending.values():
            if not queue:
                continue
            request = queue[0]
            if request == best:
                if len(queue) == 1:
                    continue
                request = queue[1]
            if found is not None and request > found[0]:
                continue  # (a later one in the order)
            step, gpu = choose(views, self._waiting[request], closed, interactive_only, times, self._wanted,
                               held_back)
            if step is Step.START:
                assert gpu is not None
                found = request, gpu, False
        return found

    def _need(self, model: str) -> tuple[float, float]:
        """`eviction.Need` from the order: the earlier its first request not started, the more."""
        first = min((queue[0] for band in (False, True) if (queue := self._pending.get((model, band)))),
                    default=None)
        return NOT_WAITED_FOR if first is None else (-float(first), 0.0)

    def _start(self, now: float, request: int, index: int, best: bool) -> None:
        candidate = self._waiting[request]
        self._pending[candidate.model, candidate.interactive].remove(request)  # (its key's first or second)
        self._left -= 1
        model = candidate.model
        self._wanted[model] -= 1
        gpu = self._gpus[index]
        name = gpu.holding.name
        run_s = self._figures.expected_request_run_s(model, self._sizes[request], name)
        if model is not None and model not in gpu.residents:  # a load: ready when it ends
            loaded_at = now + self._figures.expected_swap_s(model, name)
            view = gpu.view(now)  # beside what runs, once the idle models chosen have gone
            # (Models the best holds back go for its own load only.)
            keep = () if best else self.held.models.get(name, ())
            gone = victims(view, model, self._need, keep) or ()
            gpu.residents = after_load(view, model, [eviction.model for eviction in gone])
            item = _Item(loaded_at + run_s, candidate.interactive, model, False)
            gpu.loads.append((item, model, loaded_at))
        else:
            item = _Item(max(now, gpu.ready_of(model)) + run_s, candidate.interactive, model, False)
        gpu.items.append(item)
        self._starts[request] = (now, name)
