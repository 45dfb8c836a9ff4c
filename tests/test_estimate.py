"""Expected run and swap times per model, and estimated starts along the dispatch order."""

from __future__ import annotations

import pytest

from llamaswap.core import Estimator


def make(**kwargs: float) -> Estimator:
    return Estimator(default_run_s=kwargs.get("run", 10.0), default_swap_s=kwargs.get("swap", 5.0),
                     samples=int(kwargs.get("samples", 5)))


def test_defaults_before_any_measurement():
    e = make(run=12.0, swap=3.0)
    assert e.expected_run_s("a") == 12.0
    assert e.expected_swap_s("a") == 3.0
    assert e.expected_run_s(None) == 12.0


def test_run_is_a_rolling_median_of_warm_runs():
    e = make(samples=3)
    for run in (1.0, 100.0, 2.0):  # one runaway generation does not move the median far
        e.record("a", run_s=run, first_byte_s=0.1, model_load=False)
    assert e.expected_run_s("a") == 2.0
    for run in (4.0, 4.0, 4.0):  # only the last 3 count
        e.record("a", run_s=run, first_byte_s=0.1, model_load=False)
    assert e.expected_run_s("a") == 4.0
    assert e.expected_run_s("b") == 10.0  # other models keep the default


def test_swap_cost_is_the_extra_time_to_first_byte_of_a_load():
    e = make()
    e.record("a", run_s=2.0, first_byte_s=0.2, model_load=False)
    e.record("a", run_s=4.0, first_byte_s=2.7, model_load=True)
    assert e.expected_swap_s("a") == pytest.approx(2.5)
    # The run learnt from a load is the run without its load.
    e2 = make(swap=1.0)
    e2.record("b", run_s=5.0, first_byte_s=None, model_load=True)
    assert e2.expected_run_s("b") == pytest.approx(4.0)


def test_swap_cost_never_negative():
    e = make()
    e.record("a", run_s=1.0, first_byte_s=1.0, model_load=False)
    e.record("a", run_s=1.0, first_byte_s=0.5, model_load=True)
    assert e.expected_swap_s("a") == 0.0


def test_starts_walk_the_order_adding_runs_and_swaps():
    e = make(run=10.0, swap=5.0)
    e.record("a", run_s=2.0, first_byte_s=None, model_load=False)
    e.record("b", run_s=3.0, first_byte_s=None, model_load=False)
    starts = e.starts(["a", "a", "b", None, "a"], loaded="a", busy_s=1.5)
    # a (loaded): 1.5; a: +2; b: +2 -> 5.5, then swap 5 + run 3; None: +10 (default, no swap); a: swap again
    assert starts == [1.5, 3.5, 5.5, 13.5, 23.5]


def test_remaining_of_a_running_grant():
    e = make(run=10.0, swap=5.0)
    assert e.remaining_s("a", model_load=False, running_s=4.0) == 6.0
    assert e.remaining_s("a", model_load=True, running_s=4.0) == 11.0
    assert e.remaining_s("a", model_load=False, running_s=40.0) == 0.0


def test_samples_must_be_positive():
    with pytest.raises(ValueError):
        Estimator(default_run_s=1.0, default_swap_s=1.0, samples=0)
