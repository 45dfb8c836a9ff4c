"""The `Upstream` port over HTTP, for llama-server (router or single-model mode), llama-swap and
any OpenAI-compatible server.

What each kind tells (measured on llama-server b11434; see docs/operations.md, "Failure
behaviour"):
- every kind lists its models at `GET /v1/models`;
- llama-server in router mode gives each model a `status` (`loaded`, `loading`, `unloaded`; and
  `sleeping` for one it put to sleep after `--sleep-idle-seconds`: its process stays, its weights
  are freed, and any request naming it wakes it, even `GET /slots?model=...&autoload=false`),
  answers `GET /slots?model=NAME` for a loaded model, and unloads with `POST /models/unload`
  (`unload` then reads the list until the model is `unloaded`: its child process has exited).
  Asking `/slots` for a model that is not loaded LOADS it (router autoload), so busy() asks
  only for models the list says are loaded, and with `autoload=false` (checked on b11434:
  `/slots` and `/metrics` then answer 400 "model is not loaded" for a model not loaded, and
  load nothing);
- single-model llama-server answers `GET /slots` (each slot's `is_processing`) and serves any
  model name;
- llama-swap marks its models `owned_by: llama-swap`; it has no `/slots` of its own.

busy() counts the slots processing (in router mode, those of the model it is asked about: each
resident model is a process of its own). It tells "cannot tell, ever" (None: 404/405/501 on
/slots, llama-swap) from "no answer this time" (`UpstreamUnanswered`: a timeout, a refused
connection, a 5xx, a garbled answer): llama-server answers /slots from its main loop, which a long
prompt batch keeps busy, so a settle asks again.

With an API key (upstream.apiKey) every request carries it as
`Authorization: Bearer`, as llama-server's --api-key wants on everything but /health. A 401 or
403 is logged as an error naming those keys (never the key), once until the upstream answers
otherwise; the sidecar makes one at start fatal (`access_status`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import quote

import aiohttp

from llamaswap.runtime.upstream import Catalog, UpstreamKind, UpstreamUnanswered

_log = logging.getLogger(__name__)

_STATUS_LOADED = "loaded"
_STATUS_LOADING = "loading"
_STATUS_UNLOADED = "unloaded"
_STATUS_SLEEPING = "sleeping"
# The router's argument that puts an idle model to sleep (its children's `status.args` carry it).
_SLEEP_ARGUMENT = "--sleep-idle-seconds"
# What a server without GET /slots answers (llama-server started with --no-slots: 501).
_NO_SLOTS_STATUSES = frozenset({404, 405, 501})
# What router mode answers a query with autoload=false for a model that is not loaded.
_NOT_LOADED_STATUS = 400
# What a server behind an API key answers without the right one (llama-server: 401).
KEY_REFUSED_STATUSES = frozenset({401, 403})
# A model this client unloaded is still listed `loaded` while its instance exits, and a
# `/slots?model=` that reaches the exiting instance holds its exit until the router force-kills it
# 10 s later (bench/swap_probe.py). So for this long after a successful unload it is not asked
# (counted idle: the unload ended its work) unless the list shows it gone and back in between.
EXITING_S = 15.0
# How often GET /v1/models is read while an unload (`unload`) waits for the model to go (backs off).
UNLOAD_POLL_FIRST_S = 0.02
UNLOAD_POLL_MAX_S = 0.5


def bearer(api_key: str | None) -> dict[str, str]:
    """The header that carries the upstream's API key; none without a key."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


