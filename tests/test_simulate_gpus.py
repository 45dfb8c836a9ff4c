"""`llamaswap simulate` over several upstreams (issue 27): `--gpus N`, the sweep key `gpus`, a
log's recorded upstreams, per-GPU figures, and the fidelity of a replay of a two-GPU recording.

Every expected number is worked out by hand in the comments next to it.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import pathlib
import random

import pytest

from llamaswap.commands import simulate as cli
from llamaswap.core import Outcome, Policy, Slots
from llamaswap.core.policy import GpuPolicy
from llamaswap.simulate.engine import FixedCosts, prepare, simulate
from llamaswap.simulate.records import RequestRecord, format_line, parse_activity
from llamaswap.simulate.settings import Settings, SettingsError

S = 1_000_000_000
ORIGIN_MS = 1_764_580_000_000.0


def arrival(request_id: str, at_s: float, model: str, priority: int = 0, order: int = 0) -> RequestRecord:
    """A request that never ran in a recording: granted, it takes its model's stated costs."""
    return RequestRecord(request_id, model, priority, Outcome.SERVED, False, at_s * 1000, None, None, None, 0.0,
                         False, False, order=order)


def two_gpus(slots: int = 1) -> Policy:
    policy = Policy.serial(aging_divisor_s=60, swap_affinity_bonus=0, slots=Slots(slots))
    return policy.with_gpus((GpuPolicy("gpu0", Slots(slots)), GpuPolicy("gpu1", Slots(slots))))


def starts(records: list[RequestRecord], policy: Policy, costs: FixedCosts) -> dict[str, tuple[int | None, str | None]]:
    sim = simulate(prepare(records), policy, costs)
    return {r.request.record.request_id: (r.start_ns, r.gpu) for r in sim.results}


def test_two_gpus_serve_two_models_at_once_and_swap_apart():
    # A: run 10 s, swap 5 s; B: run 4 s, swap 2 s.
    costs = FixedCosts({"A": 10.0, "B": 4.0}, {"A": 5.0, "B": 2.0})
    records = [arrival("a1", 0, "A", order=0), arrival("b1", 0, "B", order=1), arrival("a2", 1, "A", order=2),
               arrival("a3", 2, "A", order=3), arrival("b2", 7, "B", order=4)]
    sim = simulate(prepare(records), two_gpus(), costs)
    got = {r.request.record.request_id: (r.start_ns, r.gpu) for r in sim.results}
    assert got == {
        # t=0: both idle: a1 loads A on gpu0 (until 15), b1 loads B on gpu1 (until 6).
        "a1": (0, "gpu0"), "b1": (0, "gpu1"),
        # t=6: gpu1 idle; gpu0 (A) frees in 9 s, a load of A takes 5: a2 swaps gpu1 to A (until 21).
        "a2": (6 * S, "gpu1"),
        # t=15: gpu0 frees, A still loaded there: a3 runs warm (until 25).
        "a3": (15 * S, "gpu0"),
        # t=21: gpu1 frees: b2 swaps it back to B (until 27). gpu0 kept A throughout.
        "b2": (21 * S, "gpu1"),
    }
    m = sim.metrics
    assert m.swaps == 4
    assert {name: gpu.swaps for name, gpu in m.gpus.items()} == {"gpu0": 1, "gpu1": 3}
    # Last release 27: gpu0 held 0..25, gpu1 0..27; the node's busy is their mean.
    assert m.gpus["gpu0"].busy_fraction == pytest.approx(25 / 27)
    assert m.gpus["gpu1"].busy_fraction == pytest.approx(1.0)
    assert m.busy_fraction == pytest.approx((25 / 27 + 1.0) / 2)


def test_a_request_waits_for_the_warm_gpu_when_that_is_sooner_than_a_load():
    # A's swap is 12 s: at t=4 (gpu1 idle after b1's 2 + 2 s) gpu0 frees A in 18 s, which is
    # later than a load (12 s): a2 loads on gpu1. With b1 longer (B run 14: gpu1 idle at 16),
    # gpu0 frees in 6 s, sooner than the load: a2 waits for gpu0 and runs warm at 22.
    fast = FixedCosts({"A": 10.0, "B": 2.0}, {"A": 12.0, "B": 2.0})
    records = [arrival("a1", 0, "A", order=0), arrival("b1", 0, "B", order=1), arrival("a2", 1, "A", order=2)]
    assert starts(records, two_gpus(), fast)["a2"] == (4 * S, "gpu1")
    slow = FixedCosts({"A": 10.0, "B": 14.0}, {"A": 12.0, "B": 2.0})
    assert starts(records, two_gpus(), slow)["a2"] == (22 * S, "gpu0")


