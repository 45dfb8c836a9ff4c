"""Fuzzing the edges that take untrusted input: the priority header, what Envoy sends (the
body's model as json_to_metadata typed it, the access log's flags and timings), the config file.

The sidecar never parses a request body: Envoy's json_to_metadata does, and hands over the
`model` as a google.protobuf.Value of whatever JSON type the client sent.
"""

from __future__ import annotations

import pathlib
import tempfile

from flow import check_request
from google.protobuf import struct_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from llamaswap._proto.envoy.data.accesslog.v3 import accesslog_pb2
from llamaswap.config import Config, ConfigError, load_config, parse_config
from llamaswap.core import PriorityMode, PriorityPolicy, PrioritySource, parse_priority
from llamaswap.core.priority import INT64_MAX, INT64_MIN
from llamaswap.runtime.ticket import ExchangeEnd, ExchangeReport
from llamaswap.adapters.access_log import exchange_end, report_of
from llamaswap.adapters.ext_authz import MAX_MODEL_NAME, model_of
from test_transport import CLIENT_LEFT_FLAGS, NOT_SENT_FLAGS, OTHER_FLAGS, UPSTREAM_FAILED_FLAGS, log_entry

# -- the priority header ---------------------------------------------------------------------


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
    policy = PriorityPolicy(mode=PriorityMode.CLAMP, minimum=low, maximum=low + width, trusted_header=None)
    resolved = policy.resolve(raw)
    assert low <= resolved.value <= low + width
    parsed = parse_priority(raw)
    if low <= parsed.value <= low + width:
        assert resolved == parsed
    else:
        assert resolved.source is PrioritySource.CLAMPED


@given(st.one_of(st.text(), st.none()))
def test_strip_policy_gives_everyone_zero(raw) -> None:
    policy = PriorityPolicy(mode=PriorityMode.STRIP, minimum=-100, maximum=100, trusted_header=None)
    assert policy.resolve(raw).value == 0


@given(st.one_of(st.text(), st.none()), st.integers(INT64_MIN, INT64_MAX))
def test_a_trusted_header_overrides_every_mode(raw, trusted: int) -> None:
    for mode in PriorityMode:
        policy = PriorityPolicy(mode=mode, minimum=-10, maximum=10, trusted_header="x-tier")
        resolved = policy.resolve(raw, str(trusted))
        assert (resolved.value, resolved.source) == (trusted, PrioritySource.TRUSTED)


# -- the body's model, as json_to_metadata typed it ------------------------------------------

scalars = st.one_of(
    st.builds(lambda: struct_pb2.Value(null_value=struct_pb2.NULL_VALUE)),
    st.booleans().map(lambda b: struct_pb2.Value(bool_value=b)),
    st.floats(allow_nan=False).map(lambda f: struct_pb2.Value(number_value=f)),
    st.text(max_size=MAX_MODEL_NAME + 8).map(lambda s: struct_pb2.Value(string_value=s)),
    st.just(struct_pb2.Value()),  # no kind at all
)


def _list(items: list[struct_pb2.Value]) -> struct_pb2.Value:
    value = struct_pb2.Value()
    value.list_value.values.extend(items)
    return value


def _struct(items: dict[str, struct_pb2.Value]) -> struct_pb2.Value:
    value = struct_pb2.Value()
    for key, item in items.items():
        value.struct_value.fields[key].CopyFrom(item)
    return value


values = st.recursive(
    scalars,
    lambda children: st.lists(children, max_size=4).map(_list)
    | st.dictionaries(st.text(max_size=8), children, max_size=4).map(_struct),
    max_leaves=20,
)


@given(values)
def test_the_model_is_only_a_non_empty_string_of_at_most_512(value: struct_pb2.Value) -> None:
    model = model_of(check_request(model=value))
    if value.WhichOneof("kind") == "string_value" and 0 < len(value.string_value) <= MAX_MODEL_NAME:
        assert model == value.string_value
    else:
        assert model is None


@given(st.dictionaries(st.text(max_size=12), values, max_size=4))
def test_other_metadata_never_counts_as_the_model(fields: dict[str, struct_pb2.Value]) -> None:
    request = check_request()
    for key, value in fields.items():
        if key != "model":
            request.attributes.metadata_context.filter_metadata["llamaswap"].fields[key].CopyFrom(value)
            request.attributes.metadata_context.filter_metadata["other"].fields["model"].CopyFrom(value)
    assert model_of(request) is None


# -- the access log's flags and timings ------------------------------------------------------

ALL_FLAGS = NOT_SENT_FLAGS + CLIENT_LEFT_FLAGS + UPSTREAM_FAILED_FLAGS + OTHER_FLAGS
durations = st.one_of(st.none(), st.integers(-10**12, 10**15).map(lambda ns: ns / 1e9))
kinds = st.sampled_from([v.number for v in accesslog_pb2.DESCRIPTOR.enum_types_by_name["AccessLogType"].values])


def expected_end(flags: set[str], tx_s: float | None, status: int) -> ExchangeEnd:
    """The specification, by family: the client, then not sent, then the upstream."""
    if flags & set(CLIENT_LEFT_FLAGS):
        return ExchangeEnd.CLIENT_LEFT
    if tx_s is None or flags & set(NOT_SENT_FLAGS):
        return ExchangeEnd.NOT_SENT
    if status == 0 or flags & set(UPSTREAM_FAILED_FLAGS):
        return ExchangeEnd.UPSTREAM_FAILED
    return ExchangeEnd.COMPLETE


@settings(max_examples=300)
@given(st.sets(st.sampled_from(ALL_FLAGS)), durations, durations, st.one_of(st.none(), st.integers(0, 2**32 - 1)),
       kinds)
def test_report_of_any_entry(flags: set[str], tx_s: float | None, rx_s: float | None, status: int | None,
                             kind: int) -> None:
    entry = log_entry(kind, status=status, flags=tuple(sorted(flags)), tx_s=tx_s, rx_s=rx_s)
    report = report_of(entry)
    if kind not in (accesslog_pb2.DownstreamPeriodic, accesslog_pb2.DownstreamEnd, accesslog_pb2.NotSet):
        assert report is None
        return
    assert isinstance(report, ExchangeReport)
    if tx_s is not None and rx_s is not None:
        tx_ns = entry.common_properties.time_to_first_upstream_tx_byte.ToNanoseconds()
        rx_ns = entry.common_properties.time_to_first_upstream_rx_byte.ToNanoseconds()
        assert report.first_byte_s == max(0, rx_ns - tx_ns) / 1e9
        assert report.first_byte_s >= 0
    else:
        assert report.first_byte_s is None
    if kind == accesslog_pb2.DownstreamPeriodic:
        assert (report.final, report.end, report.status) == (False, None, 0)
    else:
        assert report.final is True
        assert report.status == (status or 0)
        assert report.end is expected_end(flags, tx_s, status or 0)


@given(st.sets(st.sampled_from(ALL_FLAGS)), durations, st.integers(0, 999))
def test_exchange_end_of_any_flags(flags: set[str], tx_s: float | None, status: int) -> None:
    entry = log_entry(flags=tuple(sorted(flags)), tx_s=tx_s, status=status)
    assert exchange_end(entry, status) is expected_end(flags, tx_s, status)


# -- the config file -------------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)


# No deadline: a timing threshold is no assertion (a loaded machine took 526 ms for one example).
@settings(suppress_health_check=[HealthCheck.too_slow], max_examples=200, deadline=None)
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
        config = parse_config(document)
    except ConfigError as exc:
        assert exc.problems and all(problem.path and problem.message for problem in exc.problems)
    else:
        assert isinstance(config, Config)
