"""The scheduling core's cost per dispatch, against a brute-force scan, in the same run.

For each queue depth d (100, 1,000, 10,000, 100,000) the queue is filled to d requests
(priorities drawn from {-100, -99, -98, 0, 1, 100}, models from a few names, the clock
advancing between arrivals), then a loop of rounds is timed; each round does one enqueue,
one next() and one release(), so the depth stays at d. The serial policy runs with its
defaults (agingDivisor 60, swapAffinityBonus 10) and a model loaded, so swap affinity is
real: the loaded model follows every dispatch. The clock moves on by up to two seconds each
round, so aging keeps changing the order.

The scan is the obvious implementation: a list of waiting requests and, at each dispatch, a
pass over all of them computing each one's current score (priority + bonus + aging), best
score wins, ties by arrival. It runs the same workload (same seed) with fewer rounds at the
largest depths, since each of its dispatches is O(n).

A last extra line (before the summary) measures an adversarial pattern: a few old
low-priority requests spread through a long run of normal ones, which are then dispatched
one by one. Each decision names up to 16 earlier arrivals it overtook; this shows what
finding them costs when the ones left behind are far apart.

The shape of the node (flags; the defaults are the shape above, one GPU of one slot with one
model resident at a time): ``--gpus N`` GPUs of ``--slots N`` slots each, keeping up to
``--max-loaded N`` models resident, with requests of ``--models N`` models (the first N names).
With several slots every slot is kept busy: the queue is filled with the slots' worth more, they
are granted, and each round then releases the earliest running grant instead of the one it just
made. With several GPUs each next() is handed the times the runtime hands it
(`NodeTimes.of_grants` of the running grants, read only if the rule asks), as the coordinator
does. The scan keeps the same number of grants running. ``--depth N`` runs that depth only.

Issue 45's shape, per dispatch at 100,000 waiting:

    .venv/bin/python bench/core.py --depth 100000 --models 1 --slots 4 --gpus 2 --max-loaded 3

Last line:

    core: depth 100000: N.N us/dispatch, scan N.N us/dispatch, ratio N.N

Run: .venv/bin/python bench/core.py [--quick] [--profile FILE] [--depth N] [--models N] [--slots N]
[--gpus N] [--max-loaded N]
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import gc
import random
import statistics
import sys
import time
from collections import deque

from llamaswap.core import Estimator, ManualClock, Policy, Priority, PrioritySource, Residency, Scheduler, Slots
from llamaswap.core.dispatch import NO_TIMES, GpuTimes
from llamaswap.core.estimate_node import NodeTimes
from llamaswap.core.policy import GpuPolicy

PRIORITIES = (-100, -99, -98, 0, 1, 100)
MODELS = ("qwen3-8b", "llama-3.1-8b", "gemma-3-4b", "phi-4")
AGING_DIVISOR_S = 60.0
BONUS = 10
NS = 1_000_000_000
MAX_GAP_NS = 2 * NS  # the clock moves on by up to this much per arrival

# depth: (rounds for the real scheduler, rounds for the scan)
PLAN = {100: (20_000, 20_000), 1_000: (20_000, 3_000), 10_000: (20_000, 300), 100_000: (20_000, 60)}
CHUNKS = 5
QUICK_PLAN = {100: (5_000, 5_000), 1_000: (5_000, 500), 10_000: (5_000, 60), 100_000: (5_000, 12)}


@dataclasses.dataclass(frozen=True)
class Shape:
    """The node the requests wait for, and the models they ask for."""

    gpus: int = 1
    slots: int = 1  # per GPU
    max_loaded: int = 1
    models: int = len(MODELS)

    @property
    def running(self) -> int:
        """Grants running at once once every slot is busy."""
        return self.gpus * self.slots

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(MODELS[i] if i < len(MODELS) else f"model-{i}" for i in range(self.models))

    def policy(self) -> Policy:
        serial = Policy.serial(aging_divisor_s=AGING_DIVISOR_S, swap_affinity_bonus=BONUS)
        if self == Shape():
            return serial
        residency = Residency(self.max_loaded, frozenset(), None, {})
        return serial.with_gpus(tuple(GpuPolicy(f"gpu{i}", Slots(self.slots), None, residency)
                                      for i in range(self.gpus)))


def workload(depth: int, rounds: int, seed: int, shape: Shape = Shape()):
    """The same arrivals for both implementations: (id, priority, model, gap_ns). The queue's
    fill has the slots' worth more, which are granted before the timed loop (one slot: one)."""
    rng = random.Random(seed)
    names = shape.names

    def arrival(name: str):
        return name, rng.choice(PRIORITIES), rng.choice(names), rng.randrange(1, MAX_GAP_NS)

    fill = [arrival(f"f{i}") for i in range(depth + shape.running - 1)]
    loop = [arrival(f"r{i}") for i in range(rounds)]
    return fill, loop