def test_one_gpu_is_the_replay_it_always_was():
    costs = FixedCosts({"A": 10.0, "B": 4.0}, {"A": 5.0, "B": 2.0})
    records = [arrival("a1", 0, "A", order=0), arrival("b1", 0, "B", order=1), arrival("a2", 1, "A", order=2)]
    single = Policy.serial(aging_divisor_s=60, swap_affinity_bonus=0)
    # One GPU, no affinity: a1 0..15 (a load), then the earlier b1 swaps to B (15..21), then a2
    # swaps back to A at 21.
    assert starts(records, single, costs) == {"a1": (0, "gpu0"), "b1": (15 * S, "gpu0"), "a2": (21 * S, "gpu0")}


# -- the command ------------------------------------------------------------------------------


def _request(request_id: str, at_s: float, model: str, *, granted_s: float, run_s: float, load: bool,
             upstream: str | None, priority: int = 0, swap_s: float = 0.0) -> dict:
    """A served generation as the sidecar records it (first byte: the load's time, else 0)."""
    return {"event": "request", "time": 0, "request_id": request_id, "model": model, "outcome": "served",
            "dispatched": True, "serial_priority": priority,
            "serial_queue_wait_ms": round((granted_s - at_s) * 1000, 3),
            "arrival_unix_ms": round(ORIGIN_MS + at_s * 1000, 3),
            "granted_unix_ms": round(ORIGIN_MS + granted_s * 1000, 3),
            "first_byte_ms": round(swap_s * 1000, 3) if load else 0.0, "run_ms": round(run_s * 1000, 3),
            "settle_ms": 0.0, "swap": False, "load": load, "status": 200, "generation": True, "streamed": True,
            "upstream": upstream}


SETTINGS = {"event": "settings", "time": 1764580000.0, "scheduler": "serial", "aging_divisor_s": 60,
            "swap_affinity_bonus": 10, "max_queued": 0, "max_wait_s": 0, "model_priorities": {}, "slots": 1}

NAMED = [
    _request("a1", 0, "A", granted_s=0, run_s=8, load=True, upstream="big", swap_s=3),
    _request("b1", 0, "B", granted_s=0, run_s=5, load=True, upstream="small", swap_s=1),
    _request("a2", 1, "A", granted_s=8, run_s=5, load=False, upstream="big"),
]


def run_cli(argv: list[str], documents: list[dict], tmp_path: pathlib.Path,
            settings: dict = SETTINGS) -> tuple[str, str, int]:
    log = tmp_path / "activity.log"
    log.write_text("".join(format_line(d) for d in [settings, *documents]))
    out, err = io.StringIO(), io.StringIO()
    top = argparse.ArgumentParser(prog="llamaswap")
    cli.add_parser(top.add_subparsers(dest="command", required=True))
    args = top.parse_args(["simulate", "--activity", str(log), *argv])
    status = args.run(args, out=out, err=err)
    return out.getvalue(), err.getvalue(), status


def run_json(argv: list[str], documents: list[dict], tmp_path: pathlib.Path, **kwargs) -> dict:
    out, err, status = run_cli(["--format", "json", *argv], documents, tmp_path, **kwargs)
    assert status == 0, err
    return json.loads(out)


def test_a_log_of_two_upstreams_replays_with_them_unless_gpus_says_otherwise(tmp_path):
    (row,) = run_json([], NAMED, tmp_path)["rows"]
    assert row["settings"]["gpus"] == 2
    assert set(row["gpus"]) == {"big", "small"}
    (row,) = run_json(["--gpus", "1"], NAMED, tmp_path)["rows"]
    assert set(row["gpus"]) == {"gpu0"}
    (row,) = run_json(["--gpus", "3"], NAMED, tmp_path)["rows"]
    assert set(row["gpus"]) == {"gpu0", "gpu1", "gpu2"}
    # A log without upstreams (an older sidecar) replays on one.
    plain = [dict(d, upstream=None) for d in NAMED]
    (row,) = run_json([], plain, tmp_path)["rows"]
    assert row["settings"]["gpus"] == 1 and set(row["gpus"]) == {"gpu0"}


