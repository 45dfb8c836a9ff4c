"""Stopping running Batch API lines so that a request of a higher band starts (issue 46): which
lines, on which GPU, as the one rule reads it.

Only a grant the runtime marked stoppable at its arrival is ever stopped (a line of the Batch
API, whose feeder can stop it at a token and send it again to resume where it stopped; a
client's own request never is). When the best waiting request cannot start on any GPU, the
stoppable grants of a lower band than its own are the candidates (a resumed one, which took its
stopped place back, once it has run ``min_run_ns``: not stopped again at once), and on each GPU
that may serve it the fewest of them whose going lets it start there are chosen (`turn` asked of
the GPU as it would hold without them):

- its model resident there (or a request of no model): one of that model's grants, which frees
  a slot of it;
- else, for its load: every grant of each of the resident models whose draining makes room for it,
  the fewest grants (then as below: the lowest band, the least work lost; an idle model may go; a
  model of a client's request never drains by this).

Over the GPUs, the fewest stops win, then the lowest band stopped, then the least work lost
(the shortest running: a stopped line reads its kept tokens again as prompt where the upstream's
prompt cache no longer holds them), then the configured order. The grants chosen are said once
(`Stopping.orders`); while they are being stopped they count as gone for the next choice, so one
waiting request never stops more than it needs, and their release ends them
(`Stopping.released`). A stopped grant's release may begin a settle of its GPU (the upstream lets
go of the generation): until that settle ends, or something is granted there, the rule reads that
GPU as it will hold once settled, so that no line more is stopped for the waiting request
meanwhile (there or elsewhere).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Sequence

from llamaswap.core.dispatch import Turn, turn
from llamaswap.core.gpu_record import Grant, GpuRecord
from llamaswap.core.holding import GpuHolding, running_of
from llamaswap.core.index import Entry
from llamaswap.core.priority import Band

# A band's rank: a grant is stopped only for a request of a strictly higher one.
_RANK = {Band.BATCH: 0, Band.NORMAL: 1, Band.INTERACTIVE: 2}

_STARTS = (Turn.IDLE, Turn.FREE, Turn.ROOM, Turn.EVICT)


@dataclasses.dataclass(frozen=True, slots=True)
class Stop:
    """An order to stop a running grant: ``request_id`` on ``gpu``, for ``for_request`` (the best
    waiting request, of a higher band)."""

    request_id: str
    gpu: str
    band: Band
    for_request: str
    for_band: Band


def _holding_without(gpu: GpuRecord, holding: GpuHolding, gone: Iterable[str]) -> GpuHolding:
    """What ``gpu``, holding ``holding``, would hold with the grants ``gone`` ended (their models
    stay resident)."""
    gone = set(gone)
    if not gone:
        return holding
    left = [grant.entry for request_id, grant in gpu.grants.items() if request_id not in gone]
    return holding._replace(running=running_of(left))


def _stoppable(grant: Grant, best: Entry, now_ns: int, min_run_ns: int) -> bool:
    entry = grant.entry
    return (entry.stoppable and _RANK[entry.priority.band] < _RANK[best.priority.band]
            and (not entry.resumed or now_ns - grant.decision.granted_ns >= min_run_ns))


def _least_loss(grants: Sequence[Grant]) -> list[Grant]:
    """Lowest band first, then the shortest running (the least work to read again), then the
    earliest granted."""
    return sorted(grants, key=lambda g: (_RANK[g.entry.priority.band], -g.decision.granted_ns, g.decision.request_id))


def _on_gpu(gpu: GpuRecord, holding: GpuHolding, best: Entry, stopping: set[str], now_ns: int,
            min_run_ns: int) -> list[Grant] | None:
    """The fewest stoppable grants of ``gpu`` whose going lets ``best`` start there (besides those
    ``stopping`` already), least loss first; None if none would."""
    candidates = [grant for request_id, grant in gpu.grants.items()
                  if request_id not in stopping and _stoppable(grant, best, now_ns, min_run_ns)]
    if not candidates:
        return None
    model = best.model
    if model is None or model in gpu.residents:
        for grant in _least_loss([g for g in candidates if g.entry.model == model or model is None]):
            if turn(_holding_without(gpu, holding, stopping | {grant.decision.request_id}), best) in _STARTS:
                return [grant]
        return None
    # A load: drain whole models (each one's every grant stoppable), the fewest grants first.
    by_model: dict[str | None, list[Grant]] = {}
    for request_id, grant in gpu.grants.items():
        if request_id not in stopping:
            by_model.setdefault(grant.entry.model, []).append(grant)
    drainable = {name: grants for name, grants in by_model.items()
                 if all(_stoppable(grant, best, now_ns, min_run_ns) for grant in grants)}
    best_set: tuple[tuple[int, int, int], list[Grant]] | None = None  # (its cost, the grants)
    for size in range(1, len(drainable) + 1):
        for names in itertools.combinations(sorted(drainable, key=str), size):
            grants = [grant for name in names for grant in drainable[name]]
            cost = _cost(grants, now_ns)  # (of equally few stops: the lowest band, the least loss)
            if best_set is not None and cost >= best_set[0]:
                continue
            gone = stopping | {grant.decision.request_id for grant in grants}
            if turn(_holding_without(gpu, holding, gone), best) in _STARTS:
                best_set = cost, _least_loss(grants)
    return best_set[1] if best_set is not None else None


def _cost(grants: Sequence[Grant], now_ns: int) -> tuple[int, int, int]:
    return (len(grants), max(_RANK[g.entry.priority.band] for g in grants),
            sum(now_ns - g.decision.granted_ns for g in grants))


class Stopping:
    """How many stoppable grants run (none: nothing is asked), the stops ordered and not yet ended,
    and the orders not yet taken by the runtime."""

    __slots__ = ("running", "_stopping", "_orders", "_letting_go")

    def __init__(self) -> None:
        self.running = 0
        self._stopping: dict[str, Stop] = {}  # by request id, until its release
        self._orders: list[Stop] = []
        # GPUs where a stopped grant was released, with their grants so far then (`GpuRecord.dispatches`).
        self._letting_go: dict[str, int] = {}

    def ask(self, gpus: Sequence[GpuRecord], best: Entry, now_ns: int, min_run_ns: int) -> None:
        """``best`` waits and starts nowhere: order the stops that let it start (none where a stop
        ordered already will, or none would)."""
        if not _RANK[best.priority.band]:
            return  # (the lowest band stops nothing: lines waiting behind lines ask this at every next)
        stopping = set(self._stopping)
        chosen: tuple[int, list[Grant]] | None = None
        for index, gpu in enumerate(gpus):
            holding = self._settled(gpu) if self._letting_go else gpu.holding
            if holding.blocked or not holding.may_serve(best):
                continue
            if (stopping or holding is not gpu.holding) and turn(_holding_without(gpu, holding, stopping),
                                                                 best) in _STARTS:
                return  # the stops under way (and the settles they began) make room for it here
            grants = _on_gpu(gpu, holding, best, stopping, now_ns, min_run_ns)
            if grants is not None and (chosen is None or _cost(grants, now_ns) < _cost(chosen[1], now_ns)):
                chosen = index, grants
        if chosen is None:
            return
        gpu = gpus[chosen[0]]
        for grant in chosen[1]:
            stop = Stop(grant.decision.request_id, gpu.name, grant.entry.priority.band, best.request_id,
                        best.priority.band)
            self._stopping[stop.request_id] = stop
            self._orders.append(stop)

    def _settled(self, gpu: GpuRecord) -> GpuHolding:
        """What ``gpu`` holds, as it will once the settle that a stopped grant's release began
        there has ended (while it settles since, nothing granted there meanwhile)."""
        holding = gpu.holding
        since = self._letting_go.get(gpu.name)
        if since is None:
            return holding
        if since != gpu.dispatches or not holding.settling:
            del self._letting_go[gpu.name]  # its settle ended, or the freed slot was taken
            return holding
        return holding._replace(settling=False, settling_model=None, blocked=holding.adopted > 0)

    def orders(self) -> list[Stop]:
        """The stops ordered since the last call (each said once)."""
        orders, self._orders = self._orders, []
        return orders

    def stopping(self, request_id: str) -> bool:
        return request_id in self._stopping

    def released(self, entry: Entry, gpu: GpuRecord) -> bool:
        """A grant ended on ``gpu`` (stopped, or it ended first: nothing doubled); whether it was
        stoppable."""
        if not entry.stoppable:
            return False
        self.running -= 1
        if self._stopping.pop(entry.request_id, None) is not None:
            self._letting_go[gpu.name] = gpu.dispatches
        return True
