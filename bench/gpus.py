"""One queue over two GPUs (issue 27) against what a user runs instead, on two real llama-servers.

Two llama-servers in router mode (the tests' tiny models, four of them, written with a 4,096-token
context; `--models-max 1`, `--slots` slots, default 1 as llamaswap's own default, and one thread
each: two "GPUs" on this machine's two cores) serve the same mixed workload three ways, measured
alike, in interleaved rounds (the order rotates every round):

- **direct**: the two servers straight, each client pinned to one. The models are placed by
  hand (tiny-a and tiny-c on the first server, tiny-b and tiny-d on the second, as llama-swap
  users place them), and each server's client keeps up to `--slots` requests at it, all of one
  model: while any runs, the oldest pending of that model; with none running, the same model as
  its last if one is pending, else the oldest. No scheduler, no sidecar, no Envoy: the throughput
  ceiling.
- **round-robin stacks**: two independent llamaswap stacks (sidecar + Envoy, one upstream each,
  `slots` as the server's), the client alternating between them request by request: what
  `replicas: 2` behind a Service gives today.
- **llamaswap upstreams**: one stack with `upstreams:` of both servers: one queue.

The workload: a batch backlog (`--batch` requests, the four models in equal shares, shuffled),
all there at the start, and `--interactive` requests of `--interactive-tokens` (models drawn at
random) arriving every `--spacing-ms` over it. A batch request's output length is drawn from a
log-normal around `--batch-tokens` (`--batch-sigma` 0.8, a coefficient of variation of about 0.9:
LLM outputs are long-tailed; 0 makes them all the same length), at most 4,000 tokens. Through
llamaswap each request carries `x-llamaswap-priority: batch` or `interactive`.

Figures, per side:
- throughput: requests / span (the first arrival to the last answer);
- wait (to the grant): through llamaswap the sidecar's `x-llamaswap-queue-wait-ms`; direct, the
  time a request spent in its client's queue before it was sent. The interactive p95 is over
  every round's interactive requests;
- swaps: model loads, counted from the servers' own logs (the router's `spawning server
  instance` line), the first load on each server included: every side starts with no model
  loaded (each loaded one is unloaded through the server's own `POST /models/unload`);
- interactive, the first of its GPUs to free: the time until the first of the servers a request
  could run on (its stack's; through the one queue, either; direct, its pinned one) was done
  with what ran there when it arrived, the least a scheduler that never aborts a generation
  could give it; and its wait beyond that, what its scheduler added (the handoff, its model's
  load, others ahead);
- GPU idle while work waited, exactly: a request was at a server from the first byte sent to it
  to the last byte received from it (through llamaswap, Envoy's access log points US_TX_BEG and
  US_RX_END, written to a file beside the gRPC one; direct, the pinned client's send and answer);
  a model load is inside the request it is for. A request waited from its send to its grant
  (the sidecar's queue wait), direct from its arrival to its client sending it. Of the time while
  any request waited, summed over both GPUs, the share in which a GPU had no request at it. The
  handoff between two requests counts: each costs a one-slot GPU about 3-5 ms here (the access
  log's entry to the sidecar, the grant back to Envoy, the request to the server).

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
import math
import pathlib
import random
import statistics
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
from stack import workdir
from stats import percentile
from tinymodels import write_tiny_llama_gguf

MODELS = ("tiny-a", "tiny-b", "tiny-c", "tiny-d")
DIRECT, ROUND_ROBIN, ONE_QUEUE = "direct", "round-robin stacks", "llamaswap upstreams"
SIDES = (DIRECT, ROUND_ROBIN, ONE_QUEUE)
SPAWN_LINE = "spawning server instance with name="  # the router's log line for each model load
# The sidecars learn what each server has loaded from its GET /models while idle (default 5 s):
# shorter here so that they see the unloads between sides.
MODELS_POLL_S = 0.5
CONTEXT_PER_SLOT = 4096
MIN_TOKENS, MAX_TOKENS = 16, 4000  # within a slot's context, beside the prompt's few tokens


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
    servers: tuple[int, ...]  # the servers it could have run on (its pinned one, its stack's, or both)

    def waited_at(self, at: float) -> bool:
        return self.waited_from <= at < self.waited_from + self.wait_ms / 1000


def batch_tokens(rng: random.Random, median: int, sigma: float) -> int:
    """A batch request's output length: log-normal around ``median`` (LLM outputs are long-tailed;
    sigma 0.8 is a coefficient of variation of about 0.9), within what the context holds; sigma
    0: every one ``median`` long."""
    if sigma == 0:
        return median
    return max(MIN_TOKENS, min(MAX_TOKENS, round(rng.lognormvariate(math.log(median), sigma))))


def workload(args: argparse.Namespace, seed: int) -> list[Job]:
    """The batch backlog (equal shares of the models, shuffled), then interactive arrivals over it."""
    rng = random.Random(seed)
    models = [MODELS[i % len(MODELS)] for i in range(args.batch)]
    rng.shuffle(models)
    jobs = [Job(i, model, "batch", 0.0, batch_tokens(rng, args.batch_tokens, args.batch_sigma))
            for i, model in enumerate(models)]
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


Interval = tuple[float, float]  # wall clock, from and to


def union(intervals: Sequence[Interval]) -> list[Interval]:
    """The same time as sorted, non-overlapping intervals."""
    merged: list[Interval] = []
    for begin, end in sorted(intervals):
        if merged and begin <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((begin, end))
    return merged


def measure(intervals: Sequence[Interval]) -> float:
    return sum(end - begin for begin, end in union(intervals))


def overlap(first: Sequence[Interval], second: Sequence[Interval]) -> float:
    """The time two sets of intervals share."""
    a, b = union(first), union(second)
    i = j = 0
    shared = 0.0
    while i < len(a) and j < len(b):
        shared += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return shared


@dataclasses.dataclass
class Run:
    """One side's run of the workload."""

    span_s: float
    done: list[Done]
    loads: int
    at_server: list[list[Interval]]  # per server: when a request was at it (computing, or loading for it)

    @property
    def rate(self) -> float:
        return len(self.done) / self.span_s

    def waits(self, priority: str) -> list[float]:
        return [done.wait_ms for done in self.done if done.job.priority == priority]

    def first_free(self, priority: str) -> list[tuple[float, float]]:
        """Per request: the time until the first of the servers it could run on was done with
        what ran there at its arrival (ms), the least any scheduler that does not abort a
        generation could give it, and its wait beyond that (what its scheduler added: the
        handoff, its model's load, requests ahead of it). With several slots "done" is drained:
        the bound for a request that needs its model loaded there, not for one that shares it."""
        out = []
        for done in self.done:
            if done.job.priority != priority:
                continue
            at = done.waited_from
            free_in = min(max((end - at for start, end in self.at_server[i] if start <= at < end), default=0.0)
                          for i in done.servers)
            out.append((1000 * free_in, done.wait_ms - 1000 * free_in))
        return out

    def idle_while_waited(self) -> tuple[float, float]:
        """(GPU-seconds with no request at the GPU while some request waited, GPU-seconds while some
        request waited), both GPUs summed."""
        waited = union([(done.waited_from, done.waited_from + done.wait_ms / 1000) for done in self.done])
        total = measure(waited) * len(self.at_server)
        return total - sum(overlap(waited, at) for at in self.at_server), total


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
    """Direct: one client per server, the models placed by hand; each client keeps up to `slots`
    requests at its server, all of one model (the server holds one): while any runs, the oldest
    pending of that model; with none running, the same model as its last if one is pending, else
    the oldest."""

    def __init__(self, servers: Sequence[str], slots: int) -> None:
        self.servers = list(servers)
        self.slots = slots
        self.pending: list[list[tuple[float, Job]]] = [[] for _ in servers]
        self.running: list[list[str]] = [[] for _ in servers]  # the models of the requests at each server
        self.last: list[str | None] = [None for _ in servers]
        self.at_server: list[list[Interval]] = [[] for _ in servers]
        self.done: list[Done] = []
        self._wake = [asyncio.Event() for _ in servers]

    def server_of(self, job: Job) -> int:
        return MODELS.index(job.model) % len(self.servers)

    async def arrive(self, job: Job) -> None:
        index = self.server_of(job)
        self.pending[index].append((time.time(), job))
        self._wake[index].set()

    def _take(self, index: int) -> tuple[float, Job] | None:
        queue = self.pending[index]
        if self.running[index]:
            model = self.running[index][0]
            chosen = next((item for item in queue if item[1].model == model), None)
        else:
            chosen = next((item for item in queue if item[1].model == self.last[index]), queue[0] if queue else None)
        if chosen is not None:
            queue.remove(chosen)
        return chosen

    async def client(self, index: int, total: int, session: aiohttp.ClientSession) -> None:
        """One of the server's `slots` senders."""
        while len(self.done) < total:
            chosen = self._take(index)
            if chosen is None:
                self._wake[index].clear()
                await self._wake[index].wait()
                continue
            arrived, job = chosen
            sent = time.time()
            self.running[index].append(job.model)
            self.last[index] = job.model
            try:
                await _post(session, self.servers[index], job, priority=False)
            finally:
                self.running[index].remove(job.model)
                self._wake[index].set()  # a sender held back for another model may go now
            self.at_server[index].append((sent, time.time()))
            self.done.append(Done(job, arrived, (sent - arrived) * 1000, (index,)))
            if len(self.done) >= total:
                for wake in self._wake:  # the other senders end now too: the span ends at this answer
                    wake.set()


