"""The activity log (runtime/activity.py) as an Observer of a real Coordinator (tests/flow.py).

One record per finished request, dispatched or not, with the specified `serial_*` keys and the
keys a replay reads; abandoned requests' records wait for their settle; a settings record at
start and after each reload; the file holds JSON lines only, which `llamaswap simulate` reads.
"""

from __future__ import annotations

import json
import logging
import pathlib
import random
import time

import pytest
from flow import FakeUpstream, Flow, clock, virtual_time
from llamaswap.config import parse_config
from llamaswap.core import NS_PER_S, Outcome, PolicyName
from llamaswap.runtime.activity import LOGGER_NAME, ActivityLog, thousandths
from llamaswap.runtime.ticket import ExchangeEnd
from llamaswap.simulate.records import read_activity

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
SPECIFIED = ("serial_priority", "serial_band", "serial_score", "serial_queue_wait_ms")
REPLAY = ("arrival_unix_ms", "granted_unix_ms", "first_byte_ms", "run_ms", "settle_ms", "swap", "load", "model",
          "outcome", "dispatched")
CONFIG = {"routing": {"scheduler": {"maxQueued": 2, "maxWaitSeconds": 30}}, "envoy": {"leaseSeconds": 1000}}
# An upstream's residency in the settings record with one model at a time (the default).
ONE_MODEL = {"max_loaded": 1, "pinned": [], "memory_bytes": None, "model_bytes": {}}


def lines_of(path: pathlib.Path) -> list[dict]:
    text = path.read_text(encoding="utf-8")
    assert text.endswith("\n")
    return [json.loads(line) for line in text.splitlines()]


def requests_of(path: pathlib.Path) -> list[dict]:
    return [record for record in lines_of(path) if record["event"] == "request"]


