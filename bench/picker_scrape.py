"""What an endpoint picker's scrape costs: a pod's metrics read every 50 ms by llm-d's router.

A real Coordinator with the real Telemetry as its observer holds one running grant and WAITING
(10,000) held Checks over several models. Two pages a picker can read: its own
(`Telemetry.picker_text`, at /llamaswap/v1/picker/metrics: its four gauges, written from the
published picture) and the whole `/metrics` (`Telemetry.prometheus_text`, an SDK collection of
every instrument). Beside them, in the same run:

- both pages of a second coordinator in the same process with SMALL (100) waiting, measured
  round by round with the first: the gauges are O(1), so the two should be alike;
- the picker's four gauges alone (their callbacks, as the SDK calls them);
- the floor: a MeterProvider with four gauges whose callbacks return a constant, rendered by
  the same reader (the SDK's and the renderer's cost for four series, llamaswap doing nothing).

Printed per scrape (median over rounds), and a last line:

    picker: N waiting: picker page N.N us/scrape (100 waiting N.N us), whole page N us, floor N.N us

Run: .venv/bin/python bench/picker_scrape.py [--quick] [--waiting N] [--rounds N]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from collections.abc import Callable, Iterable
from typing import Any

from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider

from llamaswap.config import parse_config
from llamaswap.runtime.coordinator import Coordinator
from llamaswap.runtime.ticket import Arrival
from llamaswap.telemetry import Telemetry
from llamaswap.telemetry.prometheus import PrometheusTextReader

PRIORITIES = ("interactive", "0", "batch", "100", "-50")
MODELS = ("qwen3", "gemma3", "llama3", "mistral", None)
SCRAPES_PER_ROUND = 200
SMALL = 100


def _arrival(request_id: str, rng: random.Random) -> Arrival:
    return Arrival(request_id, rng.choice(PRIORITIES), None, rng.choice(MODELS), "bench", None, None,
                   "POST", "/v1/chat/completions", rng.choice((None, 64, 256)), True)


def _floor() -> Callable[[], bytes]:
    reader = PrometheusTextReader()
    meter = MeterProvider(metric_readers=[reader]).get_meter("floor")

    def constant(options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(1)]

    for name in ("floor_waiting", "floor_running", "floor_saturation", "floor_info"):
        meter.create_observable_gauge(name, [constant])
    return reader.render


def _picker_gauges(telemetry: Telemetry) -> Callable[[], Any]:
    observe = (telemetry._observe_waiting, telemetry._observe_slots_busy,  # noqa: SLF001 - the callbacks themselves
               telemetry._observe_saturation, telemetry._observe_models_info)  # noqa: SLF001
    options = CallbackOptions()

    def read() -> Any:
        return [list(callback(options)) for callback in observe]

    return read


def _per_scrape_us(scrape: Callable[[], Any]) -> float:
    start = time.perf_counter()
    for _ in range(SCRAPES_PER_ROUND):
        scrape()
    return (time.perf_counter() - start) / SCRAPES_PER_ROUND * 1e6


async def _queue(waiting: int, rng: random.Random) -> tuple[Telemetry, Coordinator, list[asyncio.Task[Any]]]:
    """A coordinator observed by its own Telemetry, with one running grant and `waiting` held Checks."""
    telemetry = Telemetry()
    coordinator = Coordinator(parse_config({"envoy": {"leaseSeconds": 100_000}}), observer=telemetry)
    tasks = [asyncio.ensure_future(coordinator.admit(_arrival("running", rng)))]
    await asyncio.sleep(0)
    tasks += [asyncio.ensure_future(coordinator.admit(_arrival(f"w{i}", rng))) for i in range(waiting)]
    while coordinator.live_tickets() < waiting + 1:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.2)  # the arrival estimates' batch and the published picture
    text = telemetry.prometheus_text()[0].decode()
    assert f"llamaswap_scheduler_waiting_requests {waiting}" in text, "the page does not show the queue"
    return telemetry, coordinator, tasks


async def _main(args: argparse.Namespace) -> None:
    rng = random.Random(7)
    # Both queues live in one process (one heap, one machine state), measured round by round.
    small_telemetry, small_coordinator, small_tasks = await _queue(SMALL, rng)
    telemetry, coordinator, tasks = await _queue(args.waiting, rng)
    small = f"picker page, {SMALL} waiting"
    scrapes: dict[str, Callable[[], Any]] = {
        "picker page": telemetry.picker_text, small: small_telemetry.picker_text,
        "whole page": telemetry.prometheus_text, f"whole page, {SMALL} waiting": small_telemetry.prometheus_text,
        "picker gauges": _picker_gauges(telemetry), "floor": _floor()}
    figures: dict[str, list[float]] = {name: [] for name in scrapes}
    for _ in range(args.rounds):
        for name, scrape in scrapes.items():
            figures[name].append(_per_scrape_us(scrape))
    for each in (small_coordinator, coordinator):
        each.stop_admitting()
        each.close()
    for task in (*small_tasks, *tasks):
        task.cancel()
    await asyncio.gather(*small_tasks, *tasks, return_exceptions=True)
    small_telemetry.shutdown()
    telemetry.shutdown()

    median = {name: statistics.median(values) for name, values in figures.items()}
    print(f"{args.waiting} waiting, {args.rounds} rounds of {SCRAPES_PER_ROUND} scrapes; us per scrape (median):")
    for name, value in median.items():
        print(f"  {name:28}{value:10.1f}")
    print(f"picker: {args.waiting} waiting: picker page {median['picker page']:.1f} us/scrape "
          f"({SMALL} waiting {median[small]:.1f} us), whole page {median['whole page']:.0f} us, "
          f"floor {median['floor']:.1f} us")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument("--waiting", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=None)
    args = parser.parse_args()
    if args.rounds is None:
        args.rounds = 2 if args.quick else 7
    asyncio.run(_main(args))


if __name__ == "__main__":
    main()