@dataclasses.dataclass
class Stack:
    sidecar: SidecarProcess
    envoy: EnvoyProcess
    upstream_times: pathlib.Path  # Envoy's file access log of `_UPSTREAM_TIMES_FORMAT`

    @property
    def url(self) -> str:
        return self.envoy.url

    def exchanges(self) -> list[dict[str, Any]]:
        """Every ended exchange Envoy sent to an upstream so far (its file is flushed every 100 ms)."""
        if not self.upstream_times.exists():
            return []
        lines = self.upstream_times.read_text().splitlines()
        entries = [json.loads(line) for line in lines if line.strip()]
        return [entry for entry in entries if entry["kind"] == "DownstreamEnd"
                and entry["cluster"].startswith("upstream-") and entry["to_upstream_us"] != "-"]


@contextlib.contextmanager
def llamaswap_stack(workdir: pathlib.Path, servers: dict[str, str], slots: int) -> Iterator[Stack]:
    """The sidecar and Envoy in front of `servers` (name -> url): one upstream, or `upstreams:`."""
    workdir.mkdir(parents=True, exist_ok=True)
    document: dict[str, Any] = {
        "listen": {"http": "127.0.0.1:0", "grpc": "127.0.0.1:0", "admin": "127.0.0.1:0"},
        "upstream": {"modelsPollSeconds": MODELS_POLL_S},
        "envoy": {"leaseSeconds": 3.0},  # the production lease
    }
    if len(servers) == 1:
        document["upstream"].update(url=next(iter(servers.values())), slots=slots)
    else:
        document["upstreams"] = [{"name": name, "url": url, "slots": slots} for name, url in servers.items()]
    sidecar = SidecarProcess(write_config(workdir, document), workdir)
    try:
        bootstrap = build_bootstrap(parse_config(document), grpc_port=sidecar.grpc_port,
                                    admin_port=sidecar.admin_port, envoy_admin_port=0)
        log_upstream_times(bootstrap, workdir / UPSTREAM_TIMES)
        envoy = EnvoyProcess(bootstrap, workdir, extra_args=["--file-flush-interval-msec", "100"])
        try:
            yield Stack(sidecar, envoy, workdir / UPSTREAM_TIMES)
        finally:
            envoy.stop()
    finally:
        sidecar.stop()


