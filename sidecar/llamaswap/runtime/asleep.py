"""The router's own sleep: llama-server's `--sleep-idle-seconds` frees an idle model's weights
and lists it `sleeping` (its process stays; any request naming it wakes it, which is a load).

- Not resident: the catalog counts a sleeping model out of its residents (`catalog_from`), and
  the catalog reconciliation tells the scheduler (`Gpus.reconcile`, the one path), so the next
  request of it is estimated, ordered and recorded as a load. So is a model the router unloaded
  by itself, once a catalog says so.
- Noticed before a grant (`look`): a request whose model a sleeping router's GPU counts resident,
  with nothing of it running there and last granted there at least the router's shortest sleep
  time ago (`Catalog.sleep_after_s`: none sooner can be asleep), waits until that GPU's catalog has
  been read again before it is queued. Requests at the same moment share one read; a router that
  puts nothing to sleep is never asked here.
- Room (`observed`): a sleeping model still holds one of the router's `--models-max` places, so
  where the GPU keeps several models (maxLoaded above 1) the scheduler, counting it gone, would let
  a load make the router evict by itself (its least recently used, maybe a busy one). Each sleeping
  model the scheduler no longer counts is unloaded (`Evictions.unload`: loads on that GPU wait for
  it, as for a grant's evictions); one whose unload failed is counted resident again and not tried
  again while it sleeps. With room for one the router replaces its model by itself anyway.
- A pinned model (`models.<id>.pinned`) is never unloaded by llamaswap: asleep, it stays counted
  resident (its place is held; its next request is estimated as if it needed no load), and a
  warning says so once (set the router's sleep off for it: `sleep-idle-seconds = -1` in its
  `--models-preset` section).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
from collections.abc import Awaitable

from llamaswap.core import NS_PER_S, Clock, Scheduler
from llamaswap.core.eviction import busy_of
from llamaswap.core.holding import GpuHolding
from llamaswap.runtime.catalog import puts_to_sleep
from llamaswap.runtime.evictions import Evictions
from llamaswap.runtime.gpus import Gpu, Gpus
from llamaswap.runtime.upstream import Catalog

_log = logging.getLogger(__name__)


def may_be_asleep(catalog: Catalog | None, holding: GpuHolding, model: str | None, now_ns: int) -> bool:
    """Whether ``model``, which the scheduler counts resident on that GPU, may have been put to
    sleep since ``catalog`` was read: the router puts models to sleep, nothing of it runs there,
    and its last grant there is at least the shortest sleep time old."""
    if not puts_to_sleep(catalog):
        return False
    assert catalog is not None and catalog.sleep_after_s is not None
    if not holding.has(model) or busy_of(holding, model)[0]:
        return False
    assert model is not None
    last_ns = holding.last_used.get(model)
    return last_ns is None or now_ns - last_ns >= catalog.sleep_after_s * NS_PER_S


def asleep_to_unload(catalog: Catalog, holding: GpuHolding, evicting: frozenset[str],
                     failed: frozenset[str]) -> frozenset[str]:
    """The sleeping models to unload on a GPU after ``catalog`` was applied: where it keeps several
    models, each one asleep that the scheduler no longer counts, that nothing runs on, not being
    unloaded already, and whose unload has not failed while it sleeps."""
    if holding.residency.replaces_by_itself:
        return frozenset()
    return frozenset(model for model in catalog.asleep - holding.residents - evicting - failed
                     if not busy_of(holding, model)[0])


class RouterSleep:
    """See the module's docstring."""

    def __init__(self, gpus: Gpus, scheduler: Scheduler, clock: Clock, evictions: Evictions) -> None:
        self._gpus = gpus
        self._scheduler = scheduler
        self._clock = clock
        self._evictions = evictions  # (the grants' own)
        # By GPU: sleeping models being unloaded or whose unload failed, marked as it begins (not
        # begun again), and of those the ones that failed; each kept while a catalog lists it asleep.
        self._tried: dict[str, set[str]] = {}
        self._failed: dict[str, set[str]] = {}
        self._said: set[tuple[str, str]] = set()  # (GPU, pinned model) warned about asleep

    def look(self, model: str | None) -> Awaitable[object] | None:
        """Before a request of ``model`` is queued: the reads again of the catalog of each GPU
        where it may have been put to sleep (`may_be_asleep`), to wait for; None where there is
        none (no coroutine on the admission path for the usual case)."""
        # (A GPU whose router puts nothing to sleep is passed by without building its holding, and
        # with none such the clock is not read: this runs at every admission.)
        sleeping = [gpu for gpu in self._gpus.all if gpu.catalog.puts_to_sleep]
        if not sleeping:
            return None
        now_ns = self._clock.now_ns()
        stale = [gpu for gpu in sleeping
                 if may_be_asleep(gpu.catalog.latest, self._scheduler.holding_of(gpu.name), model, now_ns)]
        return asyncio.gather(*(gpu.catalog.refresh() for gpu in stale)) if stale else None

    def reported(self, gpu: str, catalog: Catalog) -> Catalog:
        """What a catalog of ``gpu`` tells the scheduler is resident (`Gpus.reconcile`): a sleeping
        model that is pinned, or that the upstream would not unload, still holds its place, so it
        is counted."""
        for marks in (self._tried, self._failed):
            if gpu in marks:
                marks[gpu] &= catalog.asleep  # awake or gone since: tried again when it next sleeps
        if not catalog.asleep:
            return catalog
        pinned = catalog.asleep & self._scheduler.policy.gpu(gpu).residency.pinned
        for model in sorted(pinned):
            if (gpu, model) not in self._said:
                self._said.add((gpu, model))
                _log.warning("models.%s.pinned: the router on %s put %s to sleep (--sleep-idle-seconds); it stays "
                             "counted resident and is never unloaded, and its next request wakes it: set "
                             "sleep-idle-seconds = -1 in its --models-preset section to keep it loaded",
                             model, gpu, model)
        kept = pinned | self._failed.get(gpu, set())
        return dataclasses.replace(catalog, residents=catalog.residents | kept) if kept else catalog

    def observed(self, gpu: Gpu, catalog: Catalog) -> None:
        """A catalog of ``gpu`` was reconciled: unload the sleeping models that hold a place of the
        router's the scheduler no longer counts (`asleep_to_unload`), each on its own."""
        if not catalog.asleep:
            return
        evictions = self._evictions
        tried = self._tried.setdefault(gpu.name, set())
        models = asleep_to_unload(catalog, self._scheduler.holding_of(gpu.name), evictions.evicting(gpu.name),
                                  frozenset(tried))
        for model in sorted(models):
            tried.add(model)
            done = evictions.unload(gpu.name, frozenset((model,)),
                                    "the router put it to sleep, and it still holds one of its --models-max places")
            done.add_done_callback(functools.partial(self._ended, gpu.name, model))

    def _ended(self, gpu: str, model: str, unloads: asyncio.Future[str | None]) -> None:
        if unloads.cancelled():
            return
        if unloads.result() is None:
            self._tried.get(gpu, set()).discard(model)  # gone: when next asleep, unloaded again
            return
        # It would not go: counted resident again, as `Evictions` did (a catalog read since may
        # have dropped it), and not tried again while it sleeps.
        _log.warning("the upstream did not unload %s on %s, which it put to sleep: it stays counted resident",
                     model, gpu)
        self._failed.setdefault(gpu, set()).add(model)
        self._scheduler.not_unloaded(gpu, frozenset((model,)))
