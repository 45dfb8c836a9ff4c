"""Replays (issue 45): activity logs recorded through the real stack at 68b3511
(tests/replays/README.md) replayed by `llamaswap simulate --activity` with the log's own
settings decide as the sidecar decided: the same grants in the same order, each on the same GPU,
loading its model or not as it did, unloading the same resident models (for the same reasons; never a pinned one),
put ahead by aging or swap affinity as often. Waits are left out: the recorded ones follow the
machine's clock, the decisions must not."""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import pathlib
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

from llamaswap.commands import simulate as cli

REPLAYS = pathlib.Path(__file__).resolve().parent / "replays"
# The fake upstream's generations are sleeps: n at once run as fast as one each.
FAKE_SPEED = ("--concurrency-speed", "1:1,2:2,3:3,4:4")
# Each log with what its replay needs beside the log's own settings: what the log cannot say.
FAITHFUL: dict[str, tuple[str, ...]] = {
    "one_gpu": (),
    # The estimates' defaults (defaultSwapSeconds 0 there) are not in the log: its configuration.
    "two_gpus": ("-c", str(REPLAYS / "two_gpus.yaml")),
    # Generations overlapped: the fake's speed, where the table measured from the log is wrong
    # (test_the_measured_concurrency_speed_replays_otherwise).
    "resident": FAKE_SPEED,
    "resident_memory": FAKE_SPEED,
    "resident_pinned": FAKE_SPEED,
    "slots": FAKE_SPEED,
}


@dataclasses.dataclass(frozen=True)
class Grant:
    """One decision: which request was granted, where, whether it loaded its model, what its grant
    unloaded to make room."""

    request_id: str
    upstream: str | None
    model_load: bool
    evicted: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Decisions:
    grants: list[Grant]  # in the order they were made
    reorders: dict[str, int]  # grants each cause (aging, swap affinity) put ahead, by cause
    evictions: dict[str, int]  # resident models unloaded, by reason


def _nonzero(counts: dict[str, int]) -> dict[str, int]:
    return {key: value for key, value in counts.items() if value}


def recorded(log: pathlib.Path) -> Decisions:
    """The sidecar's decisions, in the order it made them (its grant times)."""
    records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    granted = [r for r in records if r.get("event") == "request" and r.get("granted_unix_ms") is not None]
    granted.sort(key=lambda r: r["granted_unix_ms"])
    times = [r["granted_unix_ms"] for r in granted]
    assert len(set(times)) == len(times), "two grants at one recorded instant: their order is unknown"
    grants = [Grant(r["request_id"], r["upstream"], bool(r["swap"] or r["load"]),
                    tuple(e["model"] for e in r.get("evicted", []))) for r in granted]
    reorders = Counter(cause for r in granted for cause in r.get("reordered_by", []))
    evictions = Counter(e["reason"] for r in granted for e in r.get("evicted", []))
    return Decisions(grants, dict(reorders), dict(evictions))


def replayed(log: pathlib.Path, *options: str) -> Decisions:
    """`llamaswap simulate --activity LOG --requests - --format json` run in-process: its grants in
    its order, and its reorders and evictions as its report counts them."""
    top = argparse.ArgumentParser(prog="llamaswap")
    cli.add_parser(top.add_subparsers(dest="command", required=True))
    args = top.parse_args(["simulate", "--activity", str(log), "--requests", "-", "--format", "json", *options])
    out, err = io.StringIO(), io.StringIO()
    assert args.run(args, out=out, err=err) == 0, err.getvalue()
    *lines, summary = [json.loads(line) for line in out.getvalue().splitlines() if line.strip()]
    granted = sorted((line for line in lines if line["grant"] is not None), key=lambda line: line["grant"])
    (row,) = summary["rows"]
    return Decisions([Grant(line["request_id"], line["upstream"], line["model_load"], tuple(line["evicted"]))
                      for line in granted], _nonzero(row["reorders"]), _nonzero(row["evictions"]))


def first_difference(was: Decisions, now: Decisions) -> str | None:
    """The first decision the replay made otherwise (None: every one the same)."""
    for index, (recorded_grant, replayed_grant) in enumerate(zip(was.grants, now.grants)):
        if recorded_grant != replayed_grant:
            return f"grant {index}: recorded {recorded_grant}, replayed {replayed_grant}"
    if len(was.grants) != len(now.grants):
        return f"{len(was.grants)} grants recorded, {len(now.grants)} replayed"
    if was.reorders != now.reorders:
        return f"reorders by cause: recorded {was.reorders}, replayed {now.reorders}"
    if was.evictions != now.evictions:
        return f"evictions by reason: recorded {was.evictions}, replayed {now.evictions}"
    return None


def settings_of(log: pathlib.Path) -> dict[str, Any]:
    first = json.loads(log.read_text().splitlines()[0])
    assert first["event"] == "settings"
    return first


@pytest.mark.parametrize("name", list(FAITHFUL))
def test_a_recorded_log_replays_to_the_same_decisions(name: str) -> None:
    log = REPLAYS / f"{name}.jsonl"
    was = recorded(log)
    assert len(was.grants) >= 20  # a workload, not a handful
    assert first_difference(was, replayed(log, *FAITHFUL[name])) is None


