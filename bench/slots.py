"""Slots against the real llama-server (`--parallel 4`, the tests' tiny model, CPU).

(a) Aggregate output tokens per second of the same-model requests (16 by default) at
`upstream.slots` 1, 2 and 4, in three ways measured alike, in interleaved rounds (the order
rotates every round): straight to llama-server by N clients that each send one request after
the other ("direct, N at a time"); the same N clients through llamaswap ("llamaswap, N at a
time": the same client code, so the difference is what the path adds); all requests sent at
once through llamaswap, which keeps N running ("llamaswap, all at once": how a scheduler is
used). Every side is warmed alike before its rounds. Twice: with `--tokens` per request
(1024 by default, about a quarter of a second of generation each here) and with
`--short-tokens` (96: ~10 ms, where a fixed per-request cost weighs most).

Every response carries llama-server's own time for its generation (`timings`): printed per
run (median, slowest), so a run where llama-server itself stalled (other llama.cpp processes
on the same cores) shows as such. At 1 slot, the span less every generation's own time, per
request, is what each path spends outside generation (the handoffs: client, Envoy, sidecar,
connection); such stalls do not touch it, and with direct's generation time it gives the
ratio a machine whose generation speed did not drift between runs would measure. Through
llamaswap, the sidecar's and Envoy's CPU per request (/proc/PID/task/*/schedstat): on this
CPU-only machine it comes out of the cores llama-server generates on.

(b) The wait (the sidecar's x-llamaswap-queue-wait-ms) of an interactive request that arrives
while a long same-model batch generation runs, at `slots: 1` and at `slots: 2, reservedSlots: 1`.

Last line: `slots: 4 slots N.NNx the throughput of 1 (llama-server direct M.MMx), interactive
behind batch p50 A ms (1 slot: B ms)` (from the `--tokens` runs, llamaswap all at once).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics
import time
from collections.abc import Awaitable, Callable

import aiohttp

import bench_paths  # noqa: F401 - puts e2e/ on the path
from harness import async_wait_for, get_json, running_stack
from llama import run_llama_server
from procfs import cpu_ns
from stack import workdir
from tinymodels import write_tiny_llama_gguf

PARALLEL = 4
SLOTS = (1, 2, 4)
DIRECT = "direct, N at a time"
SAME_CLIENT = "llamaswap, N at a time"
ALL_AT_ONCE = "llamaswap, all at once"
SIDES = (DIRECT, SAME_CLIENT, ALL_AT_ONCE)
# A generation this many times its run's median is llama-server stalling (another process on its cores).
STALL_FACTOR = 3.0


@dataclasses.dataclass(frozen=True)
class Answer:
    tokens: int  # output tokens
    wait_ms: float  # the sidecar's queue wait (0 straight to llama-server)
    generation_ms: float  # llama-server's own time for it: prompt + generation (`timings`)


@dataclasses.dataclass(frozen=True)
class Run:
    span_s: float
    answers: list[Answer]
    path_cpu_ms: float | None = None  # through llamaswap: the sidecar's and Envoy's CPU per request

    @property
    def rate(self) -> float:
        return sum(answer.tokens for answer in self.answers) / self.span_s

    @property
    def generation_ms(self) -> float:
        return statistics.median(answer.generation_ms for answer in self.answers)

    @property
    def slowest_ms(self) -> float:
        return max(answer.generation_ms for answer in self.answers)

    @property
    def stalled(self) -> bool:
        return self.slowest_ms > STALL_FACTOR * self.generation_ms

    def outside_generation_ms(self) -> float:
        """Per request, the span not spent generating (one at a time: the handoffs). Stalls inside
        llama-server's generations do not count here; waits for it to read a request do."""
        return (self.span_s * 1000 - sum(answer.generation_ms for answer in self.answers)) / len(self.answers)