UPSTREAM_TIMES = "upstream-times.jsonl"
# When each exchange was at its upstream, on Envoy's own clock: from the first byte sent to it
# to the last byte received from it (the access log's points US_TX_BEG and US_RX_END).
_UPSTREAM_TIMES_FORMAT = {
    "start_s": "%START_TIME(%s.%6f)%", "kind": "%ACCESS_LOG_TYPE%", "cluster": "%UPSTREAM_CLUSTER%",
    "request_id": "%REQ(X-REQUEST-ID)%",
    "to_upstream_us": "%COMMON_DURATION(DS_RX_BEG:US_TX_BEG:us)%",
    "from_upstream_us": "%COMMON_DURATION(DS_RX_BEG:US_RX_END:us)%",
}


def log_upstream_times(bootstrap: dict[str, Any], path: pathlib.Path) -> None:
    """Add a file access log of `_UPSTREAM_TIMES_FORMAT` to the listener's HTTP connection manager."""
    for listener in bootstrap["static_resources"]["listeners"]:
        for chain in listener["filter_chains"]:
            for network_filter in chain["filters"]:
                config = network_filter.get("typed_config", {})
                if config.get("@type", "").endswith("HttpConnectionManager"):
                    config.setdefault("access_log", []).append({
                        "name": "envoy.access_loggers.file",
                        "typed_config": {
                            "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
                            "path": str(path),
                            "log_format": {"json_format": _UPSTREAM_TIMES_FORMAT}}})


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


