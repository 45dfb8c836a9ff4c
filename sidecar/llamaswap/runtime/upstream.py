"""The upstream as the runtime sees it (a port): what it serves, what it has loaded, and whether
it is still computing. `llamaswap.adapters.upstream_http` is the adapter for llama-server and
llama-swap over HTTP; `NoUpstream` is the default that knows nothing and refuses nothing.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Protocol


class UpstreamKind(str, enum.Enum):
    ROUTER = "router"  # llama-server in router mode: lists its models and their states
    LLAMA_SWAP = "llama-swap"  # llama-swap: lists the models it can start
    SINGLE = "single"  # one model that answers to any name (plain llama-server, most servers)

    def __str__(self) -> str:
        return self.value


@dataclasses.dataclass(frozen=True, slots=True)
class Catalog:
    """One answer about the models: which it serves (None: any name) and which are loaded."""

    kind: UpstreamKind
    models: frozenset[str] | None
    # The loaded (resident) models if the upstream says (router mode: every model loaded or
    # loading, several where it keeps several; empty: nothing loaded); `residents_known` False
    # when the answer says nothing about them.
    residents: frozenset[str] = frozenset()
    residents_known: bool = False
    # Router mode: the models it put to sleep by itself (`--sleep-idle-seconds`: status `sleeping`,
    # weights freed, the process kept): not resident (their next request loads them again), yet
    # each still holds one of its `--models-max` places. `sleep_after_s`: the shortest idle time
    # after which it puts one to sleep, as its models' arguments say; None: it puts none to sleep.
    asleep: frozenset[str] = frozenset()
    sleep_after_s: float | None = None


class UpstreamUnanswered(Exception):
    """The upstream did not answer this time (timeout, refused connection, 5xx, a garbled answer);
    unlike "not supported", asking again may succeed."""


class Upstream(Protocol):
    async def catalog(self) -> Catalog | None:
        """What the upstream serves now; None when it could not be asked."""

    async def busy(self, model: str | None) -> int | None:
        """How many generations are still running (slots processing; a model being loaded
        counts as one), 0 when idle (for `model` where the upstream runs one process per model);
        None when the upstream cannot tell, ever (no GET /slots: 404/501, llama-swap). Raises
        `UpstreamUnanswered` when it could tell but did not answer this time (a timeout, a
        refused connection, a 5xx): ask again."""

    async def stop(self, model: str | None) -> bool:
        """Stop whatever `model` is generating (router mode: unload it); True if it could."""

    async def unload(self, model: str, *, timeout_s: float) -> bool:
        """Unload `model` (router mode: POST /models/unload) and wait until the upstream no longer
        lists it loaded (nor loading); True once it is gone (or was not loaded), False if the
        upstream would not unload it, cannot (not router mode) or still has it after `timeout_s`."""

    async def total_slots(self, model: str | None = None) -> int | None:
        """How many generations the upstream runs at once (llama-server's /props total_slots);
        in router mode of `model`, only while it is loaded (asking never loads it); None when it
        cannot tell."""


class NoUpstream:
    """Knows nothing: serves every model, cannot tell whether it is busy, cannot stop, and has
    nothing loaded that it knows of (an unload is done at once)."""

    async def catalog(self) -> Catalog | None:
        return None

    async def busy(self, model: str | None) -> int | None:
        return None

    async def stop(self, model: str | None) -> bool:
        return False

    async def unload(self, model: str, *, timeout_s: float) -> bool:
        return True

    async def total_slots(self, model: str | None = None) -> int | None:
        return None
