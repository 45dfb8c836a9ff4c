"""Argument types and options the commands share."""

from __future__ import annotations

import argparse

from llamaswap.runtime.coordinator import GRACE_SECONDS_DEFAULT


def _seconds(text: str) -> float:
    try:
        return float(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from exc


def non_negative_seconds(text: str) -> float:
    value = _seconds(text)
    if value < 0:
        raise argparse.ArgumentTypeError("must be 0 or more seconds")
    return value


def positive_seconds(text: str) -> float:
    value = _seconds(text)
    if not value > 0:
        raise argparse.ArgumentTypeError("needs a positive number of seconds")
    return value


def add_stop_options(parser: argparse.ArgumentParser, *, stopping: str, activity_note: str) -> None:
    """--grace and --activity-log, which `up` and `serve` both take."""
    parser.add_argument("--grace", type=non_negative_seconds, default=GRACE_SECONDS_DEFAULT,
                        help=f"seconds the running request may take to finish {stopping} "
                             f"(default {GRACE_SECONDS_DEFAULT:g})")
    parser.add_argument("--activity-log", metavar="FILE",
                        help=f"append the activity log's JSON lines to FILE ({activity_note}overrides activity.path)")
