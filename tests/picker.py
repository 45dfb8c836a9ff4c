"""An endpoint picker's reading of a pod's metrics, as llm-d's router (the InferencePool's EPP)
reads them: a model of its contract for the chart and end-to-end tests (no EPP runs here).

What is modelled, from the inference extension's metric code as read (facts/components.md,
"Many nodes"; the router kept it when the EPP moved to llm-d):
- a metric spec is `name` or `name{label=value,...}`: braces hold at least one pair, values
  unquoted, nothing after the closing brace;
- a gauge spec (queued, running, KV use) reads the first series of the family whose labels
  include every pair of the spec (series carry no timestamps, so "the latest" is the first);
- the LoRA spec reads, of the series whose `running_lora_adapters` or `waiting_lora_adapters`
  is not empty, the one with the highest value (vLLM sets it to the time the labels were set);
  the adapters are comma-separated, `max_lora` an integer.
"""

from __future__ import annotations

import dataclasses
import re

_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*\Z")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*\Z")
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)(?: (-?\d+))?$")
_PAIR = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"\s*(,|$)')


class SpecError(ValueError):
    """A metric spec the picker would refuse at start."""


@dataclasses.dataclass(frozen=True)
class MetricSpec:
    name: str
    labels: dict[str, str]


def parse_spec(text: str) -> MetricSpec:
    """`name` or `name{a=b,c=d}`, as the picker parses an engine config's spec."""
    spec = text.strip()
    if not spec:
        raise SpecError("empty metric spec")
    start, end = spec.find("{"), spec.find("}")
    labels: dict[str, str] = {}
    name = spec
    if start != -1 or end != -1:
        if start == -1 or end == -1 or end <= start + 1:
            raise SpecError(f"{text!r}: needs both braces around at least one label")
        if end != len(spec) - 1:
            raise SpecError(f"{text!r}: characters after the closing brace")
        name = spec[:start].strip()
        for pair in spec[start + 1:end].split(","):
            parts = pair.split("=")
            if len(parts) != 2 or not parts[0].strip() or not parts[1].strip():
                raise SpecError(f"{text!r}: bad label pair {pair!r}")
            key = parts[0].strip()
            if not _LABEL_NAME.match(key):
                raise SpecError(f"{text!r}: bad label name {key!r}")
            labels[key] = parts[1].strip()
    if not _NAME.match(name):
        raise SpecError(f"{text!r}: bad metric name {name!r}")
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
    """What a LoRA spec reads: the latest series with adapters; None when no series has any."""
    latest: Series | None = None
    for series in families.get(spec.name, ()):
        if not all(series.labels.get(key) == value for key, value in spec.labels.items()):
            continue
        if not series.labels.get("running_lora_adapters") and not series.labels.get("waiting_lora_adapters"):
            continue
        if latest is None or series.value > latest.value:
            latest = series
    if latest is None:
        return None

    def names(label: str) -> tuple[str, ...]:
        return tuple(name for name in latest.labels.get(label, "").split(",") if name)

    return Adapters(names("running_lora_adapters"), names("waiting_lora_adapters"),
                    int(latest.labels.get("max_lora", "0") or 0))
