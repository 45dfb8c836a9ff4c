"""What bench/batches.py measures for issue 47 (a batch cannot take the node down), beside its
throughput and wait figures:

- the sidecar's memory: VmRSS of its process sampled every `interval` (/proc/PID/status), the
  peak above its idle RSS (read just before the upload) in each phase of the batch, and VmHWM;
- the Checks of interactive requests while the batch validates and finalizes: one-token
  interactive requests, one every `interval` (open loop), sent only while the batch is in one of
  those phases (its status polled every `POLL_S`), each one's whole latency kept under the phase
  it was sent and answered in; beside the same requests with no batch at all ("no batch"), sent
  in the same round just before the upload: the added latency is the difference of the p99s
  (a request granted at once: what it adds is the sidecar's event loop answering the Check late);
- a file of one line over batches.maxLineBytes: the time from its batch's creation to its
  refusal (or the upload's own time, where the upload refuses it), the sidecar's memory growth
  over it, and whether an interactive request is served right after.

It measures; it asserts nothing but what the requests answer.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import pathlib
import time
from collections.abc import Callable
from typing import Any

import aiohttp

from stats import percentile

NO_BATCH, VALIDATING, IN_PROGRESS, FINALIZING = "no batch", "validating", "in_progress", "finalizing"
PROBED = (NO_BATCH, VALIDATING, FINALIZING)
ENDED = ("completed", "failed", "expired", "cancelled")
POLL_S = 0.02
MB = 1024 * 1024


def vm_bytes(pid: int, field: str) -> int:
    """A Vm* figure of /proc/PID/status (VmRSS, VmHWM), in bytes."""
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} for pid {pid}")


class MemorySampler:
    """VmRSS of `pid` every `interval_s`: the peak in each phase that `phase()` names."""

    def __init__(self, pid: int, interval_s: float, phase: Callable[[], str | None]) -> None:
        self.pid, self.interval_s, self.phase = pid, interval_s, phase
        self.peaks: dict[str, int] = {}
        self.samples = 0

    def sample(self) -> int:
        rss = vm_bytes(self.pid, "VmRSS")
        phase = self.phase() or "-"
        self.peaks[phase] = max(self.peaks.get(phase, 0), rss)
        self.samples += 1
        return rss

    async def run(self) -> None:
        while True:
            self.sample()
            await asyncio.sleep(self.interval_s)


class Probe:
    """One-token interactive requests every `interval_s` while `phase` is probed; each one's whole
    latency (ms) by phase. `watch(batch_id)` follows a batch's status (GET every POLL_S)."""

    def __init__(self, session: aiohttp.ClientSession, url: str, interval_s: float, body: dict[str, Any],
                 endpoint: str) -> None:
        self.session, self.url, self.interval_s, self.body, self.endpoint = session, url, interval_s, body, endpoint
        self.phase: str | None = None
        self.latencies_ms: dict[str, list[float]] = {}
        self.straddled = 0  # sent in one phase, answered in another: not counted
        self._sent: list[asyncio.Task[None]] = []
        self._batch_id: str | None = None

    async def _one(self, phase: str) -> None:
        started = time.perf_counter()
        async with self.session.post(f"{self.url}{self.endpoint}", json=self.body,
                                     headers={"x-llamaswap-priority": "interactive"}) as response:
            document = await response.json(content_type=None)
            assert response.status == 200, document
        if self.phase == phase:
            self.latencies_ms.setdefault(phase, []).append((time.perf_counter() - started) * 1000)
        else:
            self.straddled += 1

    async def run(self) -> None:
        if self.interval_s <= 0:
            return
        next_at = time.perf_counter()
        while True:
            next_at += self.interval_s
            await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
            phase = self.phase
            if phase in PROBED:
                self._sent.append(asyncio.create_task(self._one(phase)))

    async def watch(self, batch_id: str) -> None:
        """Follow the batch's status until it ends (the phase the probes are sent in)."""
        while True:
            async with self.session.get(f"{self.url}/v1/batches/{batch_id}") as response:
                document = await response.json(content_type=None)
                assert response.status == 200, document
            self.phase = str(document["status"])
            if self.phase in ENDED:
                return
            await asyncio.sleep(POLL_S)

    async def no_batch(self, seconds: float) -> None:
        """The floor: the same requests for `seconds` with no batch."""
        self.phase = NO_BATCH
        await asyncio.sleep(seconds)
        self.phase = None

    async def drain(self) -> None:
        await asyncio.gather(*self._sent)
        self._sent.clear()


@dataclasses.dataclass
class RoundLimits:
    """One round's batch side: its Checks by phase and the sidecar's memory."""

    latencies_ms: dict[str, list[float]]
    straddled: int
    idle_rss: int
    peaks: dict[str, int]  # by phase
    hwm: int  # VmHWM after the round (since the sidecar started)
    samples: int

    def describe(self) -> str:
        return (f"Checks (1-token interactive, whole latency) p99 {_p99(self, NO_BATCH)} no batch, "
                f"{_p99(self, VALIDATING)} validating, {_p99(self, FINALIZING)} finalizing; sidecar RSS idle "
                f"{self.idle_rss / MB:.1f} MB, above it: {_above(self)}; VmHWM {self.hwm / MB:.1f} MB")


def _p99(limits: RoundLimits, phase: str) -> str:
    values = limits.latencies_ms.get(phase, [])
    return f"{percentile(values, 99):.1f} ms ({len(values)})" if values else "- (0)"


def _above(limits: RoundLimits) -> str:
    return ", ".join(f"{phase} {(peak - limits.idle_rss) / MB:+.1f} MB" for phase, peak in limits.peaks.items()
                     if phase != "-")


