"""The handoff: how quickly the GPU goes to the next waiting request.

N requests (500 by default) are sent at once to an upstream that takes 50 ms each (a short
completion), so all but one wait. The upstream records when each request starts and ends
there. The handoff gap is the time from the end of one request at the upstream to the start of
the next one there: Envoy finishing the response and sending the access log's final entry, the
sidecar releasing and granting the next ticket, its held Check being answered, and Envoy
sending that request upstream. Efficiency is the upstream's busy time divided by the wall time
from the first start to the last end.

The same burst goes, in interleaved rounds (llamaswap, toy, then toy, llamaswap, ...), through
llamaswap and through the floor: a toy FIFO (bench/floor.py, ~30 lines of grpc.aio) with
the same protocol (ticket in the Check's dynamic metadata, release on the access log's final
entry) behind the same bootstrap: the gap Python and grpc.aio on this chain cannot go below.
For reference, one client sending back to back through bare Envoy (no scheduler at all) is
measured before and after. Figures are medians over rounds. Last lines:

    floor: gap p50 N.NN ms, p99 N.NN ms, efficiency N.NNN
    dispatch: gap p50 N.NN ms, p99 N.NN ms, efficiency N.NNN

Goals (printed, never enforced): gap p50 under 2 ms, p99 under 10 ms, efficiency above 0.95.

Run: .venv/bin/python bench/dispatch.py [--quick] [--rounds N] [--requests N] [--sleep-ms N]
     [--sidecar-env K=V] [--profile FILE] [--cprofile FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from clients import chat_body, post, session  # noqa: E402
from procfs import cpu_seconds, machine_load, raise_nofile  # noqa: E402
from profiling import profiled  # noqa: E402
from stack import Bench, bench_stack, add_stack_arguments, sidecar_env_of  # noqa: E402
from stats import describe_ms, percentile  # noqa: E402


def gaps_and_efficiency(hits: list[dict]) -> tuple[list[int], float, int]:
    """Gaps (ns) between consecutive hits, busy/wall, and how many hits overlapped."""
    hits = sorted(hits, key=lambda h: h["start_ns"])
    gaps = [b["start_ns"] - a["end_ns"] for a, b in zip(hits, hits[1:])]
    busy = sum(h["end_ns"] - h["start_ns"] for h in hits)
    wall = max(h["end_ns"] for h in hits) - hits[0]["start_ns"]
    overlaps = sum(1 for gap in gaps if gap < 0)
    return gaps, busy / wall, overlaps


async def sequential_baseline(url: str, count: int, sleep_ms: int, prefix: str) -> None:
    """One client, back to back."""
    body = chat_body()
    async with session() as client:
        for index in range(count):
            headers = {"content-type": "application/json", "x-test-id": f"{prefix}-{index}",
                       "x-test-sleep-ms": str(sleep_ms)}
            status, _ = await post(client, url, body, headers)
            if status != 200:
                raise RuntimeError(f"baseline request: HTTP {status}")


async def burst(url: str, count: int, sleep_ms: int, prefix: str = "burst") -> tuple[list[int], float]:
    """`count` requests at once; statuses and the client's wall time."""
    body = chat_body()
    async with session(limit=0) as client:
        async def one(index: int) -> int:
            headers = {"content-type": "application/json", "x-test-id": f"{prefix}-{index}",
                       "x-test-sleep-ms": str(sleep_ms)}
            status, _ = await post(client, url, body, headers)
            return status

        start = time.perf_counter()
        statuses = await asyncio.gather(*(one(index) for index in range(count)))
        return list(statuses), time.perf_counter() - start


def run_burst(bench: Bench, name: str, url: str, pid: int, args: argparse.Namespace, index: int,
              profile: str | None) -> dict:
    bench.upstream.clear()
    cpu_before = cpu_seconds(pid)
    with profiled(pid, profile):
        statuses, client_wall = asyncio.run(burst(url, args.requests, args.sleep_ms, f"{name}{index}"))
    cpu = cpu_seconds(pid) - cpu_before
    hits = bench.upstream.hits()
    bad = [status for status in statuses if status != 200]
    if bad or len(hits) != args.requests:
        print(f"warning: {name} round {index + 1}: {len(bad)} non-200 answers ({sorted(set(bad))}), "
              f"{len(hits)} of {args.requests} reached the upstream")
    gaps, efficiency, overlaps = gaps_and_efficiency(hits)
    return {"gaps": gaps, "efficiency": efficiency, "overlaps": overlaps, "cpu_per_request": cpu / args.requests,
            "p50": percentile(gaps, 50) / 1e6, "p90": percentile(gaps, 90) / 1e6, "p99": percentile(gaps, 99) / 1e6,
            "max": max(gaps) / 1e6, "client_wall": client_wall, "load": machine_load(),
            "runs": [h["end_ns"] - h["start_ns"] for h in hits]}


