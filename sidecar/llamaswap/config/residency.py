"""Several models resident on one upstream (issue 37): what ``maxLoaded``, ``memory``,
``models.<id>.memory`` and ``models.<id>.pinned`` make of each upstream of a configuration.

- `model_sizes`: where an upstream has a memory budget, the size of each model it may serve:
  ``models.<id>.memory``, else an estimate from the model's GGUF file (`gguf_memory`: the file's
  size plus its KV cache at the context the upstream runs it with), found in the models directory
  of the upstream's command (llama-server's ``--models-dir``; the file ``<id>.gguf``). A model
  with neither is a problem that names ``models.<id>.memory``.
- `residency_problems`: pinned models that cannot stay (``maxLoaded: 1``, more pinned than
  ``maxLoaded``, more than ``memory``).
- `residency_of`: the core's `Residency` of one upstream, which the scheduler's policy carries.

`Config` runs the first two when it is validated and keeps the sizes, so that building a
policy reads no file.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
from collections.abc import Mapping, Sequence
from typing import Protocol

from llamaswap.config.gguf_memory import GgufError, estimate_model_bytes
from llamaswap.config.idle import KeepAliveConfig, idle_unload_of
from llamaswap.config.llama_command import cache_types, context_of, models_dir, router_models_max
from llamaswap.config.problems import Problem
from llamaswap.config.types import size_document, size_text
from llamaswap.config.upstreams import GpuEntry, UpstreamItem
from llamaswap.core.residency import Residency

# Bytes per KV cache element of llama-server's --cache-type-k/-v (a block's bytes over its 32 values).
CACHE_TYPE_BYTES = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32, "q5_1": 24 / 32, "q5_0": 22 / 32,
                    "q4_1": 20 / 32, "q4_0": 18 / 32, "iq4_nl": 18 / 32}


class _Model(Protocol):
    """What is read of a `sections.ModelConfig`."""

    @property
    def memory(self) -> int | None: ...

    @property
    def pinned(self) -> bool: ...

    @property
    def ttl(self) -> float | None: ...


class _Routing(Protocol):
    @property
    def keep_alive(self) -> KeepAliveConfig: ...


class Config(Protocol):
    """What is read of a `sections.Config` (which calls these functions as it is validated, so it
    is named here by its shape, not imported)."""

    @property
    def models(self) -> Mapping[str, _Model]: ...

    @property
    def upstreams(self) -> Sequence[UpstreamItem] | None: ...

    @property
    def gpu_entries(self) -> tuple[GpuEntry, ...]: ...

    def entry(self, gpu: str) -> GpuEntry: ...

    @property
    def routing(self) -> _Routing: ...

    def residency_of(self, gpu: str) -> Residency: ...

    def model_sizes(self, gpu: str) -> Mapping[str, ModelSize]: ...


@dataclasses.dataclass(frozen=True, slots=True)
class ModelSize:
    """A model's size on an upstream, and where it comes from (a key, or the file estimated)."""

    bytes: int
    source: str

    def __str__(self) -> str:
        return size_text(self.bytes)


def cache_type_bytes(command: Sequence[str]) -> float:
    """Bytes per KV cache element: the mean of K's and V's (`llama_command.cache_types`)."""
    widths = [CACHE_TYPE_BYTES.get(cache_type, 2.0) for cache_type in cache_types(command)]
    return sum(widths) / len(widths)


def gguf_models(directory: pathlib.Path) -> dict[str, pathlib.Path]:
    """The models llama-server's router serves from a directory: each ``<id>.gguf`` in it (not a
    multimodal projector, ``mmproj*``), by id; empty where it cannot be read."""
    try:
        files = sorted(directory.iterdir())
    except OSError:
        return {}
    return {path.name[:-len(".gguf")]: path for path in files
            if path.name.endswith(".gguf") and not path.name.startswith("mmproj") and path.is_file()}


def memory_key(config: Config, index: int) -> str:
    """The key that gives upstream ``index`` its memory budget."""
    if config.upstreams is not None and config.upstreams[index].memory is not None:
        return f"upstreams[{index}].memory"
    return "upstream.memory"


def max_loaded_key(config: Config, index: int) -> str:
    """The key that gives upstream ``index`` its maxLoaded."""
    if config.upstreams is not None and config.upstreams[index].max_loaded is not None:
        return f"upstreams[{index}].maxLoaded"
    return "upstream.maxLoaded"


def served_models(config: Config, entry: GpuEntry, found: Mapping[str, pathlib.Path]) -> list[str]:
    """The models an upstream may serve, as far as the file and its models directory tell: its
    ``models`` list, else every ``models.<id>`` and every GGUF file of its directory."""
    if entry.models is not None:
        return sorted(entry.models)
    return sorted(set(config.models) | set(found))


