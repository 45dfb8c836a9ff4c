"""The asyncio adapter around the pure core: tickets, waiters, leases, settles, estimates, reload.

- `coordinator`: builds the parts and is what the adapters call (the invariants); `admission`:
  admit and refuse, the waiting side; `grants`: pump, grant, release, finish, the running side;
  `publishing`: the change counter, the gauges' picture, the observers after the step;
- `leases`: the running grant, the adopted exchanges, the lapsed grants kept and their timer;
- `settle`: the settle loop (waiting for the upstream to compute nothing);
- `catalog`: the model catalog checks (upstream.modelCheck);
- `views`: the queue view and one client's status;
- `gpu_projection`: each GPU and the node as /queue, the page, the CLI and the gauges read them; `GpuState`;
- `ticket`, `observer`, `activity`, `upstream`: a request's state, the observer port and the
  activity log, the upstream port.

The coordinator uses two ports: `Observer` (telemetry, the activity log) and `Upstream` (what
the upstream serves and whether it is still computing); the adapters call it.
"""

from llamaswap.runtime.coordinator import Admission, Coordinator, Refusal
from llamaswap.runtime.ticket import Arrival, ExchangeEnd, ExchangeReport, Ticket, TicketState
from llamaswap.runtime.gpu_projection import GpuState
from llamaswap.runtime.views import QueueView

__all__ = ["Admission", "Arrival", "Coordinator", "ExchangeEnd", "ExchangeReport", "GpuState", "QueueView", "Refusal",
           "Ticket", "TicketState"]
