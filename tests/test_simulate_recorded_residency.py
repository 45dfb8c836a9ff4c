"""A replay with the residency the log was written with (issue 37): the settings record's
upstreams say each one's maxLoaded, pinned models and memory budget, and `simulate` runs with
them unless -c or --max-loaded says otherwise; the log's `eviction` records are known, not
replayed, and counted beside the replay's own evictions."""

from __future__ import annotations

import io
import json
import pathlib

from test_simulate import SETTINGS, parser, request, write_log

from llamaswap.core import PolicyName
from llamaswap.core.residency import Residency
from llamaswap.simulate.records import format_line, parse_activity
from llamaswap.simulate.settings import Settings, override

GiB = 1 << 30


def upstream(name: str = "gpu0", **residency: object) -> dict:
    return {"name": name, "slots": 1, "model_slots": {}, "models": None, **residency}


def settings(*upstreams: dict) -> dict:
    return {**SETTINGS, "slots": 1, "model_slots": {}, "reserved_slots": 0, "upstreams": list(upstreams)}


def eviction(model: str, reason: str, for_model: str) -> dict:
    return {"event": "eviction", "time": 0, "upstream": "gpu0", "model": model, "reason": reason,
            "for_model": for_model, "request_id": "r", "trace_id": None, "serial_priority": 0,
            "serial_band": "normal", "granted_unix_ms": 0}


# One request at a time, round A, B, C, A, B, C, ...: with 2 resident every load past the second
# evicts one; with 3 none does.
ROUND = [{**request(f"r{i}", i * 10.0, 0, "ABC"[i % 3], run_s=1.0, first_byte_s=0.1, load=i < 3),
          "upstream": "gpu0"} for i in range(9)]
RECORDED = settings(upstream(max_loaded=2, pinned=[], memory_bytes=None, model_bytes={}))


def run(tmp_path: pathlib.Path, argv: list[str], *, recorded: dict = RECORDED,
        extra: list[str] = ()) -> tuple[str, str, int]:
    log = write_log(tmp_path / "activity.log", ROUND, settings=recorded, extra=list(extra))
    out, err = io.StringIO(), io.StringIO()
    args = parser().parse_args(["simulate", "--activity", str(log), *argv])
    status = args.run(args, out=out, err=err)
    return out.getvalue(), err.getvalue(), status


def run_json(tmp_path: pathlib.Path, argv: list[str], **kwargs: object) -> dict:
    out, err, status = run(tmp_path, ["--format", "json", *argv], **kwargs)  # type: ignore[arg-type]
    assert status == 0, err
    return json.loads(out)


def test_the_settings_record_gives_each_upstreams_residency() -> None:
    record = settings(upstream("big", max_loaded=3, pinned=["B"], memory_bytes=80 * GiB,
                               model_bytes={"A": 40 * GiB, "B": GiB}),
                      upstream("small"))  # an entry of an older log: one model at a time
    (parsed,) = parse_activity([format_line(record)]).settings
    assert parsed.residency == {"big": Residency(3, frozenset({"B"}), 80 * GiB, {"A": 40 * GiB, "B": GiB}),
                                "small": Residency()}
    (older,) = parse_activity([format_line(SETTINGS)]).settings  # no upstreams at all
    assert older.residency is None
    base = Settings(PolicyName.SERIAL, 60, 10, 0, 0, {}, gpus=2, named_gpus=("big", "small")).with_recorded(parsed)
    assert base.max_loaded == 3  # the first upstream's, as for -c FILE
    assert [gpu.residency for gpu in base.policy().gpus] == [
        Residency(3, frozenset({"B"}), 80 * GiB, {"A": 40 * GiB, "B": GiB}), Residency()]
    # A flag's maxLoaded is every GPU's, the recorded pins and budget kept.
    assert [gpu.residency for gpu in override(base, {"maxLoaded": "2"}).policy().gpus] == [
        Residency(2, frozenset({"B"}), 80 * GiB, {"A": 40 * GiB, "B": GiB}), Residency(2)]
    # --gpus N names them gpu0..: each keeps the recorded maxLoaded, not the pins or a budget.
    assert [gpu.residency for gpu in override(base, {"gpus": "2"}).policy().gpus] == [Residency(3), Residency(3)]


