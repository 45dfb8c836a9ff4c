"""What the Batch API's end-to-end tests share (e2e/test_batches_*.py): the stack's configuration,
input files, the SDK's client, waiting for a batch's end, reading its files, what may lie in
batches.dir, and two ways to stop the sidecar inside a window of its work without a hook in it:

- `RenameHold`: strace attached to the sidecar holds each rename it makes (at its entry: the
  file not yet in place; or at its exit: in place, nothing after it done) until the test kills
  it; strace's own output says when a rename of a given file is being held;
- `database_write_lock`: another process holds the batches database's write lock, so the
  sidecar cannot commit anything (as a stalled disk): what it answers meanwhile is not written.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import pathlib
import shutil
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import openai

from harness import Stack, async_wait_for, free_port, wait_for
from llamaswap.batches.feeder import Feeder, FeedSettings
from llamaswap.batches.store import DATABASE, Store
from llamaswap.telemetry.batches import new_trace_ids

ENDPOINT = "/v1/chat/completions"
ENDED = ("completed", "failed", "expired", "cancelled")
# What batches.dir holds besides the files the API lists: the database, its WAL, the lock.
DIR_ENTRIES = (DATABASE, f"{DATABASE}-wal", f"{DATABASE}-shm", "batches.lock")
# strace's delay is in microseconds: long enough that only the test's kill ends it.
HOLD_US = 120_000_000


def batch_config(workdir: pathlib.Path, **batches: Any) -> dict[str, Any]:
    """Fixed ports (a sidecar started again must be where Envoy's bootstrap says); the fake's
    four slots (lines run side by side); batches.dir in the test's directory."""
    return {"listen": {"http": f"127.0.0.1:{free_port()}", "grpc": f"127.0.0.1:{free_port()}",
                       "admin": f"127.0.0.1:{free_port()}"},
            "upstream": {"slots": 4},
            "batches": {"dir": str(workdir / "batches"), **batches}}


def chat_line(custom_id: str, content: str = "hi", *, model: str = "model-a") -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": content}]}}


def jsonl(lines: list[Any]) -> bytes:
    return b"".join((line if isinstance(line, bytes) else json.dumps(line).encode()) + b"\n" for line in lines)


def sdk(stack: Stack, api_key: str = "unused", **headers: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key=api_key, max_retries=0, timeout=60,
                         default_headers=headers or None)


def upload(client: openai.OpenAI, lines: list[Any]) -> str:
    return client.files.create(file=("input.jsonl", jsonl(lines)), purpose="batch").id


def create(client: openai.OpenAI, file_id: str) -> Any:
    return client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")


def ended(client: openai.OpenAI, batch_id: str, status: str | None = None, *, timeout: float = 60.0) -> Any:
    """The batch once it reached a terminal status (polled with a deadline: no batch stuck)."""
    def terminal() -> Any:
        batch = client.batches.retrieve(batch_id)
        return batch if batch.status in ENDED else None
    batch = wait_for(terminal, timeout=timeout, what=f"batch {batch_id} to end")
    if status is not None:
        assert batch.status == status, batch
    return batch


def records(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def each_once(client: openai.OpenAI, batch: Any, custom_ids: list[str]) -> tuple[list[dict[str, Any]],
                                                                                list[dict[str, Any]]]:
    """Every custom_id exactly once in the output and error files together; (output, errors)."""
    output, errors = records(client, batch.output_file_id), records(client, batch.error_file_id)
    seen = collections.Counter(record["custom_id"] for record in output + errors)
    assert seen == collections.Counter(custom_ids), seen
    return output, errors


def leftovers(directory: pathlib.Path, file_ids: set[str]) -> list[str]:
    """What lies in batches.dir besides the database, its lock and the files the API lists: a
    temporary file left behind (an upload's, an output being written)."""
    if not directory.exists():
        return []
    found = []
    for path in sorted(directory.rglob("*")):
        relative = path.relative_to(directory)
        if path.is_dir():
            continue
        if len(relative.parts) == 1 and relative.name in DIR_ENTRIES:
            continue
        if len(relative.parts) == 2 and relative.parts[0] == "files" and relative.name in file_ids:
            continue
        found.append(str(relative))
    return found


def listed_file_ids(client: openai.OpenAI) -> set[str]:
    return {item.id for item in client.files.list().data}


def serves_interactive(stack: Stack) -> bool:
    """An interactive chat completion through Envoy is answered (the sidecar schedules)."""
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=30,
                           default_headers={"x-llamaswap-priority": "interactive"})
    try:
        answer = client.chat.completions.create(model="model-a", messages=[{"role": "user", "content": "still up?"}])
        return answer.choices[0].message.content == "ok"
    finally:
        client.close()


@contextlib.contextmanager
def database_write_lock(batches_dir: pathlib.Path) -> Iterator[None]:
    """Hold the batches database's write lock (readers go on, in WAL mode; no write commits)."""
    db = sqlite3.connect(batches_dir / DATABASE, isolation_level=None, timeout=30)
    try:
        db.execute("BEGIN IMMEDIATE")
        yield
        db.execute("ROLLBACK")
    finally:
        db.close()


def shifted_clock_command(offset_s: int) -> list[str]:
    """What runs `llamaswap` with its wall clock (time.time, time.time_ns) `offset_s` ahead, as if
    that much time had passed (the monotonic clocks as they are): for what expires."""
    code = ("import runpy, sys, time\n"
            f"_now, _now_ns = time.time, time.time_ns\n"
            f"time.time = lambda: _now() + {offset_s}\n"
            f"time.time_ns = lambda: _now_ns() + {offset_s * 1_000_000_000}\n"
            "runpy.run_module('llamaswap', run_name='__main__', alter_sys=True)\n")
    return [sys.executable, "-c", code]


def truncate_wal(batches_dir: pathlib.Path) -> None:
    """Checkpoint the batches database and cut its WAL to nothing, so that the sidecar's next
    commit needs new space on the disk (a WAL reused from its start would not)."""
    db = sqlite3.connect(batches_dir / DATABASE, isolation_level=None, timeout=30)
    try:
        busy, _, _ = db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
        assert busy == 0, "the batches database was busy: its WAL could not be cut"
    finally:
        db.close()


def strace_missing() -> str | None:
    """Why RenameHold cannot run here, or None."""
    return None if shutil.which("strace") else "strace is not installed (Debian package strace)"


class RenameHold:
    """strace attached to process `pid` (every thread, and those it starts): each rename (or, with
    `path`, each read of that file from the `after`th on) waits HOLD_US at its entry (`at`
    "enter") or its exit ("exit"). Stop it once the process was killed."""

    def __init__(self, pid: int, workdir: pathlib.Path, *, at: str = "enter", path: pathlib.Path | None = None,
                 after: int = 1, name: str = "strace") -> None:
        self.output = workdir / f"{name}.out"
        self.errors = workdir / f"{name}.err"
        if path is None:
            calls = "rename,renameat,renameat2"
            filters: list[str] = []
        else:
            calls = "read,pread64,readv,preadv,preadv2"
            filters = ["-P", str(path)]
        argv = ["strace", "-f", "-p", str(pid), "-o", str(self.output), *filters, "-e", f"trace={calls}",
                "-e", f"inject={calls}:delay_{at}={HOLD_US}:when={after}+"]
        with open(self.errors, "wb") as errors:
            self.process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=errors)
        wait_for(lambda: "attached" in self.errors.read_text() or self.process.poll() is not None,
                 what="strace attached")
        assert self.process.poll() is None, self.errors.read_text()

    def holding(self, text: str) -> bool:
        """Whether a held call whose arguments contain `text` has begun (strace writes a call's
        arguments as it enters)."""
        return self.output.exists() and text in self.output.read_text(errors="replace")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(15)


