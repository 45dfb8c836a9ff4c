"""What the scheduler settings mean in waiting time, for `llamaswap check-config`.

Aging adds ``waited_seconds / agingDivisor`` to a waiting request's score, so a request of
priority L that has waited ``w`` seconds ties a fresh request of priority H when
``L + w / D = H``, that is after ``(H - L) * D`` seconds; on a tie the earlier arrival goes
first, so from then on it overtakes. Swap affinity can hold it back: when the fresh request's
model is loaded and the old one's is not, the fresh one has the bonus B, and the old one needs
``(H - L + B) * D`` seconds (the worst case). The anchors are the bands' own values (batch -100,
normal 0, interactive 100); per-tier offsets move these times by a minute or two at most.

With more than one slot, a line says how many generations of the loaded model run at once and
who may use the reserved ones; with one slot (the default) nothing is added.

Pure: a Policy in, numbers and text out.
"""

from __future__ import annotations

import dataclasses
import math

from llamaswap.core.priority import ALIASES, INTERACTIVE_FLOOR, Band
from llamaswap.core.policy import Policy, PolicyName
from llamaswap.core.slots import Slots

ANCHORS: dict[Band, int] = {Band(name): value for name, value in ALIASES.items()}
# Lowest first: a band can only need to overtake the bands after it.
_ASCENDING: tuple[Band, ...] = tuple(sorted(ANCHORS, key=ANCHORS.__getitem__))

_UNITS: tuple[tuple[str, int], ...] = (("d", 86_400), ("h", 3_600), ("min", 60), ("s", 1))


@dataclasses.dataclass(frozen=True, slots=True)
class Overtake:
    """How long a waiting request of ``band`` waits before it goes ahead of fresh ``over_band``
    traffic: ``seconds`` when neither has the loaded model (or both), ``seconds_worst`` when the
    fresh one has it. ``math.inf`` when it never does (no aging)."""

    band: Band
    over_band: Band
    seconds: float
    seconds_worst: float


def overtake_times(policy: Policy) -> list[Overtake]:
    """One entry per pair of bands (lower, higher), lowest pairs first."""
    aging = policy.name is PolicyName.SERIAL and policy.aging_divisor_ns > 0
    bonus = policy.swap_affinity_bonus if policy.name is PolicyName.SERIAL else 0
    times = []
    for i, low in enumerate(_ASCENDING):
        for high in _ASCENDING[i + 1:]:
            gap = ANCHORS[high] - ANCHORS[low]
            if aging:
                times.append(Overtake(low, high, gap * policy.aging_divisor_s, (gap + bonus) * policy.aging_divisor_s))
            else:
                times.append(Overtake(low, high, math.inf, math.inf))
    return times


def format_duration(seconds: float) -> str:
    """The two largest units that are not zero: "1 h 40 min", "45 s", "2 d 3 h", "0.5 s"."""
    if math.isinf(seconds):
        return "never"
    if seconds < 60:
        text = f"{seconds:.3g}"
        return f"{text} s"
    total = round(seconds)
    parts: list[tuple[int, str]] = []
    for name, size in _UNITS:
        count, total = divmod(total, size)
        if count or parts:
            parts.append((count, name))
    # The largest unit and the next one, if that one is not zero.
    shown = [parts[0]] + ([parts[1]] if len(parts) > 1 and parts[1][0] else [])
    return " ".join(f"{count} {name}" for count, name in shown)


def explain_policy(policy: Policy) -> list[str]:
    """Lines of text saying how long each band waits before it overtakes each higher band."""
    if policy.name is PolicyName.FIFO:
        lines = ["fifo scheduler: no aging and no swap affinity; requests go by priority (the header "
                 "plus the model's configured priority), then by arrival, so a lower band never "
                 "overtakes a higher one and can starve while higher-priority traffic keeps arriving"]
        if policy.model_priorities:
            listed = ", ".join(f"{model} {value:+d}" for model, value in sorted(policy.model_priorities.items()))
            lines.append(f"model priorities: {listed} (other models 0)")
        else:
            lines.append("model priorities: none configured (every model at 0)")
        return lines + _slots_lines(policy) + _max_wait_lines(policy, [])
    bonus = policy.swap_affinity_bonus
    if policy.aging_divisor_ns <= 0:
        return [f"serial scheduler: agingDivisor 0 (aging off), swapAffinityBonus {bonus}",
                "lower bands never overtake higher ones: batch and normal requests can starve while "
                "higher-priority traffic keeps arriving"] + _slots_lines(policy) + _max_wait_lines(policy, [])
    divisor = policy.aging_divisor_s
    lines = [f"serial scheduler: agingDivisor {divisor:g} (one priority point per {format_duration(divisor)} "
             f"of waiting), swapAffinityBonus {bonus}"]
    times = overtake_times(policy)
    for item in times:
        text = (f"{item.band} ({ANCHORS[item.band]}) overtakes fresh {item.over_band} ({ANCHORS[item.over_band]}) "
                f"traffic after {format_duration(item.seconds)} of waiting")
        if bonus:
            text += f" ({format_duration(item.seconds_worst)} when the fresh one has the loaded model)"
        lines.append(text)
    return lines + _slots_lines(policy) + _max_wait_lines(policy, times)


def _slots_lines(policy: Policy) -> list[str]:
    """What the slots allow, for every GPU at once where they all have the same, else per GPU;
    nothing with one slot for every model (the default)."""
    first = policy.gpus[0].slots
    if all(gpu.slots == first for gpu in policy.gpus):
        return _gpu_slots_lines(first, "")
    return [line for gpu in policy.gpus for line in _gpu_slots_lines(gpu.slots, f"{gpu.name}: ")]


def _gpu_slots_lines(slots: Slots, prefix: str) -> list[str]:
    if slots.single:
        return []
    if slots.per_model:
        listed = "".join(f"{model} {count}, " for model, count in sorted(slots.per_model.items()))
        counts = f"{listed}other models {slots.default}"
    else:
        counts = str(slots.default)
    lines = [f"{prefix}slots: generations of the loaded model at once: {counts}; a swap waits until every slot is "
             "idle"]
    if slots.reserved:
        lines.append(f"{prefix}reservedSlots {slots.reserved}: requests below priority {INTERACTIVE_FLOOR} use at "
                     f"most a model's slots minus {slots.reserved}; the other {slots.reserved} go only to "
                     "interactive requests")
    return lines


def _max_wait_lines(policy: Policy, times: list[Overtake]) -> list[str]:
    """A maxWaitSeconds shorter than an overtake time means that overtake never happens."""
    if policy.max_wait_ns <= 0:
        return []
    limit = policy.max_wait_s
    cut = [t for t in times if t.seconds_worst >= limit]
    text = f"maxWaitSeconds {limit:g}: a request that has waited {format_duration(limit)} is refused"
    if cut:
        pairs = ", ".join(f"{t.band} over {t.over_band}" for t in cut)
        text += f", so it can be refused before it overtakes ({pairs})"
    return [text]
