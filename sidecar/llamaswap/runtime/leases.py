"""The leases: the running grants' deadlines, the adopted exchanges, what must be remembered of finished
grants, and the one timer that watches their deadlines.

A grant is a lease: Envoy's periodic access-log entries renew it, and unrenewed for
envoy.leaseSeconds it lapses. An exchange Envoy reports that this process does not hold (an
earlier sidecar process granted it, or its lease lapsed) is adopted: the GPU is busy with it
until it ends, is no longer reported, or outlives routing.scheduler.maxRunSeconds.

Which process issued a token is in the token (its epoch, `ticket.Tokens`): a late entry for a
grant of ours that finished needs no memory. Only what decides something is remembered: our
grants released while they may still run (lease lapsed, Envoy connection gone), and earlier
processes' exchanges the watchdog let go. Both are rare, and both memories are bounded.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
from collections.abc import Callable, Sequence

from llamaswap.core import NS_PER_S, Clock
from llamaswap.runtime.ticket import Ticket

# Grants of ours released while they may still run, kept until their final entry, until the
# watchdog would let them go anyway (maxRunSeconds after the grant), or past this many.
LAPSED_MEMORY = 4096
# Earlier processes' exchanges the watchdog let go; needed only when Envoy's entries carry no
# start time (they do: the next entry is past maxRunSeconds by itself).
LET_GO_MEMORY = 4096


@dataclasses.dataclass(slots=True)
class Adoption:
    """An exchange this process holds by lease without a ticket for it."""

    adopted_ns: int
    started_ns: int  # the exchange's start: our grant, Envoy's start_time, or else the adoption
    lease_deadline_ns: int
    ours: bool  # a grant of this process whose lease lapsed (or whose Envoy connection went)
    gpu: str  # the GPU it holds: our grant's, else the one Envoy's entry names (`Gpus.reported`)


@dataclasses.dataclass(frozen=True, slots=True)
class Adoptable:
    """An exchange to adopt: when it started, and the GPU it holds where this process knows it
    (a lapsed grant of ours: its grant's; None: an earlier process's, placed by Envoy's entry)."""

    started_ns: int
    gpu: str | None


class Leases:
    """What holds the GPU by lease. `due` runs when the earliest deadline passes (the coordinator
    decides what a lapse means); `running` lists the running grants' tickets, earliest first (the
    scheduler's grants are the record of what runs: the leases only watch their deadlines);
    `max_run_ns` reads routing.scheduler.maxRunSeconds (0: off); `adopted`: the node's adopted
    exchanges by token, the one record of them (each GPU reads its own from it: `Gpu.adoptions`)."""

    def __init__(self, clock: Clock, due: Callable[[], None], running: Callable[[], Sequence[Ticket]],
                 max_run_ns: Callable[[], int] = lambda: 0, *, adopted: dict[str, Adoption] | None = None) -> None:
        self._clock = clock
        self._due = due
        self._running = running
        self._max_run_ns = max_run_ns
        self.adopted: dict[str, Adoption] = {} if adopted is None else adopted
        # token -> (granted_ns, the GPU it was granted)
        self._lapsed: collections.OrderedDict[str, tuple[int, str]] = collections.OrderedDict()
        self._let_go: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_ns = 0  # the deadline it is armed for

    # -- what is remembered ----------------------------------------------------------------

    def remember_lapsed(self, token: str, granted_ns: int, gpu: str) -> None:
        """A grant of ours (on ``gpu``) was released while its exchange may still run."""
        self._lapsed[token] = (granted_ns, gpu)
        while self._lapsed and (len(self._lapsed) > LAPSED_MEMORY
                                or self._overrun(next(iter(self._lapsed.values()))[0])):
            self._lapsed.popitem(last=False)

    def lapsed_grant(self, token: str) -> tuple[int, str] | None:
        """When a lapsed grant of ours was granted (ns) and on which GPU, if it may still run;
        None for every other grant of ours (it finished, or the watchdog would let it go by now)."""
        lapsed = self._lapsed.get(token)
        if lapsed is not None and self._overrun(lapsed[0]):
            del self._lapsed[token]
            return None
        return lapsed

    def forget_lapsed(self, token: str) -> None:
        self._lapsed.pop(token, None)

    def let_go(self, token: str) -> None:
        """An earlier process's exchange the watchdog let go: never adopt it again."""
        self._let_go[token] = None
        while len(self._let_go) > LET_GO_MEMORY:
            self._let_go.popitem(last=False)

    def was_let_go(self, token: str) -> bool:
        return token in self._let_go

    def _overrun(self, started_ns: int) -> bool:
        max_run_ns = self._max_run_ns()
        return max_run_ns > 0 and self._clock.now_ns() >= started_ns + max_run_ns

    # -- adopted exchanges -----------------------------------------------------------------

    def adopt(self, token: str, lease_ns: int, *, started_ns: int, ours: bool, gpu: str) -> Adoption:
        now = self._clock.now_ns()
        adoption = self.adopted[token] = Adoption(now, started_ns, now + lease_ns, ours, gpu)
        return adoption

    def renew_adopted(self, token: str, lease_ns: int) -> None:
        self.adopted[token].lease_deadline_ns = self._clock.now_ns() + lease_ns

    def end_adopted(self, token: str) -> Adoption:
        """Forget an adopted exchange (what was known of it)."""
        return self.adopted.pop(token)

    def lapsed_adopted(self) -> list[str]:
        """The adopted exchanges whose lease has passed."""
        now = self._clock.now_ns()
        return [token for token, adoption in self.adopted.items() if now >= adoption.lease_deadline_ns]

    def overrun_adopted(self) -> list[str]:
        """The adopted exchanges older than routing.scheduler.maxRunSeconds (the watchdog's)."""
        return [token for token, adoption in self.adopted.items() if self._overrun(adoption.started_ns)]

    def to_adopt(self, token: str, *, ours: bool, final: bool, elapsed_s: float | None,
                 now_ns: int) -> Adoptable | None:
        """An entry for an exchange this process does not hold: when it started (and, if ours, on
        which GPU), if it is to be adopted; None if nothing runs for it. A grant of ours that is
        not live finished (served, failed, let go by the watchdog, cut off at shutdown), unless it
        was released while it could still run (`remember_lapsed`); one let go on purpose stays
        let go; one past maxRunSeconds would be let go by the watchdog at once."""
        gpu: str | None = None
        if ours:
            lapsed = self.lapsed_grant(token)
            if lapsed is None:
                return None
            if final:
                self.forget_lapsed(token)
                return None
            started_ns, gpu = lapsed
        else:
            if final or self.was_let_go(token):
                return None
            started_ns = now_ns if elapsed_s is None else now_ns - round(elapsed_s * NS_PER_S)
        return None if self.past_max_run(started_ns) else Adoptable(started_ns, gpu)

    def past_max_run(self, started_ns: int) -> bool:
        """An exchange started then is older than maxRunSeconds: the watchdog lets it go."""
        return self._overrun(started_ns)

    # -- the running grants ----------------------------------------------------------------

    def lapsed_running(self) -> list[Ticket]:
        """The running grants whose lease has passed, earliest granted first."""
        now = self._clock.now_ns()
        return [ticket for ticket in self._running() if now >= ticket.lease_deadline_ns]

    # -- the one timer ---------------------------------------------------------------------

    def arm(self) -> None:
        """One timer for the leases (every running grant's and the adopted ones) and the adopted
        exchanges' watchdog, at the earliest. A timer already armed no later than that stays: it
        fires, finds nothing due yet and arms for the earliest then (`_fire`), so a grant and its
        release cost no timer of their own while another is armed."""
        deadline_ns = self._earliest_ns()
        if deadline_ns is None or (self._timer is not None and self._timer_ns <= deadline_ns):
            return
        self.cancel()
        self._set(deadline_ns)

    def granted(self, deadline_ns: int) -> None:
        """A grant's lease began, due at ``deadline_ns``: `arm`, without reading every deadline where
        a timer is armed no later than this one (it is no later than the others already)."""
        if self._timer is None or self._timer_ns > deadline_ns:
            self.arm()

    def released(self) -> None:
        """A grant's lease ended: a timer armed stays (no deadline came earlier); with none armed,
        `arm` for what is left (none is, while every deadline's timer is armed as it begins)."""
        if self._timer is None:
            self.arm()

    def _earliest_ns(self) -> int | None:
        deadlines = [adoption.lease_deadline_ns for adoption in self.adopted.values()]
        max_run_ns = self._max_run_ns()
        if max_run_ns > 0:
            deadlines.extend(adoption.started_ns + max_run_ns for adoption in self.adopted.values())
        deadlines.extend(ticket.lease_deadline_ns for ticket in self._running())
        return min(deadlines) if deadlines else None

    def _set(self, deadline_ns: int) -> None:
        delay_s = max(0.0, (deadline_ns - self._clock.now_ns()) / NS_PER_S)
        self._timer = asyncio.get_running_loop().call_later(delay_s, self._fire)
        self._timer_ns = deadline_ns

    def _fire(self) -> None:
        """`due` runs when the earliest deadline has passed, only then: a timer armed for a grant
        since released, or for a lease since renewed, arms for the earliest deadline now, if any."""
        self._timer = None
        deadline_ns = self._earliest_ns()
        if deadline_ns is None:
            return
        if deadline_ns > self._clock.now_ns():
            self._set(deadline_ns)
            return
        self._due()

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
