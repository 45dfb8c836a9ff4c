"""`llamaswap simulate --idle-unload S` (issue 48): the replay unloads a resident model idle its idle
time, at exactly its due time, and counts the idle unloads and the reloads they cost later; the
flag, the sweep, -c FILE's ttl and the report.

Every expected time is worked out by hand in the comments next to it. Each request runs 10 s
warm; a load adds its model's swap of 5 s (recorded warm, so a replayed load holds 15 s).
"""

from __future__ import annotations

import io
import json
import pathlib

import pytest
from test_simulate import parser

from llamaswap.commands.simulate import _node_policy
from llamaswap.config import parse_config
from llamaswap.core import NS_PER_S, ManualClock, Outcome, Policy, Priority, PrioritySource, Scheduler, Slots
from llamaswap.core.policy import GpuPolicy
from llamaswap.core.residency import IdleUnload, Residency
from llamaswap.simulate.engine import FixedCosts, prepare, simulate
from llamaswap.simulate.idling import IdleReplay
from llamaswap.simulate.records import RequestRecord
from llamaswap.simulate.results import IdleGpuMetrics, IdleMetrics, Simulation
from llamaswap.simulate.running import NEVER
from llamaswap.simulate.settings import (
    Settings,
    SettingsError,
    combinations,
    override,
    parse_idle_unload,
    parse_sweep,
)

S = NS_PER_S
ORIGIN_MS = 1_764_580_000_000.0
COSTS = FixedCosts({}, {"A": 5.0, "B": 5.0})


def arrival(request_id: str, at_s: float, model: str, order: int) -> RequestRecord:
    """A request recorded as run warm for 10 s (no load, no settle)."""
    return RequestRecord(request_id, model, 0, Outcome.SERVED, True, ORIGIN_MS + at_s * 1000, 0.0, None,
                         10_000.0, 0.0, False, False, order=order)


def policy(idle_s: float, *, max_loaded: int = 1) -> Policy:
    residency = Residency(max_loaded, idle=IdleUnload(idle_s))
    return Policy.serial(aging_divisor_s=0, swap_affinity_bonus=0).with_gpus(
        (GpuPolicy("gpu0", Slots(1), residency=residency),))


def run(records: list[RequestRecord], idle_s: float = 60.0, **kwargs: int) -> Simulation:
    return simulate(prepare(records), policy(idle_s, **kwargs), COSTS)


def grants(simulation: Simulation) -> dict[str, tuple[int | None, int | None, bool]]:
    """Each request's (grant, release, whether its grant loaded its model), from the first arrival."""
    return {r.request.record.request_id: (r.start_ns, r.release_ns, r.model_load) for r in simulation.results}


def idle(unloads: int, reloads: int, freed_s: float = 0.0) -> IdleMetrics:
    return IdleMetrics(unloads, reloads, freed_s, {"gpu0": IdleGpuMetrics(unloads, reloads, freed_s)})


def test_a_model_idle_past_its_time_is_unloaded_and_its_next_request_loads_it_again_a_reload():
    simulation = run([arrival("a1", 0, "A", 0), arrival("a2", 100, "A", 1)])
    # a1 loads A from nothing: 0..15. A is idle from 15, due at 75: unloaded. a2 at 100 loads it
    # again (100..115), a reload; A, idle from 115, is unloaded again at 175 (nothing follows).
    # Freed: A out of memory 75..100; the unload at 175 is past the last release (115).
    assert grants(simulation) == {"a1": (0, 15 * S, True), "a2": (100 * S, 115 * S, True)}
    assert simulation.metrics.idle == idle(2, 1, 25.0)
    assert simulation.metrics.swaps == 2
    assert simulation.metrics.evictions["idle"] == 2  # each idle unload is an eviction, reason idle
    without = run([arrival("a1", 0, "A", 0), arrival("a2", 100, "A", 1)], idle_s=0)
    assert grants(without)["a2"] == (100 * S, 110 * S, False)  # kept resident: no load, 10 s
    assert without.metrics.idle == idle(0, 0) and without.metrics.evictions["idle"] == 0


