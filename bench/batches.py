"""The OpenAI Batch API (issue 38) against a client sending the same lines, through the real
llama-server (the tests' tiny model, CPU).

One llama-server (`--parallel SLOTS`) and one llamaswap stack (real Envoy and sidecar,
`upstream.slots: SLOTS`, `batches:` on, `batches.inFlight` the node's slots unless `--in-flight`)
serve `--lines` completions of `--tokens` output tokens each (`ignore_eos`: every line the same
length), three ways, measured alike in interleaved rounds (the order of the two llamaswap sides
rotates every round):

- **floor**: the same lines straight to llama-server by SLOTS clients that each send the next
  when answered; no Envoy, no sidecar, no interactive traffic: what the server itself does;
- **client**: the same lines through Envoy by SLOTS such clients with `X-LlamaSwap-Priority:
  batch` (what a user without the Batch API runs), while interactive requests arrive;
- **batch API**: the lines uploaded as one file (`POST /v1/files`), one batch created
  (`POST /v1/batches`) and polled (`GET /v1/batches/{id}`, every `--poll-ms`) until it is
  completed, while the same interactive requests arrive; its output file is read back and
  checked (every line once, each answered 200).

The interactive traffic, on both llamaswap sides: one request of `--interactive-tokens` with
`X-LlamaSwap-Priority: interactive` every 1/`--interactive-rate` seconds, each sent on its own
(open loop), from the side's start until its last line is answered.

Figures, per side (a line per side and round, then a table of the medians over rounds):
- the time the lines took: the client's first send to its last answer; the batch's
  `POST /v1/batches` to the poll that sees it completed (validation and the output file's
  writing included; the poll adds up to `--poll-ms`); the upload is timed on its own;
- batch throughput: lines / that time, and its ratio to the client's in the same round;
- interactive wait p50 / p95: the sidecar's `x-llamaswap-queue-wait-ms`, pooled over rounds and
  round by round;
- the most lines of the batch in the queue at once (waiting + running, by request id: the
  batch's lines carry `BATCH_ID:CUSTOM_ID`, the client's `client-R:CUSTOM_ID`), from the admin
  `GET /queue` every `--sample-ms`, and exactly from the sidecar's activity log (each line from
  its arrival to its end), against `batches.inFlight`; the mean share of the slots busy over
  those samples, and those GETs' latency (p99, slowest: the sidecar's event loop answers them,
  so a loop held up by other work shows there);
- from the activity log: the lines' share of the slots (their time from grant to end over the
  time x the slots), the handoff (median time from the latest end of a line to the next line's
  arrival at the sidecar: what the sender takes to send the next one, during which a slot
  waits when at most SLOTS lines are out) and the slowest line (a grant to end far above the
  others is llama-server stalled by other processes on the cores: read that round with care);
- llama-server's own time per line (`timings` in each answer; the output file's for the batch);
- the sidecar's and Envoy's CPU per line over the side (/proc/PID/task/*/schedstat; the
  interactive requests and the polls included): on this CPU-only machine it comes out of the
  cores llama-server generates on.

Issue 47's figures (bench/batch_limits.py): the sidecar's peak memory above idle, the Checks of
1-token interactive requests while the batch validates and finalizes against the same requests
with no batch, and the refusal of a `--big-line-mb` one-line file. `--history N` runs N one-line
batches to their end before the rounds; `--upstream fake` puts a do-nothing upstream in place of
llama-server (the sidecar's own costs); `--cprofile FILE` runs the sidecar under cProfile. The
defaults (1,000 lines of 8 tokens, 5 rounds) take about a minute on the 2-core VM when quiet.

Last line: `batches: N lines, batch API X lines/s = R.RRx the client's (Y lines/s), interactive
p95 A ms (client B ms), most lines in the queue M (inFlight I)`, with the issue's goals printed
above it as measured figures: this measures, it asserts nothing but that every line was answered.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import pathlib
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import aiohttp

import bench_paths  # noqa: F401 - puts e2e/ on the path
from batch_activity import activity, handoffs, most_at_once
from batch_limits import MemorySampler, Probe, RoundLimits, refuse_big_line, vm_bytes
from batch_limits import report as report_limits
from fake_upstream import UpstreamProcess
from harness import free_port, running_stack
from llama import run_llama_server
from procfs import cpu_ns, machine_load
from profile_serve import argv_for
from stack import sidecar_command, workdir
from stats import percentile
from tinymodels import write_tiny_llama_gguf

FLOOR, CLIENT, BATCH_API = "floor (direct, no interactive)", "client", "batch API"
ENDPOINT = "/v1/completions"
MODEL = "tiny"
ENDED = ("completed", "failed", "expired", "cancelled")
# Issue 47's probe of the Checks: an interactive request granted at once that computes a token.
PROBE_BODY = {"model": MODEL, "prompt": "probe", "max_tokens": 1}


def generation_ms(document: dict[str, Any]) -> float | None:
    """llama-server's own time for a completion (its `timings`: prompt and generation); None from
    the do-nothing upstream (`--upstream fake`), which neither times nor counts tokens."""
    if "timings" not in document:
        return None
    return float(document["timings"]["prompt_ms"]) + float(document["timings"]["predicted_ms"])


def _median(values: list[float | None]) -> float | None:
    known = [value for value in values if value is not None]
    return statistics.median(known) if known else None


def line_body(n: int, tokens: int) -> dict[str, Any]:
    return {"model": MODEL, "prompt": f"question {n}: hello world", "max_tokens": tokens, "ignore_eos": True}


def input_file(lines: int, tokens: int) -> bytes:
    return b"".join(json.dumps({"custom_id": f"line-{n}", "method": "POST", "url": ENDPOINT,
                                "body": line_body(n, tokens)}).encode() + b"\n" for n in range(lines))


@dataclasses.dataclass
class Side:
    """One side's run in one round."""

    name: str
    lines: int
    span_s: float
    upload_s: float | None = None
    waits_ms: list[float] = dataclasses.field(default_factory=list)  # the interactive requests' queue waits
    most_in_queue: int | None = None
    slots_busy: float | None = None  # mean share of the slots busy over the queue samples
    samples: int = 0
    sidecar_cpu_ms: float | None = None  # per line
    envoy_cpu_ms: float | None = None  # per line
    handoff_ms: float | None = None  # median: a line's arrival at the sidecar after the latest end of one
    occupancy: float | None = None  # the lines' time granted (grant to end) / (the span x the slots)
    most_at_once: int | None = None  # the most lines between arrival and end at once, by the activity log
    over: tuple[float, int] = (0.0, 0)  # by the activity log: ms with more lines than batches.inFlight, times
    run_ms: tuple[float, float] | None = None  # the lines' grant to end: median, slowest
    generation_ms: float | None = None  # median: llama-server's own time for a line (`timings`)
    queue_get_ms: tuple[float, float] | None = None  # GET /queue's latency: p99, slowest
    limits: RoundLimits | None = None  # the batch API's: Checks by phase, the sidecar's memory (issue 47)

    @property
    def rate(self) -> float:
        return self.lines / self.span_s

    def describe(self) -> str:
        line = (f"{self.name}: {self.lines} lines in {self.span_s:.2f} s, {self.rate:.1f} lines/s; llama-server "
                f"{_cell(self.generation_ms, '.2f')} ms a line")
        if self.run_ms is None:
            return line
        return (line + f"; interactive {len(self.waits_ms)}, wait p50 {_ms(self.waits_ms, 50)} ms, p95 "
                f"{_ms(self.waits_ms, 95)} ms; most lines in the queue {self.most_in_queue} (GET /queue), "
                f"{self.most_at_once} (activity log; above inFlight {self.over[0]:.1f} ms, {self.over[1]} times); "
                f"slots busy {_pct(self.slots_busy)} (GET /queue), the lines' "
                f"share {_pct(self.occupancy)}; handoff p50 {_cell(self.handoff_ms, '.2f')} ms; a line's grant to "
                f"end p50 {self.run_ms[0]:.1f} ms, slowest {self.run_ms[1]:.0f} ms; GET /queue p99 "
                f"{self.queue_get_ms[0] if self.queue_get_ms else 0:.1f} ms, slowest "
                f"{self.queue_get_ms[1] if self.queue_get_ms else 0:.0f} ms; sidecar "
                f"{_cell(self.sidecar_cpu_ms, '.2f')} ms and Envoy {_cell(self.envoy_cpu_ms, '.2f')} ms CPU per line")