def test_each_log_exercises_what_it_is_kept_for() -> None:
    """The fixtures hold the decisions the replays are there to check: swaps, aging and swap
    affinity on one GPU, both GPUs used, evictions among resident models (by count, and by
    memory), several grants running at once beside a kept slot."""
    one = [json.loads(line) for line in (REPLAYS / "one_gpu.jsonl").read_text().splitlines()]
    assert sum(r.get("swap", False) for r in one) >= 5
    assert any("aging" in r.get("reordered_by", []) for r in one)
    assert any("swap_affinity" in r.get("reordered_by", []) for r in one)
    assert {g.upstream for g in recorded(REPLAYS / "two_gpus.jsonl").grants} == {"gpu0", "gpu1"}
    for name, most in (("resident", 2), ("resident_memory", 3)):
        assert settings_of(REPLAYS / f"{name}.jsonl")["upstreams"][0]["max_loaded"] == most
        assert sum(len(g.evicted) for g in recorded(REPLAYS / f"{name}.jsonl").grants) >= 3, name
    assert settings_of(REPLAYS / "resident_memory.jsonl")["upstreams"][0]["memory_bytes"] == 20 * 2**30
    pinned = recorded(REPLAYS / "resident_pinned.jsonl").grants
    assert settings_of(REPLAYS / "resident_pinned.jsonl")["upstreams"][0]["pinned"] == ["model-a"]
    assert sum(len(g.evicted) for g in pinned) >= 3 and not any("model-a" in g.evicted for g in pinned)
    slots = [json.loads(line) for line in (REPLAYS / "slots.jsonl").read_text().splitlines()]
    assert (slots[0]["slots"], slots[0]["reserved_slots"]) == (4, 1)
    assert max(r.get("serial_slots_busy") or 0 for r in slots) == 4


@pytest.mark.parametrize(("name", "options"), [
    ("resident", ("--max-loaded", "1")),  # one model at a time: no evictions, more loads
    ("resident_memory", ("--max-loaded", "2")),
    ("resident_pinned", ("--max-loaded", "2")),  # the pinned model and one other
    ("one_gpu", ("--scheduler", "fifo")),  # no aging and no affinity: another order
    ("two_gpus", ("--gpus", "1")),  # every grant on gpu0
    ("slots", ("--slots", "2")),  # fewer at once: another order
])
def test_a_replay_under_other_settings_is_told_apart(name: str, options: tuple[str, ...]) -> None:
    """The comparison can fail: the same log replayed with another setting decides otherwise, and
    the difference is found."""
    log = REPLAYS / f"{name}.jsonl"
    assert first_difference(recorded(log), replayed(log, *FAITHFUL[name], *options)) is not None


MEASURED_SPEED_IS_WRONG = ("simulate measures the concurrency speed from the log in requests (no max_tokens) over "
                           "held requests of any length: the wrong table retimes the runs and the replay decides "
                           "otherwise")
ESTIMATE_DEFAULTS_NOT_RECORDED = ("the log does not record the estimates' defaults: without -c the replay takes the "
                                  "built-in ones (a load 5 s) and leaves a request to the busy GPU where its model "
                                  "is, where the recording loaded it at once on the free one")


@pytest.mark.xfail(strict=True, raises=AssertionError, reason=MEASURED_SPEED_IS_WRONG)
@pytest.mark.parametrize("name", ["resident", "resident_memory", "resident_pinned", "slots"])
def test_the_measured_concurrency_speed_replays_otherwise(name: str) -> None:
    log = REPLAYS / f"{name}.jsonl"
    assert first_difference(recorded(log), replayed(log)) is None


@pytest.mark.xfail(strict=True, raises=AssertionError, reason=ESTIMATE_DEFAULTS_NOT_RECORDED)
def test_two_gpus_without_the_configuration_replays_otherwise() -> None:
    log = REPLAYS / "two_gpus.jsonl"
    assert first_difference(recorded(log), replayed(log)) is None


@pytest.mark.parametrize(("name", "field", "change"), [
    ("one_gpu", "swap", lambda record: not record["swap"]),  # said it loaded where it did not
    ("two_gpus", "upstream", lambda record: "gpu1" if record["upstream"] == "gpu0" else "gpu0"),
    ("resident", "evicted", lambda record: [{**e, "reason": "least_needed"} for e in record["evicted"]]),
])
def test_a_log_altered_in_one_decision_is_told_apart(tmp_path: pathlib.Path, name: str, field: str,
                                                     change: Callable[[dict[str, Any]], Any]) -> None:
    """One grant's record altered (where it ran, whether it loaded, why it evicted): the faithful
    replay no longer matches it."""
    lines = (REPLAYS / f"{name}.jsonl").read_text().splitlines()
    index = next(i for i, line in enumerate(lines) if json.loads(line).get(field) not in (None, [], False)
                 and json.loads(line).get("event") == "request" and json.loads(line)["request_id"].startswith("w"))
    record = json.loads(lines[index])
    record[field] = change(record)
    lines[index] = json.dumps(record)
    altered = tmp_path / "altered.jsonl"
    altered.write_text("\n".join(lines) + "\n")
    difference = first_difference(recorded(altered), replayed(altered, *FAITHFUL[name]))
    assert difference is not None
    # Found where it was made: that grant, or (a reason) the evictions by reason.
    assert f"request_id='{record['request_id']}'" in difference or difference.startswith("evictions by reason")
