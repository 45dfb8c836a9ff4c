"""Expected GPU times per model and estimated start times for the waiting, like `squeue --start`.

Measurements arrive one grant at a time (`record`): how long the grant held the GPU and, when
the upstream answered, how long it took to the first response byte. Per model the estimator
keeps the most recent ``samples`` of each and answers with rolling medians (robust to the odd
runaway generation):

- expected run of a model = median run time of its grants that needed no model load;
- expected swap cost of a model = median time to first byte of its grants that loaded it,
  minus the median time to first byte of those that did not (never below 0). An answer that was
  not streamed times no first byte (it comes with the last): then a grant that loaded its model
  and said its `max_tokens` measures the load as its run beyond what its tokens take (the
  model's run for that many tokens, below), so that batch traffic, which seldom streams, still
  learns its swaps.

Where a request says how many output tokens it asks for (`max_tokens`), its expected run scales
with them (`expected_request_run_s`, `_TokenRuns`): per model, from its recent grants that said
so, either the median run time per token asked times the tokens, or, where it predicts those
grants better, a run that grows with the square of the tokens as well (each token reads the
whole context before it, so the 4,000th token of a generation costs more than the 100th: on
this project's CPU machine four times the per-token median at 4,000 tokens). A request that
does not say, or a model with no such measurement yet, gets the model's expected run.

Before a model has a measurement the stated defaults apply (`estimates.defaultRunSeconds`,
`estimates.defaultSwapSeconds`). A grant that loaded a model also teaches the run time, minus
the measured swap cost, so that a model that is always swapped in still gets a run estimate.

Estimated starts are `estimate_node.starts_of_node`: the grants' own rule walked over the
order with this estimator's figures, for one GPU as for several (one GPU is a node of one).

A running request's expected end is one function, `expected_end_s`: its run (sized by its
`max_tokens` where given) from its ready time, counted from its grant. The ready time is set once,
at the grant (`Decision.ready_at`): when the load it waits for ends (its own, or the one under way
that it was granted beside), or at once. The grants (`NodeTimes`), the estimates, the views, the
page, Retry-After and `llamaswap simulate` all read it, each through one protocol of figures
(`Figures`: a learnt `Estimator`, or the stated costs of a simulation).

A grant that has run longer than expected holds its slot for a time nobody can tell: its
remainder is unknown (`left_s`: None), and so is the start of every request that
waits for that slot (`math.inf` from `starts_of_node`), never a time already known to be wrong. Pure:
no clock, no I/O; times are passed in.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Final, Protocol, TypeVar

from llamaswap.core.clock import NS_PER_S
from llamaswap.core.decisions import Decision, RunningView

NO_MODEL: Final = ""  # the key for requests that name no model (also their metric label)
_Key = tuple[str | None, str]  # (gpu, model): None for the node's figure
_W = TypeVar("_W")  # a window of recent measurements (`_Recent`, `_TokenRuns`)


class _Recent:
    """The last `size` values and their median. The median is worked out when read, once per
    change (a sort of the window): values arrive at every release, and are read only where an
    estimate is asked for (a request that waits, the page), so a release costs an append."""

    __slots__ = ("values", "_median", "_fresh")

    def __init__(self, size: int) -> None:
        self.values: deque[float] = deque(maxlen=size)
        self._median: float | None = None
        self._fresh = True  # _median is of the window as it is

    def add(self, value: float) -> None:
        self.values.append(value)
        self._fresh = False

    @property
    def median(self) -> float | None:
        if not self._fresh:
            ordered = sorted(self.values)
            middle = len(ordered) // 2
            self._median = ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2
            self._fresh = True
        return self._median


class _TokenRuns:
    """A model's recent runs with the output tokens they asked for, and its run for N tokens.

    Two fits of the same window; the one whose predictions of those runs were closer (mean
    absolute error) answers. The median run per token is the robust default: a run that stopped
    well before its `max_tokens` does not move it. The other, run = a*N + b*N^2 with a, b >= 0 by
    least squares, follows a run per token that grows with the context; it must beat the median
    by a margin, so that runs that grow in proportion (one run per token) keep the median's exact
    answer."""

    __slots__ = ("pairs", "_per_token", "_linear", "_square", "_fresh")
    MARGIN = 0.9  # the growing fit answers only when its error is below this share of the median's
    FIT_FROM = 5  # runs before a curve of two terms is fitted (fewer: it would fit any three)

    def __init__(self, size: int) -> None:
        self.pairs: deque[tuple[int, float]] = deque(maxlen=size)
        self._per_token = 0.0
        self._linear = 0.0  # a, b of the growing fit; both 0: the median answers
        self._square = 0.0
        self._fresh = True  # the fits are of the window as it is (refitted when asked after an add)

    def add(self, tokens: int, run_s: float) -> None:
        self.pairs.append((tokens, run_s))
        self._fresh = False

    def run_s(self, tokens: int) -> float:
        """The expected run for ``tokens`` (at least one pair added)."""
        if not self._fresh:
            self._per_token = statistics.median(run / n for n, run in self.pairs)
            self._linear, self._square = self._growing_fit()
            self._fresh = True
        if self._square:
            return self._linear * tokens + self._square * tokens * tokens
        return self._per_token * tokens

    def _growing_fit(self) -> tuple[float, float]:
        pairs = self.pairs
        if len(pairs) < self.FIT_FROM:
            return 0.0, 0.0
        # Least squares of run = a*N + b*N^2 (normal equations, N in thousands to keep them tame).
        s2 = s3 = s4 = p1 = p2 = 0.0
        for n, run in pairs:
            k = n / 1000
            k2 = k * k
            s2 += k2
            s3 += k2 * k
            s4 += k2 * k2
            p1 += k * run
            p2 += k2 * run
        det = s2 * s4 - s3 * s3
        if det <= 1e-9 * s2 * s4:  # (nearly) one size asked: no curve to tell
            return 0.0, 0.0
        a = (p1 * s4 - p2 * s3) / det
        b = (p2 * s2 - p1 * s3) / det
        if b < 0:
            a, b = p1 / s2, 0.0
        elif a < 0:
            a, b = 0.0, p2 / s4
        a, b = a / 1000, b / 1_000_000  # back to seconds per token, per token squared
        per_token = self._per_token
        by_fit = sum(abs(a * n + b * n * n - run) for n, run in pairs)
        by_median = sum(abs(per_token * n - run) for n, run in pairs)
        return (a, b) if b > 0 and by_fit < self.MARGIN * by_median else (0.0, 0.0)


class Figures(Protocol):
    """The expected GPU times per model on a GPU (gpu None: the node's figure), which every
    expected end and estimated start is figured from: an `Estimator` (learnt), or the stated costs
    of `llamaswap simulate` (`simulate.engine.FixedCosts`). The run of a request that says its
    `max_tokens` is sized by them (`expected_request_run_s`)."""

    def expected_run_s(self, model: str | None, gpu: str | None = None) -> float: ...

    def expected_request_run_s(self, model: str | None, max_tokens: int | None,
                               gpu: str | None = None) -> float: ...

    def expected_swap_s(self, model: str | None, gpu: str | None = None) -> float: ...


# A grant's ready time as a running request reads it: the load its run waits for (that model)
# and how long before the moment asked about that load began (`Decision.ready_at`).
ReadyAt = tuple[str | None, float]


def ready_in_s(figures: Figures, ready_at: ReadyAt | None, gpu: str | None = None) -> float:
    """How long after the moment ``ready_at`` is counted from a run may begin: when the load it
    waits for ends (that model's expected swap after the load began), or at once (None, or a load
    expected over)."""
    if ready_at is None:
        return 0.0
    return max(0.0, figures.expected_swap_s(ready_at[0], gpu) - ready_at[1])


def expected_end_s(figures: Figures, model: str | None, *, max_tokens: int | None = None,
                   gpu: str | None = None, ready_at: ReadyAt | None = None) -> float:
    """When a running request is expected to end, in seconds after its grant: its run (sized by
    ``max_tokens`` where given, `expected_request_run_s`) once it is ready (``ready_at``: the
    load it waits for, its own or the one it was granted beside, and how long before this grant
    that load began; None: ready at once). The one figure of a running request's end: every
    reader asks it."""
    return ready_in_s(figures, ready_at, gpu) + figures.expected_request_run_s(model, max_tokens, gpu)


def _ready_of(decision: Decision) -> ReadyAt | None:
    """A grant's `Decision.ready_at` counted from its grant."""
    load = decision.ready_at
    return None if load is None else (load[0], (decision.granted_ns - load[1]) / NS_PER_S)


def grant_ready_s(figures: Figures, decision: Decision) -> float:
    """How long after its grant a grant is ready to run (`Decision.ready_at`)."""
    return ready_in_s(figures, _ready_of(decision), decision.gpu)


def grant_end_s(figures: Figures, decision: Decision) -> float:
    """`expected_end_s` of a grant as the scheduler made it: its ready time is the one its grant
    set (`Decision.ready_at`), its run sized by its `max_tokens` where said."""
    return expected_end_s(figures, decision.model, max_tokens=decision.max_tokens, gpu=decision.gpu,
                          ready_at=_ready_of(decision))


def left_s(end_s: float, running_s: float) -> float | None:
    """How much longer a request expected to end ``end_s`` after its grant runs, ``running_s``
    after it: None once it has outrun that (it still runs, for a time nobody can tell)."""
    left = end_s - running_s
    return left if left > 0 else None


def remaining_of(figures: Figures, grants: Sequence[RunningView]) -> list[float]:
    """The expected remaining time of each of these running grants (`math.inf`: it outran its
    expected time): its run, sized by the output tokens it asked for where it said, once its
    ready time has come (`RunningView.ready_at`, set once at its grant)."""
    remaining: list[float] = []
    for grant in grants:
        load = grant.ready_at
        # (that model, how long before this grant its load began)
        ready = None if load is None else (load[0], load[1] - grant.running_s)
        end = expected_end_s(figures, grant.model, max_tokens=grant.max_tokens, gpu=grant.gpu,
                             ready_at=ready)
        left = left_s(end, grant.running_s)
        remaining.append(math.inf if left is None else left)
    return remaining


def ready_left_s(figures: Figures, grant: RunningView) -> float:
    """How long until a running grant's ready time (the load it waits for ends; 0 once it is
    expected over, or with none)."""
    return ready_in_s(figures, grant.ready_at, grant.gpu)


class Estimator:
    def __init__(self, *, default_run_s: float, default_swap_s: float, samples: int) -> None:
        if samples < 1:
            raise ValueError("samples must be at least 1")
        self.default_run_s = default_run_s
        self.default_swap_s = default_swap_s
        self._samples = samples
        # Keyed by (gpu, model): each GPU's own figures, and the node's under gpu None.
        self._run: dict[_Key, _Recent] = {}
        self._warm_first_byte: dict[_Key, _Recent] = {}
        self._load_first_byte: dict[_Key, _Recent] = {}
        self._token_runs: dict[_Key, _TokenRuns] = {}  # runs with the tokens they asked for
        self._load_beyond_run: dict[_Key, _Recent] = {}  # loads measured by unstreamed runs

    # -- learning ------------------------------------------------------------------------

    def record(self, model: str | None, *, run_s: float, first_byte_s: float | None, model_load: bool,
               max_tokens: int | None = None, gpu: str | None = None) -> None:
        """One finished generation: its run time, its time to first byte (None when it does not
        time the start of the generation: no answer, or a response that was not streamed), whether
        it began by loading its model, the output tokens it asked for (None: not said), and the
        GPU it ran on: each GPU learns its own figures (a small GPU runs slower), and
        the node's figures, for a GPU that has none yet, learn from all."""
        for where in (None, gpu) if gpu is not None else (None,):
            key = (where, model or NO_MODEL)
            if first_byte_s is not None:
                table = self._load_first_byte if model_load else self._warm_first_byte
                self._recent(table, key).add(max(0.0, first_byte_s))
            elif model_load and max_tokens is not None and max_tokens > 0:
                tokens_run = self._tokens_run_s(model, max_tokens, where)
                if tokens_run is not None:
                    self._recent(self._load_beyond_run, key).add(max(0.0, run_s - tokens_run))
            run = max(0.0, run_s - self.expected_swap_s(model, gpu=where) if model_load else run_s)
            self._recent(self._run, key).add(run)
            if max_tokens is not None and max_tokens > 0:
                self._window(self._token_runs, key, _TokenRuns).add(max_tokens, run)

    def _recent(self, table: dict[_Key, _Recent], key: _Key) -> _Recent:
        # (A window, once made, is there: one lookup, at every release, without `_window`'s frame.)
        return table.get(key) or self._window(table, key, _Recent)

    def _window(self, table: dict[_Key, _W], key: _Key, kind: Callable[[int], _W]) -> _W:
        """The window of ``key`` in ``table``, a new one of ``samples`` made the first time."""
        window = table.get(key)
        if window is None:
            window = table[key] = kind(self._samples)
        return window

    @staticmethod
    def _own_or_node(table: Mapping[_Key, _W], model: str | None, gpu: str | None) -> _W | None:
        """The GPU's own window of the model where it has one, else the node's (None: neither).
        A window exists only once a value went in."""
        key = model or NO_MODEL
        own = table.get((gpu, key)) if gpu is not None else None
        return own if own is not None else table.get((None, key))

    @classmethod
    def _median(cls, table: dict[_Key, _Recent], model: str | None, gpu: str | None) -> float | None:
        """The GPU's own median where it has one, else the node's (None: no measurement)."""
        recent = cls._own_or_node(table, model, gpu)
        return recent.median if recent is not None else None

    def _tokens_run_s(self, model: str | None, tokens: int, gpu: str | None) -> float | None:
        """The run of ``tokens`` output tokens by the GPU's own runs where it has them, else the
        node's (None: no run that said its tokens)."""
        runs = self._own_or_node(self._token_runs, model, gpu)
        return runs.run_s(tokens) if runs is not None else None

    # -- answers -------------------------------------------------------------------------

    def expected_run_s(self, model: str | None, gpu: str | None = None) -> float:
        """On ``gpu`` (None: the node's figure; a GPU with no measurement of its own has it)."""
        median = self._median(self._run, model, gpu)
        return median if median is not None else self.default_run_s

    def expected_request_run_s(self, model: str | None, max_tokens: int | None, gpu: str | None = None) -> float:
        """The expected run of one request of `model` that asks for `max_tokens` output tokens
        (None: not said): by the runs that said their tokens where the model has some
        (`_TokenRuns`), else the model's expected run."""
        if max_tokens is not None and max_tokens > 0:
            tokens_run = self._tokens_run_s(model, max_tokens, gpu)
            if tokens_run is not None:
                return tokens_run
        return self.expected_run_s(model, gpu)

    def expected_swap_s(self, model: str | None, gpu: str | None = None) -> float:
        """By the first bytes where loads were streamed, else by unstreamed runs, else the default."""
        loads = self._median(self._load_first_byte, model, gpu)
        if loads is None:
            by_runs = self._median(self._load_beyond_run, model, gpu)
            return by_runs if by_runs is not None else self.default_swap_s
        warm = self._median(self._warm_first_byte, model, gpu)
        return max(0.0, loads - (warm if warm is not None else 0.0))
