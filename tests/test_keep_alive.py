"""Ollama's keep_alive (issue 48): the duration a request gives (`core/keep_alive.py`), the bounds
`routing.keepAlive` sets, and the idle rule on the fake clock: the last request granted of a model
on a GPU says its idle time there (`core/idle.py`)."""

from __future__ import annotations

import json
import math

import pytest
from google.protobuf import struct_pb2

from llamaswap.adapters.ext_authz import keep_alive_in
from llamaswap.config import ConfigError, parse_config
from llamaswap.config.idle import describe_idle
from llamaswap.envoy.bootstrap import build_bootstrap
from llamaswap.core import ManualClock, Residency, Scheduler, Slots
from llamaswap.core.clock import NS_PER_S
from llamaswap.core.keep_alive import FOR_EVER, IGNORED, KeepAlive, KeepAliveError, parse_keep_alive
from llamaswap.core.policy import GpuPolicy
from llamaswap.core.residency import IdleUnload
from policies import serial
from test_config import check_config, write
from test_idle_unload import due_models, prio


@pytest.mark.parametrize(("value", "seconds"), [
    ("5m", 300.0), ("1h30m", 5400.0), ("10s", 10.0), ("1.5s", 1.5), ("250ms", 0.25), ("2h", 7200.0),
    ("0", 0.0), ("0s", 0.0), ("300", 300.0), ("+1m", 60.0), (".5h", 1800.0), ("1m0.5s", 60.5),
    (0, 0.0), (600, 600.0), (2.5, 2.5),
    ("-1", FOR_EVER), ("-5m", FOR_EVER), (-1, FOR_EVER), (-0.5, FOR_EVER),
])
def test_ollamas_durations_and_seconds_are_read(value: str | float, seconds: float) -> None:
    assert parse_keep_alive(value) == seconds


@pytest.mark.parametrize("value", ["", "m", "5 m", "5M", "1h30", "ten minutes", "5d", "1.2.3s", "-", "--5m",
                                   "1" * 70 + "s", True, math.nan])
def test_anything_else_is_refused(value: str | float) -> None:
    with pytest.raises(KeepAliveError):
        parse_keep_alive(value)


def _value(**kind: object) -> struct_pb2.Value:
    value = struct_pb2.Value()
    for name, content in kind.items():
        if name == "list_value":
            value.list_value.values.add().number_value = 1
        elif name == "null_value":
            value.null_value = struct_pb2.NULL_VALUE
        else:
            setattr(value, name, content)
    return value


def test_the_body_field_is_a_string_or_a_number_and_null_is_none() -> None:
    assert keep_alive_in(None) is None
    assert keep_alive_in({}) is None
    assert keep_alive_in({"keep_alive": _value(string_value="10m")}) == 600.0
    assert keep_alive_in({"keep_alive": _value(number_value=-1)}) == FOR_EVER
    assert keep_alive_in({"keep_alive": _value(null_value=True)}) is None
    for bad in (_value(bool_value=True), _value(list_value=True), _value(string_value="soon")):
        with pytest.raises(KeepAliveError):
            keep_alive_in({"keep_alive": bad})


def test_the_bounds_clamp_and_keep_means_as_long_as_allowed() -> None:
    unbounded = KeepAlive(honour=True)
    assert (unbounded.after_ns(0.0), unbounded.after_ns(90.0), unbounded.after_ns(FOR_EVER)) == (0, 90 * NS_PER_S,
                                                                                                 None)
    bounded = KeepAlive(honour=True, max_s=60.0)
    assert (bounded.after_ns(0.0), bounded.after_ns(90.0), bounded.after_ns(FOR_EVER)) == (0, 60 * NS_PER_S,
                                                                                           60 * NS_PER_S)
    idle = IdleUnload(30.0, {"own": 10.0}, bounded)
    assert (idle.idle_for_ns("a", None), idle.idle_for_ns("own", None)) == (30 * NS_PER_S, 10 * NS_PER_S)
    assert (idle.idle_for_ns("a", 0.0), idle.idle_for_ns("own", 45.0)) == (0, 45 * NS_PER_S)
    ignored = IdleUnload(30.0, {}, IGNORED)
    assert ignored.idle_for_ns("a", 0.0) == 30 * NS_PER_S  # honour off: the configured time
    assert IdleUnload(0.0, {}, IGNORED).idle_for_ns("a", 0.0) is None
    assert IdleUnload(0.0, {}, KeepAlive(honour=True)).ever and not IdleUnload().ever


