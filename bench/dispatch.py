"""The handoff: how quickly the GPU goes to the next waiting request.

N requests (1,000 by default) are sent at once through Envoy with the sidecar to an
upstream that takes 50 ms each (a short completion), so all but one wait. The upstream
records when each request starts and ends there. The handoff gap is the time from the end of
one request at the upstream to the start of the next one there: Envoy finishing the
response, the ext_proc stream ending, the sidecar releasing and granting the next ticket,
its held Check being answered, and Envoy sending the request upstream. Efficiency is the
upstream's busy time divided by the wall time from the first start to the last end.

For reference (not in the summary line) the same is measured through bare Envoy with one
client sending its requests back to back, before and after the burst: the gap a client that
drives its own queue gets without any scheduler. Last line:

    dispatch: gap p50 N.NN ms, p99 N.NN ms, efficiency N.NNN

With --floor the same burst then goes through a toy FIFO sidecar (bench/common.py: the same
protocol in ~30 lines of grpc.aio, nothing else): the gap Python and grpc.aio cannot go below.

Run: .venv/bin/python bench/dispatch.py [--quick] [--floor] [--requests N] [--sleep-ms N]
     [--sidecar-env K=V] [--profile FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import pathlib
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


def gaps_and_efficiency(hits: list[dict]) -> tuple[list[int], float, int]:
    """Gaps (ns) between consecutive hits, busy/wall, and how many hits overlapped."""
    hits = sorted(hits, key=lambda h: h["start_ns"])
    gaps = [b["start_ns"] - a["end_ns"] for a, b in zip(hits, hits[1:])]
    busy = sum(h["end_ns"] - h["start_ns"] for h in hits)
    wall = max(h["end_ns"] for h in hits) - hits[0]["start_ns"]
    overlaps = sum(1 for gap in gaps if gap < 0)
    return gaps, busy / wall, overlaps


async def sequential_baseline(bench: Bench, count: int, sleep_ms: int, prefix: str) -> None:
    """One client, back to back, through bare Envoy."""
    body = chat_body()
    async with session() as client:
        for index in range(count):
            headers = {"content-type": "application/json", "x-test-id": f"{prefix}-{index}",
                       "x-test-sleep-ms": str(sleep_ms)}
            status, _ = await post(client, bench.bare_url, body, headers)
            if status != 200:
                raise RuntimeError(f"baseline request: HTTP {status}")


async def burst(url: str, count: int, sleep_ms: int) -> tuple[list[int], float]:
    """`count` requests at once; statuses and the client's wall time."""
    body = chat_body()
    async with session(limit=0) as client:
        async def one(index: int) -> int:
            headers = {"content-type": "application/json", "x-test-id": f"burst-{index}",
                       "x-test-sleep-ms": str(sleep_ms)}
            status, _ = await post(client, url, body, headers)
            return status

        start = time.perf_counter()
        statuses = await asyncio.gather(*(one(index) for index in range(count)))
        return list(statuses), time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="200 requests, 40 baseline requests")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--sleep-ms", type=int, default=50, help="upstream time per request")
    parser.add_argument("--baseline", type=int, default=100,
                        help="bare-Envoy sequential requests (half before the burst, half after)")
    parser.add_argument("--profile", help="py-spy the sidecar during the burst into this raw file")
    parser.add_argument("--floor", action="store_true",
                        help="then the same burst through a toy FIFO grpc.aio sidecar (bench/common.py)")
    parser.add_argument("--sidecar-env", action="append", default=[], metavar="KEY=VALUE",
                        help="environment for the sidecar process (repeatable), e.g. OTEL_SDK_DISABLED=true")
    parser.add_argument("--keep", help="keep logs and configs in this folder")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.baseline = 200, 40
    sidecar_env = dict(item.split("=", 1) for item in args.sidecar_env)
    raise_nofile()
    print(f"dispatch: load average {machine_load()}")
    with bench_stack(bare=True, null=args.floor, null_serial=True, keep=args.keep, sidecar_env=sidecar_env) as bench:
        upstream = bench.upstream
        # Warm-up: connections and code paths on both Envoys.
        asyncio.run(sequential_baseline(bench, 20, 0, "warm"))
        asyncio.run(burst(bench.sidecar_url, 20, 0))
        if bench.null is not None:
            asyncio.run(burst(bench.null.url, 20, 0))

        upstream.clear()
        asyncio.run(sequential_baseline(bench, args.baseline // 2, args.sleep_ms, "base"))
        baseline_hits = upstream.hits()

        upstream.clear()
        cpu_before = cpu_seconds(bench.sidecar_pid)
        with profiled(bench.sidecar_pid, args.profile):
            statuses, client_wall = asyncio.run(burst(bench.sidecar_url, args.requests, args.sleep_ms))
        sidecar_cpu = cpu_seconds(bench.sidecar_pid) - cpu_before
        burst_hits = upstream.hits()

        floor_hits: list[dict] = []
        if bench.null is not None:
            upstream.clear()
            floor_statuses, _ = asyncio.run(burst(bench.null.url, args.requests, args.sleep_ms))
            floor_hits = upstream.hits()
            if any(status != 200 for status in floor_statuses):
                print(f"warning: the toy FIFO answered {sorted(set(floor_statuses))}")

        upstream.clear()
        asyncio.run(sequential_baseline(bench, args.baseline - args.baseline // 2, args.sleep_ms, "base"))
        baseline_hits_after = upstream.hits()

    bad = [status for status in statuses if status != 200]
    if bad or len(burst_hits) != args.requests:
        raise SystemExit(f"burst: {len(bad)} non-200 answers ({sorted(set(bad))}), "
                         f"{len(burst_hits)} of {args.requests} reached the upstream")
    gaps, efficiency, overlaps = gaps_and_efficiency(burst_hits)
    base_gaps = (gaps_and_efficiency(baseline_hits)[0] if len(baseline_hits) > 1 else []) + \
                (gaps_and_efficiency(baseline_hits_after)[0] if len(baseline_hits_after) > 1 else [])
    runs = [h["end_ns"] - h["start_ns"] for h in burst_hits]
    ordered = sorted(burst_hits, key=lambda h: h["start_ns"])
    first_half = gaps[: len(gaps) // 2]
    second_half = gaps[len(gaps) // 2:]

    upstream_wall = (ordered[-1]["end_ns"] - ordered[0]["start_ns"]) / 1e9
    print(f"burst: {args.requests} requests at once, upstream {args.sleep_ms} ms each; "
          f"client wall {client_wall:.2f} s, upstream wall {upstream_wall:.2f} s")
    print(f"upstream time per request: {describe_ms(runs)}")
    print(f"handoff gap (sidecar):      {describe_ms(gaps)}")
    print(f"  first half of the burst:  {describe_ms(first_half)}")
    print(f"  second half:              {describe_ms(second_half)}")
    if base_gaps:
        print(f"sequential client, bare Envoy (reference): {describe_ms(base_gaps)}")
    if len(floor_hits) > 1:
        floor_gaps, floor_efficiency, floor_overlaps = gaps_and_efficiency(floor_hits)
        print(f"toy FIFO grpc.aio sidecar (floor):         {describe_ms(floor_gaps)}; "
              f"efficiency {floor_efficiency:.4f}, overlaps {floor_overlaps}")
    print(f"overlapping requests at the upstream: {overlaps} (must be 0: one at a time)")
    print(f"sidecar CPU during the burst: {sidecar_cpu:.2f} s, {1e3 * sidecar_cpu / args.requests:.2f} ms per request")
    print(f"efficiency (busy / wall): {efficiency:.4f}; load average {machine_load()}")
    print(f"dispatch: gap p50 {percentile(gaps, 50) / 1e6:.2f} ms, p99 {percentile(gaps, 99) / 1e6:.2f} ms, "
          f"efficiency {efficiency:.3f}")


if __name__ == "__main__":
    main()
