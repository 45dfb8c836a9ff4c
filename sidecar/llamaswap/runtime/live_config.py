"""The configuration in effect: a reload replaces it (`Coordinator.reconfigure`) and every part
of the runtime reads it here, so none keeps a copy that a reload would leave stale; and what a
request naming a model is scheduled as under it (`ModelKeys`)."""

from __future__ import annotations

from llamaswap.config import Config
from llamaswap.config.model_key import ModelKey, model_key
from llamaswap.core import NS_PER_S, Priority
from llamaswap.runtime.gpus import Gpus, auto_slots


# The most distinct priority claims whose priorities are remembered at once (clients send what they like).
_PRIORITIES_REMEMBERED = 1024


class LiveConfig:
    """The configuration now, and the few values the runtime reads of it on every step: those
    derived from it are built once per configuration (a Config's private attributes go through
    pydantic's `__getattr__`, about 1.5 us a read, and `priority_policy` builds one)."""

    def __init__(self, config: Config) -> None:
        self.set(config)

    def set(self, config: Config) -> None:
        self.config = config
        self.auto_slots = auto_slots(config)  # the upstreams whose slots are learnt (slots: auto)
        self.priority_policy = config.priority_policy()  # what callers may claim (each Check)
        self._priorities: dict[tuple[str | None, str | None, str | None, str | None], Priority] = {}
        self.entries = {entry.name: entry for entry in config.gpu_entries}  # each GPU's, by its name
        self.keep_alive_honoured = config.routing.keep_alive.honour  # Ollama's keep_alive (each grant)
        # Durations in the runtime's nanoseconds, read at each grant and release.
        self._lease_ns = round(config.envoy.lease_seconds * NS_PER_S)
        self._max_run_s = config.routing.scheduler.max_run_seconds
        self._max_run_ns = round(self._max_run_s * NS_PER_S)
        self._retry_grace_ns = round(config.routing.retry_grace_seconds * NS_PER_S)

    def current(self) -> Config:
        return self.config

    def priority_of(self, header: str | None, trusted: str | None, objective: str | None,
                    service_tier: str | None) -> Priority:
        """What `priority_policy` resolves a Check's claims to (`PriorityPolicy.resolve`, a function
        of them): remembered per distinct claims under this configuration, as most requests send one
        of a few (a frozen value, shared)."""
        claims = header, trusted, objective, service_tier
        priority = self._priorities.get(claims)
        if priority is None:
            if len(self._priorities) >= _PRIORITIES_REMEMBERED:
                self._priorities.clear()
            priority = self._priorities[claims] = self.priority_policy.resolve(*claims)
        return priority

    def lease_ns(self) -> int:
        return self._lease_ns

    def max_run_ns(self) -> int:
        return self._max_run_ns

    def max_run_s(self) -> float:
        return self._max_run_s

    def retry_grace_ns(self) -> int:
        return self._retry_grace_ns


# The most model names whose keys are remembered at once (clients name what they like).
_KEYS_REMEMBERED = 1024


class ModelKeys:
    """What a request naming a model is scheduled as, and whose models.<id> it gets, under the
    configuration in effect and what the GPUs serve (a single-model upstream: its one model).

    Each admission asks: a name's key is worked out once while the configuration and the single
    model are those it was worked out under (both are values, replaced when they change)."""

    def __init__(self, config: LiveConfig, gpus: Gpus) -> None:
        self._config = config
        self._gpus = gpus
        self._known: dict[str | None, ModelKey] = {}
        self._known_under: tuple[Config, str | None] | None = None

    def key(self, model: str | None) -> ModelKey:
        single = self._gpus.single_model()
        config = self._config.config
        known = self._known
        under = self._known_under
        if under is None or under[0] is not config or under[1] != single or len(known) >= _KEYS_REMEMBERED:
            known.clear()
            self._known_under = config, single
        key = known.get(model)
        if key is None:
            key = known[model] = model_key(model, single, config.models.keys())
        return key

    def scheduled(self, model: str | None) -> str | None:
        return self.key(model).scheduled