def model_sizes(config: Config) -> tuple[dict[str, dict[str, ModelSize]], list[Problem]]:
    """Each upstream's model sizes (by upstream name, then model id), and the models that need
    one and have none. Without a budget an upstream has only the sizes ``models.<id>.memory`` gives."""
    configured = {model_id: ModelSize(model.memory, f"models.{model_id}.memory")
                  for model_id, model in config.models.items() if model.memory is not None}
    sizes: dict[str, dict[str, ModelSize]] = {}
    problems: list[Problem] = []
    for index, entry in enumerate(config.gpu_entries):
        if entry.memory is None:
            sizes[entry.name] = {m: size for m, size in configured.items() if entry.lists(m)}
            continue
        directory = models_dir(entry.command)
        found = gguf_models(directory) if directory is not None else {}
        own: dict[str, ModelSize] = {}
        missing = 0
        for model_id in served_models(config, entry, found):
            if model_id in configured:
                own[model_id] = configured[model_id]
                continue
            estimate, why_not = _estimate(found.get(model_id), entry.command, directory, model_id)
            if estimate is not None:
                own[model_id] = estimate
                continue
            missing += 1
            if not any(p.path == f"models.{model_id}.memory" for p in problems):
                problems.append(Problem(
                    f"models.{model_id}.memory",
                    f"is needed: {entry.name} has a memory budget ({memory_key(config, index)}: "
                    f"{size_document(entry.memory)}) and llamaswap cannot estimate {model_id}'s size ({why_not}). "
                    f"Set models.{model_id}.memory to what it takes loaded (its file plus its KV cache, e.g. "
                    f"8GiB), or remove the budget"))
        if not own and not missing:
            where = (f"no GGUF file in {directory}, its command's --models-dir" if directory is not None
                     else "no models.<id>, and its command gives no --models-dir")
            problems.append(Problem(
                memory_key(config, index),
                f"{entry.name} has a memory budget and llamaswap knows no model it serves ({where}): set "
                f"models.<id>.memory for each model it serves, or remove the budget"))
        sizes[entry.name] = own
    return sizes, problems


def _estimate(path: pathlib.Path | None, command: Sequence[str], directory: pathlib.Path | None,
              model_id: str) -> tuple[ModelSize | None, str]:
    """(the GGUF estimate, or None and why there is none)."""
    if directory is None:
        return None, "its command gives no --models-dir to read its GGUF file from"
    if path is None:
        return None, f"no {model_id}.gguf in {directory}"
    context = context_of(command)
    try:
        size = estimate_model_bytes(path, context, cache_type_bytes(command))
    except (GgufError, OSError) as error:
        return None, f"its GGUF file cannot be read: {error}"
    at = f"context {context}" if context else "its trained context"
    return ModelSize(size, f"estimated from {os.fspath(path)}: file + KV cache at {at}"), ""


def residency_problems(config: Config, sizes: Mapping[str, Mapping[str, ModelSize]]) -> list[Problem]:
    """Pinned models that cannot stay resident where they are pinned."""
    problems: list[Problem] = []
    pinned_models = [model_id for model_id, model in config.models.items() if model.pinned]
    for index, entry in enumerate(config.gpu_entries):
        pinned = [model_id for model_id in pinned_models if entry.lists(model_id)]
        if not pinned:
            continue
        key = max_loaded_key(config, index)
        if entry.max_loaded == 1:
            problems.extend(Problem(f"models.{model_id}.pinned",
                                    f"{entry.name} keeps one model at a time ({key}: 1), so a pinned model would "
                                    f"leave no room for any other: set {key} >= 2, or remove pinned")
                            for model_id in pinned)
            continue
        if len(pinned) > entry.max_loaded:
            problems.append(Problem(key, f"{entry.name} pins {len(pinned)} models ({', '.join(pinned)}) and keeps "
                                         f"{entry.max_loaded} at once: set {key} to {len(pinned) + 1} or more (room "
                                         f"for the others too), or unpin one"))
        if entry.memory is None:
            continue
        # The fit is the scheduler's (`Residency`), over the pinned models whose size is known
        # (one without is a problem of `model_sizes`).
        residency = residency_of(config, entry.name, sizes)
        own = sizes.get(entry.name, {})
        known = [model_id for model_id in pinned if model_id in own]
        budget = f"{entry.name}'s memory ({memory_key(config, index)}: {size_document(entry.memory)})"
        over = [model_id for model_id in known if not residency.fits((model_id,))]
        problems.extend(Problem(f"models.{model_id}.pinned",
                                f"{model_id} takes {own[model_id]} ({own[model_id].source}), more than {budget}: "
                                f"it can never be resident there. Raise the memory, or remove pinned")
                        for model_id in over)
        total = residency.bytes_together(known)
        if not over and len(pinned) > 1 and total > entry.memory:
            problems.append(Problem(memory_key(config, index),
                                    f"the pinned models ({', '.join(pinned)}) take {size_text(total)} together, more "
                                    f"than {budget}: raise it, or unpin one"))
    return problems


