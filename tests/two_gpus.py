"""A node of two upstreams without a coordinator: a Scheduler built with `Policy.with_gpus`, its
grants made by the node rule, and the views and observers fed the way the coordinator feeds
them (tickets, the published picture with every upstream). For the tests of what people see
(`/queue`, `llamaswap queue`, the metrics, spans, the activity record and the page's documents)
while the coordinator is being made per-upstream.
"""

from __future__ import annotations

from collections.abc import Sequence

from llamaswap.core import Estimator, ManualClock, Outcome, Priority, PrioritySource, Scheduler, Slots
from llamaswap.core.policy import GpuPolicy
from llamaswap.runtime.observer import Observer, QueuePicture, queue_picture
from llamaswap.runtime.ticket import Arrival, Ticket, TicketState
from llamaswap.runtime.views import QueueView, QueueViews
from policies import serial


class TwoGpus:
    """`big` (two slots) and `small` (one), in that order; one queue over both."""

    def __init__(self, observers: Sequence[Observer] = (), *, clock: ManualClock | None = None,
                 trace_parent: str | None = None) -> None:
        self.clock = clock or ManualClock()
        self.policy = serial(aging_divisor_s=0.0).with_gpus(
            (GpuPolicy("big", Slots(2)), GpuPolicy("small", Slots(1))))
        self.scheduler = Scheduler(self.policy, self.clock)
        self.estimator = Estimator(default_run_s=10.0, default_swap_s=5.0, samples=5)
        self.tickets: dict[str, Ticket] = {}
        self.by_request_id: dict[str, Ticket] = {}
        self.version = 0
        self.observers = list(observers)
        self.trace_parent = trace_parent
        self.views = QueueViews(self.scheduler, self.estimator, self.clock, self.tickets, self.by_request_id,
                                version=lambda: self.version, blocked=dict)
        for observer in self.observers:
            observer.settings_changed(self.policy)
        self.publish()

    def view(self) -> QueueView:
        return self.views.view()

    def arrive(self, request_id: str, model: str, priority: int = 0) -> Ticket:
        """A request joins the queue (granted only by `grant`)."""
        arrival = Arrival(request_id, None, None, model, "peer", self.trace_parent, None)
        ticket = Ticket(f"token-{request_id}", arrival, Priority(priority, PrioritySource.NUMBER),
                        self.clock.now_ns())
        self.scheduler.enqueue(ticket.token, ticket.priority, model)
        self.tickets[ticket.token] = ticket
        self.by_request_id[request_id] = ticket
        for observer in self.observers:
            observer.enqueued(ticket)
        self._changed()
        return ticket

    def grant(self) -> dict[str, str]:
        """Every grant the node rule makes now: request id -> the upstream it runs on."""
        granted = {}
        while (decision := self.scheduler.next()) is not None:
            ticket = self.tickets[decision.request_id]
            ticket.decision = decision
            ticket.state = TicketState.RUNNING
            granted[ticket.request_id] = decision.gpu
            for observer in self.observers:
                observer.dispatched(ticket, ())
        self._changed()
        return granted

    def finish(self, ticket: Ticket, outcome: Outcome = Outcome.SERVED) -> None:
        self.scheduler.release(ticket.token)
        ticket.state = TicketState.DONE
        ticket.outcome = outcome
        ticket.response_status = 200
        ticket.finished_ns = self.clock.now_ns()
        del self.tickets[ticket.token]
        del self.by_request_id[ticket.request_id]
        for observer in self.observers:
            observer.finished(ticket)
        self._changed()

    def advance(self, seconds: float) -> None:
        self.clock.advance(seconds)

    def picture(self) -> QueuePicture:
        """The gauges' picture as the coordinator publishes it, with every upstream."""
        return queue_picture(self.scheduler, self.views.gpus())

    def publish(self) -> None:
        picture = self.picture()
        for observer in self.observers:
            observer.queue_changed(picture)

    def _changed(self) -> None:
        self.version += 1
        self.publish()

    @property
    def coordinator(self) -> _Coordinator:
        """What the page's documents (`adapters/ui.py`) ask of a coordinator, over this node."""
        return _Coordinator(self)


class _Coordinator:
    def __init__(self, node: TwoGpus) -> None:
        self._node = node
        self.scheduler = node.scheduler
        self.clock = node.clock
        self.status_of = node.views.status_of

    @property
    def version(self) -> int:
        return self._node.version

    def view(self) -> QueueView:
        return self._node.view()
