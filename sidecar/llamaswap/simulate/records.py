"""The activity log, parsed into typed records.

The sidecar writes one JSON object per line: a ``settings`` record at start and after every
reload, a ``request`` record when each request ends (so the file is in finish order), and an
``eviction`` record per resident model a grant unloaded (several resident, issue 37: counted by
reason, never replayed; the replay decides its own). The
log may be mixed with other lines or carry a logging prefix: a line counts if a JSON object
starts at its first ``{`` and has a known ``event``. Anything else is skipped and counted; a
known record with unusable fields is skipped too, with the first reason kept for the summary.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Collection, Iterable, Mapping
from typing import Any

from llamaswap.config.model_key import model_key
from llamaswap.core import Outcome, PolicyName
from llamaswap.core.residency import Residency

_DECODER = json.JSONDecoder()
_OUTCOMES = {outcome.value: outcome for outcome in Outcome}


@dataclasses.dataclass(frozen=True, slots=True)
class GpuSlots:
    """One GPU's slots as a settings record gives them: every model's, and the models' own."""

    default: int
    per_model: Mapping[str, int] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True, slots=True)
class SettingsRecord:
    """The scheduler settings in force from ``time`` on (None fields: not in the record)."""

    time: float | None
    scheduler: PolicyName | None
    aging_divisor_s: float | None
    swap_affinity_bonus: int | None
    max_queued: int | None
    max_wait_s: float | None
    model_priorities: Mapping[str, int] | None
    # The node's slots, where the record carries them (`slots`: the default, `model_slots`: per
    # model): the first GPU's, which logs written before each GPU's were recorded give every GPU.
    slots: int | None = None
    model_slots: Mapping[str, int] | None = None
    reserved_slots: int | None = None
    # Each upstream's residency (maxLoaded, pinned models, memory budget and sizes), by name, in
    # the configured order; an entry without the fields (older logs) keeps one model at a time.
    residency: Mapping[str, Residency] | None = None
    # Each upstream's own slots, by name (`upstreams[].slots`, `model_slots`; after `auto`, what
    # was learnt); an entry without them takes the node's.
    gpu_slots: Mapping[str, GpuSlots] | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class RequestRecord:
    """One finished request, as the simulation needs it.

    ``run_ms`` on a record that was not dispatched is what the request would take if granted:
    the sidecar never writes one, synthetic workloads do (their patient clients may leave).
    """

    request_id: str
    model: str | None
    priority: int  # the priority the scheduler used (after the operator's policy)
    outcome: Outcome
    dispatched: bool
    arrival_ms: float  # arrival_unix_ms
    queue_wait_ms: float | None  # until granted, or until it left without a grant
    first_byte_ms: float | None
    run_ms: float | None
    settle_ms: float  # the GPU stayed busy this long after the release (an abandoned generation)
    swap: bool
    load: bool
    status: int | None = None
    order: int = 0  # position in the file: breaks ties between equal arrival times
    # A generation answered 2xx (its run teaches the estimates), and streamed (its first byte
    # times its start). Logs written before these were recorded count as both.
    generation: bool = True
    streamed: bool = True
    # The name the client sent, where it differs from `model` (a single-model upstream keys
    # every request on its one model): what models.<id>.priority applies to.
    named_model: str | None = None
    # When it was granted (granted_unix_ms; None: not recorded or not granted), the output
    # tokens it asked for, and how many grants ran at its grant, itself included.
    granted_ms: float | None = None
    max_tokens: int | None = None
    slots_busy: int | None = None
    gpu: str | None = None  # the GPU its grant ran on (None: not recorded, or not granted)
    # A line of the Batch API (`batch_line`): its grant may be stopped for a higher band and the
    # line resumed where it stopped (`simulate --preempt`). Absent: a client's own request.
    batch_line: bool = False

    def settings_of(self, configured: Collection[str]) -> str | None:
        """The models.<id> entry it had (`config.model_key`, as the sidecar keyed it): where the
        client's name differed from the scheduled one, a single-model upstream's one model."""
        if self.named_model is None:
            return model_key(self.model, None, configured).settings
        return model_key(self.named_model, self.model, configured).settings

    @property
    def model_load(self) -> bool:
        """The grant had to load its model first (from nothing known, or from another model)."""
        return self.swap or self.load


