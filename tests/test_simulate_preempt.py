"""`llamaswap simulate --preempt` (issue 46): Batch API lines stopped for a higher band and
resumed where they stopped, in the replay; the records' `batch_line`, a workload's `stoppable`,
the flags and the report.

Every expected time is worked out by hand in the comments next to it. A stopped line keeps the
work it did; resumed, it holds its load (if any), 5% of the work done (reading its kept tokens
again, `stopping.REREAD_SHARE`), then the work left.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import pathlib

import pytest

from llamaswap.commands import simulate as cli
from llamaswap.core import Outcome, Policy, Priority, PrioritySource, Slots
from llamaswap.simulate.concurrency import ConcurrencySpeed
from llamaswap.simulate.engine import FixedCosts, prepare, simulate
from llamaswap.simulate.records import RequestRecord, format_line, parse_activity, request_document
from llamaswap.simulate.inversion import worst_inversion
from llamaswap.simulate.results import Request, Result, Simulation, StopMetrics
from llamaswap.simulate.stopping import REREAD_SHARE
from llamaswap.simulate.workload import WorkloadError, generate, parse_workload

S = 1_000_000_000
BATCH, NORMAL, PERSON = -100, 0, 100
ORIGIN_MS = 1_764_580_000_000.0


def arrival(request_id: str, at_s: float, model: str, priority: int, run_s: float, *, line: bool = False,
            order: int = 0) -> RequestRecord:
    """A request recorded as run warm for ``run_s`` (no load, no settle)."""
    return RequestRecord(request_id, model, priority, Outcome.SERVED, True, ORIGIN_MS + at_s * 1000, 0.0, None,
                         run_s * 1000, 0.0, False, False, order=order, batch_line=line)


def policy(*, slots: int = 1, min_run_s: float = 0.0) -> Policy:
    return dataclasses.replace(Policy.serial(aging_divisor_s=0, swap_affinity_bonus=0, slots=Slots(slots)),
                               stop_min_run_s=min_run_s)


def run(records: list[RequestRecord], costs: FixedCosts | None = None, *, preempt: bool = True,
        speed: ConcurrencySpeed | None = None, **kwargs: float) -> Simulation:
    return simulate(prepare(records), policy(**kwargs), costs or FixedCosts({}, {}), preempt=preempt,  # type: ignore[arg-type]
                    concurrency_speed=speed)


def by_id(simulation: Simulation) -> dict[str, tuple[int | None, int | None, int]]:
    """Each request's (grant, end, stops), times from the first arrival."""
    return {r.request.record.request_id: (r.start_ns, r.release_ns, r.stops) for r in simulation.results}


# A line of 10 s running alone; a person of 2 s arrives at 4 s, on the same model.
LINE_AND_PERSON = [arrival("line", 0, "A", BATCH, 10.0, line=True, order=0),
                   arrival("person", 4, "A", PERSON, 2.0, order=1)]


def test_a_person_stops_the_line_which_resumes_after_it_with_its_work_left_and_the_reread():
    simulation = run(LINE_AND_PERSON)
    # t=4: the person starts nowhere, the line is stopped, 4 s of its 10 done; the person runs
    # 4..6; the line resumes at 6 with 6 s left plus 5% of the 4 s done: 6.2 s, ending at 12.2.
    assert REREAD_SHARE == 0.05
    assert by_id(simulation) == {"line": (0, 12_200_000_000, 1), "person": (4 * S, 6 * S, 0)}
    line = simulation.results[0]
    assert line.parts == [(0, 4 * S)] and line.part_start_ns == 6 * S
    assert line.held() == [(0, 4 * S), (6 * S, 12_200_000_000)]
    assert line.grant == 0 and line.outcome is Outcome.SERVED  # its first grant; it ends served
    metrics = simulation.metrics
    assert metrics.stops == StopMetrics(1, {"interactive": 0, "normal": 0, "batch": 1}, 1)
    assert metrics.bands["interactive"].wait_max_s == 0.0  # granted as it arrived
    assert metrics.bands["batch"].wait_max_s == 0.0  # a line's wait is to its first grant
    assert metrics.busy_fraction == 1.0  # the GPU never idled: 12.2 s held of 12.2