def test_the_table_gives_each_gpus_figures_and_gpus_sweeps(tmp_path):
    out, err, status = run_cli(["--gpus", "2"], NAMED, tmp_path)
    assert status == 0, err
    line = next(line for line in out.splitlines() if line.startswith("per GPU: "))
    assert line.startswith("per GPU: gpu0 swaps ") and "; gpu1 swaps " in line
    document = run_json(["--sweep", "gpus=1,2"], NAMED, tmp_path)
    assert [row["settings"]["gpus"] for row in document["rows"]] == [1, 2]
    assert [sorted(row["gpus"]) for row in document["rows"]] == [["gpu0"], ["gpu0", "gpu1"]]
    # Measured: A runs 5 s (a1's 8 minus its 3 s load, a2's 5), loads in 3; B runs 4, loads in 1.
    # One GPU: a1, then a2 (A loaded: its affinity beats the earlier b1), then b1: 2 swaps. Two: a1 on gpu0, b1 on
    # gpu1; at 5 gpu1 is idle and gpu0 frees A in 3 s, no sooner than a load (3 s): a2 swaps
    # gpu1 to A.
    one, two = document["rows"]
    assert one["gpus"] == {"gpu0": {"swaps": 2, "busy_fraction": 1.0}}
    assert {name: gpu["swaps"] for name, gpu in two["gpus"].items()} == {"gpu0": 1, "gpu1": 2}
    out, _, _ = run_cli(["--sweep", "gpus=1,2"], NAMED, tmp_path)
    assert any(line.startswith("row 2: gpu0 swaps ") for line in out.splitlines())


@pytest.mark.parametrize("argv, message", [
    (["--gpus", "0"], "--gpus 0: must be an integer from 1 to 64"),
    (["--gpus", "two"], "--gpus two: not an integer"),
    (["--sweep", "gpus=1,0"], "--sweep gpus=0: must be an integer from 1 to 64"),
])
def test_bad_gpus_exit_2(argv, message, tmp_path):
    _, err, status = run_cli(argv, NAMED, tmp_path)
    assert status == cli.EXIT_USAGE
    assert f"error: {message}" in err


# -- fidelity: a recording of two GPUs replays as it ran ---------------------------------------

RUN_S = {"A": 3.0, "B": 2.0, "C": 5.0}
SWAP_S = {"A": 4.0, "B": 1.0, "C": 6.0}


def _recording(slots: int, seed: int) -> list[dict]:
    """What a two-GPU node did with a mixed queue (the engine with stated costs), written as the
    sidecar writes it: finish order, each grant's upstream, a load's first byte its swap."""
    rng = random.Random(seed)
    records, at = [], 0.0
    for number in range(150):
        at += rng.choice([0.2, 0.5, 1.0, 1.5, 3.0])  # a queue builds and drains
        records.append(arrival(f"q{number}", round(at, 3), rng.choice("AABBC"), rng.choice([-60, 0, 0, 60]),
                               order=number))
    policy = Policy.serial(aging_divisor_s=60, swap_affinity_bonus=10, slots=Slots(slots))
    policy = policy.with_gpus((GpuPolicy("gpu0", Slots(slots)), GpuPolicy("gpu1", Slots(slots))))
    sim = simulate(prepare(records), policy, FixedCosts(RUN_S, SWAP_S))
    assert {r.gpu for r in sim.results} == {"gpu0", "gpu1"}
    assert sim.metrics.gpus["gpu0"].swaps and sim.metrics.gpus["gpu1"].swaps
    return [_request(r.request.record.request_id, r.request.arrival_ns / S, r.request.record.model,
                     granted_s=r.start_ns / S, run_s=(r.release_ns - r.start_ns) / S, load=r.model_load,
                     upstream=r.gpu, priority=r.request.priority.value,
                     swap_s=SWAP_S[r.request.record.model])
            for r in sorted(sim.results, key=lambda r: (r.release_ns, r.request.index))]


