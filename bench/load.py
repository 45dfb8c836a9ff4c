"""10,000 requests waiting at once through the real Envoy and sidecar: each served exactly
once, in score order, and what a waiting request costs the sidecar in memory.

    .venv/bin/python bench/load.py [--quick] [--requests N]

The data path is the real one: buffer -> json_to_metadata -> ext_authz (one held Check per
waiting request) -> router, each grant released by Envoy's access log.

A held request occupies the upstream while N requests with mixed priorities queue behind
it; the upstream's arrival order must then be non-increasing in priority (aging and swap
affinity are off, so the score is the priority), with every request exactly once.
Prints its figures and ends with one line:
    load: N served exactly once in score order, N bytes per waiting request
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import pathlib
import random
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from clients import chat_body, post, session  # noqa: E402
from procfs import machine_load, raise_nofile, rss_bytes  # noqa: E402
from stack import bench_stack  # noqa: E402
from harness import async_wait_for, http_get  # noqa: E402

PRIORITIES = (-100, -99, -98, 0, 1, 2, 100)
CONFIG = {"routing": {"scheduler": {"settings": {"serial": {"agingDivisor": 0, "swapAffinityBonus": 0}}}},
          "envoy": {"maxSidecarStreams": 100_000}}


def _depth(admin_url: str) -> int:
    text = http_get(f"{admin_url}/metrics")[1].decode()
    total = 0
    for line in text.splitlines():
        if line.startswith("llamaswap_scheduler_queue_depth{"):
            total += int(float(line.rsplit(" ", 1)[1]))
    return total


async def run(requests: int, seed: int) -> int:
    rng = random.Random(seed)
    load_at_start = machine_load()
    with bench_stack(CONFIG, bare=False) as bench:
        admin = bench.stack.sidecar.admin_url
        body = chat_body()
        async with session() as client:
            blocker = asyncio.create_task(post(client, bench.sidecar_url, body,
                                               {"x-test-id": "blocker", "x-test-hold": "1"}))
            await async_wait_for(lambda: bench.upstream.count() == 1, what="blocker at the upstream")
            rss_idle = rss_bytes(bench.sidecar_pid)
            envoy_idle = rss_bytes(bench.envoy_pid)
            started = time.monotonic()
            tasks = []
            for index in range(requests):
                priority = rng.choice(PRIORITIES)
                tasks.append(asyncio.create_task(post(client, bench.sidecar_url, body, {
                    "x-test-id": f"r{index}:{priority}", "x-llamaswap-priority": str(priority)})))
                if index % 500 == 499:
                    await asyncio.sleep(0)  # let connections open as we go
            last_report = 0.0
            while (depth := _depth(admin)) < requests:
                failed = [task for task in tasks if task.done()]
                if failed:
                    raise RuntimeError(f"{len(failed)} requests ended before the blocker was released: "
                                       f"{collections.Counter(task.result()[0] for task in failed)}")
                now = time.monotonic()
                if now - last_report > 5:
                    print(f"  {depth} of {requests} waiting ({now - started:.0f} s)", file=sys.stderr, flush=True)
                    last_report = now
                if now - started > 600:
                    raise TimeoutError(f"only {depth} of {requests} queued after 600 s")
                await asyncio.sleep(0.5)
            queued_s = time.monotonic() - started
            rss_full = rss_bytes(bench.sidecar_pid)
            envoy_full = rss_bytes(bench.envoy_pid)
            per_request = (rss_full - rss_idle) / requests
            streams = bench.envoy_stat("cluster.llamaswap_grpc.upstream_rq_active")
            bench.upstream.release("blocker")
            drain_start = time.monotonic()
            results = await asyncio.gather(blocker, *tasks)
            drain_s = time.monotonic() - drain_start
        statuses = collections.Counter(status for status, _ in results)
        hits = [hit["id"] for hit in bench.upstream.hits()]
    served = hits[1:]
    priorities = [int(hit.split(":")[1]) for hit in served]
    exactly_once = len(served) == len(set(served)) == requests
    in_order = all(a >= b for a, b in zip(priorities, priorities[1:]))
    print(f"load average: {machine_load()} (at the start: {load_at_start})")
    print(f"queued {requests} in {queued_s:.1f} s; drained in {drain_s:.1f} s ({requests / drain_s:.0f} req/s)")
    print(f"statuses: {dict(statuses)}")
    print(f"sidecar RSS: {rss_idle / 1e6:.1f} MB idle, {rss_full / 1e6:.1f} MB with {requests} waiting "
          f"({per_request:.0f} bytes each); Envoy RSS {envoy_idle / 1e6:.1f} -> {envoy_full / 1e6:.1f} MB "
          f"({(envoy_full - envoy_idle) / requests:.0f} bytes each); Envoy held {streams} gRPC streams to the sidecar")
    print(f"upstream hits: {len(hits)} (the blocker + {len(served)}), distinct {len(set(served))}; "
          f"priorities served: {dict(sorted(collections.Counter(priorities).items(), reverse=True))}")
    print(f"served exactly once: {exactly_once}; in score order: {in_order}")
    verdict = "served exactly once in score order" if exactly_once and in_order and statuses == {200: requests + 1} \
        else "NOT all served exactly once in score order"
    print(f"load: {requests} {verdict}, {per_request:.0f} bytes per waiting request")
    return 0 if verdict.startswith("served") else 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="2,000 requests")
    args = parser.parse_args()
    if args.quick:
        args.requests = 2000
    raise_nofile()
    sys.exit(asyncio.run(run(args.requests, args.seed)))


if __name__ == "__main__":
    main()