def test_without_preempt_the_person_waits_for_the_line_and_nothing_is_stopped():
    simulation = run(LINE_AND_PERSON, preempt=False)
    assert by_id(simulation) == {"line": (0, 10 * S, 0), "person": (10 * S, 12 * S, 0)}
    assert simulation.metrics.stops is None
    assert simulation.metrics.bands["interactive"].wait_max_s == 6.0


def test_without_preempt_a_log_with_lines_replays_as_one_without_them():
    records = [arrival("line-1", 0, "A", BATCH, 10.0, line=True, order=0),
               arrival("person", 4, "B", PERSON, 2.0, order=1),
               arrival("line-2", 5, "A", NORMAL, 3.0, line=True, order=2),
               arrival("client", 6, "A", BATCH, 1.0, order=3)]
    plain = [dataclasses.replace(record, batch_line=False) for record in records]
    costs = FixedCosts({}, {"A": 2.0, "B": 3.0})
    assert run(records, costs, preempt=False).metrics == run(plain, costs, preempt=False).metrics
    assert by_id(run(records, costs, preempt=False)) == by_id(run(plain, costs, preempt=False))
    # And with --preempt, requests that are no lines are never stopped.
    assert by_id(run(plain, costs)) == by_id(run(plain, costs, preempt=False))
    assert run(plain, costs).metrics.stops == StopMetrics(0, {"interactive": 0, "normal": 0, "batch": 0}, 0)


def test_a_line_the_runtime_stopped_is_one_request_of_the_replay():
    """A log recorded with stopping has a record per part of a stopped line (one request id, the
    first part `stopped`): replayed, the line is one request again, with its first part's
    arrival and every part's run, whether or not the replay stops lines itself."""
    stopped = dataclasses.replace(arrival("line", 0, "A", BATCH, 4.0, line=True, order=0), outcome=Outcome.STOPPED)
    person = arrival("person", 4, "A", PERSON, 2.0, order=1)
    # The runtime sent the line again at 4 s; it waited 2 s behind the person, then ran its 6 s
    # left and 0.2 s reading its 4 s of tokens again.
    resumed = dataclasses.replace(arrival("line", 4, "A", BATCH, 6.2, line=True, order=2), queue_wait_ms=2000.0)
    requests = prepare([stopped, person, resumed]).requests
    assert [(r.record.request_id, r.arrival_ns, r.run_ns, r.granted_outcome) for r in requests] == [
        ("line", 0, 10_200_000_000, Outcome.SERVED), ("person", 4 * S, 2 * S, Outcome.SERVED)]
    assert requests[0].record.queue_wait_ms == 0.0  # its wait is to its first grant
    # Without stopping the person waits for the whole line; with it, the replay stops the line at
    # 4 s (4 s done) and resumes it at 6 s: 6.2 s left and 0.2 s reading the 4 s again.
    assert by_id(run([stopped, person, resumed], preempt=False)) == {
        "line": (0, 10_200_000_000, 0), "person": (10_200_000_000, 12_200_000_000, 0)}
    assert by_id(run([stopped, person, resumed])) == {"line": (0, 12_400_000_000, 1), "person": (4 * S, 6 * S, 0)}


def test_only_a_stopped_line_s_parts_are_one_request():
    """A client's requests that share an id stay apart, as do two lines' records; a line stopped
    and never resumed within the log replays what it ran, and ends stopped."""
    client = [arrival("same", 0, "A", NORMAL, 1.0, order=0), arrival("same", 2, "A", NORMAL, 1.0, order=1)]
    assert [r.arrival_ns for r in prepare(client).requests] == [0, 2 * S]
    stopped = dataclasses.replace(arrival("cut", 0, "A", BATCH, 3.0, line=True, order=0), outcome=Outcome.STOPPED)
    other = arrival("other", 1, "A", BATCH, 1.0, line=True, order=1)
    requests = prepare([stopped, other]).requests
    assert [(r.record.request_id, r.run_ns, r.granted_outcome) for r in requests] == [
        ("cut", 3 * S, Outcome.STOPPED), ("other", S, Outcome.SERVED)]