@pytest.mark.parametrize(("at_s", "loads"), [(74.999, False), (75.0, False), (75.001, True)])
def test_the_unload_is_at_exactly_the_due_time_after_the_arrivals_of_that_instant(at_s: float, loads: bool):
    # A idle from 15, due at 75. Before 75 a2 finds it resident; at 75 it arrives before the
    # instant's unload and keeps it (a model waited for is not idle); a microsecond later it is gone.
    simulation = run([arrival("a1", 0, "A", 0), arrival("a2", at_s, "A", 1)])
    start = round(at_s * 1000) * 1_000_000
    assert grants(simulation)["a2"] == (start, start + (15 if loads else 10) * S, loads)
    # One unload after a2's release (past the last release: it frees nothing counted), plus the
    # one at 75 where a2 came later, freeing A for a millisecond.
    assert simulation.metrics.idle == (idle(2, 1, 0.001) if loads else idle(1, 0))


def test_a_request_before_the_due_time_cancels_nothing_and_is_no_load():
    simulation = run([arrival("a1", 0, "A", 0), arrival("a2", 50, "A", 1)])
    # a2 at 50, 25 s before A would fall due: warm, 50..60; A is then idle from 60, unloaded at 120.
    assert grants(simulation) == {"a1": (0, 15 * S, True), "a2": (50 * S, 60 * S, False)}
    assert simulation.metrics.idle == idle(1, 0)


def test_a_model_waited_for_is_never_unloaded():
    clock = ManualClock(0)
    scheduler = Scheduler(policy(60.0, max_loaded=2), clock)
    scheduler.set_residents(frozenset({"A"}), as_of=scheduler.dispatches_on("gpu0"), gpu="gpu0")  # idle from 0
    replay = IdleReplay(scheduler, scheduler.policy, scheduler.gpus)
    assert replay.on and replay.next_at(0) == 60 * S
    clock.set_ns(100 * S)  # past its due time, and a request for it waits (not yet granted)
    scheduler.enqueue("r", Priority(0, PrioritySource.NUMBER), "A")
    assert replay.next_at(100 * S) == NEVER
    assert replay.unload_due(100 * S) == 0 and scheduler.residents_on("gpu0") == {"A"}
    scheduler.cancel("r")  # no longer waited for: due at once
    assert replay.next_at(100 * S) == 100 * S
    assert replay.unload_due(100 * S) == 1 and scheduler.residents_on("gpu0") == frozenset()
    assert replay.metrics(130 * S) == idle(1, 0, 30.0)  # out of memory from 100 to the end


@pytest.mark.parametrize(("max_loaded", "reloads", "freed_s"), [(1, 0, 50.0), (2, 1, 165.0)])
def test_a_load_is_a_reload_only_where_the_model_would_have_stayed_resident(max_loaded: int, reloads: int,
                                                                            freed_s: float):
    records = [arrival("a1", 0, "A", 0), arrival("b1", 100, "B", 1), arrival("a2", 200, "A", 2)]
    simulation = run(records, max_loaded=max_loaded)
    # A is unloaded at 75, B loads at 100..115 and is unloaded at 175, A loads at 200..215 and is
    # unloaded at 275. With room for one model, B's load would have replaced A anyway: a2's load is
    # no reload. With room for two, A would have stayed beside B: it is one.
    # Freed, with room for one: A 75..100 (B's load would have replaced it), B 175..200 (A's
    # would have). With room for two: A 75..200 (its next grant), B 175..215 (the last release).
    assert grants(simulation) == {"a1": (0, 15 * S, True), "b1": (100 * S, 115 * S, True),
                                  "a2": (200 * S, 215 * S, True)}
    assert simulation.metrics.idle == idle(3, reloads, freed_s)
    # The reloads are the loads the idle unloads added: the swaps beyond those without them.
    assert simulation.metrics.swaps - run(records, idle_s=0, max_loaded=max_loaded).metrics.swaps == reloads


# -- the settings, the flag and the sweep -----------------------------------------------------


