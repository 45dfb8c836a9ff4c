"""Several models resident on one GPU (issue 37), against one at a time and against the router alone.

Three real llama-servers in router mode over the same three models (the tests' tiny model, one
file copied under the names model-a, model-b and model-c; `--slots` slots (2) and one thread per
child, `-t 1`, which the router passes on to each model's server), one per side, for the whole
run. The sides, measured alike in interleaved rounds whose order rotates:

- **llamaswap maxLoaded 1**: a stack (sidecar + Envoy) with `upstream.maxLoaded` at its default,
  1, in front of a router started with `--models-max 1`: one model at a time, a load replaces it;
- **llamaswap maxLoaded 3**: a stack with `upstream.maxLoaded: 3` in front of a router started with
  `--models-max 3`: every model may stay resident, llamaswap's rule says what loads and goes;
- **router alone**: the clients straight to a router started with `--models-max 3`, no llamaswap:
  each model's server takes its requests first come, first served, whatever their priority.

Every router runs at nice `--nice` (10), and so do the model servers it starts: on a GPU node
generation runs on the GPU and leaves the CPU to Envoy and the sidecar, while here the model
servers compute on the same 2 cores, and at equal priority they starved Envoy's access log past
the 3 s lease (grants released, exchanges adopted). The router alone's own proxying runs at the
same nice value as every other side's router.

Both stacks: `upstream.slots` = `--slots`, `reservedSlots` = `--reserved` (0), the production
lease, the model poll every 0.5 s (so that they see the unloads between sides). Every router
gets `--threads-http` for every request that can be at it at once: its default on 2 cores
(the slots + 2) would hold the router alone's clients in the kernel's accept queue, not at
each model's server as on a machine of many cores.

The workload, the same for every side of a round (a new seed per round): a batch backlog of
`--batch` requests on model-a and model-c (half each, shuffled, all there at the start, output
lengths log-normal around `--batch-tokens`, sigma `--batch-sigma`, 16 to 4,000 tokens; with
`--batch-inflight K` the batch client keeps at most K at once instead of sending them all), and
`--pairs` interactive pairs arriving every `--spacing-ms` over it, as a RAG client sends them: a
short completion of `--short-tokens` to model-b (the retrieval step), and when it is answered a
chat completion of `--chat-tokens` to model-a. Through llamaswap the batch requests carry
`x-llamaswap-priority: batch`, the pairs `interactive`; the router alone gets the same headers
and ignores them. Every output is exactly its `max_tokens` long (`ignore_eos`).

Before each side every model of its server is unloaded (`POST /models/unload`), so every side
starts cold: its first load of each model counts.

Figures, per side:
- model loads: the router's own log (its `spawning server instance with name=` line per load),
  and of those the loads of a model loaded before in the run (each side starts cold, so its
  first load of each model is alike on every side: the goal is judged on all loads);
- most models resident at once, and unloads: from `GET /models`, polled every 50 ms during the run;
- interactive latency: each interactive request's whole latency, from its send to the last byte
  of its (non-streamed) answer, p50 and p95 over every round's interactive requests (both of each
  pair); and the pair's, from the short request's send to the chat answer. Whole latency, not
  time to first byte: the router alone has no queue wait to report, and a non-streamed answer's
  first byte is its last;
- throughput: the batch backlog's output tokens per second, from the start to its last answer
  (the interactive pairs run inside it); and every request per second over the whole run; and
  llama-server's own generation speed for each batch request (its `timings`), p50: how fast the
  model's server computed, which on a machine of 2 cores falls as more processes compute at once
  (the other models' servers, and Envoy's and the sidecar's work);
- failed requests (an error status or a cut connection), and busy evictions: a model that left
  `loaded` in `GET /models` while a request to it was at the server (sent and not yet answered;
  counted for the router alone, where a request sent is a request at the server: through
  llamaswap a sent request may still be waiting in the sidecar's queue).

Last line: `resident: maxLoaded 3 N loads (maxLoaded 1: M), interactive p95 A ms (maxLoaded 1: B
ms, router alone: C ms), throughput R.RRx the router alone's, busy evictions by the router alone
E`, with the issue's goals printed above it, met or not: this measures, it asserts nothing. A side
that cannot run (`--sides`, or a configuration that does not know `maxLoaded` yet) prints `-`, and
so does a side whose sidecar applies another `maxLoaded` than its name says (each stack's GET
/queue is read at its start): its figures are printed, its goals not judged.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import pathlib
import random
import shutil
import statistics
import time
from collections.abc import Iterator, Sequence
from typing import Any

import aiohttp

import bench_paths  # noqa: F401 - puts e2e/ on the path
from gpus import SPAWN_LINE, batch_tokens, unload_all
from harness import EnvoyProcess, SidecarProcess, write_config
from llama import LlamaServer, router_mode_args, run_llama_server
from llamaswap.config import ConfigError, parse_config
from llamaswap.envoy.bootstrap import build_bootstrap
from stack import workdir
from stats import percentile
from tinymodels import write_tiny_llama_gguf

MODELS = ("model-a", "model-b", "model-c")
CHAT, SHORT, OTHER = MODELS  # the pairs' chat model (also batch), their short model, the other batch model
ML1, ML3, ROUTER = "llamaswap maxLoaded 1", "llamaswap maxLoaded 3", "router alone"
SIDES = (ML1, ML3, ROUTER)
SHORT_NAMES = {ML1: "ml1", ML3: "ml3", ROUTER: "router"}  # --sides, and the files under --keep
MODELS_MAX = {ML1: 1, ML3: 3, ROUTER: 3}
MODELS_POLL_S = 0.5
WATCH_S = 0.05
CONTEXT_PER_SLOT = 4096


@dataclasses.dataclass(frozen=True)
class Job:
    index: int
    model: str
    priority: str  # batch or interactive
    tokens: int
    chat: bool = False
    pair: int | None = None  # which interactive pair


@dataclasses.dataclass(frozen=True)
class Workload:
    batch: list[Job]
    pairs: list[tuple[float, Job, Job]]  # arrival (s from the start), the short request, then the chat

    @property
    def size(self) -> int:
        return len(self.batch) + 2 * len(self.pairs)


def workload(args: argparse.Namespace, seed: int) -> Workload:
    rng = random.Random(seed)
    models = [(CHAT, OTHER)[i % 2] for i in range(args.batch)]
    rng.shuffle(models)
    batch = [Job(i, model, "batch", batch_tokens(rng, args.batch_tokens, args.batch_sigma))
             for i, model in enumerate(models)]
    pairs = []
    for n in range(args.pairs):
        base = args.batch + 2 * n
        pairs.append(((n + 1) * args.spacing_ms / 1000,
                      Job(base, SHORT, "interactive", args.short_tokens, pair=n),
                      Job(base + 1, CHAT, "interactive", args.chat_tokens, chat=True, pair=n)))
    return Workload(batch, pairs)


@dataclasses.dataclass(frozen=True)
class Answer:
    job: Job
    sent: float  # perf_counter
    answered: float
    ok: bool
    error: str = ""
    speed: float | None = None  # llama-server's own generation speed for it (timings.predicted_per_second)

    @property
    def latency_ms(self) -> float:
        return 1000 * (self.answered - self.sent)


class InFlight:
    """The requests sent to each model and not yet answered."""

    def __init__(self) -> None:
        self.count = {model: 0 for model in MODELS}

    @contextlib.contextmanager
    def of(self, model: str) -> Iterator[None]:
        self.count[model] += 1
        try:
            yield
        finally:
            self.count[model] -= 1


async def send(session: aiohttp.ClientSession, url: str, job: Job, in_flight: InFlight) -> Answer:
    headers = {"x-llamaswap-priority": job.priority}
    body: dict[str, Any] = {"model": job.model, "max_tokens": job.tokens, "ignore_eos": True}
    if job.chat:
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": f"question {job.index}: hello"}]
    else:
        path, body["prompt"] = "/v1/completions", f"passage {job.index}: hello world"
    sent = time.perf_counter()
    with in_flight.of(job.model):
        try:
            async with session.post(url + path, json=body, headers=headers) as response:
                document = await response.json(content_type=None)
                tokens = int(document.get("usage", {}).get("completion_tokens", -1)) if response.status == 200 else -1
                if response.status != 200 or tokens != job.tokens:
                    return Answer(job, sent, time.perf_counter(), False, f"{response.status}: {str(document)[:200]}")
                speed = document.get("timings", {}).get("predicted_per_second")
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            return Answer(job, sent, time.perf_counter(), False, f"{type(exc).__name__}: {exc}")
    return Answer(job, sent, time.perf_counter(), True, speed=float(speed) if speed else None)


@dataclasses.dataclass
class Watch:
    """What GET /models said during a run, polled every WATCH_S."""

    most_resident: int = 0
    unloads: int = 0
    busy_evictions: list[str] = dataclasses.field(default_factory=list)  # "model at t s (n at the server)"


async def watch_models(session: aiohttp.ClientSession, url: str, in_flight: InFlight, started: float,
                       stop: asyncio.Event, out: Watch) -> None:
    resident = ("loaded", "loading")
    last: dict[str, str] = {}
    while not stop.is_set():
        try:
            async with session.get(f"{url}/models") as response:
                document = await response.json(content_type=None)
            states = {item["id"]: item["status"]["value"] for item in document["data"]}
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError, TypeError):
            states = {}
        if states:
            out.most_resident = max(out.most_resident, sum(1 for s in states.values() if s in resident))
            for model, state in states.items():
                if last.get(model) == "loaded" and state not in resident:
                    out.unloads += 1
                    if in_flight.count.get(model, 0):
                        out.busy_evictions.append(f"{model} at {time.perf_counter() - started:.1f} s "
                                                  f"({in_flight.count[model]} at the server)")
            last = states
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), WATCH_S)


@dataclasses.dataclass
class Run:
    side: str
    span_s: float  # the start to the last answer
    batch_span_s: float  # the start to the last batch answer
    answers: list[Answer]
    loads: int
    reloads: int  # loads of a model loaded before in the run (every side starts cold: its first loads are alike)
    watch: Watch

    @property
    def failed(self) -> list[Answer]:
        return [a for a in self.answers if not a.ok]

    @property
    def batch_rate(self) -> float:
        """The batch backlog's output tokens per second."""
        return sum(a.job.tokens for a in self.answers if a.job.priority == "batch") / self.batch_span_s

    def speeds(self) -> list[float]:
        """llama-server's own generation speed (tokens/s) of each answered batch request: how
        fast its model's server computed, whatever waited before it (on this machine's shared
        cores it falls as more processes compute at once)."""
        return [a.speed for a in self.answers if a.job.priority == "batch" and a.speed]

    @property
    def request_rate(self) -> float:
        return len(self.answers) / self.span_s

    def interactive(self) -> list[float]:
        """The answered interactive requests' latencies (the failed ones are counted apart)."""
        return [a.latency_ms for a in self.answers if a.job.priority == "interactive" and a.ok]

    def pairs(self) -> list[float]:
        by_pair: dict[int, list[Answer]] = {}
        for a in self.answers:
            if a.job.pair is not None and a.ok:
                by_pair.setdefault(a.job.pair, []).append(a)
        return [1000 * (max(a.answered for a in two) - min(a.sent for a in two))
                for two in by_pair.values() if len(two) == 2]