class HttpUpstream:
    def __init__(self, url: str, *, api_key: str | None = None, timeout_s: float = 5.0,
                 monotonic: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        self._url = url.rstrip("/")
        # An unload's deadline and its waits between looks (injected: tests count them, never time them).
        self._monotonic = monotonic
        self._sleep = sleep
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._headers = bearer(api_key)
        self._session: aiohttp.ClientSession | None = None
        self._kind: UpstreamKind | None = None
        self._refused_said = False
        self._exiting: dict[str, float] = {}  # model -> monotonic time of its unload

    @property
    def base_url(self) -> str:
        return self._url

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self._timeout, headers=self._headers)
        return self._session

    async def _get(self, path: str) -> tuple[int, Any]:
        async with self._client().get(self._url + path) as response:
            self._note_status(response.status, f"GET {path}")
            if response.status != 200:
                return response.status, None
            return 200, await response.json(content_type=None)

    def _note_status(self, status: int, request: str) -> None:
        if status not in KEY_REFUSED_STATUSES:
            self._refused_said = False
        elif not self._refused_said:
            self._refused_said = True
            sent = "with the key of upstream.apiKey" if self._headers else "without an API key"
            _log.error("the upstream answered %d to %s %s: set upstream.apiKey (file:PATH or env:NAME) to "
                       "a key it accepts (llama-server's --api-key); until then it cannot tell whether it is busy",
                       status, request, sent)

    async def access_status(self) -> int | None:
        """The status of GET /v1/models (401 or 403: the key is missing or wrong); None when the
        upstream does not answer (not started yet)."""
        try:
            async with self._client().get(self._url + "/v1/models") as response:
                return response.status
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return None

    # -- the port ------------------------------------------------------------------------

    async def _models_document(self) -> Any:
        """GET /v1/models's answer; None without one (failed, or not 200)."""
        try:
            status, document = await self._get("/v1/models")
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            _log.debug("GET /v1/models failed: %s", exc)
            return None
        return document if status == 200 else None

    async def catalog(self) -> Catalog | None:
        document = await self._models_document()
        if document is None:
            return None
        catalog = catalog_from(document)
        if catalog is not None:
            self._kind = catalog.kind
        return catalog

    async def busy(self, model: str | None) -> int | None:
        try:
            kind = self._kind
            if kind is None:
                status, document = await self._get("/v1/models")
                catalog = catalog_from(document) if status == 200 else None
                if catalog is None:
                    raise UpstreamUnanswered(f"GET /v1/models answered {status}")
                kind = self._kind = catalog.kind
            if kind is UpstreamKind.ROUTER:
                return await self._router_busy(model)
            if kind is UpstreamKind.SINGLE:
                return await self._slots_busy("/slots")
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            raise UpstreamUnanswered(f"asking the upstream whether it is busy failed: {exc!r}") from exc
        return None  # llama-swap cannot tell

    async def _slots_busy(self, path: str, *, unloaded_is_idle: bool = False) -> int | None:
        status, slots = await self._get(path)
        if status in _NO_SLOTS_STATUSES:
            return None
        if status == _NOT_LOADED_STATUS and unloaded_is_idle:
            return 0  # unloaded since /v1/models said it was loaded (autoload=false): computes nothing
        if status != 200:
            raise UpstreamUnanswered(f"GET {path} answered {status}")
        return _processing(slots)

    async def stop(self, model: str | None) -> bool:
        if self._kind is not UpstreamKind.ROUTER:
            return False
        names = [model] if model else await self._models_in(_STATUS_LOADED)
        stopped = False
        for name in names or ():
            stopped = await self._post_unload(name) == 200 or stopped
        return stopped

    async def unload(self, model: str, *, timeout_s: float) -> bool:
        deadline = self._monotonic() + timeout_s
        if self._kind is None:
            await self.catalog()
        if self._kind is not UpstreamKind.ROUTER:
            _log.warning("cannot unload %s: the upstream is not llama-server in router mode", model)
            return False
        posted = await self._post_unload(model)
        delay = UNLOAD_POLL_FIRST_S
        while True:
            state = await self._state_of(model)
            if state == _STATUS_UNLOADED:
                return True
            if posted != 200 and state is not None:
                # Refused (or not answered) while still listed: nothing will unload it.
                _log.warning("the upstream did not unload %s (POST /models/unload: %s; listed %s)",
                             model, posted or "no answer", state)
                return False
            left = deadline - self._monotonic()
            if left <= 0:
                _log.warning("the upstream still lists %s %s %.1f s after its unload", model, state or "(no answer)",
                             timeout_s)
                return False
            await self._sleep(min(delay, left))
            delay = min(delay * 2, UNLOAD_POLL_MAX_S)

    async def _post_unload(self, name: str) -> int | None:
        """POST /models/unload for one model: its status (None: no answer). After a 200 the model
        is exiting (`EXITING_S`)."""
        try:
            async with self._client().post(f"{self._url}/models/unload", json={"model": name}) as response:
                self._note_status(response.status, "POST /models/unload")
                if response.status == 200:
                    self._exiting[name] = time.monotonic()
                return response.status
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            _log.warning("unloading %s failed: %s", name, exc)
            return None

    async def _state_of(self, model: str) -> str | None:
        """A router-mode model's status by GET /v1/models (unloaded where it is not listed); None
        without an answer."""
        document = await self._models_document()
        return None if document is None else _states(document).get(model, _STATUS_UNLOADED)

    # -- router mode ---------------------------------------------------------------------

    async def _models_in(self, state: str) -> list[str] | None:
        status, document = await self._get("/v1/models")
        if status != 200:
            return None
        return [name for name, value in _states(document).items() if value == state]

    async def total_slots(self, model: str | None = None) -> int | None:
        try:
            catalog = await self.catalog()
            path = "/props"
            if catalog is not None and catalog.kind is UpstreamKind.ROUTER:
                if model is None:
                    return None  # the router's own /props has no slots
                if model in catalog.asleep:
                    return None  # asked, it would wake (autoload=false or not): asked again once awake
                # autoload=false: /props?model= for a model not loaded would load it.
                path = f"/props?model={quote(model, safe='')}&autoload=false"
            elif catalog is not None and catalog.kind is UpstreamKind.LLAMA_SWAP:
                return None
            status, document = await self._get(path)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            _log.info("asking the upstream for its slots failed: %s", exc)
            return None
        slots = document.get("total_slots") if status == 200 and isinstance(document, dict) else None
        return slots if isinstance(slots, int) and not isinstance(slots, bool) and slots >= 1 else None

    async def _router_busy(self, model: str | None) -> int | None:
        """The slots computing of `model` (each model its own process: several may be resident),
        or of every model where it names none or none the router lists by that id."""
        status, document = await self._get("/v1/models")
        if status != 200:
            raise UpstreamUnanswered(f"GET /v1/models answered {status}")
        states = _states(document)
        if model in states:
            states = {model: states[model]}
        processing = 0
        for name, value in states.items():
            if value == _STATUS_LOADING:
                processing += 1  # a load is GPU work too
            if value != _STATUS_LOADED:
                self._exiting.pop(name, None)  # gone: a later `loaded` is a new instance
                continue  # never ask /slots for it: that would load it (or wake it, asleep)
            unloaded_at = self._exiting.get(name)
            if unloaded_at is not None and time.monotonic() - unloaded_at < EXITING_S:
                continue  # unloaded by us and still exiting: asking it would hold its exit
            # autoload=false: unloaded since the list was read, it must not be loaded again.
            busy = await self._slots_busy(f"/slots?model={quote(name, safe='')}&autoload=false",
                                          unloaded_is_idle=True)
            if busy is None:
                return None
            processing += busy
        return processing


