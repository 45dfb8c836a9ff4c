"""The settings a simulation runs with: where each value comes from, validation, sweeps.

Precedence, lowest first: the recorded settings (the log's first settings record; the
configuration defaults without one), then a whole configuration file (``-c``), then the single
flags (``--scheduler``, ``--aging-divisor``, ...), then ``--sweep``, whose every combination runs.

Slots: without -c, each GPU the log's settings record lists with its own slots
(``upstreams[].slots``, ``model_slots``) keeps them, by name; the others (a log written before
they were recorded, a GPU it does not list) take the node's ``slots``. ``slots`` set by a flag or
a sweep applies to every model on every GPU (the per-model and per-GPU slots of ``-c`` or the
record give way). ``maxLoaded`` set by a flag or a sweep applies to every GPU (the models each
keeps resident at once; ``-c``'s pinned models and memory budgets stay, and 1 is one model at a
time, as before); without one each GPU keeps what ``-c`` gives it, else what the log's settings
record says it ran with (its maxLoaded, pinned models and memory budget, by upstream name), else 1.
``idleUnload`` (``--idle-unload S``) set by a flag or a sweep is every GPU's
``upstream.idleUnloadSeconds`` (``-c``'s ``models.<id>.ttl`` stay: a model's own wins, as in the
sidecar); without one each GPU keeps ``-c``'s idle times, else none (0: never).

A ``reservedSlots`` that a flag or a sweep gives must be below the slots of
its combination (``SettingsError`` otherwise); one from the record or ``-c`` is lowered to fit,
as the sidecar does where ``auto`` learns fewer slots (``fit_reserved``).
"""

from __future__ import annotations

import dataclasses
import difflib
import itertools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from llamaswap.core import InvalidSlots, Policy, PolicyName, Slots
from llamaswap.core.policy import GpuPolicy
from llamaswap.core.residency import IdleUnload, Residency
from llamaswap.simulate.records import GpuSlots, SettingsRecord

MAX_BONUS = 99
MAX_GPUS = 64


class SettingsError(ValueError):
    """A bad value; the message is ready for ``error: ...``."""