def _ms(values: list[float], q: float) -> str:
    # One decimal: the sidecar's x-llamaswap-queue-wait-ms has 0.1 ms, and the two sides' p95
    # differ by about that much.
    return f"{percentile(values, q):.1f}" if values else "-"


def _cell(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.0f} %"


class QueueSampler:
    """GET /queue every `interval_s`: the most rows whose request id starts with `prefix` (waiting
    or running) and the share of the slots busy."""

    def __init__(self, session: aiohttp.ClientSession, admin_url: str, interval_s: float) -> None:
        self.session, self.url, self.interval_s = session, f"{admin_url}/queue", interval_s
        self.prefix: str | None = None
        self.most = 0
        self.busy: list[float] = []
        self.latencies_ms: list[float] = []  # each GET /queue's: the sidecar's event loop answers it

    async def run(self) -> None:
        while True:
            started = time.perf_counter()
            async with self.session.get(self.url) as response:
                queue = await response.json()
            self.latencies_ms.append((time.perf_counter() - started) * 1000)
            if self.prefix is not None:
                rows = queue["running_all"] + queue["waiting"]
                self.most = max(self.most, sum(row["request_id"].startswith(self.prefix) for row in rows))
            self.busy.append(queue["slots_busy"] / max(1, queue["slots_total"]))
            await asyncio.sleep(max(0.0, self.interval_s - (time.perf_counter() - started)))


