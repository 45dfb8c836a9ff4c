"""What the sidecar adds to a request when the GPU is idle and nobody waits.

Three paths, all with the bootstrap `build_bootstrap()` makes, to the same instant upstream:

- bare Envoy: that bootstrap with json_to_metadata, ext_authz and the access log taken out;
- the floor: that bootstrap in front of a do-nothing grpc.aio server (bench/floor.py) that
  answers every Check at once with OK and a ticket in dynamic metadata and reads the access
  log: what this chain costs in Python before a scheduler does anything;
- llamaswap: that bootstrap in front of `llamaswap serve`.

One client (wrk, one connection, sequential requests) in interleaved rounds (bare, floor,
llamaswap, then the reverse) so every path sees the same machine noise. For each path it prints
the medians over rounds of the percentiles, the rps and each process's CPU per request
(/proc/PID/stat); the added latency is the median over rounds of the difference to bare Envoy
in the same round. Last lines:

    floor: p50 +N.NN ms, p99 +N.NN ms, throughput ratio N.NN
    overhead: p50 +N.NN ms, p99 +N.NN ms, throughput ratio N.NN

Goals (printed, never enforced): llamaswap's added p50 under 1.0 ms, and within 1.3x of the
floor's (added p50 and sidecar CPU per request).

With --candidate PYTHONPATH a fourth path runs in the same rounds: llamaswap again, its sidecar
from another copy of the code (a patched one in a scratch folder): an A/B of a suggestion.

Run: .venv/bin/python bench/overhead.py [--quick] [--rounds N] [--seconds S] [--clients N]
     [--body-bytes N] [--sidecar-env K=V] [--profile FILE] [--cprofile FILE] [--candidate PYTHONPATH]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import pathlib
import statistics
import sys
import time
from collections.abc import Iterator
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from clients import chat_body, post, run_wrk, session, wrk_available  # noqa: E402
from procfs import cpu_seconds, machine_load, raise_nofile, thread_cpu  # noqa: E402
from profiling import profiled  # noqa: E402
from stack import BENCH_CONFIG, Bench, bench_stack, add_stack_arguments, sidecar_env_of  # noqa: E402
from stats import percentile  # noqa: E402

NAMES = {"bare": "bare Envoy", "floor": "floor (do-nothing grpc.aio, same chain)", "llamaswap": "llamaswap",
         "candidate": "llamaswap candidate (--candidate)"}


async def _aiohttp_round(url: str, body: bytes, seconds: float, clients: int) -> dict[str, Any]:
    """The fallback without wrk: `clients` sequential aiohttp clients for `seconds`."""
    headers = {"content-type": "application/json", "x-llamaswap-priority": "interactive"}
    latencies: list[float] = []
    async with session() as client:
        deadline = time.perf_counter() + seconds

        async def worker() -> None:
            while time.perf_counter() < deadline:
                start = time.perf_counter_ns()
                status, _ = await post(client, url, body, headers)
                latencies.append((time.perf_counter_ns() - start) / 1e6)
                if status != 200:
                    raise RuntimeError(f"{url}: HTTP {status}")

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        elapsed = time.perf_counter() - start
    return {"requests": len(latencies), "seconds": elapsed, "rps": len(latencies) / elapsed,
            "p50": percentile(latencies, 50), "p90": percentile(latencies, 90), "p99": percentile(latencies, 99),
            "max": max(latencies), "errors": 0, "non2xx": 0}


def one_round(bench: Bench, url: str, body: bytes, args: argparse.Namespace) -> dict[str, Any]:
    if args.client == "wrk":
        return run_wrk(url, body, seconds=args.seconds, connections=args.clients, workdir=bench.workdir)
    return asyncio.run(_aiohttp_round(url, body, args.seconds, args.clients))


def check_paths(paths: dict[str, str], body: bytes) -> None:
    """Every path must answer 200 (the figures of error answers are not the path's), and the
    llamaswap ones must really be scheduled (x-llamaswap-* headers on the answer). A failure names
    the path, the status, x-llamaswap-outcome and the body's beginning."""
    async def ask(url: str) -> tuple[int, dict[str, str], bytes]:
        async with session() as client:
            async with client.post(f"{url}/v1/chat/completions", data=body,
                                   headers={"content-type": "application/json"}) as response:
                return response.status, {k.lower(): v for k, v in response.headers.items()}, await response.read()

    for path, url in paths.items():
        status, headers, answer = asyncio.run(ask(url))
        if status != 200:
            raise RuntimeError(f"{path} ({url}): HTTP {status}, x-llamaswap-outcome "
                               f"{headers.get('x-llamaswap-outcome', '-')}: {answer[:300]!r}")
        if path in ("llamaswap", "candidate") and "x-llamaswap-band" not in headers:
            raise RuntimeError(f"the {path} path answered without x-llamaswap-* headers: not scheduled?")


def med(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


@contextlib.contextmanager
def candidate_stack(bench: Bench, pythonpath: str | None, sidecar_env: dict[str, str]) -> Iterator[Any]:
    """A second llamaswap (sidecar from `pythonpath`, e.g. a patched copy) and its Envoy, same bootstrap."""
    if not pythonpath:
        yield None
        return
    from harness import running_stack

    workdir = bench.workdir / "candidate"
    workdir.mkdir(exist_ok=True)
    with running_stack(workdir, BENCH_CONFIG, upstream_url=bench.upstream.url,
                       sidecar_env={**sidecar_env, "PYTHONPATH": pythonpath}) as stack:
        yield stack


def measure(bench: Bench, args: argparse.Namespace, candidate: Any = None) -> None:
    assert bench.null is not None and bench.null.envoy is not None and bench.bare is not None
    body = chat_body(pad_bytes=args.body_bytes)
    paths = {"bare": bench.bare_url, "floor": bench.null.url, "llamaswap": bench.sidecar_url}
    pids = {"llamaswap sidecar": bench.sidecar_pid, "floor sidecar": bench.null.pid,
            "Envoy": None, "upstream": bench.upstream.pid}
    envoys = {"bare": bench.bare.popen.pid, "floor": bench.null.envoy.popen.pid, "llamaswap": bench.envoy_pid}
    sidecars = {"floor": bench.null.pid, "llamaswap": bench.sidecar_pid}
    if candidate is not None:
        paths["candidate"] = candidate.url
        pids["candidate sidecar"] = candidate.sidecar.popen.pid
        envoys["candidate"] = candidate.envoy.popen.pid
        sidecars["candidate"] = candidate.sidecar.popen.pid
    check_paths(paths, body)
    for path, url in paths.items():  # warm-up: connections, code paths, Envoy's pools
        run_wrk(url, body, seconds=args.warmup, connections=args.clients, workdir=bench.workdir) \
            if args.client == "wrk" else asyncio.run(_aiohttp_round(url, body, args.warmup, args.clients))

    rounds: dict[str, list[dict[str, Any]]] = {path: [] for path in paths}
    print(f"{'round':>5} " + " ".join(f"{path + ' p50':>14}" for path in paths)
          + " " + " ".join(f"{path + ' rps':>14}" for path in paths) + "  load")
    with profiled(bench.sidecar_pid, args.profile):
        for index in range(args.rounds):
            order = list(paths) if index % 2 == 0 else list(reversed(paths))
            for path in order:
                watched = {name: pid for name, pid in pids.items() if pid is not None}
                watched["Envoy"] = envoys[path]
                before = {name: cpu_seconds(pid) for name, pid in watched.items()}
                sidecar_pid = sidecars.get(path)
                threads_before = thread_cpu(sidecar_pid) if sidecar_pid else {}
                result = one_round(bench, paths[path], body, args)
                if sidecar_pid:
                    result["threads_us"] = {group: 1e6 * (seconds - threads_before.get(group, 0.0))
                                            / max(1, result["requests"])
                                            for group, seconds in thread_cpu(sidecar_pid).items()}
                result["cpu_us"] = {name: 1e6 * (cpu_seconds(pid) - before[name]) / max(1, result["requests"])
                                    for name, pid in watched.items()}
                if result["non2xx"]:
                    raise RuntimeError(f"{path} ({paths[path]}): {result['non2xx']} non-2xx answers in a round")
                if result["errors"]:
                    print(f"warning: {path}: {result['errors']} socket errors")
                rounds[path].append(result)
            print(f"{index + 1:>5} " + " ".join(f"{rounds[path][-1]['p50']:>14.3f}" for path in paths) + " "
                  + " ".join(f"{rounds[path][-1]['rps']:>14.0f}" for path in paths) + f"  {machine_load()}")

    def added(path: str, key: str) -> float:
        return med([r[key] - b[key] for r, b in zip(rounds[path], rounds["bare"])])

    def ratio(path: str) -> float:
        return med([r["rps"] / b["rps"] for r, b in zip(rounds[path], rounds["bare"])])

    def cpu(path: str, name: str) -> float:
        return med([r["cpu_us"].get(name, 0.0) for r in rounds[path]])

    print()
    print(f"| path ({args.rounds} rounds x {args.seconds:g} s, {args.clients} client(s), medians) | p50 | p90 | p99 "
          "| rps | +p50 | +p99 | rps ratio | sidecar CPU/req | Envoy CPU/req |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for path in paths:
        sidecar = {"bare": None, "floor": "floor sidecar", "llamaswap": "llamaswap sidecar",
                   "candidate": "candidate sidecar"}[path]
        print(f"| {NAMES[path]} | {med([r['p50'] for r in rounds[path]]):.2f} ms "
              f"| {med([r['p90'] for r in rounds[path]]):.2f} ms | {med([r['p99'] for r in rounds[path]]):.2f} ms "
              f"| {med([r['rps'] for r in rounds[path]]):.0f} "
              + ("| - | - | - " if path == "bare" else
                 f"| {added(path, 'p50'):+.2f} ms | {added(path, 'p99'):+.2f} ms | {ratio(path):.2f} ")
              + f"| {'-' if sidecar is None else f'{cpu(path, sidecar):.0f} us'} | {cpu(path, 'Envoy'):.0f} us |")
    print()
    deltas = [r["p50"] - b["p50"] for r, b in zip(rounds["llamaswap"], rounds["bare"])]
    floor_deltas = [r["p50"] - b["p50"] for r, b in zip(rounds["floor"], rounds["bare"])]
    print(f"per round, llamaswap p50 - bare p50: min {min(deltas):+.2f}, median {med(deltas):+.2f}, "
          f"max {max(deltas):+.2f} ms; floor: min {min(floor_deltas):+.2f}, median {med(floor_deltas):+.2f}, "
          f"max {max(floor_deltas):+.2f} ms")
    for path in sidecars:
        groups = rounds[path][0].get("threads_us", {})
        print(f"{path} sidecar CPU per request by thread: " + ", ".join(
            f"{group} {med([r['threads_us'][group] for r in rounds[path]]):.0f} us" for group in groups))
    requests = sum(r["requests"] for r in rounds["llamaswap"])
    print(f"llamaswap requests in the measured rounds (the profile's window): {requests}")
    print(f"upstream CPU per request: {cpu('bare', 'upstream'):.0f} us (bare path), "
          f"{cpu('llamaswap', 'upstream'):.0f} us (llamaswap path)")
    floor_added, ours_added = added("floor", "p50"), added("llamaswap", "p50")
    floor_cpu, ours_cpu = cpu("floor", "floor sidecar"), cpu("llamaswap", "llamaswap sidecar")
    print(f"goal: added p50 < 1.00 ms: llamaswap {ours_added:+.2f} ms "
          f"({'met' if ours_added < 1.0 else f'missed by {ours_added - 1.0:.2f} ms'}), "
          f"floor {floor_added:+.2f} ms")
    added_ratio = ours_added / floor_added if floor_added > 0 else float("nan")
    print(f"goal: within 1.3x of the floor: added p50 {added_ratio:.2f}x, sidecar CPU per request "
          f"{ours_cpu / floor_cpu if floor_cpu else float('nan'):.2f}x ({ours_cpu:.0f} vs {floor_cpu:.0f} us), "
          f"latency {med([r['p50'] for r in rounds['llamaswap']]) / med([r['p50'] for r in rounds['floor']]):.2f}x")
    if candidate is not None:
        cand = [c["p50"] - r["p50"] for c, r in zip(rounds["candidate"], rounds["llamaswap"])]
        print(f"candidate vs llamaswap, same rounds: p50 {med(cand):+.3f} ms (per round min {min(cand):+.3f}, max "
              f"{max(cand):+.3f}), sidecar CPU per request {cpu('candidate', 'candidate sidecar'):.0f} vs "
              f"{ours_cpu:.0f} us, main thread "
              f"{med([c['threads_us']['main'] for c in rounds['candidate']]):.0f} vs "
              f"{med([r['threads_us']['main'] for r in rounds['llamaswap']]):.0f} us; candidate: p50 "
              f"{added('candidate', 'p50'):+.2f} ms, p99 {added('candidate', 'p99'):+.2f} ms, throughput ratio "
              f"{ratio('candidate'):.2f}")
    print(f"client {args.client}, body {len(body)} bytes, load average {machine_load()} "
          f"(at the start: {args.load_at_start})")
    print(f"floor: p50 {floor_added:+.2f} ms, p99 {added('floor', 'p99'):+.2f} ms, "
          f"throughput ratio {ratio('floor'):.2f}")
    print(f"overhead: p50 {ours_added:+.2f} ms, p99 {added('llamaswap', 'p99'):+.2f} ms, "
          f"throughput ratio {ratio('llamaswap'):.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3 rounds x 2 s per path")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=5.0, help="seconds per path per round")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds of warm-up per path")
    parser.add_argument("--clients", type=int, default=1, help="concurrent sequential clients (the goal: 1)")
    parser.add_argument("--client", choices=("wrk", "aiohttp"), default="wrk" if wrk_available() else "aiohttp",
                        help="load generator (default wrk when installed: apt-get install wrk)")
    parser.add_argument("--body-bytes", type=int, default=0, help="pad the prompt by this many bytes")
    parser.add_argument("--profile", help="py-spy the llamaswap sidecar during the rounds into this raw file")
    parser.add_argument("--cprofile", help="run the llamaswap sidecar under cProfile (bench/profile_serve.py); "
                                           "its stats go to this file when it stops")
    parser.add_argument("--candidate", metavar="PYTHONPATH",
                        help="also a second llamaswap whose sidecar runs with this PYTHONPATH (a patched copy, "
                             "outside the repo), in the same interleaved rounds: an A/B of a suggestion")
    add_stack_arguments(parser)
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.seconds, args.warmup = 3, 2.0, 1.0
    sidecar_env = sidecar_env_of(args)
    raise_nofile()
    args.load_at_start = machine_load()
    print(f"overhead: load average {args.load_at_start}, client {args.client}")
    from profile_serve import argv_for

    with bench_stack(bare=True, null=True, keep=args.keep, sidecar_env=sidecar_env,
                     sidecar_argv=argv_for(args.cprofile)) as bench:
        with candidate_stack(bench, args.candidate, sidecar_env) as candidate:
            measure(bench, args, candidate)


if __name__ == "__main__":
    main()
