"""`upstreams` (issue 27): several upstreams behind the one queue. The implicit single entry, the
defaults, the round trip through to_document, the schema, the reload verdict, and every refusal:
exit 2 from `check-config` with the key path and the fix."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap
from typing import Any

import jsonschema
import pytest
import yaml

import llamaswap
from llamaswap.commands.serve import Sidecar
from llamaswap.config import (
    IMPLICIT_GPU,
    Config,
    ConfigError,
    GpuEntry,
    json_schema,
    load_config,
    parse_config,
)
from llamaswap.config.reload import OnReload, plan_reload, reload_key

_SOURCE_ROOT = str(pathlib.Path(llamaswap.__file__).resolve().parents[1])
RESERVED = "routing.scheduler.settings.serial.reservedSlots"


def check_config(path: pathlib.Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [_SOURCE_ROOT, os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "llamaswap", "check-config", "-c", str(path)],
                          cwd=path.parent, capture_output=True, text=True, timeout=60, env=env)


def two(**second: Any) -> list[dict[str, Any]]:
    """Two entries on two ports; ``second`` changes the second one."""
    return [{"name": "gpu0", "url": "http://127.0.0.1:8081"},
            {"name": "gpu1", "url": "http://127.0.0.1:8082", **second}]


# -- the list of one, the defaults ---------------------------------------------------------------


def test_without_upstreams_the_one_upstream_is_gpu0() -> None:
    assert Config().gpu_entries == (GpuEntry(IMPLICIT_GPU, "http://127.0.0.1:8081", 1, None, ()),)
    cfg = parse_config({"upstream": {"url": "https://llm.example:8443/", "slots": "auto", "command": "server -p 1"}})
    [entry] = cfg.gpu_entries
    assert (entry.name, entry.url, entry.slots, entry.models, entry.command) == (
        "gpu0", "https://llm.example:8443", "auto", None, ("server", "-p", "1"))
    assert (entry.host, entry.port, entry.tls) == ("llm.example", 8443, True)
    assert cfg.to_document()["upstreams"] is None


def test_entries_keep_their_order_and_take_upstream_slots_by_default() -> None:
    cfg = parse_config({
        "upstream": {"slots": 3, "modelCheck": "strict"},
        "upstreams": [
            {"name": "big", "url": "http://10.0.0.1:8081"},
            {"name": "small", "url": "https://10.0.0.2", "slots": 1, "models": ["qwen", 7, "qwen"],
             "command": ["llama-server", "--port", 8082]},
            {"name": "auto-1", "url": "http://10.0.0.3:8081", "slots": "auto", "models": []},
        ],
    })
    big, small, auto = cfg.gpu_entries
    assert [e.name for e in cfg.gpu_entries] == ["big", "small", "auto-1"]
    assert (big.slots, small.slots, auto.slots) == (3, 1, "auto")  # big takes upstream.slots
    assert (big.models, small.models, auto.models) == (None, frozenset({"qwen", "7"}), None)  # [] means any
    assert small.command == ("llama-server", "--port", "8082") and big.command == ()
    assert (small.host, small.port, small.tls) == ("10.0.0.2", 443, True)
    assert small.lists("qwen") and not small.lists("llama-70b") and big.lists("llama-70b")
    assert cfg.upstream.model_check.value == "strict"  # the rest of upstream applies to every entry


def test_the_policy_has_every_gpu_each_from_its_own_entry() -> None:
    """`Config.policy` is over the list of GPUs, one of them without ``upstreams``: each GPU's slots,
    models and residency come from its entry (its own, or upstream's as the default); the
    configuration is never rewritten per GPU."""
    cfg = parse_config({"upstream": {"slots": 3, "maxLoaded": 2},
                        "upstreams": two(slots=2, models=["qwen"], maxLoaded=1),
                        "models": {"qwen": {"slots": 4}}})
    gpu0, gpu1 = cfg.policy().gpus
    assert (gpu0.name, gpu0.slots.default, gpu0.slots.of("qwen"), gpu0.models, gpu0.residency.max_loaded) == (
        "gpu0", 3, 4, None, 2)
    assert (gpu1.name, gpu1.slots.default, gpu1.slots.of("qwen"), gpu1.models, gpu1.residency.max_loaded) == (
        "gpu1", 2, 4, frozenset({"qwen"}), 1)
    assert cfg.upstream.slots == 3  # upstream: stays the entries' default, as written
    [one] = parse_config({"upstream": {"slots": 2}}).policy().gpus
    assert (one.name, one.slots.default) == (IMPLICIT_GPU, 2)
    with pytest.raises(KeyError, match="gpu0, gpu1"):
        cfg.entry("gpu7")


def test_check_config_explains_slots_per_gpu_where_they_differ() -> None:
    from llamaswap.core.explain import explain_policy

    same = explain_policy(parse_config({"upstream": {"slots": 2}, "upstreams": two()}).policy())
    assert [line for line in same if line.startswith("slots:")] == [
        "slots: generations of the loaded model at once: 2; a swap waits until every slot is idle"]
    differ = explain_policy(parse_config({"upstream": {"slots": 2}, "upstreams": two(slots=1)}).policy())
    assert [line for line in differ if "slots:" in line] == [
        "gpu0: slots: generations of the loaded model at once: 2; a swap waits until every slot is idle"]


def test_upstream_slots_change_the_entries_that_take_it() -> None:
    document = {"upstreams": two(slots=1)}
    assert [e.slots for e in parse_config(document).gpu_entries] == [1, 1]
    assert [e.slots for e in parse_config({**document, "upstream": {"slots": 4}}).gpu_entries] == [4, 1]


def test_a_model_one_entry_may_serve_is_served_and_an_entry_without_models_serves_any() -> None:
    parse_config({"upstreams": two(models=["big"]), "models": {"big": {"slots": 1}, "other": {}}})
    parse_config({"upstreams": [{"name": "a", "url": "http://h:1", "models": ["x"]},
                                {"name": "b", "url": "http://h:2", "models": ["y"]}], "models": {"x": {}, "y": {}}})


def test_auto_slots_are_not_held_against_the_reservation() -> None:
    # `auto` is what the upstream says at run time, where a reservation that does not fit is lowered.
    cfg = parse_config({"upstreams": two(slots="auto"), "upstream": {"slots": 2},
                        "routing": {"scheduler": {"settings": {"serial": {"reservedSlots": 1}}}}})
    assert [e.slots for e in cfg.gpu_entries] == [2, "auto"]


# -- the round trip ------------------------------------------------------------------------------

EVERY_ENTRY_KEY = {
    "upstream": {"healthPath": "/ready", "slots": 2, "apiKey": "env:KEY", "modelCheck": "off"},
    "upstreams": [
        {"name": "gpu0", "url": "http://127.0.0.1:8081", "slots": 4, "models": ["big", "small"],
         "command": ["llama-server", "--port", "8081"], "maxLoaded": 2, "memory": "80GiB", "idleUnloadSeconds": 600},
        {"name": "gpu1", "url": "https://gpu1.example:8443/v", "slots": None, "models": None, "command": ""},
        {"name": "gpu2", "url": "http://127.0.0.1:8083", "slots": "auto", "models": ["small"],
         "command": "llama-server --port 8083"},
    ],
    "models": {"small": {"slots": 1, "memory": "1GiB"}, "big": {"memory": "60GiB"}},
}


def test_to_document_round_trips_and_is_the_yaml_shape() -> None:
    cfg = parse_config(EVERY_ENTRY_KEY)
    document = cfg.to_document()
    assert document["upstreams"] == [
        {"name": "gpu0", "url": "http://127.0.0.1:8081", "slots": 4, "models": ["big", "small"],
         "command": ["llama-server", "--port", "8081"], "maxLoaded": 2, "memory": "80GiB", "idleUnloadSeconds": 600},
        {"name": "gpu1", "url": "https://gpu1.example:8443/v", "slots": None, "models": None, "command": "",
         "maxLoaded": None, "memory": None, "idleUnloadSeconds": None},
        {"name": "gpu2", "url": "http://127.0.0.1:8083", "slots": "auto", "models": ["small"],
         "command": ["llama-server", "--port", "8083"], "maxLoaded": None, "memory": None, "idleUnloadSeconds": None},
    ]
    # upstream.url and command are the entries' now; the rest of upstream stays, filled in
    assert "url" not in document["upstream"] and "command" not in document["upstream"]
    assert document["upstream"]["slots"] == 2 and document["upstream"]["healthPath"] == "/ready"
    assert document["upstream"]["settleTimeoutSeconds"] == Config().upstream.settle_timeout_seconds
    for again in (parse_config(document), parse_config(yaml.safe_load(yaml.safe_dump(document)))):
        assert again == cfg
        assert again.gpu_entries == cfg.gpu_entries
    assert [e.slots for e in cfg.gpu_entries] == [4, 2, "auto"]
    assert [(e.max_loaded, e.memory) for e in cfg.gpu_entries] == [(2, 80 << 30), (1, None), (1, None)]


def test_the_schema_has_upstreams_and_agrees_with_the_loader() -> None:
    schema = json_schema()
    upstreams = schema["properties"]["upstreams"]
    assert upstreams["default"] is None and "restart" in upstreams["description"]
    [listed] = [branch for branch in upstreams["anyOf"] if branch.get("type") == "array"]
    assert listed["minItems"] == 1
    assert set(listed["items"]["properties"]) == {"name", "url", "slots", "models", "command",
                                                      "maxLoaded", "memory", "idleUnloadSeconds"}
    assert listed["items"]["required"] == ["name", "url"]
    assert all(sub.get("description") for sub in listed["items"]["properties"].values())
    validator = jsonschema.Draft202012Validator(schema)
    validator.validate(EVERY_ENTRY_KEY)
    validator.validate(parse_config(EVERY_ENTRY_KEY).to_document())
    for bad in ({"upstreams": []}, {"upstreams": "gpu0"}, {"upstreams": [{"name": "GPU0", "url": "http://h:1"}]},
                {"upstreams": [{"name": "a"}]}, {"upstreams": [{"name": "a", "url": "ftp://h"}]},
                {"upstreams": [{"name": "a", "url": "http://h:1", "slots": 0}]},
                {"upstreams": [{"name": "a", "url": "http://h:1", "slot": 2}]},
                {"upstreams": [{"name": "a" * 41, "url": "http://h:1"}]}):
        with pytest.raises(ConfigError):
            parse_config(bad)
        assert list(validator.iter_errors(bad)) != [], bad


# -- refusals: exit 2, the key path and the fix -----------------------------------------------------

BAD_FILES = {
    # name: (document, the one key path, a fragment of its message that says the fix)
    "an empty list": ({"upstreams": []}, "upstreams",
                      "give at least one entry (name, url), or remove upstreams to use upstream.url"),
    "not a list": ({"upstreams": "gpu0"}, "upstreams", "must be a list of upstreams, each a mapping with name and url"),
    "an entry not a mapping": ({"upstreams": ["gpu0"]}, "upstreams[0]", "must be a mapping, got a string 'gpu0'"),
    "a bad name": ({"upstreams": two(name="GPU_1")}, "upstreams[1].name",
                   "lowercase letters, digits and '-', starting and ending with a letter or digit"),
    "a name ending in '-'": ({"upstreams": two(name="gpu-")}, "upstreams[1].name", "(e.g. gpu0)"),
    "a name too long": ({"upstreams": two(name="g" * 41)}, "upstreams[1].name", "must be 1..40"),
    "a name missing": ({"upstreams": [{"url": "http://127.0.0.1:8081"}]}, "upstreams[0].name", "is required"),
    "a url missing": ({"upstreams": [{"name": "gpu0"}]}, "upstreams[0].url", "is required"),
    "a bad url": ({"upstreams": two(url="127.0.0.1:8082")}, "upstreams[1].url",
                  "must be an http:// or https:// URL with a host"),
    "an unknown entry key": ({"upstreams": two(slot=2)}, "upstreams[1].slot", "did you mean 'slots'?"),
    "slots zero": ({"upstreams": two(slots=0)}, "upstreams[1].slots", "must be an integer >= 1, 'auto'"),
    "models not a list": ({"upstreams": two(models="qwen")}, "upstreams[1].models", "must be a list of model ids"),
    "a model id not a string": ({"upstreams": two(models=["qwen", {"id": 1}])}, "upstreams[1].models",
                                "item 2 must be a model id"),
    "a duplicate name": ({"upstreams": two(name="gpu0")}, "upstreams[1].name",
                         "'gpu0' is also upstreams[0].name: give each upstream its own name"),
    "a duplicate url": ({"upstreams": two(url="http://127.0.0.1:8081/")}, "upstreams[1].url",
                        "is also upstreams[0].url (gpu0): each entry is its own llama-server; list it once, or give "
                        "this one its own port"),
    "one server, spelt two ways": ({"upstreams": [{"name": "a", "url": "http://LOCALHOST"},
                                                  {"name": "b", "url": "http://localhost:80"}]},
                                   "upstreams[1].url", "is also upstreams[0].url (a)"),
    "a model no upstream may serve": (
        {"upstreams": [{"name": "gpu0", "url": "http://127.0.0.1:8081", "models": ["small"]},
                       {"name": "gpu1", "url": "http://127.0.0.1:8082", "models": ["small", "mid"]}],
         "models": {"small": {}, "big": {"slots": 2}}},
        "models.big", "no upstream may serve it: every entry of upstreams lists its models and none lists 'big'; "
                      "add it to the models of an upstream that can hold it, or remove models.big"),
    "reserved slots fill an entry's slots": (
        {"upstreams": two(slots=1), "upstream": {"slots": 2},
         "routing": {"scheduler": {"settings": {"serial": {"reservedSlots": 1}}}}},
        "upstreams[1].slots", f"give gpu1 more than 1 slots, or set {RESERVED} below 1"),
    "reserved slots fill the upstream.slots an entry takes": (
        {"upstreams": two(slots=4), "upstream": {"slots": 2},
         "routing": {"scheduler": {"settings": {"serial": {"reservedSlots": 2}}}}},
        "upstreams[0].slots", "unset, it takes upstream.slots (2), which leaves no slot for non-interactive requests"),
    "upstream.url beside upstreams": ({"upstreams": two(), "upstream": {"url": "http://127.0.0.1:8081"}},
                                      "upstream.url", "move it into the entries of upstreams (url: on each) and "
                                                      "remove upstream.url"),
    "upstream.command beside upstreams": ({"upstreams": two(), "upstream": {"command": "llama-server"}},
                                          "upstream.command", "move it into the entries of upstreams (command: on "
                                                              "each)"),
    "upstream.slots that no entry takes": (
        {"upstreams": [{"name": "gpu0", "url": "http://127.0.0.1:8081", "slots": 2},
                       {"name": "gpu1", "url": "http://127.0.0.1:8082", "slots": 1}], "upstream": {"slots": 4}},
        "upstream.slots", "applies to no upstream: every entry of upstreams gives its own slots"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_a_bad_upstreams_file_exits_2_and_names_the_key_path(tmp_path: pathlib.Path, case: str) -> None:
    document, key_path, fragment = BAD_FILES[case]
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(document))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert [p.path for p in info.value.problems] == [key_path]
    assert fragment in info.value.problems[0].message
    result = check_config(path)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "ok" not in result.stdout.splitlines()
    assert f"error: {key_path}: " in result.stderr and fragment in result.stderr


def test_every_problem_of_the_list_is_named_at_once() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({"upstreams": [{"name": "a", "url": "http://h:1", "models": ["x"], "slots": 1},
                                    {"name": "a", "url": "http://h:1", "models": ["x"], "slots": 2}],
                      "models": {"y": {}}, "routing": {"scheduler": {"settings": {"serial": {"reservedSlots": 1}}}}})
    assert [p.path for p in info.value.problems] == [
        "upstreams[1].name", "upstreams[1].url", "models.y", "upstreams[0].slots"]


def test_the_moved_upstream_keys_wait_for_the_list_to_be_right() -> None:
    # `llamaswap up` adds upstream.url and command to a file that names neither: a problem of
    # the list itself must not be buried under those.
    with pytest.raises(ConfigError) as info:
        parse_config({"upstreams": two(name="gpu0"), "upstream": {"url": "http://h:9", "command": "x"}})
    assert [p.path for p in info.value.problems] == ["upstreams[1].name"]


def test_a_reservation_is_still_checked_against_models_slots() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({"upstreams": two(slots=4), "upstream": {"slots": 4}, "models": {"m": {"slots": 1}},
                      "routing": {"scheduler": {"settings": {"serial": {"reservedSlots": 1}}}}})
    assert [str(p) for p in info.value.problems] == [
        f"{RESERVED}: 1 reserved slots leave models.m.slots (1) no slot for non-interactive requests: set it below "
        "1, or raise models.m.slots"]


def test_a_yaml_file_with_upstreams_loads(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "gpus.yaml"
    path.write_text(textwrap.dedent("""\
        upstream:
          slots: 2
        upstreams:
          - {name: gpu0, url: http://127.0.0.1:8081}
          - name: gpu1
            url: http://127.0.0.1:8082
            slots: 1
            models: [qwen3-0.6b]
        """))
    cfg = load_config(path)
    assert [(e.name, e.port, e.slots, e.models) for e in cfg.gpu_entries] == [
        ("gpu0", 8081, 2, None), ("gpu1", 8082, 1, frozenset({"qwen3-0.6b"}))]


def test_up_takes_upstreams_as_naming_the_upstreams() -> None:
    from llamaswap.commands.up import names_an_upstream

    assert names_an_upstream({"upstreams": two()})


# -- reloading -------------------------------------------------------------------------------------


def _parse(document: Any) -> Config:
    return parse_config(document)


@pytest.mark.parametrize("change", [
    {"upstreams": two(url="http://127.0.0.1:9999")},
    {"upstreams": two(name="gpu9")},
    {"upstreams": two(models=["qwen"])},
    {"upstreams": two(slots=2)},
    {"upstreams": two()[:1]},
], ids=["url", "name", "models", "slots", "one fewer"])
def test_a_change_of_the_list_refuses_the_reload(change: dict[str, Any]) -> None:
    assert reload_key("upstreams").on_reload is OnReload.REFUSED
    running = parse_config({"upstreams": two()})
    plan = plan_reload(running, parse_config({**change, "routing": {"scheduler": {"maxQueued": 3}}}), parse=_parse)
    assert plan.refused == ("upstreams",)
    # and an unchanged list lets the rest apply
    plan = plan_reload(running, parse_config({"upstreams": two(), "routing": {"scheduler": {"maxQueued": 3}}}),
                       parse=_parse)
    assert (plan.live, plan.restart, plan.refused) == (("routing",), (), ())


def test_moving_from_upstream_url_to_upstreams_refuses_the_reload() -> None:
    plan = plan_reload(Config(), parse_config({"upstreams": two()}), parse=_parse)
    assert set(plan.refused) == {"upstream.url", "upstreams"}


async def test_the_sidecar_keeps_its_upstreams_when_a_reload_changes_them(tmp_path: pathlib.Path) -> None:
    document = {"upstreams": two()}
    path = tmp_path / "llamaswap.yaml"
    path.write_text(yaml.safe_dump(document))
    sidecar = Sidecar(parse_config(document, source=str(path)), config_path=str(path))
    try:
        path.write_text(yaml.safe_dump({"upstreams": two(url="http://127.0.0.1:9999"),
                                        "routing": {"scheduler": {"maxQueued": 3}}}))
        assert not sidecar.reload()
        assert [e.url for e in sidecar.config.gpu_entries] == ["http://127.0.0.1:8081", "http://127.0.0.1:8082"]
        assert sidecar.coordinator.scheduler.policy.max_queued == 0
    finally:
        await sidecar.close()


def test_moving_from_upstreams_back_to_upstream_url_refuses_the_reload() -> None:
    # The running document has no upstream.command to keep: the refusal must come first.
    plan = plan_reload(parse_config({"upstreams": two()}), Config(), parse=_parse)
    assert set(plan.refused) == {"upstream.url", "upstreams"} and plan.restart == ("upstream.command",)
