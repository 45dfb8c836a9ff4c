"""`llamaswap serve`: the sidecar process (gRPC for Envoy, admin HTTP), signals, reload."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import pathlib
import signal
from typing import Any

import aiohttp
import grpc
from aiohttp import web

from llamaswap._proto.envoy.service.auth.v3 import external_auth_pb2_grpc as authz_grpc
from llamaswap._proto.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from llamaswap.config import Config, ConfigError, load_config
from llamaswap.runtime.activity import ActivityLog
from llamaswap.runtime.coordinator import Coordinator
from llamaswap.runtime.observer import FanOut, Observer
from llamaswap.telemetry import Telemetry
from llamaswap.transport.admin import build_admin_app
from llamaswap.transport.ext_authz import Authorization
from llamaswap.transport.ext_proc import ExternalProcessor

_log = logging.getLogger(__name__)

GRACE_SECONDS_DEFAULT = 30.0


class Sidecar:
    """The running sidecar: owns the coordinator, the gRPC server and the admin server."""

    def __init__(self, config: Config, *, config_path: str | None = None,
                 extra_observers: tuple[Observer, ...] = ()) -> None:
        self.config = config
        self.config_path = config_path
        self.activity = ActivityLog()
        self.telemetry = Telemetry.from_environment()
        observers: list[Observer] = [self.activity, *extra_observers, self.telemetry]
        self.coordinator = Coordinator(config, observer=FanOut(*observers))
        self.telemetry.bind(self.coordinator)
        self.grpc_port = 0
        self.admin_port = 0
        self._grpc_server: grpc.aio.Server | None = None
        self._admin_runner: web.AppRunner | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._config_mtime: float | None = None

    async def start(self) -> None:
        limit = self.config.envoy.max_request_bytes + 1024 * 1024
        self._grpc_server = grpc.aio.server(options=[
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", 16 * 1024 * 1024),
            ("grpc.max_concurrent_streams", 1 << 30),
            # A burst of arrivals can outrun the event loop's call matching; gRPC's default
            # pending-call limits (1000 soft, 3000 hard) would then cancel the surplus.
            ("grpc.server.max_pending_requests", 1 << 20),
            ("grpc.server.max_pending_requests_hard_limit", 1 << 20),
            ("grpc.server_max_unrequested_time_in_server", 3600),
            ("grpc.so_reuseport", 0),
        ])
        ext_proc_grpc.add_ExternalProcessorServicer_to_server(ExternalProcessor(self.coordinator), self._grpc_server)
        authz_grpc.add_AuthorizationServicer_to_server(Authorization(self.coordinator), self._grpc_server)
        listen = self.config.listen
        self.grpc_port = self._grpc_server.add_insecure_port(f"{listen.grpc.host}:{listen.grpc.port}")
        if self.grpc_port == 0:
            raise OSError(f"cannot bind gRPC on {listen.grpc} (listen.grpc)")
        await self._grpc_server.start()

        app = build_admin_app(self.coordinator, self.activity, metrics=self.telemetry.prometheus_text)
        self._admin_runner = web.AppRunner(app, access_log=None)
        await self._admin_runner.setup()
        site = web.TCPSite(self._admin_runner, listen.admin.host, listen.admin.port, reuse_address=True)
        await site.start()
        server = site._server  # aiohttp keeps the bound socket here
        sockets = getattr(server, "sockets", None) or []
        self.admin_port = sockets[0].getsockname()[1] if sockets else listen.admin.port
        if self.config.upstream.models_poll_s > 0:
            self._tasks.append(asyncio.create_task(self._reconcile_models()))
        if self.config_path:
            self._tasks.append(asyncio.create_task(self._watch_config_file()))
        _log.info("llamaswap sidecar: gRPC on %s:%d, admin on http://%s:%d, scheduler %s",
                  listen.grpc.host, self.grpc_port, listen.admin.host, self.admin_port, self.config.scheduler.use)

    def reload(self) -> bool:
        """Re-read the config file; an invalid one is refused and the old one stays."""
        if not self.config_path:
            return False
        try:
            config = load_config(self.config_path, warn=lambda text: _log.warning("reload: %s", text))
        except ConfigError as exc:
            _log.error("reload refused, keeping the running configuration: %s", exc)
            return False
        self.config = config
        self.coordinator.reconfigure(config)
        _log.info("configuration reloaded from %s (scheduler %s)", self.config_path, config.scheduler.use)
        return True

    async def stop(self, grace_s: float = GRACE_SECONDS_DEFAULT) -> None:
        """Stop admitting, answer the waiting 503, let the running request finish, close."""
        self.coordinator.stop_admitting()
        finished = await self.coordinator.wait_idle(grace_s)
        if not finished:
            _log.warning("grace period of %.0f s ended with a request still running", grace_s)
        for task in self._tasks:
            task.cancel()
        if self._grpc_server is not None:
            await self._grpc_server.stop(grace=1.0)
        if self._admin_runner is not None:
            await self._admin_runner.cleanup()
        self.telemetry.shutdown()

    async def _watch_config_file(self) -> None:
        """Apply a changed file (a Kubernetes ConfigMap update) like SIGHUP would."""
        path = pathlib.Path(self.config_path or "")
        last = _mtime(path)
        while True:
            await asyncio.sleep(2.0)
            current = _mtime(path)
            if current != last:
                last = current
                self.reload()

    async def _reconcile_models(self) -> None:
        """Ask a llama-server in router mode which model is loaded, while the GPU is idle."""
        url = f"{self.config.upstream.url}/models"
        timeout = aiohttp.ClientTimeout(total=5)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                try:
                    if self.coordinator.scheduler.running_id is None:
                        async with session.get(url) as response:
                            if response.status == 404:
                                _log.info("upstream has no GET /models (not router mode); not reconciling")
                                return
                            if response.status == 200:
                                loaded = loaded_model_from(await response.json(content_type=None))
                                if loaded is not None and self.coordinator.scheduler.running_id is None:
                                    self.coordinator.scheduler.set_loaded_model(loaded or None)
                except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
                    _log.debug("model reconciliation failed: %s", exc)
                await asyncio.sleep(self.config.upstream.models_poll_s)


def loaded_model_from(document: Any) -> str | None:
    """From llama-server's GET /models: the one loaded model, '' for none, None if unclear."""
    items = document.get("data") if isinstance(document, dict) else document
    if not isinstance(items, list):
        return None
    loaded = []
    for item in items:
        if not isinstance(item, dict):
            continue
        status = item.get("status")
        state = status.get("value") if isinstance(status, dict) else status if isinstance(status, str) else item.get("state")
        if state == "loaded":
            name = item.get("id") or item.get("name") or item.get("model")
            if isinstance(name, str):
                loaded.append(name)
    if len(loaded) == 1:
        return loaded[0]
    return "" if not loaded else None


def _mtime(path: pathlib.Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None


async def serve(config: Config, *, config_path: str | None = None, ports_file: str | None = None,
                grace_s: float = GRACE_SECONDS_DEFAULT) -> int:
    sidecar = Sidecar(config, config_path=config_path)
    await sidecar.start()
    if ports_file:
        tmp = f"{ports_file}.tmp"
        pathlib.Path(tmp).write_text(json.dumps({"grpc": sidecar.grpc_port, "admin": sidecar.admin_port}))
        os.replace(tmp, ports_file)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    loop.add_signal_handler(signal.SIGHUP, sidecar.reload)
    await stop.wait()
    _log.info("shutting down: no new requests; waiting up to %.0f s for the running one", grace_s)
    await sidecar.stop(grace_s)
    return 0