class ScanScheduler:
    """Brute force: every dispatch computes every waiting request's score (``slots`` grants at once)."""

    def __init__(self, aging_divisor_s: float, bonus: int, clock: ManualClock, slots: int = 1) -> None:
        self.divisor_ns = round(aging_divisor_s * NS)
        self.bonus = bonus
        self.clock = clock
        self.loaded_model: str | None = None
        self.waiting: list[tuple[int, str | None, int, int, str]] = []  # priority, model, arrival, seq, id
        self.running: set[str] = set()
        self.slots = slots
        self.seq = 0

    def enqueue(self, request_id: str, priority: int, model: str | None) -> None:
        self.seq += 1
        self.waiting.append((priority, model, self.clock.now_ns(), self.seq, request_id))

    def next(self) -> str | None:
        if len(self.running) >= self.slots or not self.waiting:
            return None
        now = self.clock.now_ns()
        divisor, bonus, loaded = self.divisor_ns, self.bonus, self.loaded_model
        best_index = -1
        best_score = best_seq = 0.0
        for index, (priority, model, arrival, seq, _) in enumerate(self.waiting):
            score = priority + (bonus if model == loaded else 0) + ((now - arrival) / divisor if divisor else 0.0)
            if best_index < 0 or score > best_score or (score == best_score and seq < best_seq):
                best_index, best_score, best_seq = index, score, seq
        winner = self.waiting[best_index]
        last = self.waiting.pop()  # swap-remove: O(1), order is kept by seq
        if best_index < len(self.waiting):
            self.waiting[best_index] = last
        if winner[1] is not None:
            self.loaded_model = winner[1]
        self.running.add(winner[4])
        return winner[4]

    def release(self, request_id: str) -> None:
        self.running.remove(request_id)