def test_a_person_on_another_model_stops_the_line_which_loads_its_model_again_to_resume():
    # A loads in 2 s, B in 3 s; one model at a time. t=0: the line loads A: holds 2 + 10 until 12.
    costs = FixedCosts({}, {"A": 2.0, "B": 3.0})
    records = [arrival("line", 0, "A", BATCH, 10.0, line=True, order=0),
               arrival("person", 5, "B", PERSON, 1.0, order=1)]
    simulation = run(records, costs)
    # t=5: the line has run 3 s past its load: 7 s left. The person loads B: 3 + 1, until 9.
    # t=9: the line loads A again (2 s), reads its 3 s done again (0.15 s), runs 7 s: until 18.15.
    assert by_id(simulation) == {"line": (0, 18_150_000_000, 1), "person": (5 * S, 9 * S, 0)}
    assert simulation.metrics.swaps == 3
    assert [r.model_load for r in simulation.results] == [True, True]


def test_a_line_stopped_during_its_load_keeps_no_work():
    costs = FixedCosts({}, {"A": 2.0, "B": 3.0})
    records = [arrival("line", 0, "A", BATCH, 10.0, line=True, order=0),
               arrival("person", 1, "B", PERSON, 1.0, order=1)]
    # t=1: still loading A: nothing done. The person holds 1..5; the line loads A again and
    # runs all 10 s (nothing to read again): 5..17.
    assert by_id(run(records, costs)) == {"line": (0, 17 * S, 1), "person": (1 * S, 5 * S, 0)}


def test_a_resumed_line_runs_its_minimum_before_it_is_stopped_again():
    records = [arrival("line", 0, "A", NORMAL, 10.0, line=True, order=0),
               arrival("person-1", 2, "A", PERSON, 1.0, order=1),
               arrival("person-2", 5, "A", PERSON, 1.0, order=2)]
    # minRun 5 holds a resumed line only. t=2: its first part stopped at once (2 done, 8 left);
    # person-1 2..3; the line resumes at 3 with 0.1 + 8. t=5: it has run 2 s of 5: person-2
    # waits; the replay asks again at 8, when it has: 4.9 done (6.9 in all), 3.1 left; person-2
    # 8..9; the line resumes with 5% of 6.9 (0.345) + 3.1: 9..12.445.
    simulation = run(records, min_run_s=5.0)
    assert by_id(simulation) == {"line": (0, 12_445_000_000, 2), "person-1": (2 * S, 3 * S, 0),
                                 "person-2": (8 * S, 9 * S, 0)}


def test_a_resumed_line_keeps_its_first_arrival_ahead_of_a_later_line():
    records = [arrival("line-1", 0, "A", BATCH, 10.0, line=True, order=0),
               arrival("line-2", 1, "A", BATCH, 3.0, line=True, order=1),
               arrival("person", 4, "A", PERSON, 2.0, order=2)]
    # t=4: line-1 stopped (4 s done); the person runs 4..6. line-1 arrived first: it resumes at
    # 6 before line-2, which waited since 1: 6.2 s until 12.2, then line-2 12.2..15.2.
    assert by_id(run(records)) == {"line-1": (0, 12_200_000_000, 1), "line-2": (12_200_000_000, 15_200_000_000, 0),
                                   "person": (4 * S, 6 * S, 0)}