@virtual_time
async def test_a_record_per_finished_request(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "activity.jsonl"
    wall_before = time.time() * 1000
    activity = ActivityLog(clock(), path=str(path))
    wall_after = time.time() * 1000
    flow = Flow(CONFIG, observers=[activity])
    a = await flow.arrive("a", "interactive", "a", trace_parent=f"00-{TRACE_ID}-00f067aa0ba902b7-01")
    b = await flow.arrive("b", "batch", "b")
    await flow.advance(2)
    await flow.complete(a, 200, first_byte_s=0.3)
    await flow.advance(1)
    await flow.complete(b, 500)
    records = {r["request_id"]: r for r in activity.recent()}
    ra, rb = records["a"], records["b"]
    for record in (ra, rb):
        assert all(key in record for key in SPECIFIED + REPLAY)

    assert wall_before <= ra["arrival_unix_ms"] <= wall_after  # wall time, from the one clock offset
    assert {k: ra[k] for k in SPECIFIED + REPLAY if k != "arrival_unix_ms"} == {
        "serial_priority": 100, "serial_band": "interactive", "serial_score": 100.0, "serial_queue_wait_ms": 0.0,
        "granted_unix_ms": ra["arrival_unix_ms"], "first_byte_ms": 300.0, "run_ms": 2000.0, "settle_ms": 0.0,
        "swap": False, "load": True, "model": "a", "outcome": "served", "dispatched": True}
    assert (ra["event"], ra["trace_id"], ra["status"], ra["swap_affinity"], ra["aging"], ra["reordered_by"],
            ra["estimated_wait_ms"]) == ("request", TRACE_ID, 200, False, 0.0, [], None)
    assert ra["time"] == pytest.approx((ra["arrival_unix_ms"] + 2000) / 1000, abs=1e-3)

    assert {k: rb[k] for k in SPECIFIED + REPLAY if k not in ("arrival_unix_ms", "granted_unix_ms")} == {
        "serial_priority": -100, "serial_band": "batch", "serial_score": pytest.approx(-100 + 2 / 60, abs=1e-3),
        "serial_queue_wait_ms": 2000.0, "first_byte_ms": None, "run_ms": 1000.0, "settle_ms": 0.0,
        "swap": True, "load": False, "model": "b", "outcome": "upstream_error", "dispatched": True}
    assert rb["granted_unix_ms"] - rb["arrival_unix_ms"] == pytest.approx(2000, abs=1e-3)
    assert rb["arrival_unix_ms"] == ra["arrival_unix_ms"]
    assert rb["status"] == 500 and rb["trace_id"] is None
    # Estimated at the batch: a (a load, 10 + 5 s) had 14.95 s left; b waited 0.05 s by then.
    assert rb["estimated_wait_ms"] == pytest.approx(15_000)
    assert requests_of(path) == [ra, rb]  # in finish order
    assert (ra["upstream"], rb["upstream"]) == ("gpu0", "gpu0")  # the one upstream of `upstream:`
    activity.close()


@virtual_time
async def test_requests_never_granted_are_recorded_with_how_long_they_waited(tmp_path: pathlib.Path) -> None:
    activity = ActivityLog(clock())
    flow = Flow(CONFIG, observers=[activity])
    await flow.arrive("running", model="a")
    expires = await flow.arrive("expires", model="a")
    await flow.advance(10)
    leaves = await flow.arrive("leaves", "interactive", "a")
    await flow.arrive("full", model="a")  # two wait: refused
    await flow.advance(1.5)
    await flow.cancel(leaves)
    await flow.advance(18.5)
    assert expires.refusal.outcome is Outcome.EXPIRED
    flow.coordinator.stop_admitting()
    await flow.arrive("late", model="a")
    records = {r["request_id"]: r for r in activity.recent()}
    expected = {"full": ("rejected_full", 0.0), "leaves": ("cancelled_waiting", 1500.0),
                "expires": ("expired", 30_000.0), "late": ("shutdown", 0.0)}
    assert set(records) == set(expected)
    for name, (outcome, waited_ms) in expected.items():
        record = records[name]
        assert (record["outcome"], record["serial_queue_wait_ms"]) == (outcome, waited_ms), name
        assert record["dispatched"] is False
        assert (record["serial_score"], record["granted_unix_ms"], record["run_ms"], record["settle_ms"],
                record["first_byte_ms"], record["swap"], record["load"], record["status"], record["upstream"]) == (
            None, None, None, None, None, False, False, 0, None)
        assert record["time"] * 1000 == pytest.approx(record["arrival_unix_ms"] + waited_ms, abs=1)
    assert records["leaves"]["serial_priority"] == 100 and records["leaves"]["serial_band"] == "interactive"


@virtual_time
async def test_an_abandoned_requests_record_waits_for_its_settle(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "activity.jsonl"
    activity = ActivityLog(clock(), path=str(path))
    upstream = FakeUpstream(busy=True)
    flow = Flow(CONFIG, observers=[activity], upstream=upstream)
    a = await flow.arrive("a", model="a")
    await flow.advance(2)
    await flow.end(a, ExchangeEnd.CLIENT_LEFT)
    assert a.outcome is Outcome.CANCELLED_RUNNING
    assert activity.recent() == [] and requests_of(path) == []  # held until the settle ends
    await flow.advance(3)
    upstream.busy_answer = False
    await flow.advance(0.25)
    [settle] = flow.recorder.settles
    [record] = activity.recent()
    assert record["outcome"] == "cancelled_running" and record["run_ms"] == 2000.0
    assert record["settle_ms"] == pytest.approx(settle.seconds * 1000, abs=1e-3)
    assert 3000 <= record["settle_ms"] <= 3250
    assert requests_of(path) == [record]
    activity.close()


@virtual_time
async def test_close_writes_the_records_still_waiting_for_a_settle(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "activity.jsonl"
    activity = ActivityLog(clock(), path=str(path))
    flow = Flow(CONFIG, observers=[activity], upstream=FakeUpstream(busy=True))
    a = await flow.arrive("a", model="a")
    await flow.peer_gone()
    assert a.outcome is Outcome.PROXY_GONE and requests_of(path) == []
    activity.close()
    [record] = requests_of(path)
    assert record["outcome"] == "proxy_gone" and record["settle_ms"] == 0.0


@virtual_time
async def test_the_settings_at_start_and_after_each_reload(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "activity.jsonl"
    activity = ActivityLog(clock(), path=str(path))
    flow = Flow({"routing": {"scheduler": {"maxQueued": 7, "settings": {"serial": {"agingDivisor": 30}}}}},
                observers=[activity])
    await flow.advance(5)
    flow.coordinator.reconfigure(parse_config({
        "upstream": {"slots": 3},
        "routing": {"scheduler": {"use": "fifo", "maxWaitSeconds": 9, "settings": {"fifo": {"reservedSlots": 1}}}},
        "models": {"m": {"priority": 10, "slots": 2}}}))
    first, second = lines_of(path)
    assert {k: v for k, v in first.items() if k != "time"} == {
        "event": "settings", "scheduler": "serial", "aging_divisor_s": 30.0, "swap_affinity_bonus": 10,
        "max_queued": 7, "max_wait_s": 0.0, "model_priorities": {}, "slots": 1, "model_slots": {},
        "reserved_slots": 0, "upstreams": [
            {"name": "gpu0", "slots": 1, "model_slots": {}, "models": None, **ONE_MODEL}]}
    assert {k: v for k, v in second.items() if k != "time"} == {
        "event": "settings", "scheduler": "fifo", "aging_divisor_s": 0.0, "swap_affinity_bonus": 0,
        "max_queued": 0, "max_wait_s": 9.0, "model_priorities": {"m": 10}, "slots": 3, "model_slots": {"m": 2},
        "reserved_slots": 1, "upstreams": [
            {"name": "gpu0", "slots": 3, "model_slots": {"m": 2}, "models": None, **ONE_MODEL}]}
    assert second["time"] - first["time"] == pytest.approx(5, abs=1e-3)
    assert activity.recent() == []  # GET /activity lists requests
    activity.close()


@virtual_time
async def test_the_settings_say_each_upstreams_residency_for_a_replay(tmp_path: pathlib.Path) -> None:
    """Several resident (issue 37): maxLoaded, the pinned models, the budget and, with one, the
    models' sizes; the simulator reads them back as each upstream's Residency."""
    from llamaswap.core.residency import Residency

    path = tmp_path / "activity.jsonl"
    activity = ActivityLog(clock(), path=str(path))
    gib = 1 << 30
    Flow({"upstream": {"maxLoaded": 3, "memory": "80GiB"},
          "models": {"A": {"memory": "40GiB"}, "B": {"memory": "1GiB", "pinned": True}}}, observers=[activity])
    activity.close()
    (settings,) = lines_of(path)
    (upstream,) = settings["upstreams"]
    assert {k: upstream[k] for k in ONE_MODEL} == {
        "max_loaded": 3, "pinned": ["B"], "memory_bytes": 80 * gib, "model_bytes": {"A": 40 * gib, "B": gib}}
    (record,) = read_activity(path).settings
    assert record.residency == {"gpu0": Residency(3, frozenset({"B"}), 80 * gib, {"A": 40 * gib, "B": gib})}


@virtual_time
async def test_the_file_is_json_lines_only_and_the_simulator_reads_it(tmp_path: pathlib.Path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    logging.getLogger("llamaswap").warning("a line for the sidecar's log, not the activity file")
    path = tmp_path / "activity.jsonl"
    activity = ActivityLog(clock(), path=str(path))
    flow = Flow(CONFIG, observers=[activity], upstream=FakeUpstream(busy=None))
    a = await flow.arrive("a", "5", "a")
    b = await flow.arrive("b", "batch", "b")
    c = await flow.arrive("c", "junk", None)
    await flow.advance(1)
    await flow.complete(a, 200, first_byte_s=0.5)
    assert c.granted  # 0 beats batch
    await flow.advance(2)
    await flow.complete(c)
    assert b.granted
    await flow.end(b, ExchangeEnd.CLIENT_LEFT)  # a settle (unsupported: 0 s)
    d = await flow.arrive("d", None, "a")
    await flow.advance(0.5)
    await flow.complete(d, 404)
    activity.close()

    text = path.read_text(encoding="utf-8")
    for line in text.splitlines():
        assert isinstance(json.loads(line), dict), line  # nothing but JSON objects, one a line
    assert "a line for the sidecar's log" not in text
    requests = requests_of(path)
    assert requests == activity.recent()
    assert [r["request_id"] for r in requests] == ["a", "c", "b", "d"]
    # The activity logger carries the same lines (for the sidecar's own log).
    logged = [json.loads(r.getMessage()) for r in caplog.records if r.name == LOGGER_NAME]
    assert logged == lines_of(path)

    activity_read = read_activity(path)
    assert (activity_read.lines, activity_read.skipped, activity_read.malformed) == (5, 0, 0)
    [settings] = activity_read.settings
    assert settings.scheduler is PolicyName.SERIAL and settings.max_queued == 2 and settings.max_wait_s == 30.0
    replay = {r.request_id: r for r in activity_read.requests}
    for record in requests:
        parsed = replay[record["request_id"]]
        assert parsed.priority == record["serial_priority"]
        assert parsed.outcome.value == record["outcome"]
        assert parsed.dispatched == record["dispatched"]
        assert parsed.model == record["model"]
        assert parsed.arrival_ms == record["arrival_unix_ms"]
        assert parsed.queue_wait_ms == record["serial_queue_wait_ms"]
        assert parsed.first_byte_ms == record["first_byte_ms"]
        assert parsed.run_ms == record["run_ms"]
        assert parsed.settle_ms == (record["settle_ms"] or 0.0)
        assert (parsed.swap, parsed.load, parsed.status) == (record["swap"], record["load"], record["status"])
    assert replay["a"].model_load and replay["a"].first_byte_ms == 500.0 and replay["a"].run_ms == 1000.0
    assert replay["b"].outcome is Outcome.CANCELLED_RUNNING and replay["b"].swap
    assert replay["c"].priority == 0  # unparseable: 0
    assert replay["d"].status == 404


@virtual_time
async def test_recent_keeps_the_latest_records() -> None:
    activity = ActivityLog(clock(), capacity=3)
    flow = Flow(observers=[activity])
    for i in range(5):
        request = await flow.arrive(f"r{i}", model="a")
        await flow.complete(request)
    assert [r["request_id"] for r in activity.recent()] == ["r2", "r3", "r4"]
    assert [r["request_id"] for r in activity.recent(2)] == ["r3", "r4"]
    none_kept = ActivityLog(clock(), capacity=0)
    none_kept.finished(flow.requests["r0"].ticket)
    assert none_kept.recent() == []


@virtual_time
async def test_the_record_says_how_many_slots_were_busy_at_its_grant() -> None:
    activity = ActivityLog(clock())
    flow = Flow({"upstream": {"slots": 2}, "envoy": {"leaseSeconds": 1000}}, observers=[activity])
    a = await flow.arrive("a", None, "a")
    b = await flow.arrive("b", None, "a")
    c = await flow.arrive("c", None, "a")
    await flow.cancel(c)
    await flow.complete(a)
    await flow.complete(b)
    records = {r["request_id"]: r for r in activity.recent() if r.get("event") == "request"}
    assert {rid: r["serial_slots_busy"] for rid, r in records.items()} == {"a": 1, "b": 2, "c": None}
    assert {rid: r["upstream"] for rid, r in records.items()} == {"a": "gpu0", "b": "gpu0", "c": None}


def test_each_dispatch_record_names_the_upstream_it_ran_on(tmp_path: pathlib.Path) -> None:
    """Several upstreams (issue 27): the record says which one; the settings list them, for a replay."""
    from llamaswap.core import ManualClock
    from two_gpus import TwoGpus

    path = tmp_path / "activity.jsonl"
    activity = ActivityLog(manual := ManualClock(), path=str(path))
    node = TwoGpus([activity], clock=manual)
    tickets = [node.arrive("x1", "x"), node.arrive("y1", "y"), node.arrive("x2", "x"), node.arrive("z1", "z")]
    assert node.grant() == {"x1": "big", "y1": "small", "x2": "big"}
    for ticket in tickets[:3]:
        node.finish(ticket)
    assert node.grant() == {"z1": "big"}
    node.finish(tickets[3])
    activity.close()
    lines = lines_of(path)
    assert lines[0]["event"] == "settings" and lines[0]["upstreams"] == [
        {"name": "big", "slots": 2, "model_slots": {}, "models": None, **ONE_MODEL},
        {"name": "small", "slots": 1, "model_slots": {}, "models": None, **ONE_MODEL}]
    assert {r["request_id"]: r["upstream"] for r in lines if r["event"] == "request"} == {
        "x1": "big", "y1": "small", "x2": "big", "z1": "big"}


def test_the_settings_record_gives_each_gpus_slots_and_the_nodes_reservation(tmp_path: pathlib.Path) -> None:
    """Issue 45 (item 5): each GPU's own slots are in ``upstreams``, which `llamaswap simulate`
    reads back per GPU; the top-level ``slots`` stay the first GPU's, for older readers; the
    reservation is the node's, not the first GPU's where `auto` lowered that one's."""
    from llamaswap.core import ManualClock, Slots
    from llamaswap.core.policy import GpuPolicy
    from policies import serial

    path = tmp_path / "activity.jsonl"
    activity = ActivityLog(ManualClock(), path=str(path))
    activity.settings_changed(serial().with_gpus((GpuPolicy("small", Slots(1, {}, 0)),
                                                  GpuPolicy("big", Slots(4, {"m": 3}, 2)))))
    activity.close()
    (line,) = lines_of(path)
    assert (line["slots"], line["model_slots"], line["reserved_slots"]) == (1, {}, 2)
    assert [(u["name"], u["slots"], u["model_slots"]) for u in line["upstreams"]] == [
        ("small", 1, {}), ("big", 4, {"m": 3})]
    (record,) = read_activity(path).settings
    assert record.gpu_slots is not None
    assert {name: (own.default, dict(own.per_model)) for name, own in record.gpu_slots.items()} == {
        "small": (1, {}), "big": (4, {"m": 3})}


def test_thousandths_is_round_to_3_decimals() -> None:
    """`thousandths` (issue 49: a record's Unix milliseconds without round's decimal conversion)
    is round(value, 3), float for float: Unix times in milliseconds as the log makes them (an
    int of nanoseconds over a float), exact ties (to the even thousandth), small and whole values."""
    chance = random.Random(49)
    values = [(chance.randrange(10**18, 4 * 10**18) + offset) / (NS_PER_S / 1000)
              for offset in range(-3, 4) for _ in range(20_000)]
    values += [chance.randrange(1, 10**7) / 2000 for _ in range(20_000)]  # ties: k + 0.5 thousandths
    values += [chance.random() * 10.0 ** chance.randrange(-9, 16) for _ in range(20_000)]
    values += [0.0005, 0.0015, 0.0025, 1.0, 2000.0, 1796601056586.9865, 2.0**53, 1e300]
    for value in values:
        assert repr(thousandths(value)) == repr(round(value, 3)), value
