"""What the benchmarks read from /proc and the resource limits: RSS, CPU time (per thread group
of a Python sidecar), the machine's load, and a raised open-files limit."""

from __future__ import annotations

import os
import pathlib
import resource

CLK_TCK = os.sysconf("SC_CLK_TCK")


def raise_nofile() -> int:
    """Raise RLIMIT_NOFILE to the hard limit (children spawned afterwards inherit it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def rss_bytes(pid: int) -> int:
    """VmRSS of a process, in bytes."""
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (all its threads)."""
    text = pathlib.Path(f"/proc/{pid}/stat").read_text()
    fields = text[text.rindex(")") + 2:].split()  # after "pid (comm) "
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime (fields 14, 15)


def cpu_ns(pid: int) -> int:
    """CPU time so far of a process's live threads, in nanoseconds (/proc/PID/task/*/schedstat:
    exact, where /proc/PID/stat counts in clock ticks of 10 ms)."""
    total = 0
    for task in pathlib.Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, IndexError, ValueError):
            continue  # the thread ended
    return total


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds so far per group of a Python sidecar's threads (/proc/PID/task/*/stat):
    `main` is the event loop's thread (all of the sidecar's Python code and grpc.aio's Cython
    callbacks), `poller` the other Python thread(s) (grpc.aio's completion-queue poller),
    `grpc core` gRPC's C threads (event_engine: sockets, HTTP/2), `other` the rest (timers)."""
    groups: dict[str, float] = {"main": 0.0, "poller": 0.0, "grpc core": 0.0, "other": 0.0}
    for task in pathlib.Path(f"/proc/{pid}/task").iterdir():
        try:
            comm = (task / "comm").read_text().strip()
            text = (task / "stat").read_text()
        except OSError:
            continue  # the thread ended
        fields = text[text.rindex(")") + 2:].split()
        seconds = (int(fields[11]) + int(fields[12])) / CLK_TCK
        if task.name == str(pid):
            group = "main"
        elif comm.startswith("python"):
            group = "poller"
        elif comm.startswith("event_engine") or comm.startswith("grpc"):
            group = "grpc core"
        else:
            group = "other"
        groups[group] += seconds
    return groups


def machine_load() -> str:
    try:
        return " ".join(pathlib.Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"