async def _complete(session: aiohttp.ClientSession, url: str, tokens: int, priority: str | None = None) -> Answer:
    headers = {"x-llamaswap-priority": priority} if priority else {}
    body = {"model": "tiny", "prompt": "hello", "max_tokens": tokens, "ignore_eos": True}
    async with session.post(f"{url}/v1/completions", json=body, headers=headers) as response:
        document = await response.json(content_type=None)
        assert response.status == 200, document
        timings = document["timings"]
        return Answer(int(document["usage"]["completion_tokens"]),
                      float(response.headers.get("x-llamaswap-queue-wait-ms", "0")),
                      float(timings["prompt_ms"]) + float(timings["predicted_ms"]))


async def n_at_a_time(url: str, requests: int, tokens: int, clients: int) -> Run:
    """`clients` clients, each sending its next request when its last one is answered."""
    left = [requests]
    answers: list[Answer] = []
    async with aiohttp.ClientSession() as session:

        async def client() -> None:
            while left[0] > 0:
                left[0] -= 1
                answers.append(await _complete(session, url, tokens))

        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(clients)))
        return Run(time.perf_counter() - started, answers)


async def all_at_once(url: str, requests: int, tokens: int) -> Run:
    async with aiohttp.ClientSession() as session:
        started = time.perf_counter()
        answers = await asyncio.gather(*(_complete(session, url, tokens) for _ in range(requests)))
        return Run(time.perf_counter() - started, list(answers))


async def warm(url: str) -> None:
    """The same for every side before its rounds: connections, caches, the first-call paths."""
    await all_at_once(url, PARALLEL, 8)
    await n_at_a_time(url, 2, 8, 1)


async def interactive_behind_batch(url: str, queue_url: str, batch_tokens: int, rounds: int) -> list[float]:
    """The interactive request's queue wait (ms) while a batch generation runs, per round."""
    waits = []
    async with aiohttp.ClientSession() as session:
        for _ in range(rounds):
            batch = asyncio.create_task(_complete(session, url, batch_tokens, "batch"))
            await async_wait_for(lambda: bool(get_json(queue_url)["running_all"]), what="the batch request running")
            waits.append((await _complete(session, url, 8, "interactive")).wait_ms)
            await batch
    return waits


def _spread(values: list[float], digits: int = 2) -> str:
    """The median with the range over rounds."""
    return f"{statistics.median(values):.{digits}f} [{min(values):.{digits}f}-{max(values):.{digits}f}]"


@dataclasses.dataclass
class Figures:
    """The rounds of one slots setting and one request length."""

    slots: int
    tokens: int
    requests: int
    rounds: list[dict[str, Run]] = dataclasses.field(default_factory=list)

    def runs(self, side: str) -> list[Run]:
        return [round_[side] for round_ in self.rounds]

    def rate(self, side: str) -> float:
        return statistics.median(run.rate for run in self.runs(side))

    def ratios(self, side: str) -> list[float]:
        """llamaswap's throughput over direct's, round by round (adjacent in time)."""
        return [round_[side].rate / round_[DIRECT].rate for round_ in self.rounds]

    def outside_ms(self, side: str) -> list[float]:
        return [run.outside_generation_ms() for run in self.runs(side)]

    def generation_ms(self, side: str) -> float:
        return statistics.median(run.generation_ms for run in self.runs(side))

    def path_cpu_ms(self) -> float:
        """The sidecar's and Envoy's CPU per request through llamaswap, median over its runs."""
        return statistics.median(run.path_cpu_ms for side in (SAME_CLIENT, ALL_AT_ONCE) for run in self.runs(side)
                                 if run.path_cpu_ms is not None)

    def expected_ratio(self, side: str) -> float:
        """llamaswap/direct at direct's generation time, from what each path adds outside it (at
        1 slot: a request's turn is its generation plus that): the ratio a machine whose
        generation speed does not drift between runs would measure."""
        generation = self.generation_ms(DIRECT)
        return ((generation + statistics.median(self.outside_ms(DIRECT)))
                / (generation + statistics.median(self.outside_ms(side))))

    def summary(self) -> str:
        line = (f"{self.slots} slot{'s' if self.slots > 1 else ''}, {self.tokens}-token requests: llamaswap/direct "
                f"{_spread(self.ratios(ALL_AT_ONCE))} all at once, {_spread(self.ratios(SAME_CLIENT))} N at a time "
                f"(direct {self.rate(DIRECT):.0f} tokens/s); llama-server's own generation "
                f"{self.generation_ms(DIRECT):.1f} ms direct, {self.generation_ms(SAME_CLIENT):.1f} and "
                f"{self.generation_ms(ALL_AT_ONCE):.1f} through llamaswap; sidecar and Envoy "
                f"{self.path_cpu_ms():.2f} ms CPU per request")
        if self.slots == 1:
            outside = {side: _spread(self.outside_ms(side), 1) for side in SIDES}
            line += (f"; outside generation per request: direct {outside[DIRECT]}, llamaswap N at a time "
                     f"{outside[SAME_CLIENT]}, all at once {outside[ALL_AT_ONCE]} ms, which at direct's generation "
                     f"time makes {self.expected_ratio(SAME_CLIENT):.2f} and {self.expected_ratio(ALL_AT_ONCE):.2f}")
        return line


