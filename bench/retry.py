"""What routing.retryGraceSeconds costs a request: with a grace period Envoy's Check carries the
body's first 256 KiB and four more headers, and the sidecar hashes them (runtime/kept.py).

Part 1, the sidecar's own work per Check, in this process: parse a serialized CheckRequest and
read it as the adapter does (`Authorization._arrival`), with the digest (grace on) and without it
(grace 0: today's Check, no body: the floor), at each body size. Medians of interleaved batches.
The digest is computed only when read (a kept place exists, or the client leaves while waiting:
`Ticket.retry_key`); grace on here computes it every time, so it is the cost of one that is read.

Part 2, end to end (unless --no-stack): one sequential aiohttp client, interleaved rounds, to the
same instant upstream through bare Envoy, the floor (a do-nothing sidecar on the grace-0 chain),
llamaswap with `retryGraceSeconds: 0`, and llamaswap with the default grace period; the added
p50 is the median over rounds of the difference to bare Envoy in the same round, and each
path's sidecar and Envoy CPU per request (/proc).

Run: .venv/bin/python bench/retry.py [--quick] [--rounds N] [--seconds S] [--body-bytes N ...] [--no-stack]
"""

from __future__ import annotations

import argparse
import asyncio
import pathlib
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "e2e"))

from clients import chat_body, session  # noqa: E402
from procfs import cpu_seconds, machine_load  # noqa: E402
from stack import bench_stack, merge_config, BENCH_CONFIG  # noqa: E402

from llamaswap._proto.envoy.service.auth.v3 import external_auth_pb2 as authz_pb2  # noqa: E402
from llamaswap.adapters.ext_authz import Authorization  # noqa: E402
from llamaswap.config import parse_config  # noqa: E402
from llamaswap.envoy.contract import MAX_DIGESTED_BODY  # noqa: E402
from llamaswap.runtime.coordinator import Coordinator  # noqa: E402

DEFAULT_BODIES = (1024, 64 * 1024, 1024 * 1024)


class _Context:
    def peer(self) -> str:
        return "ipv4:127.0.0.1:1"

    def invocation_metadata(self) -> tuple[()]:
        return ()


def _check_bytes(body: bytes, *, grace: bool) -> bytes:
    """A Check as Envoy sends it with and without a grace period (what the bootstrap allows)."""
    request = authz_pb2.CheckRequest()
    http = request.attributes.request.http
    http.id, http.method, http.path = "1234567890", "POST", "/v1/chat/completions"
    http.headers["x-request-id"] = "0d4c8b1e-5b8a-4e53-9f0e-1c2d3e4f5a6b"
    http.headers["x-llamaswap-priority"] = "interactive"
    request.attributes.metadata_context.filter_metadata["llamaswap"].fields["model"].string_value = "model-a"
    request.attributes.source.address.socket_address.address = "127.0.0.1"
    if grace:
        http.headers["authorization"] = "Bearer sk-0123456789abcdef0123456789abcdef"
        http.headers["content-length"] = str(len(body))
        http.headers["x-stainless-retry-count"] = "0"
        http.raw_body = body[:MAX_DIGESTED_BODY]
    return request.SerializeToString()


def sidecar_work(bodies: list[int], batches: int, per_batch: int) -> None:
    print("## the sidecar's work per Check: parse + read (+ digest with a grace period), in this process")
    print()
    print("| body | Check bytes, grace 0 | Check bytes, grace on | grace 0 (floor) | grace on | added |")
    print("|---|---|---|---|---|---|")
    readers = {grace: Authorization(Coordinator(parse_config({"routing": {"retryGraceSeconds": 10 if grace else 0}})))
               for grace in (False, True)}
    for size in bodies:
        body = chat_body(pad_bytes=size)
        checks = {grace: _check_bytes(body, grace=grace) for grace in (False, True)}
        times: dict[bool, list[float]] = {False: [], True: []}
        for index in range(batches):
            for grace in ((False, True) if index % 2 == 0 else (True, False)):
                data, reader = checks[grace], readers[grace]
                start = time.perf_counter_ns()
                for _ in range(per_batch):
                    arrival = reader._arrival(authz_pb2.CheckRequest.FromString(data), _Context())  # type: ignore[arg-type]
                    key = arrival.retry_digest() if arrival.retry_digest is not None else None
                times[grace].append((time.perf_counter_ns() - start) / per_batch / 1000)
        assert key is not None
        floor, on = statistics.median(times[False]), statistics.median(times[True])
        print(f"| {len(body):,} B | {len(checks[False]):,} | {len(checks[True]):,} | {floor:.1f} us | {on:.1f} us "
              f"| {on - floor:+.1f} us |")
    print()


