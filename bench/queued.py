"""What waiting requests cost: the sidecar's memory (VmRSS) and CPU while they wait, and Envoy's.

A blocker holds the GPU at the upstream; then 1,000 and 10,000 requests (each its own client
connection) are queued behind it. At 0 and at each count, after the arrivals settle, the
sidecar's VmRSS (/proc/PID/status) and its CPU time over an idle window (/proc/PID/stat) are
read, and Envoy's. Then every waiting client disconnects at once and the time the sidecar takes
to forget them all is measured. The same is done for the floor, a toy FIFO (bench/floor.py:
the same protocol in ~30 lines of grpc.aio, behind the same bootstrap), and for each prompt
size (1 KB and 1 MB by default; fewer waiting with 1 MB, since Envoy buffers every body), each
size in freshly started processes (memory freed by one measurement would hide the next one's
growth).

Each waiting request holds a client connection here and in Envoy, and one held Check in the
sidecar; the body stays in Envoy (json_to_metadata reads the model there), so the sidecar's
share should not depend on the prompt's size. The benchmark raises RLIMIT_NOFILE to the hard
limit before Envoy starts. Per waiting request = (RSS at the largest count - RSS at 0) / count;
the marginal figure (between the last two counts) is printed beside it. Last lines (the
summary is the largest per-request figure over the prompt sizes):

    queued (N-byte prompts): N bytes per waiting request in the sidecar, floor N, Envoy N
    queued: N bytes per waiting request

Goal (printed, never enforced): under 24 KB per waiting request in the sidecar, for 1 KB and
1 MB prompts alike.

Run: .venv/bin/python bench/queued.py [--quick] [--plan "1024=1000,10000;1048576=200,1000"]
     [--idle-seconds N] [--sidecar-env K=V]
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

from clients import chat_body, post, session  # noqa: E402
from procfs import cpu_seconds, machine_load, raise_nofile, rss_bytes  # noqa: E402
from stack import Bench, bench_stack, add_stack_arguments, sidecar_env_of  # noqa: E402 - (stack puts e2e/ on the path)
from harness import http_get  # noqa: E402

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
    """Wait until Envoy holds `streams` gRPC streams to the sidecar (one held Check per waiting
    request, besides the access-log streams)."""
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
                await settle(target, base_streams + len(waiting), timeout=180)
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


def report(name: str, samples: list[dict[str, float]]) -> dict[str, float]:
    base = samples[0]
    for item in samples[1:]:
        n = item["waiting"]
        print(f"{name}: {n:>6.0f} waiting: sidecar +{(item['rss'] - base['rss']) / n:.0f} bytes each, "
              f"Envoy +{(item['envoy_rss'] - base['envoy_rss']) / n:.0f} bytes each")
    last = samples[-1]
    out = {"sidecar": (last["rss"] - base["rss"]) / last["waiting"],
           "envoy": (last["envoy_rss"] - base["envoy_rss"]) / last["waiting"],
           "waiting": last["waiting"], "cpu": max(s["cpu"] for s in samples)}
    if len(samples) > 2:
        a, b = samples[-2], samples[-1]
        out["marginal"] = (b["rss"] - a["rss"]) / (b["waiting"] - a["waiting"])
        out["envoy_marginal"] = (b["envoy_rss"] - a["envoy_rss"]) / (b["waiting"] - a["waiting"])
        print(f"{name}: marginal ({a['waiting']:.0f} -> {b['waiting']:.0f}): sidecar {out['marginal']:.0f} bytes each, "
              f"Envoy {out['envoy_marginal']:.0f}")
    return out


def body_of(size: int) -> bytes:
    """A chat body of exactly `size` bytes (its prompt padded), `model` after the messages."""
    base = len(chat_body(pad_bytes=0))
    body = chat_body(pad_bytes=max(0, size - base))
    return body


def parse_plan(text: str) -> list[tuple[int, list[int]]]:
    plan = []
    for part in text.split(";"):
        size, _, counts = part.partition("=")
        plan.append((int(size), [int(c) for c in counts.split(",")]))
    return plan


def measure_size(size: int, counts: list[int], args: argparse.Namespace,
                 sidecar_env: dict[str, str]) -> dict[str, dict[str, float]]:
    body = body_of(size)
    print(f"-- prompts of {len(body)} bytes, {counts} waiting; load average {machine_load()}")
    config = {"envoy": {"maxSidecarStreams": max(100_000, 4 * max(counts))}}
    with bench_stack(config, bare=False, null=True, null_serial=True, keep=args.keep,
                     sidecar_env=sidecar_env) as bench:
        assert bench.null is not None
        sidecar = Target("llamaswap", bench.sidecar_url, bench.sidecar_pid, bench.stack.envoy,
                         bench.stack.sidecar.admin_url)
        toy = Target("toy FIFO", bench.null.url, bench.null.pid, bench.null.envoy, None)
        samples = asyncio.run(measure(bench, sidecar, counts, args.idle_seconds, args.batch, body))
        floor_samples = asyncio.run(measure(bench, toy, counts, args.idle_seconds, args.batch, body))
    return {"llamaswap": report("llamaswap", samples), "toy FIFO": report("toy FIFO", floor_samples),
            "raw": {"llamaswap": samples, "toy FIFO": floor_samples}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1 KB: 200 and 2,000 waiting; 1 MB: 100 and 300; 3 s idle")
    parser.add_argument("--plan", default="1024=1000,10000;1048576=200,1000",
                        help="prompt size in bytes = waiting counts (ascending); sizes separated by ';'")
    parser.add_argument("--idle-seconds", type=float, default=10.0, help="CPU measurement window")
    parser.add_argument("--batch", type=int, default=500, help="new connections per step")
    add_stack_arguments(parser)
    args = parser.parse_args()
    sidecar_env = sidecar_env_of(args)
    if args.quick:
        args.plan, args.idle_seconds = "1024=200,2000;1048576=100,300", 3.0
    plan = parse_plan(args.plan)
    limit = raise_nofile()
    need = max(max(counts) for _, counts in plan) + 1000  # per process: the client's sockets, or Envoy's
    if limit < need:
        raise SystemExit(f"RLIMIT_NOFILE is {limit}; the plan needs about {need}")
    load_at_start = machine_load()
    print(f"queued: RLIMIT_NOFILE {limit}, load average {load_at_start}")
    results = {size: measure_size(size, counts, args, sidecar_env) for size, counts in plan}

    print()
    print("| prompt | waiting | llamaswap sidecar RSS | toy FIFO RSS | Envoy RSS (llamaswap's) "
          "| sidecar CPU while waiting |")
    print("|---|---|---|---|---|---|")
    for size, result in results.items():
        for ours, toy in zip(result["raw"]["llamaswap"], result["raw"]["toy FIFO"]):
            print(f"| {size:,} B | {ours['waiting']:,.0f} | {ours['rss'] / 2**20:.1f} MiB "
                  f"| {toy['rss'] / 2**20:.1f} MiB | {ours['envoy_rss'] / 2**20:.1f} MiB "
                  f"| {100 * ours['cpu']:.1f} % of a core |")
    print()
    print("| prompt | per waiting request, from 0 to N: llamaswap | floor (toy FIFO) | llamaswap's own | "
          "marginal llamaswap / floor | Envoy (llamaswap's / floor's) |")
    print("|---|---|---|---|---|---|")
    for size, result in results.items():
        ours, toy = result["llamaswap"], result["toy FIFO"]
        marginal = (f"{ours['marginal']:,.0f} / {toy['marginal']:,.0f} B" if "marginal" in ours and "marginal" in toy
                    else "-")
        print(f"| {size:,} B (N = {ours['waiting']:,.0f}) | {ours['sidecar']:,.0f} B | {toy['sidecar']:,.0f} B "
              f"| {ours['sidecar'] - toy['sidecar']:+,.0f} B | {marginal} "
              f"| {ours['envoy']:,.0f} / {toy['envoy']:,.0f} B |")
    print()
    worst = max(result["llamaswap"]["sidecar"] for result in results.values())
    for size, result in results.items():
        ours = result["llamaswap"]["sidecar"]
        print(f"goal: < 24 KB (24,576 B) per waiting request with {size:,}-byte prompts: {ours:,.0f} B "
              f"({'met' if ours < 24576 else f'missed by {ours - 24576:,.0f} B'}), floor "
              f"{result['toy FIFO']['sidecar']:,.0f} B")
    print(f"load average {machine_load()} (at the start: {load_at_start})")
    for size, result in results.items():
        print(f"queued ({size}-byte prompts): {result['llamaswap']['sidecar']:.0f} bytes per waiting request in the "
              f"sidecar, floor {result['toy FIFO']['sidecar']:.0f}, Envoy {result['llamaswap']['envoy']:.0f}")
    print(f"queued: {worst:.0f} bytes per waiting request")


if __name__ == "__main__":
    main()