@pytest.mark.parametrize("slots, seed", [(1, 1), (1, 2), (2, 3)])
def test_the_replay_of_a_two_gpu_recording_is_what_it_recorded(slots, seed, tmp_path):
    documents = _recording(slots, seed)
    assert sum(d["serial_queue_wait_ms"] for d in documents) > 10_000  # requests waited
    target = tmp_path / "requests.jsonl"
    # Two slots ran at once on a GPU: as fast as one each, as the recording's engine had it.
    speed = ["--concurrency-speed", "2:2"] if slots > 1 else []
    document = run_json(["--requests", str(target), *speed], documents, tmp_path,
                        settings=dict(SETTINGS, slots=slots))
    (row,) = document["rows"]
    assert row["settings"]["gpus"] == 2
    lines = {line["request_id"]: line for line in map(json.loads, target.read_text().splitlines())}
    assert {rid: (line["wait_ms"], line["upstream"]) for rid, line in lines.items()} == {
        d["request_id"]: (pytest.approx(d["serial_queue_wait_ms"], abs=0.002), d["upstream"]) for d in documents}
    recorded_swaps = {name: sum(d["load"] for d in documents if d["upstream"] == name) for name in ("gpu0", "gpu1")}
    assert {name: gpu["swaps"] for name, gpu in row["gpus"].items()} == recorded_swaps


def test_records_carry_their_upstream():
    (record,) = parse_activity([format_line(NAMED[0])]).requests
    assert record.gpu == "big"
    (record,) = parse_activity([format_line(dict(NAMED[0], upstream=None))]).requests
    assert record.gpu is None


def test_upstreams_of_a_configuration_keep_their_slots_and_models_until_a_flag_replaces_them():
    from llamaswap.simulate.settings import KEYS, Settings, override

    policies = (GpuPolicy("big", Slots(2, {"A": 3})), GpuPolicy("small", Slots(1), frozenset({"B"})))
    base = Settings.from_policy(Policy.serial(aging_divisor_s=60, swap_affinity_bonus=0).with_gpus(policies))
    assert (base.gpus, base.named_gpus, base.most_slots, base.fewest_slots) == (2, ("big", "small"), 3, 1)
    assert base.policy().gpus == policies
    with_reserved = dataclasses.replace(base, reserved_slots=1)
    with pytest.raises(SettingsError, match="reservedSlots 1"):  # small has one slot
        with_reserved.policy()
    # --slots gives every upstream those slots, and any model; --gpus names them gpu0..
    flat = override(base, {"slots": "2"}).policy().gpus
    assert flat == (GpuPolicy("big", Slots(2)), GpuPolicy("small", Slots(2)))
    assert [gpu.name for gpu in override(base, {"gpus": "3"}).policy().gpus] == ["gpu0", "gpu1", "gpu2"]
    assert "gpus" in KEYS


def _upstream_entry(name: str, slots: int, model_slots: dict | None = None) -> dict:
    return {"name": name, "slots": slots, "model_slots": model_slots or {}, "models": None, "max_loaded": 1,
            "pinned": [], "memory_bytes": None, "model_bytes": {}}


def test_each_gpu_replays_with_the_slots_the_log_recorded_for_it(tmp_path):
    """Issue 45 (item 5): the settings record's top-level slots are the first GPU's; each GPU's
    own are in ``upstreams``, and the replay gives each its own (big 2 with A 3, small 1), not the
    first's everywhere. A flag's slots are every GPU's; --gpus N names new GPUs with the node's."""
    from llamaswap.simulate.settings import override

    recorded = {**SETTINGS, "slots": 2, "model_slots": {"A": 3}, "reserved_slots": 0,
                "upstreams": [_upstream_entry("big", 2, {"A": 3}), _upstream_entry("small", 1)]}
    (record,) = parse_activity([format_line(recorded)]).settings
    base = dataclasses.replace(Settings.from_policy(Policy.serial(aging_divisor_s=60, swap_affinity_bonus=0),
                                                    configured=False), gpus=2, named_gpus=("big", "small"))
    base = base.with_recorded(record)
    assert [(gpu.name, gpu.slots) for gpu in base.policy().gpus] == [("big", Slots(2, {"A": 3})),
                                                                    ("small", Slots(1))]
    assert (base.most_slots, base.fewest_slots) == (3, 1)
    assert [gpu.slots for gpu in override(base, {"slots": "4"}).policy().gpus] == [Slots(4), Slots(4)]
    assert [gpu.slots for gpu in override(base, {"gpus": "2"}).policy().gpus] == [Slots(2, {"A": 3})] * 2
    # Through the command: small keeps its one slot, so b2 waits for b1 there until 5 s (big runs
    # A, one model at a time, so it cannot load B beside it); with the first GPU's two slots on
    # small too, b2 would start at 1 s beside b1.
    documents = [_request("a1", 0, "A", granted_s=0, run_s=8, load=True, upstream="big", swap_s=1),
                 _request("b1", 0, "B", granted_s=0, run_s=5, load=True, upstream="small", swap_s=1),
                 _request("b2", 1, "B", granted_s=5, run_s=5, load=False, upstream="small")]
    out, err, status = run_cli(["--format", "json", "--requests", "-"], documents, tmp_path, settings=recorded)
    assert status == 0, err
    lines = [json.loads(line) for line in out.splitlines() if line.startswith('{"request_id"')]
    assert {line["request_id"]: (line["upstream"], line["start_ms"]) for line in lines} == {
        "a1": ("big", 0.0), "b1": ("small", 0.0), "b2": ("small", 5000.0)}
    # An older record (no upstreams): the top-level slots are every GPU's.
    (older,) = parse_activity([format_line({**SETTINGS, "slots": 2})]).settings
    assert older.gpu_slots is None


