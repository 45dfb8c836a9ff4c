"""`llamaswap serve` under cProfile: the benchmarks' hook for profiling the sidecar in place.

    python bench/profile_serve.py --out FILE serve -c CONFIG ...   (what the harness runs)
    python bench/profile_serve.py --report FILE [--per NAME]        (the hot path, per request)

The benchmarks start it instead of `python -m llamaswap` with `--cprofile FILE` (through
`stack.bench_stack(sidecar_argv=...)`; the sidecar and e2e code are not touched). The
profiler runs from the first line of `serve` until the process stops on SIGTERM, when the
stats are written. cProfile sees Python code only: grpc.aio's Cython and C core appear as the
time of the Python callers around them (use py-spy with --native for those), and it slows the
sidecar about 1.5-2x, so read the shares and the per-request figures, not absolute latencies.

The report divides each function's own (tottime) and inclusive (cumtime) time by the number of
requests, counted as the calls of `ext_authz.granted_wire` (one per granted Check) unless `--per`
names another function.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys

# What the report lists first: the sidecar's own hot path, by (file suffix, function).
HOT_PATH = (
    ("adapters/ext_authz.py", "Check"),
    ("adapters/ext_authz.py", "_arrival"),
    ("adapters/ext_authz.py", "model_of"),
    ("adapters/ext_authz.py", "granted_wire"),
    ("adapters/ext_authz.py", "_decision_values"),
    ("runtime/admission.py", "admit"),
    ("runtime/admission.py", "_admit"),
    ("runtime/grants.py", "pump"),
    ("runtime/grants.py", "report"),
    ("runtime/grants.py", "release"),
    ("runtime/grants.py", "finish"),
    ("runtime/publishing.py", "changed"),
    ("runtime/publishing.py", "publish"),
    ("runtime/admission.py", "arm_expiry"),
    ("runtime/watchdogs.py", "arm"),
    ("runtime/forecast.py", "estimate_later"),
    ("runtime/forecast.py", "_estimate"),
    ("runtime/publishing.py", "observe"),
    ("adapters/access_log.py", "StreamAccessLogs"),
    ("adapters/access_log.py", "ticket_of"),
    ("adapters/access_log.py", "report_of"),
    ("adapters/access_log.py", "exchange_end"),
    ("runtime/observer.py", "_each"),
    ("telemetry/observer.py", "dispatched"),
    ("telemetry/observer.py", "finished"),
    ("telemetry/observer.py", "queue_changed"),
    ("runtime/activity.py", "finished"),
    ("runtime/activity.py", "record"),
    ("runtime/activity.py", "_write"),
    ("json/__init__.py", "dumps"),
    ("logging/__init__.py", "info"),
    ("logging/__init__.py", "emit"),
    ("core/scheduler.py", "enqueue"),
    ("core/scheduler.py", "next"),
    ("core/scheduler.py", "release"),
    ("core/scheduler.py", "band_stats"),
    ("runtime/ticket.py", "__init__"),
    ("core/priority.py", "resolve"),
    ("secrets.py", "token_urlsafe"),
)


def argv_for(output: str | None) -> list[str] | None:
    """The sidecar command for `bench_stack(sidecar_argv=...)`: None (the plain one) without output."""
    if not output:
        return None
    import pathlib

    return [sys.executable, str(pathlib.Path(__file__).resolve()), "--out", str(pathlib.Path(output).resolve())]


def run(output: str, argv: list[str]) -> int:
    from llamaswap.commands.main import main

    profiler = cProfile.Profile()
    profiler.enable()
    try:
        return main(argv)
    finally:
        profiler.disable()
        profiler.dump_stats(output)


def report(path: str, per: str = "granted_wire", top: int = 25) -> str:
    stats = pstats.Stats(path)
    entries = stats.stats  # type: ignore[attr-defined]  # {(file, line, name): (cc, nc, tt, ct, callers)}
    requests = sum(nc for (file, _, name), (_, nc, _, _, _) in entries.items()
                   if name == per and "llamaswap" in file)
    if not requests:
        return f"no calls of {per} in {path}"
    total = stats.total_tt  # type: ignore[attr-defined]
    lines = [f"{path}: {requests} requests (calls of {per}); {1e6 * total / requests:.0f} us of profiled Python "
             "per request in all (cProfile's own overhead included)"]
    lines.append(f"{'function':<58} {'calls/req':>9} {'own us/req':>10} {'incl us/req':>11}")
    for suffix, name in HOT_PATH:
        for (file, line, function), (_, nc, tt, ct, _) in entries.items():
            if function == name and file.endswith(suffix):
                label = f"{suffix.rsplit('/', 1)[-1]}:{line} {function}"
                lines.append(f"{label:<58} {nc / requests:>9.2f} {1e6 * tt / requests:>10.1f} "
                             f"{1e6 * ct / requests:>11.1f}")
    lines.append(f"-- top {top} by own time --")
    ranked = sorted(entries.items(), key=lambda item: -item[1][2])[:top]
    for (file, line, function), (_, nc, tt, ct, _) in ranked:
        label = f"{'/'.join(file.rsplit('/', 2)[-2:])}:{line} {function}"
        lines.append(f"{label[-58:]:<58} {nc / requests:>9.2f} {1e6 * tt / requests:>10.1f} "
                     f"{1e6 * ct / requests:>11.1f}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="write the stats here when the sidecar stops")
    parser.add_argument("--report", help="summarise a stats file")
    parser.add_argument("--per", default="granted_wire", help="the function whose calls count requests")
    parser.add_argument("--top", type=int, default=25)
    args, rest = parser.parse_known_args()
    if args.report:
        print(report(args.report, args.per, args.top))
        return 0
    if not args.out:
        parser.error("--out or --report")
    return run(args.out, rest)


if __name__ == "__main__":
    sys.exit(main())
