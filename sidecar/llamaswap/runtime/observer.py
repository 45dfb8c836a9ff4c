"""What the runtime tells the outside world; telemetry implements it, tests record it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from llamaswap.core import Outcome
    from llamaswap.core.scheduler import Decision
    from llamaswap.runtime.coordinator import Ticket


class Observer(Protocol):
    def enqueued(self, ticket: "Ticket", queue_depth: int) -> None: ...

    def dispatched(self, ticket: "Ticket", decision: "Decision") -> None: ...

    def finished(self, ticket: "Ticket", outcome: "Outcome") -> None:
        """Called exactly once per admitted ticket, however it ended."""

    def watchdog_fired(self, ticket: "Ticket") -> None: ...


class NoopObserver:
    def enqueued(self, ticket: "Ticket", queue_depth: int) -> None:
        pass

    def dispatched(self, ticket: "Ticket", decision: "Decision") -> None:
        pass

    def finished(self, ticket: "Ticket", outcome: "Outcome") -> None:
        pass

    def watchdog_fired(self, ticket: "Ticket") -> None:
        pass


class FanOut:
    """Several observers behind one; a failing observer never breaks scheduling."""

    def __init__(self, *observers: Observer) -> None:
        self._observers = observers

    def _each(self, method: str, *args: object) -> None:
        import logging

        for observer in self._observers:
            try:
                getattr(observer, method)(*args)
            except Exception:  # noqa: BLE001 - telemetry must not take the scheduler down
                logging.getLogger(__name__).exception("observer %s.%s failed", type(observer).__name__, method)

    def enqueued(self, ticket: "Ticket", queue_depth: int) -> None:
        self._each("enqueued", ticket, queue_depth)

    def dispatched(self, ticket: "Ticket", decision: "Decision") -> None:
        self._each("dispatched", ticket, decision)

    def finished(self, ticket: "Ticket", outcome: "Outcome") -> None:
        self._each("finished", ticket, outcome)

    def watchdog_fired(self, ticket: "Ticket") -> None:
        self._each("watchdog_fired", ticket)