def recorded_gpus(records: Iterable[RequestRecord]) -> tuple[str, ...]:
    """The upstreams the log's grants ran on, by name (empty: none recorded)."""
    return tuple(sorted({record.gpu for record in records if record.gpu is not None}))


def single_model(records: Iterable[RequestRecord]) -> str | None:
    """The key a single-model upstream scheduled every request of the log on, where the log shows
    it: every request is on that one key and some client named it otherwise (only a single-model
    upstream schedules a request on another name than the one it gave). None otherwise: a
    router, a workload, or a log that cannot tell. `Config.slots` needs it to key
    ``models.<id>.slots`` as the sidecar did (`config.model_key`)."""
    keys = set()
    renamed = False
    for record in records:
        keys.add(record.model)
        renamed = renamed or record.named_model is not None
    if renamed and len(keys) == 1:
        (key,) = keys
        return key
    return None


@dataclasses.dataclass(frozen=True, slots=True)
class Activity:
    settings: tuple[SettingsRecord, ...]
    requests: tuple[RequestRecord, ...]
    lines: int
    skipped: int  # not a JSON object with a known event
    malformed: int  # a known event with unusable fields
    first_problem: str | None  # "line N: why", for the first malformed one
    evictions: Mapping[str, int] = dataclasses.field(default_factory=dict)  # recorded, by reason


class _Bad(Exception):
    pass


def parse_activity(lines: Iterable[str]) -> Activity:
    settings: list[SettingsRecord] = []
    requests: list[RequestRecord] = []
    evictions: dict[str, int] = {}
    skipped = malformed = count = 0
    first_problem: str | None = None
    for number, line in enumerate(lines, 1):
        count = number
        document = _json_object(line)
        event = document.get("event") if document is not None else None
        try:
            if event == "request":
                requests.append(_request(document, len(requests)))  # type: ignore[arg-type]
            elif event == "settings":
                settings.append(_settings(document))  # type: ignore[arg-type]
            elif event == "eviction":
                reason = _reason(document)  # type: ignore[arg-type]
                evictions[reason] = evictions.get(reason, 0) + 1
            else:
                skipped += 1
        except _Bad as exc:
            malformed += 1
            if first_problem is None:
                first_problem = f"line {number}: {exc}"
    return Activity(tuple(settings), tuple(requests), count, skipped, malformed, first_problem, evictions)


def read_activity(path: str | pathlib.Path) -> Activity:
    """Raises OSError (unreadable) or UnicodeDecodeError; junk lines are not errors."""
    with open(path, encoding="utf-8") as handle:
        return parse_activity(handle)


def _json_object(line: str) -> dict[str, Any] | None:
    start = line.find("{")
    if start < 0:
        return None
    try:
        value, _ = _DECODER.raw_decode(line, start)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


# -- field readers: each raises _Bad naming the field --------------------------------------
# The request reader runs once per line of logs of 100,000s of lines: the common case (a
# float or an int, or None) is checked first and by type, the rest falls to the slow path.


def _number(document: Mapping[str, Any], key: str, *, required: bool, minimum: float | None = 0.0) -> float | None:
    value: Any = document.get(key)
    kind = type(value)
    if kind is float or kind is int:
        if (minimum is None or value >= minimum) and value - value == 0:  # finite: inf - inf is nan
            return float(value)
    elif value is None:
        if required:
            raise _Bad(f"{key} missing")
        return None
    if kind is not float and kind is not int:
        raise _Bad(f"{key} is not a number: {value!r}")
    if value - value != 0:
        raise _Bad(f"{key} is not a finite number: {value!r}")
    raise _Bad(f"{key} is below {minimum:g}: {value!r}")


def _integer(document: Mapping[str, Any], key: str, *, required: bool) -> int | None:
    value = document.get(key)
    if type(value) is int:
        return value
    if value is None:
        if required:
            raise _Bad(f"{key} missing")
        return None
    raise _Bad(f"{key} is not an integer: {value!r}")


