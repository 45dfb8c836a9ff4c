"""The chart's llamaServer.maxLoaded (issue 37), without a cluster: llama-server's --models-max and
the sidecar's upstream.maxLoaded, one number; what the chart refuses; and the rendered
configuration passing the sidecar's own check."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

import chart_tools as ct

from llamaswap.config import parse_config


def _arg(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def _config(rendered: ct.Rendered) -> dict[str, Any]:
    return yaml.safe_load(rendered.sidecar_config)


def _servers(rendered: ct.Rendered) -> list[dict[str, Any]]:
    return [c for c in rendered.pod_spec["containers"] if c["name"].startswith("llama-server")]


def test_the_default_keeps_one_model_and_writes_nothing_new() -> None:
    rendered = ct.render()
    assert _arg(rendered.container("llama-server")["args"], "--models-max") == "1"
    assert "maxLoaded" not in (_config(rendered).get("upstream") or {})
    assert parse_config(_config(rendered)).residency_of("gpu0").max_loaded == 1
    assert ct.render({"llamaServer": {"maxLoaded": 1}}).files == rendered.files


def test_max_loaded_is_the_routers_models_max_and_the_sidecars_max_loaded() -> None:
    rendered = ct.render({"llamaServer": {"maxLoaded": 3}, "config": {"upstream": {"slots": 2}}})
    assert _arg(rendered.container("llama-server")["args"], "--models-max") == "3"
    config = _config(rendered)
    assert (config["upstream"]["maxLoaded"], config["upstream"]["slots"]) == (3, 2)
    assert parse_config(config).residency_of("gpu0").max_loaded == 3


def test_on_several_gpus_each_router_and_each_upstream_keeps_n() -> None:
    rendered = ct.render({"llamaServer": {"gpus": 2, "maxLoaded": 4}})
    assert [_arg(c["args"], "--models-max") for c in _servers(rendered)] == ["4", "4"]
    config = parse_config(_config(rendered))
    assert [(e.name, e.max_loaded) for e in config.gpu_entries] == [("gpu0", 4), ("gpu1", 4)]


def test_pins_and_a_budget_in_config_go_with_it() -> None:
    values = {"llamaServer": {"maxLoaded": 2},
              "config": {"upstream": {"memory": "80GiB", "maxLoaded": 2},
                         "models": {"embed": {"memory": "1GiB", "pinned": True}, "chat": {"memory": "40GiB"}}}}
    residency = parse_config(_config(ct.render(values))).residency_of("gpu0")
    assert (residency.max_loaded, residency.pinned, residency.memory_bytes) == (2, frozenset({"embed"}), 80 << 30)


@pytest.mark.parametrize(("values", "message"), [
    ({"llamaServer": {"maxLoaded": 1}, "config": {"upstream": {"maxLoaded": 3}}},
     "config.upstream.maxLoaded is 3 and llamaServer.maxLoaded is 1"),
    ({"llamaServer": {"modelsMax": 3}}, "llamaServer.modelsMax (3) is renamed llamaServer.maxLoaded"),
])
def test_what_the_chart_refuses(values: dict[str, Any], message: str) -> None:
    helm = ct.helm()
    with pytest.raises(helm.HelmError) as refused:
        ct.render(values)
    assert message in str(refused.value), str(refused.value)


def test_an_old_models_max_equal_to_max_loaded_still_renders() -> None:
    rendered = ct.render({"llamaServer": {"modelsMax": 1}})
    assert _arg(rendered.container("llama-server")["args"], "--models-max") == "1"


def test_your_own_args_keep_your_max_loaded() -> None:
    rendered = ct.render({"llamaServer": {"args": ["--models-dir", "/models", "--models-max", "5"]},
                          "config": {"upstream": {"maxLoaded": 5}}})
    assert _config(rendered)["upstream"]["maxLoaded"] == 5


@pytest.mark.parametrize("value", [0, -1, 1.5, "2"])
def test_the_values_schema_refuses_a_bad_max_loaded(value: Any) -> None:
    helm = ct.helm()
    with pytest.raises(helm.HelmValuesError) as refused:
        ct.render({"llamaServer": {"maxLoaded": value}})
    assert "/llamaServer/maxLoaded" in str(refused.value), str(refused.value)


def test_max_loaded_lints_clean() -> None:
    values = {"llamaServer": {"gpus": 2, "maxLoaded": 3}}
    report = ct.lint(values)
    assert not report["errors"] and not [m for m in report["messages"] if m["severity"] >= 2], report