def test_the_reservation_of_a_configured_node_is_not_its_first_gpus():
    """`auto` lowered the reservation on the first GPU (one slot learnt); the node's is the
    configured one, which each replayed GPU gets and a replay lowers to fit as the sidecar did."""
    policies = (GpuPolicy("small", Slots(1, {}, 0)), GpuPolicy("big", Slots(4, {}, 2)))
    base = Settings.from_policy(Policy.serial(aging_divisor_s=60, swap_affinity_bonus=0).with_gpus(policies))
    assert base.reserved_slots == 2 and base.fewest_slots == 1


def test_an_unusable_slots_entry_makes_the_record_unusable():
    bad = {**SETTINGS, "upstreams": [_upstream_entry("big", 0)]}
    activity = parse_activity([format_line(bad)])
    assert activity.settings == () and activity.first_problem == "line 1: upstream big: slots is not an integer >= 1: 0"


# -- fidelity: a recording of the runtime over two GPUs -------------------------------------------

# Each GPU serves its own models (`upstreams[].models`), so no choice of the rule rests on
# times the live estimator and the replay's may learn differently; the one queue still orders
# every request across both (bands, aging), and each GPU loads its models itself.
NODE_CONFIG = {
    "upstreams": [{"name": "gpu0", "url": "http://127.0.0.1:8081", "slots": 1, "models": ["qwen", "gemma"]},
                  {"name": "gpu1", "url": "http://127.0.0.1:8082", "slots": 1, "models": ["llama"]}],
    "envoy": {"leaseSeconds": 1000},
}


def test_the_replay_of_the_runtimes_two_gpu_record_is_what_it_did(tmp_path):
    import yaml
    from flow import FakeUpstream, Flow, clock, virtual_time

    from llamaswap.runtime.activity import ActivityLog

    @virtual_time
    async def record() -> list[dict]:
        activity = ActivityLog(clock())
        flow = Flow(NODE_CONFIG, observers=[activity], upstreams=[FakeUpstream(), FakeUpstream()])
        # Apart in time: a replay enqueues the arrivals of one instant together before it grants.
        q1 = await flow.arrive("q1", None, "qwen")
        l1 = await flow.arrive("l1", None, "llama")
        await flow.advance(0.5)
        g1 = await flow.arrive("g1", "batch", "gemma")
        q2 = await flow.arrive("q2", "interactive", "qwen")
        await flow.advance(1.5)
        await flow.complete(q1, first_byte_s=0.5)  # q2 (interactive) before g1
        l2 = await flow.arrive("l2", "batch", "llama")
        await flow.advance(1)
        l3 = await flow.arrive("l3", "interactive", "llama")
        await flow.advance(1)
        await flow.complete(l1, first_byte_s=0.5)  # l3 before the earlier l2
        await flow.advance(1.5)
        await flow.complete(q2, first_byte_s=0.1)  # g1 swaps gpu0 to gemma
        await flow.advance(2)
        await flow.complete(l3, first_byte_s=0.1)
        await flow.advance(0.5)
        await flow.complete(g1, first_byte_s=0.5)
        await flow.advance(3)
        await flow.complete(l2, first_byte_s=0.1)
        return activity.recent()

    documents = record()
    granted = {d["request_id"]: (d["serial_queue_wait_ms"], d["upstream"]) for d in documents}
    assert granted == {"q1": (0.0, "gpu0"), "l1": (0.0, "gpu1"), "q2": (1500.0, "gpu0"), "g1": (5000.0, "gpu0"),
                       "l3": (1000.0, "gpu1"), "l2": (5500.0, "gpu1")}
    config = tmp_path / "llamaswap.yaml"
    config.write_text(yaml.safe_dump(NODE_CONFIG))
    target = tmp_path / "requests.jsonl"
    document = run_json(["-c", str(config), "--requests", str(target)], documents, tmp_path,
                        settings=dict(SETTINGS, swap_affinity_bonus=0))
    (row,) = document["rows"]
    assert row["settings"]["gpus"] == 2
    lines = {line["request_id"]: line for line in map(json.loads, target.read_text().splitlines())}
    assert {rid: (line["wait_ms"], line["upstream"]) for rid, line in lines.items()} == granted
    assert {name: gpu["swaps"] for name, gpu in row["gpus"].items()} == {"gpu0": 2, "gpu1": 1}


