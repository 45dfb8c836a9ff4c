"""The X-LlamaSwap-Priority header: parsing, aliases and bands."""

from __future__ import annotations

import dataclasses
import enum
import re

HEADER = "x-llamaswap-priority"

ALIASES: dict[str, int] = {"interactive": 100, "normal": 0, "batch": -100}

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


BAND_NAMES: tuple[str, ...] = tuple(band.value for band in Band)

INTERACTIVE_FLOOR = 50
BATCH_CEILING = -50


def band_of(priority: int) -> Band:
    if priority >= INTERACTIVE_FLOOR:
        return Band.INTERACTIVE
    if priority <= BATCH_CEILING:
        return Band.BATCH
    return Band.NORMAL


class PrioritySource(str, enum.Enum):
    """Where a priority value came from, so telemetry can count bad headers."""

    NUMBER = "number"
    ALIAS = "alias"
    ABSENT = "absent"
    UNPARSEABLE = "unparseable"

    def __str__(self) -> str:
        return self.value


@dataclasses.dataclass(frozen=True, slots=True)
class Priority:
    value: int
    source: PrioritySource

    @property
    def band(self) -> Band:
        return band_of(self.value)

    @property
    def unparseable(self) -> bool:
        return self.source is PrioritySource.UNPARSEABLE


DEFAULT = Priority(0, PrioritySource.ABSENT)


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
    alias = ALIASES.get(text.lower())
    if alias is not None:
        return Priority(alias, PrioritySource.ALIAS)
    if len(text) > _MAX_DIGITS or not _INTEGER.fullmatch(text):
        return Priority(0, PrioritySource.UNPARSEABLE)
    value = int(text)
    if not INT64_MIN <= value <= INT64_MAX:
        return Priority(0, PrioritySource.UNPARSEABLE)
    return Priority(value, PrioritySource.NUMBER)
