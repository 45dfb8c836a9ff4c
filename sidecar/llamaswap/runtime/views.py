"""The queue as operators and clients see it: `view()` (GET /queue, `llamaswap queue`) and one
client's own status (`status_of`), from the scheduler's dispatch order and the estimator.

A walk of the queue (the dispatch order and each one's estimated start) is reused for a moment
while nothing changes: many readers of a deep queue should not each pay for one. A client's
status is one row of the last walk, found by its position index (built once per walk): polling
it costs O(1) however deep the queue (bench/status_poll.py).
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Callable, Mapping, Sequence

from llamaswap.core import NS_PER_S, Band, Clock, Estimator, QueueSnapshot, Scheduler
from llamaswap.core.estimate import grant_end_s, left_s
from llamaswap.core.estimate_node import starts_of_node
from llamaswap.core.eviction import busy_of
from llamaswap.core.holding import GpuHolding
from llamaswap.core.policy import SINGLE_UPSTREAM
from llamaswap.runtime.kept import KeptRow
from llamaswap.runtime.ticket import Ticket, TicketState

# The queue view (GET /queue, the status route) is reused while younger than this.
VIEW_MAX_AGE_S = 0.2


class GpuState(enum.StrEnum):
    """What holds the GPU: nothing, a grant, an abandoned generation the upstream finishes, or an
    exchange granted by an earlier sidecar process that Envoy still reports."""

    IDLE = "idle"
    RUNNING = "running"
    SETTLING = "settling"
    ADOPTED = "adopted"

    @classmethod
    def of(cls, gpu: GpuHolding) -> GpuState:
        """The one word for what holds a GPU (grants first, then a settle, then an adopted exchange)."""
        if gpu.running.busy:
            return cls.RUNNING
        if gpu.settling:
            return cls.SETTLING
        return cls.ADOPTED if gpu.adopted else cls.IDLE

    @classmethod
    def of_node(cls, holdings: Sequence[GpuHolding]) -> GpuState:
        """The one word for the node: grants on any GPU first, then a settle on any, then an
        adopted exchange on any."""
        if any(gpu.running.busy for gpu in holdings):
            return cls.RUNNING
        if any(gpu.settling for gpu in holdings):
            return cls.SETTLING
        return cls.ADOPTED if any(gpu.adopted for gpu in holdings) else cls.IDLE


def free(holdings: Sequence[GpuHolding]) -> bool:
    """Nothing holds any of these GPUs: no grant, no settle, no adopted exchange."""
    return not any(gpu.running.busy or gpu.blocked for gpu in holdings)


def held(gpu: GpuHolding) -> int:
    """The exchanges this process holds on a GPU: its grants and the adopted ones."""
    return gpu.running.busy + gpu.adopted


@dataclasses.dataclass(frozen=True, slots=True)
class WaitingRow:
    """`model` is the name the client sent (the scheduler may key it otherwise: `Ticket.schedule_model`)."""

    request_id: str
    position: int
    priority: int
    band: Band
    score: float  # at its turn in this order
    swap_affinity: bool
    waited_s: float
    model: str | None
    estimated_start_s: float | None  # from now; None: unknown (it waits behind work of unknown length)
    aging: float = 0.0  # the score's aging term (`WaitingView.aging`)


@dataclasses.dataclass(frozen=True, slots=True)
class RunningRow:
    request_id: str
    priority: int
    band: Band
    score: float
    model: str | None
    queue_wait_s: float
    running_s: float
    # When it is expected to end, from its grant (`estimate.grant_end_s`): its run after its own
    # load or the load it was granted beside.
    expected_end_s: float
    expected_remaining_s: float | None  # None: it has outrun its expected run, how much longer is unknown
    upstream: str = SINGLE_UPSTREAM  # the upstream (GPU) it runs on


@dataclasses.dataclass(frozen=True, slots=True)
class ModelRow:
    """One model on a GPU: resident there (or running there while none is known resident), its
    slots and how many of them running grants hold."""

    model: str
    slots_busy: int
    slots: int  # the model's own slots there (`models.<id>.slots`, else the upstream's)
    pinned: bool = False  # `models.<id>.pinned`: never evicted
    # A running grant began by loading it (`GpuHolding.loading`): its load may still be under way.
    loading: bool = False

    @classmethod
    def rows_of(cls, gpu: GpuHolding) -> tuple[ModelRow, ...]:
        """Each resident model of a GPU, and any model running there while not known resident,
        sorted by name."""
        running = gpu.running
        named = set(gpu.residents)
        if running.models is not None:
            named.update(running.models)
        elif running.model is not None:
            named.add(running.model)
        loading = gpu.loading[0] if gpu.loading is not None else None
        pinned = gpu.residency.pinned
        return tuple(cls(model, busy_of(gpu, model)[0], gpu.slots.of(model), model in pinned, model == loading)
                     for model in sorted(named))


@dataclasses.dataclass(frozen=True, slots=True)
class GpuRow:
    """One upstream of the node (a GPU, or the GPUs one llama-server uses together): what it has
    loaded and how many of its slots the running grants hold."""

    name: str
    resident_models: tuple[str, ...]  # sorted (empty: none known)
    slots_busy: int
    slots: int  # the slots of the model in effect there
    state: GpuState = GpuState.IDLE  # what holds it
    # Several resident (issue 37): each model's slots and busy ones (`ModelRow.rows_of`), how many
    # may be resident at once (`maxLoaded`), and the resident model the best waiting request
    # holds back there (no new grants for it until it drains and goes; None: none).
    models: tuple[ModelRow, ...] = ()
    max_loaded: int = 1
    held_back: str | None = None

    @classmethod
    def of(cls, gpu: GpuHolding, held_back: str | None = None) -> GpuRow:
        """The row of what a GPU holds (`Scheduler.holdings`), with the model held back there
        (the snapshot's `GpuView.held_back`)."""
        return cls(gpu.name, tuple(sorted(gpu.residents)), gpu.running.busy, gpu.slots_in_effect, GpuState.of(gpu),
                   ModelRow.rows_of(gpu), gpu.residency.max_loaded, held_back)


@dataclasses.dataclass(frozen=True, slots=True)
class QueueView:
    """The live queue for operators (GET /queue, `llamaswap queue`) and for one client's status."""

    policy: str
    # Every upstream's resident models, each once, in the configured order of the upstreams (each
    # one's sorted); empty: none known.
    resident_models: tuple[str, ...]
    gpu: GpuState
    running: tuple[RunningRow, ...]  # every running grant, earliest first (one per busy slot)
    waiting: tuple[WaitingRow, ...]
    bands: tuple[tuple[Band, int, float], ...]  # band, depth, oldest wait in seconds
    slots_busy: int = 0  # running grants
    slots_total: int = 1  # the slots of the model in effect (upstream.slots, models.<id>.slots)
    kept: tuple[KeptRow, ...] = ()  # places kept for a client's retry (routing.retryGraceSeconds), oldest first
    # Every upstream, in the configured order (one with `upstream:` alone). With several, the
    # fields above describe the node: `resident_models` all of theirs, the slots summed over all.
    gpus: tuple[GpuRow, ...] = ()


def node_residents(snapshot: QueueSnapshot) -> tuple[str, ...]:
    """Every upstream's resident models in a snapshot, each once, in the configured order."""
    return tuple(dict.fromkeys(model for gpu in snapshot.gpus for model in gpu.resident_models))


@dataclasses.dataclass(frozen=True, slots=True)
class _Walk:
    version: int
    at_ns: int
    snapshot: QueueSnapshot
    starts: list[float]
    took_s: float
    positions: dict[str, int]  # token -> index in snapshot.waiting


class QueueViews:
    """Reads the coordinator's state, never changes it. `version` changes with every change of
    the queue (the coordinator counts them); `blocked` says, for each GPU that work the scheduler
    did not grant holds (a settling generation, an adopted exchange), how much longer it does
    (`math.inf`: unknown), nothing granted there meanwhile; `holdings`, what holds each GPU
    (`Scheduler.holdings`, by default; the coordinator's tells the scheduler first what the
    runtime knows: `Gpus.tell`), which says what holds the node and each GPU (`GpuState`)."""

    def __init__(self, scheduler: Scheduler, estimator: Estimator, clock: Clock, tickets: dict[str, Ticket],
                 by_request_id: dict[str, Ticket], *, version: Callable[[], int],
                 blocked: Callable[[], Mapping[str, float]],
                 holdings: Callable[[], Sequence[GpuHolding]] | None = None) -> None:
        self._scheduler = scheduler
        self._estimator = estimator
        self._clock = clock
        self._tickets = tickets
        self._by_request_id = by_request_id
        self._version = version
        self._blocked = blocked
        self._holdings = holdings or scheduler.holdings
        self._walk: _Walk | None = None

    @property
    def last_walk_s(self) -> float:
        """How long the last fresh walk took (the estimate batching widens with it)."""
        return self._walk.took_s if self._walk is not None else 0.0

    def walk(self, *, fresh: bool = False) -> tuple[QueueSnapshot, list[float]]:
        """The dispatch order and each one's estimated start (seconds from now)."""
        now = self._clock.now_ns()
        cached = self._current(now, fresh=fresh)
        age_s = (now - cached.at_ns) / NS_PER_S
        if age_s == 0:
            return cached.snapshot, cached.starts
        return cached.snapshot, [_aged(start, age_s) for start in cached.starts]

    def _current(self, now: int, *, fresh: bool = False) -> _Walk:
        """The last walk while it is current (same version, younger than VIEW_MAX_AGE_S), else a new one."""
        cached = self._walk
        if (cached is not None and not fresh and cached.version == self._version()
                and now - cached.at_ns < VIEW_MAX_AGE_S * NS_PER_S):
            return cached
        snapshot = self._scheduler.snapshot()
        # A settle or an adopted exchange: nothing is granted on its GPU until it ends (`GpuHolding.blocked`).
        blocked = self._blocked()
        # The grants' own rule over every GPU (`starts_of_node`; one GPU is a node of one).
        placed = starts_of_node(self._estimator, snapshot, self._holdings(), blocked)
        starts = [start for start, _ in placed]
        positions = {w.request_id: index for index, w in enumerate(snapshot.waiting)}
        took_s = (self._clock.now_ns() - now) / NS_PER_S
        walk = self._walk = _Walk(self._version(), now, snapshot, starts, took_s, positions)
        return walk

    def view(self, kept: tuple[KeptRow, ...] = ()) -> QueueView:
        """The live queue, with ``kept``: the places kept for a retry (`PlaceKeeper.rows`)."""
        snapshot, starts = self.walk()
        now = self._clock.now_ns()

        tickets = self._tickets
        waiting = tuple(
            WaitingRow(ticket.request_id, w.position, w.priority, w.band, w.score, w.swap_affinity, w.waited_s,
                       ticket.model, _known(start), w.aging) if (ticket := tickets.get(w.request_id)) is not None
            else WaitingRow("-", w.position, w.priority, w.band, w.score, w.swap_affinity, w.waited_s, w.model,
                            _known(start), w.aging)
            for w, start in zip(snapshot.waiting, starts))
        running = self._running_rows(now)
        bands = tuple((band, stats.depth, stats.oldest_wait_s) for band, stats in self._scheduler.band_stats().items())
        # The GPUs as the scheduler has them now (the walk's may be VIEW_MAX_AGE_S old).
        scheduler = self._scheduler
        holdings = self._holdings()
        held_back = {gpu.name: gpu.held_back for gpu in snapshot.gpus}
        gpus = [GpuRow.of(gpu, held_back.get(gpu.name)) for gpu in holdings]
        # The node's slots in effect (with one GPU, its own; busy is over all of them).
        slots_total = sum(gpu.slots for gpu in gpus)
        return QueueView(str(snapshot.policy), node_residents(snapshot), GpuState.of_node(holdings), tuple(running),
                         waiting, bands, scheduler.slots_busy, slots_total, kept=kept, gpus=tuple(gpus))

    def _running_rows(self, now: int, *, only: str | None = None) -> tuple[RunningRow, ...]:
        """A row per running grant, earliest first (with `only`, that ticket's row alone)."""
        rows = []
        for decision in self._scheduler.running_grants:
            if only is not None and decision.request_id != only:
                continue
            ticket = self._tickets.get(decision.request_id)
            running_s = (now - decision.granted_ns) / NS_PER_S
            expected = grant_end_s(self._estimator, decision)
            remaining = left_s(expected, running_s)
            rows.append(RunningRow(ticket.request_id if ticket is not None else "-", decision.priority, decision.band,
                                   decision.score, ticket.model if ticket is not None else decision.model,
                                   decision.queue_wait_ns / NS_PER_S, running_s, expected, remaining,
                                   decision.upstream))
        return tuple(rows)

    def status_of(self, request_id: str) -> tuple[Ticket, WaitingRow | RunningRow] | None:
        """One client's own request, by its x-request-id (the public status route): its row of
        the current walk, by the walk's position index, without building the others."""
        ticket = self._by_request_id.get(request_id)
        if ticket is None:
            return None
        now = self._clock.now_ns()
        if ticket.state is TicketState.RUNNING:
            row = self._running_rows(now, only=ticket.token)
            return (ticket, row[0]) if row else None
        if ticket.state is not TicketState.WAITING:
            return None
        walk = self._current(now)
        index = walk.positions.get(ticket.token)
        if index is None:
            return None
        w = walk.snapshot.waiting[index]
        age_s = (now - walk.at_ns) / NS_PER_S
        return ticket, WaitingRow(request_id, w.position, w.priority, w.band, w.score, w.swap_affinity,
                                  w.waited_s, ticket.model, _known(_aged(walk.starts[index], age_s)), w.aging)


def _aged(start_s: float, age_s: float) -> float:
    """A start estimated `age_s` ago, from now. One that has come while the walk is still current
    (nothing ended since) waited for work that outran its estimate: unknown (`math.inf`), not 0."""
    if 0 < start_s <= age_s:
        return math.inf
    return max(0.0, start_s - age_s)


def _known(start_s: float) -> float | None:
    """An estimated start as the views show it: None where it cannot be told (`math.inf`)."""
    return start_s if math.isfinite(start_s) else None