def test_of_two_lines_sharing_the_gpu_one_is_stopped_and_each_keeps_its_progress():
    # Two slots; two at once run at an aggregate speed of 1 (each at half its rate alone).
    speed = ConcurrencySpeed.parse("1:1,2:1")
    records = [arrival("line-1", 0, "A", BATCH, 10.0, line=True, order=0),
               arrival("line-2", 0, "A", BATCH, 10.0, line=True, order=1),
               arrival("person", 4, "A", PERSON, 1.0, order=2)]
    simulation = run(records, speed=speed, slots=2)
    # t=4: each has done 2 s. Both started at 0: the first granted (line-1) is stopped, 8 s left.
    # The person and line-2 run at half rate: the person's 1 s ends at 6, line-2 has 7 s left.
    # t=6: line-1 resumes with 8 + 0.1 s; at half rate line-2 ends at 20 and line-1 has 1.1 s
    # left, alone at full rate: it ends at 21.1.
    assert by_id(simulation) == {"line-1": (0, 21_100_000_000, 1), "line-2": (0, 20 * S, 0),
                                 "person": (4 * S, 6 * S, 0)}
    assert simulation.metrics.stops == StopMetrics(1, {"interactive": 0, "normal": 0, "batch": 1}, 1)


def test_a_line_stopped_twice_counts_its_stops_and_reads_all_its_work_done_again():
    records = [arrival("line", 0, "A", NORMAL, 10.0, line=True, order=0),
               arrival("person-1", 2, "A", PERSON, 1.0, order=1),
               arrival("person-2", 5, "A", PERSON, 1.0, order=2)]
    # t=2: stopped (2 done, 8 left); person-1 2..3; the line resumes 3 with 0.1 + 8.
    # t=5: 2 s of that part run, 0.1 of them the re-read: 1.9 done, 6.1 left (3.9 done in all);
    # person-2 5..6; the line resumes with 0.195 + 6.1: 6..12.295.
    simulation = run(records)
    assert by_id(simulation) == {"line": (0, 12_295_000_000, 2), "person-1": (2 * S, 3 * S, 0),
                                 "person-2": (5 * S, 6 * S, 0)}
    assert simulation.results[0].parts == [(0, 2 * S), (3 * S, 5 * S)]
    assert simulation.metrics.stops == StopMetrics(2, {"interactive": 0, "normal": 2, "batch": 0}, 1)


def test_the_inversion_counts_a_stopped_line_part_by_part():
    # A normal request waits 0..10 while a later batch line holds the GPU 1..3 and 5..6 (stopped
    # at 3, resumed at 5): 3 s of inversion, not the 5 s from its first grant to its end.
    def result(index: int, at_s: float, priority: int, start_s: float, end_s: float) -> Result:
        record = arrival(f"r{index}", at_s, "A", priority, 1.0, order=index)
        request = Request(index, record, round(at_s * S), Priority(priority, PrioritySource.NUMBER), None, S, 0,
                          False, Outcome.SERVED, True)
        return Result(request, Outcome.SERVED, priority, start_ns=round(start_s * S), end_ns=round(start_s * S),
                      release_ns=round(end_s * S))

    waiting = result(0, 0, NORMAL, 10, 11)
    line = result(1, 1, BATCH, 1, 6)
    line.parts, line.part_start_ns, line.stops = [(1 * S, 3 * S)], 5 * S, 1
    inversion = worst_inversion([waiting, line])
    assert inversion is not None and (inversion.request_id, inversion.seconds) == ("r0", 3.0)
    line.parts = None  # the same hold unbroken: 5 s
    assert worst_inversion([waiting, line]).seconds == 5.0  # type: ignore[union-attr]


# -- records and workloads -----------------------------------------------------------------


def test_a_record_says_batch_line_and_an_absent_field_is_a_client_s_request():
    line = request_document(arrival("line", 0, "A", BATCH, 1.0, line=True))
    plain = request_document(arrival("plain", 0, "A", BATCH, 1.0))
    absent = {key: value for key, value in plain.items() if key != "batch_line"}
    bad = dict(plain, batch_line="yes")
    activity = parse_activity(format_line(d) for d in (line, plain, absent, bad))
    assert [record.batch_line for record in activity.requests] == [True, False, False]
    assert activity.malformed == 1 and activity.first_problem == "line 4: batch_line is not true or false: 'yes'"


WORKLOAD = {"duration": 600, "seed": 3, "classes": [
    {"name": "chat", "rate": 0.05, "priority": "interactive", "models": "A", "run": {"fixed": 2}},
    {"name": "lines", "rate": 0.05, "priority": "batch", "models": "A", "run": {"fixed": 30}, "stoppable": True},
]}


