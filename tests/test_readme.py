"""The README's promises that can drift: its configuration block is the code's defaults, its
metric table names every metric, and its outcome table every refusal."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from llamaswap.config import Config
from llamaswap.core import Outcome
from llamaswap.telemetry import instruments
from llamaswap.adapters.outcomes import REFUSALS

README = Path(__file__).resolve().parent.parent / "README.md"


def section(title: str) -> str:
    text = README.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else None]


def test_the_configuration_block_is_the_defaults():
    block = re.search(r"```yaml\n(.*?)```", section("Configuration"), re.S)
    assert block is not None
    assert yaml.safe_load(block.group(1)) == Config().to_document()


def test_every_metric_is_documented():
    metrics = section("Reading the metrics, traces, estimates, activity log and queue")
    documented = set(re.findall(r"`(llamaswap_[a-z_]+)", metrics))
    # Shared prefixes are written once: `llamaswap_scheduler_swaps_total` / `_loads_total`.
    for short in re.findall(r"/ `(_[a-z_]+)`|, `(_[a-z_]+)`", metrics):
        documented.update(short)
    for name in instruments.ALL:
        assert name in documented or any(name.endswith(s) for s in documented if s.startswith("_")), name


def test_every_outcome_is_named_and_every_refusal_tabled():
    text = section("Reading the metrics, traces, estimates, activity log and queue")
    for outcome in Outcome:
        assert f"`{outcome.value}`" in text, outcome
    architecture = section("Architecture")
    for outcome, error in REFUSALS.items():
        if outcome is Outcome.CANCELLED_WAITING:
            continue  # never seen by a client
        assert f"| `{outcome.value}` | {error.status} | `{error.code}` |" in architecture, outcome
