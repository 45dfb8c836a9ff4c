"""The upstreams a node's one queue serves (issue 27): `GpuEntry`, what `Config.gpu_entries`
gives, and the checks across ``upstreams``, ``upstream`` and ``models`` that the configuration
runs on it. Without ``upstreams`` the list is one entry, ``gpu0``, made of upstream.url, slots
and command."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Sequence
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import BeforeValidator, Field, PlainSerializer, WithJsonSchema

from llamaswap.core.policy import IMPLICIT_GPU
from llamaswap.core.residency import listed
from llamaswap.config.section import Section
from llamaswap.config.types import (
    MemorySize,
    StrictInt,
    UrlParts,
    ZeroOrSeconds,
    command_document,
    command_line,
    upstream_url,
)
from llamaswap.config.problems import Meaning, Problem, describe_value, invalid

# A name becomes part of an Envoy cluster name (upstream-<name>) and a metric label value.
MAX_NAME_LENGTH = 40
NAME_PATTERN = r"[a-z0-9]([a-z0-9-]*[a-z0-9])?"
_NAME = re.compile(NAME_PATTERN)
# The value of upstream.slots that asks the upstream (llama-server's /props total_slots).
SLOTS_AUTO = "auto"


@dataclasses.dataclass(frozen=True, slots=True)
class GpuEntry(UrlParts):
    """One upstream of the node: a llama-server on one GPU (or on the GPUs it uses together).
    ``slots`` is resolved (an entry without its own takes upstream.slots); ``models`` None means
    it may serve any model."""

    name: str
    url: str
    slots: int | Literal["auto"]
    models: frozenset[str] | None
    command: tuple[str, ...]
    # Models resident at once, and their memory budget in bytes (None: none); resolved like slots.
    max_loaded: int = 1
    memory: int | None = None
    idle_unload_s: float = 0.0  # how long a model may sit idle before it is unloaded (0: for ever)

    def lists(self, model: str) -> bool:
        """Whether the file lists ``model`` for this upstream (its ``models`` list, if any:
        `residency.listed`). Whether the scheduler may send it there is `GpuPolicy.may_serve`."""
        return listed(self.models, model)


def upstream_name(value: Any) -> str:
    if isinstance(value, str) and len(value) <= MAX_NAME_LENGTH and _NAME.fullmatch(value):
        return value
    raise invalid(f"must be 1..{MAX_NAME_LENGTH} lowercase letters, digits and '-', starting and ending with a "
                  f"letter or digit (it names the upstream's Envoy cluster and metric label), got "
                  f"{describe_value(value)} (e.g. gpu0)")


def model_list(value: Any) -> tuple[str, ...] | None:
    """``models`` of an entry: model ids, in order, once each; absent or empty means any model."""
    if value is None:
        return None
    if not isinstance(value, (list, tuple)):
        raise invalid(f"must be a list of model ids (empty or absent: any model), got {describe_value(value)}")
    ids: list[str] = []
    for position, item in enumerate(value, 1):
        if isinstance(item, (int, float)) and not isinstance(item, bool):
            item = str(item)  # `- 7` in YAML is the model "7", as under models:
        if not isinstance(item, str) or not item:
            raise invalid(f"item {position} must be a model id (a non-empty string), got {describe_value(item)}")
        if item not in ids:
            ids.append(item)
    return tuple(ids) or None


def upstream_list(value: Any) -> Any:
    if value is None:
        return value
    if not isinstance(value, (list, tuple)):
        raise invalid(f"must be a list of upstreams, each a mapping with name and url, got {describe_value(value)}")
    if not value:
        raise invalid("lists no upstream: give at least one entry (name, url), or remove upstreams to use "
                      f"upstream.url as the one upstream ({IMPLICIT_GPU})")
    return value


def _same_server(url: str) -> tuple[str, str, int | None, str]:
    parts = urlsplit(url)
    port = parts.port if parts.port is not None else (443 if parts.scheme == "https" else 80)
    return parts.scheme, (parts.hostname or "").lower(), port, parts.path.rstrip("/")


def duplicates(entries: Sequence[GpuEntry]) -> list[Problem]:
    """A name or a server given twice: each repeat, naming the first."""
    problems = []
    names: dict[str, int] = {}
    servers: dict[tuple[str, str, int | None, str], int] = {}
    for index, entry in enumerate(entries):
        first = names.setdefault(entry.name, index)
        if first != index:
            problems.append(Problem(f"upstreams[{index}].name",
                                    f"{entry.name!r} is also upstreams[{first}].name: give each upstream its own "
                                    f"name"))
        first = servers.setdefault(_same_server(entry.url), index)
        if first != index:
            problems.append(Problem(f"upstreams[{index}].url",
                                    f"{entry.url} is also upstreams[{first}].url ({entries[first].name}): each entry "
                                    f"is its own llama-server; list it once, or give this one its own port"))
    return problems


def unserved_models(entries: Sequence[GpuEntry], configured: Iterable[str]) -> list[Problem]:
    """``models.<id>`` entries that no upstream may serve, where every upstream lists its models."""
    if any(entry.models is None for entry in entries):
        return []
    served = set().union(*(entry.models or () for entry in entries))
    return [Problem(f"models.{model_id}",
                    f"no upstream may serve it: every entry of upstreams lists its models and none lists "
                    f"{model_id!r}; add it to the models of an upstream that can hold it, or remove models.{model_id}")
            for model_id in configured if model_id not in served]


def slots_left_unreserved(entries: Sequence[GpuEntry], own_slots: Sequence[bool], reserved: int,
                          reserved_key: str) -> list[Problem]:
    """Upstreams whose integer slots the reservation fills (``own_slots``: whether each entry
    gives its own, or takes upstream.slots)."""
    problems = []
    for index, (entry, own) in enumerate(zip(entries, own_slots, strict=True)):
        if isinstance(entry.slots, int) and reserved >= entry.slots:
            slots = f"{entry.slots}" if own else f"unset, it takes upstream.slots ({entry.slots}), which"
            problems.append(Problem(f"upstreams[{index}].slots",
                                    f"{slots} leaves no slot for non-interactive requests beside the {reserved} "
                                    f"reserved by {reserved_key}: give {entry.name} more than {reserved} slots, or "
                                    f"set {reserved_key} below {entry.slots}"))
    return problems


def moved_keys(upstream_set: Iterable[str], own_slots: Sequence[bool]) -> list[Problem]:
    """Keys of ``upstream`` that ``upstreams`` replaces, set anyway (``upstream_set``: the keys
    the file gives there, camelCase). upstream.slots stays the entries' default, unless every
    entry gives its own."""
    given = set(upstream_set)
    problems = [Problem(f"upstream.{key}",
                        f"describes the one upstream of a file without upstreams, and this file has upstreams: move "
                        f"it into the entries of upstreams ({key}: on each) and remove upstream.{key}")
                for key in ("url", "command") if key in given]
    if "slots" in given and all(own_slots):
        problems.append(Problem("upstream.slots",
                                "applies to no upstream: every entry of upstreams gives its own slots. Remove it, or "
                                "remove slots from the entries that should take it"))
    return problems


def _entry_slots_value(value: Any) -> Any:
    if value is None:
        return None
    if value == SLOTS_AUTO or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        return value
    raise invalid(f"must be an integer >= 1, 'auto' (ask the upstream), or null for upstream.slots, got "
                  f"{describe_value(value)}")


# A command line (upstream.command, upstreams[i].command): a string split like a shell does, or a list.
Command = Annotated[
    tuple[str, ...],
    BeforeValidator(command_line),
    PlainSerializer(command_document),
    WithJsonSchema({"anyOf": [
        {"type": "string"},
        {"type": "array", "items": {"type": ["string", "number"]}, "minItems": 1},
        {"type": "null"},
    ]}),
]
UPSTREAM_URL_PATTERN = r"^https?://[^\s/?#]+(/\S*)?$"


class UpstreamItem(Section):
    """One entry of upstreams: one llama-server (one GPU, or the GPUs it uses together)."""

    # The rest of `upstream` (apiKey, modelCheck, healthPath, ...) applies to every entry.

    name: Annotated[str, BeforeValidator(upstream_name)] = Field(
        description=f"The upstream's name, 1..{MAX_NAME_LENGTH} lowercase letters, digits and '-': its Envoy "
                    "cluster is upstream-<name>, and metrics, /queue and the activity log name it.",
        json_schema_extra={"pattern": f"^{NAME_PATTERN}$", "maxLength": MAX_NAME_LENGTH})
    url: Annotated[str, BeforeValidator(upstream_url)] = Field(
        description="Its base URL, http:// or https://; a trailing '/' is dropped. Each entry its own server.",
        json_schema_extra={"pattern": UPSTREAM_URL_PATTERN})
    slots: Annotated[int | Literal["auto"] | None, BeforeValidator(_entry_slots_value)] = Field(
        default=None,
        description="Its generations at once (its --parallel): an integer >= 1, or 'auto' (ask it); null (the "
                    "default) takes upstream.slots.",
        json_schema_extra={"anyOf": [{"type": "integer", "minimum": 1}, {"const": "auto"}, {"type": "null"}]})
    models: Annotated[tuple[str, ...] | None, BeforeValidator(model_list),
                      WithJsonSchema({"anyOf": [{"type": "array", "items": {"type": ["string", "number"]}},
                                                {"type": "null"}]})] = Field(
        default=None,
        description="The model ids it may serve (a small GPU cannot hold the big model); null or empty: any.")
    command: Command = Field(default=(), description="`llamaswap up` starts this for the entry, like "
                                                     "upstream.command; empty for none.",
                             json_schema_extra={"default": ""})  # as to_document writes ()
    max_loaded: Annotated[StrictInt | None, Meaning("null = upstream.maxLoaded")] = Field(
        default=None, ge=1,
        description="Models resident on it at once, as upstream.maxLoaded; null (the default) takes "
                    "upstream.maxLoaded.")
    memory: MemorySize = Field(
        default=None,
        description="Its memory budget for resident models, as upstream.memory; null (the default) takes "
                    "upstream.memory.")
    idle_unload_seconds: Annotated[ZeroOrSeconds | None, Meaning("null = upstream.idleUnloadSeconds")] = Field(
        default=None, ge=0,
        description="Unload a model idle this long on it, as upstream.idleUnloadSeconds; null (the default) takes "
                    "upstream.idleUnloadSeconds.")
