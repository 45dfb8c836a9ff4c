"""Shared pieces of the data-path benchmarks (overhead.py, dispatch.py, queued.py).

They reuse the end-to-end harness (`e2e/harness.py`): the real Envoy binary, the real
sidecar process (`python -m llamaswap serve`) and the FakeUpstream. The upstream runs in a
process of its own (`python bench/common.py upstream`), so the client's event loop and the
upstream's do not share a GIL; it records each hit's start and end (CLOCK_MONOTONIC) and
answers a few commands on stdin.

"Bare Envoy" is the same bootstrap (`build_bootstrap`) with json_to_metadata, ext_authz and
the gRPC access log taken out, in front of the same upstream: the baseline every figure is
compared with. "The floor" is the same bootstrap in front of a do-nothing grpc.aio server with
the same protocol (a ticket in the Check's dynamic metadata, the release from the access log).
Both are measured in the same run as llamaswap, because this machine is shared and noisy.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import os
import re
import pathlib
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import aiohttp
import yaml

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "e2e"))

from harness import (  # noqa: E402 - after the path set-up
    EnvoyProcess,
    FakeUpstream,
    Stack,
    http_get,
    running_stack,
    wait_for,
)
from llamaswap.config import parse_config  # noqa: E402
from llamaswap.envoy.bootstrap import EXT_AUTHZ, JSON_TO_METADATA, build_bootstrap  # noqa: E402

CLK_TCK = os.sysconf("SC_CLK_TCK")


# -- limits, /proc -------------------------------------------------------------------------


def raise_nofile() -> int:
    """Raise RLIMIT_NOFILE to the hard limit (children spawned afterwards inherit it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def rss_bytes(pid: int) -> int:
    """VmRSS of a process, in bytes."""
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (all its threads)."""
    text = pathlib.Path(f"/proc/{pid}/stat").read_text()
    fields = text[text.rindex(")") + 2:].split()  # after "pid (comm) "
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime (fields 14, 15)


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds so far per group of a Python sidecar's threads (/proc/PID/task/*/stat):
    `main` is the event loop's thread (all of the sidecar's Python code and grpc.aio's Cython
    callbacks), `poller` the other Python thread(s) (grpc.aio's completion-queue poller),
    `grpc core` gRPC's C threads (event_engine: sockets, HTTP/2), `other` the rest (timers)."""
    groups: dict[str, float] = {"main": 0.0, "poller": 0.0, "grpc core": 0.0, "other": 0.0}
    for task in pathlib.Path(f"/proc/{pid}/task").iterdir():
        try:
            comm = (task / "comm").read_text().strip()
            text = (task / "stat").read_text()
        except OSError:
            continue  # the thread ended
        fields = text[text.rindex(")") + 2:].split()
        seconds = (int(fields[11]) + int(fields[12])) / CLK_TCK
        if task.name == str(pid):
            group = "main"
        elif comm.startswith("python"):
            group = "poller"
        elif comm.startswith("event_engine") or comm.startswith("grpc"):
            group = "grpc core"
        else:
            group = "other"
        groups[group] += seconds
    return groups


def machine_load() -> str:
    try:
        return " ".join(pathlib.Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


# -- statistics ------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100]."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def describe_ms(values_ns: Sequence[float]) -> str:
    ms = [v / 1e6 for v in values_ns]
    return (f"n={len(ms)} p50 {percentile(ms, 50):.2f} p90 {percentile(ms, 90):.2f} p99 {percentile(ms, 99):.2f} "
            f"max {max(ms):.2f} mean {statistics.fmean(ms):.2f} ms")


# -- the upstream, in a process of its own ----------------------------------------------------


class UpstreamProcess:
    """FakeUpstream (e2e/harness.py) in a child process, driven over stdin/stdout."""

    def __init__(self, log_dir: pathlib.Path) -> None:
        self._stderr = open(log_dir / "upstream.log", "wb")  # noqa: SIM115 - closed in close()
        self.popen = subprocess.Popen([sys.executable, __file__, "upstream"], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=self._stderr, text=True, bufsize=1)
        self._lock = threading.Lock()
        self.port = int(self._ask("port"))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.popen.pid

    def _ask(self, command: str) -> str:
        assert self.popen.stdin is not None and self.popen.stdout is not None
        with self._lock:
            self.popen.stdin.write(command + "\n")
            self.popen.stdin.flush()
            line = self.popen.stdout.readline()
        if not line:
            raise RuntimeError(f"upstream process died (command {command!r})")
        return line.strip()

    def hits(self) -> list[dict[str, Any]]:
        """[{id, start_ns, end_ns}] in arrival order."""
        return json.loads(self._ask("hits"))

    def clear(self) -> None:
        self._ask("clear")

    def release(self, test_id: str) -> None:
        self._ask(f"release {test_id}")

    def count(self) -> int:
        return int(self._ask("count"))

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._ask("quit")
        try:
            self.popen.wait(10)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(10)
        self._stderr.close()


def _upstream_main() -> None:
    server = FakeUpstream().started()
    for line in sys.stdin:
        command, _, argument = line.strip().partition(" ")
        if command == "port":
            answer: Any = server.port
        elif command == "hits":
            with server.lock:
                answer = json.dumps([{"id": h.test_id, "start_ns": h.start_ns, "end_ns": h.end_ns}
                                     for h in server.hits])
        elif command == "count":
            with server.lock:
                answer = len(server.hits)
        elif command == "clear":
            with server.lock:
                server.hits.clear()
                server.max_active = server.active
            answer = "ok"
        elif command == "release":
            server.release(argument)
            answer = "ok"
        elif command == "quit":
            sys.stdout.write("bye\n")
            sys.stdout.flush()
            break
        else:
            answer = f"unknown command {command!r}"
        sys.stdout.write(f"{answer}\n")
        sys.stdout.flush()
    server.close()


# -- the floor: a do-nothing sidecar for the same chain ------------------------------------------


def _null_sidecar_main(ports_file: str, serial: bool) -> None:
    """The least a Python sidecar on this chain can do, as a floor for the figures.

    The same protocol as llamaswap, and nothing else: a grpc.aio server with the two services
    Envoy calls (ext_authz Check, the access-log stream). Plain: every Check is answered OK at
    once with a ticket in dynamic metadata (so Envoy's access log reports the exchange, as it
    does for llamaswap's grants). Serial (`--serial`): a toy FIFO that holds each Check until
    the GPU is free and frees it on the access log's final entry for the running ticket; no
    priorities, telemetry, logging or bookkeeping.
    """
    import collections
    import secrets

    import grpc
    from google.protobuf import struct_pb2
    from google.rpc import code_pb2, status_pb2

    from llamaswap._proto.envoy.data.accesslog.v3 import accesslog_pb2
    from llamaswap._proto.envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
    from llamaswap._proto.envoy.service.auth.v3 import external_auth_pb2 as authz_pb2
    from llamaswap._proto.envoy.service.auth.v3 import external_auth_pb2_grpc as authz_grpc
    from llamaswap.envoy.contract import GRANT_NAMESPACE, TICKET_KEY

    ok = status_pb2.Status(code=code_pb2.OK)
    waiting: collections.deque[tuple[str, asyncio.Future[None]]] = collections.deque()
    running: list[str | None] = [None]

    def grant(token: str) -> authz_pb2.CheckResponse:
        metadata = struct_pb2.Struct()
        metadata.fields[TICKET_KEY].string_value = token
        return authz_pb2.CheckResponse(status=ok, ok_response=authz_pb2.OkHttpResponse(), dynamic_metadata=metadata)

    def pump() -> None:
        while running[0] is None and waiting:
            token, future = waiting.popleft()
            if not future.done():  # a cancelled Check (its client left) is skipped
                running[0] = token
                future.set_result(None)

    # BENCH_CAPTURE=DIR: keep the last Check and final access-log message Envoy sent, as bytes
    # (bench/hotpath.py replays them; the sidecar's protos are trimmed, unknown fields are kept).
    capture = os.environ.get("BENCH_CAPTURE")

    class Authorization(authz_grpc.AuthorizationServicer):
        async def Check(self, request, context):  # noqa: N802
            token = secrets.token_urlsafe(18)
            if capture:
                pathlib.Path(capture, "check.bin").write_bytes(request.SerializeToString())
            if serial:
                future = asyncio.get_running_loop().create_future()
                waiting.append((token, future))
                pump()
                await future
            return grant(token)

    class AccessLogs(als_pb2_grpc.AccessLogServiceServicer):
        async def StreamAccessLogs(self, request_iterator, context):  # noqa: N802
            async for message in request_iterator:
                for entry in message.http_logs.log_entry:
                    common = entry.common_properties
                    if common.access_log_type == accesslog_pb2.DownstreamPeriodic:
                        continue
                    if capture:
                        pathlib.Path(capture, "access-log.bin").write_bytes(message.SerializeToString())
                    token = common.metadata.filter_metadata[GRANT_NAMESPACE].fields[TICKET_KEY].string_value
                    if token and running[0] == token:
                        running[0] = None
                        pump()
            return als_pb2.StreamAccessLogsResponse()

    async def serve() -> None:
        server = grpc.aio.server(options=[("grpc.max_concurrent_streams", 1 << 30), ("grpc.so_reuseport", 0),
                                          ("grpc.server.max_pending_requests", 1 << 20),
                                          ("grpc.server.max_pending_requests_hard_limit", 1 << 20)])
        authz_grpc.add_AuthorizationServicer_to_server(Authorization(), server)
        als_pb2_grpc.add_AccessLogServiceServicer_to_server(AccessLogs(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        tmp = f"{ports_file}.tmp"
        pathlib.Path(tmp).write_text(json.dumps({"grpc": port}))
        os.replace(tmp, ports_file)
        await server.wait_for_termination()

    asyncio.run(serve())


class NullSidecar:
    """The do-nothing (or toy FIFO) sidecar in a child process, and an Envoy (same bootstrap) in front."""

    def __init__(self, workdir: pathlib.Path, document: dict[str, Any], env: dict[str, str] | None = None,
                 *, serial: bool = False) -> None:
        from harness import Process

        name = "toy-fifo" if serial else "floor"
        ports_file = workdir / f"{name}-ports.json"
        ports_file.unlink(missing_ok=True)
        self.process = Process(name, [sys.executable, __file__, "null-sidecar", str(ports_file),
                                      *(["--serial"] if serial else [])],
                               workdir / f"{name}.log", env)
        self.envoy: EnvoyProcess | None = None
        try:
            port = wait_for(lambda: ports_file.exists() and json.loads(ports_file.read_text())["grpc"],
                            what=f"{name} sidecar port")
            bootstrap = build_bootstrap(parse_config(document), grpc_port=port, admin_port=1, envoy_admin_port=0)
            self.envoy = EnvoyProcess(bootstrap, workdir, name=f"envoy-{name}")
        except BaseException:
            self.process.dump()
            self.close()
            raise

    @property
    def pid(self) -> int:
        return self.process.popen.pid

    @property
    def url(self) -> str:
        assert self.envoy is not None
        return self.envoy.url

    def close(self) -> None:
        if self.envoy is not None:
            self.envoy.stop()
        self.process.stop()


# -- the stacks -------------------------------------------------------------------------------


def bare_bootstrap(bootstrap: dict[str, Any]) -> dict[str, Any]:
    """The same bootstrap without json_to_metadata, ext_authz (and their per-route config) and the
    gRPC access log: buffer -> router, everything else as it was."""
    bare = copy.deepcopy(bootstrap)
    for listener in bare["static_resources"]["listeners"]:
        for chain in listener["filter_chains"]:
            for network_filter in chain["filters"]:
                hcm = network_filter["typed_config"]
                hcm["http_filters"] = [f for f in hcm["http_filters"] if f["name"] not in (JSON_TO_METADATA, EXT_AUTHZ)]
                hcm.pop("access_log", None)
                hcm.pop("access_log_options", None)
                for host in hcm["route_config"]["virtual_hosts"]:
                    for route in host["routes"]:
                        route.pop("typed_per_filter_config", None)
    return bare


# The production defaults where the e2e harness shortens them for its tests (leaseSeconds 1.5).
BENCH_CONFIG: dict[str, Any] = {"envoy": {"leaseSeconds": 3.0}}


class Bench:
    """Upstream process + llamaswap + Envoy (+ a bare Envoy, + the floor), torn down on exit."""

    def __init__(self, stack: Stack, upstream: UpstreamProcess, bare: EnvoyProcess | None, workdir: pathlib.Path,
                 null: NullSidecar | None = None):
        self.stack = stack
        self.upstream = upstream
        self.bare = bare
        self.workdir = workdir
        self.null = null

    @property
    def sidecar_url(self) -> str:
        return self.stack.url

    @property
    def bare_url(self) -> str:
        assert self.bare is not None
        return self.bare.url

    @property
    def sidecar_pid(self) -> int:
        return self.stack.sidecar.popen.pid

    @property
    def envoy_pid(self) -> int:
        return self.stack.envoy.popen.pid

    def envoy_stat(self, name: str) -> int:
        return self.stack.envoy.stat(name)


@contextlib.contextmanager
def sidecar_command(argv: list[str] | None) -> Iterator[None]:
    """Run llamaswap's sidecar with another command (e.g. under a profiler) while the block runs."""
    import harness

    if argv is None:
        yield
        return
    original = harness.sidecar_command
    harness.sidecar_command = lambda: list(argv)
    try:
        yield
    finally:
        harness.sidecar_command = original


@contextlib.contextmanager
def bench_stack(config: dict[str, Any] | None = None, *, bare: bool = True, null: bool = False,
                null_serial: bool = False, keep: str | None = None,
                sidecar_env: dict[str, str] | None = None, sidecar_argv: list[str] | None = None) -> Iterator[Bench]:
    """Start everything; logs go to a temporary folder (kept, and printed, if `keep`).

    `bare`: also a bare Envoy; `null`: also Envoy + the do-nothing sidecar (the floor), a toy
    FIFO one if `null_serial`; `sidecar_env`: extra environment for llamaswap's sidecar (the
    floor gets the same PYTHONPATH); `sidecar_argv`: llamaswap's sidecar command instead of
    `python -m llamaswap` (`serve ...` is appended)."""
    workdir = pathlib.Path(keep) if keep else pathlib.Path(tempfile.mkdtemp(prefix="llamaswap-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    upstream = UpstreamProcess(workdir)
    bare_envoy = None
    null_sidecar = None
    document_config = merge_config(BENCH_CONFIG, config or {})
    try:
        with sidecar_command(sidecar_argv), running_stack(workdir, document_config, upstream_url=upstream.url,
                                                          sidecar_env=sidecar_env) as stack:
            document = yaml.safe_load(stack.config_path.read_text())
            if null:
                null_sidecar = NullSidecar(workdir, document, serial=null_serial)
            if bare:
                bootstrap = build_bootstrap(parse_config(document), grpc_port=stack.sidecar.grpc_port,
                                            admin_port=stack.sidecar.admin_port, envoy_admin_port=0)
                bare_envoy = EnvoyProcess(bare_bootstrap(bootstrap), workdir, name="envoy-bare")
            try:
                yield Bench(stack, upstream, bare_envoy, workdir, null_sidecar)
            finally:
                if bare_envoy is not None:
                    bare_envoy.stop()
                if null_sidecar is not None:
                    null_sidecar.close()
    finally:
        upstream.close()
        if keep:
            print(f"logs kept in {workdir}")
        else:
            import shutil

            shutil.rmtree(workdir, ignore_errors=True)


def merge_config(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    from harness import merge

    return merge(copy.deepcopy(base), extra)


# -- client --------------------------------------------------------------------------------


def session(limit: int = 0) -> aiohttp.ClientSession:
    """An aiohttp session with no connection cap and no client-side timeout."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=limit, force_close=False),
                                 timeout=aiohttp.ClientTimeout(total=None, sock_connect=60))


def chat_body(model: str = "model-a", pad_bytes: int = 0) -> bytes:
    document = {"model": model, "messages": [{"role": "system", "content": "You are terse."},
                                              {"role": "user", "content": "hi" + "x" * pad_bytes}],
                "max_tokens": 16, "stream": False}
    return json.dumps(document).encode()


async def post(client: aiohttp.ClientSession, url: str, body: bytes,
               headers: dict[str, str]) -> tuple[int, dict[str, str]]:
    async with client.post(f"{url}/v1/chat/completions", data=body, headers=headers) as response:
        await response.read()
        return response.status, dict(response.headers)


# -- wrk: a load generator that costs the 2 cores little -------------------------------------------

_WRK_SCRIPT = """
local f = assert(io.open(os.getenv("BENCH_BODY_FILE"), "rb"))
wrk.method = "POST"
wrk.body = f:read("*all")
f:close()
wrk.headers["Content-Type"] = "application/json"
wrk.headers["x-llamaswap-priority"] = "interactive"
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    "WRK {\\"requests\\":%d,\\"duration_us\\":%d,\\"p50\\":%d,\\"p90\\":%d,\\"p99\\":%d,\\"max\\":%d," ..
    "\\"mean\\":%f,\\"errors\\":%d,\\"non2xx\\":%d}\\n",
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(90),
    latency:percentile(99), latency.max, latency.mean,
    e.connect + e.read + e.write + e.timeout, e.status))
end
"""


def wrk_available() -> bool:
    import shutil

    return shutil.which("wrk") is not None


def run_wrk(url: str, body: bytes, *, seconds: float, connections: int = 1, workdir: pathlib.Path) -> dict[str, Any]:
    """`wrk` POSTing `body` to /v1/chat/completions for `seconds`; requests, rps and latency
    percentiles (ms) from wrk's own histogram (microsecond resolution)."""
    script = workdir / "wrk-post.lua"
    if not script.exists():
        script.write_text(_WRK_SCRIPT)
    body_file = workdir / f"wrk-body-{len(body)}.json"
    if not body_file.exists():
        body_file.write_bytes(body)
    argv = ["wrk", "-t", str(min(connections, 2)), "-c", str(connections), "-d", f"{seconds:g}s",
            "--timeout", "10s", "-s", str(script), f"{url}/v1/chat/completions"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=seconds + 60,
                          env={**os.environ, "BENCH_BODY_FILE": str(body_file)}, check=False)
    line = next((x for x in done.stdout.splitlines() if x.startswith("WRK ")), None)
    if done.returncode != 0 or line is None:
        raise RuntimeError(f"wrk failed ({done.returncode}): {done.stdout[-2000:]} {done.stderr[-2000:]}")
    result = json.loads(line[4:])
    seconds_run = result["duration_us"] / 1e6
    return {"requests": result["requests"], "seconds": seconds_run, "rps": result["requests"] / seconds_run,
            "p50": result["p50"] / 1e3, "p90": result["p90"] / 1e3, "p99": result["p99"] / 1e3,
            "max": result["max"] / 1e3, "mean": result["mean"] / 1e3,
            "errors": result["errors"], "non2xx": result["non2xx"]}


# -- profiling -----------------------------------------------------------------------------


@contextlib.contextmanager
def profiled(pid: int, output: str | None, *, rate: int = 250) -> Iterator[None]:
    """py-spy record of `pid` while the block runs (if `output`); raw collapsed stacks.

    Extra py-spy flags come from $PYSPY_ARGS (e.g. `--native --threads --idle`)."""
    if not output:
        yield
        return
    py_spy = pathlib.Path(sys.executable).parent / "py-spy"
    extra = os.environ.get("PYSPY_ARGS", "").split()
    argv = [str(py_spy if py_spy.exists() else "py-spy"), "record", "-p", str(pid), "-o", output,
            "--format", "raw", "--rate", str(rate), *([] if "--native" in extra else ["--nonblocking"]), *extra]
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    time.sleep(1.0)  # let py-spy attach
    try:
        yield
    finally:
        process.send_signal(signal.SIGINT)
        try:
            _, err = process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            _, err = process.communicate()
        if process.returncode not in (0, -signal.SIGINT) or not pathlib.Path(output).exists():
            sys.stderr.write(f"py-spy exited {process.returncode}: {err.decode(errors='replace')}")
        print(f"profile: {output} (summary: .venv/bin/python bench/common.py profile {output})")


IDLE_LEAVES = ("EpollSelector.select", "epoll_wait", "select (selectors", "poll (libc")


def _function(frame: str) -> str:
    """`name (file:line)` -> `name (file)`: one entry per function, not per line."""
    return re.sub(r":\d+\)$", ")", frame)


def summarize_profile(path: str, top: int = 30, *, requests: int | None = None, rate: int = 250,
                      by_line: bool = False) -> str:
    """Self and inclusive shares per function from a py-spy raw (collapsed) file, without the
    samples whose leaf is the event loop waiting in epoll (idle). With `requests` (how many
    requests the profiled window served) and py-spy's sampling `rate`, also microseconds per
    request: samples / rate / requests, i.e. the wall time a thread spent there per request."""
    self_count: dict[str, int] = {}
    total_count: dict[str, int] = {}
    samples = idle = 0
    for line in pathlib.Path(path).read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack:
            continue
        count = int(count_text)
        frames = stack.split(";")
        if any(frames[-1].startswith(leaf) for leaf in IDLE_LEAVES):
            idle += count
            continue
        if not by_line:
            frames = [_function(frame) for frame in frames]
        samples += count
        seen: set[str] = set()
        for frame in frames:
            if frame not in seen:
                seen.add(frame)
                total_count[frame] = total_count.get(frame, 0) + count
        self_count[frames[-1]] = self_count.get(frames[-1], 0) + count
    per = f", {1e6 * samples / rate / requests:.0f} us per request" if requests else ""
    lines = [f"{samples} busy samples ({idle} more idle in epoll, left out){per}"]

    def row(frame: str, count: int) -> str:
        us = f" {1e6 * count / rate / requests:8.1f} us/req" if requests else ""
        return f"{100 * count / samples:6.2f}%{us}  {frame}"

    lines.append("-- self --")
    lines += [row(frame, count) for frame, count in sorted(self_count.items(), key=lambda kv: -kv[1])[:top]]
    lines.append("-- inclusive --")
    lines += [row(frame, count) for frame, count in sorted(total_count.items(), key=lambda kv: -kv[1])[:top]]
    return "\n".join(lines)


__all__ = [
    "BENCH_CONFIG", "Bench", "NullSidecar", "UpstreamProcess", "bare_bootstrap", "bench_stack", "chat_body",
    "cpu_seconds", "describe_ms", "http_get", "machine_load", "percentile", "post", "profiled", "raise_nofile",
    "rss_bytes", "run_wrk", "session", "sidecar_command", "summarize_profile", "thread_cpu", "wrk_available",
]


if __name__ == "__main__":
    if sys.argv[1:2] == ["upstream"]:
        _upstream_main()
    elif sys.argv[1:2] == ["null-sidecar"]:
        _null_sidecar_main(sys.argv[2], "--serial" in sys.argv[3:])
    elif sys.argv[1:2] == ["profile"]:
        import argparse

        parser = argparse.ArgumentParser(prog="common.py profile")
        parser.add_argument("file")
        parser.add_argument("top", nargs="?", type=int, default=30)
        parser.add_argument("--requests", type=int, help="requests served in the profiled window (for us/request)")
        parser.add_argument("--rate", type=int, default=250, help="py-spy's sampling rate (bench default 250)")
        parser.add_argument("--by-line", action="store_true", help="one entry per line, not per function")
        options = parser.parse_args(sys.argv[2:])
        print(summarize_profile(options.file, options.top, requests=options.requests, rate=options.rate,
                                by_line=options.by_line))
    else:
        sys.exit("usage: common.py upstream | null-sidecar PORTS_FILE [--serial] | profile FILE [TOP] [--requests N]")
