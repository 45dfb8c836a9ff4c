"""Slots against the real llama-server (`--parallel 4`, the tests' tiny model, CPU).

(a) Aggregate output tokens per second of the same-model requests (16 by default, sent all at
once) through llamaswap at `upstream.slots` 1, 2 and 4, beside the same requests sent straight
to llama-server (the floor of the same run: what the server itself gives).
(b) The wait (the sidecar's x-llamaswap-queue-wait-ms) of an interactive request that arrives
while a long same-model batch generation runs, at `slots: 1` and at `slots: 2, reservedSlots: 1`.

Last line: `slots: 4 slots N.NNx the throughput of 1 (llama-server direct M.MMx), interactive
behind batch p50 A ms (1 slot: B ms)`.
"""

from __future__ import annotations

import argparse
import asyncio
import pathlib
import statistics
import tempfile
import time

import aiohttp

import bench_paths  # noqa: F401 - puts e2e/ on the path
from harness import async_wait_for, running_stack
from llama import run_llama_server
from tinymodels import write_tiny_llama_gguf

PARALLEL = 4


async def _complete(session: aiohttp.ClientSession, url: str, tokens: int, priority: str | None = None) -> tuple[int, float]:
    """(output tokens, the sidecar's queue wait in ms, 0 straight to llama-server)."""
    headers = {"x-llamaswap-priority": priority} if priority else {}
    body = {"model": "tiny", "prompt": "hello", "max_tokens": tokens, "ignore_eos": True}
    async with session.post(f"{url}/v1/completions", json=body, headers=headers) as response:
        document = await response.json(content_type=None)
        assert response.status == 200, document
        wait_ms = float(response.headers.get("x-llamaswap-queue-wait-ms", "0"))
        return int(document["usage"]["completion_tokens"]), wait_ms


async def throughput(url: str, requests: int, tokens: int) -> float:
    """Output tokens per second of ``requests`` sent at once."""
    async with aiohttp.ClientSession() as session:
        started = time.perf_counter()
        done = await asyncio.gather(*(_complete(session, url, tokens) for _ in range(requests)))
        return sum(count for count, _ in done) / (time.perf_counter() - started)


async def interactive_behind_batch(url: str, queue_url: str, batch_tokens: int, rounds: int) -> list[float]:
    """The interactive request's queue wait (ms) while a batch generation runs, per round."""
    waits = []
    async with aiohttp.ClientSession() as session:
        for _ in range(rounds):
            batch = asyncio.create_task(_complete(session, url, batch_tokens, "batch"))
            await async_wait_for(lambda: _running(queue_url), what="the batch request running")
            _, wait_ms = await _complete(session, url, 8, "interactive")
            waits.append(wait_ms)
            await batch
    return waits


def _running(queue_url: str) -> bool:
    from harness import get_json

    return bool(get_json(queue_url)["running_all"])


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=96, help="output tokens per request in (a)")
    parser.add_argument("--batch-tokens", type=int, default=1024, help="the batch generation's tokens in (b)")
    parser.add_argument("--rounds", type=int, default=5, help="interactive requests in (b), per setting")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="llamaswap-bench-slots-") as tmp:
        root = pathlib.Path(tmp)
        model = write_tiny_llama_gguf(root / "tiny.gguf", seed=5, name="tiny")
        server_args = ["-m", str(model), "--no-repack", "-c", str(2048 * PARALLEL), "--parallel", str(PARALLEL)]
        with run_llama_server(server_args, log_path=root / "llama-server.log") as server:
            direct_url = f"http://127.0.0.1:{server.port}"
            await throughput(direct_url, PARALLEL, 8)  # warm up
            direct = {n: 0.0 for n in (1, PARALLEL)}
            rates: dict[int, float] = {}
            for slots in (1, 2, 4):
                work = root / f"slots-{slots}"
                work.mkdir()
                with running_stack(work, {"upstream": {"slots": slots}, "envoy": {"leaseSeconds": 3.0}},
                                   upstream_url=direct_url) as stack:
                    rates[slots] = await throughput(stack.url, args.requests, args.tokens)
                print(f"slots {slots}: {rates[slots]:.1f} tokens/s through llamaswap", flush=True)
            for at_once in direct:
                started = time.perf_counter()
                tokens = 0
                async with aiohttp.ClientSession() as session:
                    for offset in range(0, args.requests, at_once):
                        batch = await asyncio.gather(*(_complete(session, direct_url, args.tokens)
                                                       for _ in range(min(at_once, args.requests - offset))))
                        tokens += sum(count for count, _ in batch)
                direct[at_once] = tokens / (time.perf_counter() - started)
                print(f"direct, {at_once} at a time: {direct[at_once]:.1f} tokens/s", flush=True)
            waits: dict[str, list[float]] = {}
            for name, config in (("1 slot", {"upstream": {"slots": 1}}),
                                 ("2 slots, 1 reserved", {"upstream": {"slots": 2}, "routing": {"scheduler": {
                                     "settings": {"serial": {"reservedSlots": 1}}}}})):
                work = root / name.replace(" ", "-").replace(",", "")
                work.mkdir()
                with running_stack(work, {**config, "envoy": {"leaseSeconds": 3.0}}, upstream_url=direct_url) as stack:
                    waits[name] = await interactive_behind_batch(stack.url, f"{stack.sidecar.admin_url}/queue",
                                                                 args.batch_tokens, args.rounds)
                print(f"{name}: interactive behind batch, waits {', '.join(f'{w:.0f}' for w in waits[name])} ms",
                      flush=True)
    reserved = statistics.median(waits["2 slots, 1 reserved"])
    single = statistics.median(waits["1 slot"])
    print(f"slots: 4 slots {rates[4] / rates[1]:.2f}x the throughput of 1 (llama-server direct "
          f"{direct[PARALLEL] / direct[1]:.2f}x), interactive behind batch p50 {reserved:.0f} ms (1 slot: {single:.0f} ms)")


if __name__ == "__main__":
    asyncio.run(main())
