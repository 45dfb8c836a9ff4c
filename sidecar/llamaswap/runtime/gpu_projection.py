"""One projection of the GPUs, the one that every reader of them reads: GET /queue and the
page's state (`NodeProjection.document`, which `llamaswap queue` and the page render as sent),
the gauges and an endpoint picker's page (`QueuePicture.node`, `runtime/observer.py`).

Built from what holds each GPU (`GpuHolding`, the scheduler's) and the model the best waiting
request holds back there (`Scheduler.held_back`). The JSON of a GPU is written from the
dataclass's own fields (`document_of`): a field added to `GpuProjection` or `ModelProjection`
is in /queue, the page's state and the gauges' picture with that one edit. The server also says
how to show them: `per_gpu` (a line per GPU), `per_model` (a GPU's models each with its slots),
so neither the page nor the command line decides it.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping, Sequence
from typing import Any

from llamaswap.core.eviction import busy_of
from llamaswap.core.holding import GpuHolding


class GpuState(enum.StrEnum):
    """What holds a GPU: nothing, a grant, an abandoned generation the upstream finishes, or an
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
    def of_node(cls, states: Sequence[GpuState]) -> GpuState:
        """The one word for the node, from each GPU's: grants on any first, then a settle on any,
        then an adopted exchange on any."""
        for state in (cls.RUNNING, cls.SETTLING, cls.ADOPTED):
            if state in states:
                return state
        return cls.IDLE


@dataclasses.dataclass(frozen=True, slots=True)
class ModelProjection:
    """One model on a GPU: resident there (or running there while none is known resident), its
    slots and how many of them running grants hold."""

    model: str
    slots_busy: int
    slots: int  # the model's own slots there (`models.<id>.slots`, else the upstream's)
    pinned: bool = False  # `models.<id>.pinned`: never evicted
    # A running grant began by loading it (`GpuHolding.loading`): its load may still be under way.
    loading: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class GpuProjection:
    """One GPU (an upstream: a GPU, or the GPUs one llama-server uses together) as everyone
    outside the scheduler sees it."""

    name: str
    resident_models: tuple[str, ...]  # sorted (empty: none known)
    slots_busy: int  # its running grants
    slots: int  # the slots of the model in effect there (several resident: the sum of theirs)
    state: GpuState = GpuState.IDLE  # what holds it
    max_loaded: int = 1  # models it may keep resident at once (`maxLoaded`)
    # Each resident model, and any model running there while not known resident, by name.
    models: tuple[ModelProjection, ...] = ()
    # The resident model the best waiting request holds back there (no new grants for it until
    # it drains and goes); None: none.
    held_back: str | None = None
    # Something besides our grants holds it (a settle, an adopted exchange): nothing starts there.
    blocked: bool = False
    # Shown model by model (each with its slots): it may keep several resident, or has several. (A
    # model held back says nothing of it: with room for one model, the best waiting for a swap
    # holds back the one resident.)
    per_model: bool = False

    @classmethod
    def of(cls, gpu: GpuHolding, held_back: str | None = None) -> GpuProjection:
        """What a GPU holds (`Scheduler.holdings`), with the model held back there."""
        residents = tuple(sorted(gpu.residents))
        max_loaded = gpu.residency.max_loaded
        return cls(gpu.name, residents, gpu.running.busy, gpu.slots_in_effect, GpuState.of(gpu), max_loaded,
                   _models_of(gpu), held_back, gpu.blocked,
                   max_loaded > 1 or len(residents) > 1)

    @classmethod
    def configured(cls, name: str, slots: int, max_loaded: int = 1) -> GpuProjection:
        """A GPU as its configuration describes it before anything is known of it: idle, none resident."""
        return cls(name, (), 0, slots, max_loaded=max_loaded, per_model=max_loaded > 1)


def _models_of(gpu: GpuHolding) -> tuple[ModelProjection, ...]:
    """Each resident model of a GPU, and any model running there while not known resident, by name."""
    running = gpu.running
    named = set(gpu.residents)
    if running.models is not None:
        named.update(running.models)
    elif running.model is not None:
        named.add(running.model)
    loading = gpu.loading[0] if gpu.loading is not None else None
    pinned = gpu.residency.pinned
    return tuple(ModelProjection(model, busy_of(gpu, model)[0], gpu.slots.of(model), model in pinned,
                                 model == loading) for model in sorted(named))


@dataclasses.dataclass(frozen=True, slots=True)
class NodeProjection:
    """Every GPU in the configured order, and the node they make (with one GPU, its own)."""

    gpus: tuple[GpuProjection, ...]
    gpu: GpuState  # what holds the node (`GpuState.of_node`)
    resident_models: tuple[str, ...]  # every GPU's, each once, in the configured order (each one's sorted)
    slots_busy: int  # running grants, over every GPU
    slots_total: int  # the slots in effect, summed over every GPU
    # A line per GPU: there are several, or one is shown model by model.
    per_gpu: bool

    @classmethod
    def of(cls, gpus: Sequence[GpuProjection]) -> NodeProjection:
        residents = tuple(dict.fromkeys(model for gpu in gpus for model in gpu.resident_models))
        return cls(tuple(gpus), GpuState.of_node([gpu.state for gpu in gpus]), residents,
                   sum(gpu.slots_busy for gpu in gpus), sum(gpu.slots for gpu in gpus),
                   len(gpus) > 1 or any(gpu.per_model for gpu in gpus))

    @property
    def busy(self) -> bool:
        """A grant, a settle or an adopted exchange holds a GPU."""
        return any(gpu.slots_busy or gpu.blocked for gpu in self.gpus)

    def document(self) -> dict[str, Any]:
        """The node's fields of GET /queue and the page's state (``gpus`` each GPU's)."""
        return document_of(self)


def document_of(value: Any) -> dict[str, Any]:
    """A projection as JSON: each field of the dataclass by its name (tuples as lists, the
    projections within as documents, a state as its word)."""
    return {field.name: _json(getattr(value, field.name)) for field in dataclasses.fields(value)}


def _json(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_json(item) for item in value]
    if isinstance(value, enum.Enum):
        return value.value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return document_of(value)
    return value


class Projector:
    """Builds the node's projection, keeping each GPU's while what holds it (the same
    `GpuHolding` value: the scheduler keeps it while nothing changes) and its held-back model
    stay: the gauges ask after every change of the queue."""

    def __init__(self) -> None:
        self._last: dict[str, tuple[GpuHolding, str | None, GpuProjection]] = {}
        self._node: NodeProjection | None = None

    def node(self, holdings: Sequence[GpuHolding], held_back: Mapping[str, str | None]) -> NodeProjection:
        gpus = tuple(self._gpu(holding, held_back.get(holding.name)) for holding in holdings)
        node = self._node
        if node is None or len(node.gpus) != len(gpus) or any(a is not b for a, b in zip(node.gpus, gpus)):
            node = self._node = NodeProjection.of(gpus)
        return node

    def _gpu(self, holding: GpuHolding, held_back: str | None) -> GpuProjection:
        last = self._last.get(holding.name)
        if last is not None and last[0] is holding and last[1] == held_back:
            return last[2]
        gpu = GpuProjection.of(holding, held_back)
        self._last[holding.name] = (holding, held_back, gpu)
        return gpu
