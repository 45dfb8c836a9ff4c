"""`llamaswap serve`: the sidecar process (gRPC for Envoy, admin HTTP), signals, reload."""

from __future__ import annotations

import asyncio
import errno
import gc
import json
import logging
import os
import pathlib
import signal

import grpc
from aiohttp import web

from llamaswap._proto.envoy.service.accesslog.v3 import als_pb2_grpc
from collections.abc import Callable
from typing import Any

from llamaswap.config import Config, ConfigError, HostPort, ListenConfig, load_document, parse_config
from llamaswap.config.advice import advice
from llamaswap.commands.event_loop import loop_name
from llamaswap.commands.loading import EXIT_CONFIG
from llamaswap.commands.ports import is_llamaswap, port_holder
from llamaswap.config.reload import plan_reload
from llamaswap.core import MonotonicClock
from llamaswap.runtime.activity import ActivityLog
from llamaswap.runtime.coordinator import GRACE_SECONDS_DEFAULT, Coordinator
from llamaswap.runtime.history import History
from llamaswap.runtime.observer import FanOut, Observer
from llamaswap.runtime.views import free
from llamaswap.telemetry import Telemetry
from llamaswap.adapters.access_log import AccessLogs
from llamaswap.adapters.admin import build_admin_app
from llamaswap.adapters.ext_authz import Authorization, add_authorization_to_server
from llamaswap.adapters.upstream_http import KEY_REFUSED_STATUSES, HttpUpstream, bearer
from llamaswap.adapters.upstream_metrics import add_upstream_metrics
from llamaswap.adapters.ui import UiState, add_ui_routes, batch_documents, batch_storage
from llamaswap.batches.access import Access
from llamaswap.batches.api import BatchService, add_batch_routes
from llamaswap.batches.feeder import Feeder, FeedSettings, StoppableLines
from llamaswap.batches.store import Store
from llamaswap.core.priority import HEADER as PRIORITY_HEADER
from llamaswap.telemetry.batches import new_trace_ids

_log = logging.getLogger(__name__)

CONFIG_POLL_S = 2.0
# Allocations between two collections of the youngest generation (Python's default is 700).
GC_YOUNG_THRESHOLD = 20_000


# How often the sidecar asks an upstream that does not answer yet whether it wants an API key.
ACCESS_RETRY_S = 1.0


class UpstreamKeyRefused(Exception):
    """The upstream refused the sidecar's requests (401, 403): its API key is missing or wrong."""


def key_refusal(config: Config, status: int, url: str | None = None) -> str:
    """What to say when an upstream (``url``; None: upstream.url) answered ``status`` (401, 403)
    to the sidecar: the key to set, never the key itself."""
    upstream = config.upstream
    head = f"the upstream {url or upstream.url} answered {status} to GET /v1/models"
    if upstream.api_key is not None:
        return (f"{head} with the API key of upstream.apiKey ({upstream.api_key}): it is not a key the upstream "
                f"accepts (llama-server's --api-key)")
    return (f"{head}: it wants an API key (llama-server's --api-key). Set upstream.apiKey to where the key is: "
            f"file:PATH (a file holding it) or env:NAME (an environment variable)")


class PortInUse(OSError):
    """A listen address is taken: by another llamaswap, or by another server (llama-server's own
    default port is 8080, llamaswap's listen.http); the message names the holder where it can."""

    def __init__(self, key: str, address: HostPort, holder: str | None = None) -> None:
        holder = holder if holder is not None else port_holder(address.port)
        if holder is None:
            text = (f"{key} {address} is already in use, by another llamaswap or another server (llama-server listens "
                    f"on 8080 unless given --port): stop it or choose another address for {key}")
        elif is_llamaswap(holder):
            text = (f"{key} {address} is already in use by {holder}: is another llamaswap running? Stop it or choose "
                    f"another address for {key}")
        else:
            text = (f"{key} {address} is already in use by {holder}, not by llamaswap: stop it or move it to another "
                    f"port (llama-server --port 8081, the port of upstream.url), or set {key} to another address")
        super().__init__(errno.EADDRINUSE, text)
        self.text = text
        self.key = key
        self.address = address

    def __str__(self) -> str:
        # The sentence alone: OSError's own form prefixes "[Errno 98] ", which `up` printed.
        return self.text


