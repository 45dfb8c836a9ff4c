"""Idle unloads (`models.<id>.ttl`, `upstream.idleUnloadSeconds`): which resident models have sat
idle long enough to be unloaded, and when the next one will have.

A resident model is idle on a GPU while nothing runs on it, none of it loads, no settle waits for
its generation, nothing holds the GPU (`GpuHolding.blocked`) and no request that could use it
waits: one naming it, one naming no model, or a place kept for a retry of it. It has been idle
since its last grant there ended, or since the scheduler counted it resident anew (a report, an
unload that failed), whichever is later (`GpuHolding.idle_since`, kept by `GpuRecord` on the
scheduler's clock; its last grant: `GpuHolding.last_used`). It falls due once it has been idle
its `IdleUnload.after_ns`; 0 (the default), or a pinned model: never. Where the operator honours
Ollama's keep_alive (`routing.keepAlive`), the last request granted of the model on that GPU
says instead, if it asked one (`IdleUnloading.keep_alive`, `IdleUnload.idle_for_ns`): 0 falls due
as soon as it is idle, a negative one never (or after ``maxSeconds``); a request that asks none
gives the model back its configured time. It lasts while the model stays resident there.

Pure: values in, values out. `IdleUnloading` is the scheduler's part of it (a base of
`Scheduler`, so that this job keeps its own room beside the grant rule's): what is due
(`idle_unloads`), and an idle model counted gone as its unload begins (`unload_idle`: a load of
it then waits for the unload, as for an eviction's); the runtime unloads it (`runtime/idle.py`).
An unload that fails counts the model resident again, which marks it anew: it is tried again a
whole idle time later, never in a loop.
"""

from __future__ import annotations

from collections.abc import Collection, Container, Sequence
from typing import TYPE_CHECKING, NamedTuple

from llamaswap.core.eviction import busy_of
from llamaswap.core.holding import GpuHolding

if TYPE_CHECKING:
    from llamaswap.core.clock import Clock
    from llamaswap.core.gpu_record import GpuRecord, NodeHolding
    from llamaswap.core.kept import KeptPlaces


class IdleModel(NamedTuple):
    """A resident model idle on a GPU: since when, and when it falls due for an unload (None: never)."""

    gpu: str
    model: str
    since_ns: int
    due_ns: int | None


def idle_models(holding: GpuHolding, waited_for: Container[str | None]) -> list[IdleModel]:
    """The resident models idle on one GPU (see the module), by name, each with since when and
    when it falls due."""
    if holding.blocked or not holding.residents or None in waited_for:
        return []
    residency = holding.residency
    idle = residency.idle
    last_used = holding.last_used
    since = holding.idle_since
    asked = holding.keep_alive
    found = []
    for model in sorted(holding.residents):
        if model == holding.settling_model or model in waited_for or busy_of(holding, model)[0]:
            continue
        since_ns = max(since.get(model, 0), last_used.get(model, 0))
        after_ns = None if model in residency.pinned else idle.idle_for_ns(model, asked.get(model))
        found.append(IdleModel(holding.name, model, since_ns, None if after_ns is None else since_ns + after_ns))
    return found


class IdleDue(NamedTuple):
    """The node's idle models (`idle_models`, GPU by GPU), those due at ``now`` (their unload may
    begin), and when the next of the others falls due (None: none will while nothing changes)."""

    idle: tuple[IdleModel, ...]
    due: tuple[IdleModel, ...]
    next_ns: int | None


def idle_due(holdings: Sequence[GpuHolding], waited_for: Container[str | None], now_ns: int,
             gpus: Container[str] | None = None) -> IdleDue:
    """`IdleDue` over ``holdings`` at ``now_ns``; only ``gpus`` (None: all) may have models due
    (the others' upstreams cannot unload one: they are shown, never due)."""
    idle: list[IdleModel] = []
    due: list[IdleModel] = []
    next_ns: int | None = None
    for holding in holdings:
        found = idle_models(holding, waited_for)
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


class IdleUnloading:
    """The scheduler's idle unloads, read from its own record (a base of `Scheduler`: these are
    the attributes it sets)."""

    _clock: Clock
    _gpus: list[GpuRecord]
    _holding: NodeHolding
    _wanted: dict[str | None, int]
    _kept: KeptPlaces

    def idle_unloads(self, gpus: Collection[str] | None = None) -> IdleDue:
        """The idle resident models, those due for an idle unload now (only on ``gpus``: those
        whose upstream can unload one; None: any) and when the next falls due."""
        waited = {*self._wanted, *(place.model for place in self._kept.places())}
        return idle_due(self._holding.now()[0], waited, self._clock.now_ns(), gpus)

    def keep_alive(self, gpu: str, model: str, requested_s: float | None) -> None:
        """A request of ``model`` granted on ``gpu`` asked this keep_alive (`core/keep_alive.py`;
        None: none): the model's idle time there from now on, where honoured (see the module)."""
        for record in self._gpus:
            if record.name == gpu:
                if requested_s is None:
                    record.keep_alive.pop(model, None)
                else:
                    record.keep_alive[model] = requested_s

    def unload_idle(self, gpu: str, models: frozenset[str]) -> None:
        """Idle models whose unload begins: no longer counted resident (a load of one waits for it)."""
        for record in self._gpus:
            if record.name == gpu:
                record.set_residents(record.residents - models)
        self._holding.changed(residents=True)
