"""Helm and Kubernetes-schema helpers for the chart tests (no cluster needed).

Helm is the real one, from PyPI: `helm-python-sdk` embeds the Helm 4 Go library (module
`helm_python`), so rendering and `helm lint --strict` run offline with no binary. Manifests
are checked against the Kubernetes OpenAPI schemas with `kubernetes-validate`.

`PodVolumes` and `run_init_container` run a rendered pod's init container on this machine the
way the kubelet would: its own arguments and environment, its volumes as directories (a
ConfigMap volume holds the rendered ConfigMap's files), so the Envoy bootstrap a test checks is
the one the pod would get.

Install both with:  .venv/bin/python -m pip install helm-python-sdk==0.2.2 kubernetes-validate==1.37.0
(the `test` extra of pyproject.toml should carry the same pins)

On CI (CI=true) a missing tool fails the tests; on a developer machine it skips them with the
install command.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import pathlib
import re
import socket
import subprocess
import sys
from collections.abc import Mapping
from types import ModuleType
from typing import Any

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "llamaswap"
SIDECAR_SOURCE = ROOT / "sidecar"
GENERATOR = CHART / "generate_schema.py"
CI_VALUES = sorted((CHART / "ci").glob("*-values.yaml"))
INSTALL_HINT = ".venv/bin/python -m pip install helm-python-sdk==0.2.2 kubernetes-validate==1.37.0"
KUBE_VERSION = "1.32.0"
# The one value the chart cannot default: the registry the sidecar image was pushed to.
SIDECAR_IMAGE = {"sidecar": {"image": {"repository": "registry.example.com/llamaswap"}}}
# The Gateway API inference extension's kinds (a CRD each): checked against their field lists
# (inference_kinds.py), not by kubernetes-validate.
INFERENCE_KINDS = {("inference.networking.k8s.io/v1", "InferencePool"),
                   ("llm-d.ai/v1alpha2", "InferenceObjective"),
                   ("inference.networking.x-k8s.io/v1alpha2", "InferenceObjective")}
# Kinds whose schema is a CRD that kubernetes-validate does not ship.
CRD_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor"), *INFERENCE_KINDS}


def require(module: str, package: str) -> ModuleType:
    """Import a test tool; fail on CI (which installs it), skip elsewhere with the hint."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        message = f"{package} is not installed ({exc}); install it with: {INSTALL_HINT}"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    raise AssertionError("unreachable")


def helm() -> ModuleType:
    return require("helm_python", "helm-python-sdk")


def load_values(path: pathlib.Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text()) or {}


