"""The X-LlamaSwap-Priority header: parsing, aliases and bands; what stands in for a missing header."""

from __future__ import annotations

import dataclasses
import enum
import re
from collections.abc import Mapping

HEADER = "x-llamaswap-priority"
# The InferenceObjective a request names for llm-d's router (the InferencePool's endpoint
# picker); `routing.objectives` maps it to a priority when the request sends no HEADER.
OBJECTIVE_HEADER = "x-llm-d-inference-objective"
# Its earlier name, which the router still reads when the new one is absent.
OLD_OBJECTIVE_HEADER = "x-gateway-inference-objective"

ALIASES: dict[str, int] = {"interactive": 100, "normal": 0, "batch": -100}

# The OpenAI request body's `service_tier`, for a request without HEADER (or an objective): each
# tier's priority. Exactly these strings (the API's own values); any other value is ignored.
SERVICE_TIERS: dict[str, int] = {"flex": ALIASES["batch"], "default": ALIASES["normal"],
                                 "auto": ALIASES["normal"], "priority": ALIASES["interactive"]}

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1

# ASCII digits only: Python's int() would also accept "1_000" and non-ASCII digits.
_INTEGER = re.compile(r"[+-]?[0-9]+")
# Longest text that can still be an int64 (sign + 19 digits, leading zeros aside); longer
# input is checked cheaply before int() so a megabyte of digits costs nothing.
_MAX_DIGITS = 40


class Band(str, enum.Enum):
    """Which anchor a priority is nearest to: >= 50 interactive, <= -50 batch."""

    INTERACTIVE = "interactive"
    NORMAL = "normal"
    BATCH = "batch"

    def __str__(self) -> str:
        return self.value

    @property
    def interactive(self) -> bool:
        """The band the reserved slots are kept for: the one test of "interactive" (a value is
        in it when `band_of` says so)."""
        return self is _INTERACTIVE  # (a global: a member read through its class costs 70 ns, `dispatch._IDLE`)


_INTERACTIVE, _NORMAL, _BATCH = Band.INTERACTIVE, Band.NORMAL, Band.BATCH


BAND_NAMES: tuple[str, ...] = tuple(band.value for band in Band)

INTERACTIVE_FLOOR = 50
BATCH_CEILING = -50


def band_of(priority: int) -> Band:
    if priority >= INTERACTIVE_FLOOR:
        return _INTERACTIVE
    if priority <= BATCH_CEILING:
        return _BATCH
    return _NORMAL


class PrioritySource(str, enum.Enum):
    """Where a priority value came from, so telemetry can count bad headers."""

    NUMBER = "number"
    ALIAS = "alias"
    ABSENT = "absent"
    UNPARSEABLE = "unparseable"
    CLAMPED = "clamped"  # the operator's policy moved it into the allowed range
    STRIPPED = "stripped"  # the operator's policy ignores callers' priorities
    TRUSTED = "trusted"  # from the operator's trusted header (set by an authenticating proxy)
    OBJECTIVE = "objective"  # no header: the priority of the InferenceObjective the request named
    SERVICE_TIER = "service_tier"  # no header nor objective: the body's OpenAI `service_tier`

    def __str__(self) -> str:
        return self.value


@dataclasses.dataclass(frozen=True, slots=True)
class Priority:
    value: int
    source: PrioritySource
    band: Band = dataclasses.field(init=False, compare=False)

    def __post_init__(self) -> None:
        # Computed once: the scheduler reads the band several times per request.
        object.__setattr__(self, "band", band_of(self.value))

    @property
    def unparseable(self) -> bool:
        return self.source is PrioritySource.UNPARSEABLE


DEFAULT = Priority(0, PrioritySource.ABSENT)
# Each alias's priority, built once: a Priority is frozen, so one value serves every request that
# names the alias (a frozen dataclass's construction is most of a parse: 0.8 us against 0.2).
_ALIASED: dict[str, Priority] = {name: Priority(value, PrioritySource.ALIAS) for name, value in ALIASES.items()}