def at_upstream(exchanges: Sequence[dict[str, Any]], cluster: str, since: float) -> list[Interval]:
    """When the exchanges Envoy sent to `cluster` since then were at it."""
    intervals = []
    for entry in exchanges:
        start = float(entry["start_s"])
        if entry["cluster"] == cluster and start >= since:
            intervals.append((start + int(entry["to_upstream_us"]) / 1e6, start + int(entry["from_upstream_us"]) / 1e6))
    return intervals


async def run_side(side: str, jobs: list[Job], servers: Sequence[LlamaServer], stacks: dict[str, list[Stack]],
                   slots: int) -> Run:
    await asyncio.to_thread(unload_all, servers)
    urls = [server.url for server in servers]
    loads_before = loads_in_logs(servers)
    connector = aiohttp.TCPConnector(limit=0)
    since = time.time()
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:
        if side == DIRECT:
            pinned = PinnedClients(urls, slots)
            started = time.perf_counter()
            clients = [asyncio.create_task(pinned.client(i, len(jobs), session))
                       for i in range(len(urls)) for _ in range(slots)]
            await arrivals(jobs, pinned.arrive)
            await asyncio.gather(*clients)
            span = time.perf_counter() - started
            done, at_server = pinned.done, pinned.at_server
        else:
            targets = stacks[side]
            done = []
            order = sorted(jobs, key=lambda job: (job.at_s, job.index))
            job_order = {job.index: position for position, job in enumerate(order)}

            async def send(job: Job) -> None:
                # Round-robin: the arrival order alternates between the stacks (one stack: always it).
                at = job_order[job.index] % len(targets)
                sent = time.time()
                wait_ms = await _post(session, targets[at].url, job, priority=True)
                done.append(Done(job, sent, wait_ms, (at,) if len(targets) > 1 else tuple(range(len(urls)))))

            started = time.perf_counter()
            await arrivals(jobs, send)
            span = time.perf_counter() - started
            # A stack of its own per server (its one upstream is gpu0), or one stack with both.
            where = ([(stack, "upstream-gpu0") for stack in targets] if len(targets) > 1
                     else [(targets[0], f"upstream-gpu{i}") for i in range(len(urls))])
            sent_to = [sum(1 for job in jobs if len(targets) == 1 or job_order[job.index] % len(targets) == i)
                       for i in range(len(where))]

            def logged() -> list[list[Interval]] | None:
                at = [at_upstream(stack.exchanges(), cluster, since) for stack, cluster in where]
                if len(targets) > 1:
                    return at if [len(x) for x in at] == sent_to else None
                return at if sum(len(x) for x in at) == len(jobs) else None

            at_server = await asyncio.to_thread(wait_for, logged, what="every exchange in Envoy's access log file")
    # The loads of this side are in the logs once their children started (each answered a request).
    return Run(span, done, loads_in_logs(servers) - loads_before, at_server)


def _goal(met: bool) -> str:
    return "met" if met else "NOT met"


def report(runs: dict[str, list[Run]]) -> None:
    rounds = len(runs[DIRECT])
    ratios = {side: [runs[side][i].rate / runs[DIRECT][i].rate for i in range(rounds)] for side in SIDES}
    p95 = {side: percentile([w for run in runs[side] for w in run.waits("interactive")], 95) for side in SIDES}
    swaps = {side: statistics.median(run.loads for run in runs[side]) for side in SIDES}
    def idle_share(side: str) -> float:
        counts = [run.idle_while_waited() for run in runs[side]]
        return 100 * sum(c[0] for c in counts) / max(1e-9, sum(c[1] for c in counts))

    idle = {side: idle_share(side) for side in SIDES}
    for side in SIDES:
        batch = [w for run in runs[side] for w in run.waits("batch")]
        print(f"{side}: {statistics.median(run.rate for run in runs[side]):.2f} requests/s "
              f"({'/'.join(f'{run.rate:.2f}' for run in runs[side])}), {statistics.median(ratios[side]):.2f}x direct "
              f"(rounds {', '.join(f'{r:.2f}' for r in ratios[side])}); wait to the grant: interactive p50 "
              f"{percentile([w for run in runs[side] for w in run.waits('interactive')], 50):.0f} ms, p95 "
              f"{p95[side]:.0f} ms, batch p50 {percentile(batch, 50):.0f} ms; model loads "
              f"{'/'.join(str(run.loads) for run in runs[side])}; GPU idle while work waited {idle[side]:.1f}% "
              f"of {sum(run.idle_while_waited()[1] for run in runs[side]):.1f} GPU-s", flush=True)
        free = [pair for run in runs[side] for pair in run.first_free("interactive")]
        print(f"  interactive: the first of its GPUs free of what ran at its arrival after p50 "
              f"{percentile([f for f, _ in free], 50):.0f} ms, p95 {percentile([f for f, _ in free], 95):.0f} ms; "
              f"its wait beyond that p50 {percentile([b for _, b in free], 50):.0f} ms, "
              f"p95 {percentile([b for _, b in free], 95):.0f} ms", flush=True)
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



