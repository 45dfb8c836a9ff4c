"""What the serial settings mean in waiting time (for `llamaswap check-config`)."""

from __future__ import annotations

import math

import pytest

from llamaswap.core import Band, Policy, Slots
from llamaswap.core.explain import Overtake, explain_policy, format_duration, overtake_times


def test_overtake_times_at_the_default_divisor():
    times = overtake_times(Policy.serial(aging_divisor_s=60, swap_affinity_bonus=10))
    assert times == [
        Overtake(Band.BATCH, Band.NORMAL, 6000.0, 6600.0),  # 100 points x 60 s; +10 for the bonus
        Overtake(Band.BATCH, Band.INTERACTIVE, 12000.0, 12600.0),
        Overtake(Band.NORMAL, Band.INTERACTIVE, 6000.0, 6600.0),
    ]


def test_the_default_divisor_in_words():
    lines = explain_policy(Policy.serial(aging_divisor_s=60, swap_affinity_bonus=10))
    assert lines[0] == ("serial scheduler: agingDivisor 60 (one priority point per 1 min of waiting), "
                        "swapAffinityBonus 10")
    assert lines[1] == ("batch (-100) overtakes fresh normal (0) traffic after 1 h 40 min of waiting "
                        "(1 h 50 min when the fresh one has the loaded model)")
    assert lines[2] == ("batch (-100) overtakes fresh interactive (100) traffic after 3 h 20 min of waiting "
                        "(3 h 30 min when the fresh one has the loaded model)")
    assert lines[3] == ("normal (0) overtakes fresh interactive (100) traffic after 1 h 40 min of waiting "
                        "(1 h 50 min when the fresh one has the loaded model)")
    assert len(lines) == 4


def test_without_the_bonus_there_is_no_worse_case():
    times = overtake_times(Policy.serial(aging_divisor_s=1.5, swap_affinity_bonus=0))
    assert [(t.seconds, t.seconds_worst) for t in times] == [(150.0, 150.0), (300.0, 300.0), (150.0, 150.0)]
    lines = explain_policy(Policy.serial(aging_divisor_s=1.5, swap_affinity_bonus=0))
    assert lines[1] == "batch (-100) overtakes fresh normal (0) traffic after 2 min 30 s of waiting"
    assert "loaded model" not in "\n".join(lines)


def test_divisor_zero_means_starvation():
    policy = Policy.serial(aging_divisor_s=0, swap_affinity_bonus=10)
    assert all(t.seconds == math.inf and t.seconds_worst == math.inf for t in overtake_times(policy))
    assert len(overtake_times(policy)) == 3
    assert explain_policy(policy) == [
        "serial scheduler: agingDivisor 0 (aging off), swapAffinityBonus 10",
        "lower bands never overtake higher ones: batch and normal requests can starve while "
        "higher-priority traffic keeps arriving",
    ]


def test_fifo_has_no_aging_and_names_the_model_priorities():
    lines = explain_policy(Policy.fifo(model_priorities={"qwen3": 10, "gemma3": -5}))
    assert lines[0].startswith("fifo scheduler: no aging and no swap affinity;")
    assert "can starve" in lines[0]
    assert lines[1] == "model priorities: gemma3 -5, qwen3 +10 (other models 0)"
    assert explain_policy(Policy.fifo(model_priorities={}))[1] == "model priorities: none configured (every model at 0)"
    assert all(t.seconds == math.inf for t in overtake_times(Policy.fifo(model_priorities={})))


def test_a_max_wait_shorter_than_an_overtake_is_pointed_out():
    lines = explain_policy(Policy.serial(aging_divisor_s=60, swap_affinity_bonus=10, max_wait_s=7200))
    assert lines[-1] == ("maxWaitSeconds 7200: a request that has waited 2 h is refused, so it can be refused "
                         "before it overtakes (batch over interactive)")
    # 6600 s (1 h 50 min, the worst case over normal) is under 2 h: only the 3 h 20 min one is cut.


@pytest.mark.parametrize("seconds, text", [
    (45, "45 s"), (0.5, "0.5 s"), (6000, "1 h 40 min"), (6600, "1 h 50 min"), (12000, "3 h 20 min"),
    (3600, "1 h"), (90, "1 min 30 s"), (183_600, "2 d 3 h"), (172_800, "2 d"), (86_460, "1 d"),
    (math.inf, "never"),
])
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text


def test_slots_are_explained_only_when_there_is_more_than_one():
    one = explain_policy(Policy.serial(aging_divisor_s=60, swap_affinity_bonus=10, slots=Slots(1, {"a": 1})))
    assert one == explain_policy(Policy.serial(aging_divisor_s=60, swap_affinity_bonus=10))
    four = explain_policy(Policy.serial(aging_divisor_s=60, swap_affinity_bonus=10, max_wait_s=600, slots=Slots(4)))
    assert four[-2:] == [
        "slots: generations of the loaded model at once: 4; a swap waits until every slot is idle",
        "maxWaitSeconds 600: a request that has waited 10 min is refused, so it can be refused before it "
        "overtakes (batch over normal, batch over interactive, normal over interactive)",
    ]
    lines = explain_policy(Policy.fifo(model_priorities={}, slots=Slots(2, {"qwen3": 4, "gemma3": 3}, reserved=1)))
    assert lines[-2:] == [
        "slots: generations of the loaded model at once: gemma3 3, qwen3 4, other models 2; a swap waits until "
        "every slot is idle",
        "reservedSlots 1: requests below priority 50 use at most a model's slots minus 1; the other 1 go only to "
        "interactive requests",
    ]