def parse_priority(raw: str | bytes | None) -> Priority:
    """Resolve a header value; absent, empty or unparseable means 0 (never an error).

    Values are signed 64-bit integers and are not clamped; the caller is trusted.
    """
    if raw is None:
        return DEFAULT
    if isinstance(raw, bytes):
        try:
            raw = raw.decode("ascii")
        except UnicodeDecodeError:
            return Priority(0, PrioritySource.UNPARSEABLE)
    text = raw.strip()
    if not text:
        return DEFAULT
    aliased = _ALIASED.get(text.lower())
    if aliased is not None:
        return aliased
    if len(text) > _MAX_DIGITS or not _INTEGER.fullmatch(text):
        return Priority(0, PrioritySource.UNPARSEABLE)
    value = int(text)
    if not INT64_MIN <= value <= INT64_MAX:
        return Priority(0, PrioritySource.UNPARSEABLE)
    return Priority(value, PrioritySource.NUMBER)


class PriorityMode(str, enum.Enum):
    """What the operator does with the caller's X-LlamaSwap-Priority."""

    TRUST = "trust"  # take it as it is (the specification's default)
    CLAMP = "clamp"  # keep it inside [minimum, maximum]
    STRIP = "strip"  # ignore it: everyone gets 0

    def __str__(self) -> str:
        return self.value


# As module globals, for `resolve` (each Check): a member read through its class costs 70 ns
# (`Band.interactive`'s note), a global 10.
_ABSENT, _NUMBER, _ALIAS = PrioritySource.ABSENT, PrioritySource.NUMBER, PrioritySource.ALIAS
_STRIP, _CLAMP = PriorityMode.STRIP, PriorityMode.CLAMP

# What a caller claimed (the header, an objective, a service tier): what `strip` ignores.
_CLAIMED = frozenset({PrioritySource.NUMBER, PrioritySource.ALIAS, PrioritySource.OBJECTIVE,
                      PrioritySource.SERVICE_TIER})


@dataclasses.dataclass(frozen=True, slots=True)
class PriorityPolicy:
    """What the operator lets callers claim (built from `security.priority`; defaults live there).

    A ``trusted_header`` (set by an authenticating proxy, which must drop client copies)
    overrides the mode: its value is taken as the priority, unclamped. A request without the
    header that names an objective in ``objectives`` gets that priority; else one whose body
    names an OpenAI ``service_tier`` (SERVICE_TIERS) gets that tier's. The caller chose either, so
    the mode applies to them as to the header. A header that is sent wins, even an unparseable one
    (its 0 is counted as the caller's mistake); an empty one is no header.
    """

    mode: PriorityMode
    minimum: int
    maximum: int
    trusted_header: str | None
    objectives: Mapping[str, int] = dataclasses.field(default_factory=dict)

    def resolve(self, header: str | bytes | None, trusted: str | bytes | None = None,
                objective: str | None = None, service_tier: str | None = None) -> Priority:
        if self.trusted_header is not None and trusted is not None:
            granted = parse_priority(trusted)
            if granted.source is _NUMBER or granted.source is _ALIAS:
                return Priority(granted.value, PrioritySource.TRUSTED)
        priority = parse_priority(header)
        if priority.source is _ABSENT and objective is not None:
            named = self.objectives.get(objective.strip())
            if named is not None:
                priority = Priority(named, PrioritySource.OBJECTIVE)
        if priority.source is _ABSENT and service_tier is not None:
            tier = SERVICE_TIERS.get(service_tier)
            if tier is not None:
                priority = Priority(tier, PrioritySource.SERVICE_TIER)
        mode = self.mode
        if mode is _STRIP and priority.source in _CLAIMED:
            return Priority(0, PrioritySource.STRIPPED)
        if mode is _CLAMP and not self.minimum <= priority.value <= self.maximum:
            return Priority(min(max(priority.value, self.minimum), self.maximum), PrioritySource.CLAMPED)
        return priority
