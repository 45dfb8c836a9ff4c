"""The chart with `inferencePool.enabled` (charts/llamaswap/ci/inference-pool-values.yaml): every
rendered document validated (core kinds by kubernetes-validate, the inference kinds against their
field lists, the endpoint picker's configuration read as llm-d's router reads it), and wired to
the pods: the pool selects them at Envoy's port, their engine-type label picks llamaswap's engine
config, whose specs name gauges the sidecar serves; the objectives are the sidecar's
routing.objectives. test_chart.py covers the same values file for lint, bootstrap and check-config."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml

import chart_tools as ct
from inference_kinds import KINDS, PickerConfigError, problems, read_picker_config
from picker import SpecError
from llamaswap.config import parse_config
from llamaswap.core.priority import ALIASES
from llamaswap.envoy.contract import PICKER_METRICS_PATH
from llamaswap.telemetry import instruments

VALUES = ct.load_values(ct.CHART / "ci" / "inference-pool-values.yaml")
ENGINE_LABEL = "llm-d.ai/engine-type"


@pytest.fixture(scope="module")
def rendered() -> ct.Rendered:
    return ct.render(VALUES)


def picker_config(rendered: ct.Rendered) -> Any:
    return yaml.safe_load(rendered.configmap_file("-epp", "llamaswap-epp.yaml"))


def test_every_document_is_valid(rendered: ct.Rendered) -> None:
    kinds = {(m["apiVersion"], m["kind"]) for m in rendered.manifests}
    assert {("inference.networking.k8s.io/v1", "InferencePool"), ("llm-d.ai/v1alpha2", "InferenceObjective")} <= kinds
    errors = []
    for manifest in rendered.manifests:
        key = (manifest["apiVersion"], manifest["kind"])
        if key in KINDS:
            errors += [f"{manifest['kind']}/{manifest['metadata']['name']}: {p}" for p in problems(manifest)]
        elif key not in ct.CRD_KINDS:
            error = ct.validate_manifest(manifest)
            if error:
                errors.append(error)
    assert not errors, "\n".join(errors)
    read_picker_config(picker_config(rendered))  # raises what the router would refuse


def test_the_field_lists_refuse_what_the_api_refuses(rendered: ct.Rendered) -> None:
    """The checker itself: a missing required field, an unknown one, a bad enum or range fails."""
    pool = rendered.find("InferencePool")
    objective = rendered.all("InferenceObjective")[0]
    broken = []
    for change in (lambda m: m["spec"].pop("targetPorts"), lambda m: m["spec"].update(selector={"app": "x"}),
                   lambda m: m["spec"]["endpointPickerRef"].update(failureMode="Sometimes"),
                   lambda m: m["spec"]["endpointPickerRef"].pop("port"),
                   lambda m: m["spec"]["targetPorts"][0].update(number=70000),
                   lambda m: m["spec"].update(extensionRef={"name": "epp"})):
        manifest = copy.deepcopy(pool)
        change(manifest)
        broken.append(problems(manifest))
    for change in (lambda m: m["spec"].pop("poolRef"), lambda m: m["spec"].update(priority=2**31),
                   lambda m: m["spec"].update(criticality="Critical")):
        manifest = copy.deepcopy(objective)
        change(manifest)
        broken.append(problems(manifest))
    assert all(broken), broken


def test_the_pool_selects_the_pods_at_envoys_port(rendered: ct.Rendered) -> None:
    pool = rendered.find("InferencePool")
    template = rendered.deployment["spec"]["template"]
    labels = template["metadata"]["labels"]
    selector = pool["spec"]["selector"]["matchLabels"]
    assert selector and all(labels.get(key) == value for key, value in selector.items())
    # Only the llamaswap pods: no other pod template of the release matches.
    for other in rendered.all("Deployment"):
        if other is not rendered.deployment:
            other_labels = other["spec"]["template"]["metadata"]["labels"]
            assert not all(other_labels.get(key) == value for key, value in selector.items())
    envoy_port = next(p["containerPort"] for p in rendered.container("envoy")["ports"] if p["name"] == "http")
    assert pool["spec"]["targetPorts"] == [{"number": envoy_port}]
    assert pool["spec"]["endpointPickerRef"] == {"name": "epp", "port": {"number": 9002}, "failureMode": "FailOpen"}
    assert pool["spec"]["appProtocol"] == "http"
    assert rendered.deployment["spec"]["replicas"] == 2


def test_the_engine_label_picks_llamaswaps_gauges(rendered: ct.Rendered) -> None:
    labels = rendered.deployment["spec"]["template"]["metadata"]["labels"]
    config = read_picker_config(picker_config(rendered))
    engine = config.engines[labels[ENGINE_LABEL]]
    assert labels[ENGINE_LABEL] == "llamaswap"
    # Each spec names a gauge the sidecar serves, with no label matcher (one series each).
    assert {key: (spec.name, spec.labels) for key, spec in engine.specs.items()} == {
        "queuedRequestsSpec": (instruments.WAITING, {}),
        "runningRequestsSpec": (instruments.GPU_SLOTS_BUSY, {}),
        "kvUsageSpec": (instruments.SATURATION, {}),
        "loraSpec": (instruments.MODELS_INFO, {}),
    }
    assert set(config.profiles["default"]) == {"queue-scorer", "kv-cache-utilization-scorer",
                                               "lora-affinity-scorer", "max-score-picker"}
    # The source reads the pods' picker page, which Envoy's listener routes to the sidecar.
    assert config.plugins["metrics-data-source"][0] == "metrics-data-source"
    assert config.metrics_path == PICKER_METRICS_PATH
    assert config.plugins["core-metrics-extractor"][0] == "core-metrics-extractor"


def test_the_objectives_are_the_sidecars_priorities(rendered: ct.Rendered) -> None:
    pool = rendered.find("InferencePool")["metadata"]["name"]
    objectives = {m["metadata"]["name"]: m["spec"] for m in rendered.all("InferenceObjective")}
    assert {m["apiVersion"] for m in rendered.all("InferenceObjective")} == {"llm-d.ai/v1alpha2"}
    assert {name: spec["priority"] for name, spec in objectives.items()} == ALIASES
    assert objectives["batch"]["priority"] < 0  # sheddable
    assert all(spec["poolRef"]["name"] == pool for spec in objectives.values())
    config = parse_config(yaml.safe_load(rendered.sidecar_config))
    assert dict(config.routing.objectives) == ALIASES


def test_custom_objectives_reach_the_sidecar_unless_the_config_names_its_own() -> None:
    items = [{"name": "chat", "priority": 80}, {"name": "offline", "priority": -20}]
    values = ct.merge_values(VALUES, {"inferencePool": {"objectives": {"items": items}}})
    rendered = ct.render(values)
    assert sorted(m["metadata"]["name"] for m in rendered.all("InferenceObjective")) == ["chat", "offline"]
    assert dict(parse_config(yaml.safe_load(rendered.sidecar_config)).routing.objectives) == {
        "chat": 80, "offline": -20}
    own = ct.merge_values(values, {"config": {"routing": {"objectives": {"chat": "interactive"}}}})
    assert dict(parse_config(yaml.safe_load(ct.render(own).sidecar_config)).routing.objectives) == {"chat": 100}
    legacy = ct.render(ct.merge_values(VALUES, {"inferencePool": {"objectives": {
        "apiVersion": "inference.networking.x-k8s.io/v1alpha2"}}}))
    assert {m["apiVersion"] for m in legacy.all("InferenceObjective")} == {"inference.networking.x-k8s.io/v1alpha2"}
    assert all(not problems(m) for m in legacy.all("InferenceObjective"))
    none = ct.render(ct.merge_values(VALUES, {"inferencePool": {"objectives": {"create": False}}}))
    assert not none.all("InferenceObjective")
    assert "objectives" not in (yaml.safe_load(none.sidecar_config).get("routing") or {})


def test_extra_picker_config_and_other_names() -> None:
    values = ct.merge_values(VALUES, {"inferencePool": {
        "name": "gemma-pool", "engineType": "llamaswap-l4",
        "endpointPicker": {"serviceName": "", "extraConfig": {"featureGates": ["flowControl"]}}}})
    rendered = ct.render(values)
    pool = rendered.named("InferencePool", "gemma-pool")
    assert pool["spec"]["endpointPickerRef"]["name"] == "llm-llamaswap-epp"
    document = picker_config(rendered)
    assert document["featureGates"] == ["flowControl"]
    assert set(read_picker_config(document).engines) == {"llamaswap-l4"}
    assert rendered.deployment["spec"]["template"]["metadata"]["labels"][ENGINE_LABEL] == "llamaswap-l4"
    assert all(m["spec"]["poolRef"]["name"] == "gemma-pool" for m in rendered.all("InferenceObjective"))


def test_off_by_default() -> None:
    rendered = ct.render()
    assert not any((m["apiVersion"], m["kind"]) in KINDS for m in rendered.manifests)
    assert not rendered.has("ConfigMap", "-epp")
    assert ENGINE_LABEL not in rendered.deployment["spec"]["template"]["metadata"]["labels"]


def test_the_schema_refuses_a_bad_spec_or_objective() -> None:
    helm = ct.helm()
    for bad in ({"engineConfig": {"queuedRequestsSpec": "not a metric"}},
                {"objectives": {"items": [{"name": "Batch", "priority": -1}]}},
                {"objectives": {"items": [{"name": "huge", "priority": 2**31}]}},
                {"endpointPicker": {"failureMode": "Maybe"}}):
        with pytest.raises(Exception) as caught:
            ct.render(ct.merge_values(VALUES, {"inferencePool": bad}))
        assert "values" in str(caught.value).lower() or "schema" in str(caught.value).lower(), caught.value
    assert helm is not None


def test_the_picker_config_reader_refuses_what_the_router_refuses(rendered: ct.Rendered) -> None:
    good = picker_config(rendered)
    for change in (lambda d: d["plugins"].append({"type": "queue-scorer"}),  # a name taken twice
                   lambda d: d["plugins"][1].pop("type"),
                   lambda d: d.update(data={"sources": []}),  # not a field of the strict decoder
                   lambda d: d.pop("schedulingProfiles"),
                   lambda d: d["plugins"][0]["parameters"].update(metricsPath="/m"),
                   lambda d: d["plugins"][1]["parameters"].update(engines=[]),
                   lambda d: d["plugins"][1].update(name="llamaswap-metrics"),  # not wired by default
                   lambda d: d.update(dataLayer={"sources": [{"pluginRef": "nope", "extractors": []}]}),
                   lambda d: d["schedulingProfiles"][0]["plugins"].append({"pluginRef": "nope"}),
                   lambda d: d.update(kind="Config"),
                   lambda d: d["plugins"][1]["parameters"]["engineConfigs"].append({"name": "llamaswap"}),
                   lambda d: d["plugins"][1]["parameters"]["engineConfigs"][0].update(kvUsage="x")):
        document = copy.deepcopy(good)
        change(document)
        with pytest.raises(PickerConfigError):
            read_picker_config(document)
    document = copy.deepcopy(good)
    document["plugins"][1]["parameters"]["engineConfigs"][0]["loraSpec"] = "info{max_lora}"
    with pytest.raises(SpecError):
        read_picker_config(document)


def test_a_pool_rendered_by_llm_ds_chart() -> None:
    """inferencePool.create: false: llm-d's chart renders the pool; the labels, the picker's
    configuration and the objectives (naming that pool) are still this chart's."""
    rendered = ct.render(ct.merge_values(VALUES, {"inferencePool": {"create": False, "name": "llamaswap-epp"}}))
    assert not rendered.all("InferencePool")
    assert rendered.has("ConfigMap", "-epp")
    assert rendered.deployment["spec"]["template"]["metadata"]["labels"][ENGINE_LABEL] == "llamaswap"
    assert {m["spec"]["poolRef"]["name"] for m in rendered.all("InferenceObjective")} == {"llamaswap-epp"}


def test_an_extractor_under_another_name_counts_once_the_data_layer_wires_it(rendered: ct.Rendered) -> None:
    document = picker_config(rendered)
    document["plugins"][1]["name"] = "llamaswap-metrics"
    document["dataLayer"] = {"sources": [{"pluginRef": "metrics-data-source",
                                          "extractors": [{"pluginRef": "llamaswap-metrics"}]}]}
    assert set(read_picker_config(document).engines) == {"llamaswap"}


def test_the_notes_say_where_the_picker_configuration_is(rendered: ct.Rendered) -> None:
    assert "InferencePool llm-llamaswap" in rendered.notes
    assert "get configmap llm-llamaswap-epp -o jsonpath='{.data.llamaswap-epp\\.yaml}'" in rendered.notes
    assert "(interactive, normal, batch)" in rendered.notes
    assert "InferencePool" not in ct.render().notes