class Interactive:
    """One interactive request every 1/rate s, each on its own, until stopped."""

    def __init__(self, session: aiohttp.ClientSession, url: str, rate: float, tokens: int) -> None:
        self.session, self.url, self.rate, self.tokens = session, url, rate, tokens
        self.waits_ms: list[float] = []
        self._sent: list[asyncio.Task[None]] = []

    async def _one(self, n: int) -> None:
        body = {"model": MODEL, "prompt": f"interactive {n}: hello", "max_tokens": self.tokens, "ignore_eos": True}
        async with self.session.post(f"{self.url}{ENDPOINT}", json=body,
                                     headers={"x-llamaswap-priority": "interactive"}) as response:
            document = await response.json(content_type=None)
            assert response.status == 200, document
            self.waits_ms.append(float(response.headers["x-llamaswap-queue-wait-ms"]))

    async def run(self) -> None:
        if self.rate <= 0:
            return
        started = time.perf_counter()
        n = 0
        while True:
            n += 1
            await asyncio.sleep(max(0.0, started + n / self.rate - time.perf_counter()))
            self._sent.append(asyncio.create_task(self._one(n)))

    async def drain(self) -> None:
        await asyncio.gather(*self._sent)


async def clients(session: aiohttp.ClientSession, url: str, lines: int, tokens: int, concurrency: int,
                  headers: dict[str, str], request_id: str | None = None) -> tuple[float, list[float]]:
    """`concurrency` clients, each sending its next line when its last is answered; the span (s)
    and llama-server's time for each line (ms)."""
    left = list(range(lines - 1, -1, -1))
    generations: list[float | None] = []

    async def client() -> None:
        while left:
            n = left.pop()
            extra = {"x-request-id": f"{request_id}:line-{n}"} if request_id else {}
            async with session.post(f"{url}{ENDPOINT}", json=line_body(n, tokens),
                                    headers={**headers, **extra}) as response:
                document = await response.json(content_type=None)
                assert response.status == 200, document
                assert "usage" not in document or int(document["usage"]["completion_tokens"]) == tokens, document
                generations.append(generation_ms(document))

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return time.perf_counter() - started, generations