def test_the_sweep_and_the_flag_set_every_gpus_idle_time():
    (sweep,) = [parse_sweep("idleUnload=0,60,600")]
    assert sweep.values == (0.0, 60.0, 600.0)
    from llamaswap.commands.simulate import _defaults

    rows = combinations(_defaults(), [sweep])
    assert [row.policy().gpus[0].residency.idle for row in rows] == [IdleUnload(0.0), IdleUnload(60.0),
                                                                     IdleUnload(600.0)]
    assert [row.idles for row in rows] == [False, True, True]
    assert override(_defaults(), {"idleUnload": "90"}).policy().gpus[0].residency.idle == IdleUnload(90.0)


@pytest.mark.parametrize("text", ["-1", "0.0001", "x", "inf"])
def test_a_bad_idle_time_is_refused(text: str):
    with pytest.raises(SettingsError):
        parse_idle_unload(text)


CONFIGURED = {"upstream": {"url": "http://127.0.0.1:8081", "maxLoaded": 2, "idleUnloadSeconds": 30},
              "models": {"A": {"ttl": 120}, "B": {"ttl": 0}}}


def test_the_configurations_idle_times_apply_and_the_flag_keeps_the_models_own():
    settings = Settings.from_policy(_node_policy(parse_config(CONFIGURED), None, 1))
    assert settings.idle_unload_s == 30 and settings.model_ttl == {"A": 120, "B": 0} and settings.idles
    (gpu,) = settings.policy().gpus
    assert gpu.residency.idle == IdleUnload(30.0, {"A": 120.0, "B": 0.0})
    (gpu,) = override(settings, {"idleUnload": "600"}).policy().gpus
    assert gpu.residency.idle == IdleUnload(600.0, {"A": 120.0, "B": 0.0})  # a model's own ttl wins
    assert gpu.residency.max_loaded == 2


# -- the command ------------------------------------------------------------------------------

WORKLOAD = """\
duration: 1800
seed: 5
classes:
  - {name: chat, rate: 0.01, priority: interactive, models: {A: 1, B: 1}, run: {fixed: 5}, swap: 10}
"""


def run_cli(tmp_path: pathlib.Path, argv: list[str], config: dict | None = None) -> tuple[str, str, int]:
    workload = tmp_path / "workload.yaml"
    workload.write_text(WORKLOAD)
    if config is not None:
        (tmp_path / "llamaswap.yaml").write_text(json.dumps(config))
        argv = ["-c", str(tmp_path / "llamaswap.yaml"), *argv]
    out, err = io.StringIO(), io.StringIO()
    args = parser().parse_args(["simulate", "--workload", str(workload), *argv])
    return out.getvalue() if (status := args.run(args, out=out, err=err)) == 0 else "", err.getvalue(), status


def test_a_sweep_reports_idle_unloads_and_reloads_per_row(tmp_path: pathlib.Path):
    out, err, status = run_cli(tmp_path, ["--sweep", "idleUnload=0,60,600", "--max-loaded", "2", "--format", "json"])
    assert status == 0, err
    rows = json.loads(out)["rows"]
    assert [row["settings"]["idleUnload"] for row in rows] == [0, 60, 600]
    assert rows[0]["idle"] == {"unloads": 0, "reloads": 0, "freed_s": 0.0,
                               "gpus": {"gpu0": {"unloads": 0, "reloads": 0, "freed_s": 0.0}}}
    for row in rows:
        assert row["evictions"]["idle"] == row["idle"]["unloads"]
        # The reloads are loads the row made beyond those of the row that never unloads.
        assert row["swaps"] - rows[0]["swaps"] == row["idle"]["reloads"]
    # A shorter idle time unloads more, costs more loads later and frees more (15 arrivals on two
    # models in 30 minutes: many gaps pass 60 s, none 600 s; there only the unloads after the
    # last release, which free nothing counted).
    assert rows[1]["idle"]["unloads"] > rows[2]["idle"]["unloads"] > 0
    assert rows[1]["idle"]["reloads"] > rows[2]["idle"]["reloads"]
    assert rows[1]["idle"]["freed_s"] > rows[2]["idle"]["freed_s"]
    table, err, status = run_cli(tmp_path, ["--sweep", "idleUnload=0,60,600", "--max-loaded", "2"])
    assert status == 0, err
    header = next(line for line in table.splitlines() if line.lstrip().startswith("idleUnload"))
    assert header.split()[13:18] == ["unloads", "reloads", "freed", "swaps", "evictions"]
    cells = [line.split() for line in table.splitlines() if line.split()[:1] in (["0"], ["60"], ["600"])]
    assert [(int(c[13]), int(c[14]), float(c[15])) for c in cells] == [
        (r["idle"]["unloads"], r["idle"]["reloads"], round(r["idle"]["freed_s"] / 3600, 2)) for r in rows]


