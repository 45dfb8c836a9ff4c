"""Fuzzing the edges that take untrusted input: the header, the body, the config file."""

from __future__ import annotations

import json
import pathlib
import tempfile

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llamaswap.config import Config, ConfigError, load_config, parse_config
from llamaswap.core import PriorityPolicy, PrioritySource, parse_priority
from llamaswap.core.priority import INT64_MAX, INT64_MIN
from llamaswap.runtime.model import model_from_body


@given(st.one_of(st.text(), st.binary(), st.none()))
def test_priority_parser_never_raises_and_stays_in_int64(raw) -> None:
    priority = parse_priority(raw)
    assert INT64_MIN <= priority.value <= INT64_MAX
    if priority.source is PrioritySource.UNPARSEABLE or priority.source is PrioritySource.ABSENT:
        assert priority.value == 0


@given(st.integers(min_value=INT64_MIN, max_value=INT64_MAX), st.sampled_from(["", " ", "\t"]))
def test_every_int64_round_trips(value: int, pad: str) -> None:
    assert parse_priority(f"{pad}{value}{pad}").value == value


@given(st.one_of(st.text(), st.none()), st.integers(-1000, 1000), st.integers(0, 1000))
def test_clamp_policy_keeps_every_value_in_range(raw, low: int, width: int) -> None:
    policy = PriorityPolicy("clamp", low, low + width)
    assert low <= policy.resolve(raw).value <= low + width or policy.resolve(raw).value == 0


@given(st.binary(max_size=2048))
def test_model_extraction_never_raises_on_bytes(body: bytes) -> None:
    model = model_from_body(body)
    assert model is None or isinstance(model, str)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)


@given(json_values)
def test_model_is_only_a_top_level_string(document) -> None:
    model = model_from_body(json.dumps(document).encode())
    if isinstance(document, dict) and isinstance(document.get("model"), str) and 0 < len(document["model"]) <= 512:
        assert model == document["model"]
    else:
        assert model is None


def test_deeply_nested_body_is_not_an_error() -> None:
    assert model_from_body(b'{"model": "m", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}") in (None, "m")


@settings(suppress_health_check=[HealthCheck.too_slow], max_examples=200)
@given(st.text(max_size=300))
def test_config_loader_on_arbitrary_text(text: str) -> None:
    with tempfile.TemporaryDirectory() as directory:
        path = pathlib.Path(directory) / "c.yaml"
        path.write_text(text, encoding="utf-8")
        try:
            config = load_config(path)
        except ConfigError as exc:
            assert exc.problems and all(problem.path for problem in exc.problems)
        else:
            assert isinstance(config, Config)


@given(json_values)
def test_config_parser_on_arbitrary_documents(document) -> None:
    try:
        parse_config(document)
    except ConfigError as exc:
        assert exc.problems
