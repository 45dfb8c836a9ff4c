"""The OpenAI request body's `service_tier` gives a request without X-LlamaSwap-Priority a priority:
`flex` is batch, `default` and `auto` normal, `priority` interactive; any other value is ignored.
A header that is sent wins (even an unparseable one), an objective too, and the operator's policy
(clamp, strip, trustedHeader) applies as to the header. Envoy's json_to_metadata copies the key
into the Check; e2e/test_service_tier_path.py runs it through the real Envoy."""

from __future__ import annotations

import pytest
from flow import Flow, check_request, virtual_time
from google.protobuf import struct_pb2

from llamaswap.adapters.ext_authz import service_tier_of
from llamaswap.config import parse_config
from llamaswap.core.priority import (
    ALIASES,
    OBJECTIVE_HEADER,
    SERVICE_TIERS,
    PriorityMode,
    PriorityPolicy,
    PrioritySource,
)
from llamaswap.envoy.bootstrap import JSON_TO_METADATA, build_bootstrap
from llamaswap.envoy.contract import MODEL_NAMESPACE, SERVICE_TIER_KEY

SOURCE = PrioritySource


def policy(mode: PriorityMode = PriorityMode.TRUST, *, minimum: int = -100, maximum: int = 100,
           trusted: str | None = None) -> PriorityPolicy:
    return PriorityPolicy(mode=mode, minimum=minimum, maximum=maximum, trusted_header=trusted,
                          objectives={"nightly": -300, "batch": -100})


def test_the_tiers_are_the_aliases() -> None:
    assert SERVICE_TIERS == {"flex": ALIASES["batch"], "default": ALIASES["normal"], "auto": ALIASES["normal"],
                             "priority": ALIASES["interactive"]}


@pytest.mark.parametrize(("tier", "value", "band"), [
    ("flex", -100, "batch"),
    ("default", 0, "normal"),
    ("auto", 0, "normal"),
    ("priority", 100, "interactive"),
])
def test_each_tier_stands_in_for_a_missing_header(tier: str, value: int, band: str) -> None:
    resolved = policy().resolve(None, None, None, tier)
    assert (resolved.value, resolved.source, resolved.band.value) == (value, SOURCE.SERVICE_TIER, band)
    assert policy().resolve("", None, None, tier).source is SOURCE.SERVICE_TIER  # an empty header is no header
    assert policy().resolve("  ", None, None, tier).value == value


@pytest.mark.parametrize(("header", "value", "source"), [
    ("7", 7, SOURCE.NUMBER),
    ("interactive", 100, SOURCE.ALIAS),
    ("normal", 0, SOURCE.ALIAS),
    ("soon please", 0, SOURCE.UNPARSEABLE),  # a header that is sent wins, even unparseable: its fault is counted
])
def test_a_header_that_is_sent_wins(header: str, value: int, source: PrioritySource) -> None:
    resolved = policy().resolve(header, None, None, "flex")
    assert (resolved.value, resolved.source) == (value, source)


def test_an_objective_wins_over_the_tier_and_a_trusted_header_over_both() -> None:
    objective = policy().resolve(None, None, "nightly", "priority")
    assert (objective.value, objective.source) == (-300, SOURCE.OBJECTIVE)
    unknown = policy().resolve(None, None, "unlisted", "priority")  # an unlisted objective is none
    assert (unknown.value, unknown.source) == (100, SOURCE.SERVICE_TIER)
    trusted = policy(trusted="x-auth").resolve(None, "42", None, "flex")
    assert (trusted.value, trusted.source) == (42, SOURCE.TRUSTED)
    untrusted = policy(trusted="x-auth").resolve(None, "junk", None, "flex")  # an invalid trusted value: ignored
    assert (untrusted.value, untrusted.source) == (-100, SOURCE.SERVICE_TIER)


@pytest.mark.parametrize("tier", [None, "", "Flex", "FLEX", " flex", "flex ", "scale", "batch", "interactive",
                                  "priority\x00", "x" * 1000])
def test_any_other_value_is_ignored_as_no_header(tier: str | None) -> None:
    resolved = policy().resolve(None, None, None, tier)
    assert (resolved.value, resolved.source) == (0, SOURCE.ABSENT)


def test_clamp_applies_to_the_tier() -> None:
    narrow = policy(PriorityMode.CLAMP, minimum=-50, maximum=50)
    flex = narrow.resolve(None, None, None, "flex")
    assert (flex.value, flex.source, flex.band.value) == (-50, SOURCE.CLAMPED, "batch")
    fast = narrow.resolve(None, None, None, "priority")
    assert (fast.value, fast.source, fast.band.value) == (50, SOURCE.CLAMPED, "interactive")
    inside = narrow.resolve(None, None, None, "default")
    assert (inside.value, inside.source) == (0, SOURCE.SERVICE_TIER)
    wide = policy(PriorityMode.CLAMP).resolve(None, None, None, "flex")  # the defaults hold every tier
    assert (wide.value, wide.source) == (-100, SOURCE.SERVICE_TIER)


