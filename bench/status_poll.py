"""What clients polling their own status cost the event loop: `GET /llamaswap/v1/requests/{id}`.

A real Coordinator on a real asyncio loop holds one running grant and WAITING (10,000) held
Checks, with a mix of priorities, models and output sizes. Then POLLERS (100) clients each ask
for their own request's status, round after round; in each round every poller asks once (the
document the route answers, `adapters.admin.status_document`, which is what runs on the only
event loop). Three ways, interleaved round by round, in the same run:

- llamaswap: `status_document` as shipped (its row of the current walk, by the walk's index);
- before: what the route did until issue 17 (build the whole live view, then scan it for the id);
- floor: a do-nothing route (find the ticket by id and answer a constant-shaped document).

Each is timed with no change between rounds (the walk is reused) and with one change per round
(a request arrives: the next poll walks the queue again, at most once per change). Printed per
poll (median over rounds), and a last line:

    status: N waiting, N pollers: N.N us/poll (one change per round N.N us), before N us, floor N.N us

Run: .venv/bin/python bench/status_poll.py [--quick] [--waiting N] [--pollers N] [--rounds N]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

from llamaswap.adapters.admin import status_document
from llamaswap.config import parse_config
from llamaswap.runtime.coordinator import Coordinator
from llamaswap.runtime.ticket import Arrival

PRIORITIES = ("interactive", "0", "batch", "100", "-50")
MODELS = ("qwen3", "gemma3", "llama3", None)


def _arrival(request_id: str, rng: random.Random) -> Arrival:
    return Arrival(request_id, rng.choice(PRIORITIES), None, rng.choice(MODELS), "bench", None, None,
                   "POST", "/v1/chat/completions", rng.choice((None, 64, 256, 1024)), True)


def _before(coordinator: Coordinator, request_id: str) -> dict[str, Any] | None:
    """The route until issue 17: the whole view, then a scan for the id."""
    view = coordinator.view()
    for row in view.waiting:
        if row.request_id == request_id:
            return {"request_id": request_id, "state": "waiting", "position": row.position, "priority": row.priority,
                    "band": row.band.value, "score": row.score, "waited_s": row.waited_s,
                    "estimated_start_s": row.estimated_start_s}
    return None


def _floor(coordinator: Coordinator, request_id: str) -> dict[str, Any] | None:
    """Do nothing but find the ticket and answer."""
    ticket = coordinator._request_ids.first.get(request_id)  # noqa: SLF001 - the floor reads the index directly
    if ticket is None:
        return None
    return {"request_id": request_id, "state": "waiting", "position": 0, "priority": ticket.priority.value,
            "band": ticket.priority.band.value, "score": 0.0, "waited_s": 0.0, "estimated_start_s": 0.0}


async def _fill(coordinator: Coordinator, waiting: int, rng: random.Random) -> list[asyncio.Task[Any]]:
    tasks = [asyncio.ensure_future(coordinator.admit(_arrival("running", rng)))]
    await asyncio.sleep(0)
    tasks += [asyncio.ensure_future(coordinator.admit(_arrival(f"w{i}", rng))) for i in range(waiting)]
    while coordinator.live_tickets() < waiting + 1:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.2)  # the arrival estimates' batch
    return tasks


async def _main(args: argparse.Namespace) -> None:
    rng = random.Random(7)
    coordinator = Coordinator(parse_config({"envoy": {"leaseSeconds": 100_000}}))
    tasks = await _fill(coordinator, args.waiting, rng)
    pollers = [f"w{i * args.waiting // args.pollers}" for i in range(args.pollers)]
    ways: dict[str, Callable[[Coordinator, str], dict[str, Any] | None]] = {
        "llamaswap": status_document, "before": _before, "floor": _floor}
    per_poll: dict[tuple[str, bool], list[float]] = {(name, change): [] for name in ways for change in (False, True)}
    extra = 0
    for _ in range(args.rounds):
        for change in (False, True):
            for name, way in ways.items():
                if change:  # one arrival: the queue changed, the next poll walks again
                    tasks.append(asyncio.ensure_future(coordinator.admit(_arrival(f"x{extra}", rng))))
                    extra += 1
                    await asyncio.sleep(0)
                else:
                    way(coordinator, pollers[0])  # the walk of this version, made before timing
                start = time.perf_counter()
                for request_id in pollers:
                    if way(coordinator, request_id) is None:
                        raise AssertionError(f"{name}: no status for {request_id}")
                per_poll[(name, change)].append((time.perf_counter() - start) / len(pollers) * 1e6)
    coordinator.stop_admitting()
    coordinator.close()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)

    def median(name: str, change: bool) -> float:
        return statistics.median(per_poll[(name, change)])

    print(f"{args.waiting} waiting, {args.pollers} pollers, {args.rounds} rounds; us per poll (median of rounds):")
    print(f"{'':12}{'no change':>12}{'1 change/round':>16}")
    for name in ways:
        print(f"{name:12}{median(name, False):12.1f}{median(name, True):16.1f}")
    print(f"status: {args.waiting} waiting, {args.pollers} pollers: {median('llamaswap', False):.1f} us/poll "
          f"(one change per round {median('llamaswap', True):.1f} us), before {median('before', False):.0f} us, "
          f"floor {median('floor', False):.1f} us")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument("--waiting", type=int, default=10_000)
    parser.add_argument("--pollers", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=None)
    args = parser.parse_args()
    if args.rounds is None:
        args.rounds = 2 if args.quick else 5
    asyncio.run(_main(args))


if __name__ == "__main__":
    main()
