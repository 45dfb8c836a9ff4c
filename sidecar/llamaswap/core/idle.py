"""Idle unloads (`models.<id>.ttl`, `upstream.idleUnloadSeconds`): which resident models have sat
idle long enough to be unloaded, and when the next one will have.

A resident model is idle on a GPU while nothing runs on it, none of it loads, no settle waits for
its generation, nothing holds the GPU (`GpuHolding.blocked`) and no request that could use it
waits: one naming it, one naming no model, or a place kept for a retry of it. It has been idle
since its last grant there ended (`IdleSince`: a release marks it), or since the scheduler first
counted it resident (a report, an unload that failed), whichever is later. It falls due once it
has been idle its `IdleUnload.after_ns`; 0 (the default), or a pinned model: never.

Pure: values in, values out; the scheduler keeps the marks (`Scheduler.idle_unloads`) and counts
an idle model gone as its unload begins (`Scheduler.unload_idle`: a load of it then waits for the
unload, as for an eviction's), and the runtime unloads it (`runtime/idle.py`). An unload that
fails counts the model resident again, which marks it anew: it is tried again a whole idle time
later, never in a loop.
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Mapping, Sequence
from typing import NamedTuple

from llamaswap.core.eviction import busy_of
from llamaswap.core.holding import GpuHolding

_NONE: Mapping[str, int] = {}


class IdleSince:
    """When each model on each GPU last became idle by an event the holding does not keep: a
    release of its grant, or being counted resident anew. (Its last grant: `GpuHolding.last_used`.)"""

    __slots__ = ("_since",)

    def __init__(self) -> None:
        self._since: dict[str, dict[str, int]] = {}

    def mark(self, gpu: str, models: Iterable[str | None], now_ns: int) -> None:
        """``models`` became idle on ``gpu`` now (the idle time counts from here)."""
        marks = self._since.get(gpu)
        for model in models:
            if model is None:
                continue
            if marks is None:
                marks = self._since[gpu] = {}
            marks[model] = now_ns

    def of(self, gpu: str) -> Mapping[str, int]:
        return self._since.get(gpu, _NONE)


class IdleModel(NamedTuple):
    """A resident model idle on a GPU: since when, and when it falls due for an unload (None: never)."""

    gpu: str
    model: str
    since_ns: int
    due_ns: int | None


def idle_models(holding: GpuHolding, since: Mapping[str, int], waited_for: Container[str | None]) -> list[IdleModel]:
    """The resident models idle on one GPU (see the module), by name, each with since when and
    when it falls due."""
    if holding.blocked or not holding.residents or None in waited_for:
        return []
    residency = holding.residency
    idle = residency.idle
    last_used = holding.last_used
    found = []
    for model in sorted(holding.residents):
        if model == holding.settling_model or model in waited_for or busy_of(holding, model)[0]:
            continue
        since_ns = max(since.get(model, 0), last_used.get(model, 0))
        after_ns = 0 if model in residency.pinned else idle.after_ns(model)
        found.append(IdleModel(holding.name, model, since_ns, since_ns + after_ns if after_ns > 0 else None))
    return found


class IdleDue(NamedTuple):
    """The node's idle models (`idle_models`, GPU by GPU), those due at ``now`` (their unload may
    begin), and when the next of the others falls due (None: none will while nothing changes)."""

    idle: tuple[IdleModel, ...]
    due: tuple[IdleModel, ...]
    next_ns: int | None


def idle_due(holdings: Sequence[GpuHolding], since: IdleSince, waited_for: Container[str | None], now_ns: int,
             gpus: Container[str] | None = None) -> IdleDue:
    """`IdleDue` over ``holdings`` at ``now_ns``; only ``gpus`` (None: all) may have models due
    (the others' upstreams cannot unload one: they are shown, never due)."""
    idle: list[IdleModel] = []
    due: list[IdleModel] = []
    next_ns: int | None = None
    for holding in holdings:
        found = idle_models(holding, since.of(holding.name), waited_for)
        if gpus is not None and holding.name not in gpus:
            found = [model._replace(due_ns=None) for model in found]
        idle.extend(found)
        for model in found:
            if model.due_ns is None:
                continue
            if model.due_ns <= now_ns:
                due.append(model)
            elif next_ns is None or model.due_ns < next_ns:
                next_ns = model.due_ns
    return IdleDue(tuple(idle), tuple(due), next_ns)