def test_a_stoppable_class_makes_batch_lines():
    records = generate(parse_workload(WORKLOAD))
    assert records and {r.request_id.split("-")[0]: r.batch_line for r in records} == {"chat": False, "lines": True}


@pytest.mark.parametrize(("change", "problem"), [
    ({"stoppable": "yes"}, "classes[1].stoppable: must be true or false, got a string 'yes'"),
    ({"stoppable": True, "patience": {"fixed": 5}},
     "classes[1].stoppable: a Batch API line has no client that gives up: drop patience or stoppable"),
    ({"stopable": True}, "classes[1].stopable: unknown key; did you mean 'stoppable'?"),
])
def test_a_bad_stoppable_names_its_key(change, problem):
    classes = [WORKLOAD["classes"][0], {**WORKLOAD["classes"][1], **change}]
    if "stopable" in change:
        del classes[1]["stoppable"]
    with pytest.raises(WorkloadError) as caught:
        parse_workload({**WORKLOAD, "classes": classes})
    assert caught.value.problems == [problem]


# -- the command ---------------------------------------------------------------------------


SETTINGS = {"event": "settings", "time": 1764580000.0, "scheduler": "serial", "aging_divisor_s": 0,
            "swap_affinity_bonus": 0, "max_queued": 0, "max_wait_s": 0, "model_priorities": {}}


def line_log(tmp_path: pathlib.Path) -> pathlib.Path:
    """The line and the person, recorded warm on A (granted without a load: A loaded from the start),
    one after the other."""
    line, person = LINE_AND_PERSON
    documents = [request_document(dataclasses.replace(line, granted_ms=line.arrival_ms)),
                 request_document(dataclasses.replace(person, granted_ms=line.arrival_ms + 10_000))]
    path = tmp_path / "activity.jsonl"
    path.write_text("".join(format_line(d) for d in [SETTINGS, *documents]))
    return path


def run_cli(argv: list[str]) -> tuple[str, str, int]:
    out, err = io.StringIO(), io.StringIO()
    top = argparse.ArgumentParser(prog="llamaswap")
    cli.add_parser(top.add_subparsers(dest="command", required=True))
    args = top.parse_args(["simulate", *argv])
    status = args.run(args, out=out, err=err)
    return out.getvalue(), err.getvalue(), status


def test_a_sweep_of_preempt_shows_the_person_s_wait_with_and_without_stopping(tmp_path):
    out, err, status = run_cli(["--activity", str(line_log(tmp_path)), "--format", "json", "--sweep",
                                "preempt=off,on"])
    assert status == 0, err
    report = json.loads(out)
    off, on = report["rows"]
    assert (off["settings"]["preempt"], on["settings"]["preempt"]) == (False, True)
    assert off["bands"]["interactive"]["wait_max_s"] == 6.0 and on["bands"]["interactive"]["wait_max_s"] == 0.0
    assert off["stops"] is None
    assert on["stops"] == {"total": 1, "bands": {"interactive": 0, "normal": 0, "batch": 1}, "lines": 1}
    table, _, _ = run_cli(["--activity", str(line_log(tmp_path)), "--sweep", "preempt=off,on"])
    assert "stops  stopped" in table
    assert "row 1: stopping off" in table and "row 2: stops 1 (batch 1), 1 line stopped" in table


def test_requests_lines_say_a_line_s_stops_and_end(tmp_path):
    out, err, status = run_cli(["--activity", str(line_log(tmp_path)), "--preempt", "--requests", "--format",
                                "json"])
    assert status == 0, err
    lines = {d["request_id"]: d for d in map(json.loads, out.splitlines()[:2])}
    assert (lines["line"]["stops"], lines["line"]["end_ms"]) == (1, 12200.0)
    assert (lines["person"]["stops"], lines["person"]["end_ms"], lines["person"]["wait_ms"]) == (0, 6000.0, 0.0)