def _chunks(loop: list, count: int = CHUNKS) -> list[list]:
    """The timed loop in a few consecutive chunks: this machine is shared, so the median
    chunk is reported, which a burst of someone else's work does not move much."""
    size = max(1, len(loop) // count)
    return [loop[i:i + size] for i in range(0, len(loop), size)]


def run_real(depth: int, rounds: int, seed: int, profile: cProfile.Profile | None = None,
             shape: Shape = Shape()) -> tuple[list[float], list[str]]:
    fill, loop = workload(depth, rounds, seed, shape)
    clock = ManualClock()
    scheduler = Scheduler(shape.policy(), clock)
    priorities = {p: Priority(p, PrioritySource.NUMBER) for p in PRIORITIES}
    for rid, prio, model, gap in fill:
        clock.set_ns(clock.now_ns() + gap)
        scheduler.enqueue(rid, priorities[prio], model)
    for gpu in scheduler.gpus:  # the first model resident on every GPU
        scheduler.set_residents(frozenset(shape.names[:1]), as_of=scheduler.dispatches_on(gpu), gpu=gpu)
    # The times the runtime hands the rule (read only if it asks: to choose among GPUs).
    figures = Estimator(default_run_s=10.0, default_swap_s=5.0, samples=5)
    grants = lambda: scheduler.running_grants  # noqa: E731 (read only when the rule asks)
    node = shape.gpus > 1

    def times() -> GpuTimes:
        return NodeTimes.of_grants(grants, clock.now_ns(), figures) if node else NO_TIMES

    running: deque[str] = deque()
    while len(running) < shape.running - 1 and (decision := scheduler.next(times())) is not None:
        running.append(decision.request_id)
    loop = [(rid, priorities[prio], model, gap) for rid, prio, model, gap in loop]
    granted: list[str] = []
    enqueue, next_, release, advance = scheduler.enqueue, scheduler.next, scheduler.release, clock.set_ns
    chunks: list[float] = []
    gc.collect()
    if profile is not None:
        profile.enable()
    for chunk in _chunks(loop):
        start = time.perf_counter_ns()
        for rid, prio, model, gap in chunk:
            advance(clock.now_ns() + gap)
            enqueue(rid, prio, model)
            decision = next_(times()) if node else next_()
            if decision is not None:
                running.append(decision.request_id)
                granted.append(decision.request_id)
            if running:  # (one slot: the grant just made; several: the earliest running)
                release(running.popleft())
        chunks.append((time.perf_counter_ns() - start) / len(chunk) / 1000)
    if profile is not None:
        profile.disable()
    assert scheduler.depth == depth or shape != Shape(), (scheduler.depth, depth)
    return chunks, granted


def run_scan(depth: int, rounds: int, seed: int, shape: Shape = Shape()) -> tuple[list[float], list[str]]:
    fill, loop = workload(depth, rounds, seed, shape)
    clock = ManualClock()
    scan = ScanScheduler(AGING_DIVISOR_S, BONUS, clock, shape.running)
    for rid, prio, model, gap in fill:
        clock.set_ns(clock.now_ns() + gap)
        scan.enqueue(rid, prio, model)
    scan.loaded_model = shape.names[0]
    running: deque[str] = deque()
    while len(running) < shape.running - 1 and (winner := scan.next()) is not None:
        running.append(winner)
    granted: list[str] = []
    chunks: list[float] = []
    gc.collect()
    for chunk in _chunks(loop):
        start = time.perf_counter_ns()
        for rid, prio, model, gap in chunk:
            clock.set_ns(clock.now_ns() + gap)
            scan.enqueue(rid, prio, model)
            winner = scan.next()
            if winner is not None:
                running.append(winner)
                granted.append(winner)
            if running:
                scan.release(running.popleft())
        chunks.append((time.perf_counter_ns() - start) / len(chunk) / 1000)
    assert len(scan.waiting) == depth or shape != Shape()
    return chunks, granted


def run_adversarial(depth: int) -> float:
    """16 old batch requests spread through `depth` normal ones; dispatch half the normals."""
    clock = ManualClock()
    scheduler = Scheduler(Policy.serial(aging_divisor_s=AGING_DIVISOR_S, swap_affinity_bonus=BONUS), clock)
    batch, normal = Priority(-100, PrioritySource.NUMBER), Priority(0, PrioritySource.NUMBER)
    spacing = max(1, depth // 16)
    for i in range(depth):
        if i % spacing == 0:
            scheduler.enqueue(f"b{i}", batch)
        scheduler.enqueue(f"n{i}", normal)
        clock.set_ns(clock.now_ns() + 1000)  # a microsecond apart: aging changes nothing here
    rounds = depth // 2
    gc.collect()
    # (timed as one piece: the cost grows as the run goes on)
    start = time.perf_counter_ns()
    for _ in range(rounds):
        decision = scheduler.next()
        scheduler.release(decision.request_id)
    return (time.perf_counter_ns() - start) / rounds / 1000


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (a smoke test)")
    parser.add_argument("--profile", metavar="FILE", help="cProfile the real scheduler's loop at 100,000")
    parser.add_argument("--seed", type=int, default=20240601)
    parser.add_argument("--depth", type=int, choices=sorted(PLAN), help="run this depth only")
    parser.add_argument("--models", type=int, default=len(MODELS), help="models the requests ask for (default 4)")
    parser.add_argument("--slots", type=int, default=1, help="slots per GPU (default 1)")
    parser.add_argument("--gpus", type=int, default=1, help="GPUs of the node (default 1)")
    parser.add_argument("--max-loaded", type=int, default=1, help="models resident per GPU at once (default 1)")
    args = parser.parse_args(argv)
    shape = Shape(args.gpus, args.slots, args.max_loaded, args.models)
    if min(shape.gpus, shape.slots, shape.max_loaded, shape.models) < 1:
        parser.error("--models, --slots, --gpus and --max-loaded must be at least 1")
    plan = QUICK_PLAN if args.quick else PLAN
    if args.depth is not None:
        plan = {args.depth: plan[args.depth]}
    if shape != Shape():
        print(f"core: {shape.gpus} GPU(s) of {shape.slots} slot(s), maxLoaded {shape.max_loaded}, "
              f"{shape.models} model(s)", flush=True)

    results: dict[int, tuple[float, float]] = {}
    for depth, (real_rounds, scan_rounds) in plan.items():
        real_chunks, real_granted = run_real(depth, real_rounds, args.seed + depth, shape=shape)
        scan_chunks, scan_granted = run_scan(depth, scan_rounds, args.seed + depth, shape)
        real_us, scan_us = statistics.median(real_chunks), statistics.median(scan_chunks)
        # Same workload, same seed: the winners should match (a float scan could in
        # principle break an exact tie differently, so this is reported, not asserted).
        same = sum(a == b for a, b in zip(real_granted, scan_granted))
        results[depth] = (real_us, scan_us)
        print(f"core: depth {depth}: {real_us:.1f} us/dispatch (median of {len(real_chunks)} chunks of "
              f"{real_rounds // CHUNKS} rounds; min {min(real_chunks):.1f}, max {max(real_chunks):.1f}), "
              f"scan {scan_us:.1f} us/dispatch ({scan_rounds} rounds; min {min(scan_chunks):.1f}), "
              f"ratio {scan_us / real_us:.1f}, same winner {same}/{len(scan_granted)}", flush=True)

    if args.profile:
        profile = cProfile.Profile()
        rounds = (QUICK_PLAN if args.quick else PLAN)[100_000][0]
        run_real(100_000, rounds, args.seed + 100_000, profile, shape)
        profile.dump_stats(args.profile)
        print(f"core: profile of the real loop at depth 100000 written to {args.profile}", flush=True)

    adversarial_depth = 20_000 if args.quick else 100_000
    print(f"core: adversarial depth {adversarial_depth}: {run_adversarial(adversarial_depth):.1f} us/dispatch "
          "(old requests far apart in arrival order; see the module doc)", flush=True)

    last = max(results)
    real_us, scan_us = results[last]
    print(f"core: depth {last}: {real_us:.1f} us/dispatch, scan {scan_us:.1f} us/dispatch, "
          f"ratio {scan_us / real_us:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