# Validates a configuration document the way the command that runs it does (`up` adds its
# built-in upstream to a file that names none): a reload must read the file the same way.
DocumentParser = Callable[[Any, str], Config]


def parse_document(document: Any, source: str) -> Config:
    return parse_config(document, source=source, warn=lambda text: _log.warning("reload: %s", text))


class Sidecar:
    """The running sidecar: owns the coordinator, the gRPC server and the admin server."""

    def __init__(self, config: Config, *, config_path: str | None = None, activity_path: str | None = None,
                 extra_observers: tuple[Observer, ...] = (), parse: DocumentParser = parse_document) -> None:
        self.config = config
        self.config_path = config_path
        self._parse = parse
        self._poll_changed = asyncio.Event()
        clock = MonotonicClock()
        self.activity = ActivityLog(clock, capacity=config.activity.recent, path=activity_path or config.activity.path)
        self.telemetry = Telemetry.from_environment(clock)
        # Read once (ConfigError when it cannot be); only the HTTP clients hold it.
        self._api_key = config.upstream.read_api_key()
        # One client per upstream of the node (`upstreams:`), in order.
        self.upstreams = [HttpUpstream(entry.url, api_key=self._api_key) for entry in config.gpu_entries]
        # A 401 or 403 from the upstream before it ever answered otherwise: `failure` says why.
        self.failed = asyncio.Event()
        self.failure: str | None = None
        self.history = History(clock, self.activity)
        if activity_path or config.activity.path:  # a restart keeps the page's timeline
            self.history.load(activity_path or config.activity.path or "")
        observers: list[Observer] = [self.activity, self.history, *extra_observers, self.telemetry]
        # The Batch API's lines the scheduler may stop for a higher band: the feeder, built after
        # the coordinator (it asks the coordinator what it serves), answers for them once it is.
        self.lines = StoppableLines()
        self.coordinator = Coordinator(config, clock=clock, observer=FanOut(*observers),
                                       upstreams=self.upstreams, lines=self.lines)
        self.batches = self._batch_service(config)
        self.ui = UiState(self.coordinator, self.history, jaeger_url=lambda: self.config.ui.jaeger_url,
                          batches=batch_documents(self.batches), batch_storage=batch_storage(self.batches))
        self.grpc_port = 0
        self.admin_port = 0
        self._grpc_server: grpc.aio.Server | None = None
        self._admin_runner: web.AppRunner | None = None
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        listen = self.config.listen
        warn_remote_listen(listen)
        for problem in advice(self.config):
            _log.warning("%s", problem)
        if not await self._check_upstream_access():
            self._tasks.append(asyncio.create_task(self._watch_upstream_access()))
        if self.failure is not None:
            raise UpstreamKeyRefused(self.failure)
        self._grpc_server = grpc.aio.server(options=[
            ("grpc.max_receive_message_length", 4 * 1024 * 1024),
            ("grpc.max_concurrent_streams", 1 << 30),
            # A burst of arrivals can outrun the event loop's call matching; gRPC's default
            # pending-call limits (1000 soft, 3000 hard) would then cancel the surplus.
            ("grpc.server.max_pending_requests", 1 << 20),
            ("grpc.server.max_pending_requests_hard_limit", 1 << 20),
            ("grpc.server_max_unrequested_time_in_server", 3600),
            # One sidecar per port: a second one must fail to bind, not share it.
            ("grpc.so_reuseport", 0),
        ])
        add_authorization_to_server(Authorization(self.coordinator), self._grpc_server)
        als_pb2_grpc.add_AccessLogServiceServicer_to_server(AccessLogs(self.coordinator), self._grpc_server)
        try:
            self.grpc_port = self._grpc_server.add_insecure_port(str(listen.grpc))
        except RuntimeError as exc:  # grpcio raises on a failed bind
            raise PortInUse("listen.grpc", listen.grpc) from exc
        if self.grpc_port == 0:
            raise PortInUse("listen.grpc", listen.grpc)
        # Before the first Check can arrive: a restarted sidecar asks the upstream (and, when it
        # cannot tell, waits for Envoy's periodic entries) before its first grant.
        self.coordinator.begin_startup_settle()
        await self._grpc_server.start()

        app = build_admin_app(self.coordinator, self.activity, metrics=self.telemetry.prometheus_text,
                              picker_metrics=self.telemetry.picker_text, history=self.history)
        add_upstream_metrics(app, {entry.name: entry.url for entry in self.config.gpu_entries}, self._api_key)
        add_ui_routes(app, self.ui)
        add_batch_routes(app, self.batches)
        self._admin_runner = web.AppRunner(app, access_log=None)
        await self._admin_runner.setup()
        # SO_REUSEADDR: a restart may bind over TIME_WAIT; two listeners still cannot share a port.
        site = web.TCPSite(self._admin_runner, listen.admin.host, listen.admin.port, reuse_address=True)
        try:
            await site.start()
        except OSError as exc:
            await self._grpc_server.stop(None)
            if exc.errno == errno.EADDRINUSE:
                raise PortInUse("listen.admin", listen.admin) from exc
            raise
        server = site._server  # aiohttp keeps the bound socket here
        sockets = getattr(server, "sockets", None) or []
        self.admin_port = sockets[0].getsockname()[1] if sockets else listen.admin.port
        self._tasks.append(asyncio.create_task(self.coordinator.learn_slots()))
        self._tasks.append(asyncio.create_task(self._reconcile_models()))
        if self.config_path:
            self._tasks.append(asyncio.create_task(self._watch_config_file()))
        if self.batches is not None:
            self._tasks.append(asyncio.create_task(self.batches.feeder.run()))
            self._tasks.append(asyncio.create_task(self.batches.sweep_expired_files()))
        tune_gc()
        _log.info("llamaswap sidecar: gRPC on %s:%d, admin on http://%s:%d, scheduler %s, event loop %s",
                  listen.grpc.host, self.grpc_port, listen.admin.host, self.admin_port,
                  self.config.routing.scheduler.use, loop_name(asyncio.get_running_loop()))

    def _batch_service(self, config: Config) -> BatchService | None:
        """The Batch API over batches.dir (None: off). Lines go to Envoy's public listener."""
        if config.batches.dir is None:
            return None
        access = Access(config.batches.read_keys(self._api_key), config.batches.caller_header,
                        frozenset(config.batches.admin_callers))
        if access.open:
            _log.warning("the Batch API is open to every caller who reaches Envoy's listener: each lists, reads and "
                         "deletes every file and batch. Set batches.apiKeys (a key per caller), upstream.apiKey or "
                         "batches.callerHeader (set by your authenticating proxy) to tell callers apart")
        store = Store(config.batches.dir)
        store.output_expiry_s = lambda: self.config.batches.output_expiry_seconds
        listener = config.listen.http
        trusted = config.security.priority.trusted_header
        settings = FeedSettings(target_url=f"http://{HostPort(listener.connect_host, listener.port)}",
                                in_flight=lambda: self.config.batches.in_flight or self.node_slots(),
                                max_requests=lambda: self.config.batches.max_requests,
                                max_line_bytes=lambda: (self.config.batches.max_line_bytes
                                                        or self.config.envoy.max_request_bytes),
                                max_answer_bytes=lambda: self.config.batches.max_answer_bytes,
                                priority_header=trusted or PRIORITY_HEADER, headers=bearer(self._api_key),
                                line_priority=lambda batch: service.line_priority(batch),
                                preempt=lambda: self.config.batches.preempt,
                                max_preemptions=lambda: self.config.batches.max_preemptions)
        feeder = Feeder(store, settings, observer=self.telemetry.batch_telemetry(), serves=self.coordinator.serves)
        self.lines.feeder = feeder
        service = BatchService(store, feeder, lambda: self.config, new_trace_ids, access=access)
        return service

    def node_slots(self) -> int:
        """The slots of the node now: every upstream's, for the model in effect there."""
        scheduler = self.coordinator.scheduler
        return sum(gpu.slots_in_effect for gpu in scheduler.holdings())

    def reload(self) -> bool:
        """Re-read the config file; an invalid one is refused and the old one stays."""
        if not self.config_path:
            return False
        path = self.config_path
        try:
            plan = plan_reload(self.config, self._parse(load_document(path), path),
                               parse=lambda document: self._parse(document, path))
        except ConfigError as exc:
            _log.error("reload refused, keeping the running configuration: %s", exc)
            return False
        if plan.refused:
            # Envoy keeps the bootstrap it started with (lease renewals, ports, headers): applying
            # only half of such a change would let the two disagree.
            _log.error("reload refused, keeping the running configuration: %s changed, which Envoy's bootstrap "
                       "uses; restart the stack (or the pod) to apply it", ", ".join(plan.refused))
            return False
        if plan.restart:
            _log.warning("reload: %s changed and need%s a restart to apply; the running value%s kept",
                         ", ".join(plan.restart), "s" if len(plan.restart) == 1 else "",
                         " is" if len(plan.restart) == 1 else "s are")
        if not plan.live:
            _log.info("configuration re-read from %s: nothing to apply", path)
            return True
        previous, self.config = self.config, plan.config
        self.coordinator.reconfigure(plan.config)
        if previous.upstream.models_poll_seconds != plan.config.upstream.models_poll_seconds:
            self._poll_changed.set()
        _log.info("configuration reloaded from %s: %s applied (scheduler %s)", path, ", ".join(plan.live),
                  plan.config.routing.scheduler.use)
        return True

    async def stop(self, grace_s: float = GRACE_SECONDS_DEFAULT) -> None:
        """Stop admitting, answer the waiting 503, let the running request finish, close."""
        await self.drain(grace_s)
        await self.close()

    async def drain(self, grace_s: float) -> None:
        """No new requests, the waiting ones get 503, and the running one may finish within
        `grace_s` (its end still comes from Envoy, so Envoy must be up meanwhile)."""
        if self.batches is not None:
            self.batches.feeder.pause()  # lines in flight may finish; none starts
        self.coordinator.stop_admitting()
        finished = await self.coordinator.wait_idle(grace_s)
        if not finished:
            # Not finished also when only a settle runs (`up` failing at start, an upstream that
            # refuses the key) or, with a grace of 0, when nothing runs at all: name requests only.
            running = len(self.coordinator.view().running)
            if running:
                _log.warning("grace period of %.0f s ended with %d request(s) still running", grace_s, running)
            self.coordinator.abandon_running()

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self.batches is not None:
            await self.batches.feeder.stop()  # what is still in flight is sent again at the next start
            self.batches.store.close()
        self.coordinator.close()
        if self._grpc_server is not None:
            await self._grpc_server.stop(grace=1.0)
            self._grpc_server = None
        if self._admin_runner is not None:
            await self._admin_runner.cleanup()
            self._admin_runner = None
        for upstream in self.upstreams:
            await upstream.close()
        await asyncio.sleep(0)  # let the last observer callbacks run before the providers stop
        self.activity.close()
        self.telemetry.shutdown()

    async def _watch_config_file(self) -> None:
        """Apply a changed file (a Kubernetes ConfigMap update) like SIGHUP would."""
        path = pathlib.Path(self.config_path or "")
        last = _mtime(path)
        while True:
            await asyncio.sleep(CONFIG_POLL_S)
            current = _mtime(path)
            if current != last:
                last = current
                self.reload()

    async def _check_upstream_access(self) -> bool:
        """Whether every upstream answered GET /v1/models at all; a 401 or 403 sets `failure`."""
        answered = True
        for upstream in self.upstreams:
            status = await upstream.access_status()
            if status in KEY_REFUSED_STATUSES:
                self.failure = key_refusal(self.config, status, upstream.base_url)
                self.failed.set()
            answered = answered and status is not None
        return answered

    async def _watch_upstream_access(self) -> None:
        """An upstream that starts after the sidecar (a pod's containers start together): its
        first answer tells whether the key is right, instead of every settle waiting it out."""
        while not await self._check_upstream_access():
            await asyncio.sleep(ACCESS_RETRY_S)

    async def _reconcile_models(self) -> None:
        """Ask the upstream what it serves and has loaded, while the GPU is idle, every
        upstream.modelsPollSeconds; at 0, wait until a reload sets it again."""
        while True:
            interval_s = self.config.upstream.models_poll_seconds
            if interval_s <= 0:
                await self._poll_changed.wait()
                self._poll_changed.clear()
                continue
            scheduler = self.coordinator.scheduler
            for gpu in self.coordinator.gpus:  # each while it is idle: its loaded model can change only then
                if free((self.coordinator.holding_of(gpu.name),)):
                    as_of = scheduler.dispatches_on(gpu.name)
                    catalog = await gpu.upstream.catalog()
                    if catalog is not None:  # warns of models.<id> it never serves
                        self.coordinator.observe_catalog(catalog, as_of, gpu.name)
            # A reload that changes the interval ends this wait: the new one counts from now.
            try:
                await asyncio.wait_for(self._poll_changed.wait(), interval_s)
            except asyncio.TimeoutError:
                pass
            self._poll_changed.clear()