def residency_of(config: Config, name: str, sizes: Mapping[str, Mapping[str, ModelSize]]) -> Residency:
    """The `Residency` of the upstream named ``name``: its maxLoaded, the pinned models it may
    serve, its memory budget and the models' sizes. KeyError for a name the file does not have."""
    entry = config.entry(name)
    pinned = frozenset(model_id for model_id, model in config.models.items() if model.pinned and entry.lists(model_id))
    return Residency(entry.max_loaded, pinned, entry.memory,
                     {model_id: size.bytes for model_id, size in sizes.get(name, {}).items()},
                     idle_unload_of(entry, config.models, config.routing.keep_alive.bounds))


# Pairs of models that can never be resident together, named at most this many times per upstream.
_PAIRS_SHOWN = 6


def residency_advice(config: Config) -> list[Problem]:
    """Residency settings that are valid but do less than they seem to (warnings)."""
    problems = []
    for index, entry in enumerate(config.gpu_entries):
        key = max_loaded_key(config, index)
        if entry.memory is not None and entry.max_loaded == 1:
            problems.append(Problem(memory_key(config, index),
                                    f"{entry.name} keeps one model at a time ({key}: 1), so the budget never decides "
                                    f"what stays: set {key} >= 2 to keep several models that fit in it, or remove it"))
        pinned = [model_id for model_id, model in config.models.items() if model.pinned and entry.lists(model_id)]
        if entry.max_loaded > 1 and len(pinned) == entry.max_loaded:
            problems.append(Problem(key, f"{entry.name} pins {len(pinned)} models ({', '.join(pinned)}) and keeps "
                                         f"{entry.max_loaded} at once: no other model can ever load there. Set {key} "
                                         f"to {entry.max_loaded + 1} or more, or unpin one"))
        router = router_models_max(entry.command)
        if router is not None and router < entry.max_loaded:
            problems.append(Problem(key, f"{entry.max_loaded}, and {entry.name}'s command starts llama-server's router "
                                         f"keeping {router} models (--models-max): it would evict on its own models "
                                         f"llamaswap keeps resident. Pass --models-max {entry.max_loaded} (or more) in "
                                         f"the command, or set {key}: {router}"))
    return problems


def describe_residency(config: Config) -> list[str]:
    """What maxLoaded, memory and pinned models imply, per upstream (`llamaswap check-config`);
    nothing for an upstream that keeps one model without a budget or pins."""
    lines: list[str] = []
    for index, entry in enumerate(config.gpu_entries):
        residency = config.residency_of(entry.name)
        name = entry.name
        key = max_loaded_key(config, index)
        if residency.max_loaded == 1:  # (room for one model: `Residency` drops the budget)
            if entry.memory is not None:
                lines.append(f"{name}: one model resident at a time ({key}: 1): the memory budget does not apply")
            continue
        budget = residency.memory_bytes
        within = f", within {size_text(budget)} ({memory_key(config, index)})" if budget is not None else ""
        lines.append(f"{name}: up to {residency.max_loaded} models resident at once ({key}){within}")
        if residency.pinned:
            lines.append(f"{name}: pinned, never evicted: {', '.join(sorted(residency.pinned))}")
        if budget is not None:
            lines.extend(_fitting(name, config.model_sizes(name), residency))
    return lines


def _fitting(name: str, sizes: Mapping[str, ModelSize], residency: Residency) -> list[str]:
    """What fits in an upstream's budget: the sizes, the models that never fit, the pairs that
    never fit together, or that all fit at once."""
    assert residency.memory_bytes is not None
    budget = size_text(residency.memory_bytes)
    lines = [f"{name}: sizes: " + ", ".join(f"{model_id} {size} ({size.source})" for model_id, size in
                                          sorted(sizes.items()))]
    never = [model_id for model_id in sorted(sizes) if residency.never_fits(model_id)]
    for model_id in never:
        why = ("it is larger than the budget" if sizes[model_id].bytes > residency.memory_bytes
               else "not beside the pinned models")
        lines.append(f"{name}: {model_id} ({sizes[model_id]}) can never be resident in {budget}: {why}")
    can = [model_id for model_id in sorted(sizes) if model_id not in never]
    others = [model_id for model_id in can if model_id not in residency.pinned]
    if len(can) < 2 or not others:
        return lines
    if residency.fits(can):
        lines.append(f"{name}: {_listed(can)} fit together")
        return lines
    if residency.max_loaded - len(residency.pinned) < 2:
        lines.append(f"{name}: one model at a time beside the pinned ones ({_listed(sorted(residency.pinned))})")
        return lines
    pairs = [(a, b) for i, a in enumerate(others) for b in others[i + 1:]
             if not residency.fits(residency.pinned | {a, b})]
    beside = " with the pinned models" if residency.pinned else ""
    for a, b in pairs[:_PAIRS_SHOWN]:
        together = size_text(residency.bytes_together(residency.pinned | {a, b}))
        lines.append(f"{name}: {a} and {b} are never resident together ({together}{beside}, over {budget})")
    if len(pairs) > _PAIRS_SHOWN:
        lines.append(f"{name}: and {len(pairs) - _PAIRS_SHOWN} more pairs that are never resident together")
    if not pairs:
        lines.append(f"{name}: any two of {_listed(others)} fit together{beside}, not all at once")
    return lines


def _listed(names: Sequence[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"
