"""What admission remembers between requests gives what working it out anew gives (issue 49):
a Check's priority (`LiveConfig.priority_of`), a model name's key (`ModelKeys.key`), the GPUs that
may answer a model (`Gpus._may_answer`) and whether a GPU's router puts models to sleep
(`ModelCatalog.puts_to_sleep`), across reloads and new catalogs."""

from __future__ import annotations

import dataclasses

from flow import FakeUpstream, Flow, router, single, virtual_time

from llamaswap.config import parse_config
from llamaswap.config.model_key import model_key
from llamaswap.runtime.catalog import puts_to_sleep
from llamaswap.runtime.gpus import Gpus
from llamaswap.runtime.live_config import LiveConfig

NAMES = (None, "a", "b", "x.gguf", "alias")


def keys_as_worked_out_anew(flow: Flow) -> None:
    coordinator = flow.coordinator
    for name in NAMES:
        expected = model_key(name, coordinator.gpus.single_model(), coordinator.config.models.keys())
        assert coordinator._keys.key(name) == expected, name
        assert coordinator._keys.key(name) == expected, name  # (the remembered one)


def answering_as_worked_out_anew(flow: Flow) -> None:
    coordinator = flow.coordinator
    gpus: Gpus = coordinator.gpus
    policy, entries = coordinator.scheduler.policy, coordinator._config.entries
    for name in ("a", "b", "x.gguf"):
        for scheduled in (name, "x.gguf", None):
            expected = tuple(gpu for gpu in gpus if entries[gpu.name].lists(name)
                             and policy.gpu(gpu.name).may_serve(scheduled))
            assert gpus._may_answer(name, scheduled, policy, entries) == expected, (name, scheduled)
            assert gpus._may_answer(name, scheduled, policy, entries) == expected, (name, scheduled)


@virtual_time
async def test_a_names_key_follows_reloads_and_catalogs() -> None:
    flow = Flow({"models": {"a": {"priority": 5}}}, upstream=FakeUpstream(router("a", "b")))
    keys_as_worked_out_anew(flow)
    flow.coordinator.observe_catalog(router("a", "b"), 0, "gpu0")
    keys_as_worked_out_anew(flow)
    flow.coordinator.reconfigure(parse_config({"models": {"b": {"priority": 1}, "alias": {"priority": 2}}}))
    keys_as_worked_out_anew(flow)
    flow.coordinator.observe_catalog(single("x.gguf"), 0, "gpu0")  # one model now, whatever the name
    keys_as_worked_out_anew(flow)
    flow.coordinator.observe_catalog(single(), 0, "gpu0")  # still one, listed by no name
    keys_as_worked_out_anew(flow)
    flow.coordinator.observe_catalog(router("a"), 0, "gpu0")
    keys_as_worked_out_anew(flow)


@virtual_time
async def test_the_gpus_that_may_answer_follow_reloads() -> None:
    def config(models: tuple[list[str] | None, ...]) -> dict[str, object]:
        entries = []
        for index, allowed in enumerate(models):
            entry: dict[str, object] = {"name": f"gpu{index}", "url": f"http://127.0.0.1:{8081 + index}"}
            if allowed is not None:
                entry["models"] = allowed
            entries.append(entry)
        return {"upstreams": entries}

    flow = Flow(config((["a"], None)), upstreams=[FakeUpstream(), FakeUpstream()])
    answering_as_worked_out_anew(flow)
    assert [gpu.name for gpu in flow.coordinator.gpus._may_answer("b", "b", flow.coordinator.scheduler.policy,
                                                                   flow.coordinator._config.entries)] == ["gpu1"]
    flow.coordinator.reconfigure(parse_config(config((["a", "b"], ["a"]))))
    answering_as_worked_out_anew(flow)
    assert [gpu.name for gpu in flow.coordinator.gpus._may_answer("b", "b", flow.coordinator.scheduler.policy,
                                                                   flow.coordinator._config.entries)] == ["gpu0"]
    flow.coordinator.observe_catalog(single("x.gguf"), 0, "gpu1")  # the policy narrows gpu1 to its one model
    answering_as_worked_out_anew(flow)


def test_whether_a_router_puts_models_to_sleep_follows_each_answer() -> None:
    from llamaswap.runtime.catalog import ModelCatalog

    catalog = ModelCatalog(FakeUpstream(), dispatches=lambda: 0, observed=lambda _catalog, _as_of: None)
    sleepy = dataclasses.replace(router("a"), sleep_after_s=30.0)
    for answer in (None, router("a"), sleepy, single("x.gguf"), sleepy, None):
        catalog.latest = answer
        assert catalog.puts_to_sleep is puts_to_sleep(answer)
    assert puts_to_sleep(sleepy) and not puts_to_sleep(router("a")) and not puts_to_sleep(None)


CLAIMS = [(header, trusted, objective, tier)
          for header in (None, "", "interactive", " Batch ", "7", "-3", "99999999999999999999", "x", "+5")
          for trusted in (None, "interactive", "12", "no")
          for objective in (None, "chat", " batch ", "unknown")
          for tier in (None, "flex", "priority", "auto")]


def test_a_checks_priority_is_what_the_policy_resolves_across_reloads() -> None:
    documents = [
        {},
        {"security": {"priority": {"mode": "clamp", "min": -10, "max": 10, "trustedHeader": "x-trusted"}},
         "routing": {"objectives": {"chat": 30}}},
        {"security": {"priority": {"mode": "strip", "trustedHeader": "x-trusted"}}},
    ]
    live = LiveConfig(parse_config(documents[0]))
    for document in documents:
        live.set(parse_config(document))
        for _ in range(2):  # worked out, then remembered
            for claims in CLAIMS:
                assert live.priority_of(*claims) == live.priority_policy.resolve(*claims), claims


def test_the_remembered_priorities_are_bounded() -> None:
    from llamaswap.runtime import live_config

    live = LiveConfig(parse_config({}))
    for value in range(live_config._PRIORITIES_REMEMBERED + 10):
        assert live.priority_of(str(value), None, None, None).value == value
    assert len(live._priorities) <= live_config._PRIORITIES_REMEMBERED
