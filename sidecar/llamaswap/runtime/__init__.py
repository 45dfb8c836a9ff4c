"""The asyncio adapter around the pure core: tickets, waiters, leases, settles, estimates, reload.

The coordinator uses two ports: `Observer` (telemetry, the activity log) and `Upstream` (what
the upstream serves and whether it is still computing); the adapters call it.
"""

from llamaswap.runtime.coordinator import Admission, Coordinator, QueueView, Refusal
from llamaswap.runtime.ticket import Arrival, ExchangeEnd, ExchangeReport, Ticket, TicketState

__all__ = ["Admission", "Arrival", "Coordinator", "ExchangeEnd", "ExchangeReport", "QueueView", "Refusal", "Ticket",
           "TicketState"]
