"""`simulate_pods` (issue 28): a workload over pods of GPUs, routed by the picker's rule, by
round-robin, or not at all (one queue over every GPU), through the real scheduler."""

from __future__ import annotations

import json
import pathlib

import pytest
import yaml

from llamaswap.commands.main import main

from llamaswap.core import Outcome, Policy
from llamaswap.simulate.engine import FixedCosts
from llamaswap.simulate.pods import Routing, simulate_pods
from llamaswap.simulate.records import RequestRecord
from llamaswap.simulate.workload import costs, generate, parse_workload

POLICY = Policy.serial(aging_divisor_s=0.0, swap_affinity_bonus=0)


def record(request_id: str, at_s: float, run_s: float, model: str = "m", priority: int = 0) -> RequestRecord:
    return RequestRecord(request_id=request_id, model=model, priority=priority, outcome=Outcome.SERVED,
                         dispatched=True, arrival_ms=at_s * 1000, queue_wait_ms=None, first_byte_ms=None,
                         run_ms=run_s * 1000, settle_ms=0.0, swap=False, load=False, order=int(at_s * 1000))


NO_SWAP = FixedCosts({}, {})


def test_round_robin_leaves_a_gpu_idle_while_work_waits_in_the_other_pod() -> None:
    # Pod 0 gets the long one and then the third; pod 1 finishes its short one and idles.
    records = [record("long", 0.0, 100.0), record("short", 0.001, 1.0), record("third", 0.002, 1.0)]
    rr = simulate_pods(records, POLICY, NO_SWAP, pods=2, gpus=1, routing=Routing.ROUND_ROBIN)
    one = simulate_pods(records, POLICY, NO_SWAP, pods=2, gpus=1, routing=Routing.ONE_QUEUE)
    assert rr.granted == one.granted == 3
    assert rr.idle_while_waiting > 0.4  # pod 1 idles from 1 s to 100 s while "third" waits
    assert one.idle_while_waiting == 0.0
    assert one.wait_p95_s is not None and rr.wait_p95_s is not None and one.wait_p95_s < rr.wait_p95_s


def test_the_picker_sends_a_request_to_the_pod_that_has_its_model_loaded() -> None:
    # a and b load on pods 0 and 1; a second b, arriving when both queues are empty, goes to pod 1.
    records = [record("a1", 0.0, 1.0, "a"), record("b1", 0.001, 1.0, "b"), record("b2", 5.0, 1.0, "b"),
               record("a2", 6.0, 1.0, "a")]
    swap = FixedCosts({}, {"a": 10.0, "b": 10.0})
    picker = simulate_pods(records, POLICY, swap, pods=2, gpus=1, routing=Routing.PICKER)
    rr = simulate_pods(records, POLICY, swap, pods=2, gpus=1, routing=Routing.ROUND_ROBIN)
    assert (picker.loads, picker.swaps) == (2, 0)  # each model stays where it was loaded
    assert (rr.loads, rr.swaps) == (2, 2)  # b2 lands where a is loaded, a2 where b is


def test_the_picker_prefers_a_short_queue_to_affinity() -> None:
    # Pod 0 has m loaded: q0..q2 follow it there (within AFFINITY_SLACK of the idle pod 1's empty
    # queue), q3 finds pod 0 three deep and goes to pod 1, which loads m too.
    records = [record("m1", 0.0, 50.0)] + [record(f"q{i}", 0.001 * (i + 1), 50.0) for i in range(4)]
    picker = simulate_pods(records, POLICY, NO_SWAP, pods=2, gpus=1, routing=Routing.PICKER)
    assert picker.loads == 2
    assert picker.idle_while_waiting > 0.0  # the price of affinity: pod 1 idled while q0 waited


@pytest.mark.parametrize("routing", list(Routing))
def test_every_request_is_granted_once_whatever_the_routing(routing: Routing) -> None:
    workload = parse_workload({"duration": 600, "seed": 3, "classes": [
        {"name": "chat", "rate": 0.5, "priority": "interactive", "models": {"a": 2, "b": 1},
         "run": {"lognormal": {"median": 2, "sigma": 0.5}}, "swap": 3},
        {"name": "batch", "rate": 0.05, "priority": "batch", "models": {"c": 1, "a": 1}, "run": {"uniform": [10, 30]},
         "swap": 3}]})
    records = generate(workload)
    result = simulate_pods(records, POLICY, costs(workload, records), pods=3, gpus=2, routing=routing)
    assert result.granted == len(records)
    assert result.interactive_p95_wait_s is not None and result.interactive_p95_wait_s >= 0.0
    assert 0.0 <= result.idle_while_waiting <= 1.0


def test_pods_and_gpus_must_be_positive() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        simulate_pods([], POLICY, NO_SWAP, pods=0, gpus=1, routing=Routing.PICKER)


def _workload_file(tmp_path: pathlib.Path) -> pathlib.Path:
    path = tmp_path / "workload.yaml"
    path.write_text(yaml.safe_dump({"duration": 300, "seed": 5, "classes": [
        {"name": "chat", "rate": 0.5, "priority": "interactive", "models": {"a": 1, "b": 1},
         "run": {"fixed": 2}, "swap": 4},
        {"name": "batch", "rate": 0.05, "priority": "batch", "models": "c", "run": {"fixed": 20}, "swap": 4}]}))
    return path


def test_simulate_pods_reports_the_three_routings(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _workload_file(tmp_path)
    assert main(["simulate", "--workload", str(path), "--pods", "2", "--gpus", "2", "--format", "json"]) == 0
    document = json.loads(capsys.readouterr().out)
    rows = {row["routing"]: row for row in document["routings"]}
    assert set(rows) == {"picker", "round-robin", "one-queue"}
    assert len({row["granted"] for row in rows.values()}) == 1 and rows["picker"]["granted"] > 100
    assert all(row["pods"] == 2 and row["gpus"] == 2 for row in rows.values())
    assert main(["simulate", "--workload", str(path), "--pods", "2"]) == 0
    table = capsys.readouterr().out
    assert "over 2 pods x 1 GPUs" in table and "round-robin" in table


def test_simulate_pods_refuses_what_it_cannot_show(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _workload_file(tmp_path)
    assert main(["simulate", "--workload", str(path), "--pods", "2", "--sweep", "slots=1,2"]) == 2
    assert "--pods compares three routings" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["simulate", "--workload", str(path), "--pods", "zero"])
    assert exit_info.value.code == 2