@dataclasses.dataclass
class BigLine:
    """A one-line file over batches.maxLineBytes: how and how fast it was refused, memory around it."""

    file_bytes: int
    upload_s: float
    refused_at: str  # "upload", "validation", or not refused (the batch's end)
    refuse_s: float  # the upload's time, or the batch's creation to the poll that saw it failed
    error: dict[str, Any]
    idle_rss: int
    peak_upload: int
    before_refusal: int  # RSS as the batch is created (the upload's memory may not be given back)
    peak_refusal: int
    served_after: bool

    def describe(self) -> str:
        return (f"a {self.file_bytes / MB:.0f} MB one-line file: refused at {self.refused_at} in "
                f"{self.refuse_s:.2f} s ({json.dumps(self.error)[:200]}), upload {self.upload_s:.2f} s; sidecar RSS "
                f"idle {self.idle_rss / MB:.1f} MB, peak above it during the upload "
                f"{(self.peak_upload - self.idle_rss) / MB:+.1f} MB; during the refusal, above the RSS as it began "
                f"({self.before_refusal / MB:.1f} MB): {(self.peak_refusal - self.before_refusal) / MB:+.1f} MB; "
                f"an interactive request served after it: "
                f"{'yes' if self.served_after else 'NO'}")


def big_line(megabytes: int, model: str, endpoint: str) -> bytes:
    """One line of about `megabytes` MB: a request whose prompt is that long (a string: were it
    parsed, the sidecar would hold it a few times over, not the millions of objects the issue's
    crash-loop line had, which could take the shared machine's memory)."""
    head = json.dumps({"custom_id": "big", "method": "POST", "url": endpoint,
                       "body": {"model": model, "max_tokens": 1, "prompt": "@"}})
    filler = "x" * (megabytes * MB)
    return head.replace('"@"', f'"{filler}"').encode() + b"\n"


async def refuse_big_line(session: aiohttp.ClientSession, url: str, pid: int, megabytes: int, model: str,
                          endpoint: str, interactive: dict[str, Any]) -> BigLine:
    data = big_line(megabytes, model, endpoint)
    state = {"phase": "upload"}
    sampler = MemorySampler(pid, 0.01, lambda: state["phase"])
    idle = sampler.sample()
    sampling = asyncio.create_task(sampler.run())
    try:
        started = time.perf_counter()
        form = aiohttp.FormData()
        form.add_field("purpose", "batch")
        form.add_field("file", data, filename="big.jsonl", content_type="application/jsonl")
        async with session.post(f"{url}/v1/files", data=form) as response:
            document = await response.json(content_type=None)
            status = response.status
        upload_s = time.perf_counter() - started
        before_refusal = sampler.sample()
        if status != 200:
            refused_at, refuse_s, error = "upload", upload_s, {"status": status, **document.get("error", {})}
        else:
            state["phase"] = "refusal"
            before_refusal = sampler.sample()
            started = time.perf_counter()
            async with session.post(f"{url}/v1/batches", json={"input_file_id": document["id"], "endpoint": endpoint,
                                                               "completion_window": "24h"}) as response:
                batch = await response.json(content_type=None)
                assert response.status == 200, batch
            while batch["status"] not in ENDED:
                await asyncio.sleep(POLL_S)
                async with session.get(f"{url}/v1/batches/{batch['id']}") as response:
                    batch = await response.json(content_type=None)
            refuse_s = time.perf_counter() - started
            refused_at = "validation" if batch["status"] == "failed" else f"no step: the batch ended {batch['status']}"
            errors = (batch.get("errors") or {}).get("data") or [{}]
            error = {"batch": batch["status"], **errors[0]}
        async with session.post(f"{url}{endpoint}", json=interactive,
                                headers={"x-llamaswap-priority": "interactive"}) as response:
            await response.read()
            served = response.status == 200
        sampler.sample()
    finally:
        sampling.cancel()
        await asyncio.gather(sampling, return_exceptions=True)
    return BigLine(len(data), upload_s, refused_at, refuse_s, error, idle, sampler.peaks.get("upload", idle),
                   before_refusal, sampler.peaks.get("refusal", before_refusal), served)


def report(rounds: list[RoundLimits], big: BigLine | None) -> None:
    """The issue's goals, as measured figures (never asserted)."""
    print("issue 47's goals (measured, never asserted):")
    for phase, label in ((VALIDATING, "validates"), (FINALIZING, "finalizes")):
        floor = [v for limits in rounds for v in limits.latencies_ms.get(NO_BATCH, [])]
        during = [v for limits in rounds for v in limits.latencies_ms.get(phase, [])]
        if floor and during:
            added = percentile(during, 99) - percentile(floor, 99)
            print(f"  Checks of interactive requests while the batch {label}: p99 {percentile(during, 99):.1f} ms "
                  f"({len(during)} requests) against {percentile(floor, 99):.1f} ms with no batch ({len(floor)}): "
                  f"added {added:+.1f} ms (goal: under 20 ms)")
        else:
            print(f"  Checks while the batch {label}: {len(during)} requests in that phase, {len(floor)} with no "
                  "batch (too short a phase to probe; lower --probe-ms)")
    for index, limits in enumerate(rounds, 1):
        above = max((peak for phase, peak in limits.peaks.items() if phase != "-"), default=limits.idle_rss)
        print(f"  round {index}: the sidecar's peak memory above idle {(above - limits.idle_rss) / MB:+.1f} MB "
              f"(goal: under 150 MB; idle {limits.idle_rss / MB:.1f} MB, by phase: {_above(limits)}; VmHWM "
              f"{limits.hwm / MB:.1f} MB; {limits.samples} samples)")
    if big is not None:
        print(f"  {big.describe()} (goal: under 2 s, memory growth under 50 MB)")
