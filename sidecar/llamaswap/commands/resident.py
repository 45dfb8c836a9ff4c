"""`llamaswap up --max-loaded N`: N models resident on each upstream at once (issue 37); `up
--idle-unload S`: a resident model idle S seconds is unloaded (issue 48).

The flag writes ``maxLoaded: N`` into the configuration `up` runs (upstream.maxLoaded, and each
entry of ``upstreams`` that gives its own), and makes each llama-server router that `up` starts
keep N models loaded (``--models-max N``): in a command that passes ``--models-max`` its value
is replaced, and a router command (``--models-dir``, or ``env LLAMA_ARG_MODELS_DIR=...``) without
one gets it, so that the router never evicts on its own a model llamaswap keeps resident. The
built-in llama-server takes its ``--models-max`` from the configuration's maxLoaded
(`up.default_upstream`), with or without the flag.

--idle-unload S writes ``idleUnloadSeconds: S`` the same way (upstream.idleUnloadSeconds, and each
entry of ``upstreams`` that gives its own), over the file's and its ``globalTTL``; a model's own
``ttl`` still applies to it.
"""

from __future__ import annotations

import math
import shlex
from collections.abc import Mapping
from typing import Any

from llamaswap.config.llama_command import with_models_max


def max_loaded_flag(text: str) -> int:
    """--max-loaded's value: a whole number >= 1 (argparse turns the ValueError into its error)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"must be a whole number of models, 1 or more, got {text!r}")
    return value


def router_command(command: Any, models_max: int) -> Any:
    """``command`` (a string or a list, as the file writes it) with ``--models-max models_max`` where it
    starts llama-server's router (it passes --models-max or --models-dir); anything else as it is."""
    if isinstance(command, str):
        try:
            argv = shlex.split(command)
        except ValueError:
            return command  # the configuration's own check names it
    elif isinstance(command, (list, tuple)):
        argv = [str(argument) for argument in command]
    else:
        return command
    changed = with_models_max(argv, models_max)
    return command if changed is None else changed


def with_max_loaded(document: Any, max_loaded: int) -> Any:
    """The configuration document of `up --max-loaded N`: maxLoaded N on the upstream (and on each
    entry of upstreams that sets its own), and --models-max N on the routers its commands start."""
    if not isinstance(document, Mapping):
        return document
    result = dict(document)
    upstream = document.get("upstream")
    upstream = dict(upstream) if isinstance(upstream, Mapping) else {}
    upstream["maxLoaded"] = max_loaded
    if "command" in upstream:
        upstream["command"] = router_command(upstream["command"], max_loaded)
    result["upstream"] = upstream
    entries = document.get("upstreams")
    if isinstance(entries, list):
        result["upstreams"] = [_entry(entry, max_loaded) for entry in entries]
    return result


def _entry(entry: Any, max_loaded: int) -> Any:
    if not isinstance(entry, Mapping):
        return entry
    entry = dict(entry)
    if entry.get("maxLoaded") is not None:
        entry["maxLoaded"] = max_loaded
    if "command" in entry:
        entry["command"] = router_command(entry["command"], max_loaded)
    return entry


def idle_unload_flag(text: str) -> float:
    """--idle-unload's value: seconds, 0 (never) or at least a millisecond (argparse turns the
    ValueError into its error)."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not math.isfinite(value) or value < 0 or 0 < value < 0.001:
        raise ValueError(f"must be the seconds a model may sit idle before it is unloaded (0: never), got {text!r}")
    return value


def with_idle_unload(document: Any, seconds: float) -> Any:
    """The configuration document of `up --idle-unload S`: idleUnloadSeconds S on the upstream
    (and on each entry of upstreams that sets its own), in place of the file's globalTTL."""
    if not isinstance(document, Mapping):
        return document
    result = {key: value for key, value in document.items() if key != "globalTTL"}
    upstream = document.get("upstream")
    result["upstream"] = {**(upstream if isinstance(upstream, Mapping) else {}), "idleUnloadSeconds": seconds}
    entries = document.get("upstreams")
    if isinstance(entries, list):
        result["upstreams"] = [{**entry, "idleUnloadSeconds": seconds}
                               if isinstance(entry, Mapping) and entry.get("idleUnloadSeconds") is not None else entry
                               for entry in entries]
    return result