def test_per_gpu_idle_unloads_add_up(tmp_path: pathlib.Path):
    out, err, status = run_cli(tmp_path, ["--idle-unload", "60", "--gpus", "2", "--format", "json"])
    assert status == 0, err
    (row,) = json.loads(out)["rows"]
    gpus = row["idle"]["gpus"]
    assert sorted(gpus) == ["gpu0", "gpu1"]
    assert sum(gpu["unloads"] for gpu in gpus.values()) == row["idle"]["unloads"] > 0
    assert sum(gpu["reloads"] for gpu in gpus.values()) == row["idle"]["reloads"]
    table, _, _ = run_cli(tmp_path, ["--idle-unload", "60", "--gpus", "2"])
    line = next(line for line in table.splitlines() if line.startswith("per GPU: "))
    assert f"gpu0 swaps {row['gpus']['gpu0']['swaps']} " in line
    assert (f"idle unloads {gpus['gpu1']['unloads']} reloads {gpus['gpu1']['reloads']} "
            f"freed {gpus['gpu1']['freed_s'] / 3600:.2f} h") in line


def test_without_an_idle_time_the_report_is_as_before(tmp_path: pathlib.Path):
    for form in ("table", "json"):
        plain, err, status = run_cli(tmp_path, ["--format", form, "--max-loaded", "2"])
        assert status == 0, err
        assert run_cli(tmp_path, ["--format", form, "--max-loaded", "2", "--idle-unload", "0"])[0] == plain
        assert "idleUnload" not in plain and "reloads" not in plain
    row = json.loads(plain)["rows"][0]
    assert "idleUnload" not in row["settings"] and "idle" not in row and row["evictions"]["idle"] == 0


def test_the_configurations_ttl_is_replayed_and_shown(tmp_path: pathlib.Path):
    out, err, status = run_cli(tmp_path, [], config=CONFIGURED)
    assert status == 0, err
    assert "idleUnload 30, model ttl A 120, B 0" in out
    document, err, status = run_cli(tmp_path, ["--format", "json"], config=CONFIGURED)
    (row,) = json.loads(document)["rows"]
    assert row["settings"]["idleUnload"] == 30 and row["settings"]["modelTtl"] == {"A": 120, "B": 0}
    assert row["idle"]["unloads"] > 0


def test_a_single_model_llama_server_unloads_nothing(tmp_path: pathlib.Path):
    one_model = {"upstream": {"url": "http://127.0.0.1:8081", "command": "llama-server -m /models/a.gguf --port 8081",
                              "idleUnloadSeconds": 30}}
    out, err, status = run_cli(tmp_path, ["--format", "json"], config=one_model)
    assert status == 0, err
    (row,) = json.loads(out)["rows"]
    assert row["settings"]["idleUnload"] == 30 and row["idle"]["unloads"] == 0
    table, _, _ = run_cli(tmp_path, [], config=one_model)
    assert "no idle unload on gpu0: a single-model llama-server (-m in the command) cannot unload" in table
    # The GPUs of --gpus N are not the configured one: each is taken as a router.
    out, err, status = run_cli(tmp_path, ["--format", "json", "--gpus", "2"], config=one_model)
    assert status == 0, err
    assert json.loads(out)["rows"][0]["idle"]["unloads"] > 0


@pytest.mark.parametrize(("argv", "message"), [
    (["--idle-unload", "-1"], "error: --idle-unload -1: must be 0"),
    (["--sweep", "idleUnload=60,0.0001"], "error: --sweep idleUnload=0.0001: must be 0"),
    (["--idle-unload", "60", "--pods", "2"], "error: --pods does not replay idle unloads"),
])
def test_bad_use_exits_2(tmp_path: pathlib.Path, argv: list[str], message: str):
    _, err, status = run_cli(tmp_path, argv)
    assert status == 2
    assert err.startswith(message)