def merge_values(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """Helm's merge of user values over the chart's: maps merge, anything else replaces, null removes."""
    out = dict(base)
    for key, value in override.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merge_values(out[key], value)
        else:
            out[key] = value
    return out


def python_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """An environment with only what runs this checkout's llamaswap here, plus `extra` (a
    container's own variables): nothing else leaks in from the test's environment."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(SIDECAR_SOURCE),
           "PYTHONDONTWRITEBYTECODE": "1"}
    env.update(extra or {})
    return env


_QUANTITY_UNITS = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
                   "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def quantity_bytes(text: str | int) -> int:
    """A Kubernetes memory quantity ("1Gi", "512Mi", "1000000") in bytes."""
    match = re.fullmatch(r"([0-9]+)([kMGT]i?)?", str(text))
    assert match, f"not a quantity this helper knows: {text!r}"
    return int(match.group(1)) * _QUANTITY_UNITS[match.group(2) or ""]


def container_env(container: Mapping[str, Any], fields: Mapping[str, str] | None = None,
                  pod: Mapping[str, Any] | None = None) -> dict[str, str]:
    """A container's environment as the kubelet sets it: plain values, fieldRef values from
    `fields` (e.g. {"metadata.name": "pod-0"}), resourceFieldRef memory limits from the `pod`
    spec's containers, and $(VAR) references to earlier variables."""
    env: dict[str, str] = {}
    for item in container.get("env", []):
        source = item.get("valueFrom", {})
        if "value" in item:
            value = str(item["value"])
        elif fields is not None and "fieldRef" in source:
            value = fields[source["fieldRef"]["fieldPath"]]
        elif pod is not None and "resourceFieldRef" in source:
            ref = source["resourceFieldRef"]
            assert ref["resource"] == "limits.memory" and str(ref.get("divisor", "1")) == "1", ref
            owner = next(c for c in pod["containers"] if c["name"] == ref["containerName"])
            value = str(quantity_bytes(owner["resources"]["limits"]["memory"]))
        else:
            continue
        for name, known in env.items():
            value = value.replace(f"$({name})", known)
        env[item["name"]] = value
    return env


@dataclasses.dataclass
class Rendered:
    """A rendered release: template path -> text, and the parsed manifests."""

    files: dict[str, str]
    manifests: list[dict[str, Any]]
    notes: str

    def named(self, kind: str, name: str) -> dict[str, Any]:
        found = [m for m in self.manifests if m["kind"] == kind and m["metadata"]["name"] == name]
        assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
        return found[0]

    def find(self, kind: str, name_suffix: str = "") -> dict[str, Any]:
        found = [m for m in self.manifests
                 if m["kind"] == kind and m["metadata"]["name"].endswith(name_suffix)]
        if len(found) != 1:
            names = [(m["kind"], m["metadata"]["name"]) for m in self.manifests]
            raise AssertionError(f"expected one {kind} named *{name_suffix}, found {len(found)} in {names}")
        return found[0]

    def all(self, kind: str) -> list[dict[str, Any]]:
        return [m for m in self.manifests if m["kind"] == kind]

    def has(self, kind: str, name_suffix: str = "") -> bool:
        return any(m["kind"] == kind and m["metadata"]["name"].endswith(name_suffix) for m in self.manifests)

    @property
    def deployment(self) -> dict[str, Any]:
        return next(m for m in self.all("Deployment")
                    if m["metadata"]["labels"].get("app.kubernetes.io/component") == "server")

    @property
    def pod_spec(self) -> dict[str, Any]:
        return self.deployment["spec"]["template"]["spec"]

    def container(self, name: str) -> dict[str, Any]:
        return next(c for c in self.pod_spec["containers"] if c["name"] == name)

    def init_container(self, name: str) -> dict[str, Any]:
        return next(c for c in self.pod_spec.get("initContainers", []) if c["name"] == name)

    def configmap_file(self, name_suffix: str, key: str) -> str:
        return self.find("ConfigMap", name_suffix)["data"][key]

    @property
    def sidecar_config(self) -> str:
        """The configuration file in the ConfigMap the sidecar and the init container mount."""
        volume = next(v for v in self.pod_spec["volumes"] if v["name"] == "config")
        return self.named("ConfigMap", volume["configMap"]["name"])["data"]["config.yaml"]


def expand(args: list[str], env: Mapping[str, str]) -> list[str]:
    """$(VAR) in a container's arguments, as the kubelet expands them (unknown ones stay)."""
    return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), arg)
            for arg in args]


def with_image(values: Mapping[str, Any] | None) -> dict[str, Any]:
    """Values with the sidecar image's repository (the one required value) under them; a null
    in `values` stays, for Helm to remove the chart's default."""
    values = dict(values or {})
    sidecar = dict(values.get("sidecar") or {})
    sidecar["image"] = {**SIDECAR_IMAGE["sidecar"]["image"], **(sidecar.get("image") or {})}
    return {**values, "sidecar": sidecar}


def render(values: dict[str, Any] | None = None, *, name: str = "llm", namespace: str = "ai",
           image: bool = True) -> Rendered:
    """Render the chart; `image` puts SIDECAR_IMAGE under the values (False: exactly `values`)."""
    values = with_image(values) if image else (values or {})
    files = helm().Chart.load(str(CHART)).render(values, name=name, namespace=namespace)
    manifests: list[dict[str, Any]] = []
    notes = ""
    for path, text in sorted(files.items()):
        if path.endswith("NOTES.txt"):
            notes = text
            continue
        for document in yaml.safe_load_all(text):
            if document:
                manifests.append(document)
    return Rendered(files, manifests, notes)


