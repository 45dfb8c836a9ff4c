"""The chart's llamaServer.idleUnloadSeconds (issue 48), without a cluster: the sidecar's
upstream.idleUnloadSeconds, what the chart refuses, and the rendered configuration passing the
sidecar's own check."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

import chart_tools as ct

from llamaswap.config import parse_config
from llamaswap.core.clock import NS_PER_S


def _config(rendered: ct.Rendered) -> dict[str, Any]:
    return yaml.safe_load(rendered.sidecar_config)


def test_the_default_writes_nothing_new() -> None:
    rendered = ct.render()
    assert "idleUnloadSeconds" not in (_config(rendered).get("upstream") or {})
    assert ct.render({"llamaServer": {"idleUnloadSeconds": 0}}).files == rendered.files


def test_it_is_the_sidecars_idle_unload_seconds_on_every_gpu() -> None:
    rendered = ct.render({"llamaServer": {"idleUnloadSeconds": 600, "maxLoaded": 2},
                          "config": {"models": {"chat": {"ttl": 60}}}})
    config = parse_config(_config(rendered))
    idle = config.policy().gpu("gpu0").residency.idle
    assert (idle.after_ns("chat"), idle.after_ns("other")) == (60 * NS_PER_S, 600 * NS_PER_S)
    two = parse_config(_config(ct.render({"llamaServer": {"idleUnloadSeconds": 30, "gpus": 2}})))
    assert [entry.idle_unload_s for entry in two.gpu_entries] == [30.0, 30.0]


def test_the_same_number_in_both_places_renders_and_two_numbers_are_refused() -> None:
    same = ct.render({"llamaServer": {"idleUnloadSeconds": 60}, "config": {"upstream": {"idleUnloadSeconds": 60}}})
    assert _config(same)["upstream"]["idleUnloadSeconds"] == 60
    helm = ct.helm()
    with pytest.raises(helm.HelmError) as refused:
        ct.render({"llamaServer": {"idleUnloadSeconds": 60}, "config": {"upstream": {"idleUnloadSeconds": 30}}})
    assert "config.upstream.idleUnloadSeconds is 30 and llamaServer.idleUnloadSeconds is 60" in str(refused.value)


@pytest.mark.parametrize("value", [-1, "10m"])
def test_the_values_schema_refuses_a_bad_idle_time(value: Any) -> None:
    helm = ct.helm()
    with pytest.raises(helm.HelmValuesError) as refused:
        ct.render({"llamaServer": {"idleUnloadSeconds": value}})
    assert "/llamaServer/idleUnloadSeconds" in str(refused.value), str(refused.value)