async def run_side(side: str, work: Workload, server: LlamaServer, url: str, args: argparse.Namespace) -> Run:
    await asyncio.to_thread(unload_all, [server])
    if side != ROUTER:
        await asyncio.sleep(3 * MODELS_POLL_S)  # the sidecar's model poll sees the unloads
    log_before = len(server.log_text())
    in_flight, watch, stop = InFlight(), Watch(), asyncio.Event()
    answers: list[Answer] = []
    batch_gate = asyncio.Semaphore(args.batch_inflight) if args.batch_inflight > 0 else None
    # A connection per request: a pooled connection the server has closed meanwhile would fail a
    # request for the client's sake, not the server's.
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:
        started = time.perf_counter()
        watcher = asyncio.create_task(watch_models(session, server.url, in_flight, started, stop, watch))

        async def batch(job: Job) -> None:
            async with batch_gate if batch_gate is not None else contextlib.nullcontext():
                answers.append(await send(session, url, job, in_flight))

        async def pair(at_s: float, short: Job, chat: Job) -> None:
            await asyncio.sleep(max(0.0, started + at_s - time.perf_counter()))  # its arrival time
            answer = await send(session, url, short, in_flight)
            answers.append(answer)
            answers.append(await send(session, url, chat, in_flight))

        await asyncio.gather(*(batch(job) for job in work.batch), *(pair(*p) for p in work.pairs))
        ended = time.perf_counter()
        stop.set()
        await watcher
    batch_end = max((a.answered for a in answers if a.job.priority == "batch"), default=ended)
    loaded = [line.split(SPAWN_LINE, 1)[1].split()[0] for line in server.log_text()[log_before:].splitlines()
              if SPAWN_LINE in line]
    return Run(side, ended - started, batch_end - started, answers, len(loaded), len(loaded) - len(set(loaded)),
               watch)