def test_a_configuration_with_upstreams_replays_them_with_their_slots_and_models(tmp_path):
    import yaml

    from llamaswap.config import load_config

    document = dict(NODE_CONFIG, upstreams=[dict(NODE_CONFIG["upstreams"][0], slots="auto"),  # type: ignore[index]
                                            dict(NODE_CONFIG["upstreams"][1], slots=3)])  # type: ignore[index]
    path = tmp_path / "llamaswap.yaml"
    path.write_text(yaml.safe_dump(document))
    # auto: the slots the log recorded (2 here).
    assert cli._node_policy(load_config(str(path)), None, 2).gpus == (
        GpuPolicy("gpu0", Slots(2), frozenset({"qwen", "gemma"})), GpuPolicy("gpu1", Slots(3), frozenset({"llama"})))
    (row,) = run_json(["-c", str(path)], NAMED, tmp_path)["rows"]
    assert set(row["gpus"]) == {"gpu0", "gpu1"}  # the configuration's, not the log's "big" and "small"


def test_a_configuration_of_one_upstream_is_a_node_of_one_as_the_runtime_builds_it(tmp_path):
    """One `upstreams:` entry is one GPU named as configured, with the entry's slots and models
    (`runtime.gpus.node_policy`), not the `upstream:` of a file without `upstreams` (gpu0, its slots)."""
    import yaml

    from llamaswap.config import load_config

    path = tmp_path / "llamaswap.yaml"
    path.write_text(yaml.safe_dump(dict(NODE_CONFIG, upstreams=[
        {"name": "big", "url": "http://127.0.0.1:8081", "slots": 2, "models": ["A"]}])))
    policy = cli._node_policy(load_config(str(path)), None, 1)
    assert policy.gpus == (GpuPolicy("big", Slots(2), frozenset({"A"})),)
    assert Settings.from_policy(policy).policy().gpus == policy.gpus
    documents = [_request("a1", 0, "A", granted_s=0, run_s=8, load=True, upstream="big", swap_s=3),
                 _request("a2", 1, "A", granted_s=1, run_s=5, load=False, upstream="big")]
    (row,) = run_json(["-c", str(path)], documents, tmp_path)["rows"]
    assert set(row["gpus"]) == {"big"} and row["settings"]["slots"] == 2
    # Without upstreams: the one upstream, gpu0, with upstream.slots.
    path.write_text(yaml.safe_dump({"upstream": {"slots": 3}}))
    assert cli._node_policy(load_config(str(path)), None, 1).gpus == (GpuPolicy("gpu0", Slots(3)),)



# -- each GPU's own costs -----------------------------------------------------------------------

def _warm(request_id: str, at_s: float, run_s: float, upstream: str | None, order: int) -> RequestRecord:
    """A served warm generation of A, granted as it arrived (first byte at once)."""
    return RequestRecord(request_id, "A", 0, Outcome.SERVED, True, at_s * 1000, 0.0, 0.0, run_s * 1000, 0.0,
                         False, False, order=order, gpu=upstream)


