"""What waiting requests cost the sidecar: memory (VmRSS) and CPU while they wait.

A blocker holds the GPU at the upstream; then 1,000 and 10,000 requests (each its own
client connection) are queued behind it. At 0, 1,000 and 10,000 waiting, after the
arrivals settle, the sidecar's VmRSS (/proc/PID/status) and its CPU time over an idle
window (/proc/PID/stat) are read; Envoy's are printed for reference. Then every waiting
client disconnects at once and the time the sidecar takes to forget them all is measured.
Last line (RSS growth from 0 to the largest count, divided by that count):

    queued: N bytes per waiting request

Each waiting request holds a client connection here and in Envoy, and two gRPC streams in
the sidecar (ext_proc + Check); the benchmark raises RLIMIT_NOFILE to the hard limit before
Envoy starts. With --floor the same is then measured for a toy FIFO sidecar (the same
protocol in ~30 lines of grpc.aio, bench/common.py): what grpc.aio itself keeps per held pair
of calls. --body-bytes pads each waiting request's prompt (the body reaches the sidecar in
the Check).

Run: .venv/bin/python bench/queued.py [--quick] [--floor] [--counts 1000,10000]
     [--idle-seconds N] [--body-bytes N] [--sidecar-env K=V]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import pathlib
import sys
import time
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from common import (  # noqa: E402
    Bench,
    bench_stack,
    chat_body,
    cpu_seconds,
    http_get,
    machine_load,
    post,
    raise_nofile,
    rss_bytes,
    session,
)

ACTIVE_STREAMS = "cluster.llamaswap_grpc.upstream_rq_active"


@dataclasses.dataclass
class Target:
    name: str
    url: str
    pid: int
    envoy: Any  # harness.EnvoyProcess
    admin_url: str | None  # llamaswap's admin server (for /queue), None for the toy

    def streams(self) -> int:
        return self.envoy.stat(ACTIVE_STREAMS)

    def depth(self) -> int | None:
        """Waiting requests by the sidecar's /queue (read only after the RSS: it allocates)."""
        if self.admin_url is None:
            return None
        status, body = http_get(f"{self.admin_url}/queue", timeout=60)
        return len(json.loads(body)["waiting"]) if status == 200 else -1


async def settle(target: Target, streams: int, timeout: float) -> None:
    """Wait until Envoy holds `streams` gRPC streams to the sidecar."""
    start = time.monotonic()
    active = 0
    while time.monotonic() - start < timeout:
        active = await asyncio.to_thread(target.streams)
        if active >= streams:
            return
        await asyncio.sleep(0.2)
    raise TimeoutError(f"Envoy holds {active} of {streams} sidecar streams after {timeout:.0f} s")


async def sample(target: Target, waiting: int, idle_s: float) -> dict[str, float]:
    pid, envoy = target.pid, target.envoy.popen.pid
    await asyncio.sleep(1.0)  # let the last arrivals' work finish
    cpu0, envoy_cpu0 = cpu_seconds(pid), cpu_seconds(envoy)
    await asyncio.sleep(idle_s)
    cpu = (cpu_seconds(pid) - cpu0) / idle_s
    envoy_cpu = (cpu_seconds(envoy) - envoy_cpu0) / idle_s
    rss, envoy_rss = rss_bytes(pid), rss_bytes(envoy)
    print(f"{target.name}: {waiting:>6} waiting: sidecar RSS {rss / 2**20:8.1f} MiB, CPU {100 * cpu:5.2f} % of a core "
          f"while they wait; Envoy RSS {envoy_rss / 2**20:8.1f} MiB, CPU {100 * envoy_cpu:5.2f} %")
    return {"waiting": waiting, "rss": rss, "envoy_rss": envoy_rss, "cpu": cpu, "envoy_cpu": envoy_cpu}


