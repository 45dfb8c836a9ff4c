"""What holds each GPU now, read after the scheduler is told what the runtime knows of it (a
settle or an adoption may have just changed: `Gpus.tell`)."""

from __future__ import annotations

from llamaswap.core import Scheduler
from llamaswap.core.holding import GpuHolding
from llamaswap.runtime.gpus import Gpus


class Holdings:
    def __init__(self, gpus: Gpus, scheduler: Scheduler) -> None:
        self._gpus = gpus
        self._scheduler = scheduler

    def all(self) -> tuple[GpuHolding, ...]:
        """What holds each GPU, the scheduler told first (`Gpus.tell`: a settle or adoption may have just changed)."""
        self._gpus.tell(self._scheduler)
        return self._scheduler.holdings()

    def of(self, gpu: str) -> GpuHolding:
        return next(holding for holding in self.all() if holding.name == gpu)