def stack_document(url: str, max_loaded: int, args: argparse.Namespace) -> dict[str, Any]:
    upstream: dict[str, Any] = {"url": url, "slots": args.slots, "modelsPollSeconds": MODELS_POLL_S}
    if max_loaded != 1:
        upstream["maxLoaded"] = max_loaded
    document: dict[str, Any] = {
        "listen": {"http": "127.0.0.1:0", "grpc": "127.0.0.1:0", "admin": "127.0.0.1:0"},
        "upstream": upstream,
        "envoy": {"leaseSeconds": 3.0},  # the production lease
    }
    if args.reserved:
        document["routing"] = {"scheduler": {"settings": {"serial": {"reservedSlots": args.reserved}}}}
    return document


@contextlib.contextmanager
def llamaswap_stack(root: pathlib.Path, document: dict[str, Any]) -> Iterator[tuple[str, SidecarProcess]]:
    """The sidecar and Envoy in front of one router; yields Envoy's URL and the sidecar."""
    root.mkdir(parents=True, exist_ok=True)
    sidecar = SidecarProcess(write_config(root, document), root)
    try:
        bootstrap = build_bootstrap(parse_config(document), grpc_port=sidecar.grpc_port,
                                    admin_port=sidecar.admin_port, envoy_admin_port=0)
        envoy = EnvoyProcess(bootstrap, root)
        try:
            yield envoy.url, sidecar
        finally:
            envoy.stop()
    finally:
        sidecar.stop()


