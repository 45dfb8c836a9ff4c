"""Synthetic traffic: a YAML description in, the records a replay consumes out.

```yaml
duration: 3600          # seconds of arrivals
seed: 1                 # the same seed gives the same records
classes:
  - name: chat
    rate: 0.2           # arrivals per second (Poisson)
    priority: interactive   # an integer, or interactive / normal / batch
    models: {qwen3: 3, gemma3: 1}   # model -> weight, or one model name
    run: {lognormal: {median: 4, sigma: 0.6}}   # GPU seconds when no model load is needed
    patience: {uniform: [30, 120]}  # optional: seconds before the client gives up; absent = forever
    swap: 8             # optional: extra seconds when its model must be loaded first (default 0)
    stoppable: false    # optional: its requests are Batch API lines (`simulate --preempt` may stop them)
```

Distributions: ``{fixed: S}``, ``{uniform: [A, B]}``, ``{exponential: MEAN}``,
``{lognormal: {median: S, sigma: X}}``. Every draw comes from one ``random.Random(seed)``, class by
class, so the result does not depend on anything else.

Each arrival becomes a record: a client with patience is a ``cancelled_waiting`` record whose
wait is its patience and whose ``run_ms`` is what it would run if granted; the others are
``served`` with their run. None of them needed a model load, so every load the simulation
makes costs its model's ``swap``. A ``stoppable`` class's records are Batch API lines
(``batch_line``), which have no patience.
"""

from __future__ import annotations

import bisect
import dataclasses
import difflib
import itertools
import math
import pathlib
import random
import statistics
from collections.abc import Set as AbstractSet
from typing import Any

import yaml

from llamaswap.config import describe_value
from llamaswap.core import Outcome
from llamaswap.core.priority import PrioritySource, parse_priority
from llamaswap.simulate.engine import FixedCosts
from llamaswap.simulate.records import RequestRecord

# More arrivals than this is a typo in rate or duration, not a workload.
MAX_ARRIVALS = 5_000_000


