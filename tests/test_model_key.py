"""One function says what a request is scheduled as and which models.<id> entry is its
(`config.model_key`): the queue, the slots, the per-model priority, the estimates and the settle
all key on it (issue 26)."""

from __future__ import annotations

import logging

import pytest
from flow import FakeUpstream, Flow, router, single, virtual_time

from llamaswap.config import parse_config
from llamaswap.config.model_key import ModelKey, model_key, unmatched
from llamaswap.runtime.ticket import ExchangeEnd

LONG_LEASE = {"leaseSeconds": 1000}


@pytest.mark.parametrize(("requested", "single_model", "configured", "expected"), [
    ("a", None, {"a"}, ModelKey("a", "a")),  # routed by name: its own entry
    ("b", None, {"a"}, ModelKey("b", None)),
    (None, None, {"a"}, ModelKey(None, None)),
    ("alias", "x.gguf", {"alias", "x.gguf"}, ModelKey("x.gguf", "alias")),  # one model: the name's entry first
    ("other", "x.gguf", {"x.gguf"}, ModelKey("x.gguf", "x.gguf")),  # else the one model's own
    ("other", "x.gguf", {"alias"}, ModelKey("x.gguf", None)),
    (None, "x.gguf", {"x.gguf"}, ModelKey("x.gguf", "x.gguf")),
])
def test_model_key(requested, single_model, configured, expected) -> None:
    assert model_key(requested, single_model, configured) == expected


def test_unmatched_only_where_the_upstream_routes_by_name_and_lists() -> None:
    assert unmatched(["a", "zz"], frozenset({"a", "b"}), by_name=True) == ["zz"]
    assert unmatched(["a", "zz"], frozenset({"x"}), by_name=False) == []  # one model: every entry applies
    assert unmatched(["zz"], None, by_name=True) == []  # it does not list: nothing to compare


def test_single_model_slots_whatever_the_id() -> None:
    config = parse_config({"models": {"alias": {"slots": 3}}})
    assert config.slots("gpu0", single="x.gguf").of("x.gguf") == 3
    assert parse_config({"models": {"x.gguf": {"slots": 4}, "alias": {"slots": 2}}}).slots(
        "gpu0", single="x.gguf").of("x.gguf") == 4  # its own entry first
    assert parse_config({"models": {"a": {"slots": 4}, "b": {"slots": 2}}}).slots("gpu0", single="x").of("x") == 2


@virtual_time
async def test_models_slots_under_the_clients_name_apply_on_a_single_model_upstream() -> None:
    # The upstream lists x.gguf; clients call it "chat", and models.chat.slots says 2.
    flow = Flow({"models": {"chat": {"slots": 2}}, "envoy": LONG_LEASE}, upstream=FakeUpstream(single("x.gguf")))
    requests = [await flow.arrive(f"r{i}", model="chat") for i in range(3)]
    assert [r.granted for r in requests] == [True, True, False]
    assert flow.coordinator.scheduler.holdings()[0].slots_in_effect == 2
    assert requests[0].ticket.schedule_model == "x.gguf"


@virtual_time
async def test_models_priority_on_a_single_model_upstream_falls_back_to_the_one_models_entry() -> None:
    flow = Flow({"routing": {"scheduler": {"use": "fifo"}}, "envoy": LONG_LEASE,
                 "models": {"x.gguf": {"priority": 20}, "cheap": {"priority": 0}}},
                upstream=FakeUpstream(single("x.gguf")))
    holder = await flow.arrive("holder", model="x.gguf")
    cheap = await flow.arrive("cheap", "10", model="cheap")  # its own entry: 10 + 0
    other = await flow.arrive("other", "5", model="anything")  # no entry of its own: the one model's, 5 + 20
    assert holder.granted and cheap.waiting and other.waiting
    assert flow.waiting_ids() == ["other", "cheap"]


@virtual_time
async def test_a_settle_on_a_single_model_upstream_is_estimated_from_what_its_model_ran() -> None:
    upstream = FakeUpstream(single("x.gguf"), busy=1)
    flow = Flow({"envoy": LONG_LEASE, "estimates": {"defaultRunSeconds": 100}}, upstream=upstream)
    first = await flow.arrive("first", model="chat")
    await flow.advance(7)
    await flow.complete(first, first_byte_s=0.1)  # x.gguf runs 7 s
    second = await flow.arrive("second", model="chat")
    await flow.advance(2)
    await flow.end(second, ExchangeEnd.CLIENT_LEFT)  # abandoned: the upstream finishes it (a settle)
    third = await flow.arrive("third", model="chat")
    assert third.waiting and flow.coordinator.gpu_state == "settling"
    [row] = flow.coordinator.view().waiting
    assert row.estimated_start_s == pytest.approx(5.0)  # 7 s expected, 2 s gone: not the 100 s default


@virtual_time
async def test_a_models_entry_the_upstream_does_not_list_is_warned_at_start_and_on_reload(caplog) -> None:
    upstream = FakeUpstream(router("model-a", "model-b"))
    config = {"models": {"model-a": {"priority": 5}, "qwen3-8b": {"priority": 10}}}
    with caplog.at_level(logging.WARNING, logger="llamaswap.runtime.catalog"):
        flow = Flow(config, upstream=upstream)
        await flow.arrive("a", model="model-a")  # the first catalog
        await flow.arrive("b", model="model-b")
        assert caplog.text.count("models.qwen3-8b: the upstream does not serve qwen3-8b") == 1  # once
        assert "(it lists model-a, model-b)" in caplog.text and "models.model-a:" not in caplog.text
        caplog.clear()
        flow.coordinator.reconfigure(parse_config({**config, "envoy": LONG_LEASE}))  # a reload
        assert caplog.text.count("models.qwen3-8b: the upstream does not serve") == 1


@virtual_time
async def test_no_warning_on_a_single_model_upstream(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="llamaswap.runtime.catalog"):
        flow = Flow({"models": {"chat": {"priority": 5}}}, upstream=FakeUpstream(single("x.gguf")))
        await flow.arrive("a", model="chat")
    assert "does not serve" not in caplog.text
