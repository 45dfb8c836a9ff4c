"""An InferenceObjective named in x-llm-d-inference-objective (llm-d's router in front of an
InferencePool) gives a request without X-LlamaSwap-Priority that objective's priority
(`routing.objectives`); the header wins when sent, and the operator's policy applies to both."""

from __future__ import annotations

import pytest
from flow import Flow, check_request, virtual_time

from llamaswap.config import parse_config
from llamaswap.core.priority import OBJECTIVE_HEADER, OLD_OBJECTIVE_HEADER, PriorityMode, PriorityPolicy, PrioritySource
from llamaswap.envoy.bootstrap import build_bootstrap

OBJECTIVES = {"interactive": 100, "normal": 0, "batch": -100, "nightly": -300}


def policy(mode: PriorityMode = PriorityMode.TRUST, trusted: str | None = None) -> PriorityPolicy:
    return PriorityPolicy(mode=mode, minimum=-100, maximum=100, trusted_header=trusted, objectives=OBJECTIVES)


@pytest.mark.parametrize(("header", "objective", "value", "source"), [
    (None, "batch", -100, PrioritySource.OBJECTIVE),
    ("", "interactive", 100, PrioritySource.OBJECTIVE),  # an empty header is no header
    (" ", "batch ", -100, PrioritySource.OBJECTIVE),
    ("7", "batch", 7, PrioritySource.NUMBER),  # the header wins
    ("interactive", "batch", 100, PrioritySource.ALIAS),
    ("soon", "batch", 0, PrioritySource.UNPARSEABLE),  # a header was sent: its fault is counted
    (None, "unknown", 0, PrioritySource.ABSENT),
    (None, "Batch", 0, PrioritySource.ABSENT),  # object names are lowercase: no case folding
    (None, None, 0, PrioritySource.ABSENT),
])
def test_the_objective_stands_in_for_a_missing_header(header: str | None, objective: str | None, value: int,
                                                       source: PrioritySource) -> None:
    resolved = policy().resolve(header, None, objective)
    assert (resolved.value, resolved.source) == (value, source)


def test_the_operators_policy_applies_to_the_objective_too() -> None:
    clamped = policy(PriorityMode.CLAMP).resolve(None, None, "nightly")
    assert (clamped.value, clamped.source) == (-100, PrioritySource.CLAMPED)
    stripped = policy(PriorityMode.STRIP).resolve(None, None, "interactive")
    assert (stripped.value, stripped.source) == (0, PrioritySource.STRIPPED)
    trusted = policy(trusted="x-auth").resolve(None, "42", "batch")
    assert (trusted.value, trusted.source) == (42, PrioritySource.TRUSTED)


def test_the_defaults_are_the_charts_objectives_and_aliases_are_accepted() -> None:
    assert dict(parse_config({}).routing.objectives) == {"interactive": 100, "normal": 0, "batch": -100}
    config = parse_config({"routing": {"objectives": {"chat": "interactive", "offline": -20, "bulk": " Batch "}}})
    assert dict(config.routing.objectives) == {"chat": 100, "offline": -20, "bulk": -100}
    assert dict(parse_config({"routing": {"objectives": None}}).routing.objectives) == {}
    assert parse_config({"routing": {"objectives": {}}}).priority_policy().resolve(None, None, "batch").value == 0


def test_envoy_sends_the_objective_header_to_the_check() -> None:
    """Always: routing.objectives may change on a reload, Envoy's bootstrap cannot."""
    for config in (parse_config({}), parse_config({"routing": {"objectives": {}}})):
        filters = build_bootstrap(config)["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
        authz = next(f for f in filters["typed_config"]["http_filters"] if f["name"].endswith("ext_authz"))
        patterns = {p["exact"] for p in authz["typed_config"]["allowed_headers"]["patterns"]}
        assert {OBJECTIVE_HEADER, OLD_OBJECTIVE_HEADER} <= patterns


@virtual_time
async def test_a_check_naming_an_objective_is_queued_at_its_priority() -> None:
    flow = Flow({"envoy": {"leaseSeconds": 1000}})
    running = await flow.check(check_request({"x-request-id": "first"}, model="m"))
    batch = await flow.check(check_request({"x-request-id": "b", OBJECTIVE_HEADER: "batch"}, model="m"))
    normal = await flow.check(check_request({"x-request-id": "n"}, model="m"))
    chat = await flow.check(check_request({"x-request-id": "i", OBJECTIVE_HEADER: "interactive"}, model="m"))
    both = await flow.check(check_request({"x-request-id": "h", OBJECTIVE_HEADER: "interactive",
                                           "x-llamaswap-priority": "-5"}, model="m"))
    # The header's earlier name, which the router still reads, and the new one winning over it.
    old = await flow.check(check_request({"x-request-id": "o", OLD_OBJECTIVE_HEADER: "batch"}, model="m"))
    new = await flow.check(check_request({"x-request-id": "w", OLD_OBJECTIVE_HEADER: "batch",
                                          OBJECTIVE_HEADER: "interactive"}, model="m"))
    assert running.granted
    assert [r.ticket.priority.value for r in (batch, normal, chat, both, old, new)] == [-100, 0, 100, -5, -100, 100]
    assert flow.waiting_ids() == ["i", "w", "n", "h", "b", "o"]
    await flow.complete(running)
    assert chat.granted
    flow.close()