def warn_remote_listen(listen: ListenConfig) -> None:
    """A sidecar port off the loopback (allowed only by listen.allowRemote) is said at every start."""
    for key, address in (("listen.grpc", listen.grpc), ("listen.admin", listen.admin)):
        if not address.is_loopback:
            _log.warning("%s binds %s, which is not the loopback (listen.allowRemote: true): whoever reaches it "
                         "can hold the GPU (gRPC) or read the queue (admin); admit only Envoy to it", key, address)


def tune_gc() -> None:
    """Fewer collections of the young generation: each request allocates a few hundred short-lived
    objects (protobuf messages, futures, records) and almost no cycles, and everything loaded at
    start is moved out of the collector's way for good."""
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, middle, old)


def _mtime(path: pathlib.Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None


async def serve(config: Config, *, config_path: str | None = None, ports_file: str | None = None,
                activity_path: str | None = None, grace_s: float = GRACE_SECONDS_DEFAULT) -> int:
    sidecar = Sidecar(config, config_path=config_path, activity_path=activity_path)
    try:
        await sidecar.start()
    except UpstreamKeyRefused as exc:
        _log.critical("cannot start: %s", exc)
        await sidecar.close()
        return EXIT_CONFIG
    if ports_file:
        tmp = f"{ports_file}.tmp"
        pathlib.Path(tmp).write_text(json.dumps({"grpc": sidecar.grpc_port, "admin": sidecar.admin_port}))
        os.replace(tmp, ports_file)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    loop.add_signal_handler(signal.SIGHUP, sidecar.reload)
    await first_of(stop, sidecar.failed)
    if sidecar.failure is not None:
        _log.critical("stopping: %s", sidecar.failure)
        await sidecar.stop(0.0)
        return EXIT_CONFIG
    _log.info("shutting down: no new requests; waiting up to %.0f s for the running one", grace_s)
    await sidecar.stop(grace_s)
    return 0


async def first_of(*events: asyncio.Event) -> None:
    """Wait until one of ``events`` is set."""
    waits = [asyncio.create_task(event.wait()) for event in events]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()