class Feeding:
    """A store and a feeder in this test's process, sending to a stack's listener at ``url``: the
    test calls the feeder itself (`Feeder.stop_line`). Leave the stack's batches.dir unset (the
    sidecar's own feeder off)."""

    def __init__(self, url: str, directory: pathlib.Path, *, preempt: bool = True) -> None:
        self.url = url
        self.store = Store(directory)
        self.preempt = preempt
        self.feeder = self._feeder()
        self.task: asyncio.Task[None] | None = None

    def _feeder(self) -> Feeder:
        return Feeder(self.store, FeedSettings(self.url, lambda: 2, lambda: 1000, preempt=lambda: self.preempt))

    def batch(self, lines: list[tuple[str, dict[str, Any]]]) -> str:
        upload = self.store.directory / "upload.jsonl"
        upload.write_text("".join(json.dumps({"custom_id": custom_id, "method": "POST", "url": ENDPOINT,
                                              "body": body}) + "\n" for custom_id, body in lines))
        record = self.store.add_file(upload, filename="in.jsonl", purpose="batch")
        trace_id, span_id = new_trace_ids()
        batch = self.store.create_batch(endpoint=ENDPOINT, input_file_id=record.id, completion_window="24h",
                                        window_s=3600, metadata=None, priority=-100, trace_id=trace_id,
                                        span_id=span_id)
        self.feeder.wake()
        return batch.id

    def start(self) -> None:
        self.task = asyncio.create_task(self.feeder.run())

    async def restart(self) -> None:
        """Stop the feeder as a kill would leave it (its lines in flight abandoned) and start anew."""
        await self.stop()
        self.feeder = self._feeder()
        self.start()

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
            self.task = None

    async def output(self, batch_id: str) -> dict[str, dict[str, Any]]:
        """The batch's output file once it completed, by custom_id."""
        def done() -> Any:
            batch = self.store.batch(batch_id)
            return batch if batch is not None and batch.status.ended else None
        batch = await async_wait_for(done, what=f"batch {batch_id} to end")
        assert batch.status.value == "completed" and batch.output_file_id is not None, batch
        records = [json.loads(text) for text in self.store.file_path(batch.output_file_id).read_text().splitlines()]
        return {record["custom_id"]: record for record in records}
