"""The pure scheduling core.

Nothing in this package performs I/O, touches asyncio, gRPC or OpenTelemetry, or reads a
clock of its own: time arrives through the :class:`Clock` protocol. That keeps every
decision reproducible in tests and in simulation (`llamaswap simulate` replays recorded
traffic through this very code). `tests/test_core_imports.py` enforces the rule.
"""

from llamaswap.core.clock import Clock, ManualClock, MonotonicClock
from llamaswap.core.estimate import Estimator
from llamaswap.core.outcome import Outcome
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
from llamaswap.core.scheduler import (
    NS_PER_S,
    Decision,
    InvalidSlots,
    Policy,
    PolicyName,
    QueueFull,
    Queued,
    QueueSnapshot,
    Released,
    Removed,
    ReorderCause,
    RunningView,
    Scheduler,
    SchedulerError,
    Slots,
    UnknownRequest,
    WaitingView,
)

__all__ = [
    "BAND_NAMES",
    "NS_PER_S",
    "Band",
    "Clock",
    "Decision",
    "Estimator",
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
    "band_of",
    "parse_priority",
]
