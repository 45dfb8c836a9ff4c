"""The one in-memory fake transport: a real Coordinator on a virtual-time event loop.

What it is:
- a real `Coordinator` built from a real `parse_config(...)` configuration, with
  `observe_after_grant=False` so observers run synchronously and each step can be read at once;
- a `FakeUpstream` (the `Upstream` port of `runtime/upstream.py`): a catalog to return, a busy
  flag the test flips, a stop result, and a log of every call;
- a `Recorder` observer that keeps every event the coordinator emits; further observers
  (Telemetry, ActivityLog) are called after it, and their exceptions are NOT swallowed;
- the transport's three calls, made the way the servicers make them: `admit(Arrival)` as a task
  (the held Check), `report(token, ExchangeReport)` (periodic: `final=False`; the end:
  `final=True` with an `ExchangeEnd` and a status), and `peer_gone(peer)`.

Time. The coordinator reads time from its injected Clock but arms asyncio timers
(`loop.call_later`) in loop seconds for leases, the watchdog, maxWaitSeconds, the estimate batch
and its settle polls (`asyncio.sleep`). To keep both on one timeline, the test runs on
`VirtualTimeLoop`, an event loop whose `time()` IS the `ManualClock`: a timer armed for 3 s
fires when, and only when, the test has moved the clock 3 s. `Flow.advance(s)` walks the clock
forward timer by timer (each timer runs with the clock reading exactly its due time), letting
the loop run everything that becomes ready at each step; `Flow.idle()` runs what is ready
without moving time. Nothing sleeps for real: the loop's selector refuses to block while a
test runs (a test that awaits something only time could bring fails at once with `Stalled`,
instead of hanging), so every wait is exact and every run deterministic.

Tests that use a Flow are `async def` functions decorated with `@virtual_time`, which runs
them on a fresh VirtualTimeLoop (instead of pytest-asyncio's loop); pytest fixtures still work.

The loop reads the base event loop's `_ready` and `_scheduled` (CPython's asyncio internals,
stable since 3.4) to know whether anything is runnable and when the next timer is due.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import selectors
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

from google.protobuf import struct_pb2
from llamaswap._proto.envoy.service.auth.v3 import external_auth_pb2 as authz_pb2
from llamaswap.config import Config, parse_config
from llamaswap.core import ManualClock, Outcome, Policy
from llamaswap.runtime.coordinator import Coordinator, Refusal
from llamaswap.runtime.kept import KeptEvent
from llamaswap.runtime.observer import IdleUnloaded, Observer, Overtaken, PictureSource, QueuePicture, Settle
from llamaswap.runtime.stops import Lines
from llamaswap.runtime.ticket import Arrival, ExchangeEnd, ExchangeReport, Ticket
from llamaswap.runtime.upstream import Catalog, UpstreamKind, UpstreamUnanswered
from llamaswap.adapters.ext_authz import Authorization

NS_PER_S = 1_000_000_000
START_NS = 1_000 * NS_PER_S  # the clock starts at 1000 s: no time is ever 0 by accident
PEER = "ipv4:127.0.0.1:40001"
# Enough for any scenario here; more means something re-arms itself without end.
_MAX_TURNS = 100_000


# -- virtual time ----------------------------------------------------------------------------


class Stalled(RuntimeError):
    """The test awaited something that only the passing of time could bring."""


class _NonBlockingSelector(selectors.DefaultSelector):
    """Polls, never waits, while `strict`: real time must not pass during a test."""

    def __init__(self) -> None:
        super().__init__()
        self.strict = True
        self.next_timer: Callable[[], float | None] = lambda: None

    def select(self, timeout: float | None = None) -> list[Any]:
        if not self.strict or timeout == 0:
            return super().select(timeout)
        events = super().select(0)
        if events:
            return events
        when = self.next_timer()
        raise Stalled("the event loop would wait for real time with nothing to run "
                      f"(next timer at {when!r} s of virtual time): drive the clock with Flow.advance()")


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop whose clock is a ManualClock: timers fire when the test moves the clock."""

    def __init__(self, clock: ManualClock | None = None) -> None:
        self._selector_guard = _NonBlockingSelector()
        super().__init__(self._selector_guard)
        self.clock = clock or ManualClock(START_NS)
        self._selector_guard.next_timer = self.next_timer_s

    def time(self) -> float:
        return self.clock.now_ns() / NS_PER_S

    def allow_blocking(self) -> None:
        """After the test: the runner's own shutdown may wait for threads."""
        self._selector_guard.strict = False

    def runnable(self) -> bool:
        """Something is ready to run, or a timer is due at the current time."""
        if self._ready:  # type: ignore[attr-defined]
            return True
        end = self.time() + self._clock_resolution  # type: ignore[attr-defined]
        return any(not handle.cancelled() and handle.when() < end
                   for handle in self._scheduled)  # type: ignore[attr-defined]

    def next_timer_s(self) -> float | None:
        live = [handle.when() for handle in self._scheduled if not handle.cancelled()]  # type: ignore[attr-defined]
        return min(live) if live else None

    def next_timer_ns(self) -> int | None:
        when = self.next_timer_s()
        return None if when is None else round(when * NS_PER_S)