def _count(document: Mapping[str, Any], key: str) -> int | None:
    """A positive integer, else None: a size or count the replay can do without."""
    value = document.get(key)
    return value if type(value) is int and value >= 1 else None


def _flag(document: Mapping[str, Any], key: str, default: bool) -> bool:
    value = document.get(key)
    if value is None:
        return default
    if value is not True and value is not False:
        raise _Bad(f"{key} is not true or false: {value!r}")
    return value


def _request(document: Mapping[str, Any], order: int) -> RequestRecord:
    outcome = _OUTCOMES.get(document.get("outcome"))  # type: ignore[arg-type]
    if outcome is None:
        raise _Bad(f"unknown outcome {document.get('outcome')!r}")
    # The model the scheduler keyed it on, where recorded (one key for a single-model upstream).
    model = document.get("scheduled_model", document.get("model"))
    if model is not None and type(model) is not str:
        raise _Bad(f"model is not a string: {model!r}")
    request_id = document.get("request_id")
    run_ms = _number(document, "run_ms", required=False)
    priority = _integer(document, "serial_priority", required=True)
    arrival = _number(document, "arrival_unix_ms", required=True, minimum=None)
    return RequestRecord(
        str(request_id) if request_id is not None else f"#{order + 1}",
        model or None,
        priority,  # type: ignore[arg-type]
        outcome,
        _flag(document, "dispatched", run_ms is not None),
        arrival,  # type: ignore[arg-type]
        # A client that gave up is replayed with its patience: the wait is then required.
        _number(document, "serial_queue_wait_ms", required=outcome is Outcome.CANCELLED_WAITING),
        _number(document, "first_byte_ms", required=False),
        run_ms,
        _number(document, "settle_ms", required=False) or 0.0,
        _flag(document, "swap", False),
        _flag(document, "load", False),
        _integer(document, "status", required=False),
        order,
        _flag(document, "generation", True),
        _flag(document, "streamed", True),
        named if isinstance(named := document.get("model"), str) and named != model else None,
        _number(document, "granted_unix_ms", required=False, minimum=None),
        _count(document, "max_tokens"),
        _count(document, "serial_slots_busy"),
        gpu if isinstance(gpu := document.get("upstream"), str) and gpu else None,
        _flag(document, "batch_line", False),
    )


def _settings(document: Mapping[str, Any]) -> SettingsRecord:
    scheduler = document.get("scheduler")
    if scheduler is not None and scheduler not in ("serial", "fifo"):
        raise _Bad(f"scheduler is not serial or fifo: {scheduler!r}")
    bonus = _integer(document, "swap_affinity_bonus", required=False)
    if bonus is not None and not 0 <= bonus <= 99:
        raise _Bad(f"swap_affinity_bonus is not 0..99: {bonus}")
    queued = _integer(document, "max_queued", required=False)
    if queued is not None and queued < 0:
        raise _Bad(f"max_queued is negative: {queued}")
    priorities = document.get("model_priorities")
    if priorities is not None and (not isinstance(priorities, dict) or not all(
            isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) for k, v in priorities.items())):
        raise _Bad("model_priorities is not a mapping of model to integer")
    model_slots = document.get("model_slots")
    if model_slots is not None and (not isinstance(model_slots, dict) or not all(
            isinstance(k, str) and type(v) is int and v >= 1 for k, v in model_slots.items())):
        raise _Bad("model_slots is not a mapping of model to an integer >= 1")
    reserved = _integer(document, "reserved_slots", required=False)
    if reserved is not None and reserved < 0:
        raise _Bad(f"reserved_slots is negative: {reserved}")
    return SettingsRecord(
        time=_number(document, "time", required=False, minimum=None),
        scheduler=PolicyName(scheduler) if scheduler is not None else None,
        aging_divisor_s=_number(document, "aging_divisor_s", required=False),
        swap_affinity_bonus=bonus,
        max_queued=queued,
        max_wait_s=_number(document, "max_wait_s", required=False),
        model_priorities=dict(priorities) if priorities is not None else None,
        slots=_count(document, "slots"),
        model_slots=dict(model_slots) if model_slots is not None else None,
        reserved_slots=reserved,
        residency=_residencies(document.get("upstreams")),
        gpu_slots=_gpu_slots(document.get("upstreams")),
    )