def _slow_gpu1() -> list[RequestRecord]:
    # gpu0 runs A in 2 s (three samples), gpu1 in 20 s (one): the node's median is 2 s.
    return [_warm("f1", 0, 2, "gpu0", 0), _warm("s1", 0, 20, "gpu1", 1), _warm("f2", 2, 2, "gpu0", 2),
            _warm("f3", 4, 2, "gpu0", 3)]


def test_each_gpu_replays_with_its_own_run_times():
    from llamaswap.simulate.engine import measure_costs

    records = _slow_gpu1()
    costs = measure_costs(records, default_run_s=10.0, default_swap_s=5.0, samples=50)
    assert (costs.expected_run_s("A", "gpu0"), costs.expected_run_s("A", "gpu1"), costs.expected_run_s("A")) == (
        2.0, 20.0, 2.0)
    # Two requests that never ran arrive together at 30, both GPUs idle: each takes its GPU's
    # run of A (not the node's 2 s on gpu1).
    late = [arrival("n1", 30, "A", order=4), arrival("n2", 30, "A", order=5)]
    sim = simulate(prepare(records + late), two_gpus(), costs)
    ran = {r.request.record.request_id: (r.gpu, (r.release_ns - r.start_ns) / S) for r in sim.results}
    assert {ran["n1"], ran["n2"]} == {("gpu0", 2.0), ("gpu1", 20.0)}
    # One GPU (gpu0): f1 loads A first (no grant time recorded: nothing loaded; the default
    # swap, 5 s: 0..7); s1, recorded 20 s on gpu1, runs at gpu0's pace (2 s): f2 starts at 9, not 27.
    single = simulate(prepare(records), Policy.serial(aging_divisor_s=60, swap_affinity_bonus=0), costs)
    started = {r.request.record.request_id: r.start_ns / S for r in single.results}
    assert started == {"f1": 0.0, "s1": 7.0, "f2": 9.0, "f3": 11.0}


def test_a_gpu_without_its_own_figures_takes_the_nodes():
    from llamaswap.simulate.engine import measure_costs

    records = _slow_gpu1()
    costs = measure_costs(records, default_run_s=10.0, default_swap_s=5.0, samples=50)
    # gpu2 recorded nothing: the node's run of A (2 s); no model anywhere recorded: the defaults.
    assert costs.expected_run_s("A", "gpu2") == 2.0
    assert (costs.expected_run_s("Z", "gpu1"), costs.expected_swap_s("Z", "gpu1")) == (10.0, 5.0)
    three = Policy.serial(aging_divisor_s=60, swap_affinity_bonus=0).with_gpus(
        tuple(GpuPolicy(f"gpu{i}", Slots(1)) for i in range(3)))
    late = [arrival(f"n{i}", 30, "A", order=4 + i) for i in range(3)]
    sim = simulate(prepare(records + late), three, costs)
    ran = {r.gpu: (r.release_ns - r.start_ns) / S for r in sim.results if r.request.record.request_id[0] == "n"}
    assert ran == {"gpu0": 2.0, "gpu1": 20.0, "gpu2": 2.0}


def test_measuring_the_needed_suffix_per_upstream_matches_feeding_everything():
    from llamaswap.core import Estimator
    from llamaswap.simulate.engine import measure_costs

    rng = random.Random(12)
    for _ in range(300):
        records = [RequestRecord("r", rng.choice(["a", "b"]), 0, Outcome.SERVED, True, 0.0, 0.0,
                                 rng.choice([None, rng.uniform(0, 9000)]), rng.uniform(0, 20000), 0.0,
                                 rng.random() < 0.3, False, gpu=rng.choice(["g0", "g1", None]))
                   for _ in range(rng.randint(0, 60))]
        samples = rng.randint(1, 8)
        everything = Estimator(default_run_s=10.0, default_swap_s=5.0, samples=samples)
        for r in records:
            everything.record(r.model, run_s=r.run_ms / 1000, model_load=r.model_load, gpu=r.gpu,
                              first_byte_s=r.first_byte_ms / 1000 if r.first_byte_ms is not None else None)
        measured = measure_costs(records, default_run_s=10.0, default_swap_s=5.0, samples=samples)
        for model in ("a", "b"):
            for upstream in ("g0", "g1", None):
                assert measured.expected_run_s(model, upstream) == everything.expected_run_s(model, upstream)
                assert measured.expected_swap_s(model, upstream) == everything.expected_swap_s(model, upstream)
