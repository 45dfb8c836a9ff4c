"""upstream.slots: auto: asking the upstream how many generations it runs at once.

A single-model upstream is asked once (its number is kept under None); a router is asked about
each model once it is loaded (asking never loads one; several resident: each of them, in turn):
when the reconcile loop sees it loaded (`observe`), or after its first grant while it runs
(`after_grant`: the loop reads the catalog only when idle, which a steady stream of requests
never is). What is learnt goes to the
scheduler through the coordinator (`apply`); the configuration turns it into slots
(`Config.slots`). At most one ask is under way (`asking`): the one place that starts one is `_ask`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from llamaswap.config import SLOTS_AUTO, Config
from llamaswap.runtime.catalog import ModelCatalog
from llamaswap.runtime.upstream import Catalog, Upstream, UpstreamKind

_log = logging.getLogger(__name__)

# In router mode, after the grant of a model not asked about yet, the catalog is read until
# the upstream has loaded it (backing off), at most this many times.
LEARN_POLL_FIRST_S = 0.05
LEARN_POLL_MAX_S = 1.0
LEARN_POLLS = 30


class SlotLearner:
    """What the upstream of the GPU named ``gpu`` said about its slots, and the asking. ``config``
    reads the settings in force (the GPU's own entry: `Config.entry`); ``apply`` re-applies them
    (the learnt numbers changed); ``runs(model)`` says whether a grant of ``model`` runs;
    ``default_slots`` is the scheduler's default now (for the log)."""

    def __init__(self, gpu: str, *, config: Callable[[], Config], catalog: ModelCatalog, upstream: Upstream,
                 apply: Callable[[Config], None], runs: Callable[[str], bool],
                 default_slots: Callable[[], int]) -> None:
        self._gpu = gpu
        self._config = config
        self._catalog = catalog
        self._upstream = upstream
        self._apply = apply
        self._runs = runs
        self._default_slots = default_slots
        # By model in router mode (None: a single-model upstream); empty before it is asked.
        self.learnt: dict[str | None, int] = {}
        self._asking: asyncio.Future[None] | None = None
        self._learning: asyncio.Future[None] | None = None  # `_learn_when_loaded`

    @property
    def asking(self) -> bool:
        """An ask is under way."""
        return self._asking is not None and not self._asking.done()

    def _auto(self) -> bool:
        return self._config().entry(self._gpu).slots == SLOTS_AUTO

    def _ask(self, work: Coroutine[Any, Any, None]) -> asyncio.Future[None]:
        """Begin an ask (the only place one begins): `asking` until it ends, however it ends."""
        self._asking = asyncio.ensure_future(work)
        return self._asking

    async def learn(self) -> None:
        """Ask now (at start): the single model, or the model a router has loaded."""
        if not self._auto() or self.asking:
            return
        await self._ask(self._refresh_and_learn())

    async def _refresh_and_learn(self) -> None:
        catalog = await self._catalog.refresh()
        if catalog is None or catalog.kind is not UpstreamKind.ROUTER:
            await self._learn(None, router=False)
        elif not catalog.residents:
            await self._learn(None, router=True)  # (says that it cannot tell yet)
        else:
            await self._learn_each(sorted(catalog.residents))

    async def _learn_each(self, models: list[str]) -> None:
        """Ask about each of a router's resident models in turn (one ask at a time)."""
        for model in models:
            if self._wants(model):
                await self._learn(model, router=True)

    async def _learn(self, model: str | None, *, router: bool) -> None:
        learnt = await self._upstream.total_slots(model) if model is not None or not router else None
        if learnt is None:
            _log.info("upstream.slots: auto: the upstream does not say how many slots %s; scheduling with %d",
                      f"model {model} has" if model else "it has", self._default_slots())
            return
        self.learnt[model] = learnt
        _log.info("upstream.slots: auto: the upstream runs %d generations%s at once", learnt,
                  f" of model {model}" if model else "")
        # The settings now in force: a reload while the upstream was asked has replaced them.
        config = self._config()
        if config.entry(self._gpu).slots != SLOTS_AUTO:
            return
        slots = config.slots(self._gpu, self.learnt, self._catalog.single_model())  # as the coordinator applies them
        if slots.reserved < config.reserved_slots:
            _log.warning("upstream.slots: auto: the upstream has %d slots%s, too few for %d reserved "
                         "(routing.scheduler.settings.%s.reservedSlots); reserving %d", learnt,
                         f" for model {model}" if model else "", config.reserved_slots,
                         config.routing.scheduler.use, slots.reserved)
        self._apply(config)

    def _wants(self, model: str | None) -> bool:
        """Not learnt yet, nor configured in models.<id>.slots (None: the single model's)."""
        config = self._config()
        configured = model is not None and model in config.models and config.models[model].slots is not None
        return config.entry(self._gpu).slots == SLOTS_AUTO and model not in self.learnt and not configured

    def observe(self, catalog: Catalog) -> None:
        """The reconcile loop read the catalog: ask about each model seen loaded for the first time
        (several resident: each in turn; a single-model upstream: once)."""
        if self.asking:
            return
        if catalog.kind is not UpstreamKind.ROUTER:
            if self._wants(None):
                self._ask(self._learn(None, router=False))
            return
        wanted = sorted(model for model in catalog.residents if self._wants(model))
        if wanted:
            self._ask(self._learn_each(wanted))

    def after_grant(self, model: str | None) -> None:
        """A grant of a router-mode model whose slots are not known yet: learn them once the upstream
        has it loaded, while it runs."""
        latest = self._catalog.latest
        if (model is None or latest is None or latest.kind is not UpstreamKind.ROUTER
                or not self._wants(model) or (self._learning is not None and not self._learning.done())):
            return
        self._learning = asyncio.ensure_future(self._learn_when_loaded(model))

    async def _learn_when_loaded(self, model: str) -> None:
        delay = LEARN_POLL_FIRST_S
        for _ in range(LEARN_POLLS):
            catalog = await self._catalog.refresh()  # `observe` may begin to ask about it
            asking = self._asking
            asked = self.asking
            if asking is not None and asked:
                await asyncio.shield(asking)
            if not self._wants(model) or catalog is None or catalog.kind is not UpstreamKind.ROUTER:
                return
            if model in catalog.residents:
                if not asked and not self.asking:
                    await self._ask(self._learn(model, router=True))  # None while it still loads: asked again
                    if not self._wants(model):
                        return
            elif not self._runs(model):
                return  # it went before the upstream had it loaded: asked at its next grant
            await asyncio.sleep(delay)
            delay = min(delay * 2, LEARN_POLL_MAX_S)

    def close(self) -> None:
        for task in (self._asking, self._learning):
            if task is not None:
                task.cancel()
