"""What the sidecar adds to a request when the GPU is idle and nobody waits.

The same requests go to an instant upstream through bare Envoy and through Envoy with the
sidecar (ext_proc + held ext_authz Check), one client at a time, in interleaved rounds
(bare, sidecar, sidecar, bare, ...) so both paths see the same machine noise. Prints the
latency of each path, the difference of their percentiles, the throughput ratio
(sidecar rps / bare rps) and the CPU each process spends per request. Last line:

    overhead: p50 +N.NN ms, p99 +N.NN ms, throughput ratio N.NN

With --floor a third path is measured in the same rounds: Envoy with the same two filters in
front of a do-nothing grpc.aio server (answers every message and Check at once): what the
protocol costs in Python before llamaswap does anything.

Run: .venv/bin/python bench/overhead.py [--quick] [--floor] [--rounds N] [--per-round N]
     [--clients N] [--body-bytes N] [--sidecar-env K=V] [--profile FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from common import (  # noqa: E402
    Bench,
    bench_stack,
    chat_body,
    cpu_seconds,
    describe_ms,
    machine_load,
    percentile,
    post,
    profiled,
    raise_nofile,
    session,
)


async def one_round(client, url: str, count: int, clients: int, body: bytes,
                    headers: dict[str, str]) -> tuple[list[int], float]:
    """`count` requests from `clients` sequential clients; latencies (ns) and elapsed seconds."""
    latencies: list[int] = []
    per_client = [count // clients + (1 if index < count % clients else 0) for index in range(clients)]

    async def worker(n: int) -> None:
        for _ in range(n):
            start = time.perf_counter_ns()
            status, _ = await post(client, url, body, headers)
            latencies.append(time.perf_counter_ns() - start)
            if status != 200:
                raise RuntimeError(f"{url}: HTTP {status}")

    start = time.perf_counter()
    await asyncio.gather(*(worker(n) for n in per_client))
    return latencies, time.perf_counter() - start


async def measure(bench: Bench, args: argparse.Namespace) -> None:
    body = chat_body(pad_bytes=args.body_bytes)
    headers = {"content-type": "application/json", "x-llamaswap-priority": "interactive"}
    paths = {"bare": bench.bare_url, "sidecar": bench.sidecar_url}
    pids = {"sidecar": bench.sidecar_pid, "envoy+sidecar": bench.envoy_pid, "envoy-bare": bench.bare.popen.pid,
            "upstream": bench.upstream.pid}
    if bench.null is not None:
        paths = {"bare": bench.bare_url, "null": bench.null.url, "sidecar": bench.sidecar_url}
        pids["null-sidecar"] = bench.null.pid
        pids["envoy+null"] = bench.null.envoy.popen.pid
    latencies: dict[str, list[int]] = {path: [] for path in paths}
    elapsed: dict[str, float] = {path: 0.0 for path in paths}
    ratios: list[float] = []
    p50_deltas: list[float] = []
    cpu: dict[str, dict[str, float]] = {path: {name: 0.0 for name in pids} for path in paths}

    async with contextlib.AsyncExitStack() as stack:
        clients = {path: await stack.enter_async_context(session()) for path in paths}
        for path, url in paths.items():  # warm-up: connections, code paths, Envoy's pools
            await one_round(clients[path], url, args.warmup, args.clients, body, headers)
        # A sanity check that the sidecar path is really scheduled.
        _, sidecar_headers = await post(clients["sidecar"], bench.sidecar_url, body, headers)
        if "x-llamaswap-band" not in {k.lower() for k in sidecar_headers}:
            raise RuntimeError("the sidecar path answered without x-llamaswap-* headers: not scheduled?")

        print(f"{'round':>5} " + " ".join(f"{path + ' p50':>12}" for path in paths)
              + " " + " ".join(f"{path + ' rps':>12}" for path in paths) + f" {'ratio':>6}")
        with profiled(bench.sidecar_pid, args.profile):
            for index in range(args.rounds):
                order = list(paths) if index % 2 == 0 else list(reversed(paths))
                round_rps: dict[str, float] = {}
                round_p50: dict[str, float] = {}
                for path in order:
                    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
                    lat, seconds = await one_round(clients[path], paths[path], args.per_round, args.clients, body,
                                                   headers)
                    for name, pid in pids.items():
                        cpu[path][name] += cpu_seconds(pid) - before[name]
                    latencies[path] += lat
                    elapsed[path] += seconds
                    round_rps[path] = len(lat) / seconds
                    round_p50[path] = percentile(lat, 50) / 1e6
                ratios.append(round_rps["sidecar"] / round_rps["bare"])
                p50_deltas.append(round_p50["sidecar"] - round_p50["bare"])
                print(f"{index + 1:>5} " + " ".join(f"{round_p50[path]:>12.3f}" for path in paths) + " "
                      + " ".join(f"{round_rps[path]:>12.0f}" for path in paths) + f" {ratios[-1]:>6.3f}")

    names = {"bare": "bare Envoy:          ", "null": "Envoy + null sidecar:", "sidecar": "Envoy + sidecar:     "}
    for path in paths:
        print(f"{names[path]} {describe_ms(latencies[path])}")
    bare = latencies["bare"]
    rps = {path: len(latencies[path]) / elapsed[path] for path in paths}
    added: dict[str, dict[int, float]] = {}
    for path in paths:
        if path == "bare":
            continue
        added[path] = {q: (percentile(latencies[path], q) - percentile(bare, q)) / 1e6 for q in (50, 90, 99)}
        label = "llamaswap sidecar" if path == "sidecar" else "do-nothing grpc.aio sidecar (the floor)"
        print(f"added by the {label}: p50 +{added[path][50]:.3f} ms, p90 +{added[path][90]:.3f} ms, "
              f"p99 +{added[path][99]:.3f} ms; throughput ratio {rps[path] / rps['bare']:.3f}")
    ratio = rps["sidecar"] / rps["bare"]
    print(f"per round (sidecar vs bare): p50 difference median {statistics.median(p50_deltas):+.3f}, "
          f"min {min(p50_deltas):+.3f}, max {max(p50_deltas):+.3f} ms; throughput ratio median "
          f"{statistics.median(ratios):.3f}, min {min(ratios):.3f}, max {max(ratios):.3f}")
    print("throughput: " + ", ".join(f"{path} {rps[path]:.0f} rps" for path in paths))
    for path in paths:
        n = len(latencies[path])
        shares = ", ".join(f"{name} {1e6 * seconds / n:.0f} us" for name, seconds in cpu[path].items() if seconds)
        print(f"CPU per request on the {path} path: {shares}")
    print(f"{args.clients} client(s), {args.rounds} rounds x {args.per_round} requests per path, "
          f"body {len(body)} bytes, load average {machine_load()}")
    print(f"overhead: p50 +{added['sidecar'][50]:.2f} ms, p99 +{added['sidecar'][99]:.2f} ms, "
          f"throughput ratio {ratio:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="4 rounds x 200 requests")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--per-round", type=int, default=1000, help="requests per path per round")
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--clients", type=int, default=1, help="concurrent sequential clients (the issue: 1)")
    parser.add_argument("--body-bytes", type=int, default=0, help="pad the prompt by this many bytes")
    parser.add_argument("--profile", help="py-spy the sidecar during the rounds into this raw file")
    parser.add_argument("--floor", action="store_true",
                        help="also measure Envoy + a do-nothing grpc.aio sidecar (the protocol's floor)")
    parser.add_argument("--sidecar-env", action="append", default=[], metavar="KEY=VALUE",
                        help="environment for the sidecar process (repeatable), e.g. OTEL_SDK_DISABLED=true")
    parser.add_argument("--keep", help="keep logs and configs in this folder")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.per_round, args.warmup = 4, 200, 100
    sidecar_env = dict(item.split("=", 1) for item in args.sidecar_env)
    raise_nofile()
    print(f"overhead: load average {machine_load()}")
    with bench_stack(bare=True, null=args.floor, keep=args.keep, sidecar_env=sidecar_env) as bench:
        asyncio.run(measure(bench, args))


if __name__ == "__main__":
    main()