@dataclasses.dataclass(frozen=True, slots=True)
class Settings:
    scheduler: PolicyName
    aging_divisor_s: float
    swap_affinity_bonus: int
    max_queued: int
    max_wait_s: float
    model_priorities: Mapping[str, int]
    slots: int = 1  # every model's, unless in model_slots
    reserved_slots: int = 0
    model_slots: Mapping[str, int] = dataclasses.field(default_factory=dict)
    # The upstreams (GPUs) of the node, each with these slots: their names where the log or -c
    # names them (as many as ``gpus``), else gpu0..gpuN-1.
    gpus: int = 1
    named_gpus: tuple[str, ...] = ()
    # The upstreams as -c FILE describes them (their own slots, models and residency), while no
    # flag or sweep of slots or gpus replaces them.
    configured: tuple[GpuPolicy, ...] = ()
    # Models resident at once on each GPU: the first configured GPU's, or a flag's or a sweep's
    # (then every GPU's: ``max_loaded_everywhere``).
    max_loaded: int = 1
    max_loaded_everywhere: bool = False
    # Each upstream's residency as the log's settings record gives it, by name (without -c): an
    # upstream it does not name keeps ``max_loaded`` models, no pins, no budget.
    recorded_residency: Mapping[str, Residency] = dataclasses.field(default_factory=dict)
    # Each upstream's own slots as the log's settings record gives them, by name (without -c): an
    # upstream it does not name takes ``slots`` and ``model_slots``.
    recorded_slots: Mapping[str, GpuSlots] = dataclasses.field(default_factory=dict)
    # Batch API lines may be stopped for a higher band (`simulate --preempt`), each after running
    # at least ``min_run_s`` (`Policy.stop_min_run_s`).
    preempt: bool = False
    min_run_s: float = 0.0
    # Seconds a resident model may sit idle before it is unloaded (`upstream.idleUnloadSeconds`;
    # 0: never): the first configured GPU's, or a flag's or a sweep's (then every GPU's:
    # ``idle_unload_everywhere``; a GPU not configured takes it in any case).
    idle_unload_s: float = 0.0
    idle_unload_everywhere: bool = False

    @classmethod
    def from_policy(cls, policy: Policy, *, configured: bool = True) -> Settings:
        """The settings of ``policy``: its GPUs as configured (``configured``), or only their count
        (the defaults, without -c FILE: one GPU). The node's reservation is the largest of the
        GPUs' (`auto` may have lowered one GPU's). The node-wide slots and maxLoaded are the first
        GPU's: what the report shows for the row and what GPUs named by ``--gpus N`` get (each
        configured GPU keeps its own until a flag replaces them)."""
        first = policy.gpus[0]
        reserved = max(gpu.slots.reserved for gpu in policy.gpus)
        return cls(policy.name, policy.aging_divisor_s, policy.swap_affinity_bonus, policy.max_queued,
                   policy.max_wait_s, dict(policy.model_priorities), first.slots.default, reserved,
                   dict(first.slots.per_model), len(policy.gpus),
                   tuple(gpu.name for gpu in policy.gpus) if configured else (),
                   policy.gpus if configured else (), first.residency.max_loaded,
                   min_run_s=policy.stop_min_run_s, idle_unload_s=first.residency.idle.default_s)

    @property
    def model_ttl(self) -> dict[str, float]:
        """The configured models' own idle times (``models.<id>.ttl``; 0: never), over every
        configured GPU that lists them."""
        return {model: seconds for gpu in self.configured for model, seconds in gpu.residency.idle.per_model_s.items()}

    @property
    def idles(self) -> bool:
        """Some model may be unloaded for idleness: an idle time, or a configured model's own ttl."""
        return self.idle_unload_s > 0 or any(gpu.residency.idle.ever for gpu in self.configured)

    @property
    def fewest_slots(self) -> int:
        """The fewest slots of any model on any upstream (reservedSlots must stay below)."""
        per_gpu = [min([gpu.slots.default, *gpu.slots.per_model.values()]) for gpu in self.configured]
        recorded = [min([own.default, *own.per_model.values()]) for own in self._recorded_slots()]
        return min([self.slots, *self.model_slots.values(), *per_gpu, *recorded])

    @property
    def gpu_names(self) -> tuple[str, ...]:
        if len(self.named_gpus) == self.gpus:
            return self.named_gpus
        return tuple(f"gpu{i}" for i in range(self.gpus))

    def policy(self) -> Policy:
        """Raises SettingsError where reservedSlots leaves a model no slot (see ``fit_reserved``)."""
        policy = self._policy()
        if self.min_run_s != policy.stop_min_run_s:
            policy = dataclasses.replace(policy, stop_min_run_s=self.min_run_s)
        return policy

    def _policy(self) -> Policy:
        try:
            slots = Slots(self.slots, self.model_slots, self.reserved_slots)
        except InvalidSlots as exc:
            raise SettingsError(f"reservedSlots {self.reserved_slots} with slots {self.slots}: {exc}") from None
        if self.scheduler is PolicyName.FIFO:
            policy = Policy.fifo(model_priorities=self.model_priorities, max_queued=self.max_queued,
                                 max_wait_s=self.max_wait_s, slots=slots)
        else:
            policy = Policy.serial(aging_divisor_s=self.aging_divisor_s, swap_affinity_bonus=self.swap_affinity_bonus,
                                   max_queued=self.max_queued, max_wait_s=self.max_wait_s, slots=slots)
        if len(self.configured) == self.gpus:  # as -c FILE describes them (one is a node of one)
            try:
                return policy.with_gpus(tuple(
                    dataclasses.replace(gpu, slots=Slots(gpu.slots.default, gpu.slots.per_model,
                                                          self.reserved_slots),
                                        residency=self._residency(gpu.name, gpu.residency, "-c FILE",
                                                                  configured=True))
                    for gpu in self.configured))
            except InvalidSlots as exc:
                raise SettingsError(f"reservedSlots {self.reserved_slots}: {exc}") from None
        recorded = self.recorded_residency
        return policy.with_gpus(tuple(
            GpuPolicy(name, self._slots_of(name, slots),
                      residency=self._residency(name, recorded.get(name) or Residency(self.max_loaded),
                                                "the log's settings record"))
            for name in self.gpu_names))

    def _slots_of(self, name: str, node: Slots) -> Slots:
        """A GPU's slots: its own as the log recorded them, else the node's."""
        own = self.recorded_slots.get(name)
        if own is None:
            return node
        try:
            return Slots(own.default, own.per_model, self.reserved_slots)
        except InvalidSlots as exc:
            raise SettingsError(f"reservedSlots {self.reserved_slots} on {name}: {exc}") from None

    def _residency(self, name: str, residency: Residency, source: str, *, configured: bool = False) -> Residency:
        """A GPU's residency (configured or recorded), with a flag's or a sweep's maxLoaded where
        one is given, and the idle time (a configured GPU keeps its own without a flag or a sweep)."""
        if ((self.idle_unload_everywhere or not configured)
                and residency.idle.default_s != self.idle_unload_s):  # (the models' own ttl stay)
            residency = dataclasses.replace(residency, idle=IdleUnload(self.idle_unload_s, residency.idle.per_model_s))
        if not self.max_loaded_everywhere or residency.max_loaded == self.max_loaded:
            return residency
        # (`Residency` drops the pins and the budget where nothing can stay beside a load.)
        changed = dataclasses.replace(residency, max_loaded=self.max_loaded)
        if len(changed.pinned) > self.max_loaded:
            raise SettingsError(f"maxLoaded {self.max_loaded}: {name} pins {len(changed.pinned)} models "
                                f"({', '.join(sorted(changed.pinned))}) in {source}: keep at least as many")
        if changed.memory_bytes is None:  # the models' sizes count against a budget only
            changed = dataclasses.replace(changed, model_bytes={})
        return changed

    def with_recorded(self, record: SettingsRecord) -> Settings:
        """The record's values over these (a record may lack some fields)."""
        changes: dict[str, Any] = {}
        for field in ("scheduler", "aging_divisor_s", "swap_affinity_bonus", "max_queued", "max_wait_s",
                      "model_priorities", "slots", "reserved_slots", "model_slots"):
            value = getattr(record, field)
            if value is not None:
                changes[field] = value
        if record.gpu_slots:
            changes["recorded_slots"] = dict(record.gpu_slots)
        if record.residency:  # the first upstream's maxLoaded is the node's (as from_policy reads it)
            changes["recorded_residency"] = dict(record.residency)
            changes["max_loaded"] = next(iter(record.residency.values())).max_loaded
        return dataclasses.replace(self, **changes)

    @property
    def most_slots(self) -> int:
        """The most slots of any model on any upstream."""
        per_gpu = [max([gpu.slots.default, *gpu.slots.per_model.values()]) for gpu in self.configured]
        recorded = [max([own.default, *own.per_model.values()]) for own in self._recorded_slots()]
        return max([self.slots, *self.model_slots.values(), *per_gpu, *recorded])

    def _recorded_slots(self) -> list[GpuSlots]:
        """The recorded slots of the GPUs this replay has (those it runs with)."""
        if len(self.configured) == self.gpus:
            return []
        return [own for name in self.gpu_names if (own := self.recorded_slots.get(name)) is not None]

    def values(self) -> dict[str, Any]:
        """Keyed by the configuration's names (the sweep keys), plus the model priorities and
        the per-model slots."""
        return {key.name: getattr(self, key.field) for key in KEYS.values()} | {
            "modelPriorities": dict(self.model_priorities), "modelSlots": dict(self.model_slots)}

    def describe(self) -> str:
        values = self.values()
        text = ", ".join(f"{name} {_show(values[name])}" for name in shown_keys([self], ()))
        if self.scheduler is PolicyName.FIFO and self.model_priorities:
            text += ", model priorities " + ", ".join(f"{m} {p:+d}" for m, p in sorted(self.model_priorities.items()))
        return text + model_slots_text(self)


