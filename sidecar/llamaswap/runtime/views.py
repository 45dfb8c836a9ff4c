"""The queue as operators and clients see it: `view()` (GET /queue, `llamaswap queue`) and one
client's own status (`status_of`), from the scheduler's dispatch order and the estimator.

A walk of the queue (the dispatch order and each one's estimated start) is reused for a moment
while nothing changes: many readers of a deep queue should not each pay for one. A client's
status is one row of the last walk, found by its position index (built once per walk): polling
it costs O(1) however deep the queue (bench/status_poll.py).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Collection, Mapping, Sequence

from llamaswap.core import NS_PER_S, Band, Clock, Estimator, QueueSnapshot, Scheduler
from llamaswap.core.estimate import grant_end_s, left_s
from llamaswap.core.estimate_node import starts_of_node
from llamaswap.core.holding import GpuHolding
from llamaswap.core.policy import IMPLICIT_GPU
from llamaswap.runtime.gpu_projection import GpuState, NodeProjection, Projector
from llamaswap.runtime.kept import KeptRow
from llamaswap.runtime.stops import LineProgress, Lines, NoLines
from llamaswap.runtime.ticket import Ticket, TicketState

# The queue view (GET /queue, the status route) is reused while younger than this.
VIEW_MAX_AGE_S = 0.2


def free(holdings: Sequence[GpuHolding]) -> bool:
    """Nothing holds any of these GPUs: no grant, no settle, no adopted exchange."""
    for gpu in holdings:  # (a loop, not any() over a generator: each release asks)
        if gpu.running.busy or gpu.blocked:
            return False
    return True


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
    # A Batch API line its owner can stop (`stops.py`): its stops so far and the tokens they kept
    # (a resumed line waits with them); None for any other request.
    line: LineProgress | None = None


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
    gpu: str = IMPLICIT_GPU  # the GPU it runs on
    line: LineProgress | None = None  # a stoppable line's stops so far and tokens now (`WaitingRow.line`)


@dataclasses.dataclass(frozen=True, slots=True)
class IdleRow:
    """A resident model idle on a GPU (`core/idle.py`): for how long, and in how long it will be
    unloaded for idleness (None: never: no idle time there, pinned, or an upstream that cannot unload)."""

    gpu: str
    model: str
    idle_s: float
    unload_in_s: float | None


@dataclasses.dataclass(frozen=True, slots=True)
class QueueView:
    """The live queue for operators (GET /queue, `llamaswap queue`) and for one client's status."""

    policy: str
    running: tuple[RunningRow, ...]  # every running grant, earliest first (one per busy slot)
    waiting: tuple[WaitingRow, ...]
    bands: tuple[tuple[Band, int, float], ...]  # band, depth, oldest wait in seconds
    # Every GPU in the configured order, and the node they make (`gpu_projection.py`): the one
    # projection /queue, the page, the gauges and the picker read.
    node: NodeProjection
    kept: tuple[KeptRow, ...] = ()  # places kept for a client's retry (routing.retryGraceSeconds), oldest first
    # The idle resident models on the GPUs with an idle time (idle unloads), GPU by GPU.
    idle: tuple[IdleRow, ...] = ()

    @property
    def gpu(self) -> GpuState:
        return self.node.gpu

    @property
    def resident_models(self) -> tuple[str, ...]:
        return self.node.resident_models

    @property
    def slots_busy(self) -> int:
        return self.node.slots_busy

    @property
    def slots_total(self) -> int:
        return self.node.slots_total


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
    (`Scheduler.holdings`, by default: the record the runtime tells of each settle and adoption
    as it begins and ends, so both read the same state and neither syncs anything), which the
    GPUs' projection shows (`gpu_projection.py`); `lines`, the progress of each Batch API line
    that may be stopped (`stops.py`), which its row carries."""

    def __init__(self, scheduler: Scheduler, estimator: Estimator, clock: Clock, tickets: dict[str, Ticket],
                 by_request_id: dict[str, Ticket], *, version: Callable[[], int],
                 blocked: Callable[[], Mapping[str, float]],
                 holdings: Callable[[], Sequence[GpuHolding]] | None = None,
                 unloadable: Callable[[], Collection[str]] = frozenset, lines: Lines | None = None) -> None:
        self._scheduler = scheduler
        self._estimator = estimator
        self._clock = clock
        self._tickets = tickets
        self._by_request_id = by_request_id
        self._version = version
        self._blocked = blocked
        self._holdings = holdings or scheduler.holdings
        self._unloadable = unloadable  # the GPUs that can unload a model (`Gpus.routers`)
        self._lines: Lines = lines or NoLines()
        self._walk: _Walk | None = None
        self._projector = Projector()

    @property
    def last_walk_s(self) -> float:
        """How long the last fresh walk took (the estimate batching widens with it)."""
        return self._walk.took_s if self._walk is not None else 0.0

    def walk(self, *, fresh: bool = False, now: int | None = None) -> tuple[QueueSnapshot, list[float]]:
        """The dispatch order and each one's estimated start (seconds from ``now``: the clock's
        now unless given)."""
        if now is None:
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
        # (As of the snapshot's instant, which its running grants' remaining times are of.)
        walk = self._walk = _Walk(self._version(), snapshot.at_ns, snapshot, starts, took_s, positions)
        return walk

    def view(self, kept: tuple[KeptRow, ...] = ()) -> QueueView:
        """The live queue, with ``kept``: the places kept for a retry (`PlaceKeeper.rows`)."""
        now = self._clock.now_ns()  # (one instant for the estimates and the running rows)
        snapshot, starts = self.walk(now=now)

        tickets = self._tickets
        waiting = tuple(
            WaitingRow(ticket.request_id, w.position, w.priority, w.band, w.score, w.swap_affinity, w.waited_s,
                       ticket.model, _known(start), w.aging, self._line(ticket))
            if (ticket := tickets.get(w.request_id)) is not None
            else WaitingRow("-", w.position, w.priority, w.band, w.score, w.swap_affinity, w.waited_s, w.model,
                            _known(start), w.aging)
            for w, start in zip(snapshot.waiting, starts))
        running = self._running_rows(now)
        bands = tuple((band, stats.depth, stats.oldest_wait_s) for band, stats in self._scheduler.band_stats().items())
        return QueueView(str(snapshot.policy), tuple(running), waiting, bands, self.gpus(), kept=kept,
                         idle=self.idle_rows(now))

    def idle_rows(self, now: int) -> tuple[IdleRow, ...]:
        """Each idle resident model on a GPU with an idle time, with how long it has sat idle and
        when it will be unloaded (`core/idle.py`); none where no GPU has one (the default)."""
        timed = {gpu.name for gpu in self._scheduler.policy.gpus if gpu.residency.idle.ever}
        if not timed:
            return ()
        return tuple(IdleRow(idle.gpu, idle.model, (now - idle.since_ns) / NS_PER_S,
                             None if idle.due_ns is None else max(0.0, (idle.due_ns - now) / NS_PER_S))
                     for idle in self._scheduler.idle_unloads(self._unloadable()).idle if idle.gpu in timed)

    def gpus(self) -> NodeProjection:
        """Every GPU as the scheduler has it now (the walk's may be VIEW_MAX_AGE_S old), with the
        model held back on each (`gpu_projection.py`; the gauges' picture reads the same)."""
        return self._projector.node(self._holdings(), self._scheduler.held_back)

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
                                   decision.gpu, self._line(ticket) if ticket is not None else None))
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
                                  w.waited_s, ticket.model, _known(_aged(walk.starts[index], age_s)), w.aging,
                                  self._line(ticket))

    def _line(self, ticket: Ticket) -> LineProgress | None:
        """A stoppable line's progress (asked of its owner only for a ticket admitted as one)."""
        return self._lines.progress(ticket.request_id) if ticket.line_key is not None else None


def _aged(start_s: float, age_s: float) -> float:
    """A start estimated `age_s` ago, from now. One that has come while the walk is still current
    (nothing ended since) waited for work that outran its estimate: unknown (`math.inf`), not 0."""
    if 0 < start_s <= age_s:
        return math.inf
    return max(0.0, start_s - age_s)


def _known(start_s: float) -> float | None:
    """An estimated start as the views show it: None where it cannot be told (`math.inf`)."""
    return start_s if math.isfinite(start_s) else None
