"""The labels of `llamaswap_loaded_models_info` (vLLM's LoRA info gauge's shape, for endpoint
pickers) and when they last changed.

The models of the waiting requests are counted per arrival and departure (O(1) each), so a
picker's scrape every 50 ms reads a finished label set whatever the depth. The labels are kept in
two parts, each rebuilt only by its own events: the waiting models' (a model's first request
starting to wait, its last one leaving) and the picture's (the resident models, maxLoaded). The
value is the time of the last change of the labels, set when it happens, on the event loop; a
collection on another thread reads the one tuple (`current`) as it was last set.
"""

from __future__ import annotations

import itertools
import time

from llamaswap.runtime.observer import QueuePicture
from llamaswap.telemetry.instruments import MAX_ADAPTERS, MAX_MODEL_LABELS, RUNNING_ADAPTERS, WAITING_ADAPTERS


class ModelsInfo:
    def __init__(self, picture: QueuePicture) -> None:
        self._waiting_model: dict[str, str] = {}  # token -> the model it is scheduled on
        self._waiting_models: dict[str, int] = {}  # model -> requests waiting for it
        self._waiting_label = ""
        self._picture_labels = _picture_labels(picture)
        # The labels and when they last changed (Unix seconds).
        self.current: tuple[dict[str, str], float] = ({}, 0.0)
        self._changed()

    def waiting(self, token: str, model: str) -> None:
        """A request started waiting for ``model``."""
        self._waiting_model[token] = model
        models = self._waiting_models
        count = models.get(model, 0)
        models[model] = count + 1
        if not count and len(models) <= MAX_MODEL_LABELS:
            # A model that was not waiting goes last, within the bound: the label gains it at its end.
            self._waiting_changed(f"{self._waiting_label},{model}" if len(models) > 1 else model)

    def left(self, token: str) -> None:
        """A request stopped waiting (granted, refused, gone); nothing if it was not counted."""
        model = self._waiting_model.pop(token, None)
        if model is None:
            return
        models = self._waiting_models
        count = models[model] - 1
        if count:
            models[model] = count
            return
        del models[model]
        self._waiting_changed(_waiting_label(models) if models else "")  # (none left: the common case)

    def picture_changed(self, picture: QueuePicture) -> None:
        """The resident models or a maxLoaded may have changed."""
        labels = _picture_labels(picture)
        if labels != self._picture_labels:
            self._picture_labels = labels
            self._changed()

    def _waiting_changed(self, waiting: str) -> None:
        if waiting != self._waiting_label:
            self._waiting_label = waiting
            self._changed()

    def _changed(self) -> None:
        # The value is when the labels changed, as in vLLM: a picker that sees several series
        # (a Prometheus between them, or an old scrape) takes the one with the latest value.
        running, max_loaded = self._picture_labels
        self.current = ({RUNNING_ADAPTERS: running, WAITING_ADAPTERS: self._waiting_label, MAX_ADAPTERS: max_loaded},
                        time.time())


def _waiting_label(models: dict[str, int]) -> str:
    """waiting_lora_adapters: bounded like the `model` label, since clients name models (without
    modelCheck, any name); the first to start waiting first (a dict keeps that order)."""
    if len(models) <= MAX_MODEL_LABELS:  # (all of them: cheaper without an islice)
        return ",".join(models)
    return ",".join(itertools.islice(models, MAX_MODEL_LABELS))


def _picture_labels(picture: QueuePicture) -> tuple[str, str]:
    """running_lora_adapters (each upstream's resident models, each once: two GPUs may hold the
    same, in the configured order) and max_lora (the upstreams' maxLoaded, summed)."""
    loaded = dict.fromkeys(model for gpu in picture.node.gpus for model in gpu.resident_models)
    return ",".join(loaded), str(max(1, sum(gpu.max_loaded for gpu in picture.node.gpus)))