def virtual_time(test: Callable[..., Awaitable[Any]]) -> Callable[..., Any]:
    """Run an `async def` test on a fresh VirtualTimeLoop (pytest sees a plain function)."""

    @functools.wraps(test)
    def run(*args: Any, **kwargs: Any) -> Any:
        with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
            try:
                return runner.run(test(*args, **kwargs))
            finally:
                loop = runner.get_loop()
                assert isinstance(loop, VirtualTimeLoop)
                for flow in list(_FLOWS.get(loop, ())):
                    flow.close()
                _FLOWS.pop(loop, None)
                loop.allow_blocking()

    return run


def current_loop() -> VirtualTimeLoop:
    loop = asyncio.get_running_loop()
    if not isinstance(loop, VirtualTimeLoop):
        raise TypeError("a Flow runs on a VirtualTimeLoop: decorate the test with @virtual_time")
    return loop


def clock() -> ManualClock:
    """The running loop's clock (for observers built before their Flow)."""
    return current_loop().clock


_FLOWS: dict[VirtualTimeLoop, list[Flow]] = {}


# -- what Envoy sends -----------------------------------------------------------------------


class FakeServicerContext:
    """The two things the servicers read from a grpc.aio.ServicerContext."""

    def __init__(self, peer: str = PEER, metadata: Sequence[tuple[str, str | bytes]] = ()) -> None:
        self._peer = peer
        self._metadata = tuple(metadata)

    def peer(self) -> str:
        return self._peer

    def invocation_metadata(self) -> tuple[tuple[str, str | bytes], ...]:
        return self._metadata


def check_request(headers: dict[str, str] | None = None, *, model: str | struct_pb2.Value | None = None,
                  http_id: str = "envoy-stream-1", namespace: str = "llamaswap") -> authz_pb2.CheckRequest:
    """A Check as Envoy sends it: the allowed headers, and json_to_metadata's `model`."""
    request = authz_pb2.CheckRequest()
    http = request.attributes.request.http
    http.id = http_id
    http.method = "POST"
    http.path = "/v1/chat/completions"
    for key, value in (headers or {}).items():
        http.headers[key] = value
    if model is not None:
        fields = request.attributes.metadata_context.filter_metadata[namespace].fields
        if isinstance(model, struct_pb2.Value):
            fields["model"].CopyFrom(model)
        else:
            fields["model"].string_value = model
    return request


# -- the upstream ----------------------------------------------------------------------------


def router(*models: str, loaded: str | None = None) -> Catalog:
    """llama-server in router mode: lists its models and says which one is loaded (None: none)."""
    return Catalog(UpstreamKind.ROUTER, frozenset(models), frozenset(() if loaded is None else (loaded,)), True)


def single(*models: str) -> Catalog:
    """One model that answers to any name."""
    return Catalog(UpstreamKind.SINGLE, frozenset(models))


