"""The sidecar's own hot path per request, timed in-process without gRPC or Envoy.

The real pieces, wired as `llamaswap serve` wires them (`serve.Sidecar`: the coordinator, the
activity log, telemetry from the environment, the HTTP upstream adapter against a FakeLlamaServer,
logging configured like the CLI, to a file as the harness does), are driven one request at a
time with the messages Envoy would send: a CheckRequest (the allowed headers, the model in
metadata_context) parsed from bytes, the Check handler (`Authorization._arrival`,
`Coordinator.admit`, which grants at once on an idle GPU, `granted_wire`: the OK's bytes,
which grpc.aio sends as they are), then a final access-log entry parsed from bytes and handled
as `AccessLogs.StreamAccessLogs` does (`ticket_of`, `report_of`, `Coordinator.report`), and a
loop turn for the observers.

Two passes: a clean one (each step timed as a whole) and a wrapped one, in which the
coordinator's and scheduler's inner methods and every observer call are timed (inclusive,
with about 0.3 us of wrapper cost each). What is left of the sidecar's CPU per request as
measured by bench/overhead.py is grpc.aio, asyncio and gRPC core, for the Check and the
access-log message.

Run: .venv/bin/python bench/hotpath.py [--requests N] [--sidecar-env K=V]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import functools
import os
import pathlib
import statistics
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "e2e"))

from fake_llama import FakeLlamaServer  # noqa: E402


class Context:
    """The bits of grpc.aio.ServicerContext the handlers read."""

    def __init__(self, peer: str) -> None:
        self._peer = peer

    def peer(self) -> str:
        return self._peer

    def invocation_metadata(self):  # Envoy without tracing: no traceparent
        return (("x-envoy-internal", "true"),)


def capture(workdir: pathlib.Path) -> tuple[bytes, bytes]:
    """A real CheckRequest and a real final access-log message, as the same bootstrap's Envoy
    sends them (captured by the floor sidecar, bench/floor.py, with BENCH_CAPTURE)."""
    import asyncio as _asyncio

    from clients import chat_body, post, session
    from stack import bench_stack

    os.environ["BENCH_CAPTURE"] = str(workdir)
    try:
        with bench_stack(bare=False, null=True) as bench:
            assert bench.null is not None

            async def send() -> None:
                async with session() as client:
                    for _ in range(3):
                        await post(client, bench.null.url, chat_body(),
                                   {"content-type": "application/json", "x-llamaswap-priority": "interactive"})
                    await _asyncio.sleep(0.5)

            _asyncio.run(send())
    finally:
        del os.environ["BENCH_CAPTURE"]
    return (workdir / "check.bin").read_bytes(), (workdir / "access-log.bin").read_bytes()


def check_bytes(template: bytes, index: int) -> bytes:
    from llamaswap._proto.envoy.service.auth.v3 import external_auth_pb2 as authz_pb2

    request = authz_pb2.CheckRequest.FromString(template)
    request.attributes.request.http.headers["x-request-id"] = f"6f1c2a9e-0b7d-4c1e-9a51-{index:012d}"
    return request.SerializeToString()


def access_log_bytes(template: bytes, ticket: str) -> bytes:
    from llamaswap._proto.envoy.service.accesslog.v3 import als_pb2
    from llamaswap.envoy.contract import GRANT_NAMESPACE, TICKET_KEY

    message = als_pb2.StreamAccessLogsMessage.FromString(template)
    for entry in message.http_logs.log_entry:
        entry.common_properties.metadata.filter_metadata[GRANT_NAMESPACE].fields[TICKET_KEY].string_value = ticket
    return message.SerializeToString()


class Timings:
    def __init__(self) -> None:
        self.ns: dict[str, int] = collections.defaultdict(int)
        self.calls: dict[str, int] = collections.defaultdict(int)

    def add(self, name: str, ns: int) -> None:
        self.ns[name] += ns
        self.calls[name] += 1

    def wrap(self, owner: object, method: str, label: str) -> None:
        original = getattr(owner, method)
        timings = self
        if asyncio.iscoroutinefunction(original):
            @functools.wraps(original)
            async def timed_async(*args, **kwargs):
                start = time.perf_counter_ns()
                try:
                    return await original(*args, **kwargs)
                finally:
                    timings.add(label, time.perf_counter_ns() - start)
            setattr(owner, method, timed_async)
        else:
            @functools.wraps(original)
            def timed(*args, **kwargs):
                start = time.perf_counter_ns()
                try:
                    return original(*args, **kwargs)
                finally:
                    timings.add(label, time.perf_counter_ns() - start)
            setattr(owner, method, timed)


async def drive(requests: int, wrapped: bool, upstream_url: str, templates: tuple[bytes, bytes]) -> tuple[Timings, int]:
    from llamaswap._proto.envoy.service.accesslog.v3 import als_pb2
    from llamaswap._proto.envoy.service.auth.v3 import external_auth_pb2 as authz_pb2
    from llamaswap.config import parse_config
    from llamaswap.commands.serve import Sidecar
    from llamaswap.adapters import access_log, ext_authz

    config = parse_config({"listen": {"http": "127.0.0.1:0", "grpc": "127.0.0.1:0", "admin": "127.0.0.1:0"},
                           "upstream": {"url": upstream_url, "modelsPollSeconds": 0}})
    sidecar = Sidecar(config)
    coordinator = sidecar.coordinator
    authz = ext_authz.Authorization(coordinator)
    timings = Timings()
    if wrapped:
        for part, methods in ((coordinator._grants, ("pump", "release", "finish", "_update_idle")),
                              (coordinator._publisher, ("changed", "publish", "observe")),
                              (coordinator._admitter, ("arm_expiry",))):
            for method in methods:
                timings.wrap(part, method, f"{type(part).__name__}.{method}")
        timings.wrap(coordinator._watchdogs, "arm", "Watchdogs.arm")
        for method in ("estimate_later", "_estimate"):
            timings.wrap(coordinator._forecast, method, f"Forecast.{method}")
        scheduler = coordinator.scheduler
        for method in ("enqueue", "next", "release", "band_stats"):
            timings.wrap(scheduler, method, f"Scheduler.{method}")
        fanout = coordinator._observer  # FanOut(activity, telemetry)
        for observer in fanout._observers:
            for method in ("enqueued", "dispatched", "finished", "queue_changed"):
                timings.wrap(observer, method, f"{type(observer).__name__}.{method}")
        timings.wrap(sidecar.activity, "record", "ActivityLog.record (the dict)")
        timings.wrap(sidecar.activity, "_write", "ActivityLog._write (JSON, its line to each destination)")
        timings.wrap(ext_authz, "model_of", "ext_authz.model_of")
        timings.wrap(ext_authz, "_decision_values", "ext_authz._decision_values (the headers' values)")
    context = Context("ipv4:127.0.0.1:51000")
    checks = [check_bytes(templates[0], index) for index in range(requests)]
    loop_turns = 0
    for index in range(requests):
        t0 = time.perf_counter_ns()
        request = authz_pb2.CheckRequest.FromString(checks[index])
        t1 = time.perf_counter_ns()
        arrival = authz._arrival(request, context)
        t2 = time.perf_counter_ns()
        ticket = await coordinator.admit(arrival)
        t3 = time.perf_counter_ns()
        ext_authz.granted_wire(ticket)  # the OK's bytes, as the Check serves them
        t4 = time.perf_counter_ns()
        timings.add("CheckRequest parse (grpc.aio does it)", t1 - t0)
        timings.add("Authorization._arrival", t2 - t1)
        timings.add("Coordinator.admit (grants at once)", t3 - t2)
        timings.add("ext_authz.granted_wire (the OK, serialized)", t4 - t3)
        t0 = time.perf_counter_ns()
        await asyncio.sleep(0)  # the deferred observers of the grant run here
        timings.add("loop turn after the grant (deferred observers)", time.perf_counter_ns() - t0)
        wire = access_log_bytes(templates[1], ticket.token)
        t0 = time.perf_counter_ns()
        message = als_pb2.StreamAccessLogsMessage.FromString(wire)
        t1 = time.perf_counter_ns()
        for entry in message.http_logs.log_entry:
            token = access_log.ticket_of(entry)
            report = access_log.report_of(entry) if token is not None else None
            t2 = time.perf_counter_ns()
            if token is not None and report is not None:
                coordinator.report(token, report)
            t3 = time.perf_counter_ns()
        timings.add("access-log message parse (grpc.aio does it)", t1 - t0)
        timings.add("access_log.ticket_of + report_of", t2 - t1)
        timings.add("Coordinator.report (release + pump)", t3 - t2)
        t0 = time.perf_counter_ns()
        await asyncio.sleep(0)  # the deferred observers of the end run here
        timings.add("loop turn after the release (deferred observers)", time.perf_counter_ns() - t0)
        loop_turns += 2
    await asyncio.sleep(0.1)
    for upstream in sidecar.upstreams:
        await upstream.close()
    sidecar.activity.close()
    sidecar.telemetry.shutdown()
    return timings, requests


def show(title: str, timings: Timings, requests: int) -> float:
    print(f"\n{title}")
    print("| step | calls/request | us/request |")
    print("|---|---|---|")
    total = 0.0
    for name, ns in sorted(timings.ns.items(), key=lambda kv: -kv[1]):
        us = ns / requests / 1e3
        print(f"| {name} | {timings.calls[name] / requests:.2f} | {us:.1f} |")
        total += us
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--warmup", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3, help="clean passes (the median of each step is shown)")
    parser.add_argument("--sidecar-env", action="append", default=[], metavar="KEY=VALUE",
                        help="environment for the sidecar's pieces, e.g. OTEL_SDK_DISABLED=true")
    args = parser.parse_args()
    for item in args.sidecar_env:
        key, _, value = item.partition("=")
        os.environ[key] = value
    import llamaswap

    print(f"llamaswap from {llamaswap.__file__}")
    log_path = os.path.join(tempfile.mkdtemp(prefix="llamaswap-hotpath-"), "sidecar.log")
    # Logging as the CLI sets it up, to a file as the harness does (its stderr is a file).
    sys.stderr = open(log_path, "a", buffering=1)  # noqa: SIM115 - for the whole run
    from llamaswap.commands.main import configure_logging

    configure_logging("INFO")
    templates = capture(pathlib.Path(log_path).parent)
    print(f"captured from Envoy: a CheckRequest of {len(templates[0])} bytes, a final access-log message of "
          f"{len(templates[1])} bytes")
    upstream = FakeLlamaServer().started()
    try:
        asyncio.run(drive(args.warmup, False, upstream.url, templates))
        clean: list[Timings] = []
        for _ in range(args.rounds):
            clean.append(asyncio.run(drive(args.requests, False, upstream.url, templates))[0])
        wrapped, n = asyncio.run(drive(args.requests, True, upstream.url, templates))
    finally:
        upstream.close()
    median = Timings()
    for name in clean[0].ns:
        median.ns[name] = int(statistics.median(t.ns[name] for t in clean))
        median.calls[name] = clean[0].calls[name]
    total = show(f"clean passes ({args.rounds} x {args.requests} requests, medians): each step as a whole",
                 median, args.requests)
    print(f"\nin all: {total:.1f} us per request of the sidecar's own Python and protobuf work "
          f"(of which the two parses and the serialize are grpc.aio's)")
    show(f"wrapped pass ({n} requests): inner methods and observers, inclusive (nested rows overlap)", wrapped, n)
    print(f"\nlog: {log_path}")


if __name__ == "__main__":
    try:
        main()
    except BaseException:
        # stderr is the sidecar's log file by now: say what failed where the caller reads.
        import traceback

        traceback.print_exc(file=sys.__stderr__)
        raise SystemExit(1) from None
