"""Profiling the sidecar under load: py-spy record while a block runs, and a per-function summary
of its raw output (`python bench/profiling.py FILE [TOP] --requests N`)."""

from __future__ import annotations

import contextlib
import os
import pathlib
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator


@contextlib.contextmanager
def profiled(pid: int, output: str | None, *, rate: int = 250) -> Iterator[None]:
    """py-spy record of `pid` while the block runs (if `output`); raw collapsed stacks.

    Extra py-spy flags come from $PYSPY_ARGS (e.g. `--native --threads --idle`)."""
    if not output:
        yield
        return
    py_spy = pathlib.Path(sys.executable).parent / "py-spy"
    extra = os.environ.get("PYSPY_ARGS", "").split()
    argv = [str(py_spy if py_spy.exists() else "py-spy"), "record", "-p", str(pid), "-o", output,
            "--format", "raw", "--rate", str(rate), *([] if "--native" in extra else ["--nonblocking"]), *extra]
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    time.sleep(1.0)  # let py-spy attach
    try:
        yield
    finally:
        process.send_signal(signal.SIGINT)
        try:
            _, err = process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            _, err = process.communicate()
        if process.returncode not in (0, -signal.SIGINT) or not pathlib.Path(output).exists():
            sys.stderr.write(f"py-spy exited {process.returncode}: {err.decode(errors='replace')}")
        print(f"profile: {output} (summary: .venv/bin/python bench/profiling.py {output})")


IDLE_LEAVES = ("EpollSelector.select", "epoll_wait", "select (selectors", "poll (libc")


def _function(frame: str) -> str:
    """`name (file:line)` -> `name (file)`: one entry per function, not per line."""
    return re.sub(r":\d+\)$", ")", frame)


def summarize_profile(path: str, top: int = 30, *, requests: int | None = None, rate: int = 250,
                      by_line: bool = False) -> str:
    """Self and inclusive shares per function from a py-spy raw (collapsed) file, without the
    samples whose leaf is the event loop waiting in epoll (idle). With `requests` (how many
    requests the profiled window served) and py-spy's sampling `rate`, also microseconds per
    request: samples / rate / requests, i.e. the wall time a thread spent there per request."""
    self_count: dict[str, int] = {}
    total_count: dict[str, int] = {}
    samples = idle = 0
    for line in pathlib.Path(path).read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack:
            continue
        count = int(count_text)
        frames = stack.split(";")
        if any(frames[-1].startswith(leaf) for leaf in IDLE_LEAVES):
            idle += count
            continue
        if not by_line:
            frames = [_function(frame) for frame in frames]
        samples += count
        seen: set[str] = set()
        for frame in frames:
            if frame not in seen:
                seen.add(frame)
                total_count[frame] = total_count.get(frame, 0) + count
        self_count[frames[-1]] = self_count.get(frames[-1], 0) + count
    per = f", {1e6 * samples / rate / requests:.0f} us per request" if requests else ""
    lines = [f"{samples} busy samples ({idle} more idle in epoll, left out){per}"]

    def row(frame: str, count: int) -> str:
        us = f" {1e6 * count / rate / requests:8.1f} us/req" if requests else ""
        return f"{100 * count / samples:6.2f}%{us}  {frame}"

    lines.append("-- self --")
    lines += [row(frame, count) for frame, count in sorted(self_count.items(), key=lambda kv: -kv[1])[:top]]
    lines.append("-- inclusive --")
    lines += [row(frame, count) for frame, count in sorted(total_count.items(), key=lambda kv: -kv[1])[:top]]
    return "\n".join(lines)




if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(prog="profiling.py", description="summarise a py-spy raw profile")
    parser.add_argument("file")
    parser.add_argument("top", nargs="?", type=int, default=30)
    parser.add_argument("--requests", type=int, help="requests served in the profiled window (for us/request)")
    parser.add_argument("--rate", type=int, default=250, help="py-spy's sampling rate (bench default 250)")
    parser.add_argument("--by-line", action="store_true", help="one entry per line, not per function")
    options = parser.parse_args()
    print(summarize_profile(options.file, options.top, requests=options.requests, rate=options.rate,
                            by_line=options.by_line))
