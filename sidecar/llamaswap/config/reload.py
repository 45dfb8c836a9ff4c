"""What a reload does with each key: the one table, read by the sidecar's reload and kept equal
to docs/configuration.md's "Reloading" section by a test.

A key path names the key and everything under it (``routing`` covers
``routing.scheduler.maxRunSeconds``); the most specific entry wins.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from typing import Any

from llamaswap.config.sections import Config


class OnReload(enum.Enum):
    LIVE = "applies at once"
    RESTART = "kept until a restart"  # the rest of the file applies; the log names the key
    REFUSED = "reload refused"  # Envoy's bootstrap uses it: the whole file waits for a restart


@dataclasses.dataclass(frozen=True)
class ReloadKey:
    path: str
    on_reload: OnReload
    why: str


RELOAD_KEYS: tuple[ReloadKey, ...] = (
    ReloadKey("routing", OnReload.LIVE, "the waiting requests keep their arrival times; a new `maxRunSeconds` "
                                        "re-arms the running grant's watchdog from its grant"),
    ReloadKey("routing.objectives", OnReload.LIVE, "from the next arrival (Envoy sends the sidecar the objective "
                                                   "header whatever the file says)"),
    ReloadKey("routing.retryGraceSeconds", OnReload.LIVE, "from the next client that leaves; Envoy's bootstrap "
                                                          "carries the body and headers that tell a retry only "
                                                          "while it is positive, so turning it on from 0 takes "
                                                          "effect at the next restart"),
    ReloadKey("routing.keepAlive", OnReload.LIVE, "from the next decision, the keep_alive each resident model's "
                                                  "last request asked included (Envoy's bootstrap always sends "
                                                  "the body's `keep_alive`)"),
    ReloadKey("models", OnReload.LIVE, "fifo's per-model priorities, for the waiting requests too; a model's "
                                       "slots from the next grant, its memory and pinned from the next decision"),
    ReloadKey("listen", OnReload.REFUSED, "the ports Envoy and the sidecar are bound to"),
    ReloadKey("upstream.url", OnReload.REFUSED, "Envoy's upstream cluster"),
    ReloadKey("upstream.managementApi", OnReload.REFUSED, "Envoy's routes refuse or schedule the management API"),
    ReloadKey("upstream.slots", OnReload.LIVE, "the scheduler's slots from the next grant (the upstream's own "
                                               "--parallel is set where it starts)"),
    ReloadKey("upstream.maxLoaded", OnReload.RESTART, "`up` and the chart start llama-server's router with "
                                                      "--models-max from it, and the resident models it reports are "
                                                      "accepted at start"),
    ReloadKey("upstream.memory", OnReload.LIVE, "the scheduler's budget from the next decision (the models' sizes "
                                                "are read again with the file)"),
    ReloadKey("upstream.idleUnloadSeconds", OnReload.LIVE, "the idle times from the next decision, counted "
                                                           "from each model's last request"),
    ReloadKey("globalTTL", OnReload.LIVE, "as upstream.idleUnloadSeconds"),
    ReloadKey("upstream.command", OnReload.RESTART, "`up` started the upstream with it"),
    ReloadKey("upstream.healthPath", OnReload.RESTART, "read once, when `up` starts the upstream"),
    ReloadKey("upstream.startupTimeoutSeconds", OnReload.RESTART, "read once, when `up` starts the upstream"),
    ReloadKey("upstream.apiKey", OnReload.RESTART, "the key is read once, at start"),
    ReloadKey("upstream.modelsPollSeconds", OnReload.LIVE, "the next poll uses it; 0 stops polling, "
                                                           "and a positive value starts it again"),
    ReloadKey("upstream.modelCheck", OnReload.LIVE, "from the next arrival"),
    ReloadKey("upstream.abandonedGeneration", OnReload.LIVE, "from the next release"),
    ReloadKey("upstream.settleTimeoutSeconds", OnReload.LIVE, "from the next settle"),
    ReloadKey("upstreams", OnReload.REFUSED, "Envoy's bootstrap has a cluster per upstream, and each upstream's "
                                             "catalog, slots and learnt costs are set up at start: any change to "
                                             "the list (names, urls, slots, models, commands) needs a restart"),
    ReloadKey("envoy", OnReload.REFUSED, "Envoy's bootstrap (limits, lease renewals, failOpen)"),
    ReloadKey("security.priority.mode", OnReload.LIVE, "from the next arrival"),
    ReloadKey("security.priority.min", OnReload.LIVE, "from the next arrival"),
    ReloadKey("security.priority.max", OnReload.LIVE, "from the next arrival"),
    ReloadKey("security.priority.trustedHeader", OnReload.REFUSED, "Envoy sends the sidecar only the headers "
                                                                   "its bootstrap names"),
    ReloadKey("activity", OnReload.RESTART, "the log file is opened and the memory sized at start"),
    ReloadKey("estimates.defaultRunSeconds", OnReload.LIVE, "from the next estimate"),
    ReloadKey("estimates.defaultSwapSeconds", OnReload.LIVE, "from the next estimate"),
    ReloadKey("estimates.samples", OnReload.RESTART, "the measurements' windows are sized at start"),
    ReloadKey("ui", OnReload.LIVE, "from the page's next load"),
    ReloadKey("batches.dir", OnReload.RESTART, "the batches' database is opened at start"),
    ReloadKey("batches.maxRequests", OnReload.LIVE, "from the next file uploaded or batch validated"),
    ReloadKey("batches.maxFileBytes", OnReload.LIVE, "from the next file uploaded"),
    ReloadKey("batches.maxLineBytes", OnReload.LIVE, "from the next batch validated"),
    ReloadKey("batches.maxAnswerBytes", OnReload.LIVE, "from the next line sent"),
    ReloadKey("batches.inFlight", OnReload.LIVE, "from the next line sent"),
    ReloadKey("batches.apiKeys", OnReload.RESTART, "the keys are read once, at start"),
    ReloadKey("batches.callerHeader", OnReload.RESTART, "who may call is set up at start, with the keys"),
    ReloadKey("batches.adminCallers", OnReload.RESTART, "who may call is set up at start, with the keys"),
    ReloadKey("batches.maxStoredBytes", OnReload.LIVE, "from the next file uploaded"),
    ReloadKey("batches.outputExpirySeconds", OnReload.LIVE, "from the next output or error file written"),
    ReloadKey("batches.preempt", OnReload.LIVE, "from the next line sent"),
    ReloadKey("batches.maxPreemptions", OnReload.LIVE, "from the next part of a line sent"),
    ReloadKey("batches.minRunSeconds", OnReload.LIVE, "from the next decision"),
)


def reload_key(path: str) -> ReloadKey:
    """The table's entry for a key path (its most specific prefix)."""
    best: ReloadKey | None = None
    for entry in RELOAD_KEYS:
        if path == entry.path or path.startswith(entry.path + "."):
            if best is None or len(entry.path) > len(best.path):
                best = entry
    if best is None:
        raise KeyError(path)
    return best


