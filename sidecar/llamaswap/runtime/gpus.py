"""The node's GPUs as the runtime keeps them: one `Gpu` per upstream (`upstreams:`), each with
its own catalog (reconciled with the scheduler's resident models: `Gpus.reconcile`), slot learning,
settle and adopted exchanges. The scheduler holds the one queue over them (its GPUs); everything
here is what holds one upstream apart from the others: a settle or an adopted exchange on one GPU
stops grants on that GPU only. Each GPU reads its own entry of the configuration
(`Config.entry`, `Config.slots`, `Config.gpu_policy`, by its name).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence

from llamaswap.config import SLOTS_AUTO, Config, GpuEntry, ModelCheck
from llamaswap.config.sections import RENEWALS_PER_LEASE
from llamaswap.core import Clock, Policy, Scheduler
from llamaswap.runtime.catalog import ModelCatalog
from llamaswap.runtime.leases import Adoption
from llamaswap.runtime.observer import Settle, SettleReason
from llamaswap.runtime.settle import Settling, settle_upstream
from llamaswap.runtime.slot_learning import SlotLearner
from llamaswap.runtime.upstream import Catalog, Upstream, UpstreamKind


# The most (model, scheduled) pairs whose GPUs `Gpus._may_answer` remembers at once.
_ANSWERS_REMEMBERED = 1024


@dataclasses.dataclass(eq=False)
class Gpu:
    """One upstream of the node and what the runtime knows of it."""

    name: str
    upstream: Upstream
    catalog: ModelCatalog
    slots: SlotLearner
    settling: Settling | None = None
    # The node's adopted exchanges (`Leases.adopted`, their one record): this GPU's are those
    # that name it.
    adoptions: Mapping[str, Adoption] = dataclasses.field(default_factory=dict)

    @property
    def adopted(self) -> list[str]:
        """The tokens of the adopted exchanges that hold it."""
        return [token for token, adoption in self.adoptions.items() if adoption.gpu == self.name]

    async def settle(self, settling: Settling, *, stop: bool, clock: Clock, unloaded: Callable[[], None],
                     settle_timeout_s: float, max_run_s: float, lease_ns: int,
                     known_running: Callable[[], int]) -> Settle:
        """Its settle loop (`settle.py`) until it ends; then the settle is no longer under way."""
        deadline_ns = settling.deadline_ns(settle_timeout_s, max_run_s)

        async def residents() -> frozenset[str]:
            # At startup, the models to ask about are the ones the upstream says it has loaded.
            catalog = await self.catalog.refresh()
            if catalog is not None and catalog.kind is UpstreamKind.ROUTER:
                return catalog.residents
            return frozenset() if settling.model is None else frozenset((settling.model,))

        startup = settling.reason is SettleReason.STARTUP
        # After a restart, an upstream that cannot tell leaves one witness of a running exchange:
        # Envoy's periodic access-log entry, sent every leaseSeconds/3. Wait for one interval.
        blind_until_ns = settling.started_ns + lease_ns // RENEWALS_PER_LEASE if startup else None
        try:
            settle = await settle_upstream(
                self.upstream, settling, stop=stop, clock=clock, deadline_ns=deadline_ns,
                residents=residents if startup else None, unloaded=unloaded, blind_until_ns=blind_until_ns,
                known_running=known_running)
            return dataclasses.replace(settle, gpu=self.name)
        finally:
            if self.settling is settling:
                self.settling = None


class Gpus:
    """The node's GPUs, in the configured order."""

    def __init__(self, gpus: list[Gpu], adoptions: Mapping[str, Adoption]) -> None:
        self.all = gpus
        self.adoptions = adoptions  # the node's adopted exchanges (`Leases.adopted`), which each GPU reads
        self._by_name = {gpu.name: gpu for gpu in gpus}
        # `_may_answer`'s answers by (model, scheduled), and the policy and entries they hold under.
        self._answering: dict[tuple[str, str | None], tuple[Gpu, ...]] = {}
        self._answering_under: tuple[Policy | None, Mapping[str, GpuEntry] | None] = None, None

    def __iter__(self) -> Iterator[Gpu]:
        return iter(self.all)

    def __len__(self) -> int:
        return len(self.all)

    def named(self, name: str) -> Gpu:
        """The GPU of that name: every caller has one (a grant's, an adoption's, a catalog's).
        Raises KeyError for a name that is not configured."""
        return self._by_name[name]

    def reported(self, name: str | None) -> Gpu | None:
        """The GPU an exchange Envoy reports runs on: the one its access-log entry names (the
        cluster its route chose: `envoy.contract.gpu_of_cluster`). An entry that names none,
        or a GPU not configured (a grant's route always names one of ours; an exchange that reached
        no upstream names none), is placed only where there is no choice: on a node of one GPU it
        is that GPU, on several it cannot be placed (None)."""
        gpu = self._by_name.get(name) if name is not None else None
        if gpu is None and len(self.all) == 1:
            return self.all[0]
        return gpu

    def routers(self) -> frozenset[str]:
        """The GPUs whose upstream is llama-server's router, as last read: those that can unload a
        model (idle unloads, `idle.py`)."""
        return frozenset(gpu.name for gpu in self.all
                         if gpu.catalog.latest is not None and gpu.catalog.latest.kind is UpstreamKind.ROUTER)

    def single_model(self) -> str | None:
        """The key every request is scheduled on where every upstream serves one model whatever
        the name, and the same one (`ModelCatalog.single_model`); None otherwise."""
        if len(self.all) == 1:  # (each admission asks)
            return self.all[0].catalog.single_model()
        keys = {gpu.catalog.single_model() for gpu in self.all}
        return keys.pop() if len(keys) == 1 else None

    async def serves(self, model: str, scheduled: str | None, policy: Policy, entries: Mapping[str, GpuEntry],
                     model_check: ModelCheck) -> bool:
        """Whether some GPU answers the client's name ``model``: its entry lists it (the operator's
        ``upstreams[i].models`` names what the GPU answers, `GpuEntry.lists`, ``entries`` by GPU
        name: a single-model server answers every name with its one model, and a name its entry
        does not list is refused there), the scheduler may run there what the request is scheduled
        as (``scheduled``: `GpuPolicy.may_serve`, the one rule), and the upstream lists it
        (upstream.modelCheck, ``model_check``: `ModelCatalog.serves`, each asked again once on a miss)."""
        for gpu in self._may_answer(model, scheduled, policy, entries):
            if await gpu.catalog.serves(model, model_check):
                return True
        return False

    def serves_now(self, model: str, scheduled: str | None, policy: Policy, entries: Mapping[str, GpuEntry],
                   model_check: ModelCheck) -> bool | None:
        """`serves` where it needs no upstream asked (the usual case, without a coroutine), else None."""
        for gpu in self._may_answer(model, scheduled, policy, entries):
            # (`serves` asks the first one that does not say so now, and goes on if it says no.)
            return True if gpu.catalog.serves_now(model, model_check) else None
        return False

    def _may_answer(self, model: str, scheduled: str | None, policy: Policy,
                    entries: Mapping[str, GpuEntry]) -> tuple[Gpu, ...]:
        """The GPUs whose entry lists ``model`` and where the scheduler may run it as ``scheduled``.
        (Each admission asks: the answer is remembered while ``policy`` and ``entries``, values
        replaced when they change, are those it was worked out under.)"""
        if policy is not self._answering_under[0] or entries is not self._answering_under[1] or (
                len(self._answering) >= _ANSWERS_REMEMBERED):
            self._answering.clear()
            self._answering_under = policy, entries
        asked = model, scheduled
        gpus = self._answering.get(asked)
        if gpus is None:
            gpus = self._answering[asked] = tuple(
                gpu for gpu in self.all if entries[gpu.name].lists(model) and policy.gpu(gpu.name).may_serve(scheduled))
        return gpus

    def reconcile(self, catalog: Catalog, as_of: int, name: str, *, scheduler: Scheduler,
                  config: Config, changed: Callable[[], None], reconfigure: Callable[[], None]) -> None:
        """Catalog reconciliation: a catalog of an upstream, asked when its
        `Scheduler.dispatches_on` was `as_of`. What it says is loaded goes to the scheduler (unless
        a grant overtook it: `changed` when applied); the `models.<id>` that match nothing are
        said; a change of the one model of single-model upstreams that changes the node's policy
        re-applies the settings (`reconfigure`: the one model's models.<id>.slots, whatever the id);
        the GPU's slot learning sees the catalog."""
        gpu = self.named(name)
        before = gpu.catalog.single_model(), self.single_model()
        gpu.catalog.latest = catalog
        # A single-model upstream has its one model loaded whenever it answers.
        own = gpu.catalog.single_model()
        if catalog.residents_known or own is not None:
            single = self.single_model() or own
            loaded = catalog.residents if catalog.residents_known or single is None else frozenset((single,))
            if scheduler.set_residents(loaded, as_of=as_of, gpu=gpu.name):
                changed()
        gpu.catalog.warn_unmatched(config.models)
        if (own, self.single_model()) != before and node_policy(config, self, self.single_model()) != scheduler.policy:
            reconfigure()
        gpu.slots.observe(catalog)

    def reloaded(self, config: Config) -> None:
        """A reload: the models.<id> that match nothing are said again."""
        for gpu in self.all:
            gpu.catalog.warn_unmatched(config.models, anew=True)

    def close(self) -> None:
        for gpu in self.all:
            gpu.slots.close()
            if gpu.settling is not None and gpu.settling.task is not None:
                gpu.settling.task.cancel()
            gpu.catalog.close()