class FakeUpstream:
    """The Upstream port, scripted: what `catalog()` returns, what `busy()` says (how many slots
    compute: True is one, False none; None: cannot tell), whether
    `stop()` and `unload()` work; every call is logged in `calls` (in order) and counted. `busy_failures`:
    that many next `busy()` calls get no answer (`UpstreamUnanswered`, a timeout or a 5xx)."""

    def __init__(self, catalog: Catalog | None = None, *, busy: int | None = None, stops: bool = True,
                 idle_after_stop: bool = True) -> None:
        self.catalog_answer = catalog
        self.busy_answer = busy
        self.stops = stops
        self.idle_after_stop = idle_after_stop
        self.calls: list[tuple[str, str | None]] = []
        self.catalog_gate: asyncio.Event | None = None  # set: catalog() waits for it
        self.slots_gate: asyncio.Event | None = None  # set: total_slots() waits for it
        self.slots_answer: int | dict[str | None, int] | None = None  # what total_slots() says (by model)
        self.fail_catalog = False
        self.busy_failures = 0
        self.unloads = True  # whether `unload()` works
        self.unload_gate: asyncio.Event | None = None  # set: unload() waits for it

    @property
    def catalog_calls(self) -> int:
        return sum(1 for name, _ in self.calls if name == "catalog")

    @property
    def busy_calls(self) -> list[str | None]:
        return [model for name, model in self.calls if name == "busy"]

    @property
    def stop_calls(self) -> list[str | None]:
        return [model for name, model in self.calls if name == "stop"]

    async def catalog(self) -> Catalog | None:
        self.calls.append(("catalog", None))
        if self.catalog_gate is not None:
            await self.catalog_gate.wait()
        if self.fail_catalog:
            raise ConnectionError("the upstream's GET /v1/models failed")
        return self.catalog_answer

    async def busy(self, model: str | None) -> int | None:
        self.calls.append(("busy", model))
        if self.busy_failures > 0:
            self.busy_failures -= 1
            raise UpstreamUnanswered("GET /slots answered 500")
        return self.busy_answer

    async def total_slots(self, model: str | None = None) -> int | None:
        self.calls.append(("total_slots", model))
        if self.slots_gate is not None:
            await self.slots_gate.wait()
        if isinstance(self.slots_answer, dict):
            return self.slots_answer.get(model)
        return self.slots_answer

    async def unload(self, model: str, *, timeout_s: float) -> bool:
        """`unloads`: whether an unload works; `unload_gate` set: it waits for it first."""
        self.calls.append(("unload", model))
        if self.unload_gate is not None:
            await self.unload_gate.wait()
        answer = self.catalog_answer
        if self.unloads and answer is not None and model in answer.residents | answer.asleep:
            self.catalog_answer = dataclasses.replace(answer, residents=answer.residents - {model},
                                                      asleep=answer.asleep - {model})
        return self.unloads

    @property
    def unload_calls(self) -> list[str | None]:
        return [model for name, model in self.calls if name == "unload"]

    async def stop(self, model: str | None) -> bool:
        self.calls.append(("stop", model))
        if self.stops and self.idle_after_stop and self.busy_answer:
            self.busy_answer = False
        return self.stops


# -- the observer ----------------------------------------------------------------------------


class Recorder:
    """Every event the coordinator emits, in order."""

    def __init__(self) -> None:
        self.events: list[tuple[str, Any]] = []
        self.tickets: dict[str, Ticket] = {}  # by request id, the latest one
        self.ended: list[Ticket] = []  # finished, in order
        self.finish_counts: collections.Counter[int] = collections.Counter()  # by id(ticket)
        self.grants: list[tuple[Ticket, tuple[Overtaken, ...]]] = []  # dispatched, in order
        self.settles: list[Settle] = []
        self.kept_events: list[KeptEvent] = []
        self.watchdogs: list[Ticket] = []
        self.pictures: list[QueuePicture] = []  # each one built (when read: `queue.latest()`)
        self.queue: PictureSource | None = None  # where the coordinator's pictures are read
        self.settings: list[Policy] = []
        self.holders: set[int] = set()  # dispatched and not finished
        self.most_holders = 0

    def enqueued(self, ticket: Ticket) -> None:
        self.events.append(("enqueued", ticket))
        self.tickets[ticket.request_id] = ticket

    def dispatched(self, ticket: Ticket, overtaken: tuple[Overtaken, ...]) -> None:
        self.events.append(("dispatched", ticket))
        self.grants.append((ticket, overtaken))
        self.holders.add(id(ticket))
        self.most_holders = max(self.most_holders, len(self.holders))

    def finished(self, ticket: Ticket) -> None:
        self.events.append(("finished", ticket))
        known = self.tickets.get(ticket.request_id)
        if known is None or known.outcome is not None:  # a refused ticket is seen here first
            self.tickets[ticket.request_id] = ticket
        self.ended.append(ticket)
        self.finish_counts[id(ticket)] += 1
        self.holders.discard(id(ticket))

    def reads_queue(self, pictures: PictureSource) -> None:
        self.queue = pictures

    def queue_changed(self, picture: QueuePicture) -> None:
        self.pictures.append(picture)

    def picture(self) -> QueuePicture:
        """The gauges' picture read now, as a scrape on the loop reads it (built if it moved)."""
        assert self.queue is not None
        picture = self.queue.latest()
        assert picture is not None
        return picture

    def watchdog_fired(self, ticket: Ticket) -> None:
        self.events.append(("watchdog", ticket))
        self.watchdogs.append(ticket)

    def settled(self, settle: Settle) -> None:
        self.events.append(("settled", settle))
        self.settles.append(settle)

    def settings_changed(self, policy: Policy) -> None:
        self.settings.append(policy)

    def kept_place(self, event: KeptEvent) -> None:
        self.events.append(("kept_place", event))
        self.kept_events.append(event)

    def line_stopped(self, line: Ticket, waiting: Ticket | None, tokens_kept: int | None) -> None:
        self.events.append(("line_stopped", (line.request_id, waiting.request_id if waiting is not None else None,
                                             tokens_kept)))

    def idle_unloaded(self, unload: IdleUnloaded) -> None:
        self.events.append(("idle_unloaded", unload))

    # -- questions -----------------------------------------------------------------------

    def outcomes(self) -> dict[str, Outcome | None]:
        return {ticket.request_id: ticket.outcome for ticket in self.ended}

    def grant_order(self) -> list[str]:
        return [ticket.request_id for ticket, _ in self.grants]

    def times_finished(self, ticket: Ticket) -> int:
        return self.finish_counts[id(ticket)]