# -- the rule on the fake clock -------------------------------------------------------------


def _node(keep_alive: KeepAlive, *, ttl_s: float = 0.0, pinned: tuple[str, ...] = ()) -> tuple[Scheduler, ManualClock]:
    clock = ManualClock()
    policy = GpuPolicy("gpu0", Slots(2, {}, 0), None,
                       Residency(3, frozenset(pinned), idle=IdleUnload(ttl_s, {}, keep_alive)))
    return Scheduler(serial(aging_divisor_s=0.0, swap_affinity_bonus=0).with_gpus((policy,)), clock), clock


def _grant(scheduler: Scheduler, request_id: str, model: str, keep_alive_s: float | None) -> None:
    """A request of ``model`` granted now, its keep_alive told as the runtime tells it."""
    scheduler.enqueue(request_id, prio(), model)
    decision = scheduler.next()
    assert decision is not None and decision.request_id == request_id
    scheduler.keep_alive(decision.gpu, model, keep_alive_s)


HONOURED = KeepAlive(honour=True)


def test_keep_alive_zero_falls_due_as_its_request_ends() -> None:
    scheduler, clock = _node(HONOURED, ttl_s=600.0)
    _grant(scheduler, "r1", "A", 0.0)
    clock.advance(3.0)
    assert due_models(scheduler) == []  # it runs
    scheduler.release("r1")
    assert due_models(scheduler) == [("gpu0", "A")]


def test_keep_alive_zero_waits_for_a_request_that_waits_for_the_model() -> None:
    scheduler, clock = _node(HONOURED)
    _grant(scheduler, "r1", "A", 0.0)
    _grant(scheduler, "r2", "A", 0.0)  # (two slots: both run)
    scheduler.release("r1")
    assert due_models(scheduler) == []  # r2 runs on
    scheduler.enqueue("r3", prio(), "B")
    scheduler.release("r2")
    decision = scheduler.next()
    assert decision is not None and decision.model == "B"
    assert due_models(scheduler) == [("gpu0", "A")]
    scheduler.enqueue("r4", prio(), "A")  # (B holds a slot; r4 is granted beside it)
    assert due_models(scheduler) == []  # waited for (granted or not, A is no longer idle)


def test_with_honour_off_the_configured_time_stays() -> None:
    scheduler, clock = _node(IGNORED, ttl_s=60.0)
    _grant(scheduler, "r1", "A", 0.0)
    scheduler.release("r1")
    assert due_models(scheduler) == []
    clock.advance(60.0)
    assert due_models(scheduler) == [("gpu0", "A")]


def test_the_last_request_granted_says_and_one_without_gives_back_the_configured_time() -> None:
    scheduler, clock = _node(HONOURED, ttl_s=60.0)
    _grant(scheduler, "r1", "A", 5.0)
    scheduler.release("r1")
    found = scheduler.idle_unloads()
    assert [(idle.model, idle.due_ns) for idle in found.idle] == [("A", 5 * NS_PER_S)] and found.next_ns == 5 * NS_PER_S
    _grant(scheduler, "r2", "A", None)
    clock.advance(1.0)
    scheduler.release("r2")
    assert [idle.due_ns for idle in scheduler.idle_unloads().idle] == [61 * NS_PER_S]


def test_a_negative_keep_alive_keeps_the_model_within_max_seconds() -> None:
    scheduler, clock = _node(HONOURED, ttl_s=60.0)
    _grant(scheduler, "r1", "A", FOR_EVER)
    scheduler.release("r1")
    clock.advance(10**6)
    assert due_models(scheduler) == [] and scheduler.idle_unloads().next_ns is None
    bounded, clock = _node(KeepAlive(honour=True, max_s=120.0), ttl_s=60.0)
    _grant(bounded, "r1", "A", FOR_EVER)
    bounded.release("r1")
    assert bounded.idle_unloads().next_ns == 120 * NS_PER_S


def test_a_pinned_model_stays_whatever_keep_alive_asks() -> None:
    scheduler, clock = _node(HONOURED, pinned=("P",))
    _grant(scheduler, "r1", "P", 0.0)
    scheduler.release("r1")
    clock.advance(10.0)
    assert due_models(scheduler) == []