async def upload(session: aiohttp.ClientSession, url: str, data: bytes) -> str:
    form = aiohttp.FormData()
    form.add_field("purpose", "batch")
    form.add_field("file", data, filename="input.jsonl", content_type="application/jsonl")
    async with session.post(f"{url}/v1/files", data=form) as response:
        document = await response.json(content_type=None)
        assert response.status == 200, document
        return str(document["id"])


async def create_batch(session: aiohttp.ClientSession, url: str, file_id: str,
                       endpoint: str = ENDPOINT) -> dict[str, Any]:
    async with session.post(f"{url}/v1/batches", json={"input_file_id": file_id, "endpoint": endpoint,
                                                       "completion_window": "24h"}) as response:
        document = await response.json(content_type=None)
        assert response.status == 200, document
        return dict(document)


async def get_batch(session: aiohttp.ClientSession, url: str, batch_id: str) -> dict[str, Any]:
    async with session.get(f"{url}/v1/batches/{batch_id}") as response:
        document = await response.json(content_type=None)
        assert response.status == 200, document
        return dict(document)


async def check_output(session: aiohttp.ClientSession, url: str, batch: dict[str, Any], lines: int,
                       tokens: int) -> list[float]:
    """Every line once in the output file, each answered 200 with its tokens; no error file.
    llama-server's time for each line (ms)."""
    assert batch["status"] == "completed", batch
    assert batch["error_file_id"] is None, batch
    async with session.get(f"{url}/v1/files/{batch['output_file_id']}/content") as response:
        assert response.status == 200, await response.text()
        records = [json.loads(line) for line in (await response.text()).splitlines()]
    assert sorted(record["custom_id"] for record in records) == sorted(f"line-{n}" for n in range(lines))
    for record in records:
        assert record["response"]["status_code"] == 200, record
        body = record["response"]["body"]
        assert "usage" not in body or int(body["usage"]["completion_tokens"]) == tokens, record
    return [generation_ms(record["response"]["body"]) for record in records]


async def run_batch_api(session: aiohttp.ClientSession, url: str, data: bytes, lines: int, tokens: int,
                        poll_s: float, sampler: QueueSampler | None = None,
                        created: Callable[[str], None] | None = None) -> tuple[float, float, str, list[float]]:
    """Upload, create, poll until it ends; (upload s, create to completed s, batch id, llama-server's
    time for each line in ms). `created` is told the batch's id as it is created."""
    started = time.perf_counter()
    file_id = await upload(session, url, data)
    uploaded = time.perf_counter()
    batch = await create_batch(session, url, file_id)
    if created is not None:
        created(str(batch["id"]))
    if sampler is not None:
        sampler.prefix = f"{batch['id']}:"
    while batch["status"] not in ENDED:
        await asyncio.sleep(poll_s)
        batch = await get_batch(session, url, batch["id"])
    span = time.perf_counter() - uploaded
    generations = await check_output(session, url, batch, lines, tokens)
    return uploaded - started, span, str(batch["id"]), generations


@dataclasses.dataclass
class Setup:
    args: argparse.Namespace
    data: bytes
    direct_url: str
    stack_url: str
    admin_url: str
    path_pids: tuple[int, int]  # the sidecar's, Envoy's
    sidecar_log: pathlib.Path
    in_flight: int  # batches.inFlight in effect


