"""Idle unloads in the configuration (`core/idle.py`): `models.<id>.ttl` (llama-swap's key, now
honoured), `upstream.idleUnloadSeconds` and each `upstreams:` entry's, and llama-swap's top-level
`globalTTL`, read as `upstream.idleUnloadSeconds`.

llama-swap's meanings are kept: a model's `ttl` absent or -1 takes the upstream's idle time
(`globalTTL`), 0 never unloads it, a positive number is its idle time in seconds.

Ollama's per-request `keep_alive` changes it only where `routing.keepAlive.honour` is on, within
`routing.keepAlive.maxSeconds` (`KeepAliveConfig`, `core/keep_alive.py`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Annotated, Any, Protocol

from pydantic import Field

from llamaswap.config.llama_command import flag_value
from llamaswap.config.problems import Meaning, Problem, describe_value, invalid
from llamaswap.config.section import Section
from llamaswap.config.types import StrictBool, StrictNumber
from llamaswap.core.keep_alive import IGNORED, KeepAlive
from llamaswap.core.residency import IdleUnload

if TYPE_CHECKING:
    from llamaswap.config.upstreams import GpuEntry

# llama-swap's "use globalTTL" value of a model's ttl.
USE_UPSTREAM_TTL = -1
# A model's ttl in the JSON Schema.
TTL_SCHEMA = {"anyOf": [{"type": "number", "minimum": 0}, {"const": USE_UPSTREAM_TTL}, {"type": "null"}]}
# llama-server's flags that give it one model (then it cannot unload it: no router).
_MODEL_FLAGS = ("-m", "--model", "-hf", "--hf-repo", "-mu", "--model-url")


def ttl_value(value: Any) -> float | None:
    """``models.<id>.ttl``: seconds >= 0.001, 0 (never), or -1 / null (the upstream's idle time)."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value == USE_UPSTREAM_TTL):
        return None
    if (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and (value == 0 or value >= 0.001)):
        return float(value)
    raise invalid(f"must be the seconds this model may sit idle before it is unloaded (>= 0.001), 0 to never unload "
                  f"it, or -1 (or leave it out) for its upstream's idleUnloadSeconds; got {describe_value(value)}")


class KeepAliveConfig(Section):
    """Ollama's keep_alive in a request's body: whether it sets its model's idle time, and how far."""

    honour: StrictBool = Field(
        default=False,
        description="A request's keep_alive (Ollama's: a duration such as \"10m\" or seconds; 0 unloads its model "
                    "once nothing runs or waits for it; negative keeps it) sets its model's idle time on the "
                    "upstream it ran on, from that request on. Off (the default): ignored, so no caller can keep "
                    "a model in memory, or unload it, unless allowed. A value that is not a duration is ignored.")
    max_seconds: Annotated[StrictNumber | None, Meaning("null = no bound")] = Field(
        default=None, ge=0,
        description="The longest idle time a keep_alive may ask, a negative one (keep) included; null (the "
                    "default): no bound, so a negative keep_alive keeps its model until a request asks otherwise.")

    @property
    def bounds(self) -> KeepAlive:
        return KeepAlive(self.honour, self.max_seconds) if self.honour else IGNORED


class _Model(Protocol):
    @property
    def ttl(self) -> float | None: ...


def global_ttl_as_upstream(document: Any) -> Any:
    """A file's llama-swap ``globalTTL`` (seconds, an integer >= 0) read as
    ``upstream.idleUnloadSeconds`` where the file does not set that (before validation; a bad
    value is left to globalTTL's own check)."""
    if not isinstance(document, dict):
        return document
    seconds = document.get("globalTTL")
    upstream = document.get("upstream")
    upstream = {} if upstream is None else upstream
    if (isinstance(seconds, int) and not isinstance(seconds, bool) and seconds >= 0 and isinstance(upstream, dict)
            and "idleUnloadSeconds" not in upstream):
        return {**document, "upstream": {**upstream, "idleUnloadSeconds": seconds}}
    return document


def global_ttl_problems(idle_unload_seconds: float, global_ttl: int | None) -> list[Problem]:
    """globalTTL and upstream.idleUnloadSeconds both given, and not the same."""
    if global_ttl is not None and idle_unload_seconds != global_ttl:
        return [Problem("globalTTL", f"is llama-swap's name of upstream.idleUnloadSeconds, which this file sets to "
                                     f"{idle_unload_seconds:g}: keep one of them")]
    return []


def idle_unload_of(entry: GpuEntry, models: Mapping[str, _Model], keep_alive: KeepAlive = IGNORED) -> IdleUnload:
    """How long each model may sit idle on ``entry``'s GPU: the entry's idle time, or each model's
    own ``ttl``, or what a request's keep_alive asks within ``keep_alive`` (routing.keepAlive).
    (A pinned model never goes: the core reads `Residency.pinned`.)"""
    return IdleUnload(entry.idle_unload_s, {model_id: model.ttl for model_id, model in models.items()
                                            if model.ttl is not None and entry.lists(model_id)}, keep_alive)


def one_model_command(entry: GpuEntry) -> bool:
    """``entry``'s command starts llama-server with one model (``-m`` and the like), which cannot
    unload it: no model is unloaded for idleness there (`idle_advice`; `llamaswap simulate`)."""
    return flag_value(entry.command, _MODEL_FLAGS) is not None


def idle_advice(entries: Sequence[GpuEntry], keys: Sequence[str], models: Mapping[str, _Model]) -> list[Problem]:
    """Idle times that cannot apply: an upstream started as a single-model llama-server (its
    ``command`` gives it a model) cannot unload its one model, so it is never unloaded there.
    ``keys``: each entry's idleUnloadSeconds key path."""
    problems = []
    for entry, key in zip(entries, keys, strict=True):
        if not idle_unload_of(entry, models).ever or not one_model_command(entry):
            continue
        problems.append(Problem(key, f"{entry.name}'s command starts llama-server with one model, which cannot be "
                                     f"unloaded (only its router mode can): no model is unloaded for idleness there. "
                                     f"Start it in router mode (--models-dir or --models-preset, no -m), or set "
                                     f"{key}: 0 and leave the models' ttl out"))
    return problems


class _Entry(Protocol):
    @property
    def idle_unload_seconds(self) -> float | None: ...


class _Routing(Protocol):
    @property
    def keep_alive(self) -> KeepAliveConfig: ...


class _Config(Protocol):
    @property
    def global_ttl(self) -> int | None: ...

    @property
    def routing(self) -> _Routing: ...

    @property
    def upstreams(self) -> Sequence[_Entry] | None: ...

    @property
    def gpu_entries(self) -> Sequence[GpuEntry]: ...

    @property
    def models(self) -> Mapping[str, Any]: ...


def idle_keys(config: _Config) -> list[str]:
    """The key that gives each upstream its idle time (for advice and explanations)."""
    upstream = "globalTTL" if config.global_ttl is not None else "upstream.idleUnloadSeconds"
    if config.upstreams is None:
        return [upstream]
    return [f"upstreams[{index}].idleUnloadSeconds" if item.idle_unload_seconds is not None else upstream
            for index, item in enumerate(config.upstreams)]


def describe_idle(config: _Config) -> list[str]:
    """What the idle times imply, per upstream (`llamaswap check-config`); nothing where none is set."""
    lines = []
    keep_alive = config.routing.keep_alive
    asked = ("; a request's keep_alive sets its model's idle time (routing.keepAlive.honour"
             + (f", at most {keep_alive.max_seconds:g} s)" if keep_alive.max_seconds is not None else ")"))
    for entry, key in zip(config.gpu_entries, idle_keys(config), strict=True):
        idle = idle_unload_of(entry, config.models, keep_alive.bounds)
        if not idle.ever:
            continue
        default = (f"a model idle {entry.idle_unload_s:g} s is unloaded ({key})" if entry.idle_unload_s > 0
                   else f"no model is unloaded for idleness ({key}: 0)")
        own = [f"{model} {'never' if seconds == 0 else f'after {seconds:g} s'}"
               for model, seconds in sorted(idle.per_model_s.items())]
        lines.append(f"{entry.name}: {default}" + (f"; {', '.join(own)} (models.<id>.ttl)" if own else "")
                     + (asked if idle.keep_alive.honour else ""))
    return lines