def make_gpus(config: Config, upstreams: Sequence[Upstream], *, dispatches: Callable[[str], int],
              observed: Callable[[str, Catalog, int], None], config_now: Callable[[], Config],
              learnt: Callable[[], None], runs: Callable[[str, str], bool],
              default_slots: Callable[[str], int], adopted: Mapping[str, Adoption]) -> Gpus:
    """One `Gpu` per configured upstream, in order (``upstreams`` in the same order); ``adopted``:
    the node's adopted exchanges (`Leases.adopted`), which each reads its own from."""
    gpus = []
    for entry, upstream in zip(config.gpu_entries, upstreams, strict=True):
        name = entry.name
        catalog = ModelCatalog(upstream, dispatches=functools.partial(dispatches, name),
                               observed=functools.partial(observed, name))
        learner = SlotLearner(name, config=config_now, catalog=catalog,
                              upstream=upstream, apply=lambda _config: learnt(), runs=functools.partial(runs, name),
                              default_slots=functools.partial(default_slots, name))
        gpus.append(Gpu(name, upstream, catalog, learner, adoptions=adopted))
    return Gpus(gpus, adopted)


def auto_slots(config: Config) -> frozenset[str]:
    """The upstreams whose slots are learnt (slots: auto)."""
    return frozenset(entry.name for entry in config.gpu_entries if entry.slots == SLOTS_AUTO)