async def measure(bench: Bench, target: Target, counts: list[int], idle_s: float, batch: int,
                  body: bytes) -> list[dict[str, float]]:
    samples = []
    headers = {"content-type": "application/json"}
    async with session(limit=0) as client:
        # Warm-up: code paths, gRPC connections, the first allocations.
        for _ in range(100):
            await post(client, target.url, body, headers)
        hits_before = bench.upstream.count()
        blocker_id = f"blocker-{target.name}"
        blocker = asyncio.create_task(post(client, target.url, body, {
            **headers, "x-test-id": blocker_id, "x-test-hold": "1"}))
        deadline = time.monotonic() + 30
        while bench.upstream.count() <= hits_before:
            if time.monotonic() > deadline:
                raise TimeoutError("the blocker never reached the upstream")
            await asyncio.sleep(0.05)
        base_streams = await asyncio.to_thread(target.streams)
        samples.append(await sample(target, 0, idle_s))

        waiting: list[asyncio.Task] = []
        for count in counts:
            start = time.monotonic()
            while len(waiting) < count:
                for _ in range(min(batch, count - len(waiting))):
                    waiting.append(asyncio.create_task(post(client, target.url, body, {
                        **headers, "x-test-id": f"w{len(waiting)}"})))
                await settle(target, base_streams + 2 * len(waiting), timeout=120)
            print(f"{target.name}: queued {count} in {time.monotonic() - start:.1f} s")
            samples.append(await sample(target, count, idle_s))
            depth = await asyncio.to_thread(target.depth)
            if depth is not None and depth != count:
                print(f"warning: the sidecar reports {depth} waiting, expected {count}")
            done = [task for task in waiting if task.done()]
            if done:
                raise RuntimeError(f"{len(done)} waiting requests ended early: {done[0].result()!r}")

        # Everyone leaves at once: how long until the sidecar has forgotten them all?
        cpu0 = cpu_seconds(target.pid)
        start = time.monotonic()
        for task in waiting:
            task.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
        cleared = None
        while time.monotonic() - start < 120:
            if await asyncio.to_thread(target.streams) <= base_streams:
                depth = await asyncio.to_thread(target.depth)
                if not depth:
                    cleared = time.monotonic() - start
                    break
            await asyncio.sleep(0.1)
        cpu = cpu_seconds(target.pid) - cpu0
        if cleared is None:
            print(f"warning: {target.name} still had waiting requests 120 s after every client left")
        else:
            print(f"{target.name}: all {len(waiting)} waiting clients left; everything was forgotten after "
                  f"{cleared:.2f} s ({1e6 * cpu / len(waiting):.0f} us sidecar CPU per cancelled request)")
        rss_after = rss_bytes(target.pid)
        print(f"{target.name}: sidecar RSS after they left {rss_after / 2**20:.1f} MiB")
        bench.upstream.release(blocker_id)
        status, _ = await blocker
        if status != 200:
            print(f"warning: the blocker got HTTP {status}")
    return samples


def report(name: str, samples: list[dict[str, float]]) -> float:
    base = samples[0]
    for item in samples[1:]:
        n = item["waiting"]
        print(f"{name}: {n:>6.0f} waiting: sidecar +{(item['rss'] - base['rss']) / n:.0f} bytes each, "
              f"Envoy +{(item['envoy_rss'] - base['envoy_rss']) / n:.0f} bytes each")
    if len(samples) > 2:
        a, b = samples[-2], samples[-1]
        print(f"{name}: marginal ({a['waiting']:.0f} -> {b['waiting']:.0f}): sidecar "
              f"{(b['rss'] - a['rss']) / (b['waiting'] - a['waiting']):.0f} bytes each")
    last = samples[-1]
    return (last["rss"] - base["rss"]) / last["waiting"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="200 and 2,000 waiting, 3 s idle windows")
    parser.add_argument("--counts", default="1000,10000", help="waiting counts, ascending")
    parser.add_argument("--idle-seconds", type=float, default=10.0, help="CPU measurement window")
    parser.add_argument("--batch", type=int, default=500, help="new connections per step")
    parser.add_argument("--body-bytes", type=int, default=0, help="pad each prompt by this many bytes")
    parser.add_argument("--floor", action="store_true", help="then the same for the toy FIFO grpc.aio sidecar")
    parser.add_argument("--sidecar-env", action="append", default=[], metavar="KEY=VALUE",
                        help="environment for the sidecar process (repeatable)")
    parser.add_argument("--keep", help="keep logs and configs in this folder")
    args = parser.parse_args()
    sidecar_env = dict(item.split("=", 1) for item in args.sidecar_env)
    if args.quick:
        args.counts, args.idle_seconds = "200,2000", 3.0
    counts = [int(text) for text in args.counts.split(",")]
    limit = raise_nofile()
    need = max(counts) + 1000  # per process: the client's sockets, or Envoy's
    if limit < need:
        raise SystemExit(f"RLIMIT_NOFILE is {limit}; {max(counts)} waiting clients need about {need}")
    body = chat_body(pad_bytes=args.body_bytes)
    print(f"queued: RLIMIT_NOFILE {limit}, body {len(body)} bytes, load average {machine_load()}")
    config = {"envoy": {"maxSidecarStreams": max(100_000, 4 * max(counts))}}
    with bench_stack(config, bare=False, null=args.floor, null_serial=True, keep=args.keep,
                     sidecar_env=sidecar_env) as bench:
        sidecar = Target("llamaswap", bench.sidecar_url, bench.sidecar_pid, bench.stack.envoy,
                         bench.stack.sidecar.admin_url)
        samples = asyncio.run(measure(bench, sidecar, counts, args.idle_seconds, args.batch, body))
        floor_samples = None
        if bench.null is not None:
            toy = Target("toy FIFO", bench.null.url, bench.null.pid, bench.null.envoy, None)
            floor_samples = asyncio.run(measure(bench, toy, counts, args.idle_seconds, args.batch, body))
    per_request = report("llamaswap", samples)
    if floor_samples is not None:
        floor = report("toy FIFO", floor_samples)
        print(f"toy FIFO grpc.aio sidecar (floor): {floor:.0f} bytes per waiting request; "
              f"llamaswap adds {per_request - floor:.0f}")
    print(f"queued: {per_request:.0f} bytes per waiting request")


if __name__ == "__main__":
    main()
