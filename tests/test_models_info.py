"""`llamaswap_loaded_models_info`'s waiting models (telemetry/models_info.py), kept per arrival and
departure with a label grown at its end and rebuilt only when a model leaves: against the label
rebuilt from scratch after every step (the first MAX_MODEL_LABELS of the waiting models, in the
order they started waiting), the same label after each step, and a new value for the series
exactly when the label changed."""

from __future__ import annotations

import itertools
import random

import pytest

from llamaswap.telemetry import models_info
from llamaswap.telemetry.instruments import MAX_MODEL_LABELS, WAITING_ADAPTERS
from llamaswap.telemetry.observer import _EMPTY_PICTURE


@pytest.mark.parametrize("seed", range(20))
def test_the_waiting_label_is_the_one_rebuilt_from_scratch_and_changes_with_it(
        seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    ticks = itertools.count(1)
    monkeypatch.setattr(models_info.time, "time", lambda: float(next(ticks)))  # each change a new value
    rng = random.Random(seed)
    # Fewer models than the label keeps, or more; "" and "a,b" are names a client may send too.
    names = ["", "a,b", *(f"m{index}" for index in range(rng.choice([3, MAX_MODEL_LABELS + 4])))]
    info = models_info.ModelsInfo(_EMPTY_PICTURE)
    tokens: dict[str, str] = {}  # waiting: token -> model
    counts: dict[str, int] = {}  # waiting: model -> requests, in the order the models started waiting
    label, value = "", info.current[1]
    leaving = rng.choice([0.35, 0.5])  # (the queue grows, or stays short)
    for step in range(500):
        if tokens and rng.random() < leaving:
            token = rng.choice(list(tokens))
            model = tokens.pop(token)
            counts[model] -= 1
            if not counts[model]:
                del counts[model]
            info.left(token)
        else:
            token, model = f"t{step}", rng.choice(names)
            tokens[token] = model
            counts[model] = counts.get(model, 0) + 1
            info.waiting(token, model)
        if rng.random() < 0.1:
            info.left("never-counted")  # (a request that never waited: nothing changes)
        expected = ",".join(itertools.islice(counts, MAX_MODEL_LABELS))
        labels, changed_at = info.current
        assert labels[WAITING_ADAPTERS] == expected
        assert (changed_at != value) == (expected != label), (step, label, expected)
        label, value = expected, changed_at
