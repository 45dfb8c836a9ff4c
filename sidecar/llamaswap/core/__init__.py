"""The pure scheduling core.

Nothing in this package performs I/O, touches asyncio, gRPC or OpenTelemetry, or reads a
clock of its own: time arrives through the :class:`Clock` protocol. That keeps every
decision reproducible in tests and in simulation (`llamaswap simulate` replays recorded
traffic through this very code). `tests/test_core_imports.py` enforces the rule.
"""

from llamaswap.core.clock import Clock, ManualClock, MonotonicClock
from llamaswap.core.estimate import NO_MODEL, Estimator
from llamaswap.core.outcome import (
    SHUTDOWN_RETRY_AFTER_S,
    ExchangeEnd,
    Outcome,
    abandons,
    exchange_outcome,
    model_stays_loaded,
)
from llamaswap.core.priority import (
    BAND_NAMES,
    Band,
    Priority,
    PriorityMode,
    PriorityPolicy,
    PrioritySource,
    band_of,
    parse_priority,
)
from llamaswap.core.clock import NS_PER_S
from llamaswap.core.decisions import (
    Decision,
    Queued,
    QueueSnapshot,
    Released,
    Removed,
    ReorderCause,
    RunningView,
    WaitingView,
)
from llamaswap.core.eviction import EvictReason, Eviction
from llamaswap.core.errors import InvalidSlots, QueueFull, SchedulerError, UnknownRequest
from llamaswap.core.policy import GpuPolicy, Policy, PolicyName
from llamaswap.core.residency import Residency
from llamaswap.core.scheduler import Scheduler
from llamaswap.core.slots import Slots

__all__ = [
    "EvictReason",
    "Eviction",
    "GpuPolicy",
    "Residency",
    "BAND_NAMES",
    "NO_MODEL",
    "NS_PER_S",
    "SHUTDOWN_RETRY_AFTER_S",
    "Band",
    "Clock",
    "Decision",
    "Estimator",
    "ExchangeEnd",
    "InvalidSlots",
    "ManualClock",
    "MonotonicClock",
    "Outcome",
    "Policy",
    "PolicyName",
    "Priority",
    "PriorityMode",
    "PriorityPolicy",
    "PrioritySource",
    "QueueFull",
    "QueueSnapshot",
    "Queued",
    "Released",
    "Removed",
    "ReorderCause",
    "RunningView",
    "Scheduler",
    "SchedulerError",
    "Slots",
    "UnknownRequest",
    "WaitingView",
    "abandons",
    "band_of",
    "exchange_outcome",
    "model_stays_loaded",
    "parse_priority",
]