def test_an_unusable_upstream_entry_makes_the_record_unusable() -> None:
    activity = parse_activity([format_line(settings(upstream(max_loaded=0))),
                               format_line(settings(upstream(pinned="B")))])
    assert activity.settings == () and activity.malformed == 2
    assert activity.first_problem == "line 1: upstream gpu0: max_loaded is below 1: 0"


def test_eviction_records_are_known_and_counted_by_reason_not_skipped() -> None:
    lines = [format_line(d) for d in (eviction("A", "least_recently_used", "C"),
                                      eviction("B", "least_recently_used", "A"),
                                      eviction("C", "least_needed", "B"), {"event": "eviction"})]
    activity = parse_activity(["junk\n", *lines])
    assert activity.evictions == {"least_recently_used": 2, "least_needed": 1}
    assert activity.skipped == 1 and activity.malformed == 1  # the junk line; the record without a reason


def test_a_log_replays_with_the_max_loaded_it_was_written_with(tmp_path: pathlib.Path) -> None:
    document = run_json(tmp_path, [])
    (row,) = document["rows"]
    assert row["settings"]["maxLoaded"] == 2
    assert sum(row["evictions"].values()) == 7 and row["swaps"] == 9  # every load past the first two
    # An older log (no residency in its settings): one model at a time, swaps and no eviction.
    (row,) = run_json(tmp_path, [], recorded=settings(upstream()))["rows"]
    assert row["settings"]["maxLoaded"] == 1 and sum(row["evictions"].values()) == 0 and row["swaps"] == 9


def test_the_flag_and_the_sweep_override_the_recorded_max_loaded(tmp_path: pathlib.Path) -> None:
    document = run_json(tmp_path, ["--sweep", "maxLoaded=1,2,3"])
    assert [(row["settings"]["maxLoaded"], sum(row["evictions"].values()), row["swaps"])
            for row in document["rows"]] == [(1, 0, 9), (2, 7, 9), (3, 0, 3)]


def test_recorded_pins_above_the_flag_are_refused(tmp_path: pathlib.Path) -> None:
    recorded = settings(upstream(max_loaded=3, pinned=["A", "B"], memory_bytes=None, model_bytes={}))
    out, err, status = run(tmp_path, ["--max-loaded", "1"], recorded=recorded)
    assert status == 0, err
    out, err, status = run(tmp_path, ["--max-loaded", "2"], recorded=recorded)
    assert status == 0, err
    out, err, status = run(tmp_path, ["--sweep", "maxLoaded=1,3"], recorded=settings(
        upstream(max_loaded=4, pinned=["A", "B", "C", "D"], memory_bytes=None, model_bytes={})))
    assert status == 2
    assert "maxLoaded 3: gpu0 pins 4 models (A, B, C, D) in the log's settings record" in err


def test_the_report_puts_the_replays_evictions_beside_the_recorded(tmp_path: pathlib.Path) -> None:
    extra = [format_line(eviction("A", "least_recently_used", "C")), format_line(eviction("B", "least_needed", "A"))]
    document = run_json(tmp_path, [], extra=extra)
    assert document["recorded_evictions"] == {"least_recently_used": 1, "least_needed": 1}
    assert document["skipped_lines"] == 0
    out, err, status = run(tmp_path, ["--sweep", "maxLoaded=1,2"], extra=extra)
    assert status == 0, err
    assert "other lines skipped" not in out
    lines = out.splitlines()
    header = next(line for line in lines if "swaps" in line and "evictions" in line)
    assert header.split().index("evictions") == header.split().index("swaps") + 1
    assert "evictions: recorded 2 (least_needed 1, least_recently_used 1)" in lines
    assert "row 1: evictions 0" in lines
    assert any(line.startswith("row 2: evictions 7 (") for line in lines)
    # One model at a time, nothing recorded: no column, as before.
    out, err, status = run(tmp_path, ["--max-loaded", "1"])
    assert status == 0, err
    assert "evictions" not in out
