"""`llamaswap simulate`: replaying activity logs and synthetic workloads through the real core.

Every expected number here is worked out by hand in the comments next to it.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import io
import json
import pathlib
import random
import sys

import pytest

from llamaswap.core import Estimator, Outcome, Policy
from llamaswap.commands import simulate as cli
from llamaswap.simulate.engine import measure_costs, prepare, simulate
from llamaswap.simulate.records import RequestRecord, format_line, parse_activity, read_activity
from llamaswap.simulate.workload import generate, parse_workload

ORIGIN_MS = 1_764_580_000_000.0
SETTINGS = {"event": "settings", "time": 1764580000.0, "scheduler": "serial", "aging_divisor_s": 60,
            "swap_affinity_bonus": 10, "max_queued": 0, "max_wait_s": 0, "model_priorities": {}}


def request(request_id: str, at_s: float, priority: int, model: str | None, outcome: str = "served", *,
            run_s: float | None = None, first_byte_s: float | None = None, wait_s: float | None = None,
            swap: bool = False, load: bool = False, settle_s: float | None = None) -> dict:
    """A `request` line; dispatched when it has a run."""
    return {
        "event": "request", "time": 0, "request_id": request_id, "trace_id": None, "model": model,
        "outcome": outcome, "dispatched": run_s is not None, "serial_priority": priority,
        "serial_queue_wait_ms": wait_s * 1000 if wait_s is not None else 0.0,
        "arrival_unix_ms": ORIGIN_MS + at_s * 1000, "first_byte_ms": first_byte_s * 1000 if first_byte_s else None,
        "run_ms": run_s * 1000 if run_s is not None else None,
        "settle_ms": settle_s * 1000 if settle_s is not None else None, "swap": swap, "load": load, "status": 200,
    }


def write_log(path: pathlib.Path, documents: list[dict], *, settings: dict | None = SETTINGS,
              extra: list[str] = ()) -> pathlib.Path:
    lines = [format_line(settings)] if settings else []
    lines += list(extra)
    lines += [format_line(d) for d in documents]
    path.write_text("".join(lines))
    return path


# The hand-made log. Models A (measured swap 5 s: its loads' first bytes are 5.0 s, no warm
# first byte for A so the baseline is 0) and B (its load's first byte 2.1 s minus the warm
# median 0.1 s = 2 s). What reality did matters only through each record's run and flags.
EXACT = [
    request("a1", 0.0, 0, "A", run_s=10.0, first_byte_s=5.0, load=True),
    request("b1", 1.0, 0, "B", run_s=3.0, first_byte_s=0.1),               # ran warm in reality
    request("a2", 2.0, 0, "A", run_s=9.0, first_byte_s=5.0, swap=True),    # ran after a B in reality
    request("i1", 3.0, 100, "B", "cancelled_waiting", wait_s=6.0),          # gave up after 6 s
    request("x1", 4.0, -100, "A", "expired", wait_s=600.0),                 # no patience of its own
    request("q1", 4.5, 0, "B", run_s=1.0, first_byte_s=0.1),               # served then, refused now
    request("b2", 9.5, 0, "B", run_s=5.0, first_byte_s=2.1, swap=True),
    request("z1", 30.0, 0, "A", run_s=9.0, first_byte_s=5.0, swap=True),
    request("u1", 5.0, 0, "C", "rejected_unknown_model"),
    request("s1", 6.0, 0, "A", "shutdown"),
]
EXACT_POLICY = Policy.serial(aging_divisor_s=60, swap_affinity_bonus=10, max_queued=4, max_wait_s=14)


def exact_records() -> list[RequestRecord]:
    return list(parse_activity(format_line(d) for d in EXACT).requests)


def test_costs_learn_swaps_from_unstreamed_loads_that_said_their_tokens():
    # Batch traffic: nothing streamed, every request says max_tokens. 1 ms per token warm; each load
    # runs 0.3 s beyond its tokens. Before, no first byte timed a load and the swap stayed at 5 s.
    documents = []
    for i in range(6):
        line = request(f"w{i}", i * 10.0, 0, "A", run_s=1.0)
        line.update(streamed=False, max_tokens=1000, first_byte_ms=1000.0)
        documents.append(line)
        load = request(f"l{i}", i * 10.0 + 5, 0, "A", run_s=0.8, swap=True)
        load.update(streamed=False, max_tokens=500, first_byte_ms=800.0)
        documents.append(load)
    records = list(parse_activity(format_line(d) for d in documents).requests)
    costs = measure_costs(records, default_run_s=10.0, default_swap_s=5.0, samples=50)
    assert costs.expected_swap_s("A") == pytest.approx(0.3)
    assert costs.expected_request_run_s("A", 500) == pytest.approx(0.5)
    untold = [dataclasses.replace(r, max_tokens=None) for r in records]  # no tokens said: the default stays
    assert measure_costs(untold, default_run_s=10.0, default_swap_s=5.0, samples=50).expected_swap_s("A") == 5.0


def test_exact_replay_of_a_hand_written_log():
    records = exact_records()
    costs = measure_costs(records, default_run_s=10.0, default_swap_s=5.0, samples=50)
    assert costs.expected_swap_s("A") == pytest.approx(5.0)
    assert costs.expected_swap_s("B") == pytest.approx(2.0)
    replay = prepare(records)
    assert replay.not_replayed == {"rejected_unknown_model": 1, "shutdown": 1}
    sim = simulate(replay, EXACT_POLICY, costs)
    got = {r.request.record.request_id: (r.outcome.value, r.start_ns, r.end_ns, r.release_ns) for r in sim.results}
    s = 1_000_000_000
    assert got == {
        # t=0: the first grant loads A from nothing, as it did in reality: 10 s.
        "a1": ("served", 0, 0, 10 * s),
        # t=10, A loaded: a2 (A, +10 affinity) beats b1 (earlier, B). Reality had it after a B,
        # here A is already loaded: its 9 s minus A's 5 s swap = 4 s.
        "a2": ("served", 10 * s, 10 * s, 14 * s),
        # t=14: b1 (waited longest) swaps A -> B; reality ran it warm: 3 s plus B's 2 s = 5 s.
        "b1": ("served", 14 * s, 14 * s, 19 * s),
        # Patience 6 s: gone at t=9, the GPU busy with a1 until 10.
        "i1": ("cancelled_waiting", None, 9 * s, None),
        # maxWaitSeconds 14: arrived at 4, expired at 18 while b1 ran.
        "x1": ("expired", None, 18 * s, None),
        # maxQueued 4: b1, a2, i1, x1 waiting at t=4.5.
        "q1": ("rejected_full", None, int(4.5 * s), None),
        # t=19, B loaded: reality swapped into B, here it is warm: 5 s minus 2 s = 3 s.
        "b2": ("served", 19 * s, 19 * s, 22 * s),
        # t=30: swaps B -> A as in reality: its recorded 9 s.
        "z1": ("served", 30 * s, 30 * s, 39 * s),
    }
    m = sim.metrics
    normal = m.bands["normal"]
    # Normal waits: a1 0, a2 8, b1 13, b2 9.5, z1 0 -> nearest rank p50 = 3rd of 5, p95 = 5th.
    assert (normal.served, normal.wait_p50_s, normal.wait_p95_s, normal.wait_max_s) == (5, 8.0, 13.0, 13.0)
    assert m.bands["interactive"].served == 0 and m.bands["interactive"].wait_p50_s is None
    assert m.bands["batch"].served == 0
    assert m.swaps == 3  # a1 (load), b1 (A -> B), z1 (B -> A)
    assert m.reorders == {"aging": 0, "swap_affinity": 1}  # a2 over b1
    assert m.busy_fraction == pytest.approx((10 + 4 + 5 + 3 + 9) / 39)
    assert (m.left, m.expired, m.rejected) == (1, 1, 1)
    assert m.peak_waiting == 4
    assert m.inversion is None  # the only lower-priority request (x1) never ran


def test_a_request_that_never_ran_gets_the_expected_run_and_the_swap_cost():
    # Without limits x1 (expired in reality) runs. A's expected run is the median of what the
    # served A grants taught: a1 10 - 5, a2 9 - 5, z1 9 - 5 -> 4 s.
    records = exact_records()
    costs = measure_costs(records, default_run_s=10.0, default_swap_s=5.0, samples=50)
    assert costs.expected_run_s("A") == pytest.approx(4.0)
    sim = simulate(prepare(records), Policy.serial(aging_divisor_s=60, swap_affinity_bonus=10), costs)
    s = 1_000_000_000
    spans = {r.request.record.request_id: (r.start_ns, r.release_ns) for r in sim.results}
    assert spans == {
        "a1": (0, 10 * s),
        "a2": (10 * s, 14 * s),        # affinity, warm: 9 - 5
        "b1": (14 * s, 19 * s),        # A -> B: 3 + 2
        "i1": (None, None),            # left at 9
        "q1": (19 * s, 20 * s),        # B loaded: affinity over b2 (later) and x1 (batch); warm as recorded
        "b2": (20 * s, 23 * s),        # warm now, a swap in reality: 5 - 2
        "x1": (23 * s, 32 * s),        # never ran: expected 4 s, plus B -> A 5 s
        "z1": (32 * s, 36 * s),        # arrived at 30, A loaded: warm, 9 - 5
    }
    x1 = next(r for r in sim.results if r.request.record.request_id == "x1")
    assert x1.outcome is Outcome.SERVED and x1.model_load


def test_settle_time_keeps_the_gpu_busy():
    records = list(parse_activity([
        format_line(request("r1", 0.0, 0, "A", run_s=2.0, load=True, settle_s=3.0)),
        format_line(request("r2", 1.0, 0, "A", run_s=1.0)),
    ]).requests)
    sim = simulate(prepare(records), Policy.serial(aging_divisor_s=60, swap_affinity_bonus=10),
                   measure_costs(records, default_run_s=10.0, default_swap_s=5.0, samples=5))
    r2 = sim.results[1]
    assert r2.start_ns == 5 * 1_000_000_000  # 2 s run + 3 s settle


def test_a_client_without_patience_is_gone_before_the_grant():
    # It gave up at once in reality (wait 0): arriving to an idle GPU, it still never runs.
    records = list(parse_activity([
        format_line(request("impatient", 0.0, 0, "A", "cancelled_waiting", wait_s=0.0)),
        format_line(request("next", 1.0, 0, "A", run_s=1.0, load=True)),
    ]).requests)
    sim = simulate(prepare(records), Policy.serial(aging_divisor_s=60, swap_affinity_bonus=10),
                   measure_costs(records, default_run_s=10.0, default_swap_s=5.0, samples=5))
    assert [(r.outcome.value, r.start_ns) for r in sim.results] == [("cancelled_waiting", None),
                                                                      ("served", 1_000_000_000)]


def test_an_upstream_error_forgets_the_loaded_model():
    # After r2's upstream error the scheduler no longer knows A is loaded, so r3's grant is a
    # load: recorded warm (1 s) plus A's default swap cost (5 s, nothing measured).
    documents = [
        request("r1", 0.0, 0, "A", run_s=2.0, load=True),
        request("r2", 0.5, 0, "A", "upstream_error", run_s=1.0),
        request("r3", 1.0, 0, "A", run_s=1.0),
    ]
    records = list(parse_activity(format_line(d) for d in documents).requests)
    sim = simulate(prepare(records), Policy.serial(aging_divisor_s=60, swap_affinity_bonus=10),
                   measure_costs(records, default_run_s=10.0, default_swap_s=5.0, samples=5))
    r1, r2, r3 = sim.results
    assert r2.outcome is Outcome.UPSTREAM_ERROR and not r2.model_load
    assert r3.model_load and r3.release_ns - r3.start_ns == 6 * 1_000_000_000
    assert sim.metrics.swaps == 2


def test_fifo_uses_the_recorded_model_priorities():
    settings = dict(SETTINGS, scheduler="fifo", model_priorities={"B": 10})
    documents = [
        request("g", 0.0, 0, "A", run_s=5.0, load=True),
        request("a", 1.0, 5, "A", run_s=1.0),    # 5
        request("b", 2.0, 0, "B", run_s=1.0),    # 0 + 10 for model B: goes first
        request("c", 3.0, 5, "A", run_s=1.0),    # 5, after a
    ]
    out, err, status = run_cli(["--requests", "--format", "json"], documents, settings=settings)
    assert status == 0
    lines = [json.loads(line) for line in out.splitlines()]
    starts = {line["request_id"]: line["start_ms"] for line in lines[:-1]}
    assert sorted(starts, key=starts.__getitem__) == ["g", "b", "a", "c"]
    assert lines[-1]["rows"][0]["settings"]["scheduler"] == "fifo"
    assert lines[-1]["rows"][0]["settings"]["modelPriorities"] == {"B": 10}


# -- the command -----------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="llamaswap")
    cli.add_parser(top.add_subparsers(dest="command", required=True))
    return top


_LOG_DIR: list[pathlib.Path] = []  # where run_cli writes its log: this test's tmp_path


@pytest.fixture(autouse=True)
def _log_dir(tmp_path):
    _LOG_DIR[:] = [tmp_path]
    yield
    _LOG_DIR.clear()


def run_cli(argv: list[str], documents: list[dict] | None = None, *, settings: dict | None = SETTINGS,
            extra: list[str] = ()) -> tuple[str, str, int]:
    """Run `simulate` (on a log of ``documents`` when given): stdout, stderr, exit status."""
    out, err = io.StringIO(), io.StringIO()
    if documents is not None:
        log = write_log(_LOG_DIR[0] / "activity.log", documents, settings=settings, extra=extra)
        argv = ["--activity", str(log), *argv]
    args = parser().parse_args(["simulate", *argv])
    status = args.run(args, out=out, err=err)
    return out.getvalue(), err.getvalue(), status


def run_json(argv: list[str], documents: list[dict] = EXACT, **kwargs) -> dict:
    out, err, status = run_cli(["--format", "json", *argv], documents, **kwargs)
    assert status == 0, err
    return json.loads(out)


def test_requests_lines():
    out, err, status = run_cli(["--max-queued", "4", "--max-wait", "14", "--requests"], EXACT)
    assert status == 0
    lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    by_id = {line["request_id"]: line for line in lines}
    assert list(by_id) == ["a1", "b1", "a2", "i1", "x1", "q1", "b2", "z1"]  # arrival order
    assert by_id["a2"] == {"request_id": "a2", "band": "normal", "priority": 0, "model": "A",
                           "start_ms": 10000.0, "wait_ms": 8000.0, "outcome": "served", "upstream": "gpu0",
                           "grant": 1, "model_load": False, "evicted": []}  # after a1, before b1 (affinity)
    assert by_id["i1"] == {"request_id": "i1", "band": "interactive", "priority": 100, "model": "B",
                           "start_ms": None, "wait_ms": 6000.0, "outcome": "cancelled_waiting",
                           "upstream": None, "grant": None, "model_load": False, "evicted": []}
    assert by_id["x1"]["outcome"] == "expired" and by_id["x1"]["wait_ms"] == 14000.0
    assert by_id["q1"]["outcome"] == "rejected_full" and by_id["q1"]["wait_ms"] == 0.0
    # The table follows the request lines and says what was not replayed.
    assert "2 not replayed: 1 rejected_unknown_model, 1 shutdown" in out


def test_requests_to_a_file_and_per_setting_when_sweeping(tmp_path):
    target = tmp_path / "requests.jsonl"
    document = run_json(["--requests", str(target), "--sweep", "swapAffinityBonus=0,10"])
    lines = [json.loads(line) for line in target.read_text().splitlines()]
    assert len(lines) == 2 * 8
    assert {line["setting"] for line in lines} == {0, 1}
    assert len(document["rows"]) == 2


def test_json_output_shape():
    document = run_json([])
    assert set(document) == {"source", "requests", "not_replayed", "skipped_lines", "malformed_records", "swept",
                             "concurrency_speed", "recorded_evictions", "rows"}
    assert document["requests"] == 8
    assert document["not_replayed"] == {"rejected_unknown_model": 1, "shutdown": 1}
    assert document["swept"] == []
    (row,) = document["rows"]
    assert set(row) == {"settings", "requests", "bands", "swaps", "reorders", "busy_fraction", "left", "expired",
                        "rejected", "peak_waiting", "worst_inversion", "gpus", "evictions"}
    assert row["settings"] == {"scheduler": "serial", "agingDivisor": 60, "swapAffinityBonus": 10, "maxQueued": 0,
                               "maxWaitSeconds": 0, "slots": 1, "reservedSlots": 0, "gpus": 1, "maxLoaded": 1,
                               "modelPriorities": {}, "modelSlots": {}}
    assert row["gpus"] == {"gpu0": {"swaps": row["swaps"], "busy_fraction": row["busy_fraction"]}}
    assert set(document["concurrency_speed"]) == {"points", "source", "detail"}
    assert set(row["bands"]) == {"interactive", "normal", "batch"}
    assert set(row["bands"]["normal"]) == {"served", "wait_p50_s", "wait_p95_s", "wait_max_s"}
    assert set(row["reorders"]) == {"aging", "swap_affinity"}


def test_table_output():
    out, err, status = run_cli([], EXACT)
    assert status == 0
    assert out.startswith("replayed 8 requests from ")
    assert "settings: scheduler serial, agingDivisor 60, swapAffinityBonus 10, maxQueued 0, maxWaitSeconds 0" in out
    assert "interactive" in out and "inversion" in out


def test_settings_precedence(tmp_path):
    recorded = dict(SETTINGS, aging_divisor_s=30, swap_affinity_bonus=5, max_queued=7)
    # The log's first settings record, when nothing else is given.
    values = run_json([], settings=recorded)["rows"][0]["settings"]
    assert (values["agingDivisor"], values["swapAffinityBonus"], values["maxQueued"]) == (30, 5, 7)
    # A later settings record (a reload) does not replace the first.
    reload = format_line(dict(SETTINGS, aging_divisor_s=99))
    out, _, _ = run_cli([], EXACT + [], settings=recorded, extra=[reload])
    assert "settings changed 1 time(s)" in out
    # -c replaces the recorded settings as a whole (maxQueued back to its default 0)...
    config = tmp_path / "llamaswap.yaml"
    config.write_text("routing:\n  scheduler:\n    settings:\n      serial:\n        agingDivisor: 90\n"
                      "        swapAffinityBonus: 20\n")
    values = run_json(["-c", str(config)], settings=recorded)["rows"][0]["settings"]
    assert (values["agingDivisor"], values["swapAffinityBonus"], values["maxQueued"]) == (90, 20, 0)
    # ...a flag beats -c...
    values = run_json(["-c", str(config), "--swap-affinity-bonus", "3", "--max-queued", "2"],
                      settings=recorded)["rows"][0]["settings"]
    assert (values["agingDivisor"], values["swapAffinityBonus"], values["maxQueued"]) == (90, 3, 2)
    # ...and a sweep beats the flag.
    rows = run_json(["-c", str(config), "--swap-affinity-bonus", "3", "--sweep", "swapAffinityBonus=7,8"],
                    settings=recorded)["rows"]
    assert [row["settings"]["swapAffinityBonus"] for row in rows] == [7, 8]
    assert {row["settings"]["agingDivisor"] for row in rows} == {90}
    # No settings record and nothing else: the configuration's defaults.
    values = run_json([], settings=None)["rows"][0]["settings"]
    assert (values["scheduler"], values["agingDivisor"], values["swapAffinityBonus"]) == ("serial", 60, 10)


def test_sweep_runs_the_cartesian_product():
    document = run_json(["--sweep", "agingDivisor=30,60", "--sweep", "swapAffinityBonus=0,10,20"])
    assert document["swept"] == ["agingDivisor", "swapAffinityBonus"]
    combos = [(r["settings"]["agingDivisor"], r["settings"]["swapAffinityBonus"]) for r in document["rows"]]
    assert combos == [(30, 0), (30, 10), (30, 20), (60, 0), (60, 10), (60, 20)]
    # Each row really ran with its setting. Without affinity (bonus 0) the grants go by arrival:
    # a1 (load), b1 (A -> B), a2 (B -> A), q1 (A -> B), b2, z1 (B -> A, arriving as b2 ends), x1:
    # 5 loads; with the bonus a1, b1 and x1 only (see the previous test).
    assert [r["swaps"] for r in document["rows"]] == [5, 3, 3, 5, 3, 3]


def test_sweep_table_has_the_swept_columns():
    out, err, status = run_cli(["--sweep", "scheduler=serial,fifo"], EXACT)
    assert status == 0
    assert "fixed settings: agingDivisor 60, swapAffinityBonus 10, maxQueued 0, maxWaitSeconds 0" in out
    assert any(line.strip().startswith("fifo") for line in out.splitlines())


def test_junk_lines_are_skipped():
    documents = EXACT[:3]
    extra = [
        "2026-01-05 10:00:00,001 INFO llamaswap.commands.serve: listening on 127.0.0.1:9000\n",
        "{not json at all\n",
        '{"event": "dispatch", "request_id": "old-format"}\n',
        "[1, 2, 3]\n",
        "\n",
        "2026-01-05 10:00:00,002 INFO llamaswap.activity: " + format_line(request("p1", 0.5, 0, "A", run_s=1.0)),
        format_line(dict(request("bad", 0.7, 0, "A", run_s=1.0), arrival_unix_ms=None)),
    ]
    document = run_json([], documents, extra=extra)
    assert document["skipped_lines"] == 5
    assert document["malformed_records"] == 1
    assert document["requests"] == 4  # a1, b1, a2 and the prefixed p1
    activity = parse_activity(extra)
    assert activity.first_problem == "line 7: arrival_unix_ms missing"


# -- the worst priority inversion ---------------------------------------------------------


INVERSION = [
    request("g0", 0.0, 0, "A", run_s=10.0, load=True),
    request("e0", 0.5, 0, "A", run_s=1.0),             # lower, but arrived before h: not an inversion
    request("h", 1.0, 5, "B", run_s=4.0, swap=True),
    request("l", 2.0, 0, "A", run_s=6.0),              # lower, later, wins by affinity: 6 s
    request("m", 3.0, 0, "A", run_s=2.0),              # the same: 2 s
    request("k", 4.0, 7, "B", run_s=1.0, swap=True),   # higher than h: not an inversion
]


def test_worst_inversion_on_a_known_case():
    # Bonus 10: at t=10 (A loaded) e0 (10 + 9.5/60) beats l and m (earlier) and h (5 + 9/60);
    # then l 11-17, m 17-19, k (7 + 15/60 beats h's 5 + 18/60) 19-20, h at 20.
    # h waited 1..20; of the grants in between, l and m are lower and arrived after it: 6 + 2.
    row = run_json([], INVERSION)["rows"][0]
    assert row["worst_inversion"] == {"request_id": "h", "band": "normal", "priority": 5, "seconds": 8.0,
                                      "outcome": "served"}
    # Without affinity nothing lower overtakes h: no inversion.
    assert run_json(["--swap-affinity-bonus", "0"], INVERSION)["rows"][0]["worst_inversion"] is None


def test_inversion_counts_a_running_grant_only_until_the_client_left():
    # h gives up at t=13, while l (granted at 11) runs until 17: 2 s of l count, m none.
    documents = [d if d["request_id"] != "h" else request("h", 1.0, 5, "B", "cancelled_waiting", wait_s=12.0)
                 for d in INVERSION]
    row = run_json([], documents)["rows"][0]
    assert row["worst_inversion"] == {"request_id": "h", "band": "normal", "priority": 5, "seconds": 2.0,
                                      "outcome": "cancelled_waiting"}


def brute_force_inversions(results) -> dict[int, int]:
    """The definition, literally: O(n^2)."""
    times = {}
    for a in results:
        total = 0
        for g in results:
            if (g.start_ns is not None and g.request.index > a.request.index and g.base < a.base
                    and g.start_ns < a.end_ns):
                total += min(g.release_ns, a.end_ns) - g.start_ns
        times[a.request.index] = total
    return times


def test_inversion_matches_the_definition_on_random_traffic():
    rng = random.Random(5)
    for trial in range(80):
        documents = []
        at = 0.0
        for number in range(rng.randint(1, 40)):
            at += rng.choice([0.0, rng.expovariate(3.0)])  # a queue builds; some arrivals at one instant
            priority = rng.choice([-100, -1, 0, 1, 2, 5, 100])  # mostly within the bonus of each other
            model = rng.choice(["A", "B", "C", None])
            if rng.random() < 0.25:
                documents.append(request(f"r{number}", at, priority, model, "cancelled_waiting",
                                         wait_s=rng.choice([0.0, rng.uniform(0, 5)])))
            else:
                documents.append(request(f"r{number}", at, priority, model, run_s=rng.choice([0.0, rng.uniform(0, 3)]),
                                         swap=rng.random() < 0.3))
        records = list(parse_activity(format_line(d) for d in documents).requests)
        serial = Policy.serial(aging_divisor_s=rng.choice([0, 1, 60]), swap_affinity_bonus=rng.choice([0, 10, 99]),
                               max_queued=rng.choice([0, 0, 5]), max_wait_s=rng.choice([0, 0, 4.5]))
        policy = serial if rng.random() < 0.85 else Policy.fifo(model_priorities={"A": 1})
        sim = simulate(prepare(records), policy, measure_costs(records, default_run_s=1.0, default_swap_s=0.5,
                                                               samples=5))
        expected = brute_force_inversions(sim.results)
        worst = max(expected.values(), default=0)
        got = sim.metrics.inversion
        if worst == 0:
            assert got is None, trial
        else:
            first = min((r.end_ns, r.request.index) for r in sim.results if expected[r.request.index] == worst)[1]
            assert got is not None and got.seconds == worst / 1e9, trial
            assert got.request_id == sim.results[first].request.record.request_id, trial


# -- errors ------------------------------------------------------------------------------


@pytest.mark.parametrize("argv, message", [
    (["--swap-affinity-bonus", "120"], "error: --swap-affinity-bonus 120: must be 0..99 (0 disables it), got 120"),
    (["--swap-affinity-bonus", "x"], "error: --swap-affinity-bonus x: not an integer: 'x'"),
    (["--aging-divisor", "0.0001"], "error: --aging-divisor 0.0001: must be 0 (no aging) or at least 0.001 seconds"),
    (["--aging-divisor", "-1"], "error: --aging-divisor -1: must be 0 (no aging)"),
    (["--max-queued", "-1"], "error: --max-queued -1: must be 0 (unlimited) or more"),
    (["--scheduler", "lifo"], "error: --scheduler lifo: must be serial or fifo"),
    (["--sweep", "agingDivisr=1,2"], "error: --sweep 'agingDivisr=1,2': unknown key 'agingDivisr'; did you mean "
                                     "'agingDivisor'?"),
    (["--sweep", "swapAffinityBonus=5,100"], "error: --sweep swapAffinityBonus=100: must be 0..99"),
    (["--sweep", "maxQueued"], "error: --sweep 'maxQueued': expected KEY=V1,V2,..."),
    (["--sweep", "maxQueued=1,,2"], "expected a comma-separated list of values"),
    (["--sweep", "maxQueued=1", "--sweep", "maxQueued=2"], "error: --sweep maxQueued is given twice"),
    (["--plot", "x.png"], "error: --plot draws wait against a swept setting"),
])
def test_bad_arguments_exit_2(argv, message):
    out, err, status = run_cli(argv, EXACT)
    assert status == 2
    assert message in err
    assert "Traceback" not in err


def test_unreadable_and_empty_files_exit_2(tmp_path):
    _, err, status = run_cli(["--activity", str(tmp_path / "missing.log")])
    assert status == 2 and "missing.log: cannot read the file" in err
    empty = tmp_path / "empty.log"
    empty.write_text("")
    _, err, status = run_cli(["--activity", str(empty)])
    assert status == 2 and "empty.log: no request records (0 lines" in err
    junk = tmp_path / "junk.log"
    junk.write_text("hello\n" + format_line(SETTINGS))
    _, err, status = run_cli(["--activity", str(junk)])
    assert status == 2 and "no request records (2 lines, 1 skipped" in err


def test_a_bad_config_file_exits_2(tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text("routing:\n  scheduler:\n    settings:\n      serial:\n        agingDivisr: 5\n")
    _, err, status = run_cli(["-c", str(config)], EXACT)
    assert status == 2
    assert "error: routing.scheduler.settings.serial.agingDivisr: unknown key" in err


# -- synthetic workloads ----------------------------------------------------------------------


WORKLOAD = {
    "duration": 600,
    "seed": 1,
    "classes": [
        {"name": "chat", "rate": 0.2, "priority": "interactive", "models": {"qwen3": 3, "gemma3": 1},
         "run": {"lognormal": {"median": 2, "sigma": 0.5}}, "patience": {"uniform": [10, 60]}, "swap": 4},
        {"name": "api", "rate": 0.1, "priority": 0, "models": "qwen3", "run": {"exponential": 3}},
        {"name": "nightly", "rate": 0.02, "priority": "batch", "models": {"gemma3": 1},
         "run": {"uniform": [10, 30]}},
        {"name": "probe", "rate": 0.01, "priority": 1, "models": "gemma3", "run": {"fixed": 0.5}},
    ],
}


def test_workload_is_deterministic_by_seed():
    first = generate(parse_workload(WORKLOAD))
    again = generate(parse_workload(WORKLOAD))
    other = generate(parse_workload(dict(WORKLOAD, seed=2)))
    assert first == again
    assert first != other
    assert 150 < len(first) < 250  # about 600 s x 0.33/s = 198
    assert [r.arrival_ms for r in first] == sorted(r.arrival_ms for r in first)
    patient = [r for r in first if r.request_id.startswith("chat-")]
    assert all(r.outcome is Outcome.CANCELLED_WAITING and 10_000 <= r.queue_wait_ms <= 60_000 for r in patient)
    assert all(r.run_ms == 500.0 for r in first if r.request_id.startswith("probe-"))
    assert {r.priority for r in first} == {100, 0, -100, 1}


def test_workload_through_the_command_is_deterministic(tmp_path):
    import yaml

    path = tmp_path / "workload.yaml"
    path.write_text(yaml.safe_dump(WORKLOAD))
    one, _, status = run_cli(["--workload", str(path), "--format", "json", "--requests"])
    two, _, _ = run_cli(["--workload", str(path), "--format", "json", "--requests"])
    assert status == 0 and one == two
    path.write_text(yaml.safe_dump(dict(WORKLOAD, seed=5)))
    three, _, _ = run_cli(["--workload", str(path), "--format", "json", "--requests"])
    assert three != one
    summary = json.loads(one.splitlines()[-1])
    assert summary["rows"][0]["swaps"] > 0


def test_workload_swap_cost_applies_to_every_load():
    workload = parse_workload({"duration": 10, "seed": 0, "classes": [
        {"name": "x", "rate": 1, "models": {"A": 1, "B": 1}, "run": {"fixed": 1}, "swap": 3}]})
    records = generate(workload)
    from llamaswap.simulate.workload import costs

    sim = simulate(prepare(records), Policy.serial(aging_divisor_s=60, swap_affinity_bonus=0),
                   costs(workload, records))
    for result in sim.results:
        assert result.release_ns - result.start_ns == (4 if result.model_load else 1) * 1_000_000_000


@pytest.mark.parametrize("change, message", [
    ({"duration": 0}, "duration: must be positive, got 0"),
    ({"seed": "x"}, "seed: must be an integer"),
    ({"classes": []}, "classes: must be a non-empty list"),
    ({"durration": 5}, "durration: unknown key; did you mean 'duration'?"),
])
def test_workload_top_level_errors(change, message):
    with pytest.raises(ValueError) as caught:
        parse_workload({**WORKLOAD, **change})
    assert message in str(caught.value)


def test_workload_errors_name_their_key_paths(tmp_path):
    import yaml

    bad = {"duration": 60, "classes": [
        {"name": "a", "rate": -1, "prioritty": 5, "models": {"m": 0}, "run": {"gaussian": 3}},
        {"name": "b", "rate": 1, "priority": "urgent", "models": "m",
         "run": {"lognormal": {"median": 2}}, "patience": {"uniform": [5, 1]}},
        {"name": "b", "rate": 1, "models": ["m"], "run": {"fixed": True}},
    ]}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad, sort_keys=False))
    _, err, status = run_cli(["--workload", str(path)])
    assert status == 2
    for expected in [
        "error: classes[0].prioritty: unknown key; did you mean 'priority'?",
        "error: classes[0].rate: must be positive, got -1",
        "error: classes[0].models.m: must be positive, got 0",
        "error: classes[0].run.gaussian: unknown key",
        "error: classes[1].priority: must be an integer or interactive / normal / batch, got a string 'urgent'",
        "error: classes[1].run.lognormal.sigma: is required",
        "error: classes[1].patience.uniform: A must not exceed B, got [5, 1]",
        "error: classes[2].name: 'b' is used by another class",
        "error: classes[2].models: must be a model name or a mapping of model to weight, got a list",
        "error: classes[2].run.fixed: must be a number, got a boolean true",
    ]:
        assert expected in err, err
    assert "Traceback" not in err


def test_workload_file_problems_exit_2(tmp_path):
    _, err, status = run_cli(["--workload", str(tmp_path / "nope.yaml")])
    assert status == 2 and "nope.yaml: cannot read the file" in err
    broken = tmp_path / "broken.yaml"
    broken.write_text("duration: [1\n")
    _, err, status = run_cli(["--workload", str(broken)])
    assert status == 2 and "broken.yaml: is not valid YAML at line" in err


# -- the estimator's measurements ---------------------------------------------------------


def test_measuring_only_the_needed_suffix_matches_feeding_everything():
    rng = random.Random(11)
    for _ in range(300):
        records = [RequestRecord("r", rng.choice(["a", "b", None]), 0, Outcome.SERVED, True, 0.0, 0.0,
                                 rng.choice([None, rng.uniform(0, 9000)]), rng.uniform(0, 20000), 0.0,
                                 rng.random() < 0.3, rng.random() < 0.1) for _ in range(rng.randint(0, 60))]
        samples = rng.randint(1, 8)
        everything = Estimator(default_run_s=10.0, default_swap_s=5.0, samples=samples)
        for r in records:
            everything.record(r.model, run_s=r.run_ms / 1000, model_load=r.model_load,
                              first_byte_s=r.first_byte_ms / 1000 if r.first_byte_ms is not None else None)
        measured = measure_costs(records, default_run_s=10.0, default_swap_s=5.0, samples=samples)
        for model in ("a", "b", None):
            assert measured.expected_run_s(model) == everything.expected_run_s(model)
            assert measured.expected_swap_s(model) == everything.expected_swap_s(model)


def test_read_activity_from_a_file(tmp_path):
    path = write_log(tmp_path / "a.log", EXACT)
    activity = read_activity(path)
    assert len(activity.requests) == len(EXACT)
    assert activity.settings[0].aging_divisor_s == 60
    assert activity.skipped == 0


# -- the plot ----------------------------------------------------------------------------


def test_plot_is_written(tmp_path):
    pytest.importorskip("matplotlib")
    target = tmp_path / "wait.png"
    _, err, status = run_cli(["--sweep", "swapAffinityBonus=0,10,20", "--sweep", "scheduler=serial,fifo",
                         "--plot", str(target)], EXACT)
    assert status == 0, err
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_says_how_to_get_it(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    _, err, status = run_cli(["--sweep", "swapAffinityBonus=0,10", "--plot", str(tmp_path / "w.png")], EXACT)
    assert status == 2
    assert "--plot needs matplotlib" in err
    assert "pip install 'llamaswap[plot]'" in err
    assert not (tmp_path / "w.png").exists()


# -- slots ------------------------------------------------------------------------------------

# Four requests of model A 1 ms apart, 4 s each, recorded at one slot: each granted as the one
# before ended (at 0, 4, 8, 12 s); the first loaded A (as it does in the replay).
SAME_MODEL = [request(f"r{i}", 0.001 * i, 0, "A", run_s=4.0, first_byte_s=0.1, load=i == 0, wait_s=4 * i - 0.001 * i)
              for i in range(4)]
S, MS = 1_000_000_000, 1_000_000


def ran(request_id: str, granted_s: float, run_s: float, *, at_s: float | None = None, max_tokens: int | None = None,
        model: str = "A", load: bool = False, priority: int = 0) -> dict:
    """A served generation as the sidecar records it: granted at ``granted_s``, run ``run_s``."""
    at_s = granted_s if at_s is None else at_s
    return dict(request(request_id, at_s, priority, model, run_s=run_s, wait_s=granted_s - at_s, load=load),
                granted_unix_ms=ORIGIN_MS + granted_s * 1000, max_tokens=max_tokens)


def records_of(documents: list[dict]) -> list[RequestRecord]:
    return list(parse_activity(format_line(d) for d in documents).requests)


def _slots_replay(slots: int, speed: str | None = None, documents: list[dict] = SAME_MODEL):
    from llamaswap.core import Slots
    from llamaswap.simulate.concurrency import ConcurrencySpeed

    records = records_of(documents)
    costs = measure_costs(records, default_run_s=10.0, default_swap_s=0.0, samples=50)
    policy = Policy.serial(aging_divisor_s=60, swap_affinity_bonus=10, slots=Slots(slots))
    return simulate(prepare(records), policy, costs,
                    concurrency_speed=ConcurrencySpeed.parse(speed) if speed else None)


def test_slots_run_several_at_once_and_one_slot_is_one_at_a_time():
    one = _slots_replay(1)
    assert [r.start_ns for r in one.results] == [0, 4 * S, 8 * S, 12 * S]
    two = _slots_replay(2)
    assert [r.start_ns for r in two.results] == [0, 1 * MS, 4 * S, 4 * S + 1 * MS]
    assert two.metrics.busy_fraction == pytest.approx(1.0)  # the GPU held throughout, not twice over


def test_concurrent_grants_share_the_gpu_by_the_concurrency_speed():
    # speed(2) = 1.6: two at once each run at 0.8 of their solo rate. x (4 s solo) alone 0..1,
    # then beside y (2 s solo): y needs 2 / 0.8 = 2.5 s, ending at 3.5, when x has 3 - 2 = 1 s
    # left, which it runs alone: it ends at 4.5.
    documents = [ran("x", 0.0, 4.0, load=True), ran("y", 1.0, 2.0)]
    sim = _slots_replay(2, "2:1.6", documents)
    assert [(r.start_ns, r.release_ns) for r in sim.results] == [(0, 4 * S + S // 2), (1 * S, 3 * S + S // 2)]
    # Without a table two at once run as fast as one each; with one slot the table changes nothing.
    assert [r.release_ns for r in _slots_replay(2, None, documents).results] == [4 * S, 3 * S]
    assert [r.release_ns for r in _slots_replay(1, "2:1.6", documents).results] == [4 * S, 6 * S]


def test_concurrency_speed_parsing_and_interpolation():
    from llamaswap.simulate.concurrency import ConcurrencySpeed, ConcurrencySpeedError

    speed = ConcurrencySpeed.parse("2:1.8,4:3.1")
    assert [speed.of(n) for n in (1, 2, 4, 8)] == [1.0, 1.8, 3.1, 3.1]  # flat after the last
    assert speed.of(3) == pytest.approx(2.45)  # linear between the points
    assert speed.rate(2) == pytest.approx(0.9)
    for bad in ("", "2", "x:1", "0:1", "2:-1", "1:2"):
        with pytest.raises(ConcurrencySpeedError):
            ConcurrencySpeed.parse(bad)


# -- the concurrency speed measured from the log ---------------------------------------------


def test_the_measured_speed_of_a_hand_made_log():
    from llamaswap.simulate.concurrency import measure

    # The case above as the sidecar would have recorded it: x asked 400 tokens, y 200, and
    # speed(2) = 1.6. x: 400 w = 2 s alone + 2.5 s x r2; y: 200 w = 2.5 s x r2. So w = 0.01 s,
    # r2 = 0.8, speed(2) = 1.6.
    measurement = measure(records_of([ran("x", 0.0, 4.5, max_tokens=400), ran("y", 1.0, 2.5, max_tokens=200)]))
    assert measurement.speed is not None and measurement.speed.points == {1: 1.0, 2: pytest.approx(1.6, rel=1e-12)}
    assert (measurement.generations, measurement.concurrent, measurement.work) == (2, 2, "max_tokens")
    # Without max_tokens every request is one unit of work: z alone took 2 s, and so did x and y,
    # which ran 1 s of it side by side: two at once each ran as fast as one, speed(2) = 2.
    even = measure(records_of([ran("x", 0.0, 2.0), ran("y", 1.0, 2.0), ran("z", 4.0, 2.0)]))
    assert even.speed is not None and even.speed.points == {1: 1.0, 2: pytest.approx(2.0, rel=1e-12)}
    assert even.work == "requests"


def _shared_log(speed: str, slots: int, seed: int, rate: float = 1.0) -> tuple[list[dict], list[RequestRecord]]:
    """Traffic run through the engine with ``speed`` (solo runs of 10 ms per token asked), and
    the activity log the sidecar would have written of it."""
    from llamaswap.core import Slots
    from llamaswap.simulate.concurrency import ConcurrencySpeed
    from llamaswap.simulate.engine import FixedCosts

    rng = random.Random(seed)
    solo, at = [], 0.0
    for number in range(120):
        at += rng.expovariate(rate)  # 1/s: about as fast as one slot serves, all levels occur
        tokens = rng.randint(20, 150)
        solo.append(RequestRecord(f"q{number}", "A", 0, Outcome.SERVED, True, round(at * 1000, 3), None, None,
                                  tokens * 10.0, 0.0, False, False, order=number, max_tokens=tokens))
    policy = Policy.serial(aging_divisor_s=60, swap_affinity_bonus=10, slots=Slots(slots))
    sim = simulate(prepare(solo), policy, FixedCosts({}, {}, 1.0, 0.0), concurrency_speed=ConcurrencySpeed.parse(speed))
    documents = [ran(r.request.record.request_id, r.start_ns / 1e9, (r.release_ns - r.start_ns) / 1e9,
                     at_s=r.request.arrival_ns / 1e9, max_tokens=r.request.record.max_tokens, load=r.model_load)
                 for r in sorted(sim.results, key=lambda r: r.release_ns)]  # the log is in finish order
    for document in documents:  # as the sidecar rounds them: microseconds
        for key in ("arrival_unix_ms", "granted_unix_ms", "serial_queue_wait_ms", "run_ms"):
            document[key] = round(document[key], 3)
    return documents, solo


def test_a_known_speed_in_is_the_speed_measured_out():
    from llamaswap.simulate.concurrency import RecordedConcurrency, as_solo, measure

    documents, solo = _shared_log("2:1.7,3:2.2", 3, seed=3)
    records = records_of(documents)
    recorded = RecordedConcurrency.of(records)
    assert recorded.peak == 3
    measurement = measure(records, recorded)
    assert measurement.speed is not None
    # Exact to the microseconds the log keeps.
    assert measurement.speed.points == {1: 1.0, 2: pytest.approx(1.7, rel=1e-5), 3: pytest.approx(2.2, rel=1e-5)}
    assert measurement.concurrent > 0 and measurement.generations == len(records) - 1  # the first loaded A
    # The recorded runs turned back into solo time are the runs the engine was given.
    back = {r.request_id: r.run_ms for r in as_solo(records, recorded, measurement.speed)}
    assert back == {r.request_id: pytest.approx(r.run_ms, abs=0.01) for r in solo}


def _requests_file(argv: list[str], documents: list[dict]) -> dict[str, float]:
    target = _LOG_DIR[0] / "requests.jsonl"
    run_json([*argv, "--requests", str(target)], documents)
    return {line["request_id"]: line["wait_ms"] for line in map(json.loads, target.read_text().splitlines())}


def test_the_replay_of_concurrent_traffic_with_its_measured_speed_waits_as_recorded():
    documents, solo = _shared_log("2:1.5,3:1.8", 3, seed=4, rate=1.8)  # a queue builds: waits
    document = run_json(["--slots", "3"], documents)
    assert document["concurrency_speed"]["source"] == "measured"
    assert document["concurrency_speed"]["points"] == {"1": 1.0, "2": pytest.approx(1.5, rel=1e-4),
                                                      "3": pytest.approx(1.8, rel=1e-4)}
    waits = _requests_file(["--slots", "3"], documents)
    assert sum(waits.values()) > 10_000
    assert waits == {d["request_id"]: pytest.approx(d["serial_queue_wait_ms"], abs=0.01) for d in documents}
    # What two slots would have done: the engine given the true solo runs and speed says...
    from llamaswap.core import Slots
    from llamaswap.simulate.concurrency import ConcurrencySpeed
    from llamaswap.simulate.engine import FixedCosts

    truth = simulate(prepare(solo), Policy.serial(aging_divisor_s=60, swap_affinity_bonus=10, slots=Slots(2)),
                     FixedCosts({}, {}, 1.0, 0.0), concurrency_speed=ConcurrencySpeed.parse("2:1.5,3:1.8"))
    expected = {r.request.record.request_id: r.wait_ns / 1e6 for r in truth.results}
    # ...and the log's replay with its measured speed says the same; taken linear, it does not.
    assert _requests_file(["--slots", "2"], documents) == {k: pytest.approx(v, abs=0.05) for k, v in expected.items()}
    linear = _requests_file(["--slots", "2", "--concurrency-speed", "2:2,3:3"], documents)
    assert max(abs(linear[k] - v) for k, v in expected.items()) > 100


def test_the_table_line_says_which_speed_ran_and_where_it_came_from():
    documents, _ = _shared_log("2:1.6", 2, seed=5)
    out, _, status = run_cli(["--slots", "2"], documents)
    assert status == 0
    line = next(line for line in out.splitlines() if line.startswith("concurrency speed"))
    assert line.startswith("concurrency speed 1:1,2:1.6 (measured from ")
    assert "generations, work in max_tokens)" in line
    out, _, _ = run_cli(["--slots", "2", "--concurrency-speed", "2:1.9"], documents)
    line = next(line for line in out.splitlines() if line.startswith("concurrency speed"))
    assert line.startswith("concurrency speed 1:1,2:1.9 (given --concurrency-speed; the log measured 1:1,2:1.6 from ")


def test_a_log_without_concurrent_runs_gives_the_given_table_or_linear():
    linear = run_json(["--slots", "2"], SAME_MODEL)["concurrency_speed"]
    assert linear == {"points": {}, "source": "linear",
                      "detail": "n at once run as fast as one each; no two generations ran at once"}
    given = run_json(["--slots", "2", "--concurrency-speed", "2:1.6"], SAME_MODEL)["concurrency_speed"]
    assert given == {"points": {"1": 1.0, "2": 1.6}, "source": "given",
                     "detail": "--concurrency-speed; the log measured nothing: no two generations ran at once"}


def test_runs_that_never_ran_alone_cannot_be_measured():
    from llamaswap.simulate.concurrency import measure

    # Two at once throughout: twice the work or half the speed, the log cannot tell.
    measurement = measure(records_of([ran("x", 0.0, 4.0), ran("y", 0.0, 4.0), ran("w", 0.0, 1.0, load=True)]))
    assert measurement.speed is None and "cannot tell concurrency from run length" in measurement.why


def test_a_grant_as_another_ends_is_no_overlap():
    from llamaswap.simulate.concurrency import RecordedConcurrency

    # Rounded on their own, y's grant lands a microsecond before x's end.
    records = records_of([ran("x", 0.0, 1.0), dict(ran("y", 0.999999, 1.0))])
    assert RecordedConcurrency.of(records).peak == 1


def test_the_slots_flags():
    one = run_json([], SAME_MODEL)
    two = run_json(["--slots", "2"], SAME_MODEL)
    assert one["rows"][0]["bands"]["normal"]["wait_max_s"] == pytest.approx(12.0, abs=0.01)
    assert two["rows"][0]["bands"]["normal"]["wait_max_s"] == pytest.approx(4.0, abs=0.01)
    assert two["rows"][0]["settings"]["slots"] == 2
    # Two at once no faster than one: r0 and r1 share the GPU for 8 s, and so on.
    slower = run_json(["--slots", "2", "--concurrency-speed", "1:1,2:1"], SAME_MODEL)
    assert slower["rows"][0]["bands"]["normal"]["wait_max_s"] == pytest.approx(8.0, abs=0.01)
    _, err, status = run_cli(["--slots", "0"], SAME_MODEL)
    assert status == 2 and "error: --slots 0: must be an integer >= 1, got 0" in err
    with pytest.raises(SystemExit):
        run_cli(["--concurrency-speed", "fast"], SAME_MODEL)


# -- slots in a sweep -------------------------------------------------------------------------


def test_sweep_slots_with_another_key():
    document = run_json(["--sweep", "slots=1,2,4", "--sweep", "swapAffinityBonus=0,10"], SAME_MODEL)
    assert document["swept"] == ["slots", "swapAffinityBonus"]
    rows = document["rows"]
    assert [(r["settings"]["slots"], r["settings"]["swapAffinityBonus"]) for r in rows] == [
        (1, 0), (1, 10), (2, 0), (2, 10), (4, 0), (4, 10)]
    # One slot: the last waits 12 s; two: 4 s; four: all at once.
    assert [r["bands"]["normal"]["wait_max_s"] for r in rows] == pytest.approx([12.0, 12.0, 4.0, 4.0, 0.0, 0.0],
                                                                               abs=0.01)
    out, _, status = run_cli(["--sweep", "slots=1,2"], SAME_MODEL)
    assert status == 0
    assert "fixed settings: scheduler serial, agingDivisor 60, swapAffinityBonus 10, maxQueued 0, maxWaitSeconds 0, " \
           "reservedSlots 0" in out
    body = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert [cells[0] for cells in body] == ["1", "2"]


def test_sweep_reserved_slots_keeps_slots_for_the_interactive_band():
    # Three batch jobs of 4 s at 0, then an interactive one of 1 s at 1 s, recorded at one slot
    # (b0 0..4, i 4..5, b1 5..9, b2 9..13). Slots 2: b0 and b1 take both, and i waits for b0 to
    # end (3 s). One reserved: the batch jobs use one slot and i starts at once.
    documents = [ran("b0", 0.0, 4.0, load=True, priority=-100), ran("i", 4.0, 1.0, at_s=1.0, priority=100),
                 ran("b1", 5.0, 4.0, at_s=0.001, priority=-100), ran("b2", 9.0, 4.0, at_s=0.002, priority=-100)]
    rows = run_json(["--slots", "2", "--sweep", "reservedSlots=0,1"], documents)["rows"]
    assert [r["settings"]["reservedSlots"] for r in rows] == [0, 1]
    assert [r["bands"]["interactive"]["wait_max_s"] for r in rows] == pytest.approx([3.0, 0.0], abs=0.01)


def test_reserved_slots_must_fit_the_slots():
    _, err, status = run_cli(["--sweep", "slots=1,2", "--reserved-slots", "1"], SAME_MODEL)
    assert status == 2
    assert "error: reservedSlots 1 with slots 1 leaves no slot for non-interactive requests" in err
    _, err, status = run_cli(["--reserved-slots", "-1"], SAME_MODEL)
    assert status == 2 and "error: --reserved-slots -1: must be 0 (none reserved) or more" in err


def test_reserved_slots_from_the_configuration_are_lowered_to_fit(tmp_path):
    config = tmp_path / "llamaswap.yaml"
    config.write_text("upstream:\n  slots: 4\nmodels:\n  A:\n    slots: 3\nrouting:\n  scheduler:\n    settings:\n"
                      "      serial:\n        reservedSlots: 2\n")
    values = run_json(["-c", str(config)], SAME_MODEL)["rows"][0]["settings"]
    assert (values["slots"], values["reservedSlots"], values["modelSlots"]) == (4, 2, {"A": 3})
    out, _, status = run_cli(["-c", str(config), "--sweep", "slots=1,2,4"], SAME_MODEL)
    assert status == 0
    assert "reservedSlots 2 (recorded or -c) is lowered to fit: 0 at slots 1, 1 at slots 2" in out
    rows = run_json(["-c", str(config), "--sweep", "slots=1,2,4"], SAME_MODEL)["rows"]
    # A flag's or a sweep's slots are every model's: A's 3 gives way.
    assert [(r["settings"]["slots"], r["settings"]["reservedSlots"], r["settings"]["modelSlots"]) for r in rows] == [
        (1, 0, {}), (2, 1, {}), (4, 2, {})]


def test_models_slots_of_a_single_model_upstream_key_on_its_one_model(tmp_path):
    """With -c, models.<id>.slots apply as the sidecar applied them (issue 26, `config.model_key`):
    on a single-model upstream the log keys every request on its one model, and an entry under
    the name the clients send describes that model. A router's log keeps the ids as written."""
    config = tmp_path / "llamaswap.yaml"
    config.write_text("upstream:\n  slots: 1\nmodels:\n  chat:\n    slots: 3\n")
    single = [dict(r, model="chat", scheduled_model="the-model.gguf") for r in SAME_MODEL]
    values = run_json(["-c", str(config)], single)["rows"][0]["settings"]
    assert (values["slots"], values["modelSlots"]) == (1, {"the-model.gguf": 3})
    routed = [dict(r, model="chat") for r in SAME_MODEL]
    assert run_json(["-c", str(config)], routed)["rows"][0]["settings"]["modelSlots"] == {"chat": 3}