async def _round(url: str, body: bytes, seconds: float) -> dict[str, Any]:
    headers = {"content-type": "application/json", "x-llamaswap-priority": "interactive",
               "authorization": "Bearer sk-bench"}
    latencies: list[float] = []
    async with session() as client:
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            start = time.perf_counter()
            async with client.post(f"{url}/v1/chat/completions", data=body, headers=headers) as response:
                await response.read()
                if response.status != 200:
                    raise RuntimeError(f"{url}: {response.status}")
            latencies.append((time.perf_counter() - start) * 1000)
    latencies.sort()
    return {"p50": statistics.median(latencies), "p99": latencies[int(0.99 * (len(latencies) - 1))],
            "requests": len(latencies)}


def end_to_end(bodies: list[int], rounds: int, seconds: float) -> None:
    from harness import running_stack

    print("## end to end: one sequential client, instant upstream")
    print()
    with bench_stack({"routing": {"retryGraceSeconds": 0}}, bare=True, null=True) as bench:
        assert bench.bare is not None and bench.null is not None and bench.null.envoy is not None
        workdir = bench.workdir / "grace"
        workdir.mkdir()
        with running_stack(workdir, merge_config(BENCH_CONFIG, {}), upstream_url=bench.upstream.url) as graced:
            paths = {"bare Envoy": (bench.bare_url, None, bench.bare.popen.pid),
                     "floor (do-nothing sidecar, grace 0 chain)": (bench.null.url, bench.null.pid,
                                                                    bench.null.envoy.popen.pid),
                     "llamaswap, retryGraceSeconds: 0": (bench.sidecar_url, bench.sidecar_pid, bench.envoy_pid),
                     "llamaswap, retryGraceSeconds: 10 (default)": (graced.url, graced.sidecar.popen.pid,
                                                                    graced.envoy.popen.pid)}
            print("| body | path | p50 | +p50 | +p99 | sidecar CPU/req | Envoy CPU/req |")
            print("|---|---|---|---|---|---|---|")
            for size in bodies:
                body = chat_body(pad_bytes=size)
                for url, _, _ in paths.values():  # warm-up
                    asyncio.run(_round(url, body, 0.5))
                results: dict[str, list[dict[str, Any]]] = {name: [] for name in paths}
                for index in range(rounds):
                    order = list(paths) if index % 2 == 0 else list(reversed(paths))
                    for name in order:
                        url, sidecar, envoy = paths[name]
                        before = {pid: cpu_seconds(pid) for pid in (sidecar, envoy) if pid is not None}
                        result = asyncio.run(_round(url, body, seconds))
                        result["cpu"] = {pid: 1e6 * (cpu_seconds(pid) - before[pid]) / result["requests"]
                                         for pid in before}
                        results[name].append(result)
                bare = results["bare Envoy"]
                for name, (_, sidecar, envoy) in paths.items():
                    runs = results[name]
                    added = statistics.median(r["p50"] - b["p50"] for r, b in zip(runs, bare))
                    added99 = statistics.median(r["p99"] - b["p99"] for r, b in zip(runs, bare))
                    side = f"{statistics.median(r['cpu'][sidecar] for r in runs):.0f} us" if sidecar else "-"
                    print(f"| {len(body):,} B | {name} | {statistics.median(r['p50'] for r in runs):.2f} ms "
                          f"| {added:+.2f} ms | {added99:+.2f} ms | {side} "
                          f"| {statistics.median(r['cpu'][envoy] for r in runs):.0f} us |")
    print()
    print(f"load average at the end: {machine_load()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3 rounds x 2 s")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--body-bytes", type=int, nargs="+", default=list(DEFAULT_BODIES))
    parser.add_argument("--no-stack", action="store_true", help="only the in-process part")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.seconds = 3, 2.0
    print(f"load average at the start: {machine_load()}")
    sidecar_work(args.body_bytes, batches=7 if args.quick else 15, per_batch=200)
    if not args.no_stack:
        end_to_end(args.body_bytes, args.rounds, args.seconds)


if __name__ == "__main__":
    main()
