"""What holds each GPU now: the scheduler's record (`Scheduler.holdings`), which the runtime told
of each settle and adoption as it began and ended (`Adoptions`); reading syncs nothing."""

from __future__ import annotations

from llamaswap.core import Scheduler
from llamaswap.core.holding import GpuHolding


class Holdings:
    def __init__(self, scheduler: Scheduler) -> None:
        self._scheduler = scheduler

    def all(self) -> tuple[GpuHolding, ...]:
        """What holds each GPU, in the configured order."""
        return self._scheduler.holdings()

    def of(self, gpu: str) -> GpuHolding:
        return next(holding for holding in self.all() if holding.name == gpu)