def test_slots_from_the_settings_record_and_a_note_when_the_log_ran_more_at_once():
    documents, _ = _shared_log("2:1.6", 2, seed=6)
    out, _, _ = run_cli([], documents)
    assert "the log ran up to 2 requests at once, the simulation 1 at most" in out
    recorded = run_json([], documents, settings=dict(SETTINGS, slots=2, reserved_slots=1))
    assert (recorded["rows"][0]["settings"]["slots"], recorded["rows"][0]["settings"]["reservedSlots"]) == (2, 1)


def test_plot_against_slots(tmp_path):
    pytest.importorskip("matplotlib")
    target = tmp_path / "slots.png"
    _, err, status = run_cli(["--sweep", "slots=1,2,4", "--plot", str(target)], SAME_MODEL)
    assert status == 0, err
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_replay_hands_every_object_back_to_the_collector_as_it_found_it():
    """The command pauses the cyclic collector while it reads and freezes the records while it
    replays (speed: bench/README); whatever it does, the collector is left as it was found."""
    threshold = gc.get_threshold()
    assert gc.isenabled() and gc.get_freeze_count() == 0
    run_json([], EXACT)
    assert gc.isenabled() and gc.get_freeze_count() == 0 and gc.get_threshold() == threshold
    gc.disable()  # (a caller that had it off keeps it off)
    try:
        run_json([], EXACT)
        assert not gc.isenabled() and gc.get_freeze_count() == 0
    finally:
        gc.enable()
