"""How requests are ordered: the policy (serial or fifo) and its settings. Settings come from the
configuration (`llamaswap.config`); the core holds no defaults of its own."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping

from llamaswap.core.clock import NS_PER_S
from llamaswap.core.residency import ONE_MODEL, Residency, may_serve
from llamaswap.core.slots import Slots


class PolicyName(str, enum.Enum):
    SERIAL = "serial"  # priority + swap affinity + aging
    FIFO = "fifo"  # the model's configured priority + the header, then arrival

    def __str__(self) -> str:
        return self.value


_FIFO = PolicyName.FIFO


@dataclasses.dataclass(frozen=True, slots=True)
class GpuPolicy:
    """One GPU of the node as the policy describes it: its name, its slots (with the
    node's reserved slots), the models it may serve (None: any), and how many models may be
    resident there at once (`residency.Residency`: ``maxLoaded``, ``memory``, pinned models)."""

    name: str
    slots: Slots = dataclasses.field(default_factory=Slots)
    models: frozenset[str] | None = None
    residency: Residency = ONE_MODEL

    def may_serve(self, model: str | None) -> bool:
        """`residency.may_serve` for this GPU."""
        return may_serve(self.models, self.residency, model)


# The name of the one GPU of a configuration that lists none (`upstream:` alone): the configuration
# builds it (`Config.gpu_entries`), Envoy names its cluster after it, and a policy of one
# GPU built without a configuration has it.
IMPLICIT_GPU = "gpu0"


@dataclasses.dataclass(frozen=True, slots=True)
class Policy:
    """How requests are ordered over the node's GPUs (one GPU is a node of one). Build with
    :meth:`serial` or :meth:`fifo`; the defaults of every setting live in the configuration
    (`llamaswap.config`), not here."""

    name: PolicyName
    aging_divisor_s: float
    swap_affinity_bonus: int
    # fifo only: the model's configured priority is added to the header's.
    model_priorities: Mapping[str, int]
    max_queued: int  # 0: unlimited
    max_wait_s: float  # 0: wait forever
    # The node's GPUs, in the configured order, one queue over them: each one's slots, the models
    # it may serve and its residency. Never empty; by default one, IMPLICIT_GPU, one grant at a time.
    gpus: tuple[GpuPolicy, ...] = (GpuPolicy(IMPLICIT_GPU),)
    # A resumed stoppable grant (a Batch API line sent again after a stop: `preemption.py`) runs at
    # least this long before it is stopped again for a higher band.
    stop_min_run_s: float = 0.0

    def __post_init__(self) -> None:
        names = [gpu.name for gpu in self.gpus]
        if not names or len(set(names)) != len(names):
            raise ValueError(f"a policy needs one GPU or more, each named once, got {names}")

    @classmethod
    def serial(cls, *, aging_divisor_s: float, swap_affinity_bonus: int, max_queued: int = 0,
               max_wait_s: float = 0.0, slots: Slots | None = None, stop_min_run_s: float = 0.0) -> Policy:
        """``slots``: a node of one GPU (IMPLICIT_GPU) with these slots (`with_gpus` for others)."""
        return cls(PolicyName.SERIAL, aging_divisor_s, swap_affinity_bonus, {}, max_queued, max_wait_s,
                   _one_gpu(slots), stop_min_run_s)

    @classmethod
    def fifo(cls, *, model_priorities: Mapping[str, int], max_queued: int = 0, max_wait_s: float = 0.0,
             slots: Slots | None = None, stop_min_run_s: float = 0.0) -> Policy:
        """``slots``: as for `serial`."""
        return cls(PolicyName.FIFO, 0.0, 0, dict(model_priorities), max_queued, max_wait_s, _one_gpu(slots),
                   stop_min_run_s)

    def with_gpus(self, gpus: tuple[GpuPolicy, ...]) -> Policy:
        """This policy's order over these GPUs."""
        return dataclasses.replace(self, gpus=gpus)

    def gpu(self, name: str) -> GpuPolicy:
        """The GPU named ``name``; KeyError for a name it does not have."""
        for gpu in self.gpus:
            if gpu.name == name:
                return gpu
        raise KeyError(f"no GPU named {name!r}")

    @property
    def reserves_slots(self) -> bool:
        """Some GPU keeps slots for the interactive band (routing...reservedSlots)."""
        return any(gpu.slots.reserved for gpu in self.gpus)

    @property
    def aging_divisor_ns(self) -> int:
        return round(self.aging_divisor_s * NS_PER_S)

    @property
    def aging_per_s(self) -> float:
        """How fast a waiting request's aging term grows: points per second waited (0: no aging)."""
        divisor = self.aging_divisor_ns
        return NS_PER_S / divisor if divisor else 0.0

    @property
    def stop_min_run_ns(self) -> int:
        return round(self.stop_min_run_s * NS_PER_S)

    @property
    def max_wait_ns(self) -> int:
        return round(self.max_wait_s * NS_PER_S)

    def base_priority(self, priority: int, model: str | None) -> int:
        if self.name is _FIFO and model is not None:  # (a global: `priority._INTERACTIVE`'s note)
            return priority + self.model_priorities.get(model, 0)
        return priority


def _one_gpu(slots: Slots | None) -> tuple[GpuPolicy, ...]:
    return (GpuPolicy(IMPLICIT_GPU, slots if slots is not None else Slots()),)
