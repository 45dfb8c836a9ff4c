"""Idle unloads in the replay (`simulate --idle-unload S`, `-c FILE`'s `models.<id>.ttl`): the
scheduler says which resident models are due and when the next falls due
(`Scheduler.idle_unloads`), as it tells the runtime (`runtime/idle.py`); this unloads the due
ones at their due time and counts what they cost later.

- Every GPU of the replay is taken as llama-server's router, the one upstream that can unload a
  model, unless told otherwise (``unloading``: `-c FILE`'s upstreams whose command starts a
  single-model llama-server cannot; llama-swap unloads by its own `ttl`).
- The unload takes no time: the router stops the model's process at once, and the model is
  counted gone as the unload begins (`Scheduler.unload_idle`), as in the runtime.
- Reloads: the loads an idle unload cost later. A grant that loads a model on the GPU that
  idle-unloaded it is one, if it is that model's first grant there since the unload and the
  model would have stayed resident until then: at every load of another model there in between,
  it would have fitted beside the GPU's residents (`Residency.fits`; with room for one model,
  any other load would have replaced it anyway, and the load it then needs is not counted).
- Freed: what the unloads bought, the time each model stayed out of memory where it would have
  stayed resident by the same rule: from its unload to its next grant there, or to the load that
  would have replaced it, or to the replay's last release (model-seconds).
"""

from __future__ import annotations

from collections.abc import Collection, Set

from llamaswap.core import NS_PER_S, Decision, Policy, Scheduler
from llamaswap.simulate.results import IdleGpuMetrics, IdleMetrics
from llamaswap.simulate.running import NEVER


class IdleReplay:
    """See the module's docstring: one per replay, over its scheduler."""

    def __init__(self, scheduler: Scheduler, policy: Policy, gpus: Collection[str],
                 unloading: Set[str] | None = None) -> None:
        """``unloading``: the GPUs whose upstream can unload a model (None: every one)."""
        self._scheduler = scheduler
        self._policy = policy
        self._unloading = unloading
        # Whether any model may ever be unloaded for idleness (else nothing is asked).
        self.on = any(gpu.residency.idle.ever for gpu in policy.gpus if unloading is None or gpu.name in unloading)
        self._unloads = dict.fromkeys(gpus, 0)
        self._reloads = dict.fromkeys(gpus, 0)
        self._freed_ns = dict.fromkeys(gpus, 0)
        # Models unloaded for idleness that would have stayed resident, by GPU, each with when it
        # went: its next load there would be a reload.
        self._gone: dict[str, dict[str, int]] = {gpu: {} for gpu in gpus}

    def unload_due(self, now_ns: int) -> int:
        """Unload the models due at ``now_ns`` (the scheduler's clock); how many went."""
        due = self._scheduler.idle_unloads(self._unloading).due
        by_gpu: dict[str, set[str]] = {}
        for idle in due:
            by_gpu.setdefault(idle.gpu, set()).add(idle.model)
        for gpu, models in by_gpu.items():
            self._scheduler.unload_idle(gpu, frozenset(models))
            self._unloads[gpu] += len(models)
            self._gone[gpu].update(dict.fromkeys(models, now_ns))
        return len(due)

    def next_at(self, now_ns: int) -> int:
        """When to unload next: now if some model is due already, else the next due time (NEVER:
        none while nothing changes)."""
        found = self._scheduler.idle_unloads(self._unloading)
        if found.due:
            return now_ns
        return NEVER if found.next_ns is None else found.next_ns

    def granted(self, decision: Decision) -> None:
        """A grant: a reload where it loads a model its GPU unloaded for idleness (see the module)."""
        gpu = decision.gpu
        gone = self._gone[gpu]
        if not gone:
            return
        now_ns = decision.granted_ns
        model = decision.model
        if model is not None and model in gone:
            self._freed_ns[gpu] += now_ns - gone.pop(model)
            if decision.model_load:
                self._reloads[gpu] += 1
        if decision.model_load and gone:  # would each have stayed beside what is resident now?
            residency = self._policy.gpu(gpu).residency
            residents = self._scheduler.residents_on(gpu)
            for other in [other for other in gone if not residency.fits(residents | {other})]:
                self._freed_ns[gpu] += now_ns - gone.pop(other)

    def metrics(self, end_ns: int) -> IdleMetrics:
        """The counts, the models still out of memory freed until ``end_ns`` (the last release)."""
        for gpu, gone in self._gone.items():
            self._freed_ns[gpu] += sum(max(0, end_ns - since) for since in gone.values())
            gone.clear()
        gpus = {gpu: IdleGpuMetrics(self._unloads[gpu], self._reloads[gpu], _seconds(self._freed_ns[gpu]))
                for gpu in self._unloads}
        return IdleMetrics(sum(self._unloads.values()), sum(self._reloads.values()),
                           _seconds(sum(self._freed_ns.values())), gpus)


def _seconds(ns: int) -> float:
    return round(ns / NS_PER_S, 3)  # (to the millisecond: the JSON reads cleanly)
