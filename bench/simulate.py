"""`llamaswap simulate` on a 100,000-request activity log: how long the replay takes.

The log is made the way the sidecar would have written it: a synthetic workload (chat at
interactive priority with per-tier offsets, API traffic at normal, batch jobs; four models
with different load costs; some chat clients give up) is run once through the engine with
the default settings, and each request becomes an activity-log line in finish order, with
its grant's swap/load flags, its run time (load included) and a time to first byte (a warm
base, plus the load cost when it loaded), behind a logging prefix, with a settings record
first and a few unrelated lines mixed in. The arrival rate is a little above what the GPU
serves, so the queue builds up over the run.

Then the file is replayed once with the default settings through the command's own `run`
(reading, parsing, measuring the costs, replaying, the table), timed without the generation.

Last line:

    simulate: 100000 requests in N.N s

Run: .venv/bin/python bench/simulate.py [--requests N] [--keep FILE] [--profile FILE]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pathlib
import random
import sys
import tempfile
import time

from llamaswap.core import Policy
from llamaswap.commands import simulate as cli
from llamaswap.simulate.engine import prepare, simulate
from llamaswap.simulate.results import Simulation
from llamaswap.simulate.workload import Distribution, TrafficClass, Workload, costs, generate

SWAP_S = {"qwen3-8b": 12.0, "gemma3-4b": 6.0, "llama3-3b": 5.0, "phi4-mini": 4.0}
PREFIX = "2026-01-05 10:00:00,000 INFO llamaswap.activity: "


def workload(requests: int) -> Workload:
    # Mean GPU time per request is about 4.3 s with this mix; 0.24 arrivals/s keeps the GPU
    # a little over-subscribed, so waits grow through the run.
    classes = (
        TrafficClass("chat-free", 0.070, 100, (("qwen3-8b", 3.0), ("gemma3-4b", 1.0)),
                     Distribution("lognormal", 2.0, 0.6), Distribution("uniform", 30.0, 600.0), SWAP_S["qwen3-8b"]),
        TrafficClass("chat-pro", 0.030, 101, (("qwen3-8b", 3.0), ("gemma3-4b", 1.0)),
                     Distribution("lognormal", 2.0, 0.6), None, SWAP_S["qwen3-8b"]),
        TrafficClass("api", 0.100, 0, (("llama3-3b", 2.0), ("phi4-mini", 1.0), ("qwen3-8b", 1.0)),
                     Distribution("exponential", 3.0), None, SWAP_S["llama3-3b"]),
        TrafficClass("batch", 0.040, -100, (("llama3-3b", 1.0), ("gemma3-4b", 1.0)),
                     Distribution("uniform", 2.0, 20.0), None, SWAP_S["llama3-3b"]),
    )
    rate = sum(c.rate for c in classes)
    return Workload(duration_s=requests / rate * 1.02, seed=7, classes=classes)


def activity_lines(simulation: Simulation, origin_ms: float, seed: int) -> list[str]:
    """What the sidecar would have logged for this simulation, in finish order."""
    rng = random.Random(seed)
    lines: list[tuple[int, str]] = []
    for result in simulation.results:
        request, record = result.request, result.request.record
        arrival_ms = origin_ms + request.arrival_ns / 1e6
        document: dict[str, object] = {
            "event": "request", "time": None, "request_id": record.request_id, "trace_id": None,
            "model": record.model, "outcome": result.outcome.value, "dispatched": result.start_ns is not None,
            "serial_priority": record.priority, "serial_band": request.priority.band.value,
            "serial_queue_wait_ms": round(result.wait_ns / 1e6, 3), "arrival_unix_ms": round(arrival_ms, 3),
            "granted_unix_ms": None, "first_byte_ms": None, "run_ms": None, "settle_ms": 0.0,
            "swap": False, "load": False, "status": None,
        }
        finished_ns = result.end_ns
        if result.start_ns is not None and result.release_ns is not None:
            warm_ms = rng.uniform(50.0, 300.0)
            swap_ms = SWAP_S[record.model or ""] * 1000 if result.model_load else 0.0
            document.update(granted_unix_ms=round(origin_ms + result.start_ns / 1e6, 3),
                            first_byte_ms=round(warm_ms + swap_ms, 3),
                            run_ms=round((result.release_ns - result.start_ns) / 1e6, 3),
                            swap=result.model_load, status=200)
            finished_ns = result.release_ns
        document["time"] = round((origin_ms + finished_ns / 1e6) / 1000, 3)
        lines.append((finished_ns, PREFIX + json.dumps(document, separators=(",", ":")) + "\n"))
    lines.sort(key=lambda item: item[0])
    return [line for _, line in lines]


def write_log(path: pathlib.Path, requests: int) -> Simulation:
    spec = workload(requests)
    records = generate(spec)[:requests]
    reality = simulate(prepare(records), Policy.serial(aging_divisor_s=60, swap_affinity_bonus=10),
                       costs(spec, records))
    origin_ms = 1_767_600_000_000.0
    settings = {"event": "settings", "time": origin_ms / 1000, "scheduler": "serial", "aging_divisor_s": 60,
                "swap_affinity_bonus": 10, "max_queued": 0, "max_wait_s": 0, "model_priorities": {}}
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(PREFIX + json.dumps(settings) + "\n")
        handle.write("2026-01-05 10:00:00,001 INFO llamaswap.commands.serve: listening on 127.0.0.1:9000\n")
        for number, line in enumerate(activity_lines(reality, origin_ms, seed=3)):
            if number % 20_000 == 0:
                handle.write("2026-01-05 10:00:02,000 WARNING llamaswap.runtime: upstream slow to answer /models\n")
            handle.write(line)
    return reality


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--keep", help="write the activity log here (default: a temporary file)")
    parser.add_argument("--profile", help="write a cProfile of the replay here")
    options = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(options.keep or pathlib.Path(tmp) / "activity.jsonl")
        started = time.perf_counter()
        reality = write_log(path, options.requests)
        generated_s = time.perf_counter() - started
        print(f"generated {options.requests:,} requests ({path.stat().st_size / 1e6:.1f} MB) in {generated_s:.1f} s; "
              f"peak waiting {reality.metrics.peak_waiting:,}")

        commands = argparse.ArgumentParser().add_subparsers()
        args = cli.add_parser(commands).parse_args(["--activity", str(path), "--format", "json"])
        out, err = io.StringIO(), io.StringIO()
        profiler = cProfile.Profile() if options.profile else None
        started = time.perf_counter()
        if profiler is not None:
            profiler.enable()
        status = cli.run(args, out=out, err=err)
        if profiler is not None:
            profiler.disable()
        replay_s = time.perf_counter() - started
        if profiler is not None:
            profiler.dump_stats(options.profile)
    if status != 0:
        print(f"the replay failed ({status}): {err.getvalue().strip()}")
        return 0
    document = json.loads(out.getvalue())
    row = document["rows"][0]
    for band, stats in row["bands"].items():
        print(f"{band:>11}: {stats['served']:6,} served, wait p50 {stats['wait_p50_s'] or 0:8.1f} s, "
              f"p95 {stats['wait_p95_s'] or 0:8.1f} s, max {stats['wait_max_s'] or 0:8.1f} s")
    inversion = row["worst_inversion"]
    print(f"swaps {row['swaps']:,}, reorders aging {row['reorders']['aging']:,} / affinity "
          f"{row['reorders']['swap_affinity']:,}, busy {row['busy_fraction']:.3f}, left {row['left']:,}, "
          f"peak waiting {row['peak_waiting']:,}, skipped lines {document['skipped_lines']}")
    if inversion:
        print(f"worst inversion {inversion['seconds']:.1f} s ({inversion['request_id']}, {inversion['band']})")
    same = row["bands"] == {band: {"served": s.served, "wait_p50_s": s.wait_p50_s, "wait_p95_s": s.wait_p95_s,
                                   "wait_max_s": s.wait_max_s} for band, s in reality.metrics.bands.items()}
    print(f"replay with the recorded settings reproduces the recorded waits: {'yes' if same else 'no'}")
    print(f"simulate: {options.requests} requests in {replay_s:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
