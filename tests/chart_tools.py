"""Helm and Kubernetes-schema helpers for the chart tests (no cluster needed).

Helm is the real one, from PyPI: `helm-python-sdk` embeds the Helm 4 Go library (module
`helm_python`), so rendering and `helm lint --strict` run offline with no binary. Manifests
are checked against the Kubernetes OpenAPI schemas with `kubernetes-validate`.

Install both with:  .venv/bin/python -m pip install helm-python-sdk==0.2.2 kubernetes-validate==1.37.0
(the `test` extra of pyproject.toml should carry the same pins)

On CI (CI=true) a missing tool fails the tests; on a developer machine it skips them with the
install command.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import pathlib
import socket
from types import ModuleType
from typing import Any

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "llamaswap"
CI_VALUES = sorted((CHART / "ci").glob("*-values.yaml"))
INSTALL_HINT = ".venv/bin/python -m pip install helm-python-sdk==0.2.2 kubernetes-validate==1.37.0"
KUBE_VERSION = "1.32.0"
# Kinds whose schema is a CRD that kubernetes-validate does not ship.
CRD_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor")}


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


@dataclasses.dataclass
class Rendered:
    """A rendered release: template path -> text, and the parsed manifests."""

    files: dict[str, str]
    manifests: list[dict[str, Any]]
    notes: str

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

    def container(self, name: str) -> dict[str, Any]:
        return next(c for c in self.deployment["spec"]["template"]["spec"]["containers"] if c["name"] == name)

    def configmap_file(self, name_suffix: str, key: str) -> str:
        return self.find("ConfigMap", name_suffix)["data"][key]

    @property
    def sidecar_config(self) -> str:
        return self.configmap_file("llamaswap", "config.yaml")

    @property
    def envoy_bootstrap(self) -> str:
        return self.configmap_file("-envoy", "envoy.yaml")


def render(values: dict[str, Any] | None = None, *, name: str = "llm", namespace: str = "ai") -> Rendered:
    files = helm().Chart.load(str(CHART)).render(values or {}, name=name, namespace=namespace)
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


def lint(values: dict[str, Any] | None = None) -> dict[str, Any]:
    return helm().lint(str(CHART), values, strict=True, namespace="ai", kube_version=f"v{KUBE_VERSION}")


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
