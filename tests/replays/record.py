"""Records the activity logs of tests/replays/ through the real stack: the real Envoy binary, the
real sidecar process and the fake llama-server(s) of e2e/, started as the end-to-end tests start
them (e2e/harness.py, e2e/gpu_stack.py). tests/test_replays.py replays each log with
`llamaswap simulate` and checks that the replay decides as the sidecar did.

    PYTHONPATH=$PWD/sidecar .venv/bin/python tests/replays/record.py [--out DIR] [NAME ...]

Each workload goes in waves: the GPU(s) held by a request the fake holds, a wave queued behind it
(each request polled into the queue before the next is sent), then the hold released. Every
decision of a wave is so taken among requests that are all waiting, far from any arrival, which
keeps a log's decisions the same whatever the machine's speed; the runs (`x-test-sleep-ms`) and
the seconds a request is left to age are the workload's content, not readiness waits.
"""

from __future__ import annotations

import asyncio
import json
import pathlib
import sys
import tempfile
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import aiohttp
import yaml

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent / "e2e"))

from client import Reply, chat  # noqa: E402
from fake_llama import FakeLlamaServer  # noqa: E402
from gpu_stack import running_node  # noqa: E402
from harness import async_wait_for, merge, running_stack  # noqa: E402

# (request id, priority header, model, run ms)
Wave = Sequence[tuple[str, str, str, int]]


class Target:
    """Where a workload sends its requests: the URL, the sidecar's queue and the fakes."""

    def __init__(self, url: str, queue: Callable[[], dict[str, Any]], fakes: Sequence[FakeLlamaServer]) -> None:
        self.url = url
        self.queue = queue
        self.fakes = fakes
        self.tasks: list[asyncio.Task[Reply]] = []

    def waiting(self) -> list[str]:
        return [row["request_id"] for row in self.queue()["waiting"]]

    def at_a_fake(self, request_id: str) -> bool:
        return any(request_id in fake.order() for fake in self.fakes)

    async def hold(self, session: aiohttp.ClientSession, request_id: str, model: str) -> None:
        """A request that runs until released: its GPU (or slot) is busy meanwhile."""
        self.tasks.append(asyncio.create_task(chat(session, self.url, request_id, model=model, hold=True)))
        await async_wait_for(lambda: self.at_a_fake(request_id), what=f"{request_id} at a fake")

    def release(self, request_id: str) -> None:
        for fake in self.fakes:
            if request_id in fake.order():
                fake.release(request_id)

    async def queue_wave(self, session: aiohttp.ClientSession, wave: Wave) -> None:
        for request_id, priority, model, run_ms in wave:
            self.tasks.append(asyncio.create_task(chat(session, self.url, request_id, priority=priority, model=model,
                                                       sleep_ms=run_ms)))
            await async_wait_for(lambda rid=request_id: rid in self.waiting() or self.at_a_fake(rid),
                                 what=f"{request_id} arrived")

    async def drain(self) -> None:
        replies = await asyncio.gather(*self.tasks)
        self.tasks.clear()
        bad = [reply.status for reply in replies if reply.status != 200]
        if bad:
            raise RuntimeError(f"requests answered {bad}")


def _records(path: pathlib.Path) -> list[dict[str, Any]]:
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line) for line in lines if line.strip()]


async def _all_recorded(path: pathlib.Path, count: int) -> None:
    await async_wait_for(lambda: sum(r.get("event") == "request" for r in _records(path)) >= count,
                         what=f"{count} request records")


def _wave(prefix: str, items: Sequence[tuple[str, str, int]]) -> Wave:
    return [(f"{prefix}{index}", priority, model, run_ms) for index, (priority, model, run_ms) in enumerate(items)]


MIXED = [("interactive", "model-b", 40), ("normal", "model-a", 30), ("normal", "model-c", 30),
         ("batch", "model-a", 30), ("normal", "model-a", 30), ("interactive", "model-c", 40),
         ("normal", "model-b", 30), ("batch", "model-b", 20), ("5", "model-c", 25), ("-5", "model-a", 25)]