@pytest.mark.parametrize("tier", ["flex", "default", "auto", "priority"])
def test_strip_ignores_the_tier(tier: str) -> None:
    resolved = policy(PriorityMode.STRIP).resolve(None, None, None, tier)
    assert (resolved.value, resolved.source) == (0, SOURCE.STRIPPED)
    trusted = policy(PriorityMode.STRIP, trusted="x-auth").resolve(None, "interactive", None, tier)
    assert (trusted.value, trusted.source) == (100, SOURCE.TRUSTED)  # the operator's header still counts


def test_the_configured_policy_reads_the_tier() -> None:
    assert parse_config({}).priority_policy().resolve(None, None, None, "flex").value == -100
    clamped = parse_config({"security": {"priority": {"mode": "clamp", "min": -10, "max": 10}}}).priority_policy()
    assert clamped.resolve(None, None, None, "flex").value == -10
    assert parse_config({"security": {"priority": {"mode": "strip"}}}).priority_policy().resolve(
        None, None, None, "priority").value == 0


# -- the plumbing: Envoy's bootstrap and the Check ---------------------------------------------


def test_json_to_metadata_copies_the_tier_keeping_its_json_type() -> None:
    hcm = build_bootstrap(parse_config({}))["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    (rules,) = [f["typed_config"]["request_rules"]["rules"] for f in hcm["typed_config"]["http_filters"]
                if f["name"] == JSON_TO_METADATA]
    (rule,) = [r for r in rules if r["selectors"] == [{"key": SERVICE_TIER_KEY}]]
    assert rule["on_present"] == {"metadata_namespace": MODEL_NAMESPACE, "key": SERVICE_TIER_KEY,
                                  "type": "PROTOBUF_VALUE"}


def tiered(headers: dict[str, str], tier: struct_pb2.Value | str | None, *, model: str = "m"):
    request = check_request(headers, model=model)
    if tier is not None:
        field = request.attributes.metadata_context.filter_metadata[MODEL_NAMESPACE].fields[SERVICE_TIER_KEY]
        if isinstance(tier, str):
            field.string_value = tier
        else:
            field.CopyFrom(tier)
    return request


@pytest.mark.parametrize(("value", "read"), [
    ("flex", "flex"),
    ("anything", "anything"),  # the core says which count
    (struct_pb2.Value(number_value=1), None),
    (struct_pb2.Value(bool_value=True), None),
    (struct_pb2.Value(null_value=struct_pb2.NULL_VALUE), None),
    (struct_pb2.Value(list_value=struct_pb2.ListValue(values=[struct_pb2.Value(string_value="flex")])), None),
    ("x" * 33, None),  # longer than any tier: not kept on the request
    (None, None),
])
def test_the_check_reads_a_string_tier_only(value: struct_pb2.Value | str | None, read: str | None) -> None:
    assert service_tier_of(tiered({}, value)) == read


def test_a_check_without_the_namespace_has_no_tier() -> None:
    assert service_tier_of(check_request({})) is None


@virtual_time
async def test_a_check_naming_a_tier_is_queued_at_its_priority() -> None:
    flow = Flow({"envoy": {"leaseSeconds": 1000}})
    running = await flow.check(check_request({"x-request-id": "first"}, model="m"))
    flex = await flow.check(tiered({"x-request-id": "flex"}, "flex"))
    normal = await flow.check(tiered({"x-request-id": "default"}, "default"))
    junk = await flow.check(tiered({"x-request-id": "junk"}, struct_pb2.Value(number_value=100)))
    fast = await flow.check(tiered({"x-request-id": "priority"}, "priority"))
    header = await flow.check(tiered({"x-request-id": "header", "x-llamaswap-priority": "-5"}, "priority"))
    objective = await flow.check(tiered({"x-request-id": "objective", OBJECTIVE_HEADER: "batch"}, "priority"))
    assert running.granted
    requests = (flex, normal, junk, fast, header, objective)
    assert [r.ticket.priority.value for r in requests] == [-100, 0, 0, 100, -5, -100]
    assert [r.ticket.priority.source for r in requests] == [
        SOURCE.SERVICE_TIER, SOURCE.SERVICE_TIER, SOURCE.ABSENT, SOURCE.SERVICE_TIER, SOURCE.NUMBER, SOURCE.OBJECTIVE]
    assert flow.waiting_ids() == ["priority", "default", "junk", "header", "flex", "objective"]
    await flow.complete(running)
    assert fast.granted
    flow.close()