def served_by(catalog: Catalog | None) -> frozenset[str] | None:
    """The one model a single-model upstream serves, by its last answer (it answers any name
    with it, so the node sends it only that model's requests); None: no such limit known."""
    if catalog is None or catalog.kind is not UpstreamKind.SINGLE or catalog.models is None:
        return None
    return catalog.models if len(catalog.models) == 1 else None


def node_policy(config: Config, gpus: Gpus, single: str | None) -> Policy:
    """The scheduler's policy over the node (one GPU is a node of one): one GPU per upstream, named
    as configured, with its own slots (learnt ones too) and the models it may serve (its
    ``models`` list; with several, narrowed to the one model a single-model server serves, so
    that the node sends it only that model's requests: with one there is nowhere else to send
    the others, and the server answers them), and how many models it keeps resident at once
    (``maxLoaded``, pinned models, ``memory``: `Config.residency_of`)."""
    policies = []
    for gpu in gpus:
        own = gpu.catalog.single_model() if single is not None else None
        policy = config.gpu_policy(gpu.name, gpu.slots.learnt, own)
        served = served_by(gpu.catalog.latest) if len(gpus) > 1 else None
        if served is not None:
            policy = dataclasses.replace(policy, models=served if policy.models is None else policy.models & served)
        policies.append(policy)
    return config.policy(policies)