class _Tee:
    """The Recorder first, then the test's observers; exceptions propagate (no FanOut here)."""

    def __init__(self, observers: Sequence[Any]) -> None:
        self._observers = tuple(observers)

    def __getattr__(self, name: str) -> Callable[..., None]:
        def call(*args: Any) -> None:
            for observer in self._observers:
                getattr(observer, name)(*args)

        return call


# -- requests --------------------------------------------------------------------------------


@dataclasses.dataclass
class Request:
    """One request's held Check: the admit task and what the transport knows of it."""

    flow: Flow
    arrival: Arrival
    task: asyncio.Task[Any]

    @property
    def id(self) -> str:
        return self.arrival.request_id

    @property
    def waiting(self) -> bool:
        """The Check is still held."""
        return not self.task.done()

    @property
    def granted(self) -> bool:
        return self.task.done() and not self.task.cancelled() and self.task.exception() is None and isinstance(
            self.task.result(), Ticket)

    @property
    def ticket(self) -> Ticket:
        if self.granted:
            return self.task.result()
        ticket = self.flow.recorder.tickets.get(self.id)
        assert ticket is not None, f"{self.id}: no ticket seen yet"
        return ticket

    @property
    def refusal(self) -> Refusal:
        assert self.task.done(), f"{self.id} is still waiting"
        result = self.task.result()
        assert isinstance(result, Refusal), f"{self.id} was granted, not refused"
        return result

    @property
    def outcome(self) -> Outcome | None:
        return self.ticket.outcome


# -- the flow --------------------------------------------------------------------------------


# The swap cost before measurements that the scenarios' arithmetic states, apart from the product's
# default (estimates.defaultSwapSeconds), which follows what is measured on GPUs.
STATED_SWAP_S = 5.0


def with_stated_swap(document: dict[str, Any]) -> dict[str, Any]:
    """`document` with estimates.defaultSwapSeconds at STATED_SWAP_S unless it sets one."""
    estimates = {"defaultSwapSeconds": STATED_SWAP_S, **(document.get("estimates") or {})}
    return {**document, "estimates": estimates}


