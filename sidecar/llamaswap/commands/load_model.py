"""`llamaswap load-model`: have llama-server's router load a model, and say whether it is loaded.

The Helm chart runs it as the sidecar container's startup probe, so that a pod reports ready
only once its default model is loaded (router-mode `/health` answers 200 with nothing loaded,
and the first request would otherwise pay the load):

    llamaswap load-model --upstream http://127.0.0.1:8081 qwen3-8b

One run asks `GET /v1/models`: exit 0 if the model's status is `loaded`, or `sleeping` (it was
loaded, and the router put it to sleep after `--sleep-idle-seconds`: a load of it is refused as
already running, and its next request wakes it); if it is neither loaded nor loading, `POST
/models/load` it; exit 1 while it is not loaded yet (the probe runs again). With `--wait SECONDS`
it polls until loaded instead (an init step or a script).
A model the upstream does not list, or an upstream that is not in router mode, exits 2 with
one line saying so. It talks to llama-server directly: the pod is not ready yet, so no
scheduled request can be running.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

EXIT_NOT_YET = 1
EXIT_CANNOT = 2
POLL_S = 1.0
HTTP_TIMEOUT_S = 5.0


class PreloadError(Exception):
    """The model cannot be loaded this way (unknown model, no router mode): retrying is useless."""


def _request(url: str, body: dict[str, Any] | None = None, api_key: str | None = None) -> Any:
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json"} if data else {}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    request = urllib.request.Request(url, data=data, headers=headers)
    with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as response:  # noqa: S310 - the pod's upstream
        return json.load(response)


def model_state(document: Any, model: str) -> str | None:
    """The router's status of `model` in a `GET /v1/models` answer (loaded, loading, unloaded,
    ...); None if it is not listed. Raises PreloadError when the answer has no statuses."""
    items = document.get("data") if isinstance(document, dict) else None
    if not isinstance(items, list):
        raise PreloadError("GET /v1/models: no model list in the answer")
    listed = [item for item in items if isinstance(item, dict)]
    if listed and not any(isinstance(item.get("status"), dict) for item in listed):
        raise PreloadError("the upstream lists no model states: it is not llama-server in router mode")
    for item in listed:
        if item.get("id") == model:
            status = item.get("status")
            return str(status.get("value")) if isinstance(status, dict) else None
    return None


def step(upstream: str, model: str, api_key: str | None = None) -> str | None:
    """One look: the status if loaded (or asleep); otherwise None, after starting a load if none
    is under way. Raises PreloadError (hopeless) or OSError/URLError (not reachable yet)."""
    base = upstream.rstrip("/")
    try:
        state = model_state(_request(f"{base}/v1/models", api_key=api_key), model)
    except urllib.error.HTTPError as exc:
        if exc.code in (401, 403):
            raise PreloadError(f"the upstream answered {exc.code} to GET /v1/models: it wants an API key "
                               f"({'a wrong one was sent' if api_key else 'pass --api-key-env NAME'})") from exc
        raise
    if state is None:
        raise PreloadError(f"{model}: not among the upstream's models (a GGUF file name without .gguf)")
    if state in ("loaded", "sleeping"):
        return state
    if state != "loading":
        _request(f"{base}/models/load", {"model": model}, api_key)
    return None


def run(upstream: str, model: str, wait_s: float, *, clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep, api_key: str | None = None) -> int:
    deadline = clock() + wait_s
    while True:
        try:
            state = step(upstream, model, api_key)
            if state is not None:
                print(f"{model}: loaded" if state == "loaded" else
                      f"{model}: loaded, asleep (the router's --sleep-idle-seconds): its next request wakes it")
                return 0
            reason = "loading"
        except PreloadError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return EXIT_CANNOT
        except urllib.error.HTTPError as exc:
            reason = f"HTTP {exc.code} from {exc.url}"
        except (urllib.error.URLError, OSError, ValueError) as exc:
            reason = f"upstream not answering ({getattr(exc, 'reason', None) or exc})"
        if clock() >= deadline:
            print(f"{model}: not loaded yet: {reason}", file=sys.stderr)
            return EXIT_NOT_YET
        sleep(POLL_S)


def _run(args: argparse.Namespace) -> int:
    api_key = os.environ.get(args.api_key_env, "").strip() if args.api_key_env else None
    if args.api_key_env and not api_key:
        print(f"error: --api-key-env: the environment variable {args.api_key_env} is unset or empty", file=sys.stderr)
        return EXIT_CANNOT
    return run(args.upstream, args.model, args.wait, api_key=api_key)


def add_parser(commands: Any) -> None:
    """Register `llamaswap load-model` on the CLI's subcommands."""
    parser = commands.add_parser(
        "load-model", help="load a model in llama-server's router mode; exit 0 once it is loaded",
        description="Ask llama-server (router mode) to load MODEL; exit 0 if it is loaded, 1 if not yet, "
                    "2 if it cannot be (unknown model, not router mode).")
    parser.add_argument("--upstream", default="http://127.0.0.1:8081", help="llama-server's base URL")
    parser.add_argument("--wait", type=float, default=0.0, metavar="SECONDS",
                        help="poll until loaded for up to this long (default 0: look once)")
    parser.add_argument("--api-key-env", metavar="NAME",
                        help="the environment variable holding llama-server's API key (its --api-key)")
    parser.add_argument("model", help="the model id (its GGUF file name without .gguf)")
    parser.set_defaults(run=_run)
