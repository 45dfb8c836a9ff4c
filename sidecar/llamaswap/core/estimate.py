"""Expected GPU times per model and estimated start times for the waiting, like `squeue --start`.

Measurements arrive one grant at a time (`record`): how long the grant held the GPU and, when
the upstream answered, how long it took to the first response byte. Per model the estimator
keeps the most recent ``samples`` of each and answers with rolling medians (robust to the odd
runaway generation):

- expected run of a model = median run time of its grants that needed no model load;
- expected swap cost of a model = median time to first byte of its grants that loaded it,
  minus the median time to first byte of those that did not (never below 0).

Where a request says how many output tokens it asks for (`max_tokens`), its expected run scales
with them (`expected_request_run_s`): per model, the rolling median of run time per token asked
of its measured grants that said so. A request that does not say, or a model with no such
measurement yet, gets the model's expected run.

Before a model has a measurement the stated defaults apply (`estimates.defaultRunSeconds`,
`estimates.defaultSwapSeconds`). A grant that loaded a model also teaches the run time, minus
the measured swap cost, so that a model that is always swapped in still gets a run estimate.

Estimated starts walk the dispatch order the scheduler's snapshot already simulates: the time
the running request still needs, then for each request ahead its model's expected run plus
the swap cost where the model changes. Pure: no clock, no I/O; times are passed in.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence
from typing import Final

NO_MODEL: Final = ""  # the key for requests that name no model (also their metric label)


class _Recent:
    """The last `size` values and their median, recomputed only when a value arrives."""

    __slots__ = ("values", "median")

    def __init__(self, size: int) -> None:
        self.values: deque[float] = deque(maxlen=size)
        self.median: float | None = None

    def add(self, value: float) -> None:
        self.values.append(value)
        self.median = statistics.median(self.values)


class Estimator:
    def __init__(self, *, default_run_s: float, default_swap_s: float, samples: int) -> None:
        if samples < 1:
            raise ValueError("samples must be at least 1")
        self.default_run_s = default_run_s
        self.default_swap_s = default_swap_s
        self._samples = samples
        self._run: dict[str, _Recent] = {}
        self._warm_first_byte: dict[str, _Recent] = {}
        self._load_first_byte: dict[str, _Recent] = {}
        self._run_per_token: dict[str, _Recent] = {}

    # -- learning ------------------------------------------------------------------------

    def record(self, model: str | None, *, run_s: float, first_byte_s: float | None, model_load: bool,
               max_tokens: int | None = None) -> None:
        """One finished generation: its run time, its time to first byte (None when it does not
        time the start of the generation: no answer, or a response that was not streamed), whether
        it began by loading its model, and the output tokens it asked for (None: not said)."""
        key = model or NO_MODEL
        if first_byte_s is not None:
            table = self._load_first_byte if model_load else self._warm_first_byte
            self._recent(table, key).add(max(0.0, first_byte_s))
        run = max(0.0, run_s - self.expected_swap_s(model) if model_load else run_s)
        self._recent(self._run, key).add(run)
        if max_tokens is not None and max_tokens > 0:
            self._recent(self._run_per_token, key).add(run / max_tokens)

    def _recent(self, table: dict[str, _Recent], key: str) -> _Recent:
        recent = table.get(key)
        if recent is None:
            recent = table[key] = _Recent(self._samples)
        return recent

    # -- answers -------------------------------------------------------------------------

    def expected_run_s(self, model: str | None) -> float:
        recent = self._run.get(model or NO_MODEL)
        return recent.median if recent is not None and recent.median is not None else self.default_run_s

    def expected_request_run_s(self, model: str | None, max_tokens: int | None) -> float:
        """The expected run of one request of `model` that asks for `max_tokens` output tokens
        (None: not said): per token asked where the model has that measurement, else the
        model's expected run."""
        if max_tokens is not None and max_tokens > 0:
            per_token = self._run_per_token.get(model or NO_MODEL)
            if per_token is not None and per_token.median is not None:
                return per_token.median * max_tokens
        return self.expected_run_s(model)

    def expected_swap_s(self, model: str | None) -> float:
        loads = self._load_first_byte.get(model or NO_MODEL)
        if loads is None or loads.median is None:
            return self.default_swap_s
        warm = self._warm_first_byte.get(model or NO_MODEL)
        baseline = warm.median if warm is not None and warm.median is not None else 0.0
        return max(0.0, loads.median - baseline)

    def expected_grant_s(self, model: str | None, *, model_load: bool, max_tokens: int | None = None) -> float:
        """How long a grant of `model` is expected to hold the GPU, its model's load included."""
        return self.expected_request_run_s(model, max_tokens) + (self.expected_swap_s(model) if model_load else 0.0)

    def remaining_s(self, model: str | None, *, model_load: bool, running_s: float,
                    max_tokens: int | None = None) -> float:
        """How much longer a running grant is expected to hold the GPU (0 once it is overdue)."""
        return max(0.0, self.expected_grant_s(model, model_load=model_load, max_tokens=max_tokens) - running_s)

    def starts(self, models: Sequence[str | None], *, loaded: str | None, busy_s: float,
               max_tokens: Sequence[int | None] | None = None) -> list[float]:
        """Estimated start, in seconds from now, of each request in dispatch order, given the
        model loaded now and how long the GPU stays busy before the first of them; `max_tokens`
        (one per request, in the same order) sizes each one's run (`expected_request_run_s`)."""
        sizes: Sequence[int | None] = max_tokens if max_tokens is not None else [None] * len(models)
        starts: list[float] = []
        at = busy_s
        for model, size in zip(models, sizes, strict=True):
            starts.append(at)
            if model is not None and model != loaded:
                at += self.expected_swap_s(model)
                loaded = model
            at += self.expected_request_run_s(model, size)
        return starts