def catalog_from(document: Any) -> Catalog | None:
    """What a `GET /v1/models` answer says about the upstream's kind, models and loaded model."""
    items = document.get("data") if isinstance(document, dict) else document
    if not isinstance(items, list):
        return None
    names: set[str] = set()
    owners: set[str] = set()
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("id"), str):
            continue
        names.add(item["id"])
        aliases = item.get("aliases")
        if isinstance(aliases, list):
            names.update(alias for alias in aliases if isinstance(alias, str))
        if isinstance(item.get("owned_by"), str):
            owners.add(item["owned_by"])
    states = _states(document)
    if states:
        # A model being loaded is one the upstream will have: affinity applies to it already. With
        # --models-max N it keeps up to N: the resident set, every one of them.
        # A sleeping model is not: its next request loads its weights again.
        loaded = frozenset(name for name, value in states.items() if value in (_STATUS_LOADED, _STATUS_LOADING))
        asleep = frozenset(name for name, value in states.items() if value == _STATUS_SLEEPING)
        return Catalog(UpstreamKind.ROUTER, frozenset(names), loaded, True, asleep=asleep,
                       sleep_after_s=_sleep_after_s(items))
    if "llama-swap" in owners:
        return Catalog(UpstreamKind.LLAMA_SWAP, frozenset(names))
    return Catalog(UpstreamKind.SINGLE, frozenset(names))


def _states(document: Any) -> dict[str, str]:
    """Router mode's model states (`loaded`, `loading`, `unloaded`, `sleeping`) by model id; {} otherwise."""
    items = document.get("data") if isinstance(document, dict) else document
    states: dict[str, str] = {}
    for item in items if isinstance(items, list) else ():
        if isinstance(item, dict) and isinstance(item.get("id"), str) and isinstance(item.get("status"), dict):
            value = item["status"].get("value")
            if isinstance(value, str):
                states[item["id"]] = value
    return states


def _sleep_after_s(items: list[Any]) -> float | None:
    """The shortest `--sleep-idle-seconds` among the router's models' arguments (`status.args`;
    -1 is off); None where none sleeps."""
    shortest = None
    for item in items:
        status = item.get("status") if isinstance(item, dict) else None
        args = status.get("args") if isinstance(status, dict) else None
        if not isinstance(args, list):
            continue
        for flag, value in zip(args, args[1:]):
            if flag != _SLEEP_ARGUMENT or not isinstance(value, str):
                continue
            try:
                seconds = float(value)
            except ValueError:
                continue
            if seconds >= 0 and (shortest is None or seconds < shortest):
                shortest = seconds
    return shortest


def _processing(slots: Any) -> int:
    if not isinstance(slots, list):
        raise ValueError("GET /slots did not answer a list")
    return sum(1 for slot in slots if isinstance(slot, dict) and slot.get("is_processing") is True)