async def run_side(setup: Setup, name: str, round_: int) -> Side:
    args = setup.args
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        if name == FLOOR:
            span, generations = await clients(session, setup.direct_url, args.lines, args.tokens, args.slots, {})
            return Side(name, args.lines, span, generation_ms=_median(generations))
        sampler = QueueSampler(session, setup.admin_url, args.sample_ms / 1000)
        interactive = Interactive(session, setup.stack_url, args.interactive_rate, args.interactive_tokens)
        probe = memory = None
        watching: list[asyncio.Task[None]] = []
        background = []
        if name == BATCH_API:
            # Issue 47: the probes' floor (no batch) first, then the sidecar's idle memory.
            probe = Probe(session, setup.stack_url, args.probe_ms / 1000, PROBE_BODY, ENDPOINT)
            memory = MemorySampler(setup.path_pids[0], args.memory_ms / 1000, lambda: probe.phase if probe else None)
            background.append(asyncio.create_task(probe.run()))
            await probe.no_batch(args.probe_floor_s)
            await probe.drain()
            idle_rss = memory.sample()
            probe.phase = "upload"
            background.append(asyncio.create_task(memory.run()))
        background += [asyncio.create_task(sampler.run()), asyncio.create_task(interactive.run())]
        cpu_before = [cpu_ns(pid) for pid in setup.path_pids]
        log_offset = setup.sidecar_log.stat().st_size
        upload_s = None
        try:
            if name == CLIENT:
                prefix = f"client-{round_}"
                sampler.prefix = f"{prefix}:"
                span, generations = await clients(session, setup.stack_url, args.lines, args.tokens, args.slots,
                                                  {"x-llamaswap-priority": "batch"}, request_id=prefix)
            else:
                assert probe is not None
                follow = probe.watch
                upload_s, span, prefix, generations = await run_batch_api(
                    session, setup.stack_url, setup.data, args.lines, args.tokens, args.poll_ms / 1000, sampler,
                    created=lambda batch_id: watching.append(asyncio.create_task(follow(batch_id))))
                await asyncio.gather(*watching)
        finally:
            for task in background + watching:
                task.cancel()
            await asyncio.gather(*background, *watching, return_exceptions=True)
        await interactive.drain()
        limits = None
        if probe is not None and memory is not None:
            await probe.drain()
            limits = RoundLimits(probe.latencies_ms, probe.straddled, idle_rss, memory.peaks,
                                 vm_bytes(setup.path_pids[0], "VmHWM"), memory.samples)
        sidecar_ms, envoy_ms = ((cpu_ns(pid) - before) / 1e6 / args.lines
                                for pid, before in zip(setup.path_pids, cpu_before))
        await asyncio.sleep(0.5)  # the last activity lines reach the log
        records = activity(setup.sidecar_log, log_offset, f"{prefix}:")
        assert len(records) >= args.lines, (name, len(records))
        handoff, granted_ms = handoffs(records)
        runs = [record["run_ms"] for record in records]
        most, over_ms, over_times = most_at_once(records, setup.in_flight)
        return Side(name, args.lines, span, upload_s, interactive.waits_ms, sampler.most,
                    statistics.fmean(sampler.busy) if sampler.busy else None, len(sampler.busy),
                    sidecar_ms, envoy_ms, handoff, granted_ms / 1000 / (span * args.slots), most,
                    (over_ms, over_times), (statistics.median(runs), max(runs)), _median(generations),
                    (percentile(sampler.latencies_ms, 99), max(sampler.latencies_ms)) if sampler.latencies_ms else None,
                    limits)


async def warm(setup: Setup) -> None:
    """The same for every side before the rounds: connections, caches, the first-call paths,
    and one small batch through the feeder; then `--history` ended batches in the store."""
    args = setup.args
    async with aiohttp.ClientSession() as session:
        await clients(session, setup.direct_url, 8, args.tokens, args.slots, {})
        await clients(session, setup.stack_url, 8, args.tokens, args.slots, {"x-llamaswap-priority": "batch"})
        await run_batch_api(session, setup.stack_url, input_file(8, args.tokens), 8, args.tokens,
                            args.poll_ms / 1000)
        if args.history:
            await history(session, setup.stack_url, args.history, args.tokens)


async def history(session: aiohttp.ClientSession, url: str, count: int, tokens: int) -> None:
    """`count` batches of one line each, run to their end: a store that has served batches before."""
    started = time.perf_counter()
    file_id = await upload(session, url, input_file(1, tokens))
    ids = [(await create_batch(session, url, file_id))["id"] for _ in range(count)]
    for batch_id in ids:
        while (await get_batch(session, url, batch_id))["status"] not in ENDED:
            await asyncio.sleep(0.05)
    print(f"  {count} one-line batches ran before the rounds ({time.perf_counter() - started:.1f} s)", flush=True)