def med(values: list[float]) -> float:
    return statistics.median(values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1 round of 150 requests, 20 baseline requests")
    parser.add_argument("--rounds", type=int, default=3, help="bursts per path, interleaved")
    parser.add_argument("--requests", type=int, default=500, help="requests per burst")
    parser.add_argument("--sleep-ms", type=int, default=50, help="upstream time per request")
    parser.add_argument("--baseline", type=int, default=100,
                        help="bare-Envoy sequential requests (half before the bursts, half after)")
    parser.add_argument("--profile", help="py-spy the llamaswap sidecar during its bursts into this raw file")
    parser.add_argument("--cprofile", help="run the llamaswap sidecar under cProfile (bench/profile_serve.py)")
    add_stack_arguments(parser)
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.requests, args.baseline = 1, 150, 20
    sidecar_env = sidecar_env_of(args)
    raise_nofile()
    load_at_start = machine_load()
    print(f"dispatch: load average {load_at_start}")
    from profile_serve import argv_for

    results: dict[str, list[dict]] = {"llamaswap": [], "toy FIFO": []}
    with bench_stack(bare=True, null=True, null_serial=True, keep=args.keep, sidecar_env=sidecar_env,
                     sidecar_argv=argv_for(args.cprofile)) as bench:
        assert bench.null is not None
        upstream = bench.upstream
        targets = {"llamaswap": (bench.sidecar_url, bench.sidecar_pid), "toy FIFO": (bench.null.url, bench.null.pid)}
        # Warm-up: connections and code paths on the three Envoys.
        asyncio.run(sequential_baseline(bench.bare_url, 20, 0, "warm"))
        for url, _ in targets.values():
            asyncio.run(burst(url, 50, 0, "warm"))

        upstream.clear()
        asyncio.run(sequential_baseline(bench.bare_url, args.baseline // 2, args.sleep_ms, "base"))
        baseline_hits = upstream.hits()
        for index in range(args.rounds):
            order = list(targets) if index % 2 == 0 else list(reversed(targets))
            for name in order:
                url, pid = targets[name]
                result = run_burst(bench, name, url, pid, args, index,
                                   args.profile if name == "llamaswap" and index == 0 else None)
                results[name].append(result)
                print(f"round {index + 1} {name:>9}: gap p50 {result['p50']:.2f} p90 {result['p90']:.2f} "
                      f"p99 {result['p99']:.2f} max {result['max']:.1f} ms, efficiency {result['efficiency']:.4f}, "
                      f"overlaps {result['overlaps']}, sidecar CPU {1e3 * result['cpu_per_request']:.2f} ms/request; "
                      f"load {result['load']}")
        upstream.clear()
        asyncio.run(sequential_baseline(bench.bare_url, args.baseline - args.baseline // 2, args.sleep_ms, "base"))
        baseline_hits_after = upstream.hits()

    base_gaps = (gaps_and_efficiency(baseline_hits)[0] if len(baseline_hits) > 1 else []) + \
                (gaps_and_efficiency(baseline_hits_after)[0] if len(baseline_hits_after) > 1 else [])
    print()
    print(f"| {args.rounds} x {args.requests} requests at once, upstream {args.sleep_ms} ms each (medians over rounds)"
          " | gap p50 | gap p90 | gap p99 | gap max | efficiency | sidecar CPU/request |")
    print("|---|---|---|---|---|---|---|")
    labels = {"llamaswap": "llamaswap", "toy FIFO": "toy FIFO grpc.aio, same chain (floor)"}
    for name, rounds in results.items():
        print(f"| {labels[name]} | {med([r['p50'] for r in rounds]):.2f} ms | {med([r['p90'] for r in rounds]):.2f} ms "
              f"| {med([r['p99'] for r in rounds]):.2f} ms | {med([r['max'] for r in rounds]):.1f} ms "
              f"| {med([r['efficiency'] for r in rounds]):.3f} "
              f"| {1e3 * med([r['cpu_per_request'] for r in rounds]):.2f} ms |")
    if base_gaps:
        print("| one client back to back, bare Envoy (reference, no scheduler) "
              f"| {percentile(base_gaps, 50) / 1e6:.2f} ms"
              f" | {percentile(base_gaps, 90) / 1e6:.2f} ms | {percentile(base_gaps, 99) / 1e6:.2f} ms "
              f"| {max(base_gaps) / 1e6:.1f} ms | | |")
    print()
    for name, rounds in results.items():
        gaps = [gap for r in rounds for gap in r["gaps"]]
        halves = [gap for r in rounds for gap in r["gaps"][: len(r["gaps"]) // 2]], \
                 [gap for r in rounds for gap in r["gaps"][len(r["gaps"]) // 2:]]
        print(f"{name} all gaps pooled: {describe_ms(gaps)}")
        print(f"  first half of each burst (arrivals still landing): {describe_ms(halves[0])}")
        print(f"  second half:                                       {describe_ms(halves[1])}")
        print(f"  upstream time per request: {describe_ms([run for r in rounds for run in r['runs']])}")
        print(f"  overlapping requests at the upstream: {sum(r['overlaps'] for r in rounds)} (must be 0)")
    ours, floor = results["llamaswap"], results["toy FIFO"]
    p50, p99, eff = med([r["p50"] for r in ours]), med([r["p99"] for r in ours]), med([r["efficiency"] for r in ours])
    f50, f99, feff = (med([r["p50"] for r in floor]), med([r["p99"] for r in floor]),
                      med([r["efficiency"] for r in floor]))

    def verdict(value: float, goal: float, below: bool) -> str:
        met = value < goal if below else value > goal
        return "met" if met else f"missed by {abs(value - goal):.3f}"

    print(f"goal: gap p50 < 2 ms: {p50:.2f} ms ({verdict(p50, 2.0, True)}), floor {f50:.2f} ms")
    print(f"goal: gap p99 < 10 ms: {p99:.2f} ms ({verdict(p99, 10.0, True)}), floor {f99:.2f} ms")
    print(f"goal: efficiency > 0.95: {eff:.3f} ({verdict(eff, 0.95, False)}), floor {feff:.3f}")
    print(f"load average {machine_load()} (at the start: {load_at_start})")
    print(f"floor: gap p50 {f50:.2f} ms, p99 {f99:.2f} ms, efficiency {feff:.3f}")
    print(f"dispatch: gap p50 {p50:.2f} ms, p99 {p99:.2f} ms, efficiency {eff:.3f}")


if __name__ == "__main__":
    main()
