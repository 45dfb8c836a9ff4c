"""The configuration in effect: a reload replaces it (`Coordinator.reconfigure`) and every part
of the runtime reads it here, so none keeps a copy that a reload would leave stale; and what a
request naming a model is scheduled as under it (`ModelKeys`)."""

from __future__ import annotations

from llamaswap.config import Config
from llamaswap.config.model_key import ModelKey, model_key
from llamaswap.core import NS_PER_S
from llamaswap.runtime.gpus import Gpus, auto_slots


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
        self.entries = {entry.name: entry for entry in config.gpu_entries}  # each GPU's, by its name
        self.keep_alive_honoured = config.routing.keep_alive.honour  # Ollama's keep_alive (each grant)
        # Durations in the runtime's nanoseconds, read at each grant and release.
        self._lease_ns = round(config.envoy.lease_seconds * NS_PER_S)
        self._max_run_s = config.routing.scheduler.max_run_seconds
        self._max_run_ns = round(self._max_run_s * NS_PER_S)
        self._retry_grace_ns = round(config.routing.retry_grace_seconds * NS_PER_S)

    def current(self) -> Config:
        return self.config

    def lease_ns(self) -> int:
        return self._lease_ns

    def max_run_ns(self) -> int:
        return self._max_run_ns

    def max_run_s(self) -> float:
        return self._max_run_s

    def retry_grace_ns(self) -> int:
        return self._retry_grace_ns


class ModelKeys:
    """What a request naming a model is scheduled as, and whose models.<id> it gets, under the
    configuration in effect and what the GPUs serve (a single-model upstream: its one model)."""

    def __init__(self, config: LiveConfig, gpus: Gpus) -> None:
        self._config = config
        self._gpus = gpus

    def key(self, model: str | None) -> ModelKey:
        return model_key(model, self._gpus.single_model(), self._config.config.models.keys())

    def scheduled(self, model: str | None) -> str | None:
        return self.key(model).scheduled
