"""The split of a request's sidecar CPU by step, from a py-spy profile taken under load.

    python bench/cpu_split.py FILE [--main-us N] [--requests N] [--rate 250]

FILE is py-spy's raw output (`bench/overhead.py --profile FILE`, best with
`PYSPY_ARGS="--native --threads"` so that grpc.aio's Cython and C core show as their own frames).
Each busy sample of the main thread (the event loop; samples whose leaf waits in epoll are idle
and left out) goes to the first step of `STEPS` whose pattern any frame of its stack matches, so
a step is inclusive of what it calls unless an earlier step claims it (the retry digest is taken
out of the Check's reading, the grant out of admission, each observer out of the deferred run).

Shares within one profile do not depend on how busy the machine is; microseconds per request
do. With `--main-us` (the main thread's CPU per request that overhead printed for the same run)
each share is also shown as microseconds of that; with `--requests` (overhead's "requests in
the measured rounds") the other threads' samples are shown per request too.
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
from collections.abc import Callable

# Where an idle main thread waits: asyncio's selector (epoll_wait), or uvloop's libuv (epoll_pwait).
IDLE_LEAVES = ("epoll_wait", "epoll_pwait", "EpollSelector.select", "select_epoll_poll", "poll (libc")


def _all(*patterns: str) -> Callable[[str], bool]:
    compiled = [re.compile(pattern) for pattern in patterns]
    return lambda stack: all(pattern.search(stack) for pattern in compiled)


def _any(pattern: str) -> Callable[[str], bool]:
    compiled = re.compile(pattern)
    return lambda stack: compiled.search(stack) is not None


# (step, test on the whole stack as one ';'-joined string), first match wins.
STEPS: tuple[tuple[str, Callable[[str], bool]], ...] = (
    ("Check: retry digest (retry_digest: HMAC of caller and body)", _any(r"\bretry_(identity|digest) \(")),
    ("Check: reading the arrival (_arrival: headers, metadata, Arrival)", _any(r"Authorization\._arrival \(")),
    ("Check: the grant in admit (Grants.pump: scheduler, lease, ticket)", _all(r"Coordinator\.admit \(",
                                                                               r"Grants\.(pump|_grant) \(")),
    ("Check: admission less the grant (Coordinator.admit)", _any(r"Coordinator\.admit \(")),
    ("Check: the OK response (granted_wire)", _any(r";granted(_wire)? \(")),
    ("Check: the rest of the handler", _any(r"Authorization\.Check \(")),
    ("access log: the release and the next grant (Coordinator.report)", _any(r"Coordinator\.report \(")),
    ("access log: reading the entry (ticket_of, report_of)", _any(r";(ticket_of|report_of|exchange_end) \(")),
    ("access log: the stream's iteration (StreamAccessLogs)", _any(r"StreamAccessLogs \(")),
    # Built when read (a scrape's gauges, the loop's refresh for an exporter): before the metrics' row.
    ("observers: the queue picture (QueuePictures._build_now)", _any(r"QueuePictures\._build_now \(")),
    ("observers: activity log (record, JSON, log line)", _any(r"ActivityLog\.|runtime/activity\.py")),
    ("observers: metrics and spans (Telemetry, OpenTelemetry SDK)", _any(r"telemetry/observer\.py|opentelemetry/")),
    ("observers: the page's history", _any(r"runtime/history\.py")),
    ("observers: the rest of the deferred run (FanOut, Deferred.run)", _any(r"Deferred\.run \(")),
    ("protobuf: parsing a message in grpc.aio (Check or access log)", _any(r"upb_Decode|_upb_Decoder|FromString")),
    ("protobuf: serializing the answer in grpc.aio", _any(r"upb_Encode|SerializeToString|encode_message")),
    ("wake-ups: reading grpc.aio's poller socket (sock_recv)", _any(r";sock_recv")),
    ("grpc.aio: sending (sendmsg, eventfd write)", _any(r";(sendmsg|eventfd_write|write) \(")),
    ("event loop: select, _run_once, ready handles", _any(r";(BaseEventLoop\._run_once|EpollSelector\.select|"
                                                          r"BaseSelectorEventLoop\._process_events) \([^;]*$")),
    ("grpc.aio: Cython and task steps (the rest)", _any(r"cygrpc|task_step|TaskStepMethWrapper")),
    # uvloop (the default since it was adopted): its Cython (loop.c) or libuv at the leaf or just
    # above it; every stack runs under uv_run, so only what no step above claimed comes here.
    ("event loop: uvloop and libuv's own work", _any(r"\((loop\.c|core\.c|linux\.c|loop-watcher\.c|queue\.h):\d+\)"
                                                      r"[^;]*(;[^;]*)?$")),
)
OTHER = "other"


def split(path: str) -> tuple[collections.Counter[str], collections.Counter[str], int]:
    """(busy main-thread samples per step, busy samples per other thread name, idle main samples)."""
    steps: collections.Counter[str] = collections.Counter()
    threads: collections.Counter[str] = collections.Counter()
    idle = 0
    with open(path) as raw:
        for line in raw:
            stack, _, count_text = line.rstrip("\n").rpartition(" ")
            if not stack:
                continue
            count = int(count_text)
            frames = stack.split(";")
            if any(frames[-1].startswith(leaf) for leaf in IDLE_LEAVES):
                if "MainThread" in frames[0]:
                    idle += count
                continue
            if frames[0].startswith("thread") and "MainThread" not in frames[0]:
                name = re.sub(r"thread \(\d+\):\s*", "", frames[0]) or "unnamed"
                threads[name] += count
                continue
            for step, test in STEPS:
                if test(stack):
                    steps[step] += count
                    break
            else:
                steps[OTHER] += count
    return steps, threads, idle


def render(path: str, *, main_us: float | None, requests: int | None, rate: int) -> str:
    steps, threads, idle = split(path)
    busy = sum(steps.values())
    if not busy:
        return f"{path}: no busy main-thread samples"
    lines = [f"{path}: {busy} busy main-thread samples ({idle} idle in epoll, left out)"]
    lines.append("| step | share of the main thread |" + (" us per request |" if main_us else ""))
    lines.append("|---|---|" + ("---|" if main_us else ""))
    order = [step for step, _ in STEPS] + [OTHER]
    for step in order:
        share = steps.get(step, 0) / busy
        if not share:
            continue
        lines.append(f"| {step} | {100 * share:.1f} % |" + (f" {share * main_us:.0f} |" if main_us else ""))
    if threads:
        lines.append("")
        lines.append("other threads, busy samples" + (" per request (at the sampling rate)" if requests else ""))
        for name, count in threads.most_common():
            lines.append(f"  {name}: {count}" + (f" ({1e6 * count / rate / requests:.0f} us/request)"
                                                 if requests else ""))
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("file")
    parser.add_argument("--main-us", type=float, help="the main thread's CPU per request in the same run")
    parser.add_argument("--requests", type=int, help="requests served in the profiled window")
    parser.add_argument("--rate", type=int, default=250, help="py-spy's sampling rate (bench default 250)")
    args = parser.parse_args()
    print(render(args.file, main_us=args.main_us, requests=args.requests, rate=args.rate))
    return 0


if __name__ == "__main__":
    sys.exit(main())
