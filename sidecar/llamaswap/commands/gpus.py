"""`llamaswap up --gpus N`: N llama-servers made from the one upstream command, one per GPU.

Server i (named gpu<i>) runs the command of `upstream.command` (or the built-in llama-server)
with ``--port`` set to the port of upstream.url + i, under ``env CUDA_VISIBLE_DEVICES=<device i>``
(so it sees its own GPU; without NVIDIA GPUs the variable changes nothing), and with
``--threads max(1, cores // N)`` unless the command or LLAMA_ARG_THREADS sets threads (N
servers on a small CPU would otherwise each start a thread per core and fight over them). The
result is a configuration document with an ``upstreams:`` list, so the sidecar, the Envoy
bootstrap, ``--print-config`` and a reload all see every server; slots stay upstream.slots.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from llamaswap.config import ConfigError, Problem
from llamaswap.config.llama_command import PORT_FLAG, THREADS_ENV, THREADS_FLAGS, flag_value, with_flag_value

CUDA_DEVICES_ENV = "CUDA_VISIBLE_DEVICES"


def gpu_name(index: int) -> str:
    return f"gpu{index}"


def usable_cores() -> int:
    """The CPUs this process may run on (its affinity, which a container's cpuset narrows)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def threads_each(gpus: int, cores: int) -> int:
    """Each server's share of the cores: N servers together use each core once."""
    return max(1, cores // gpus)


def sets_threads(command: Sequence[str], environ: Mapping[str, str]) -> bool:
    """Whether the user chose llama-server's threads: -t/--threads on the command, or LLAMA_ARG_THREADS."""
    return flag_value(command, THREADS_FLAGS) is not None or bool(environ.get(THREADS_ENV))


def _with_port(command: Sequence[str], port: int) -> list[str]:
    """The command with its --port replaced by ``port``, or --port appended (llama-server's own
    default, 8080, is no one's port here)."""
    result, replaced = with_flag_value(command, (PORT_FLAG,), str(port))
    return result if replaced else [*result, PORT_FLAG, str(port)]


def server_command(command: Sequence[str], *, port: int, device: str, threads: int | None) -> tuple[str, ...]:
    """One server's command line: on ``port``, seeing GPU ``device``, with ``threads`` (None: as given)."""
    argv = _with_port(command, port)
    if threads is not None:
        argv += [THREADS_FLAGS[-1], str(threads)]
    return ("env", f"{CUDA_DEVICES_ENV}={device}", *argv)


@functools.cache  # asked again by each reload; the machine's GPUs stay
def nvidia_gpu_count() -> int | None:
    """The GPUs `nvidia-smi -L` lists; None where there is no nvidia-smi or it fails."""
    binary = shutil.which("nvidia-smi")
    if binary is None:
        return None
    try:
        done = subprocess.run([binary, "-L"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    return sum(1 for line in done.stdout.splitlines() if line.startswith("GPU "))


def devices(gpus: int, environ: Mapping[str, str], gpu_count: int | None) -> list[str]:
    """The device each server sees: the i-th of the CUDA_VISIBLE_DEVICES that `up` was given,
    else GPU i. Refused when there are fewer GPUs than servers (a server without its own GPU
    would share another's or quietly run on the CPU)."""
    given = environ.get(CUDA_DEVICES_ENV)
    if given is not None and given.strip():
        listed = [item.strip() for item in given.split(",") if item.strip()]
        if len(listed) < gpus:
            raise _refused("--gpus", f"{gpus} servers, and {CUDA_DEVICES_ENV}={given} lists {len(listed)} device"
                                     f"{'' if len(listed) == 1 else 's'}: list {gpus} there (one per server), or ask "
                                     f"for --gpus {len(listed)}")
        return listed[:gpus]
    if gpu_count is not None and 0 < gpu_count < gpus:
        raise _refused("--gpus", f"{gpus} servers, and nvidia-smi lists {gpu_count} GPU"
                                 f"{'' if gpu_count == 1 else 's'}: ask for --gpus {gpu_count} or fewer, or list your "
                                 f"servers under upstreams (each its own command) to share a GPU on purpose")
    return [str(index) for index in range(gpus)]


def _refused(path: str, message: str) -> ConfigError:
    return ConfigError([Problem(path, message)])


def refuse_beside_upstreams(document: Any, gpus: int, source: str) -> None:
    """--gpus makes the list of upstreams: a file that has its own keeps it, and --gpus is an error."""
    if isinstance(document, Mapping) and document.get("upstreams") is not None:
        raise _refused("upstreams", f"{source} lists its upstreams, and --gpus {gpus} would make its own list: leave "
                                    f"--gpus out (`up` starts the command of each entry that has one), or remove "
                                    f"upstreams and give one upstream.command for --gpus to start {gpus} times")


def _url_with_port(url: str, port: int) -> str:
    parts = urlsplit(url)
    host = parts.hostname or ""
    host = f"[{host}]" if ":" in host else host
    return urlunsplit(parts._replace(netloc=f"{host}:{port}"))


def gpus_document(document: Mapping[str, Any], *, url: str, command: Sequence[str], gpus: int, source: str,
                  environ: Mapping[str, str], cores: int, gpu_count: int | None) -> dict[str, Any]:
    """The configuration document of `up --gpus N` (N >= 2): ``document`` with upstream.url and
    command (``url``, ``command``: the effective ones, the built-in's where the file names none)
    made into an ``upstreams:`` list of N servers, gpu0..gpu<N-1>."""
    refuse_beside_upstreams(document, gpus, source)
    if not command:
        raise _refused("upstream.command", f"is not set in {source}, and --gpus {gpus} starts {gpus} servers from it "
                                           f"(upstream.url alone names a server `up` does not start): give "
                                           f"upstream.command, a llama-server command line, or list your running "
                                           f"servers under upstreams (name and url each) and leave --gpus out")
    port = urlsplit(url).port
    if port is None:
        raise _refused("upstream.url", f"{url} names no port, and with --gpus server i listens on that port + i: "
                                       f"give the port (e.g. http://127.0.0.1:8081)")
    if port + gpus - 1 > 65535:
        raise _refused("upstream.url", f"port {port} + {gpus - 1} is past 65535: give a lower port for --gpus {gpus}")
    seen = devices(gpus, environ, gpu_count)
    threads = None if sets_threads(command, environ) else threads_each(gpus, cores)
    upstream = {key: value for key, value in (document.get("upstream") or {}).items() if key not in ("url", "command")}
    entries = [{"name": gpu_name(index), "url": _url_with_port(url, port + index),
                "command": list(server_command(command, port=port + index, device=seen[index], threads=threads))}
               for index in range(gpus)]
    return {**document, "upstream": upstream, "upstreams": entries}


def describe(gpus: int, command: Sequence[str], environ: Mapping[str, str], cores: int) -> str:
    """What `up` says it does for --gpus N: ports, devices and threads."""
    if sets_threads(command, environ):
        threads = "the threads the command sets"
    else:
        threads = f"--threads {threads_each(gpus, cores)} each ({cores} core{'' if cores == 1 else 's'} / {gpus})"
    return f"--gpus {gpus}: {gpus} llama-servers, each on its own port and {CUDA_DEVICES_ENV}, with {threads}"
