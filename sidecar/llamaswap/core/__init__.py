"""The pure scheduling core.

Nothing in this package performs I/O, touches asyncio, gRPC or OpenTelemetry, or reads a
clock of its own: time arrives through the :class:`Clock` protocol. That keeps every
decision reproducible in tests and in simulation.
"""

from llamaswap.core.clock import Clock, ManualClock, MonotonicClock
from llamaswap.core.outcome import Outcome
from llamaswap.core.priority import (
    BAND_NAMES,
    Band,
    Priority,
    PriorityPolicy,
    PrioritySource,
    band_of,
    parse_priority,
)
from llamaswap.core.scheduler import (
    Decision,
    Policy,
    QueueFull,
    QueueSnapshot,
    Scheduler,
    SchedulerError,
    UnknownRequest,
    WaitingView,
    RunningView,
)

__all__ = [
    "BAND_NAMES",
    "Band",
    "Clock",
    "Decision",
    "ManualClock",
    "MonotonicClock",
    "Outcome",
    "Policy",
    "Priority",
    "PriorityPolicy",
    "PrioritySource",
    "QueueFull",
    "QueueSnapshot",
    "RunningView",
    "Scheduler",
    "SchedulerError",
    "UnknownRequest",
    "WaitingView",
    "band_of",
    "parse_priority",
]
