"""What one GPU holds, as one value: `GpuHolding`.

Its resident models, the slots of each, what runs in them (`Running`, as the dispatch rule
needs it), the load under way there, the models it may serve, and the work the scheduler did
not grant that holds it (a settle, adopted exchanges: the runtime tells the scheduler,
`Scheduler.blocked_by`). The scheduler keeps one per GPU, built again when read after a change of
what runs, is resident or holds it (`GpuRecord.holding`; the GPU's idle one is kept while
nothing of that changes, and `Scheduler` keeps the tuple of them and of the GPUs that take
work); the dispatch rule (`dispatch.turn`, `dispatch.choose`), a grant's `ready_at`, the node
walk, the dispatch order's swap-affinity bonus, the estimates' walk, the views and the gauges
read it, and nothing else says what a GPU holds. Each running request's expected end is a
function of its own record (`estimate.grant_end_s`: sized by the `max_tokens` it carries, after
the load it began or was granted beside), not a second copy kept here.

A GPU keeps up to ``residency.max_loaded`` models resident (1, the default: room for one, so a
load evicts the idle resident one), each with slots of its own; what runs is counted per model
where it names more than one (`Running.models`, `eviction.busy_of`).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import NamedTuple, Protocol, TypeVar

from llamaswap.core.residency import ONE_MODEL, Residency, may_serve
from llamaswap.core.slots import Slots


class Candidate(Protocol):
    """A waiting request as the rule sees it."""

    @property
    def model(self) -> str | None: ...  # what it is scheduled on; None: no model

    @property
    def alone(self) -> bool: ...  # runs with nothing beside it (an unload)

    @property
    def interactive(self) -> bool: ...  # `Band.interactive`: it may take a reserved slot


class Running(NamedTuple):
    """What runs on a GPU, as the rule needs it: the scheduler's grants (in an estimate, the
    grants it expects to run then). (A named tuple: built on every change of what runs.)"""

    busy: int = 0  # slots held
    non_interactive: int = 0  # of those, held by work below the interactive band
    model: str | None = None  # a model the running work names (the one, where it names one); None: none named
    alone: bool = False  # a request that runs alone holds the GPU
    # Where the running work names more than one model: each one's (busy,
    # non_interactive); None where it names at most one (then ``busy`` is that model's).
    models: Mapping[str, tuple[int, int]] | None = None


IDLE = Running()


class Loads(Protocol):
    """A running grant as far as its load goes (a `Decision`, or a `RunningView` of one)."""

    @property
    def model(self) -> str | None: ...

    @property
    def model_load(self) -> bool: ...  # it began by loading its model


G = TypeVar("G", bound=Loads)


def load_under_way(running: Iterable[G]) -> G | None:
    """The running grant whose load is under way on a GPU (its `GpuHolding.loading`; those
    granted beside it run once it ends): the one that began by loading its model, at most one,
    since a load starts only with nothing running there. None: none."""
    for grant in running:
        if grant.model_load and grant.model is not None:
            return grant
    return None


def running_of(work: Collection[Candidate]) -> Running:
    """What runs on a GPU, from each running request as the rule sees it (the scheduler's grants,
    or in an estimate the grants it expects to run then): the one builder of `Running`."""
    if not work:
        return IDLE
    model = None
    alone = False
    non_interactive = 0
    mixed = False  # it names more than one model
    for item in work:
        if item.model is not None:
            mixed = mixed or (model is not None and item.model != model)
            model = item.model
        alone = alone or item.alone
        non_interactive += not item.interactive
    if not mixed:
        return Running(len(work), non_interactive, model, alone)
    per_model: dict[str, tuple[int, int]] = {}
    for item in work:
        if item.model is not None:
            busy, below = per_model.get(item.model, (0, 0))
            per_model[item.model] = (busy + 1, below + (not item.interactive))
    return Running(len(work), non_interactive, model, alone, per_model)


NO_RESIDENTS: frozenset[str] = frozenset()
NEVER_USED: Mapping[str, int] = MappingProxyType({})
NONE_ASKED: Mapping[str, float] = MappingProxyType({})


class GpuHolding(NamedTuple):
    """What one GPU holds now. (A named tuple: immutable, and built on every grant and release
    at the cost of a tuple.)"""

    name: str
    slots: Slots  # each model's slots, and the reserved ones
    models: frozenset[str] | None  # the models it may serve; None: any
    residents: frozenset[str] = NO_RESIDENTS  # the models resident (known loaded) there
    running: Running = IDLE
    # The load under way there: the model a running grant began loading, and when it was granted
    # (those granted beside it run once it ends); None: none.
    loading: tuple[str, int] | None = None
    # Work the scheduler did not grant that holds it: a settle (an abandoned generation the
    # upstream finishes) and the exchanges adopted from an earlier process still running there.
    settling: bool = False
    adopted: int = 0
    # Either of those holds it: nothing new is granted there until it ends. Always
    # ``(settling and settling_model is None) or adopted > 0``, set by whoever builds the value
    # (`GpuRecord.holding`, the estimates' walk); a field, not a property, because the rule reads it for every GPU and
    # request it asks about (a property costs 50 ns a read).
    blocked: bool = False
    residency: Residency = ONE_MODEL  # how many models may be resident at once, and what they weigh
    # When each resident model was last granted (the scheduler's clock; the record's own map,
    # read, never changed, here): the least recently used goes first among equally needed ones.
    last_used: Mapping[str, int] = NEVER_USED
    # Several resident: the model whose abandoned generation a settle waits for (it takes nothing
    # and does not go meanwhile; the others serve on: then ``blocked`` is False); None: none.
    settling_model: str | None = None
    # When each model last became idle there: its last release, or being counted resident anew
    # (the record's own map, read here): its idle time counts from the later of this and its last
    # grant (idle unloads, `idle.py`).
    idle_since: Mapping[str, int] = NEVER_USED
    # The keep_alive (seconds, `core/keep_alive.py`) the last request granted of each model here
    # asked, where it asked one (the record's own map, read here): its idle time (`idle.py`).
    keep_alive: Mapping[str, float] = NONE_ASKED

    def has(self, model: str | None) -> bool:
        """``model`` is resident here (a request of no model needs none)."""
        return model is not None and model in self.residents

    def may_serve(self, candidate: Candidate) -> bool:
        return may_serve(self.models, self.residency, candidate.model)

    @property
    def slots_in_effect(self) -> int:
        """The slots the rule fills up to: those of the models held there (resident, or named by
        what runs), summed; the default with none. While a request runs alone (an unload), its
        model's: it holds the whole GPU."""
        residents = self.residents
        running = self.running
        model = running.model
        if running.alone:
            return self.slots.of(model)
        if len(residents) <= 1 and (model is None or model in residents):  # the common case, without a set
            for model in residents:
                break
            return self.slots.of(model)
        held = set(residents)
        if running.models is not None:
            held.update(running.models)
        elif model is not None:
            held.add(model)
        return sum(self.slots.of(name) for name in held)


def resident_on(holdings: Sequence[GpuHolding]) -> frozenset[str]:
    """The models resident on any of these GPUs."""
    if len(holdings) == 1:  # the common case, without a set built per grant
        return holdings[0].residents
    return frozenset(model for gpu in holdings for model in gpu.residents)
