"""Idle unloads in the configuration (issue 48): models.<id>.ttl, upstream.idleUnloadSeconds and
each upstreams entry's, llama-swap's globalTTL; what each GPU's policy carries, the errors (key
path and fix, exit 2) and the warning for an upstream that cannot unload."""

from __future__ import annotations

import pytest

from llamaswap.config import ConfigError, parse_config
from llamaswap.config.advice import advice
from llamaswap.config.idle import describe_idle
from llamaswap.core.clock import NS_PER_S
from test_config import check_config, write


def idle_of(document: dict, gpu: str = "gpu0") -> dict[str, float]:
    """Each listed model's idle time on ``gpu`` in seconds (0: never), and the default under ''."""
    config = parse_config(document)
    idle = config.policy().gpu(gpu).residency.idle
    models = {model: idle.after_ns(model) / NS_PER_S for model in config.models}
    return {"": idle.default_s, **models}


def test_nothing_set_is_never() -> None:
    assert idle_of({"models": {"a": {}}}) == {"": 0.0, "a": 0.0}


def test_a_models_ttl_overrides_the_upstreams_idle_time_and_minus_one_takes_it() -> None:
    document = {"upstream": {"idleUnloadSeconds": 300, "maxLoaded": 3},
                "models": {"a": {"ttl": 60}, "b": {"ttl": -1}, "c": {"ttl": 0}, "d": {},
                           "p": {"pinned": True, "ttl": 5}}}
    assert idle_of(document) == {"": 300.0, "a": 60.0, "b": 300.0, "c": 0.0, "d": 300.0, "p": 5.0}
    # (A pinned model is never unloaded whatever its ttl: the core reads it pinned, `test_idle_unload`.)
    assert parse_config(document).policy().gpu("gpu0").residency.pinned == frozenset({"p"})


def test_llama_swaps_global_ttl_is_read_as_idle_unload_seconds() -> None:
    document = {"globalTTL": 120, "models": {"a": {"ttl": 30}, "b": {}}}
    assert idle_of(document) == {"": 120.0, "a": 30.0, "b": 120.0}
    written = parse_config(document).to_document()
    assert (written["globalTTL"], written["upstream"]["idleUnloadSeconds"]) == (120, 120)
    assert parse_config(written) == parse_config(document)  # (the round trip: the two agree)


def test_an_upstreams_entry_has_its_own_or_the_upstreams() -> None:
    document = {"upstream": {"idleUnloadSeconds": 600},
                "upstreams": [{"name": "big", "url": "http://127.0.0.1:9001", "idleUnloadSeconds": 0},
                              {"name": "small", "url": "http://127.0.0.1:9002"}],
                "models": {"a": {"ttl": 10}}}
    assert idle_of(document, "big") == {"": 0.0, "a": 10.0}
    assert idle_of(document, "small") == {"": 600.0, "a": 10.0}


@pytest.mark.parametrize(("document", "expected"), [
    ({"models": {"a": {"ttl": -5}}},
     "models.a.ttl: must be the seconds this model may sit idle before it is unloaded (>= 0.001), 0 to never unload "
     "it, or -1 (or leave it out) for its upstream's idleUnloadSeconds; got a number -5"),
    ({"models": {"a": {"ttl": "5m"}}},
     "models.a.ttl: must be the seconds this model may sit idle before it is unloaded (>= 0.001), 0 to never unload "
     "it, or -1 (or leave it out) for its upstream's idleUnloadSeconds; got a string '5m'"),
    ({"upstream": {"idleUnloadSeconds": -1}}, "upstream.idleUnloadSeconds: must be >= 0 (0 = never), got -1"),
    ({"globalTTL": 60, "upstream": {"idleUnloadSeconds": 30}},
     "globalTTL: is llama-swap's name of upstream.idleUnloadSeconds, which this file sets to 30: keep one of them"),
    ({"globalTTL": -60}, "globalTTL: must be >= 0 (null = upstream.idleUnloadSeconds), got -60"),
])
def test_bad_idle_times_name_the_key_and_the_fix(document: dict, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(document)
    assert [str(problem) for problem in info.value.problems] == [expected]


def test_a_negative_ttl_exits_2_from_check_config(tmp_path) -> None:
    path = write(tmp_path, "models:\n  a:\n    ttl: -3\n")
    result = check_config(path.name, tmp_path)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "error: models.a.ttl: " in result.stderr


def test_a_single_model_llama_server_cannot_unload_and_is_warned_about() -> None:
    single = parse_config({"upstream": {"idleUnloadSeconds": 60,
                                        "command": "llama-server -m /models/a.gguf --port 8081"}})
    assert [(problem.path, "cannot be unloaded" in problem.message) for problem in advice(single)] == [
        ("upstream.idleUnloadSeconds", True)]
    router = parse_config({"upstream": {"idleUnloadSeconds": 60,
                                        "command": "llama-server --models-dir /models --port 8081"}})
    assert advice(router) == []
    never = parse_config({"upstream": {"command": "llama-server -m /models/a.gguf --port 8081"}})
    assert advice(never) == []


def test_check_config_explains_the_idle_times(tmp_path) -> None:
    assert describe_idle(parse_config({})) == []
    config = parse_config({"upstream": {"idleUnloadSeconds": 600, "maxLoaded": 3},
                           "models": {"chat": {"ttl": 3600}, "draft": {"ttl": 0}, "embed": {}}})
    assert describe_idle(config) == [
        "gpu0: a model idle 600 s is unloaded (upstream.idleUnloadSeconds); chat after 3600 s, draft never "
        "(models.<id>.ttl)"]
    own = parse_config({"globalTTL": 0, "models": {"chat": {"ttl": 30}}})
    assert describe_idle(own) == ["gpu0: no model is unloaded for idleness (globalTTL: 0); chat after 30 s "
                                  "(models.<id>.ttl)"]
    path = write(tmp_path, "upstream: {url: 'http://127.0.0.1:9', idleUnloadSeconds: 60}\n")
    result = check_config(path.name, tmp_path)
    assert result.returncode == 0, result.stderr
    assert "  gpu0: a model idle 60 s is unloaded (upstream.idleUnloadSeconds)" in result.stdout.splitlines()
