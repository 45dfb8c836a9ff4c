"""The real Prometheus server (Debian package `prometheus`) for the end-to-end tests.

It scrapes the given targets every second; readiness is polled on `/-/ready` with a deadline.
The listen port is chosen by binding port 0 first; if another process takes it before
Prometheus binds, the start is retried on a fresh port.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import shutil
import urllib.parse
from collections.abc import Iterator, Sequence
from typing import Any

import yaml

from harness import DEADLINE_S, Process, free_port, http_get, wait_for

ENV_BINARY = "LLAMASWAP_PROMETHEUS"


def prometheus_binary() -> str | None:
    """$LLAMASWAP_PROMETHEUS, else `prometheus` on PATH, else the Debian path."""
    configured = os.environ.get(ENV_BINARY)
    if configured:
        return configured if os.access(configured, os.X_OK) else None
    found = shutil.which("prometheus")
    if found:
        return found
    return "/usr/bin/prometheus" if os.access("/usr/bin/prometheus", os.X_OK) else None


class Prometheus:
    def __init__(self, process: Process, port: int) -> None:
        self.process = process
        self.port = port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query; the `result` list of a vector (raises on an API error)."""
        status, body = http_get(f"{self.url}/api/v1/query?{urllib.parse.urlencode({'query': expr})}")
        document = json.loads(body)
        if status != 200 or document.get("status") != "success":
            raise RuntimeError(f"query {expr!r}: {status} {document}")
        return document["data"]["result"]

    def values(self, expr: str, by: str) -> dict[str, float]:
        """`expr`'s current values keyed by the label `by` (e.g. band)."""
        return {item["metric"].get(by, ""): float(item["value"][1]) for item in self.query(expr)}

    def targets_up(self, job: str) -> bool:
        return any(float(item["value"][1]) == 1.0 for item in self.query(f'up{{job="{job}"}}'))


@contextlib.contextmanager
def running_prometheus(workdir: pathlib.Path, targets: Sequence[str], *, job: str = "llamaswap",
                       metrics_path: str = "/metrics", attempts: int = 5) -> Iterator[Prometheus]:
    """Prometheus scraping `targets` (host:port) every second; stopped whatever happens."""
    binary = prometheus_binary()
    if binary is None:
        raise FileNotFoundError("prometheus is not installed (Debian package `prometheus`)")
    config_path = workdir / "prometheus.yml"
    config_path.write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [{"job_name": job, "metrics_path": metrics_path,
                            "static_configs": [{"targets": list(targets)}]}],
    }))
    server: Prometheus | None = None
    for attempt in range(attempts):
        port = free_port()
        data = workdir / f"prometheus-data-{attempt}"
        data.mkdir(parents=True, exist_ok=True)
        process = Process(f"prometheus-{attempt}", [
            binary, f"--config.file={config_path}", f"--storage.tsdb.path={data}",
            f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn",
        ], workdir / f"prometheus-{attempt}.log")
        candidate = Prometheus(process, port)
        try:
            wait_for(lambda: _ready(candidate), timeout=DEADLINE_S, what="Prometheus /-/ready")
            server = candidate
            break
        except Exception:
            in_use = "address already in use" in process.log()
            process.dump()
            process.stop()
            if not in_use:
                raise
    if server is None:
        raise RuntimeError(f"Prometheus did not start in {attempts} attempts")
    try:
        yield server
    finally:
        server.process.stop()


def _ready(server: Prometheus) -> bool:
    if not server.process.alive():
        raise RuntimeError(f"prometheus exited with {server.process.popen.returncode}")
    try:
        return http_get(f"{server.url}/-/ready", timeout=2.0)[0] == 200
    except OSError:
        return False

