"""The live tickets by the client's x-request-id (the public status route finds a request by it)."""

from __future__ import annotations

from llamaswap.runtime.ticket import Ticket


class RequestIds:
    """The live ticket a request id names: the first of those that carry it (a client may reuse
    an id; a later arrival must not hide the earlier one's status), the later ones in arrival
    order, each named in its turn."""

    def __init__(self) -> None:
        self.first: dict[str, Ticket] = {}  # what the id names now
        self._later: dict[str, list[Ticket]] = {}

    def add(self, ticket: Ticket) -> None:
        if self.first.setdefault(ticket.request_id, ticket) is not ticket:
            self._later.setdefault(ticket.request_id, []).append(ticket)

    def forget(self, ticket: Ticket) -> None:
        """A finished ticket leaves the index; the next live one with its id takes its place."""
        request_id = ticket.request_id
        later = self._later.get(request_id)
        if self.first.get(request_id) is ticket:
            if later:
                self.first[request_id] = later.pop(0)
            else:
                del self.first[request_id]
        elif later and ticket in later:
            later.remove(ticket)
        if later is not None and not later:
            del self._later[request_id]