async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (each side once per round)")
    parser.add_argument("--batch", type=int, default=48, help="batch requests in the backlog")
    parser.add_argument("--batch-tokens", type=int, default=1024,
                        help="median output tokens of a batch request (<= 4000)")
    parser.add_argument("--batch-sigma", type=float, default=0.8,
                        help="spread of batch output lengths (log-normal sigma; 0: all --batch-tokens long)")
    parser.add_argument("--interactive", type=int, default=24, help="interactive requests arriving over the backlog")
    parser.add_argument("--interactive-tokens", type=int, default=128)
    parser.add_argument("--spacing-ms", type=float, default=500.0, help="between two interactive arrivals")
    parser.add_argument("--slots", type=int, default=1, help="slots of each server (-np), used alike by every side")
    parser.add_argument("--seed", type=int, default=27)
    parser.add_argument("--quick", action="store_true", help="1 round of 12 batch and 6 interactive requests")
    parser.add_argument("--keep", metavar="DIR", help="keep the logs (llama-servers', sidecars', Envoys') in DIR")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.batch, args.interactive, args.batch_tokens = 1, 12, 6, 256
    with workdir(args.keep, "gpus") as root:
        models = root / "models"
        for seed, name in enumerate(MODELS):
            write_tiny_llama_gguf(models / f"{name}.gguf", seed=40 + seed, name=name, context=CONTEXT_PER_SLOT)
        server_args = [*router_mode_args(models), "-np", str(args.slots), "-c", str(CONTEXT_PER_SLOT * args.slots),
                       "-t", "1"]
        with contextlib.ExitStack() as exits:
            servers = [exits.enter_context(run_llama_server(server_args, log_path=root / f"llama-gpu{i}.log"))
                       for i in range(2)]
            names = {f"gpu{i}": server.url for i, server in enumerate(servers)}
            stacks = {
                ROUND_ROBIN: [exits.enter_context(llamaswap_stack(root / f"replica-{name}", {name: url}, args.slots))
                              for name, url in names.items()],
                ONE_QUEUE: [exits.enter_context(llamaswap_stack(root / "upstreams", names, args.slots))],
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
                    run = await run_side(side, jobs, servers, stacks, args.slots)
                    assert sorted(d.job.index for d in run.done) == [job.index for job in jobs], "a request lost"
                    runs[side].append(run)
                    if args.keep:  # every wait and every interval at a server, for a closer reading
                        with open(root / f"run-{index + 1}-{side.split()[0]}.json", "w") as dump:
                            json.dump({"at_server": run.at_server,
                                       "done": [{"model": d.job.model, "priority": d.job.priority,
                                                 "tokens": d.job.tokens, "waited_from": d.waited_from,
                                                 "wait_ms": d.wait_ms, "servers": d.servers} for d in run.done]}, dump)
                    interactive = run.waits("interactive")
                    print(f"  round {index + 1}, {side}: {run.rate:.2f} requests/s in {run.span_s:.2f} s, "
                          f"interactive wait p95 {percentile(interactive, 95):.0f} ms (max {max(interactive):.0f}), "
                          f"{run.loads} model loads, idle while waited {run.idle_while_waited()[0]:.2f} of "
                          f"{run.idle_while_waited()[1]:.1f} GPU-s", flush=True)
    report(runs)


if __name__ == "__main__":
    asyncio.run(main())