async def measure_round(figures: Figures, urls: dict[str, str], path_pids: tuple[int, ...]) -> None:
    """One more round, its order rotated from the last one's so that no side always goes first.
    Through llamaswap, the CPU the data path's processes (`path_pids`) used, per request."""
    runners: dict[str, Callable[[], Awaitable[Run]]] = {
        DIRECT: lambda: n_at_a_time(urls[DIRECT], figures.requests, figures.tokens, figures.slots),
        SAME_CLIENT: lambda: n_at_a_time(urls[SAME_CLIENT], figures.requests, figures.tokens, figures.slots),
        ALL_AT_ONCE: lambda: all_at_once(urls[ALL_AT_ONCE], figures.requests, figures.tokens),
    }
    index = len(figures.rounds)
    round_ = {}
    for side in SIDES[index % len(SIDES):] + SIDES[:index % len(SIDES)]:
        cpu_before = sum(cpu_ns(pid) for pid in path_pids)
        run = await runners[side]()
        if side != DIRECT:
            cpu_ms = (sum(cpu_ns(pid) for pid in path_pids) - cpu_before) / 1e6 / len(run.answers)
            run = dataclasses.replace(run, path_cpu_ms=cpu_ms)
        round_[side] = run
        cpu = f"; sidecar and Envoy {run.path_cpu_ms:.2f} ms CPU per request" if run.path_cpu_ms is not None else ""
        print(f"  slots {figures.slots}, {figures.tokens} tokens, round {index + 1}, {side}: {run.rate:.0f} "
              f"tokens/s in {run.span_s:.2f} s; llama-server {run.generation_ms:.1f} ms per generation "
              f"(slowest {run.slowest_ms:.0f}{', stalled' if run.stalled else ''}){cpu}", flush=True)
    figures.rounds.append(round_)



