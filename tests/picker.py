"""An endpoint picker's reading of a pod's metrics, as llm-d's router (the InferencePool's EPP)
reads them: a model of its contract for the chart and end-to-end tests (no EPP runs here).

What is modelled, from llm-d-router's core metrics extractor as of 2026-08 (its `spec.go`,
`loraspec.go` and `extractor.go`):
- a metric spec is a PromQL instant-vector selector, `name` or `name{label=value,...}`, the
  values quoted or not (the router adds the quotes); only `=` matchers select, other operators
  are parsed and ignored; a spec without a name is refused;
- a gauge spec (queued, running, KV use) reads, of the series whose labels include every pair,
  the one with the latest timestamp: with none in the text, the first;
- the LoRA spec reads the matching series with the highest value (vLLM sets it to the time the
  labels were set); a missing family means no LoRA information. Its `running_lora_adapters`
  and `waiting_lora_adapters` are split at commas and trimmed, `max_lora` is an integer.
"""

from __future__ import annotations

import dataclasses
import re

_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_MATCHER = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*(?:"((?:[^"\\]|\\.)*)"|([^",}\s]+))\s*')
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)(?: (-?\d+))?$")
_PAIR = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"\s*(,|$)')


class SpecError(ValueError):
    """A metric spec the picker would refuse at start."""


@dataclasses.dataclass(frozen=True)
class MetricSpec:
    name: str
    labels: dict[str, str]


def parse_spec(text: str) -> MetricSpec:
    """`name` or `name{a=b, c="d"}`, as the router parses an engine config's spec."""
    spec = text.strip()
    name_match = _NAME.match(spec)
    if name_match is None:
        raise SpecError(f"{text!r}: no metric name")
    name, rest = name_match.group(0), spec[name_match.end():].strip()
    labels: dict[str, str] = {}
    if rest:
        if not (rest.startswith("{") and rest.endswith("}")):
            raise SpecError(f"{text!r}: expected {{label=value,...}} after the name")
        body = rest[1:-1].strip()
        position = 0
        while position < len(body):
            matcher = _MATCHER.match(body, position)
            if matcher is None:
                raise SpecError(f"{text!r}: bad label matcher at {body[position:]!r}")
            key, operator = matcher.group(1), matcher.group(2)
            value = matcher.group(3) if matcher.group(3) is not None else matcher.group(4)
            if operator == "=" and not key.startswith("__"):
                labels[key] = value
            position = matcher.end()
            if position < len(body):
                if body[position] != ",":
                    raise SpecError(f"{text!r}: expected a comma at {body[position:]!r}")
                position += 1
    return MetricSpec(name, labels)


@dataclasses.dataclass(frozen=True)
class Series:
    labels: dict[str, str]
    value: float


def parse_exposition(text: str) -> dict[str, list[Series]]:
    """Prometheus text format 0.0.4 by family, strictly: every sample's family declared by a
    `# TYPE` line before it, no duplicate series."""
    families: dict[str, list[Series]] = {}
    declared: dict[str, str] = {}
    seen: set[tuple[str, frozenset[tuple[str, str]]]] = set()
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.startswith("# HELP "):
            continue
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            if name in declared:
                raise ValueError(f"line {number}: {name} declared twice")
            declared[name] = kind
            families[name] = []
            continue
        if line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match is None:
            raise ValueError(f"line {number}: not a sample: {line!r}")
        name, body, value = match.group(1), match.group(2), match.group(3)
        labels = _labels(body or "", number)
        family = _family_of(name, declared)
        if family is None:
            raise ValueError(f"line {number}: {name} has no # TYPE line before it")
        key = (name, frozenset(labels.items()))
        if key in seen:
            raise ValueError(f"line {number}: duplicate series {key}")
        seen.add(key)
        if name == family:  # a histogram's _bucket/_sum/_count are not what a gauge spec reads
            families[family].append(Series(labels, float(value)))
    return families


def _family_of(name: str, declared: dict[str, str]) -> str | None:
    if name in declared:
        return name
    for suffix in ("_bucket", "_sum", "_count"):
        if name.endswith(suffix) and declared.get(name[: -len(suffix)]) == "histogram":
            return name[: -len(suffix)]
    return None


def _labels(body: str, number: int) -> dict[str, str]:
    labels: dict[str, str] = {}
    position = 0
    while position < len(body):
        match = _PAIR.match(body, position)
        if match is None:
            raise ValueError(f"line {number}: bad labels {body!r}")
        labels[match.group(1)] = match.group(2).replace('\\"', '"').replace("\\n", "\n").replace("\\\\", "\\")
        position = match.end()
    return labels


def read_gauge(families: dict[str, list[Series]], spec: MetricSpec) -> float:
    """The value a gauge spec reads: the first series that matches; KeyError when none does."""
    for series in families.get(spec.name, ()):
        if all(series.labels.get(key) == value for key, value in spec.labels.items()):
            return series.value
    raise KeyError(f"no series of {spec.name} matches {spec.labels}")


@dataclasses.dataclass(frozen=True)
class Adapters:
    running: tuple[str, ...]
    waiting: tuple[str, ...]
    max_adapters: int


def read_adapters(families: dict[str, list[Series]], spec: MetricSpec) -> Adapters | None:
    """What a LoRA spec reads: the matching series with the highest value; None without one."""
    latest: Series | None = None
    for series in families.get(spec.name, ()):
        if not all(series.labels.get(key) == value for key, value in spec.labels.items()):
            continue
        if latest is None or series.value > latest.value:
            latest = series
    if latest is None:
        return None

    def names(label: str) -> tuple[str, ...]:
        return tuple(name.strip() for name in latest.labels.get(label, "").split(",") if name.strip())

    return Adapters(names("running_lora_adapters"), names("waiting_lora_adapters"),
                    int(latest.labels.get("max_lora", "0") or 0))
