"""The benchmarks' clients: an aiohttp session and a chat request, and `wrk`, a load generator
that costs the 2 cores little."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
from typing import Any

import aiohttp

from llamaswap.core.priority import HEADER as PRIORITY_HEADER


def session(limit: int = 0) -> aiohttp.ClientSession:
    """An aiohttp session with no connection cap and no client-side timeout."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=limit, force_close=False),
                                 timeout=aiohttp.ClientTimeout(total=None, sock_connect=60))


def chat_body(model: str = "model-a", pad_bytes: int = 0) -> bytes:
    document = {"model": model, "messages": [{"role": "system", "content": "You are terse."},
                                              {"role": "user", "content": "hi" + "x" * pad_bytes}],
                "max_tokens": 16, "stream": False}
    return json.dumps(document).encode()


async def post(client: aiohttp.ClientSession, url: str, body: bytes,
               headers: dict[str, str]) -> tuple[int, dict[str, str]]:
    async with client.post(f"{url}/v1/chat/completions", data=body, headers=headers) as response:
        await response.read()
        return response.status, dict(response.headers)


# -- wrk: a load generator that costs the 2 cores little -------------------------------------------

_WRK_SCRIPT = """
local f = assert(io.open(os.getenv("BENCH_BODY_FILE"), "rb"))
wrk.method = "POST"
wrk.body = f:read("*all")
f:close()
wrk.headers["Content-Type"] = "application/json"
wrk.headers["%s"] = "interactive"
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    "WRK {\\"requests\\":%d,\\"duration_us\\":%d,\\"p50\\":%d,\\"p90\\":%d,\\"p99\\":%d,\\"max\\":%d," ..
    "\\"mean\\":%f,\\"errors\\":%d,\\"non2xx\\":%d}\\n",
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(90),
    latency:percentile(99), latency.max, latency.mean,
    e.connect + e.read + e.write + e.timeout, e.status))
end
""".replace("%s", PRIORITY_HEADER, 1)


def wrk_available() -> bool:
    import shutil

    return shutil.which("wrk") is not None


def run_wrk(url: str, body: bytes, *, seconds: float, connections: int = 1, workdir: pathlib.Path) -> dict[str, Any]:
    """`wrk` POSTing `body` to /v1/chat/completions for `seconds`; requests, rps and latency
    percentiles (ms) from wrk's own histogram (microsecond resolution)."""
    script = workdir / "wrk-post.lua"
    if not script.exists():
        script.write_text(_WRK_SCRIPT)
    body_file = workdir / f"wrk-body-{len(body)}.json"
    if not body_file.exists():
        body_file.write_bytes(body)
    argv = ["wrk", "-t", str(min(connections, 2)), "-c", str(connections), "-d", f"{seconds:g}s",
            "--timeout", "10s", "-s", str(script), f"{url}/v1/chat/completions"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=seconds + 60,
                          env={**os.environ, "BENCH_BODY_FILE": str(body_file)}, check=False)
    line = next((x for x in done.stdout.splitlines() if x.startswith("WRK ")), None)
    if done.returncode != 0 or line is None:
        raise RuntimeError(f"wrk failed ({done.returncode}): {done.stdout[-2000:]} {done.stderr[-2000:]}")
    result = json.loads(line[4:])
    seconds_run = result["duration_us"] / 1e6
    return {"requests": result["requests"], "seconds": seconds_run, "rps": result["requests"] / seconds_run,
            "p50": result["p50"] / 1e3, "p90": result["p90"] / 1e3, "p99": result["p99"] / 1e3,
            "max": result["max"] / 1e3, "mean": result["mean"] / 1e3,
            "errors": result["errors"], "non2xx": result["non2xx"]}