class Flow:
    """A real Coordinator driven the way Envoy's ext_authz and access log drive it."""

    def __init__(self, config: dict[str, Any] | Config | None = None, *, observers: Iterable[Observer] = (),
                 upstream: FakeUpstream | None = None, upstreams: Sequence[FakeUpstream] | None = None,
                 lines: Lines | None = None) -> None:
        """``upstreams``: one per upstream of the configuration's ``upstreams:`` list; ``lines``:
        the Batch API lines that may be stopped (`runtime/stops.py`)."""
        self.loop = current_loop()
        self.clock = self.loop.clock
        self.config = config if isinstance(config, Config) else parse_config(with_stated_swap(config or {}))
        self.upstreams = list(upstreams) if upstreams is not None else [
            upstream if upstream is not None else FakeUpstream()]
        self.upstream = self.upstreams[0]
        self.recorder = Recorder()
        self.coordinator = Coordinator(self.config, clock=self.clock, observer=_Tee((self.recorder, *observers)),
                                       upstreams=self.upstreams, observe_after_grant=False, lines=lines)
        self.requests: dict[str, Request] = {}
        _FLOWS.setdefault(self.loop, []).append(self)

    def close(self) -> None:
        self.coordinator.close()

    # -- time ----------------------------------------------------------------------------

    @property
    def now_ns(self) -> int:
        return self.clock.now_ns()

    async def idle(self) -> None:
        """Run everything that is ready now; the clock does not move."""
        for _ in range(_MAX_TURNS):
            if not self.loop.runnable():
                return
            await asyncio.sleep(0)
        raise AssertionError("the loop never became idle")

    async def advance(self, seconds: float) -> None:
        """Move the clock `seconds` ahead, firing each timer at exactly its due time."""
        if seconds < 0:
            raise ValueError("time does not go back")
        target = self.clock.now_ns() + round(seconds * NS_PER_S)
        await self.idle()
        for _ in range(_MAX_TURNS):
            due = self.loop.next_timer_ns()
            if due is None or due > target:
                break
            if due > self.clock.now_ns():
                self.clock.set_ns(due)
            await self.idle()
        else:
            raise AssertionError("timers kept firing without end")
        self.clock.set_ns(target)
        await self.idle()

    async def advance_to(self, at_ns: int) -> None:
        await self.advance((at_ns - self.clock.now_ns()) / NS_PER_S)

    # -- ext_authz -----------------------------------------------------------------------

    async def arrive(self, request_id: str, priority: str | None = None, model: str | None = None, *,
                     peer: str = PEER, trusted: str | None = None, trace_parent: str | None = None,
                     trace_state: str | None = None, method: str = "POST", path: str = "/v1/chat/completions",
                     max_tokens: int | None = None, streamed: bool = True) -> Request:
        """A held Check: `admit` as a task, then whatever becomes ready runs. By default a streamed
        chat completion (a generation whose first byte times its start)."""
        return await self.admit(Arrival(request_id, priority, trusted, model, peer, trace_parent, trace_state,
                                        method, path, max_tokens, streamed))

    async def check(self, request: authz_pb2.CheckRequest, context: FakeServicerContext | None = None) -> Request:
        """A held Check read by the ext_authz servicer's own `_arrival`."""
        arrival = Authorization(self.coordinator)._arrival(request, context or FakeServicerContext())  # type: ignore[arg-type]
        return await self.admit(arrival)

    async def admit(self, arrival: Arrival) -> Request:
        task = asyncio.ensure_future(self.coordinator.admit(arrival))
        request = Request(self, arrival, task)
        self.requests[arrival.request_id] = request
        await self.idle()
        return request

    async def cancel(self, request: Request) -> None:
        """Envoy cancels the held Check: the client went away."""
        request.task.cancel()
        await self.idle()

    # -- the access log ------------------------------------------------------------------

    async def report(self, request: Request | str, report: ExchangeReport) -> None:
        token = request if isinstance(request, str) else request.ticket.token
        self.coordinator.report(token, report)
        await self.idle()

    async def renew(self, request: Request | str, *, first_byte_s: float | None = None,
                    elapsed_s: float | None = None) -> None:
        """A periodic access-log entry: the exchange still runs (for `elapsed_s`, from Envoy's start_time)."""
        await self.report(request, ExchangeReport(final=False, end=None, status=0, first_byte_s=first_byte_s,
                                                  elapsed_s=elapsed_s))

    async def end(self, request: Request | str, end: ExchangeEnd, status: int = 0, *,
                  first_byte_s: float | None = None) -> None:
        """The final access-log entry."""
        await self.report(request, ExchangeReport(final=True, end=end, status=status, first_byte_s=first_byte_s))

    async def complete(self, request: Request | str, status: int = 200, *, first_byte_s: float | None = None) -> None:
        await self.end(request, ExchangeEnd.COMPLETE, status, first_byte_s=first_byte_s)

    async def peer_gone(self, peer: str = PEER) -> None:
        self.coordinator.peer_gone(peer)
        await self.idle()

    # -- reading -------------------------------------------------------------------------

    def waiting_ids(self) -> list[str]:
        """The waiting requests in dispatch order (from the queue view)."""
        return [row.request_id for row in self.coordinator.view().waiting]

    def running_id(self) -> str | None:
        running = self.coordinator.view().running
        return running[0].request_id if running else None