def model_ttl_text(settings: Settings) -> str:
    """The models' own idle times where some are configured (shown beside ``idleUnload``)."""
    ttl = settings.model_ttl
    if not ttl:
        return ""
    return ", model ttl " + ", ".join(f"{m} {_show(seconds)}" for m, seconds in sorted(ttl.items()))


def model_slots_text(settings: Settings) -> str:
    if not settings.model_slots:
        return ""
    return ", model slots " + ", ".join(f"{m} {n}" for m, n in sorted(settings.model_slots.items()))


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return f"{value:g}" if isinstance(value, float) else str(value)


# -- one parser per key: text -> value, or SettingsError -----------------------------------


def parse_scheduler(text: str) -> PolicyName:
    try:
        return PolicyName(text.strip().lower())
    except ValueError:
        raise SettingsError(f"must be serial or fifo, got {text!r}") from None


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise SettingsError(f"not a number: {text!r}") from None
    if not math.isfinite(value):
        raise SettingsError(f"not a finite number: {text!r}")
    return value


def _int(text: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        raise SettingsError(f"not an integer: {text!r}") from None


def parse_aging_divisor(text: str) -> float:
    value = _float(text)
    if value < 0 or 0 < value < 0.001:
        raise SettingsError(f"must be 0 (no aging) or at least 0.001 seconds, got {text}")
    return value


def parse_bonus(text: str) -> int:
    value = _int(text)
    if not 0 <= value <= MAX_BONUS:
        raise SettingsError(f"must be 0..{MAX_BONUS} (0 disables it), got {value}")
    return value


def parse_max_queued(text: str) -> int:
    value = _int(text)
    if value < 0:
        raise SettingsError(f"must be 0 (unlimited) or more, got {value}")
    return value


def parse_max_wait(text: str) -> float:
    value = _float(text)
    if value < 0 or 0 < value < 0.001:
        raise SettingsError(f"must be 0 (wait forever) or at least 0.001 seconds, got {text}")
    return value


def parse_slots(text: str) -> int:
    value = _int(text)
    if value < 1:
        raise SettingsError(f"must be an integer >= 1, got {value}")
    return value


def parse_gpus(text: str) -> int:
    value = _int(text)
    if not 1 <= value <= MAX_GPUS:
        raise SettingsError(f"must be an integer from 1 to {MAX_GPUS}, got {value}")
    return value


def parse_max_loaded(text: str) -> int:
    value = _int(text)
    if value < 1:
        raise SettingsError(f"must be an integer >= 1 (1: one model at a time), got {value}")
    return value


def parse_preempt(text: str) -> bool:
    value = text.strip().lower()
    if value not in ("on", "off", "true", "false"):
        raise SettingsError(f"must be on or off, got {text!r}")
    return value in ("on", "true")


def parse_min_run(text: str) -> float:
    value = _float(text)
    if value < 0:
        raise SettingsError(f"must be 0 (stopped at once) or more seconds, got {text}")
    return value


def parse_idle_unload(text: str) -> float:
    value = _float(text)
    if value < 0 or 0 < value < 0.001:
        raise SettingsError(f"must be 0 (never unload an idle model) or at least 0.001 seconds, got {text}")
    return value


def parse_reserved_slots(text: str) -> int:
    value = _int(text)
    if value < 0:
        raise SettingsError(f"must be 0 (none reserved) or more, got {value}")
    return value


@dataclasses.dataclass(frozen=True, slots=True)
class Key:
    name: str  # as in the configuration and --sweep
    field: str  # the Settings field
    flag: str
    parse: Callable[[str], Any]
    replaces: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # fields set along with it


KEYS: dict[str, Key] = {key.name: key for key in (
    Key("scheduler", "scheduler", "--scheduler", parse_scheduler),
    Key("agingDivisor", "aging_divisor_s", "--aging-divisor", parse_aging_divisor),
    Key("swapAffinityBonus", "swap_affinity_bonus", "--swap-affinity-bonus", parse_bonus),
    Key("maxQueued", "max_queued", "--max-queued", parse_max_queued),
    Key("maxWaitSeconds", "max_wait_s", "--max-wait", parse_max_wait),
    # A flag's or a sweep's slots are every model's.
    Key("slots", "slots", "--slots", parse_slots, {"model_slots": {}, "configured": (), "recorded_slots": {}}),
    Key("reservedSlots", "reserved_slots", "--reserved-slots", parse_reserved_slots),
    # A flag's or a sweep's GPUs are gpu0..gpuN-1, whatever the log or -c named them.
    Key("gpus", "gpus", "--gpus", parse_gpus, {"named_gpus": (), "configured": (), "recorded_residency": {},
                                               "recorded_slots": {}}),
    # A flag's or a sweep's maxLoaded is every GPU's.
    Key("maxLoaded", "max_loaded", "--max-loaded", parse_max_loaded, {"max_loaded_everywhere": True}),
    Key("preempt", "preempt", "--preempt", parse_preempt),
    Key("minRun", "min_run_s", "--min-run", parse_min_run),
    # A flag's or a sweep's idle time is every GPU's upstream.idleUnloadSeconds.
    Key("idleUnload", "idle_unload_s", "--idle-unload", parse_idle_unload, {"idle_unload_everywhere": True}),
)}
# Shown in a report only where some row stops lines or one of them is swept (`shown_keys`): a
# replay without stopping reads as it did before stopping existed.
STOPPING_KEYS = frozenset({"preempt", "minRun"})
# The same for idle unloads: shown where some row unloads idle models or the key is swept.
IDLE_KEYS = frozenset({"idleUnload"})


def stopping(settings: Iterable[Settings], swept: Iterable[str] = ()) -> bool:
    """Whether some row stops lines, or a stopping key is swept."""
    return any(setting.preempt for setting in settings) or not STOPPING_KEYS.isdisjoint(swept)


def idling(settings: Iterable[Settings], swept: Iterable[str] = ()) -> bool:
    """Whether some row unloads idle models, or the idle time is swept."""
    return any(setting.idles for setting in settings) or not IDLE_KEYS.isdisjoint(swept)


def hidden_keys(settings: Sequence[Settings], swept: Sequence[str]) -> frozenset[str]:
    """The keys a report leaves out: those of what no row does and no sweep asks about."""
    return ((frozenset() if stopping(settings, swept) else STOPPING_KEYS)
            | (frozenset() if idling(settings, swept) else IDLE_KEYS))


def shown_keys(settings: Sequence[Settings], swept: Sequence[str]) -> list[str]:
    """The keys a report shows, in KEYS order."""
    hidden = hidden_keys(settings, swept)
    return [name for name in KEYS if name not in hidden]


@dataclasses.dataclass(frozen=True, slots=True)
class Sweep:
    key: Key
    values: tuple[Any, ...]


def parse_sweep(text: str) -> Sweep:
    """``KEY=V1,V2,...``; the message names the offending part."""
    name, sep, rest = text.partition("=")
    name = name.strip()
    if not sep or not name:
        raise SettingsError(f"--sweep {text!r}: expected KEY=V1,V2,... (keys: {', '.join(KEYS)})")
    key = KEYS.get(name)
    if key is None:
        close = difflib.get_close_matches(name, list(KEYS), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else f" (keys: {', '.join(KEYS)})"
        raise SettingsError(f"--sweep {text!r}: unknown key {name!r}{hint}")
    parts = [part.strip() for part in rest.split(",")]
    if not any(parts) or not all(parts):
        raise SettingsError(f"--sweep {text!r}: expected a comma-separated list of values after '='")
    values = []
    for part in parts:
        try:
            values.append(key.parse(part))
        except SettingsError as exc:
            raise SettingsError(f"--sweep {name}={part}: {exc}") from None
    return Sweep(key, tuple(values))


def combinations(base: Settings, sweeps: Sequence[Sweep]) -> list[Settings]:
    """Every combination of the swept values (the cartesian product), in the order given."""
    seen: set[str] = set()
    for sweep in sweeps:
        if sweep.key.name in seen:
            raise SettingsError(f"--sweep {sweep.key.name} is given twice; list all its values in one --sweep")
        seen.add(sweep.key.name)
    if not sweeps:
        return [base]
    return [dataclasses.replace(base, **_changes((s.key, v) for s, v in zip(sweeps, combo)))
            for combo in itertools.product(*(s.values for s in sweeps))]


def _changes(pairs: Iterable[tuple[Key, Any]]) -> dict[str, Any]:
    changes: dict[str, Any] = {}
    for key, value in pairs:
        changes |= dict(key.replaces)
        changes[key.field] = value
    return changes


def fit_reserved(settings: Sequence[Settings], *, explicit: bool) -> tuple[list[Settings], str | None]:
    """Each combination with a reservedSlots below its slots. An explicit one (a flag or a sweep)
    that is not is refused; one from the record or -c is lowered, and the note says where."""
    fitted: list[Settings] = []
    lowered: list[int] = []
    for setting in settings:
        fewest = setting.fewest_slots
        if setting.reserved_slots < fewest:
            fitted.append(setting)
        elif explicit:
            raise SettingsError(f"reservedSlots {setting.reserved_slots} with slots {fewest} leaves no slot for "
                                "non-interactive requests: reserve fewer than the slots of every combination")
        else:
            fitted.append(dataclasses.replace(setting, reserved_slots=fewest - 1))
            if fewest not in lowered:
                lowered.append(fewest)
    note = None
    if lowered:
        reserved = settings[0].reserved_slots
        where = ", ".join(f"{fewest - 1} at slots {fewest}" for fewest in lowered)
        note = f"reservedSlots {reserved} (recorded or -c) is lowered to fit: {where}"
    return fitted, note


def override(base: Settings, flags: Mapping[str, str | None]) -> Settings:
    """Apply the single flags given (keyed by KEYS names; None = not given)."""
    pairs = []
    for name, text in flags.items():
        if text is None:
            continue
        key = KEYS[name]
        try:
            pairs.append((key, key.parse(text)))
        except SettingsError as exc:
            raise SettingsError(f"{key.flag} {text}: {exc}") from None
    return dataclasses.replace(base, **_changes(pairs))
