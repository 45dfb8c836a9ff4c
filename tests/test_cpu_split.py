"""bench/cpu_split.py: each py-spy sample goes to the step its stack names, and the names it looks
for are still the sidecar's (a rename must fail here, not send samples to another row unseen)."""

from __future__ import annotations

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import cpu_split  # noqa: E402

MAIN = "thread (100): MainThread"
LOOP = "BaseEventLoop._run_once (asyncio/base_events.py:1922);Handle._run (asyncio/events.py:80)"
CHECK = f"{MAIN};{LOOP};0x7f (cygrpc.so);Authorization.Check (llamaswap/adapters/ext_authz.py:265)"
REPORT = (f"{MAIN};{LOOP};AccessLogs.StreamAccessLogs (llamaswap/adapters/access_log.py:107);"
          "Coordinator.report (llamaswap/runtime/coordinator.py:200)")
ADMIT = f"{CHECK};Coordinator.admit (llamaswap/runtime/coordinator.py:90)"
DEFERRED = f"{MAIN};{LOOP};Deferred.run (llamaswap/runtime/deferred.py:50)"


def write_profile(tmp_path: pathlib.Path, stacks: dict[str, int]) -> str:
    path = tmp_path / "profile.raw"
    path.write_text("".join(f"{stack} {count}\n" for stack, count in stacks.items()))
    return str(path)


def test_each_sample_goes_to_the_innermost_step_its_stack_names(tmp_path: pathlib.Path) -> None:
    profile = write_profile(tmp_path, {
        f"{CHECK};Authorization._arrival (llamaswap/adapters/ext_authz.py:300);"
        "retry_digest (llamaswap/adapters/ext_authz.py:240);RetryKeys.digest (llamaswap/runtime/kept.py:57)": 3,
        f"{CHECK};Authorization._arrival (llamaswap/adapters/ext_authz.py:300);model_of (x.py:1)": 5,
        f"{ADMIT};Grants.pump (llamaswap/runtime/grants.py:130)": 7,
        f"{ADMIT};Admitter._admit (a.py:80)": 11,
        f"{REPORT};Grants.pump (llamaswap/runtime/grants.py:130)": 13,
        f"{DEFERRED};ActivityLog._write (llamaswap/runtime/activity.py:220)": 17,
        f"{MAIN};{LOOP};0x7f (cygrpc.so);sock_recv (socketmodule.c:1)": 19,
        f"{MAIN};{LOOP};EpollSelector.select (selectors.py:468);epoll_wait (libc.so.6)": 1000,
        "thread (101): Thread-1 (_poll_wrapper);0x7f (cygrpc.so)": 23,
    })
    steps, threads, idle = cpu_split.split(profile)
    names = {step: step for step, _ in cpu_split.STEPS}
    by_prefix = {prefix: next(step for step in names if step.startswith(prefix)) for prefix in (
        "Check: retry digest", "Check: reading the arrival", "Check: the grant", "Check: admission less",
        "access log: the release", "observers: activity log", "wake-ups")}
    assert steps[by_prefix["Check: retry digest"]] == 3  # taken out of the arrival's reading
    assert steps[by_prefix["Check: reading the arrival"]] == 5
    assert steps[by_prefix["Check: the grant"]] == 7  # taken out of admission
    assert steps[by_prefix["Check: admission less"]] == 11
    assert steps[by_prefix["access log: the release"]] == 13  # a pump after a release is the release's
    assert steps[by_prefix["observers: activity log"]] == 17
    assert steps[by_prefix["wake-ups"]] == 19
    assert sum(steps.values()) == 3 + 5 + 7 + 11 + 13 + 17 + 19  # idle left out, other threads apart
    assert idle == 1000
    assert threads == {"Thread-1 (_poll_wrapper)": 23}


def test_under_uvloop_idle_waits_are_left_out_and_the_loops_own_work_has_its_row(tmp_path: pathlib.Path) -> None:
    uv = f"{MAIN};run_forever (loop.c:33397);uv_run (core.c:452)"
    profile = write_profile(tmp_path, {
        f"{uv};uv__io_poll (linux.c:1404);epoll_pwait (libc.so.6)": 1000,
        f"{uv};uv__run_idle (loop-watcher.c:68);Loop__on_idle (loop.c:19342);Py_DECREF (object.h:537)": 5,
        f"{uv};uv__run_idle (loop-watcher.c:68);Handle__run (loop.c:70959);ActivityLog._write (x.py:1)": 7,
        f"{uv};Handle__run (loop.c:70959);gc_collect_main (libpython3.11.so.1.0);visit (gcmodule.c:1)": 2,
    })
    steps, _, idle = cpu_split.split(profile)
    assert idle == 1000
    assert steps["event loop: uvloop and libuv's own work"] == 5
    assert steps["observers: activity log (record, JSON, log line)"] == 7  # a step's work stays the step's
    assert steps[cpu_split.OTHER] == 2  # uvloop deeper in the stack is not the loop's own work


def test_the_table_gives_shares_and_microseconds(tmp_path: pathlib.Path) -> None:
    profile = write_profile(tmp_path, {
        f"{CHECK};granted_wire (llamaswap/adapters/ext_authz.py:91)": 1,
        f"{MAIN};{LOOP};0x7f (cygrpc.so);task_step (_asynciomodule.c:1)": 3,
    })
    table = cpu_split.render(profile, main_us=1000.0, requests=None, rate=250)
    assert "| Check: the OK response (granted_wire) | 25.0 % | 250 |" in table
    assert "| grpc.aio: Cython and task steps (the rest) | 75.0 % | 750 |" in table


def test_the_functions_it_names_still_exist() -> None:
    from llamaswap.adapters.access_log import AccessLogs, report_of, ticket_of
    from llamaswap.adapters.ext_authz import Authorization, granted_wire, retry_digest
    from llamaswap.runtime.activity import ActivityLog
    from llamaswap.runtime.coordinator import Coordinator
    from llamaswap.runtime.deferred import Deferred
    from llamaswap.runtime.grants import Grants
    from llamaswap.runtime.publishing import QueuePictures

    for owner, name in ((Authorization, "_arrival"), (Authorization, "Check"), (Coordinator, "admit"),
                        (Coordinator, "report"), (Grants, "pump"), (Grants, "_grant"), (AccessLogs, "StreamAccessLogs"),
                        (QueuePictures, "_build_now"), (Deferred, "run"), (ActivityLog, "_write")):
        assert callable(getattr(owner, name)), f"{owner.__name__}.{name}"
    assert all(callable(function) for function in (report_of, ticket_of, granted_wire, retry_digest))
    assert (ROOT / "sidecar/llamaswap/runtime/history.py").exists()