def test_an_unloaded_model_forgets_its_keep_alive() -> None:
    scheduler, clock = _node(HONOURED, ttl_s=60.0)
    _grant(scheduler, "r1", "A", 0.0)
    scheduler.release("r1")
    scheduler.unload_idle("gpu0", frozenset({"A"}))
    assert scheduler.holding_of("gpu0").keep_alive == {}
    scheduler.set_residents(frozenset({"A"}), as_of=scheduler.dispatches_on("gpu0"), gpu="gpu0")  # (back)
    assert [idle.due_ns for idle in scheduler.idle_unloads().idle] == [60 * NS_PER_S]


def test_a_reload_bounds_or_ignores_the_keep_alive_already_asked() -> None:
    scheduler, clock = _node(HONOURED, ttl_s=60.0)
    _grant(scheduler, "r1", "A", FOR_EVER)
    scheduler.release("r1")
    assert scheduler.idle_unloads().next_ns is None

    def policy(keep_alive: KeepAlive) -> GpuPolicy:
        return GpuPolicy("gpu0", Slots(2, {}, 0), None, Residency(3, idle=IdleUnload(60.0, {}, keep_alive)))

    scheduler.reconfigure(serial(aging_divisor_s=0.0, swap_affinity_bonus=0).with_gpus(
        (policy(KeepAlive(honour=True, max_s=300.0)),)))
    assert scheduler.idle_unloads().next_ns == 300 * NS_PER_S
    scheduler.reconfigure(serial(aging_divisor_s=0.0, swap_affinity_bonus=0).with_gpus((policy(IGNORED),)))
    assert scheduler.idle_unloads().next_ns == 60 * NS_PER_S


# -- the configuration ----------------------------------------------------------------------


def test_routing_keep_alive_reaches_every_gpus_idle_rule() -> None:
    default = parse_config({}).policy().gpu("gpu0").residency.idle.keep_alive
    assert default == IGNORED
    config = parse_config({"routing": {"keepAlive": {"honour": True, "maxSeconds": 900}}})
    assert config.policy().gpu("gpu0").residency.idle.keep_alive == KeepAlive(True, 900.0)
    off = parse_config({"routing": {"keepAlive": {"maxSeconds": 900}}})
    assert off.policy().gpu("gpu0").residency.idle.keep_alive == IGNORED  # (bounds without honour: nothing)
    assert config.to_document()["routing"]["keepAlive"] == {"honour": True, "maxSeconds": 900.0}


@pytest.mark.parametrize(("document", "expected"), [
    ({"routing": {"keepAlive": {"maxSeconds": -1}}}, "routing.keepAlive.maxSeconds: must be >= 0 (null = no bound), "
                                                     "got -1"),
    ({"routing": {"keepAlive": {"honour": "yes"}}}, "routing.keepAlive.honour: must be true or false, got a string "
                                                    "'yes'"),
    ({"routing": {"keepAlive": {"maxSeconds": "10m"}}}, "routing.keepAlive.maxSeconds: "),
])
def test_bad_keep_alive_settings_name_the_key(document: dict, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(document)
    [problem] = [str(problem) for problem in info.value.problems]
    assert problem.startswith(expected), problem


def test_a_bad_max_seconds_exits_2_from_check_config(tmp_path) -> None:
    path = write(tmp_path, "routing:\n  keepAlive:\n    honour: true\n    maxSeconds: -5\n")
    result = check_config(path.name, tmp_path)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "error: routing.keepAlive.maxSeconds: " in result.stderr


def test_check_config_says_what_keep_alive_may_do() -> None:
    assert describe_idle(parse_config({"routing": {"keepAlive": {"maxSeconds": 60}}})) == []  # (not honoured)
    honoured = parse_config({"routing": {"keepAlive": {"honour": True, "maxSeconds": 900}}})
    assert describe_idle(honoured) == [
        "gpu0: no model is unloaded for idleness (upstream.idleUnloadSeconds: 0); a request's keep_alive sets its "
        "model's idle time (routing.keepAlive.honour, at most 900 s)"]


def test_envoy_always_sends_the_bodys_keep_alive() -> None:
    """Whatever routing.keepAlive says (a reload may turn honour on without a new bootstrap)."""
    for document in ({}, {"routing": {"keepAlive": {"honour": True}}}):
        text = json.dumps(build_bootstrap(parse_config(document)))
        assert '"selectors": [{"key": "keep_alive"}]' in text
