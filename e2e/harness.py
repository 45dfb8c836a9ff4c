"""The end-to-end harness: the real Envoy binary, the real sidecar process, and a fake or real
upstream, all on 127.0.0.1 with ports chosen by the OS.

Readiness is polled with a deadline, never slept for; logs are dumped when a start fails;
teardown always runs and is shielded from the test's own failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import yaml
from aiohttp import web

from llamaswap.config import parse_config
from llamaswap.envoy.binary import envoy_binary
from llamaswap.envoy.bootstrap import build_bootstrap, render_bootstrap

DEADLINE_S = 60.0


def wait_for(predicate: Callable[[], Any], *, timeout: float = DEADLINE_S, interval: float = 0.02,
             what: str = "condition") -> Any:
    """Poll until predicate() is truthy; raise with `what` after the deadline."""
    deadline = time.monotonic() + timeout
    last_error: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except Exception as exc:  # noqa: BLE001 - retried until the deadline
            last_error = exc
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}" + (f": {last_error!r}" if last_error else ""))


async def async_wait_for(predicate: Callable[[], Any], *, timeout: float = DEADLINE_S, interval: float = 0.02,
                         what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    last_error: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if asyncio.iscoroutine(value):
                value = await value
            if value:
                return value
        except Exception as exc:  # noqa: BLE001
            last_error = exc
        await asyncio.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}" + (f": {last_error!r}" if last_error else ""))


def http_get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def get_json(url: str) -> Any:
    status, body = http_get(url)
    if status != 200:
        raise RuntimeError(f"GET {url}: {status} {body[:200]!r}")
    return json.loads(body)


# -- fake upstream -------------------------------------------------------------------------


@dataclasses.dataclass
class UpstreamHit:
    test_id: str
    path: str
    model: str | None
    headers: dict[str, str]
    body_bytes: int
    start_ns: int
    end_ns: int | None = None
    peer_port: int | None = None  # the connection it came on (Envoy's side)


class FakeUpstream:
    """An OpenAI-shaped upstream in a thread of its own that behaves like llama-server where the
    scheduler depends on it, and records what reached it.

    Like llama-server, it keeps computing a non-streamed request after its client has gone (its
    handler is never cancelled), and it answers `GET /slots` with `is_processing` per slot while
    anything computes (``slots`` entries; `GET /props` says ``total_slots``). In single-model mode (the default) it serves any model name; with
    ``router=True`` it lists ``models`` with their states at `GET /v1/models`, answers 400
    `model 'x' not found` for others, loads a model when a request names it, serves
    `GET /slots?model=NAME` for the loaded one, and `POST /models/unload` ends what it computes.

    `slots_failures` makes that many next `GET /slots` answer 500, and `slots_stall_s` makes
    them answer that late (llama-server's main loop busy with a long prompt batch).

    Test controls, by request header: `x-test-id` names the request; `x-test-hold: 1` keeps
    it running until `release(test_id)`; `x-test-sleep-ms` computes that long; a body with
    `"stream": true` gets a server-sent-event stream.
    """

    def __init__(self, port: int = 0, *, router: bool = False,
                 models: tuple[str, ...] = ("model-a", "model-b", "model-c"), slots: int = 4) -> None:
        self.hits: list[UpstreamHit] = []
        self.slots = slots  # what GET /slots lists and GET /props says (total_slots), like --parallel
        self.loaded_model: str | None = None
        self.router = router
        self.models = set(models)
        self.port = port
        self._loop: asyncio.AbstractEventLoop | None = None
        self._holds: dict[str, asyncio.Event] = {}
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._runner: web.AppRunner | None = None
        self._computing: dict[str, asyncio.Task[None]] = {}
        self.active = 0
        self.max_active = 0
        self.slots_queries = 0
        self.slots_failures = 0
        self.slots_stall_s = 0.0
        self.slots_asked: list[str | None] = []  # each GET /slots's ?model=, as the upstream read it
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def started(self) -> "FakeUpstream":
        self._thread = threading.Thread(target=self._run, name="fake-upstream", daemon=True)
        self._thread.start()
        if not self._ready.wait(DEADLINE_S):
            raise TimeoutError("fake upstream did not start")
        return self

    def _run(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._loop.run_until_complete(self._serve())
        self._loop.run_forever()

    async def _serve(self) -> None:
        app = web.Application(client_max_size=256 * 1024 * 1024)

        async def health(_: web.Request) -> web.Response:
            return web.json_response({"status": "ok"})

        app.router.add_get("/health", health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/models", self._models)
        app.router.add_get("/slots", self._slots)
        app.router.add_get("/props", self._props)
        app.router.add_post("/models/unload", self._unload)
        app.router.add_route("*", "/{tail:.*}", self._complete)
        # handler_cancellation off (aiohttp's default): a client that leaves does not stop the work.
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self._ready.set()

    async def _models(self, _: web.Request) -> web.Response:
        if not self.router:
            return web.json_response({"object": "list", "data": [{"id": "fake.gguf", "object": "model",
                                                                  "owned_by": "llamacpp"}]})
        return web.json_response({"object": "list", "data": [
            {"id": name, "object": "model", "owned_by": "llamacpp",
             "status": {"value": "loaded" if name == self.loaded_model else "unloaded"}}
            for name in sorted(self.models)]})

    async def _slots(self, request: web.Request) -> web.Response:
        with self.lock:
            self.slots_queries += 1
            self.slots_asked.append(request.query.get("model"))
            active = self.active
            failing = self.slots_failures > 0
            self.slots_failures -= failing
        if self.slots_stall_s:
            await asyncio.sleep(self.slots_stall_s)
        if failing:
            return web.json_response({"error": {"code": 500, "message": "busy"}}, status=500)
        if self.router:
            model = request.query.get("model")
            if not model:
                return web.json_response({"error": {"code": 400, "message": "model name is missing from the request",
                                                    "type": "invalid_request_error"}}, status=400)
            if model != self.loaded_model:  # llama-server would load it: the sidecar must never ask
                raise AssertionError(f"GET /slots?model={model} for a model that is not loaded")
        return web.json_response([{"id": index, "is_processing": index < active} for index in range(self.slots)])

    async def _props(self, request: web.Request) -> web.Response:
        if self.router and request.query.get("model") != self.loaded_model:
            raise AssertionError("GET /props for a model that is not loaded: llama-server would load it")
        return web.json_response({"total_slots": self.slots})

    async def _unload(self, request: web.Request) -> web.Response:
        document = await request.json()
        if not self.router or document.get("model") != self.loaded_model:
            return web.json_response({"error": {"code": 400, "message": "model is not running"}}, status=400)
        self.loaded_model = None
        for task in list(self._computing.values()):
            task.cancel()  # its process ends with the unload
        return web.json_response({"success": True})

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        model = None
        stream = False
        try:
            document = json.loads(body)
            model = document.get("model") if isinstance(document, dict) else None
            stream = bool(document.get("stream")) if isinstance(document, dict) else False
        except ValueError:
            pass
        test_id = request.headers.get("x-test-id", "")
        if self.router and (not isinstance(model, str) or model not in self.models):
            return web.json_response({"error": {"code": 400, "message": f"model '{model}' not found",
                                                "type": "invalid_request_error"}}, status=400)
        peer = request.transport.get_extra_info("peername") if request.transport is not None else None
        hit = UpstreamHit(test_id, request.path, model if isinstance(model, str) else None,
                          dict(request.headers), len(body), time.monotonic_ns(),
                          peer_port=int(peer[1]) if peer else None)
        with self.lock:
            self.hits.append(hit)
            self.active += 1
            self.max_active = max(self.max_active, self.active)
        try:
            if isinstance(model, str):
                self.loaded_model = model
            work = asyncio.ensure_future(self._compute(request, test_id))
            key = f"{test_id}#{id(hit)}"
            self._computing[key] = work
            try:
                await asyncio.shield(work)
            except asyncio.CancelledError:
                if not work.cancelled():
                    raise
                return web.json_response({"error": {"message": "model unloaded"}}, status=500)
            finally:
                self._computing.pop(key, None)
            if request.headers.get("x-test-fail") == "1":
                return web.json_response({"error": {"message": "boom"}}, status=500)
            if stream:
                response = web.StreamResponse(headers={"content-type": "text/event-stream"})
                await response.prepare(request)
                for index in range(int(request.headers.get("x-test-chunks", "3"))):
                    await response.write(f"data: {json.dumps({'index': index})}\n\n".encode())
                    await asyncio.sleep(float(request.headers.get("x-test-chunk-ms", "20")) / 1000)
                await response.write(b"data: [DONE]\n\n")
                await response.write_eof()
                return response
            return web.json_response({"id": test_id, "object": "chat.completion", "model": model,
                                      "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}]})
        finally:
            hit.end_ns = time.monotonic_ns()
            with self.lock:
                self.active -= 1

    async def _compute(self, request: web.Request, test_id: str) -> None:
        if request.headers.get("x-test-hold") == "1":
            await self._holds.setdefault(test_id, asyncio.Event()).wait()
        sleep_ms = float(request.headers.get("x-test-sleep-ms", "0") or 0)
        if sleep_ms:
            await asyncio.sleep(sleep_ms / 1000)

    def release(self, test_id: str) -> None:
        assert self._loop is not None

        def _set() -> None:
            self._holds.setdefault(test_id, asyncio.Event()).set()

        self._loop.call_soon_threadsafe(_set)

    def order(self) -> list[str]:
        with self.lock:
            return [hit.test_id for hit in self.hits]

    def finished(self, test_id: str) -> bool:
        with self.lock:
            return any(hit.test_id == test_id and hit.end_ns is not None for hit in self.hits)

    def close(self) -> None:
        if self._loop is None:
            return
        for event_id in list(self._holds):
            self.release(event_id)

        async def _stop() -> None:
            if self._runner is not None:
                await self._runner.cleanup()

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(_stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(10)


# -- processes ------------------------------------------------------------------------------


class Process:
    """A child process with its log in a file, stopped with SIGTERM then SIGKILL."""

    def __init__(self, name: str, argv: list[str], log_path: pathlib.Path, env: dict[str, str] | None = None):
        self.name = name
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.popen = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT,
                                      env={**os.environ, **(env or {})}, start_new_session=True)

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def dump(self) -> None:
        sys.stderr.write(f"\n----- {self.name} log ({self.log_path}) -----\n{self.log()[-20000:]}\n")

    def signal(self, signum: int) -> None:
        if self.alive():
            self.popen.send_signal(signum)

    def stop(self, timeout: float = 15.0) -> int | None:
        if self.alive():
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)
        self._log.close()
        return self.popen.returncode


def sidecar_command() -> list[str]:
    return [sys.executable, "-m", "llamaswap"]


class SidecarProcess(Process):
    def __init__(self, config_path: pathlib.Path, workdir: pathlib.Path, *, grace_s: float = 10.0,
                 env: dict[str, str] | None = None, name: str = "sidecar") -> None:
        self.ports_file = workdir / f"{name}-ports.json"
        self.ports_file.unlink(missing_ok=True)
        super().__init__(name, [*sidecar_command(), "serve", "-c", str(config_path), "--ports-file",
                                str(self.ports_file), "--grace", str(grace_s)], workdir / f"{name}.log", env)
        try:
            ports = wait_for(self._ports, what="sidecar ports file")
            self.grpc_port = int(ports["grpc"])
            self.admin_port = int(ports["admin"])
            wait_for(lambda: http_get(f"{self.admin_url}/readyz")[0] == 200, what="sidecar /readyz")
        except BaseException:
            self.dump()
            self.stop()
            raise

    def _ports(self) -> dict[str, int] | None:
        if not self.alive():
            raise RuntimeError(f"sidecar exited with {self.popen.returncode}")
        if self.ports_file.exists():
            return json.loads(self.ports_file.read_text())
        return None

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    def queue(self) -> dict[str, Any]:
        return get_json(f"{self.admin_url}/queue")


class EnvoyProcess(Process):
    def __init__(self, bootstrap: dict[str, Any], workdir: pathlib.Path, *, name: str = "envoy",
                 concurrency: int = 2) -> None:
        self.config_path = workdir / f"{name}.yaml"
        self.config_path.write_text(render_bootstrap(bootstrap))
        self.admin_path = workdir / f"{name}-admin-address"
        self.admin_path.unlink(missing_ok=True)
        super().__init__(name, [envoy_binary(), "-c", str(self.config_path), "--admin-address-path",
                                str(self.admin_path), "--disable-hot-restart", "--concurrency", str(concurrency),
                                "--log-level", os.environ.get("LLAMASWAP_ENVOY_LOG_LEVEL", "warning")],
                         workdir / f"{name}.log")
        try:
            self.admin_url = "http://" + wait_for(self._admin_address, what="Envoy admin address file")
            wait_for(lambda: http_get(f"{self.admin_url}/ready")[1].strip() == b"LIVE", what="Envoy /ready")
            self.port = wait_for(self._listener_port, what="Envoy listener port")
        except BaseException:
            self.dump()
            self.stop()
            raise

    def _admin_address(self) -> str | None:
        if not self.alive():
            raise RuntimeError(f"envoy exited with {self.popen.returncode}")
        text = self.admin_path.read_text().strip() if self.admin_path.exists() else ""
        return text or None

    def _listener_port(self) -> int | None:
        listeners = get_json(f"{self.admin_url}/listeners?format=json")
        for status in listeners.get("listener_statuses", []):
            if status.get("name") == "ingress":
                return int(status["local_address"]["socket_address"]["port_value"])
        return None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stat(self, name: str) -> int:
        status, body = http_get(f"{self.admin_url}/stats?filter=^{name}$&format=json")
        for item in json.loads(body).get("stats", []):
            if item.get("name") == name:
                return int(item.get("value", 0))
        return 0


@dataclasses.dataclass
class Stack:
    upstream: FakeUpstream | None
    sidecar: SidecarProcess
    envoy: EnvoyProcess
    config_path: pathlib.Path
    workdir: pathlib.Path

    @property
    def url(self) -> str:
        return self.envoy.url


def write_config(workdir: pathlib.Path, document: dict[str, Any]) -> pathlib.Path:
    path = workdir / "llamaswap.yaml"
    path.write_text(yaml.safe_dump(document))
    parse_config(document)  # fail early, in the test, on a bad test config
    return path


def merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


@contextlib.contextmanager
def running_stack(workdir: pathlib.Path, config: dict[str, Any] | None = None, *, upstream_url: str | None = None,
                  sidecar_env: dict[str, str] | None = None, otlp_endpoint: str | None = None,
                  fake: FakeUpstream | None = None) -> Iterator[Stack]:
    """A fake upstream (`fake`, a default one, or none with `upstream_url`), the sidecar and Envoy,
    torn down whatever happens."""
    upstream = None if upstream_url else (fake or FakeUpstream()).started()
    sidecar = envoy = None
    try:
        document = merge({
            "listen": {"http": "127.0.0.1:0", "grpc": "127.0.0.1:0", "admin": "127.0.0.1:0"},
            "upstream": {"url": upstream_url or (upstream.url if upstream else ""), "modelsPollSeconds": 0},
            # Short leases: a lost grant is found within a second or two in every test.
            "envoy": {"leaseSeconds": 1.5},
        }, config or {})
        config_path = write_config(workdir, document)
        sidecar = SidecarProcess(config_path, workdir, env=sidecar_env)
        parsed = parse_config(document)
        bootstrap = build_bootstrap(parsed, grpc_port=sidecar.grpc_port, admin_port=sidecar.admin_port,
                                    envoy_admin_port=0, otlp_endpoint=otlp_endpoint)
        envoy = EnvoyProcess(bootstrap, workdir)
        stack = Stack(upstream, sidecar, envoy, config_path, workdir)
        failed = True
        try:
            yield stack
            failed = False
        finally:
            if failed:
                envoy.dump()
                sidecar.dump()
    finally:
        for part in (envoy, sidecar):
            if part is not None:
                with contextlib.suppress(Exception):
                    part.stop()
        if upstream is not None:
            upstream.close()


def activity_records(admin_url: str, wanted: set[str]) -> dict[str, dict[str, Any]] | None:
    """The sidecar's recent activity records by request id, once every wanted one is there (for
    polling: a record is written when its exchange's end reaches the sidecar)."""
    by_id = {record["request_id"]: record for record in get_json(f"{admin_url}/activity")["activity"]}
    return by_id if wanted <= set(by_id) else None


def metric_samples(text: str) -> dict[str, float]:
    """A Prometheus text exposition as {series with its labels: value}, e.g.
    {'llamaswap_requests_total{outcome="served"}': 1.0}."""
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            series, _, value = line.rpartition(" ")
            samples[series] = float(value)
    return samples


def free_port() -> int:
    """A port that was free a moment ago (for processes that cannot bind port 0)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


if __name__ == "__main__":
    # `python e2e/harness.py PORT`: a fake upstream as its own process (for `llamaswap up`).
    # A SIGTERM to the process may reach any thread that does not block it; a Python handler
    # would then run only when the main thread next runs bytecode, which it never does while
    # blocked on a lock (it stayed up for good that way). So every thread blocks SIGTERM and
    # SIGINT (the server's thread inherits this mask) and the main thread waits for them.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    server = FakeUpstream(int(sys.argv[1])).started()
    signal.sigwait({signal.SIGTERM, signal.SIGINT})
    server.close()
