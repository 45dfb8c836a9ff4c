"""The model catalog checks (upstream.modelCheck): whether the upstream serves a request's model,
from its last answer, asking it again once on a miss (misses at the same moment share one ask)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection, Iterable

from llamaswap.config import ModelCheck
from llamaswap.config.model_key import ModelKey, model_key, unmatched
from llamaswap.runtime.upstream import Catalog, Upstream, UpstreamKind

_log = logging.getLogger(__name__)

# The model key of every request where the upstream serves one model whatever the name (when it
# does not list exactly one): they are all on the loaded model (no swap, the affinity bonus for all).
SINGLE_MODEL = "(single)"


# Read at each admission, as module globals (an Enum member read through its class costs about
# 70 ns in Python 3.11, a global 10).
_ROUTES_BY_NAME = (UpstreamKind.ROUTER, UpstreamKind.LLAMA_SWAP)
_OFF, _STRICT = ModelCheck.OFF, ModelCheck.STRICT


def listed(catalog: Catalog, model: str, check: ModelCheck) -> bool:
    """Whether `catalog` serves `model` under `check` (not OFF)."""
    routes_by_name = catalog.kind in _ROUTES_BY_NAME
    if not routes_by_name and check is not _STRICT:
        return True  # one model that answers to any name
    return catalog.models is None or model in catalog.models


def puts_to_sleep(catalog: Catalog | None) -> bool:
    """The upstream of ``catalog`` is a router that puts models to sleep (`asleep.py`)."""
    return catalog is not None and catalog.kind is UpstreamKind.ROUTER and catalog.sleep_after_s is not None


def _single_model_of(catalog: Catalog | None) -> str | None:
    if catalog is None or catalog.kind is not UpstreamKind.SINGLE:
        return None
    if catalog.models is not None and len(catalog.models) == 1:
        return next(iter(catalog.models))
    return SINGLE_MODEL


class ModelCatalog:
    """The upstream's last known catalog. `dispatches` counts the scheduler's grants, so that a
    catalog's loaded model is applied only if no grant happened while it was asked; `observed`
    hears every new catalog with that count (the coordinator applies it)."""

    def __init__(self, upstream: Upstream, *, dispatches: Callable[[], int],
                 observed: Callable[[Catalog, int], None]) -> None:
        self._upstream = upstream
        self._dispatches = dispatches
        self._observed = observed
        self._latest: Catalog | None = None
        self._single_model: str | None = None
        self.puts_to_sleep = False  # `puts_to_sleep` of the last answer
        self._refresh: asyncio.Task[Catalog | None] | None = None
        self._said: set[str] = set()  # the models.<id> already warned about (`warn_unmatched`)

    @property
    def latest(self) -> Catalog | None:
        """The upstream's last answer (None: none yet)."""
        return self._latest

    @latest.setter
    def latest(self, catalog: Catalog | None) -> None:
        self._latest = catalog
        # Read a few times per request (`ModelKeys.key`, each release; `RouterSleep.look` at each
        # admission): worked out once per answer.
        self._single_model = _single_model_of(catalog)
        self.puts_to_sleep = puts_to_sleep(catalog)

    def single_model(self) -> str | None:
        """Where the upstream's last answer says it serves one model whatever name a request gives,
        the key every request is scheduled on: the model it lists, else SINGLE_MODEL; None otherwise."""
        return self._single_model

    def key(self, requested: str | None, configured: Collection[str]) -> ModelKey:
        """What a request naming `requested` is scheduled as and which models.<id> is its
        (`config.model_key`, with what the upstream's last answer says)."""
        return model_key(requested, self.single_model(), configured)

    def warn_unmatched(self, configured: Iterable[str], *, anew: bool = False) -> None:
        """Log each models.<id> that can never apply to anything the upstream serves, once (again
        for every id after a reload: ``anew``)."""
        if anew:
            self._said.clear()
        catalog = self.latest
        if catalog is None:
            return
        by_name = catalog.kind in (UpstreamKind.ROUTER, UpstreamKind.LLAMA_SWAP)
        for model_id in unmatched(configured, catalog.models, by_name=by_name):
            if model_id not in self._said:
                self._said.add(model_id)
                _log.warning("models.%s: the upstream does not serve %s (it lists %s): this entry applies to "
                             "nothing; name a model it lists (llama-server's router: the GGUF file name without "
                             ".gguf)", model_id, model_id, ", ".join(sorted(catalog.models or ())) or "none")

    def serves_now(self, model: str, check: ModelCheck) -> bool | None:
        """`serves` where the last answer says so without asking (True), else None: a miss asks."""
        if check is _OFF:
            return True
        catalog = self._latest
        return True if catalog is not None and listed(catalog, model, check) else None

    async def serves(self, model: str, check: ModelCheck) -> bool:
        """Whether the upstream serves `model`; asks again once on a miss."""
        if self.serves_now(model, check):
            return True
        # A miss asks the upstream again, so a model added to the upstream later is served.
        catalog = await self.refresh()
        if catalog is None:
            return True  # the upstream cannot be asked: refuse nothing
        return listed(catalog, model, check)

    async def refresh(self) -> Catalog | None:
        """Ask the upstream now (joining an ask already under way); the last known on failure."""
        task = self._refresh
        if task is None or task.done():
            task = self._refresh = asyncio.ensure_future(self._ask())
        return await asyncio.shield(task)

    def refresh_later(self) -> None:
        """Ask the upstream soon, without waiting for the answer (unless an ask is under way)."""
        if self._refresh is None or self._refresh.done():
            self._refresh = asyncio.ensure_future(self._ask())

    async def _ask(self) -> Catalog | None:
        as_of = self._dispatches()
        try:
            catalog = await self._upstream.catalog()
        except Exception:  # noqa: BLE001 - the upstream adapter must not break admission
            _log.exception("asking the upstream for its models failed")
            return self.latest
        if catalog is not None:
            self._observed(catalog, as_of)
        return catalog if catalog is not None else self.latest

    def close(self) -> None:
        if self._refresh is not None:
            self._refresh.cancel()
