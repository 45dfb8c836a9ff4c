"""The chart with several GPUs in one pod (llamaServer.gpus, issue 27), without a cluster: the
pod's llama-server containers (one GPU each, their own ports, the shared models volume), the
upstreams the chart writes into the configuration file for them, what the values schema
refuses, and, once the sidecar reads `upstreams`, the config check and the bootstrap the
envoy-config init container writes from that file.
"""

from __future__ import annotations

import contextlib
import json
import pathlib
import re
import subprocess
import sys
from typing import Any

import pytest
import yaml

import chart_tools as ct

from llamaswap.config import parse_config  # noqa: E402

GPU = "nvidia.com/gpu"


def _llama_servers(rendered: ct.Rendered) -> list[dict[str, Any]]:
    return [c for c in rendered.pod_spec["containers"] if c["name"].startswith("llama-server")]


def _arg(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def _config(rendered: ct.Rendered) -> dict[str, Any]:
    return yaml.safe_load(rendered.sidecar_config)


def _all_env_names(rendered: ct.Rendered) -> set[str]:
    pod = rendered.pod_spec
    return {e["name"] for c in pod.get("initContainers", []) + pod["containers"] for e in c.get("env", [])}


def test_one_gpu_is_the_pod_of_before() -> None:
    """gpus: 1 (the default) renders exactly what the chart rendered without the value: one
    container named llama-server on the port of upstream.url, no upstreams in the config."""
    default, one = ct.render(), ct.render({"llamaServer": {"gpus": 1}})
    assert one.files == default.files
    assert [c["name"] for c in one.pod_spec["containers"]] == ["envoy", "sidecar", "llama-server"]
    assert _arg(one.container("llama-server")["args"], "--port") == "8081"
    config = _config(one)
    assert config["upstream"]["url"] == "http://127.0.0.1:8081" and "upstreams" not in config


@pytest.mark.parametrize("gpus", [2, 4])
def test_each_gpu_gets_a_llama_server_with_one_gpu_its_own_port_and_the_shared_models(gpus: int) -> None:
    rendered = ct.render({"llamaServer": {"gpus": gpus, "defaultModel": "qwen"}})
    names = [c["name"] for c in rendered.pod_spec["containers"]]
    assert names == ["envoy", "sidecar", *(f"llama-server-{i}" for i in range(gpus))]
    servers = _llama_servers(rendered)
    # One GPU each (llamaServer.resources per container): N in all for the pod.
    assert [s["resources"]["limits"][GPU] for s in servers] == [1] * gpus
    containers = rendered.pod_spec["containers"]
    assert sum(int(c.get("resources", {}).get("limits", {}).get(GPU, 0)) for c in containers) == gpus
    ports = [int(_arg(s["args"], "--port")) for s in servers]
    assert ports == [8081 + i for i in range(gpus)]
    for server, port in zip(servers, ports):
        assert _arg(server["args"], "--host") == "127.0.0.1"
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert server[probe]["exec"]["command"][-1] == f"http://127.0.0.1:{port}/health", (server["name"], probe)
        models = [m for m in server["volumeMounts"] if m["name"] == "models"]
        assert models == [{"name": "models", "mountPath": "/models", "readOnly": True}], server["name"]
        assert _arg(server["args"], "--models-dir") == "/models"
    # One models volume for all: the cache is shared, not one per GPU.
    assert [v["name"] for v in rendered.pod_spec["volumes"]].count("models") == 1
    # Each container's GPU is the device plugin's choice; nothing in the pod narrows it.
    assert "CUDA_VISIBLE_DEVICES" not in _all_env_names(rendered)
    assert "CUDA_VISIBLE_DEVICES" not in rendered.files["llamaswap/templates/deployment.yaml"]


def test_the_config_lists_one_upstream_per_llama_server() -> None:
    """The configuration file gets `upstreams` (HELPERS.md's shape): gpu0..gpuN-1 at each
    container's port, each with upstream.slots; upstream.url (the first port only) and
    upstream.slots go, as the sidecar wants beside upstreams; upstream's other keys stay, for
    every upstream."""
    rendered = ct.render({"llamaServer": {"gpus": 3, "apiKey": {"existingSecret": "llama-key"}},
                          "config": {"upstream": {"slots": 2, "modelCheck": "strict"}}})
    config = _config(rendered)
    assert config["upstreams"] == [
        {"name": "gpu0", "url": "http://127.0.0.1:8081", "slots": 2},
        {"name": "gpu1", "url": "http://127.0.0.1:8082", "slots": 2},
        {"name": "gpu2", "url": "http://127.0.0.1:8083", "slots": 2},
    ]
    assert config["upstream"] == {"modelCheck": "strict", "apiKey": "env:LLAMASWAP_UPSTREAM_API_KEY"}
    servers = _llama_servers(rendered)
    assert [f"http://127.0.0.1:{_arg(s['args'], '--port')}" for s in servers] == [u["url"] for u in config["upstreams"]]
    assert [_arg(s["args"], "--parallel") for s in servers] == ["2", "2", "2"]
    # Without upstream.slots the entries leave slots to its default; upstream itself goes when
    # nothing but the url was in it.
    plain = _config(ct.render({"llamaServer": {"gpus": 2}, "config": {"upstream": {"url": "http://127.0.0.1:18081"}}}))
    assert plain["upstreams"] == [{"name": "gpu0", "url": "http://127.0.0.1:18081"},
                                  {"name": "gpu1", "url": "http://127.0.0.1:18082"}]
    assert "upstream" not in plain
    auto = _config(ct.render({"llamaServer": {"gpus": 2}, "config": {"upstream": {"slots": "auto"}}}))
    assert auto["upstreams"][1] == {"name": "gpu1", "url": "http://127.0.0.1:8082", "slots": "auto"}
    assert "upstream" not in auto


def test_the_init_container_reads_the_config_the_chart_renders() -> None:
    """Envoy's bootstrap comes from the file that holds the upstreams: the envoy-config init
    container reads /etc/llamaswap/config.yaml from the ConfigMap the chart renders, and a
    change of gpus changes that file's checksum, so the pod (and its bootstrap) is remade."""
    rendered = ct.render({"llamaServer": {"gpus": 2}})
    init = rendered.init_container("envoy-config")
    path = _arg(init["args"], "-c")
    mount = next(m for m in init["volumeMounts"] if path.startswith(m["mountPath"] + "/"))
    volume = next(v for v in rendered.pod_spec["volumes"] if v["name"] == mount["name"])
    held = rendered.named("ConfigMap", volume["configMap"]["name"])["data"][path.rsplit("/", 1)[1]]
    assert [u["name"] for u in yaml.safe_load(held)["upstreams"]] == ["gpu0", "gpu1"]

    def checksum(gpus: int) -> str:
        return ct.render({"llamaServer": {"gpus": gpus}}).deployment["spec"]["template"]["metadata"][
            "annotations"]["checksum/config"]

    assert checksum(2) != checksum(1) and checksum(2) != checksum(3)


def test_one_gpu_check_with_one_containers_gpu() -> None:
    """One gpu-check for the pod, with one llama-server container's extended resources: the
    pod asks for no GPU beyond its llama-servers'."""
    rendered = ct.render({"llamaServer": {"gpus": 4}})
    checks = [c for c in rendered.pod_spec["initContainers"] if c["name"].startswith("gpu-check")]
    assert len(checks) == 1
    assert checks[0]["resources"]["limits"][GPU] == _llama_servers(rendered)[0]["resources"]["limits"][GPU] == 1


def test_the_startup_probe_loads_the_default_model_on_the_first_gpu() -> None:
    """`llamaswap load-model` talks to gpu0's llama-server: the pod is ready once the default
    model is loaded there; the other GPUs load models when the scheduler sends them work."""
    rendered = ct.render({"llamaServer": {"gpus": 2, "defaultModel": "qwen"}})
    command = rendered.container("sidecar")["startupProbe"]["exec"]["command"]
    assert command[:2] == ["llamaswap", "load-model"] and command[-1] == "qwen"
    assert _arg(command, "--upstream") == _config(rendered)["upstreams"][0]["url"]


@pytest.mark.parametrize("gpus", [0, 17, -1, 1.5, "2"])
def test_the_values_schema_refuses_gpus_out_of_range(gpus: Any) -> None:
    helm = ct.helm()
    with pytest.raises(helm.HelmValuesError) as refused:
        ct.render({"llamaServer": {"gpus": gpus}})
    assert "/llamaServer/gpus" in str(refused.value), str(refused.value)


def test_what_several_gpus_cannot_be_combined_with() -> None:
    helm = ct.helm()
    refusals = [
        ({"llamaServer": {"gpus": 2, "args": ["--port", "8081"]}},
         "llamaServer.args replaces every llama-server container's arguments"),
        ({"llamaServer": {"gpus": 3}, "config": {"upstream": {"url": "http://127.0.0.1:9088"}}},
         "and 9090 is config.listen.admin's"),
        ({"llamaServer": {"gpus": 2}, "config": {"upstream": {"url": "http://127.0.0.1:9900"}}},
         "and 9901 is envoy.admin's"),
        ({"llamaServer": {"gpus": 2}, "config": {"upstream": {"url": "http://127.0.0.1:65535"}}},
         "past 65535"),
    ]
    for values, message in refusals:
        with pytest.raises(helm.HelmError) as refused:
            ct.render(values)
        assert message in str(refused.value), (values, str(refused.value))
    # The same ports with one GPU are the user's choice, as before.
    assert ct.render({"config": {"upstream": {"url": "http://127.0.0.1:9900"}}}).container("llama-server")


def test_upstreams_are_the_charts_to_write() -> None:
    """config.upstreams set by hand is refused, with the value to set instead (before the
    sidecar has the key, the values schema refuses it as an unknown key)."""
    helm = ct.helm()
    with pytest.raises(helm.HelmError) as refused:
        ct.render({"config": {"upstreams": [{"name": "gpu0", "url": "http://127.0.0.1:8081"}]}})
    assert "config.upstreams is written by the chart" in str(refused.value), str(refused.value)
    assert "set llamaServer.gpus" in str(refused.value)


def test_several_gpus_lint_clean_and_valid_for_kubernetes() -> None:
    values = {"llamaServer": {"gpus": 2}}
    report = ct.lint(values)
    assert not report["errors"] and not [m for m in report["messages"] if m["severity"] >= 2], report
    errors = [e for m in ct.render(values).manifests
              if (m["apiVersion"], m["kind"]) not in ct.CRD_KINDS and (e := ct.validate_manifest(m))]
    assert not errors, "\n".join(errors)


# ---- with the sidecar's side of issue 27 ---------------------------------------------------


def test_the_config_with_upstreams_passes_check_config(tmp_path: pathlib.Path) -> None:
    rendered = ct.render({"llamaServer": {"gpus": 2}, "config": {"upstream": {"slots": 2}}})
    path = tmp_path / "config.yaml"
    path.write_text(rendered.sidecar_config)
    result = subprocess.run([sys.executable, "-m", "llamaswap", "check-config", "-c", str(path)],
                            env=ct.python_env(), capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0 and result.stdout.startswith("ok\n"), result.stdout + result.stderr
    entries = parse_config(yaml.safe_load(rendered.sidecar_config)).gpu_entries
    assert [(e.name, e.port, e.slots) for e in entries] == [("gpu0", 8081, 2), ("gpu1", 8082, 2)]


def test_the_pods_bootstrap_has_a_cluster_per_gpu(tmp_path: pathlib.Path) -> None:
    """The init container run as the pod would: a cluster upstream-gpuI for each llama-server
    container, at its --port."""
    rendered = ct.render({"llamaServer": {"gpus": 2}})
    bootstrap, _ = ct.pod_bootstrap(rendered, tmp_path)
    clusters = {c["name"]: c for c in bootstrap["static_resources"]["clusters"]}
    for i, server in enumerate(_llama_servers(rendered)):
        endpoint = clusters[f"upstream-gpu{i}"]["load_assignment"]["endpoints"][0]["lb_endpoints"][0]
        address = endpoint["endpoint"]["address"]["socket_address"]
        assert address == {"address": "127.0.0.1", "port_value": int(_arg(server["args"], "--port"))}


def test_the_notes_say_how_many_gpus_and_where_the_model_loads() -> None:
    notes = ct.render({"llamaServer": {"gpus": 2, "defaultModel": "qwen"}}).notes
    assert "2 GPUs (llama-server-0..1) under one scheduler each" in notes
    assert "once llama-server-0 (gpu0) has loaded qwen" in notes
    single = ct.render({"llamaServer": {"defaultModel": "qwen"}}).notes
    assert "one GPU and one scheduler each" in single and "once llama-server has loaded qwen" in single


def test_kubernetes_md_example_renders_as_it_says() -> None:
    """docs/kubernetes.md's "Several GPUs in one pod" example: four llama-servers on 8081..8084,
    one GPU each, and the upstreams gpu0..gpu3 with its slots."""
    text = (ct.ROOT / "docs" / "kubernetes.md").read_text()
    section = text.split("## Several GPUs in one pod", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```yaml\n(.*?)```", section, re.S)
    assert block is not None
    rendered = ct.render(yaml.safe_load(block.group(1)))
    servers = _llama_servers(rendered)
    assert [int(_arg(s["args"], "--port")) for s in servers] == [8081, 8082, 8083, 8084]
    assert [s["resources"]["limits"][GPU] for s in servers] == [1, 1, 1, 1]
    assert [(u["name"], u["slots"]) for u in _config(rendered)["upstreams"]] == [(f"gpu{i}", 2) for i in range(4)]
    for words in ("llama-server-0", "CUDA_VISIBLE_DEVICES", "per container", "gpu-check", "issue 25"):
        assert words in text, words


def test_two_gpu_pod_serves_on_the_free_gpu_while_the_other_runs(tmp_path: pathlib.Path) -> None:
    """The rendered two-GPU pod on this machine (the init container's bootstrap, the rendered
    Envoy and sidecar, a stand-in on each llama-server container's port, their rendered probes):
    with a generation held on one GPU, the next request runs on the other one at once."""
    from concurrent import futures

    from harness import http_get, wait_for
    from test_chart import DEFAULT_PORTS, PodUpstream, _http, _pod_values, _run_script, _start_pod

    ports = ct.pod_ports(DEFAULT_PORTS)
    while not ct.port_free(ports["llama"] + 1) or ports["llama"] + 1 in ports.values():
        ports = ct.pod_ports({key: ct.free_port() for key in DEFAULT_PORTS})
    values = _pod_values(ports, 0)
    values["collector"] = {"enabled": False, "endpoint": ""}
    values["llamaServer"] = {"gpus": 2}
    rendered = ct.render(values)
    servers = _llama_servers(rendered)
    stand_ins = [PodUpstream(int(_arg(s["args"], "--port"))) for s in servers]
    processes: list[Any] = []
    try:
        _, sidecar, envoy = _start_pod(rendered, tmp_path)
        processes += [sidecar, envoy]
        wait_for(lambda: http_get(f"http://127.0.0.1:{ports['admin']}/readyz")[0] == 200, what="sidecar /readyz")
        wait_for(lambda: http_get(f"http://127.0.0.1:{ports['envoy_admin']}/ready")[0] == 200, what="Envoy /ready")
        for server in servers:
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                result = _run_script(server[kind]["exec"]["command"])
                assert result.returncode == 0, (server["name"], kind, result.stderr)

        url = f"http://127.0.0.1:{ports['http']}/v1/chat/completions"
        body = json.dumps({"model": "model-a", "messages": [{"role": "user", "content": "hi"}]}).encode()
        with futures.ThreadPoolExecutor(max_workers=1) as pool:
            held = pool.submit(_http, url, body=body, headers={"Content-Type": "application/json", "x-test-hold": "a"})

            def holding() -> list[int]:
                """The stand-ins that hold the generation marked "a"."""
                return [i for i, s in enumerate(stand_ins) if any(h.get("x-test-hold") == "a" for h in s.hits)]

            busy = wait_for(holding, what="the held generation running on one GPU")
            assert len(busy) == 1
            other = stand_ins[1 - busy[0]]
            status, _, _ = _http(url, body=body, headers={"Content-Type": "application/json"})
            assert status == 200
            assert len(other.hits) == 1 and not held.done()  # served by the other GPU, meanwhile
            stand_ins[busy[0]].release("a")
            assert held.result(timeout=60)[0] == 200
    except BaseException:
        for process in processes:
            process.dump()
        raise
    finally:
        for process in processes:
            with contextlib.suppress(Exception):
                process.stop()
        for stand_in in stand_ins:
            stand_in.close()
