"""The inference kinds the chart renders, as field lists, and the endpoint picker's
configuration read the way llm-d's router reads it. No cluster or EPP binary runs here
(facts/components.md, "Many nodes"); the lists follow the API types as of 2026-08:
InferencePool `inference.networking.k8s.io/v1` (gateway-api-inference-extension
`api/v1/inferencepool_types.go`), InferenceObjective `llm-d.ai/v1alpha2` and the legacy
`inference.networking.x-k8s.io/v1alpha2` (llm-d-router `apix/v1alpha2`, which the router reads
in either group, preferring llm-d.ai), EndpointPickerConfig `llm-d.ai/v1alpha1` (llm-d-router
`apix/config/v1alpha1`, decoded strictly; the old `inference.networking.x-k8s.io/v1alpha1` is
still read, with a deprecation notice).

A field spec is a type (str, int, dict for a map of strings), an `Obj` (fields, which of them
are required; any other field is refused, as a structural CRD schema would drop it) or a
`ListOf` an element spec with bounds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from picker import MetricSpec, parse_spec

INT32 = (-(2**31), 2**31 - 1)


@dataclasses.dataclass(frozen=True)
class Obj:
    fields: Mapping[str, Any]
    required: frozenset[str] = frozenset()


@dataclasses.dataclass(frozen=True)
class ListOf:
    item: Any
    min_items: int = 0
    max_items: int | None = None


@dataclasses.dataclass(frozen=True)
class Int:
    low: int
    high: int


@dataclasses.dataclass(frozen=True)
class OneOf:
    values: frozenset[str]


STRING_MAP = "string map"

_PORT = Obj({"number": Int(1, 65535)}, frozenset({"number"}))
_METADATA = Obj({"name": str, "namespace": str, "labels": STRING_MAP, "annotations": STRING_MAP},
                frozenset({"name"}))

_POOL_REF = Obj({"group": str, "kind": str, "name": str}, frozenset({"name"}))
_OBJECTIVE = Obj({
    "apiVersion": str, "kind": str, "metadata": _METADATA,
    "spec": Obj({
        "priority": Int(*INT32),
        "poolRef": _POOL_REF,
        "poolRefs": ListOf(_POOL_REF, 1),
        "poolSelector": Obj({"matchLabels": STRING_MAP, "matchExpressions": ListOf(dict)}),
    }),
}, frozenset({"apiVersion", "kind", "metadata", "spec"}))
OBJECTIVE_VERSIONS = ("llm-d.ai/v1alpha2", "inference.networking.x-k8s.io/v1alpha2")

KINDS: dict[tuple[str, str], Obj] = {
    ("inference.networking.k8s.io/v1", "InferencePool"): Obj({
        "apiVersion": str, "kind": str, "metadata": _METADATA,
        "spec": Obj({
            "selector": Obj({"matchLabels": STRING_MAP}, frozenset({"matchLabels"})),
            "targetPorts": ListOf(_PORT, 1, 8),
            "appProtocol": OneOf(frozenset({"http", "kubernetes.io/h2c"})),
            "endpointPickerRef": Obj({
                "group": str, "kind": str, "name": str, "port": _PORT,
                "failureMode": OneOf(frozenset({"FailOpen", "FailClose"})),
            }, frozenset({"name"})),
        }, frozenset({"selector", "targetPorts"})),
    }, frozenset({"apiVersion", "kind", "metadata", "spec"})),
    **{(version, "InferenceObjective"): _OBJECTIVE for version in OBJECTIVE_VERSIONS},
}


def problems(manifest: Mapping[str, Any]) -> list[str]:
    """What is wrong with an inference-extension manifest ([] when it fits its field list)."""
    spec = KINDS.get((manifest.get("apiVersion", ""), manifest.get("kind", "")))
    if spec is None:
        return [f"unknown kind {manifest.get('apiVersion')}/{manifest.get('kind')}"]
    found: list[str] = []
    _check(manifest, spec, manifest.get("kind", "?"), found)
    spec = manifest.get("spec") if isinstance(manifest.get("spec"), dict) else {}
    endpoint_picker = spec.get("endpointPickerRef")
    # The port is needed when the reference is a Service (the default kind).
    if isinstance(endpoint_picker, dict) and endpoint_picker.get("kind", "Service") == "Service" \
            and "port" not in endpoint_picker:
        found.append("spec.endpointPickerRef.port: required for a Service")
    ports = [port.get("number") for port in spec.get("targetPorts") or [] if isinstance(port, dict)]
    if len(ports) != len(set(ports)):
        found.append("spec.targetPorts: port numbers must be unique")
    labels = (spec.get("selector") or {}).get("matchLabels") if isinstance(spec.get("selector"), dict) else None
    if isinstance(labels, dict) and not 1 <= len(labels) <= 64:
        found.append("spec.selector.matchLabels: 1 to 64 labels")
    if manifest.get("kind") == "InferenceObjective" and not any(spec.get(k) for k in ("poolRef", "poolRefs")) \
            and "poolSelector" not in spec:
        found.append("spec: one of poolRef, poolRefs, poolSelector is needed")
    return found


def _check(value: Any, spec: Any, path: str, found: list[str]) -> None:
    if isinstance(spec, Obj):
        if not isinstance(value, dict):
            found.append(f"{path}: expected an object, got {value!r}")
            return
        for key in sorted(spec.required - value.keys()):
            found.append(f"{path}.{key}: required")
        for key, item in value.items():
            if key not in spec.fields:
                found.append(f"{path}.{key}: unknown field")
            else:
                _check(item, spec.fields[key], f"{path}.{key}", found)
    elif isinstance(spec, ListOf):
        if not isinstance(value, list):
            found.append(f"{path}: expected a list, got {value!r}")
            return
        if len(value) < spec.min_items or (spec.max_items is not None and len(value) > spec.max_items):
            found.append(f"{path}: {len(value)} items, not within {spec.min_items}..{spec.max_items}")
        for index, item in enumerate(value):
            _check(item, spec.item, f"{path}[{index}]", found)
    elif isinstance(spec, Int):
        if not isinstance(value, int) or isinstance(value, bool) or not spec.low <= value <= spec.high:
            found.append(f"{path}: expected an integer in {spec.low}..{spec.high}, got {value!r}")
    elif isinstance(spec, OneOf):
        if value not in spec.values:
            found.append(f"{path}: expected one of {sorted(spec.values)}, got {value!r}")
    elif spec == STRING_MAP:
        if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
            found.append(f"{path}: expected a map of strings, got {value!r}")
    elif not isinstance(value, spec) or (spec is str and not value):
        found.append(f"{path}: expected a non-empty {spec.__name__}, got {value!r}")


# ---- the endpoint picker's configuration -----------------------------------------------------

EPP_API_VERSIONS = ("llm-d.ai/v1alpha1", "inference.networking.x-k8s.io/v1alpha1")  # the second deprecated
EPP_KIND = "EndpointPickerConfig"
# The top-level fields the router's strict decoder knows.
EPP_FIELDS = {"apiVersion", "kind", "featureGates", "plugins", "schedulingProfiles", "dataLayer", "flowControl",
              "requestHandler", "saturationDetector", "parser"}
METRICS_SOURCE = "metrics-data-source"
METRICS_EXTRACTOR = "core-metrics-extractor"
SPEC_KEYS = ("queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec", "loraSpec", "cacheInfoSpec")
# Each plugin's parameters are decoded strictly too: the fields of these two.
SOURCE_PARAMETERS = {"scheme", "path", "port", "insecureSkipVerify", "caCertPath", "clientCertPath", "clientKeyPath",
                     "interval"}
EXTRACTOR_PARAMETERS = {"engineLabelKey", "defaultEngine", "engineConfigs"}
ENGINE_FIELDS = {"name", *SPEC_KEYS, "cacheBlockSizeLabelName", "cacheNumBlocksLabelName", "cacheBlockSizeSpec",
                 "cacheNumBlocksSpec", "customMetrics"}


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    name: str
    specs: dict[str, MetricSpec]


@dataclasses.dataclass(frozen=True)
class PickerConfig:
    plugins: dict[str, tuple[str, dict[str, Any]]]  # name -> (type, parameters)
    profiles: dict[str, list[str]]  # profile -> the plugin names it refers to
    engines: dict[str, EngineConfig]
    metrics_path: str  # where the metrics data source reads each endpoint


class PickerConfigError(ValueError):
    """A configuration the router would refuse at start."""


def read_picker_config(document: Any) -> PickerConfig:
    """An EndpointPickerConfig as the router loads it: known top-level fields, plugins and
    profiles present; every plugin a `type` (its `name` defaults to the type, names unique) with
    a map of `parameters` (the metrics source's and extractor's fields known); every profile's
    pluginRefs name a plugin; each engine config of the metrics extractor a unique name, known
    fields and specs that parse (name plus label matchers)."""
    if not isinstance(document, dict):
        raise PickerConfigError("not a mapping")
    if document.get("apiVersion") not in EPP_API_VERSIONS or document.get("kind") != EPP_KIND:
        raise PickerConfigError(f"apiVersion/kind {document.get('apiVersion')}/{document.get('kind')}")
    unknown = set(document) - EPP_FIELDS
    if unknown:
        raise PickerConfigError(f"unknown fields {sorted(unknown)}")
    if not isinstance(document.get("plugins"), list) or not isinstance(document.get("schedulingProfiles"), list):
        raise PickerConfigError("plugins and schedulingProfiles are required")
    plugins: dict[str, tuple[str, dict[str, Any]]] = {}
    for index, plugin in enumerate(document.get("plugins") or []):
        if not isinstance(plugin, dict) or not isinstance(plugin.get("type"), str) or not plugin["type"]:
            raise PickerConfigError(f"plugins[{index}]: needs a type")
        unknown = set(plugin) - {"type", "name", "parameters"}
        if unknown:
            raise PickerConfigError(f"plugins[{index}]: unknown fields {sorted(unknown)}")
        name = plugin.get("name") or plugin["type"]
        if name in plugins:
            raise PickerConfigError(f"plugins[{index}]: the name {name!r} is taken")
        parameters = plugin.get("parameters") or {}
        if not isinstance(parameters, dict):
            raise PickerConfigError(f"plugins[{index}].parameters: not a mapping")
        plugins[name] = (plugin["type"], parameters)
    profiles: dict[str, list[str]] = {}
    for index, profile in enumerate(document.get("schedulingProfiles") or []):
        if not isinstance(profile, dict) or not profile.get("name"):
            raise PickerConfigError(f"schedulingProfiles[{index}]: needs a name")
        refs = []
        for ref in profile.get("plugins") or []:
            name = ref.get("pluginRef") if isinstance(ref, dict) else None
            if name not in plugins:
                raise PickerConfigError(f"schedulingProfiles[{index}]: pluginRef {name!r} names no plugin")
            refs.append(name)
        profiles[profile["name"]] = refs
    wired = _wired_extractors(document.get("dataLayer"), plugins)
    engines: dict[str, EngineConfig] = {}
    metrics_path = "/metrics"
    for name, (kind, parameters) in plugins.items():
        if kind in (METRICS_SOURCE, METRICS_EXTRACTOR) and name not in wired:
            raise PickerConfigError(f"plugin {name}: no data layer source wires it (name it {kind}, or list it "
                                    "under dataLayer.sources)")
        if kind == METRICS_SOURCE:
            unknown = set(parameters) - SOURCE_PARAMETERS
            if unknown:
                raise PickerConfigError(f"plugin {name}: unknown parameters {sorted(unknown)}")
            metrics_path = parameters.get("path") or metrics_path
        if kind != METRICS_EXTRACTOR:
            continue
        unknown = set(parameters) - EXTRACTOR_PARAMETERS
        if unknown:
            raise PickerConfigError(f"plugin {name}: unknown parameters {sorted(unknown)}")
        for index, engine in enumerate(parameters.get("engineConfigs") or []):
            where = f"plugin {name}: engineConfigs[{index}]"
            if not isinstance(engine, dict) or not isinstance(engine.get("name"), str) or not engine["name"]:
                raise PickerConfigError(f"{where}: needs a name")
            unknown = set(engine) - ENGINE_FIELDS
            if unknown:
                raise PickerConfigError(f"{where}: unknown fields {sorted(unknown)}")
            if engine["name"] in engines:
                raise PickerConfigError(f"{where}: engine {engine['name']!r} configured twice")
            specs = {key: parse_spec(str(engine[key])) for key in SPEC_KEYS if engine.get(key)}
            engines[engine["name"]] = EngineConfig(engine["name"], specs)
    return PickerConfig(plugins, profiles, engines, metrics_path)


def _wired_extractors(data_layer: Any, plugins: dict[str, tuple[str, dict[str, Any]]]) -> set[str]:
    """The plugins the data layer runs: its sources and their extractors, plus (unless
    injectDefaults is false or a metrics source is listed) the default pair, which the router
    wires by the names `metrics-data-source` and `core-metrics-extractor`."""
    wired: set[str] = set()
    sources = []
    inject = True
    if data_layer is not None:
        if not isinstance(data_layer, dict):
            raise PickerConfigError("dataLayer: not a mapping")
        inject = data_layer.get("injectDefaults", True) is not False
        sources = data_layer.get("sources") or []
    for index, source in enumerate(sources):
        ref = source.get("pluginRef") if isinstance(source, dict) else None
        if ref not in plugins:
            raise PickerConfigError(f"dataLayer.sources[{index}]: pluginRef {ref!r} names no plugin")
        wired.add(ref)
        for extractor in source.get("extractors") or []:
            name = extractor.get("pluginRef") if isinstance(extractor, dict) else None
            if name not in plugins:
                raise PickerConfigError(f"dataLayer.sources[{index}]: extractor {name!r} names no plugin")
            wired.add(name)
    if inject and not any(ref == METRICS_SOURCE for ref in wired):
        wired.update({METRICS_SOURCE, METRICS_EXTRACTOR})
    return wired