async def one_gpu(target: Target, session: aiohttp.ClientSession) -> int:
    """Slots 1, three models on a router (one in memory): priorities, swaps, swap affinity, aging."""
    await target.hold(session, "hold1", "model-a")
    await target.queue_wave(session, _wave("w1-", MIXED))
    target.release("hold1")
    await target.drain()
    # Aging: o1 (priority -5) waits four seconds at 2 points a second; n-requests of priority 0
    # that come after it for the same model go after it (they would go first without aging).
    await target.hold(session, "hold2", "model-a")
    await target.queue_wave(session, [("o1", "-5", "model-a", 30), ("o2", "-5", "model-b", 30)])
    await asyncio.sleep(4.0)  # the workload: o1 and o2 age
    await target.queue_wave(session, _wave("w2-", [("0", "model-a", 30), ("0", "model-b", 30), ("0", "model-a", 30),
                                                   ("interactive", "model-c", 30), ("-5", "model-c", 20)]))
    target.release("hold2")
    await target.drain()
    # One at a time on a free GPU: each is granted at once.
    for index, model in enumerate(("model-c", "model-a", "model-a", "model-b")):
        target.tasks.append(asyncio.create_task(chat(session, target.url, f"s{index}", model=model, sleep_ms=20)))
        await target.drain()
    return 2 + len(MIXED) + 2 + 5 + 4


async def two_gpus(target: Target, session: aiohttp.ClientSession) -> int:
    """Two GPUs (`upstreams:`), slots 1, three models, one in memory on each."""
    await target.hold(session, "hold1", "model-a")
    await target.hold(session, "hold2", "model-b")
    await target.queue_wave(session, _wave("w1-", MIXED))
    target.release("hold1")  # one GPU frees first and takes work alone for a while
    await async_wait_for(lambda: sum(target.at_a_fake(f"w1-{i}") for i in range(len(MIXED))) >= 3,
                         what="three of the wave granted")
    target.release("hold2")
    await target.drain()
    await target.hold(session, "hold3", "model-c")
    await target.hold(session, "hold4", "model-c")
    await target.queue_wave(session, _wave("w2-", list(reversed(MIXED))))
    target.release("hold3")
    target.release("hold4")
    await target.drain()
    return 4 + 2 * len(MIXED)


RESIDENT_MIXED = [("normal", "model-b", 30), ("normal", "model-c", 30), ("interactive", "model-a", 30),
                  ("normal", "model-b", 30), ("batch", "model-c", 20), ("interactive", "model-d", 30),
                  ("normal", "model-a", 30), ("normal", "model-d", 30), ("batch", "model-b", 20),
                  ("5", "model-c", 30), ("normal", "model-a", 20), ("interactive", "model-b", 30)]


async def resident(target: Target, session: aiohttp.ClientSession) -> int:
    """Several models resident on one GPU (a router with --models-max): loads beside the resident
    ones, evictions of the least needed."""
    await target.hold(session, "hold1", "model-a")
    await target.queue_wave(session, _wave("w1-", RESIDENT_MIXED))
    target.release("hold1")
    await target.drain()
    for index, model in enumerate(("model-d", "model-a", "model-c", "model-b", "model-a", "model-d")):
        target.tasks.append(asyncio.create_task(chat(session, target.url, f"s{index}", model=model, sleep_ms=20)))
        await target.drain()
    await target.hold(session, "hold2", "model-c")
    await target.queue_wave(session, _wave("w2-", list(reversed(RESIDENT_MIXED))))
    target.release("hold2")
    await target.drain()
    return 2 + 2 * len(RESIDENT_MIXED) + 6


SLOTS_MIXED = [("normal", "model-a", 60), ("batch", "model-a", 40), ("normal", "model-a", 50),
               ("interactive", "model-a", 40), ("normal", "model-a", 30), ("batch", "model-a", 60),
               ("interactive", "model-a", 30), ("normal", "model-a", 40), ("5", "model-a", 50),
               ("interactive", "model-a", 20), ("batch", "model-a", 30), ("normal", "model-a", 40)]


async def slots(target: Target, session: aiohttp.ClientSession) -> int:
    """Four slots, one kept for the interactive band: three normal requests fill the others, an
    interactive one takes the kept slot, the rest wait and run four at a time."""
    for index in range(3):
        await target.hold(session, f"hold{index}", "model-a")
    await target.queue_wave(session, _wave("w1-", SLOTS_MIXED))
    for index in range(3):
        target.release(f"hold{index}")
    await target.drain()
    # Two hold a slot each: the wave shares the two left, one of them kept for the interactive band.
    await target.hold(session, "hold-i0", "model-a")
    await target.hold(session, "hold-i1", "model-a")
    await target.queue_wave(session, _wave("w2-", list(reversed(SLOTS_MIXED))))
    target.release("hold-i0")
    await async_wait_for(lambda: sum(target.at_a_fake(f"w2-{i}") for i in range(len(SLOTS_MIXED))) >= 6,
                         what="six of the wave granted")
    target.release("hold-i1")
    await target.drain()
    return 5 + 2 * len(SLOTS_MIXED)