class WorkloadError(ValueError):
    """Every problem, each with its key path."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


@dataclasses.dataclass(frozen=True, slots=True)
class Distribution:
    kind: str  # fixed | uniform | exponential | lognormal
    a: float
    b: float = 0.0

    def draw(self, rng: random.Random) -> float:
        if self.kind == "fixed":
            return self.a
        if self.kind == "uniform":
            return rng.uniform(self.a, self.b)
        if self.kind == "exponential":
            return rng.expovariate(1.0 / self.a) if self.a > 0 else 0.0
        return rng.lognormvariate(math.log(self.a), self.b)  # lognormal: median a, sigma b


@dataclasses.dataclass(frozen=True, slots=True)
class TrafficClass:
    name: str
    rate: float
    priority: int
    models: tuple[tuple[str, float], ...]  # (model, weight)
    run: Distribution
    patience: Distribution | None
    swap_s: float
    stoppable: bool = False  # its requests are Batch API lines (records' `batch_line`)


@dataclasses.dataclass(frozen=True, slots=True)
class Workload:
    duration_s: float
    seed: int
    classes: tuple[TrafficClass, ...]


# -- validation ----------------------------------------------------------------------------


class _Reader:
    def __init__(self) -> None:
        self.problems: list[str] = []

    def fail(self, path: str, message: str) -> None:
        self.problems.append(f"{path}: {message}" if path else message)

    def mapping(self, node: Any, path: str, allowed: AbstractSet[str],
                required: AbstractSet[str] = frozenset()) -> dict[str, Any]:
        if not isinstance(node, dict):
            self.fail(path, f"must be a mapping, got {describe_value(node)}")
            return {}
        for key in node:
            if key not in allowed:
                close = difflib.get_close_matches(str(key), sorted(allowed), n=1)
                hint = f"; did you mean {close[0]!r}?" if close else f" (allowed: {', '.join(sorted(allowed))})"
                self.fail(_join(path, str(key)), f"unknown key{hint}")
        for key in sorted(required - set(node)):
            self.fail(_join(path, key), "is required")
        return node

    def number(self, node: Any, path: str, *, positive: bool = False) -> float | None:
        if isinstance(node, bool) or not isinstance(node, (int, float)) or not math.isfinite(node):
            self.fail(path, f"must be a number, got {describe_value(node)}")
            return None
        if node < 0 or (positive and node == 0):
            self.fail(path, f"must be {'positive' if positive else 'at least 0'}, got {node!r}")
            return None
        return float(node)

    def flag(self, node: Any, path: str) -> bool | None:
        if node is not True and node is not False:
            self.fail(path, f"must be true or false, got {describe_value(node)}")
            return None
        return node

    def distribution(self, node: Any, path: str) -> Distribution | None:
        kinds = {"fixed", "uniform", "exponential", "lognormal"}
        if not isinstance(node, dict) or len(node) != 1:
            self.fail(path, "must be one of {fixed: S}, {uniform: [A, B]}, {exponential: MEAN}, "
                            "{lognormal: {median: S, sigma: X}}")
            return None
        (kind, value), = node.items()
        where = _join(path, str(kind))
        if kind not in kinds:
            self.mapping(node, path, kinds)
            return None
        if kind in ("fixed", "exponential"):
            number = self.number(value, where)
            return Distribution(kind, number) if number is not None else None
        if kind == "uniform":
            if not isinstance(value, list) or len(value) != 2:
                self.fail(where, f"must be a list [A, B] of two numbers, got {describe_value(value)}")
                return None
            low, high = self.number(value[0], f"{where}[0]"), self.number(value[1], f"{where}[1]")
            if low is None or high is None:
                return None
            if low > high:
                self.fail(where, f"A must not exceed B, got [{low:g}, {high:g}]")
                return None
            return Distribution(kind, low, high)
        body = self.mapping(value, where, {"median", "sigma"}, {"median", "sigma"})
        median = self.number(body["median"], f"{where}.median", positive=True) if "median" in body else None
        sigma = self.number(body["sigma"], f"{where}.sigma") if "sigma" in body else None
        if median is None or sigma is None:
            return None
        return Distribution(kind, median, sigma)


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def parse_workload(data: Any) -> Workload:
    """Validate a parsed YAML document; raises WorkloadError listing every problem."""
    r = _Reader()
    top = r.mapping(data, "", {"duration", "seed", "classes"}, {"duration", "classes"})
    duration = r.number(top["duration"], "duration", positive=True) if "duration" in top else None
    seed = top.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int):
        r.fail("seed", f"must be an integer, got {describe_value(seed)}")
        seed = 0
    classes: list[TrafficClass] = []
    node = top.get("classes")
    if "classes" in top and (not isinstance(node, list) or not node):
        r.fail("classes", f"must be a non-empty list of traffic classes, got {describe_value(node)}")
        node = []
    names: set[str] = set()
    swaps: dict[str, tuple[float, str]] = {}
    for i, item in enumerate(node or []):
        path = f"classes[{i}]"
        spec = r.mapping(item, path, {"name", "rate", "priority", "models", "run", "patience", "swap",
                                     "stoppable"},
                         {"name", "rate", "models", "run"})
        name = spec.get("name")
        if "name" in spec:
            if not isinstance(name, str) or not name.strip():
                r.fail(f"{path}.name", f"must be a non-empty string, got {describe_value(name)}")
            elif name in names:
                r.fail(f"{path}.name", f"{name!r} is used by another class")
            names.add(str(name))
        rate = r.number(spec["rate"], f"{path}.rate", positive=True) if "rate" in spec else None
        priority = _priority(r, spec.get("priority", 0), f"{path}.priority")
        models = _models(r, spec["models"], f"{path}.models") if "models" in spec else None
        run = r.distribution(spec["run"], f"{path}.run") if "run" in spec else None
        patience = r.distribution(spec["patience"], f"{path}.patience") if spec.get("patience") is not None else None
        swap = r.number(spec.get("swap", 0), f"{path}.swap")
        stoppable = r.flag(spec.get("stoppable", False), f"{path}.stoppable")
        if stoppable and patience is not None:  # the feeder sends a line and waits for its answer
            r.fail(f"{path}.stoppable", "a Batch API line has no client that gives up: drop patience or stoppable")
        # A model has one load cost: classes that state it must agree (absent: the other's, else 0).
        if "swap" in spec and swap is not None:
            for model, _ in models or ():
                stated, where = swaps.setdefault(model, (swap, path))
                if stated != swap:
                    r.fail(f"{path}.swap", f"model {model!r} already has swap {stated:g} in {where}")
        if (rate is not None and models and run is not None and priority is not None and swap is not None
                and stoppable is not None):
            classes.append(TrafficClass(str(name), rate, priority, models, run, patience, swap, stoppable))
    if duration is not None and classes:
        expected = duration * sum(c.rate for c in classes)
        if expected > MAX_ARRIVALS:
            r.fail("duration", f"duration x total rate is {expected:,.0f} arrivals; at most {MAX_ARRIVALS:,}")
    if r.problems:
        raise WorkloadError(r.problems)
    assert duration is not None
    return Workload(duration, seed, tuple(classes))


def _priority(r: _Reader, node: Any, path: str) -> int | None:
    if isinstance(node, str):
        # The header's own aliases; a number in quotes stays an error, as in the rest of YAML here.
        alias = parse_priority(node)
        if alias.source is PrioritySource.ALIAS:
            return alias.value
    if isinstance(node, bool) or not isinstance(node, int):
        r.fail(path, f"must be an integer or interactive / normal / batch, got {describe_value(node)}")
        return None
    return node


def _models(r: _Reader, node: Any, path: str) -> tuple[tuple[str, float], ...] | None:
    if isinstance(node, str) and node.strip():
        return ((node.strip(), 1.0),)
    if not isinstance(node, dict) or not node:
        r.fail(path, f"must be a model name or a mapping of model to weight, got {describe_value(node)}")
        return None
    models = []
    for model, weight in node.items():
        value = r.number(weight, f"{path}.{model}", positive=True)
        if value is not None:
            models.append((str(model), value))
    return tuple(models) if len(models) == len(node) else None


def load_workload(path: str | pathlib.Path) -> Workload:
    """Read and validate a workload file; raises WorkloadError (unreadable files included)."""
    try:
        text = pathlib.Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise WorkloadError([f"{path}: cannot read the file: {exc.strerror or exc}"]) from exc
    except UnicodeDecodeError as exc:
        raise WorkloadError([f"{path}: is not UTF-8 text"]) from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise WorkloadError([f"{path}: is not valid YAML{where}: {getattr(exc, 'problem', None) or exc}"]) from exc
    if data is None:
        raise WorkloadError([f"{path}: is empty"])
    return parse_workload(data)


# -- generation ----------------------------------------------------------------------------


def generate(workload: Workload) -> list[RequestRecord]:
    """The arrivals, in arrival order (ties: class order), as replayable records."""
    rng = random.Random(workload.seed)
    drawn: list[tuple[float, int, int, str, float, float | None]] = []
    for class_index, spec in enumerate(workload.classes):
        names = [model for model, _ in spec.models]
        cumulative = list(itertools.accumulate(weight for _, weight in spec.models))
        at = 0.0
        for number in itertools.count(1):
            at += rng.expovariate(spec.rate)
            if at >= workload.duration_s:
                break
            model = names[bisect.bisect_right(cumulative, rng.random() * cumulative[-1])] if len(names) > 1 \
                else names[0]
            run_ms = round(spec.run.draw(rng) * 1000, 3)
            patience_ms = round(spec.patience.draw(rng) * 1000, 3) if spec.patience is not None else None
            drawn.append((round(at * 1000, 3), class_index, number, model, run_ms, patience_ms))
    drawn.sort(key=lambda item: (item[0], item[1]))
    classes = workload.classes
    return [RequestRecord(
        request_id=f"{classes[class_index].name}-{number}",
        model=model,
        priority=classes[class_index].priority,
        outcome=Outcome.SERVED if patience_ms is None else Outcome.CANCELLED_WAITING,
        dispatched=patience_ms is None,
        arrival_ms=at_ms,
        queue_wait_ms=patience_ms,
        first_byte_ms=None,
        run_ms=run_ms,
        settle_ms=0.0,
        swap=False,
        load=False,
        order=order,
        batch_line=classes[class_index].stoppable,
    ) for order, (at_ms, class_index, number, model, run_ms, patience_ms) in enumerate(drawn)]


def costs(workload: Workload, records: list[RequestRecord]) -> FixedCosts:
    """Each model's stated swap cost, and the median drawn run (only used if a record lacks one)."""
    runs: dict[str, list[float]] = {}
    for record in records:
        if record.model is not None and record.run_ms is not None:
            runs.setdefault(record.model, []).append(record.run_ms / 1000)
    swap: dict[str, float] = {}
    for spec in workload.classes:
        for model, _ in spec.models:
            swap[model] = max(swap.get(model, 0.0), spec.swap_s)  # classes agree, or left it out (0)
    return FixedCosts({model: statistics.median(values) for model, values in runs.items()}, swap)
