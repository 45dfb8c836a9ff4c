"""The asyncio adapter around the pure core: waiters, wake-ups, deadlines, reload."""

from llamaswap.runtime.coordinator import Admission, Coordinator, Rejected, Ticket, TicketState

__all__ = ["Admission", "Coordinator", "Rejected", "Ticket", "TicketState"]