class PodVolumes:
    """The pod's volumes as directories on this machine, one per volume: a ConfigMap volume
    holds the rendered ConfigMap's files, any other starts empty. A container's paths are
    mapped through its own volumeMounts, so two containers that mount one volume share files.
    A path the sidecar reads from its configuration file (`batches.dir`) is mapped the same way
    in that file, so the sidecar writes into the volume's directory, never this machine's path."""

    def __init__(self, rendered: Rendered, root: pathlib.Path) -> None:
        self.rendered = rendered
        self.dirs: dict[str, pathlib.Path] = {}
        for volume in rendered.pod_spec["volumes"]:
            path = root / volume["name"]
            path.mkdir(parents=True)
            if "configMap" in volume:
                for key, text in rendered.named("ConfigMap", volume["configMap"]["name"])["data"].items():
                    (path / key).write_text(text)
            self.dirs[volume["name"]] = path
        self._map_config_paths()

    def _map_config_paths(self) -> None:
        sidecar = next((c for c in self.rendered.pod_spec["containers"] if c["name"] == "sidecar"), None)
        config = self.dirs.get("config", pathlib.Path("/nonexistent")) / "config.yaml"
        if sidecar is None or not config.exists():
            return
        document = yaml.safe_load(config.read_text()) or {}
        directory = (document.get("batches") or {}).get("dir")
        if not directory:
            return
        local = self.path(sidecar, directory)
        # The pod's root filesystem is read-only: a directory on no volume could not be written there.
        assert local != directory, f"batches.dir {directory} is on none of the sidecar's volumes"
        document["batches"]["dir"] = local
        config.write_text(yaml.safe_dump(document, sort_keys=False))

    def path(self, container: Mapping[str, Any], pod_path: str) -> str:
        """Where a path inside the container is on this machine (unchanged if no volume holds it)."""
        mounts = sorted(container.get("volumeMounts", []), key=lambda m: len(m["mountPath"]), reverse=True)
        for mount in mounts:
            root = mount["mountPath"].rstrip("/")
            if pod_path == root or pod_path.startswith(root + "/"):
                return str(self.dirs[mount["name"]]) + pod_path[len(root):]
        return pod_path

    def argv(self, container: Mapping[str, Any], args: list[str]) -> list[str]:
        """A container's arguments with its absolute paths mapped to this machine."""
        return [self.path(container, arg) if arg.startswith("/") else arg for arg in args]


def run_init_container(rendered: Rendered, volumes: PodVolumes,
                       name: str = "envoy-config") -> subprocess.CompletedProcess[str]:
    """Run an init container of the sidecar image (its entrypoint is `llamaswap`) as the pod
    would: its arguments, its volumes, its environment and nothing else."""
    init = rendered.init_container(name)
    assert init["command"] == ["llamaswap"], init["command"]
    assert init["image"] == rendered.container("sidecar")["image"], "not the sidecar's image"
    env = container_env(init, pod=rendered.pod_spec)
    argv = [sys.executable, "-m", "llamaswap", *volumes.argv(init, expand(init["args"], env))]
    return subprocess.run(argv, env=python_env(env), capture_output=True, text=True, timeout=120, check=False)


def envoy_config_path(rendered: Rendered, volumes: PodVolumes) -> pathlib.Path:
    """The bootstrap file Envoy's container reads (its -c), on this machine."""
    envoy = rendered.container("envoy")
    args = envoy["args"]
    return pathlib.Path(volumes.path(envoy, args[args.index("-c") + 1]))


def pod_bootstrap(rendered: Rendered, root: pathlib.Path) -> tuple[dict[str, Any], pathlib.Path]:
    """The bootstrap this pod's Envoy would start with: the init container run as the pod
    would, read where the Envoy container reads it. Fails with the init container's output."""
    volumes = PodVolumes(rendered, root)
    result = run_init_container(rendered, volumes)
    assert result.returncode == 0, f"envoy-config init container: exit {result.returncode}\n{result.stderr}"
    path = envoy_config_path(rendered, volumes)
    return yaml.safe_load(path.read_text()), path


def generator(*args: str) -> subprocess.CompletedProcess[str]:
    """charts/llamaswap/generate_schema.py with this checkout's sidecar."""
    return subprocess.run([sys.executable, str(GENERATOR), *args], env=python_env(), capture_output=True,
                          text=True, timeout=120, check=False)


def values_schema() -> dict[str, Any]:
    return json.loads((CHART / "values.schema.json").read_text())


def lint(values: dict[str, Any] | None = None) -> dict[str, Any]:
    return helm().lint(str(CHART), with_image(values), strict=True, namespace="ai", kube_version=f"v{KUBE_VERSION}")


def validate_manifest(manifest: dict[str, Any]) -> str | None:
    """None if valid; the validation error otherwise. CRD kinds must be checked by the caller."""
    kv = require("kubernetes_validate", "kubernetes-validate")
    try:
        kv.validate(manifest, KUBE_VERSION, strict=True)
    except kv.ValidationError as exc:
        return f"{manifest['kind']}/{manifest['metadata']['name']}: {exc.message} at {list(exc.path)}"
    return None


def port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pod_ports(defaults: dict[str, int]) -> dict[str, int]:
    """The chart's default pod ports if all are free on 127.0.0.1, else free ones."""
    if all(port_free(port) for port in defaults.values()):
        return dict(defaults)
    chosen: dict[str, int] = {}
    while len(set(chosen.values())) < len(defaults):
        chosen = {key: free_port() for key in defaults}
    return chosen