async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=1024, help="output tokens per request in (a); at most 2040")
    parser.add_argument("--short-tokens", type=int, default=96, help="output tokens per request, short requests in (a)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per slots setting in (a)")
    parser.add_argument("--batch-tokens", type=int, default=1024, help="the batch generation's tokens in (b)")
    parser.add_argument("--interactive-rounds", type=int, default=5, help="interactive requests in (b), per setting")
    parser.add_argument("--quick", action="store_true", help="1 round of 8 requests, 3 interactive requests")
    parser.add_argument("--keep", metavar="DIR", help="keep the logs (llama-server's, the sidecars', Envoy's) in DIR")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.requests, args.interactive_rounds = 1, 8, 3
    lengths = (args.tokens, args.short_tokens)
    with workdir(args.keep, "slots") as root:
        model = write_tiny_llama_gguf(root / "tiny.gguf", seed=5, name="tiny")
        server_args = ["-m", str(model), "--no-repack", "-c", str(2048 * PARALLEL), "--parallel", str(PARALLEL)]
        with run_llama_server(server_args, log_path=root / "llama-server.log") as server:
            direct_url = f"http://127.0.0.1:{server.port}"
            figures = {(slots, tokens): Figures(slots, tokens, args.requests) for slots in SLOTS for tokens in lengths}
            for slots in SLOTS:
                work = root / f"slots-{slots}"
                work.mkdir(exist_ok=True)
                with running_stack(work, {"upstream": {"slots": slots}, "envoy": {"leaseSeconds": 3.0}},
                                   upstream_url=direct_url) as stack:
                    urls = {DIRECT: direct_url, SAME_CLIENT: stack.url, ALL_AT_ONCE: stack.url}
                    await warm(direct_url)
                    await warm(stack.url)
                    for _ in range(args.rounds):
                        for tokens in lengths:
                            await measure_round(figures[slots, tokens], urls,
                                                (stack.sidecar.popen.pid, stack.envoy.popen.pid))
                for tokens in lengths:
                    print(figures[slots, tokens].summary(), flush=True)
            waits: dict[str, list[float]] = {}
            for name, config in (("1 slot", {"upstream": {"slots": 1}}),
                                 ("2 slots, 1 reserved", {"upstream": {"slots": 2}, "routing": {"scheduler": {
                                     "settings": {"serial": {"reservedSlots": 1}}}}})):
                work = root / name.replace(" ", "-").replace(",", "")
                work.mkdir(exist_ok=True)
                with running_stack(work, {**config, "envoy": {"leaseSeconds": 3.0}}, upstream_url=direct_url) as stack:
                    await warm(stack.url)
                    waits[name] = await interactive_behind_batch(stack.url, f"{stack.sidecar.admin_url}/queue",
                                                                 args.batch_tokens, args.interactive_rounds)
                print(f"{name}: interactive behind batch, waits {', '.join(f'{w:.0f}' for w in waits[name])} ms",
                      flush=True)
    runs = [run for figure in figures.values() for side in SIDES for run in figure.runs(side)]
    stalled = sum(run.stalled for run in runs)
    print(f"llama-server stalled (a generation over {STALL_FACTOR:.0f}x its run's median) "
          f"in {stalled} of {len(runs)} runs")
    for tokens in lengths:
        print(f"slots vs direct, {tokens}-token requests, all at once (median [range] of {args.rounds} rounds): " +
              ", ".join(f"{slots} slot{'s' if slots > 1 else ''} {_spread(figures[slots, tokens].ratios(ALL_AT_ONCE))}"
                        for slots in SLOTS) +
              "; at 1 slot outside generation per request llamaswap " +
              _spread(figures[1, tokens].outside_ms(ALL_AT_ONCE), 1) + " ms, direct " +
              _spread(figures[1, tokens].outside_ms(DIRECT), 1) +
              f" ms (at direct's generation time: {figures[1, tokens].expected_ratio(ALL_AT_ONCE):.2f})")
    long = {slots: figures[slots, args.tokens] for slots in SLOTS}
    reserved = statistics.median(waits["2 slots, 1 reserved"])
    single = statistics.median(waits["1 slot"])
    print(f"slots: 4 slots {long[4].rate(ALL_AT_ONCE) / long[1].rate(ALL_AT_ONCE):.2f}x the throughput of 1 "
          f"(llama-server direct {long[4].rate(DIRECT) / long[1].rate(DIRECT):.2f}x), interactive behind batch p50 "
          f"{reserved:.0f} ms (1 slot: {single:.0f} ms)")


if __name__ == "__main__":
    asyncio.run(main())