def _reason(document: Mapping[str, Any]) -> str:
    reason = document.get("reason")
    if type(reason) is not str or not reason:
        raise _Bad(f"eviction reason is not a name: {reason!r}")
    return reason


def _residencies(upstreams: Any) -> dict[str, Residency] | None:
    """The settings record's ``upstreams``: each one's residency by name (None: no list)."""
    if upstreams is None:
        return None
    if not isinstance(upstreams, list) or not all(isinstance(entry, dict) for entry in upstreams):
        raise _Bad("upstreams is not a list of objects")
    found: dict[str, Residency] = {}
    for entry in upstreams:
        name = entry.get("name")
        if type(name) is not str or not name:
            raise _Bad(f"an upstream's name is not a string: {name!r}")
        max_loaded = _integer(entry, "max_loaded", required=False)
        if max_loaded is not None and max_loaded < 1:
            raise _Bad(f"upstream {name}: max_loaded is below 1: {max_loaded}")
        pinned = entry.get("pinned") or []
        if not isinstance(pinned, list) or not all(type(model) is str for model in pinned):
            raise _Bad(f"upstream {name}: pinned is not a list of models")
        budget = _integer(entry, "memory_bytes", required=False)
        if budget is not None and budget < 0:
            raise _Bad(f"upstream {name}: memory_bytes is negative: {budget}")
        sizes = entry.get("model_bytes") or {}
        if not isinstance(sizes, dict) or not all(type(v) is int and v >= 0 for v in sizes.values()):
            raise _Bad(f"upstream {name}: model_bytes is not a mapping of model to bytes")
        found[name] = Residency(max_loaded or 1, frozenset(pinned), budget, sizes)
    return found


def _gpu_slots(upstreams: Any) -> dict[str, GpuSlots] | None:
    """The settings record's ``upstreams`` (a list of named objects: `_residencies` checked it):
    each one's own slots by name, where it gives them (None: no list)."""
    if upstreams is None:
        return None
    found: dict[str, GpuSlots] = {}
    for entry in upstreams:
        name = entry["name"]
        slots = entry.get("slots")
        if slots is None:
            continue
        if type(slots) is not int or slots < 1:
            raise _Bad(f"upstream {name}: slots is not an integer >= 1: {slots!r}")
        per_model = entry.get("model_slots") or {}
        if not isinstance(per_model, dict) or not all(
                isinstance(k, str) and type(v) is int and v >= 1 for k, v in per_model.items()):
            raise _Bad(f"upstream {name}: model_slots is not a mapping of model to an integer >= 1")
        found[name] = GpuSlots(slots, dict(per_model))
    return found


# -- writing (synthetic logs, tests, benchmarks) -------------------------------------------


def request_document(record: RequestRecord) -> dict[str, Any]:
    """The fields of a ``request`` line that the simulation reads back."""
    return {
        "event": "request",
        "request_id": record.request_id,
        "model": record.model,
        "outcome": record.outcome.value,
        "dispatched": record.dispatched,
        "serial_priority": record.priority,
        "serial_queue_wait_ms": record.queue_wait_ms,
        "arrival_unix_ms": record.arrival_ms,
        "first_byte_ms": record.first_byte_ms,
        "run_ms": record.run_ms,
        "settle_ms": record.settle_ms,
        "swap": record.swap,
        "load": record.load,
        "status": record.status,
        "generation": record.generation,
        "streamed": record.streamed,
        "granted_unix_ms": record.granted_ms,
        "max_tokens": record.max_tokens,
        "serial_slots_busy": record.slots_busy,
        "upstream": record.gpu,
        "batch_line": record.batch_line,
    }


def format_line(document: Mapping[str, Any]) -> str:
    return json.dumps(document, separators=(",", ":")) + "\n"