Workload = Callable[[Target, aiohttp.ClientSession], Awaitable[int]]


async def _run_stack(workdir: pathlib.Path, log: pathlib.Path, workload: Workload, config: dict[str, Any],
                     fake: FakeLlamaServer) -> None:
    with running_stack(workdir, merge({"activity": {"path": str(log)}}, config), fake=fake) as stack:
        target = Target(stack.url, stack.sidecar.queue, [fake])
        async with aiohttp.ClientSession() as session:
            count = await workload(target, session)
        await _all_recorded(log, count)


async def _run_node(workdir: pathlib.Path, log: pathlib.Path, workload: Workload, config: dict[str, Any]) -> None:
    """Two router fakes as `upstreams:` gpu0 and gpu1; the configuration is kept beside the log
    (`-c` gives the replay the estimates' defaults, which the log does not record)."""
    fakes = [FakeLlamaServer(router=True).started() for _ in range(2)]
    try:
        upstreams = [{"name": f"gpu{index}", "url": fake.url, "slots": 1} for index, fake in enumerate(fakes)]
        with running_node(workdir, upstreams, merge({"activity": {"path": str(log)}}, config)) as node:
            target = Target(node.url, node.queue, fakes)
            async with aiohttp.ClientSession() as session:
                count = await workload(target, session)
            await _all_recorded(log, count)
        kept = yaml.safe_load((workdir / "llamaswap.yaml").read_text())
        del kept["activity"]  # this run's file
        log.with_suffix(".yaml").write_text(yaml.safe_dump(kept))
    finally:
        for fake in fakes:
            fake.close()


AGING = {"routing": {"scheduler": {"settings": {"serial": {"agingDivisor": 0.5}}}}}
FOUR_MODELS = ("model-a", "model-b", "model-c", "model-d")


async def record(name: str, log: pathlib.Path) -> None:
    log.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory(prefix=f"replay-{name}-") as directory:
        workdir = pathlib.Path(directory)
        if name == "one_gpu":
            await _run_stack(workdir, log, one_gpu, AGING, FakeLlamaServer(router=True))
        elif name == "two_gpus":
            # A load costs nothing until measured (and nothing here measures one): a free GPU
            # takes the best request it may serve now rather than leave it to a busy one.
            await _run_node(workdir, log, two_gpus, merge(AGING, {"estimates": {"defaultSwapSeconds": 0}}))
        elif name == "resident":  # two of four models resident, counted
            await _run_stack(workdir, log, resident, {"upstream": {"maxLoaded": 2}},
                             FakeLlamaServer(router=True, models=FOUR_MODELS, models_max=2))
        elif name == "resident_memory":  # three at most, within a memory budget
            config = {"upstream": {"maxLoaded": 3, "memory": "20GiB"},
                      "models": {"model-a": {"memory": "4GiB"}, "model-b": {"memory": "8GiB"},
                                 "model-c": {"memory": "8GiB"}, "model-d": {"memory": "12GiB"}}}
            await _run_stack(workdir, log, resident, config,
                             FakeLlamaServer(router=True, models=FOUR_MODELS, models_max=3))
        elif name == "resident_pinned":  # three at most, model-a pinned (loaded at start, never evicted)
            config = {"upstream": {"maxLoaded": 3}, "models": {"model-a": {"pinned": True}}}
            await _run_stack(workdir, log, resident, config,
                             FakeLlamaServer(router=True, models=FOUR_MODELS, models_max=3))
        elif name == "slots":
            kept_slot = {"routing": {"scheduler": {"settings": {"serial": {"reservedSlots": 1}}}}}
            config = {"upstream": {"slots": 4}, **kept_slot}
            await _run_stack(workdir, log, slots, config, FakeLlamaServer(slots=4))
        else:
            raise SystemExit(f"unknown workload {name!r}; one of {', '.join(NAMES)}")


NAMES = ("one_gpu", "two_gpus", "resident", "resident_memory", "resident_pinned", "slots")


def main(argv: Sequence[str]) -> int:
    """``[--out DIR] [NAME ...]``: every workload, or those named, into DIR (default: here)."""
    out = HERE
    if argv[:1] == ["--out"]:
        out, argv = pathlib.Path(argv[1]), argv[2:]
    for name in argv or NAMES:
        log = out / f"{name}.jsonl"
        asyncio.run(record(name, log))
        print(f"recorded {log} ({len(_records(log))} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
