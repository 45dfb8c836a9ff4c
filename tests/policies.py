"""Scheduler policies for tests, with the configuration's defaults spelled out once here."""

from __future__ import annotations

from collections.abc import Mapping

from llamaswap.config import Config
from llamaswap.core import Policy, Slots

_DEFAULTS = Config().policy()


def serial(aging_divisor_s: float = _DEFAULTS.aging_divisor_s, swap_affinity_bonus: int = _DEFAULTS.swap_affinity_bonus,
           *, max_queued: int = 0, max_wait_s: float = 0.0, slots: Slots | None = None) -> Policy:
    return Policy.serial(aging_divisor_s=aging_divisor_s, swap_affinity_bonus=swap_affinity_bonus,
                         max_queued=max_queued, max_wait_s=max_wait_s, slots=slots)


def fifo(model_priorities: Mapping[str, int] | None = None, *, max_queued: int = 0, max_wait_s: float = 0.0,
         slots: Slots | None = None) -> Policy:
    return Policy.fifo(model_priorities=dict(model_priorities or {}), max_queued=max_queued, max_wait_s=max_wait_s,
                       slots=slots)
