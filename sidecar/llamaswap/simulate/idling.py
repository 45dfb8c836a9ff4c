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
"""

from __future__ import annotations

from collections.abc import Collection, Set

from llamaswap.core import Decision, Policy, Scheduler
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
        # Models unloaded for idleness, by GPU, whose next load there would count as a reload.
        self._gone: dict[str, set[str]] = {gpu: set() for gpu in gpus}

    def unload_due(self) -> int:
        """Unload the models due now (at the scheduler's clock); how many went."""
        due = self._scheduler.idle_unloads(self._unloading).due
        by_gpu: dict[str, set[str]] = {}
        for idle in due:
            by_gpu.setdefault(idle.gpu, set()).add(idle.model)
        for gpu, models in by_gpu.items():
            self._scheduler.unload_idle(gpu, frozenset(models))
            self._unloads[gpu] += len(models)
            self._gone[gpu] |= models
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
        gone = self._gone[decision.gpu]
        if not gone:
            return
        model = decision.model
        if model in gone:
            gone.discard(model)
            if decision.model_load:
                self._reloads[decision.gpu] += 1
        if decision.model_load and gone:  # would each have stayed beside what is resident now?
            residency = self._policy.gpu(decision.gpu).residency
            residents = self._scheduler.residents_on(decision.gpu)
            self._gone[decision.gpu] = {other for other in gone if residency.fits(residents | {other})}

    def metrics(self) -> IdleMetrics:
        gpus = {gpu: IdleGpuMetrics(self._unloads[gpu], self._reloads[gpu]) for gpu in self._unloads}
        return IdleMetrics(sum(self._unloads.values()), sum(self._reloads.values()), gpus)