def test_min_run_is_a_setting_of_the_replay(tmp_path):
    out, err, status = run_cli(["--activity", str(line_log(tmp_path)), "--preempt", "--min-run", "5",
                                "--format", "json"])
    assert status == 0, err
    row = json.loads(out)["rows"][0]
    # (A line's first part is stopped at once: the person waits for nothing.)
    assert row["settings"]["minRun"] == 5.0 and row["bands"]["interactive"]["wait_max_s"] == 0.0


def test_without_preempt_the_report_shows_no_stopping(tmp_path):
    out, err, status = run_cli(["--activity", str(line_log(tmp_path)), "--format", "json"])
    assert status == 0, err
    row = json.loads(out)["rows"][0]
    assert "stops" not in row and "preempt" not in row["settings"] and "minRun" not in row["settings"]
    table, _, _ = run_cli(["--activity", str(line_log(tmp_path))])
    settings_line = next(line for line in table.splitlines() if line.startswith("settings:"))
    assert settings_line.endswith("gpus 1, maxLoaded 1")  # no preempt, no minRun
    assert "stops" not in table and "stopping" not in table


@pytest.mark.parametrize(("argv", "message"), [
    (["--min-run", "5"], "error: minRun is how long a stopped line runs first: add --preempt or --sweep "
                         "preempt=off,on\n"),
    (["--sweep", "preempt=maybe"], "error: --sweep preempt=maybe: must be on or off, got 'maybe'\n"),
    (["--preempt", "--min-run", "-1"], "error: --min-run -1: must be 0 (stopped at once) or more seconds, got -1\n"),
    (["--preempt", "--pods", "2"], "error: --pods does not replay stopped lines: drop --preempt and --min-run\n"),
])
def test_bad_stopping_flags_exit_2_naming_the_flag(tmp_path, argv, message):
    out, err, status = run_cli(["--activity", str(line_log(tmp_path)), *argv])
    assert (status, err) == (2, message)


def test_preempt_without_a_line_says_nothing_is_stopped(tmp_path):
    path = tmp_path / "plain.jsonl"
    path.write_text("".join(format_line(d) for d in [
        SETTINGS, *(request_document(dataclasses.replace(r, batch_line=False, granted_ms=r.arrival_ms))
                    for r in LINE_AND_PERSON)]))
    out, err, status = run_cli(["--activity", str(path), "--preempt"])
    assert status == 0, err
    assert "--preempt: no request is a Batch API line" in out


def run_with(records: list[RequestRecord], **changes: float) -> Simulation:
    changed = dataclasses.replace(policy(), **changes)
    return simulate(prepare(records), changed, FixedCosts({}, {}), preempt=True)


def test_a_stopped_line_that_waits_out_max_wait_since_its_first_arrival_expires_there():
    records = [arrival("line", 0, "A", BATCH, 10.0, line=True, order=0),
               arrival("person", 4, "A", PERSON, 20.0, order=1)]
    # maxWait 12: stopped at 4, the line takes its place back (arrival 0) and waits behind the
    # person's 20 s: at 12 it has waited 12 s since it first arrived, and expires.
    simulation = run_with(records, max_wait_s=12.0)
    line = simulation.results[0]
    assert (line.outcome, line.start_ns, line.release_ns, line.stops) == (Outcome.EXPIRED, 0, 12 * S, 1)
    assert simulation.results[1].release_ns == 24 * S


def test_a_line_stopped_past_max_wait_comes_back_as_a_new_arrival():
    records = [arrival("line", 0, "A", BATCH, 20.0, line=True, order=0),
               arrival("person", 6, "A", PERSON, 2.0, order=1)]
    # maxWait 5: at its stop (6) the line's place from 0 is past it, so it is not taken back: the
    # line waits anew from 6 and resumes at 8 with 14 s left and 0.3 s to read again: until 22.3.
    simulation = run_with(records, max_wait_s=5.0)
    assert by_id(simulation) == {"line": (0, 22_300_000_000, 1), "person": (6 * S, 8 * S, 0)}
    assert simulation.results[0].outcome is Outcome.SERVED
