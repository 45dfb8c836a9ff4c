"""`ext_authz.body_values` reads each body value in one pass without testing its JSON kind where
the kind's default is refused anyway: it must take exactly what the kind-checked rules take."""

from __future__ import annotations

import itertools
import math

from google.protobuf import struct_pb2

from llamaswap.adapters.ext_authz import (
    MAX_MODEL_NAME, MAX_SERVICE_TIER, MAX_TOKENS, body_values, max_tokens_of, model_of, service_tier_of, streamed_of,
)
from llamaswap.adapters.metadata import Fields
from llamaswap.envoy.contract import MAX_TOKENS_KEYS, MODEL_KEY, SERVICE_TIER_KEY, STREAM_KEY
from flow import check_request


def _kind_checked(fields: Fields | None) -> tuple[str | None, int | None, bool, str | None]:
    """The rules as each reader wrote them, testing every value's kind first."""
    def string(key: str) -> str | None:
        if fields is None or key not in fields or fields[key].WhichOneof("kind") != "string_value":
            return None
        return fields[key].string_value

    model = string(MODEL_KEY)
    tier = string(SERVICE_TIER_KEY)
    max_tokens = None
    for key in MAX_TOKENS_KEYS:
        if fields is not None and key in fields and fields[key].WhichOneof("kind") == "number_value":
            number = fields[key].number_value
            if 1 <= number <= MAX_TOKENS:
                max_tokens = int(number)
                break
    streamed = (fields is not None and STREAM_KEY in fields and fields[STREAM_KEY].WhichOneof("kind") == "bool_value"
                and fields[STREAM_KEY].bool_value)
    return (model if model and len(model) <= MAX_MODEL_NAME else None, max_tokens, streamed,
            tier if tier is not None and len(tier) <= MAX_SERVICE_TIER else None)


def _values() -> list[struct_pb2.Value | None]:
    """Every JSON kind, with the edges each rule has (None: the key is absent)."""
    listed = struct_pb2.Value()
    listed.list_value.values.add().string_value = "m"
    nested = struct_pb2.Value()
    nested.struct_value.fields["model"].string_value = "m"
    strings = ("", "m", "flex", "x" * MAX_SERVICE_TIER, "x" * (MAX_SERVICE_TIER + 1), "x" * MAX_MODEL_NAME,
               "x" * (MAX_MODEL_NAME + 1), "16", "true")
    numbers = (0.0, -1.0, 0.5, 1.0, 1.5, 16.0, MAX_TOKENS, MAX_TOKENS + 1, 1e12, math.nan, math.inf, -math.inf)
    return [None, struct_pb2.Value(null_value=struct_pb2.NULL_VALUE), struct_pb2.Value(bool_value=True),
            struct_pb2.Value(bool_value=False), listed, nested,
            *(struct_pb2.Value(string_value=text) for text in strings),
            *(struct_pb2.Value(number_value=number) for number in numbers)]


def _fields(values: dict[str, struct_pb2.Value | None]) -> Fields:
    struct = struct_pb2.Struct()
    for key, value in values.items():
        if value is not None:
            struct.fields[key].CopyFrom(value)
    return struct.fields


def test_each_value_is_taken_as_the_kind_checked_rules_take_it() -> None:
    values = _values()
    assert body_values(None) == _kind_checked(None) == (None, None, False, None)
    for key in (MODEL_KEY, SERVICE_TIER_KEY, STREAM_KEY, *MAX_TOKENS_KEYS):
        for value in values:
            fields = _fields({key: value})
            assert body_values(fields) == _kind_checked(fields), (key, value)
    # The first output-token count that is one wins, whatever the others are.
    for triple in itertools.product(values, repeat=len(MAX_TOKENS_KEYS)):
        fields = _fields(dict(zip(MAX_TOKENS_KEYS, triple)))
        assert body_values(fields) == _kind_checked(fields), triple


def test_the_readers_of_a_check_read_its_body_values() -> None:
    request = check_request({}, model="m")
    fields = request.attributes.metadata_context.filter_metadata["llamaswap"].fields
    fields["max_tokens"].number_value = 64
    fields["stream"].bool_value = True
    fields["service_tier"].string_value = "flex"
    assert (model_of(request), max_tokens_of(request), streamed_of(request), service_tier_of(request)) == (
        "m", 64, True, "flex")
    bare = check_request({})
    assert (model_of(bare), max_tokens_of(bare), streamed_of(bare), service_tier_of(bare)) == (None, None, False, None)
