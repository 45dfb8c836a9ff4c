"""`decisions.built_by_assignment`: the grant's, the release's and the arrival's values built by
plain assignment are the frozen values their classes build, whatever the fields."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from llamaswap.core.decisions import (
    Decision, Queued, Released, ReorderCause, new_decision, new_queued, new_released,
)
from llamaswap.core.priority import Band
from llamaswap.runtime.ticket import Arrival, ExchangeEnd, ExchangeReport, new_arrival, new_exchange_report

FIELDS = ("r1", 100, Band.INTERACTIVE, 112.5, 5, 9, "m", True, 2.5, False, True, frozenset({"old"}),
          frozenset({ReorderCause.AGING}), ("r0",), 3, 2, True, False, "gpu1", ("m", 9), 64, ())


def test_a_decision_built_by_assignment_is_the_one_its_class_builds() -> None:
    built, reference = new_decision(*FIELDS), Decision(*FIELDS)
    assert type(built) is Decision
    assert built == reference and hash(built) == hash(reference) and repr(built) == repr(reference)
    assert dataclasses.astuple(built) == dataclasses.astuple(reference)
    assert pickle.loads(pickle.dumps(built)) == reference
    assert dataclasses.replace(built, ready_at=None) == dataclasses.replace(reference, ready_at=None)


def test_a_value_built_by_assignment_stays_frozen() -> None:
    built = new_decision(*FIELDS)
    with pytest.raises(dataclasses.FrozenInstanceError):
        built.model = "other"  # type: ignore[misc]
    assert built.model == "m"


@pytest.mark.parametrize(("build", "cls", "fields"), [
    (new_queued, Queued, (4, 17, None)),
    (new_released, Released, ("r1", None, 5, 8)),
    (new_exchange_report, ExchangeReport, (True, ExchangeEnd.COMPLETE, 200, 0.25, 1.5, "gpu1")),
    (new_arrival, Arrival, ("r1", "interactive", None, "m", "ipv4:1", "00-ab-cd-01", None, "POST", "/v1/x", 16,
                            True, False, False, "obj", "flex", None, 2, 300.0, None)),
])
def test_the_arrival_and_the_release_the_same(build, cls, fields) -> None:  # type: ignore[no-untyped-def]
    assert type(build(*fields)) is cls and build(*fields) == cls(*fields)


def test_every_field_must_be_given() -> None:
    with pytest.raises(TypeError):
        new_decision(*FIELDS[:-1])