def renice_threads(pid: int, nice: int) -> None:
    """Every thread of a process at ``nice`` (Linux keeps a nice value per thread): the threads it
    starts later and the model servers they start inherit it."""
    for task in pathlib.Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(ProcessLookupError):
            os.setpriority(os.PRIO_PROCESS, int(task.name), nice)


def applied_max_loaded(sidecar: SidecarProcess) -> int:
    """The maxLoaded the sidecar applies to its GPU, as GET /queue says (1 where it does not say)."""
    gpus = sidecar.queue().get("gpus") or [{}]
    return int(gpus[0].get("max_loaded", 1))


def _ms(values: Sequence[float], q: float) -> str:
    return f"{percentile(values, q):.0f}" if values else "-"


def _goal(met: bool | None) -> str:
    return "not measured" if met is None else ("met" if met else "NOT met")


def report(runs: dict[str, list[Run]], skipped: dict[str, str], mismatched: dict[str, str] | None = None) -> None:
    """Each side's figures, then the issue's goals; a side in ``mismatched`` ran, but under another
    maxLoaded than its name says: its figures are printed and its goals are not judged."""
    mismatched = mismatched or {}
    p95: dict[str, float | None] = {}
    loads: dict[str, float | None] = {}
    reloads: dict[str, float | None] = {}
    rate: dict[str, float | None] = {}
    for side in SIDES:
        if side in skipped or not runs[side]:
            print(f"{side}: not run ({skipped.get(side, 'no round')})")
            p95[side] = loads[side] = reloads[side] = rate[side] = None
            continue
        done = runs[side]
        interactive = [ms for run in done for ms in run.interactive()]
        pairs = [ms for run in done for ms in run.pairs()]
        p95[side] = percentile(interactive, 95)
        loads[side] = statistics.median(run.loads for run in done)
        reloads[side] = statistics.median(run.reloads for run in done)
        rate[side] = statistics.median(run.batch_rate for run in done)
        busy = [event for run in done for event in run.watch.busy_evictions]
        print(f"{side}: model loads {'/'.join(str(run.loads) for run in done)} (median {loads[side]:.0f}; "
              f"of a model loaded before in the run {'/'.join(str(run.reloads) for run in done)}); "
              f"interactive latency p50 {_ms(interactive, 50)} ms, p95 {_ms(interactive, 95)} ms "
              f"(pairs p50 {_ms(pairs, 50)} ms, p95 {_ms(pairs, 95)} ms); batch throughput {rate[side]:.0f} tokens/s "
              f"({'/'.join(f'{run.batch_rate:.0f}' for run in done)}), "
              f"{statistics.median(run.request_rate for run in done):.2f} requests/s over the run; "
              f"llama-server's own generation p50 {_ms([v for run in done for v in run.speeds()], 50)} tokens/s "
              f"a batch request; "
              f"most resident at once {max(run.watch.most_resident for run in done)}, unloads "
              f"{'/'.join(str(run.watch.unloads) for run in done)}; failed "
              f"{sum(len(run.failed) for run in done)}", flush=True)
        if side in mismatched:
            print(f"  not judged below: {mismatched[side]}")
        if side == ROUTER:
            print(f"  busy models evicted by the router: {len(busy)}" + (f" ({'; '.join(busy[:5])})" if busy else ""))
        for run in done:
            for answer in run.failed[:3]:
                print(f"  failed: {answer.job.model} {answer.job.priority}: {answer.error}")

    def ratio(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None or b == 0 else a / b

    def check(value: float | None, limit: float, *, at_least: bool = False) -> bool | None:
        return None if value is None else (value >= limit if at_least else value <= limit)

    def shown(value: float | None, fmt: str = ".2f") -> str:
        return "-" if value is None else format(value, fmt)

    for side in mismatched:  # figures of another rule than the side's name: no goal judged on them
        p95[side] = loads[side] = reloads[side] = rate[side] = None
    loads_ratio, p95_ratio = ratio(loads[ML3], loads[ML1]), ratio(p95[ML3], p95[ML1])
    rate_ratio, router_ratio = ratio(rate[ML3], rate[ROUTER]), ratio(p95[ML3], p95[ROUTER])
    print(f"goal: maxLoaded 3 loads <= 1/5 of maxLoaded 1's: {shown(loads[ML3], '.0f')} against "
          f"{shown(loads[ML1], '.0f')} ({shown(loads_ratio)}; loads of a model loaded before in the run "
          f"{shown(reloads[ML3], '.0f')} against {shown(reloads[ML1], '.0f')}), {_goal(check(loads_ratio, 0.2))}")
    print(f"goal: maxLoaded 3 interactive p95 <= 1/3 of maxLoaded 1's: {shown(p95[ML3], '.0f')} ms against "
          f"{shown(p95[ML1], '.0f')} ms ({shown(p95_ratio)}), {_goal(check(p95_ratio, 1 / 3))}")
    print(f"goal: maxLoaded 3 throughput >= 0.9x the router alone's: {shown(rate[ML3], '.0f')} against "
          f"{shown(rate[ROUTER], '.0f')} tokens/s ({shown(rate_ratio)}x), "
          f"{_goal(check(rate_ratio, 0.9, at_least=True))}")
    print(f"goal: maxLoaded 3 interactive p95 <= half the router alone's: {shown(p95[ML3], '.0f')} ms against "
          f"{shown(p95[ROUTER], '.0f')} ms ({shown(router_ratio)}), {_goal(check(router_ratio, 0.5))}")
    busy = "-" if ROUTER in skipped or not runs[ROUTER] else str(
        sum(len(run.watch.busy_evictions) for run in runs[ROUTER]))
    print(f"resident: maxLoaded 3 {shown(loads[ML3], '.0f')} loads (maxLoaded 1: {shown(loads[ML1], '.0f')}), "
          f"interactive p95 {shown(p95[ML3], '.0f')} ms (maxLoaded 1: {shown(p95[ML1], '.0f')} ms, router alone: "
          f"{shown(p95[ROUTER], '.0f')} ms), throughput {shown(rate_ratio)}x the router alone's, "
          f"busy evictions by the router alone {busy}")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (each side once per round)")
    parser.add_argument("--batch", type=int, default=64, help="batch requests in the backlog (model-a and model-c)")
    parser.add_argument("--batch-tokens", type=int, default=1024, help="median output tokens of a batch request")
    parser.add_argument("--batch-sigma", type=float, default=0.8,
                        help="spread of batch output lengths (log-normal sigma; 0: all --batch-tokens long)")
    parser.add_argument("--batch-inflight", type=int, default=0,
                        help="batch requests the batch client keeps at once (0: the whole backlog at the start)")
    parser.add_argument("--pairs", type=int, default=16, help="interactive pairs (model-b, then model-a)")
    parser.add_argument("--spacing-ms", type=float, default=500.0, help="between two pairs' arrivals")
    parser.add_argument("--short-tokens", type=int, default=8, help="output tokens of a pair's model-b request")
    parser.add_argument("--chat-tokens", type=int, default=128, help="output tokens of a pair's model-a chat request")
    parser.add_argument("--slots", type=int, default=2, help="slots of each model's server (-np), and the stacks'")
    parser.add_argument("--reserved", type=int, default=0, help="the stacks' reservedSlots")
    parser.add_argument("--nice", type=int, default=10,
                        help="the routers' (and their model servers') nice value, every side's alike (0: none)")
    parser.add_argument("--sides", default=",".join(("ml1", "ml3", "router")),
                        help="which sides to run, of ml1, ml3 and router (comma-separated)")
    parser.add_argument("--seed", type=int, default=37)
    parser.add_argument("--quick", action="store_true",
                        help="1 round of 24 batch requests of 512 tokens, 4 pairs 250 ms apart")
    parser.add_argument("--keep", metavar="DIR", help="keep the logs (llama-servers', sidecars', Envoys') in DIR")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.batch, args.pairs, args.batch_tokens, args.spacing_ms = 1, 24, 4, 512, 250.0
    names = {short: side for side, short in SHORT_NAMES.items()}
    wanted = [name.strip() for name in args.sides.split(",") if name.strip()]
    unknown = [name for name in wanted if name not in names]
    if unknown:
        parser.error(f"--sides: unknown {', '.join(unknown)} (choose from ml1, ml3, router)")
    args.sides = [names[name] for name in wanted]
    return args


async def main() -> None:
    args = parse_args()
    skipped = {side: "not asked for (--sides)" for side in SIDES if side not in args.sides}
    with workdir(args.keep, "resident") as root:
        models = root / "models"
        first = write_tiny_llama_gguf(models / f"{MODELS[0]}.gguf", seed=37, name="tiny", context=CONTEXT_PER_SLOT)
        for name in MODELS[1:]:
            shutil.copyfile(first, models / f"{name}.gguf")
        with contextlib.ExitStack() as exits:
            servers: dict[str, LlamaServer] = {}
            urls: dict[str, str] = {}
            mismatched: dict[str, str] = {}  # sides whose sidecar does not apply their maxLoaded
            for side in SIDES:
                if side in skipped:
                    continue
                document = stack_document("http://127.0.0.1:1", MODELS_MAX[side], args) if side != ROUTER else None
                if document is not None:
                    try:
                        parse_config(document)
                    except ConfigError as exc:
                        skipped[side] = f"the configuration refuses it: {str(exc).splitlines()[0]}"
                        continue
                # --threads-http: a thread for every request that can be at the router at once. Its
                # default here (the slots + 2, on 2 cores) would queue the router alone's clients
                # in the kernel's accept queue rather than at each model's server, as on a machine
                # with many cores.
                server_args = [*router_mode_args(models, models_max=MODELS_MAX[side]), "-np", str(args.slots),
                               "-c", str(CONTEXT_PER_SLOT * args.slots), "-t", "1",
                               "--threads-http", str(args.batch + 2 * args.pairs + 8)]
                name = SHORT_NAMES[side]
                server = exits.enter_context(run_llama_server(server_args, log_path=root / f"llama-{name}.log"))
                if args.nice:
                    renice_threads(server.process.pid, args.nice)
                servers[side] = server
                if side == ROUTER:
                    urls[side] = server.url
                    continue
                urls[side], sidecar = exits.enter_context(
                    llamaswap_stack(root / f"stack-{name}", stack_document(server.url, MODELS_MAX[side], args)))
                applied = applied_max_loaded(sidecar)
                if applied != MODELS_MAX[side]:
                    # The key is read, but the scheduler does not apply it: the side would measure
                    # one model at a time in front of a router that keeps several.
                    print(f"{side}: the sidecar applies maxLoaded {applied} (GET /queue), not "
                          f"{MODELS_MAX[side]}: its figures are not the rule's", flush=True)
                    mismatched[side] = f"the sidecar applied maxLoaded {applied} (GET /queue)"
            # Every server warmed alike: each model loaded and run once; then each side starts cold.
            async with aiohttp.ClientSession() as session:
                for side, server in servers.items():
                    for model in MODELS:
                        answer = await send(session, server.url, Job(-1, model, "batch", 8), InFlight())
                        assert answer.ok, answer.error
                    if urls[side] != server.url:
                        answer = await send(session, urls[side], Job(-1, CHAT, "batch", 8), InFlight())
                        assert answer.ok, answer.error
            runs: dict[str, list[Run]] = {side: [] for side in SIDES}
            order = [side for side in SIDES if side in servers]
            for index in range(args.rounds):
                work = workload(args, args.seed + index)
                shift = index % max(1, len(order))
                for side in order[shift:] + order[:shift]:
                    run = await run_side(side, work, servers[side], urls[side], args)
                    assert len(run.answers) == work.size, "a request lost"
                    runs[side].append(run)
                    interactive = run.interactive()
                    print(f"  round {index + 1}, {side}: {run.loads} model loads ({run.reloads} again), "
                          f"interactive p95 {_ms(interactive, 95)} ms (max {_ms(interactive, 100)}), "
                          f"batch {run.batch_rate:.0f} tokens/s in {run.batch_span_s:.1f} s, "
                          f"run {run.span_s:.1f} s, most resident {run.watch.most_resident}, failed {len(run.failed)}"
                          + (f", busy evictions {len(run.watch.busy_evictions)}" if side == ROUTER else ""),
                          flush=True)
    report(runs, skipped, mismatched)


if __name__ == "__main__":
    asyncio.run(main())