def report(rounds: list[dict[str, Side]], args: argparse.Namespace, in_flight: int, load: tuple[str, str],
           whole_s: float) -> None:
    names = (FLOOR, CLIENT, BATCH_API)
    print()
    print(f"{args.lines} lines of {args.tokens} tokens, {args.slots} slots, batches.inFlight {in_flight}, "
          f"{args.history + 1 + len(rounds)} batches in the store at the end, "
          f"interactive {args.interactive_rate:g}/s of {args.interactive_tokens} tokens, {len(rounds)} round(s); "
          f"load average {load[0]} at the start, {load[1]} at the end")
    print("| side (medians over rounds; waits pooled) | time | lines/s | x floor | interactive | wait p50 | "
          "wait p95 | most lines in the queue | slots busy | the lines' share | handoff | slowest line | "
          "llama-server per line | sidecar CPU/line | Envoy CPU/line |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    floor_rate = statistics.median(round_[FLOOR].rate for round_ in rounds)

    def median(sides: list[Side], figure: Callable[[Side], float | None]) -> float | None:
        values = [value for side in sides if (value := figure(side)) is not None]
        return statistics.median(values) if values else None

    for name in names:
        sides = [round_[name] for round_ in rounds]
        waits = [w for side in sides for w in side.waits_ms]
        rate = statistics.median(side.rate for side in sides)
        most = max((side.most_in_queue for side in sides if side.most_in_queue is not None), default=None)
        slowest = max((side.run_ms[1] for side in sides if side.run_ms is not None), default=None)
        print(f"| {name} | {median(sides, lambda side: side.span_s):.1f} s | {rate:.1f} | {rate / floor_rate:.2f} | "
              f"{len(waits) or '-'} | {_ms(waits, 50)} ms | {_ms(waits, 95)} ms | {_cell(most, 'd')} | "
              f"{_pct(median(sides, lambda side: side.slots_busy))} | "
              f"{_pct(median(sides, lambda side: side.occupancy))} | "
              f"{_cell(median(sides, lambda side: side.handoff_ms), '.2f')} ms | {_cell(slowest, '.0f')} ms | "
              f"{_cell(median(sides, lambda side: side.generation_ms), '.2f')} ms | "
              f"{_cell(median(sides, lambda side: side.sidecar_cpu_ms), '.2f')} ms | "
              f"{_cell(median(sides, lambda side: side.envoy_cpu_ms), '.2f')} ms |")
    uploads = [upload_s for round_ in rounds if (upload_s := round_[BATCH_API].upload_s) is not None]
    print(f"upload of the {len(input_file(args.lines, args.tokens)):,}-byte file: "
          f"{statistics.median(uploads) * 1000:.0f} ms (median), not in the batch's time")
    quiet = [round_ for round_ in rounds if all((side.run_ms or (0, 0))[1] < args.stall_ms for side in round_.values())]
    print(f"goals (measured, never asserted); every round, then the {len(quiet)} quiet one(s) (no line over "
          f"{args.stall_ms:g} ms from grant to end on either side: llama-server not stalled by other processes):")
    for label, chosen in (("every round", rounds), ("quiet rounds", quiet)):
        if not chosen:
            print(f"  {label}: none")
            continue
        ratios = [round_[BATCH_API].rate / round_[CLIENT].rate for round_ in chosen]
        batch_waits = [w for round_ in chosen for w in round_[BATCH_API].waits_ms]
        client_waits = [w for round_ in chosen for w in round_[CLIENT].waits_ms]
        p95s = [(percentile(round_[BATCH_API].waits_ms, 95), percentile(round_[CLIENT].waits_ms, 95))
                for round_ in chosen if round_[BATCH_API].waits_ms and round_[CLIENT].waits_ms]
        print(f"  {label}: batch throughput >= 0.9x the client's: {statistics.median(ratios):.2f}x (rounds: "
              f"{', '.join(f'{r:.2f}' for r in ratios)})")
        print(f"  {label}: interactive p95 wait <= the client's: {_ms(batch_waits, 95)} ms against "
              f"{_ms(client_waits, 95)} ms (p50 {_ms(batch_waits, 50)} against {_ms(client_waits, 50)} ms; "
              f"{len(batch_waits)} and {len(client_waits)} requests); round by round "
              f"{', '.join(f'{b:.1f}/{c:.1f}' for b, c in p95s)} ms, no higher in {sum(b <= c for b, c in p95s)} "
              f"of {len(p95s)}")
    most = max(round_[BATCH_API].most_in_queue or 0 for round_ in rounds)
    exact = max(round_[BATCH_API].most_at_once or 0 for round_ in rounds)
    over_ms = sum(round_[BATCH_API].over[0] for round_ in rounds)
    over_times = sum(round_[BATCH_API].over[1] for round_ in rounds)
    batch_s = sum(round_[BATCH_API].span_s for round_ in rounds)
    print(f"  lines of the batch in the queue never above batches.inFlight: most {most} at once, inFlight "
          f"{in_flight} (GET /queue every {args.sample_ms:g} ms); by the activity log (each line from its arrival to "
          f"its exchange's end as the access log reported it) {exact}, above inFlight {over_times} times for "
          f"{over_ms:.1f} ms in all ({over_ms / 10 / batch_s:.3f} % of the batches' time)")
    print(f"(the whole run, the model and the warm-up included: {whole_s:.0f} s)")
    batch_rate = statistics.median(round_[BATCH_API].rate for round_ in rounds)
    client_rate = statistics.median(round_[CLIENT].rate for round_ in rounds)
    ratios = [round_[BATCH_API].rate / round_[CLIENT].rate for round_ in rounds]
    batch_waits = [w for round_ in rounds for w in round_[BATCH_API].waits_ms]
    client_waits = [w for round_ in rounds for w in round_[CLIENT].waits_ms]
    print(f"batches: {args.lines} lines, batch API {batch_rate:.1f} lines/s = {statistics.median(ratios):.2f}x the "
          f"client's ({client_rate:.1f} lines/s), interactive p95 {_ms(batch_waits, 95)} ms (client "
          f"{_ms(client_waits, 95)} ms), most lines in the queue {most} (inFlight {in_flight})")


@contextlib.contextmanager
def upstream(args: argparse.Namespace, root: pathlib.Path) -> Iterator[str]:
    """The real llama-server (the tests' tiny model, --parallel SLOTS), or with `--upstream fake`
    the do-nothing one in a process of its own (the sidecar's own costs, e.g. at 50,000 lines on a
    machine whose cores others share); its URL."""
    if args.upstream == "fake":
        fake = UpstreamProcess(root)
        try:
            yield fake.url
        finally:
            fake.close()
        return
    model = write_tiny_llama_gguf(root / "tiny.gguf", seed=5, name=MODEL)
    server_args = ["-m", str(model), "--alias", MODEL, "--no-repack", "-c", str(2048 * args.slots),
                   "--parallel", str(args.slots)]
    with run_llama_server(server_args, log_path=root / "llama-server.log") as server:
        yield f"http://127.0.0.1:{server.port}"


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=1000, help="lines of the batch (and of the client's run)")
    parser.add_argument("--tokens", type=int, default=8, help="output tokens per line")
    parser.add_argument("--slots", type=int, default=2, help="llama-server --parallel and upstream.slots; the "
                        "client's and the floor's concurrency")
    parser.add_argument("--in-flight", type=int, default=None,
                        help="batches.inFlight (default: unset, the node's slots)")
    parser.add_argument("--interactive-rate", type=float, default=10.0, help="interactive requests per second")
    parser.add_argument("--interactive-tokens", type=int, default=8, help="output tokens per interactive request")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (each: floor, client, batch API)")
    parser.add_argument("--history", type=int, default=0, metavar="N",
                        help="N one-line batches run to their end before the rounds (a store with a past)")
    parser.add_argument("--stall-ms", type=float, default=100,
                        help="a round with a line this long from grant to end is not quiet (llama-server stalled)")
    parser.add_argument("--sample-ms", type=float, default=50, help="GET /queue every this often")
    parser.add_argument("--poll-ms", type=float, default=100, help="GET /v1/batches/{id} every this often")
    parser.add_argument("--quick", action="store_true", help="1 round of 40 lines")
    parser.add_argument("--upstream", choices=("llama", "fake"), default="llama",
                        help="the real llama-server (default) or a do-nothing upstream (bench/fake_upstream.py)")
    parser.add_argument("--probe-ms", type=float, default=10, help="issue 47: a 1-token interactive request every "
                        "this often while the batch validates or finalizes (0: none)")
    parser.add_argument("--probe-floor-s", type=float, default=2.0,
                        help="issue 47: the same requests with no batch for this long before each batch's upload")
    parser.add_argument("--memory-ms", type=float, default=10, help="issue 47: the sidecar's VmRSS every this often")
    parser.add_argument("--big-line-mb", type=int, default=100,
                        help="issue 47: a one-line file of this many MB after the rounds (0: none)")
    parser.add_argument("--cprofile", metavar="FILE", help="run the sidecar under cProfile (bench/profile_serve.py; "
                        "`python bench/profile_serve.py --report FILE --per _send` reads it per batch line)")
    parser.add_argument("--keep", metavar="DIR", help="keep the logs (llama-server's, the sidecar's, Envoy's) in DIR")
    args = parser.parse_args()
    if args.quick:
        args.lines, args.rounds = 40, 1
    in_flight = args.in_flight or args.slots
    load_start = machine_load()
    started = time.perf_counter()
    with workdir(args.keep, "batches") as root:
        with upstream(args, root) as direct_url:
            batches: dict[str, Any] = {"dir": str(root / "batches")}
            if args.in_flight is not None:
                batches["inFlight"] = args.in_flight
            config = {"listen": {"http": f"127.0.0.1:{free_port()}"}, "upstream": {"slots": args.slots},
                      "envoy": {"leaseSeconds": 3.0}, "batches": batches}
            stack_dir = root / "stack"
            stack_dir.mkdir(exist_ok=True)
            with sidecar_command(argv_for(args.cprofile)), running_stack(stack_dir, config,
                                                                          upstream_url=direct_url) as stack:
                setup = Setup(args, input_file(args.lines, args.tokens), direct_url, stack.url,
                              stack.sidecar.admin_url, (stack.sidecar.popen.pid, stack.envoy.popen.pid),
                              stack.sidecar.log_path, in_flight)
                await warm(setup)
                rounds: list[dict[str, Side]] = []
                for index in range(args.rounds):
                    order = (FLOOR, CLIENT, BATCH_API) if index % 2 == 0 else (FLOOR, BATCH_API, CLIENT)
                    round_: dict[str, Side] = {}
                    for name in order:
                        round_[name] = await run_side(setup, name, index + 1)
                        print(f"  round {index + 1}, {round_[name].describe()}", flush=True)
                        if round_[name].limits is not None:
                            print(f"    {round_[name].limits.describe()}", flush=True)  # type: ignore[union-attr]
                    rounds.append(round_)
                big = None
                if args.big_line_mb:
                    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
                        big = await refuse_big_line(session, stack.url, stack.sidecar.popen.pid, args.big_line_mb,
                                                    MODEL, ENDPOINT, PROBE_BODY)
    # The limits first: the summary stays the last line (the bench smoke test reads its shape).
    report_limits([limits for round_ in rounds if (limits := round_[BATCH_API].limits) is not None], big)
    report(rounds, args, in_flight, (load_start, machine_load()), time.perf_counter() - started)


if __name__ == "__main__":
    asyncio.run(main())
