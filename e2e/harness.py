"""The end-to-end harness: the real Envoy binary, the real sidecar process, and a fake
(e2e/fake_llama.py) or real llama-server, all on 127.0.0.1 with ports chosen by the OS.

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
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import yaml

from fake_llama import FakeLlamaServer
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
    cause = f": {last_error!r}" if last_error else ""
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}{cause}")


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
    cause = f": {last_error!r}" if last_error else ""
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}{cause}")


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
                 env: dict[str, str] | None = None, name: str = "sidecar", command: list[str] | None = None) -> None:
        """`command`: what runs `llamaswap` (default `sidecar_command()`)."""
        self.ports_file = workdir / f"{name}-ports.json"
        self.ports_file.unlink(missing_ok=True)
        super().__init__(name, [*(command or sidecar_command()), "serve", "-c", str(config_path), "--ports-file",
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
                 concurrency: int = 2, extra_args: Sequence[str] = ()) -> None:
        self.config_path = workdir / f"{name}.yaml"
        self.config_path.write_text(render_bootstrap(bootstrap))
        self.admin_path = workdir / f"{name}-admin-address"
        self.admin_path.unlink(missing_ok=True)
        super().__init__(name, [envoy_binary(), "-c", str(self.config_path), "--admin-address-path",
                                str(self.admin_path), "--disable-hot-restart", "--concurrency", str(concurrency),
                                "--log-level", os.environ.get("LLAMASWAP_ENVOY_LOG_LEVEL", "warning"),
                                *extra_args],
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
    upstream: FakeLlamaServer | None
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
                  fake: FakeLlamaServer | None = None) -> Iterator[Stack]:
    """A fake llama-server (`fake`, a default one, or none with `upstream_url`), the sidecar and
    Envoy, torn down whatever happens. A test in which asking the fake loaded a model fails."""
    upstream = None if upstream_url else (fake or FakeLlamaServer()).started()
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
            if upstream is not None and upstream.autoloaded:
                raise AssertionError(f"asking the upstream (GET /slots, /props or /metrics ?model=) loaded "
                                     f"{upstream.autoloaded}: llama-server would have swapped models behind the "
                                     "scheduler")
            failed = False
        finally:
            # A test may have started a part again (a killed sidecar or Envoy): those are the stack's now.
            envoy, sidecar = stack.envoy, stack.sidecar
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


# Where `free_port` looks: below the kernel's ephemeral range, whose ports any outgoing connection
# (a client's, Envoy's, the sidecar's) may take between the test's pick and the process's bind (a
# sidecar once found its listen.admin port taken that way).
FIXED_PORTS_FROM = 10_000
_FIXED_PORT_TRIES = 200


def _ephemeral_low() -> int:
    try:
        return int(pathlib.Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768  # Linux's default


def free_port() -> int:
    """A port that was free a moment ago (for processes that cannot bind port 0), outside the
    ephemeral range where there is room (else any free one)."""
    import random
    import socket

    low = _ephemeral_low()
    for _ in range(_FIXED_PORT_TRIES if low > FIXED_PORTS_FROM else 0):
        port = random.randrange(FIXED_PORTS_FROM, low)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]

