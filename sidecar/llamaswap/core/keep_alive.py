"""Ollama's `keep_alive` (issue 48): how long a request asks its model to stay loaded once idle,
and the bounds the operator sets on it (`routing.keepAlive`).

A request's value is a JSON number of seconds or a string: a Go duration as Ollama reads it
("10m", "1h30m", "1.5s", "0") or, as Ollama's OLLAMA_KEEP_ALIVE also takes it, a bare number of
seconds ("300"). 0 unloads the model as soon as nothing runs or waits for it; a negative value
keeps it (for ever, or as long as ``maxSeconds`` allows). `parse_keep_alive` reads one
(`KeepAliveError` for anything else); `KeepAlive` bounds it.

Pure: values in, values out. Which request's value counts, and from when: `core/idle.py`.
"""

from __future__ import annotations

import dataclasses
import math
import re

from llamaswap.core.clock import NS_PER_S

# Go's time.ParseDuration units, in seconds (both spellings of micro that Go accepts).
_UNIT_S = {"ns": 1e-9, "us": 1e-6, "\u00b5s": 1e-6, "\u03bcs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_PART = re.compile(r"(\d+\.?\d*|\.\d+)([^\d.]+)")
_SECONDS = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)")
# A value longer than this is not a duration (the adapter reads it from a request body).
MAX_DURATION_TEXT = 64
# A request's "keep it": for ever, unless the operator bounds it (`KeepAlive.max_s`).
FOR_EVER = math.inf


class KeepAliveError(ValueError):
    """A keep_alive that is neither a number of seconds nor a duration."""


def parse_keep_alive(value: str | float) -> float:
    """A request's keep_alive in seconds: >= 0, or `FOR_EVER` for a negative one (keep)."""
    if isinstance(value, bool):
        raise KeepAliveError(f"keep_alive must be a duration such as \"5m\" or a number of seconds, not {value!r}")
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        seconds = _duration_s(value)
    if math.isnan(seconds):
        raise KeepAliveError("keep_alive must be a number of seconds, not NaN")
    return FOR_EVER if seconds < 0 else seconds


def _duration_s(text: str) -> float:
    if len(text) > MAX_DURATION_TEXT:
        raise KeepAliveError(f"keep_alive is not a duration: {len(text)} characters")
    if _SECONDS.fullmatch(text):  # "300", "-1": seconds
        return float(text)
    sign, rest = (-1.0, text[1:]) if text.startswith("-") else (1.0, text.removeprefix("+"))
    total = 0.0
    position = 0
    for part in _PART.finditer(rest):
        unit = _UNIT_S.get(part.group(2))
        if part.start() != position or unit is None:
            break
        total += float(part.group(1)) * unit
        position = part.end()
    else:
        if rest and position == len(rest):
            return sign * total
    raise KeepAliveError(f"keep_alive {text!r} is not a duration: write a number and a unit (h, m, s, ms), "
                         f"such as \"10m\" or \"1h30m\", or a number of seconds")


@dataclasses.dataclass(frozen=True, slots=True)
class KeepAlive:
    """What the operator lets a request's keep_alive do (`routing.keepAlive`): nothing unless
    ``honour``; at most ``max_s`` seconds (None: no bound), a negative keep_alive included."""

    honour: bool = False
    max_s: float | None = None

    def after_ns(self, requested_s: float) -> int | None:
        """How long a model may sit idle after a request that asked ``requested_s`` (as
        `parse_keep_alive` reads it), in nanoseconds: 0 at once; None: never unloaded for idleness."""
        seconds = requested_s if self.max_s is None else min(requested_s, self.max_s)
        return None if math.isinf(seconds) else round(seconds * NS_PER_S)


IGNORED = KeepAlive()