def _leaves(document: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(document, dict) and document and prefix not in ("models",):
        out: dict[str, Any] = {}
        for key, value in document.items():
            out.update(_leaves(value, f"{prefix}.{key}" if prefix else key))
        return out
    return {prefix: document}


@dataclasses.dataclass(frozen=True)
class ReloadPlan:
    """What a reload of `new` over `running` does: the configuration to run, and the keys that
    changed, by what happens to them."""

    config: Config
    live: tuple[str, ...]
    restart: tuple[str, ...]
    refused: tuple[str, ...]


def plan_reload(running: Config, new: Config, *, parse: Callable[[Any], Config]) -> ReloadPlan:
    """Split the changed keys by the table; a RESTART key keeps its running value (so the running
    configuration says what runs), unless a REFUSED key changed too (then ``config`` is ``new``,
    not to be run). `parse` validates a document (the caller's loader)."""
    old_leaves, new_leaves = _leaves(running.to_document()), _leaves(new.to_document())
    changed = sorted(path for path in old_leaves.keys() | new_leaves.keys()
                     if old_leaves.get(path) != new_leaves.get(path))
    by_kind: dict[OnReload, list[str]] = {kind: [] for kind in OnReload}
    for path in changed:
        entry = reload_key(path)
        if entry.path not in by_kind[entry.on_reload]:
            by_kind[entry.on_reload].append(entry.path)
    config = new
    # A refused reload applies nothing, so nothing is kept either (and a change between upstream
    # and upstreams has no running value to keep: the other document leaves upstream.url out).
    if by_kind[OnReload.RESTART] and not by_kind[OnReload.REFUSED]:
        document = new.to_document()
        kept = running.to_document()
        for path in by_kind[OnReload.RESTART]:
            _set(document, path, _get(kept, path))
        config = parse(document)
        config._source = new.source
    return ReloadPlan(config, tuple(by_kind[OnReload.LIVE]), tuple(by_kind[OnReload.RESTART]),
                      tuple(by_kind[OnReload.REFUSED]))


def _get(document: dict[str, Any], path: str) -> Any:
    value: Any = document
    for key in path.split("."):
        value = value[key]
    return value


def _set(document: dict[str, Any], path: str, value: Any) -> None:
    *parents, last = path.split(".")
    target = document
    for key in parents:
        target = target[key]
    target[last] = value
