"""Idle unloads in the runtime (`models.<id>.ttl`, `upstream.idleUnloadSeconds`): the core says
which resident models are due and when the next falls due (`Scheduler.idle_unloads`); this arms
one timer for it and unloads the due ones.

- Each due model is counted gone first (`Scheduler.unload_idle`), then unloaded like an eviction
  (`Evictions.unload`): a request that arrives meanwhile needs a load, which waits for the unload
  to end (an unload half done is not taken back); one of another model that runs beside it goes
  at once. An unload that fails counts the model resident again (`Evictions`), and it is tried
  again a whole idle time later.
- Only where the upstream can unload a model: llama-server's router (its `POST /models/unload`).
  A single-model llama-server cannot (the configuration warns); llama-swap unloads by its own
  `ttl` (the same keys, when it reads the same file). Its idle models are shown, never due.
- Seen as an eviction with the reason `idle` (`Observer.idle_unloaded`: the activity log's
  `eviction` record, `llamaswap_model_evictions_total{reason="idle"}`).
- Re-armed after whatever can change the due times: each pass of the grant decision (arrivals,
  grants, releases, a reload), a catalog applied, an unload's end. Nothing is done where no GPU
  has an idle time (the default).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable

from llamaswap.core import NS_PER_S, Clock, Policy, Scheduler
from llamaswap.core.idle import IdleModel
from llamaswap.runtime.evictions import Evictions
from llamaswap.runtime.gpus import Gpus
from llamaswap.runtime.observer import IdleUnloaded

_log = logging.getLogger(__name__)


class IdleUnloads:
    """See the module's docstring. ``unloaded``: tells the observers of one idle unload (after the
    step); ``changed``: what the scheduler counts resident changed (the views and gauges publish it)."""

    def __init__(self, gpus: Gpus, scheduler: Scheduler, clock: Clock, evictions: Evictions,
                 unloaded: Callable[[IdleUnloaded], None], changed: Callable[[], None]) -> None:
        self._gpus = gpus
        self._scheduler = scheduler
        self._clock = clock
        self._evictions = evictions
        self._unloaded = unloaded
        self._changed = changed
        self._timer: asyncio.TimerHandle | None = None
        self._timer_ns: int | None = None
        self._policy: Policy | None = None  # the policy `_ever` was worked out for
        self._ever = False

    def arm(self) -> None:
        """Unload what is due now, and set the one timer for the next due time."""
        policy = self._scheduler.policy
        if policy is not self._policy:
            self._policy = policy
            self._ever = any(gpu.residency.idle.ever for gpu in policy.gpus)
        if not self._ever:
            self._cancel()
            return
        found = self._scheduler.idle_unloads(self._gpus.routers())
        if found.due:
            self._unload(found.due)
            found = self._scheduler.idle_unloads(self._gpus.routers())
        self._set_timer(found.next_ns)

    def _set_timer(self, due_ns: int | None) -> None:
        if due_ns == self._timer_ns and self._timer is not None:
            return  # (the common case: nothing changed the next due time)
        self._cancel()
        if due_ns is None:
            return
        delay_s = max(0.0, (due_ns - self._clock.now_ns()) / NS_PER_S)
        self._timer = asyncio.get_running_loop().call_later(delay_s, self._fire)
        self._timer_ns = due_ns

    def _fire(self) -> None:
        self._timer = self._timer_ns = None
        self.arm()

    def _unload(self, due: tuple[IdleModel, ...]) -> None:
        now_ns = self._clock.now_ns()
        by_gpu: dict[str, list[IdleModel]] = {}
        for idle in due:
            by_gpu.setdefault(idle.gpu, []).append(idle)
        for gpu, models in by_gpu.items():
            names = frozenset(idle.model for idle in models)
            self._scheduler.unload_idle(gpu, names)
            for idle in models:
                idle_s = (now_ns - idle.since_ns) / NS_PER_S
                after_s = ((now_ns if idle.due_ns is None else idle.due_ns) - idle.since_ns) / NS_PER_S
                self._unloaded(IdleUnloaded(gpu, idle.model, idle_s, after_s, now_ns))
            why = ", ".join(f"{idle.model} idle {(now_ns - idle.since_ns) / NS_PER_S:.0f} s" for idle in models)
            done = self._evictions.unload(gpu, names, f"idle ({why})")
            done.add_done_callback(functools.partial(self._ended, gpu, names))
        self._changed()

    def _ended(self, gpu: str, models: frozenset[str], unloads: asyncio.Future[str | None]) -> None:
        if unloads.cancelled():
            return
        if unloads.result() is not None:
            _log.warning("the upstream did not unload %s on %s (idle): counted resident again, tried again after its "
                         "idle time", ", ".join(sorted(models)), gpu)
            self._changed()
        self.arm()

    def _cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._timer_ns = None

    def close(self) -> None:
        self._cancel()
