"""The Envoy bootstrap, the one definition: the data path's chain, and what a reload may change."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from llamaswap.config import parse_config
from llamaswap.envoy.binary import validate_bootstrap
from llamaswap.envoy.bootstrap import EXT_AUTHZ, JSON_TO_METADATA, bootstrap_changes, build_bootstrap, render_bootstrap
from llamaswap.envoy.contract import ACCESS_LOG_NAME, STATUS_PREFIX


def hcm(bootstrap: dict) -> dict:
    return bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]


def test_the_chain_is_header_mutation_buffer_json_to_metadata_ext_authz_router():
    config = hcm(build_bootstrap(parse_config({"routing": {"retryGraceSeconds": 0}})))
    names = [f["name"] for f in config["http_filters"]]
    assert names == ["envoy.filters.http.header_mutation", "envoy.filters.http.buffer", JSON_TO_METADATA, EXT_AUTHZ,
                     "envoy.filters.http.router"]
    authz = config["http_filters"][3]["typed_config"]
    assert "with_request_body" not in authz  # no body in the sidecar without a retry grace period
    (early,) = config["early_header_mutation_extensions"]
    assert early["typed_config"]["mutations"] == [{"remove": "x-llamaswap-upstream"}]  # nothing else without retries
    assert set(config["route_config"]["virtual_hosts"][0]) == {"name", "domains", "routes"}
    assert authz["metadata_context_namespaces"] == ["llamaswap"]
    rule = config["http_filters"][2]["typed_config"]["request_rules"]["rules"][0]
    assert rule["on_present"]["type"] == "PROTOBUF_VALUE"  # only a JSON string counts as a model


def test_only_granted_exchanges_are_logged_with_periodic_renewals():
    config = hcm(build_bootstrap(parse_config({"envoy": {"leaseSeconds": 6}})))
    (log,) = config["access_log"]
    assert log["filter"]["metadata_filter"]["matcher"]["path"] == [{"key": "ticket"}]
    common = log["typed_config"]["common_config"]
    assert (common["log_name"], common["buffer_size_bytes"]) == (ACCESS_LOG_NAME, 0)
    assert config["access_log_options"]["access_log_flush_interval"] == "2.000s"  # leaseSeconds / 3
    assert config["always_set_request_id_in_response"] is True


def test_unscheduled_routes_skip_the_model_lookup_and_the_check():
    routes = hcm(build_bootstrap(parse_config({})))["route_config"]["virtual_hosts"][0]["routes"]
    by_match = {r["match"].get("path") or r["match"].get("prefix"): r for r in routes}
    for key in ("/metrics", STATUS_PREFIX, "/health", "/v1/models", "/props", "/models", "/models/load"):
        disabled = by_match[key]["typed_per_filter_config"]
        assert disabled[EXT_AUTHZ]["disabled"] is True and disabled[JSON_TO_METADATA]["disabled"] is True
    assert "typed_per_filter_config" not in by_match["/"]
    assert by_match["/"]["route"]["timeout"] == "0s" and by_match["/"]["route"]["idle_timeout"] == "0s"


def test_the_trusted_priority_header_is_sent_to_the_check():
    config = parse_config({"security": {"priority": {"trustedHeader": "x-auth-priority"}},
                           "routing": {"retryGraceSeconds": 0}})
    authz = hcm(build_bootstrap(config))["http_filters"][3]["typed_config"]
    assert {p["exact"] for p in authz["allowed_headers"]["patterns"]} == {
        "x-llamaswap-priority", "x-request-id", "x-auth-priority", "x-llm-d-inference-objective",
        "x-gateway-inference-objective"}


def test_a_retry_grace_period_sends_the_check_what_tells_a_retry():
    config = hcm(build_bootstrap(parse_config({"envoy": {"maxRequestBytes": 100_000}})))  # the default grace
    authz = config["http_filters"][3]["typed_config"]
    assert authz["with_request_body"] == {"max_request_bytes": 100_000, "allow_partial_message": True,
                                          "pack_as_bytes": True}
    assert {p["exact"] for p in authz["allowed_headers"]["patterns"]} == {
        "x-llamaswap-priority", "x-request-id", "authorization", "x-llamaswap-client-request-id", "content-length",
        "x-stainless-retry-count", "x-llm-d-inference-objective", "x-gateway-inference-objective"}
    assert hcm(build_bootstrap(parse_config({})))["http_filters"][3]["typed_config"]["with_request_body"][
        "max_request_bytes"] == 256 * 1024  # only the beginning of a large body
    assert config["route_config"]["virtual_hosts"][0]["request_headers_to_remove"] == ["x-llamaswap-client-request-id"]
    (early,) = config["early_header_mutation_extensions"]
    assert early["typed_config"]["mutations"][-1]["append"]["header"] == {
        "key": "x-llamaswap-client-request-id", "value": "%REQ(x-request-id)%"}


@pytest.mark.parametrize("url", ["http://127.0.0.1:8080", "https://llm.example.com"])
def test_the_upstream_gets_one_request_per_connection(url: str) -> None:
    bootstrap = build_bootstrap(parse_config({"upstream": {"url": url}}))
    clusters = {c["name"]: c for c in bootstrap["static_resources"]["clusters"]}
    options = clusters["upstream-gpu0"]["typed_extension_protocol_options"][
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
    assert options["common_http_protocol_options"]["max_requests_per_connection"] == 1
    assert "http_protocol_options" in options["explicit_http_config"]  # HTTP/1.1, as before


def test_the_listener_does_not_share_its_port():
    listener = build_bootstrap(parse_config({}))["static_resources"]["listeners"][0]
    assert listener["enable_reuse_port"] is False


@pytest.mark.parametrize("document", [{}, {"listen": {"http": "0.0.0.0:8080"}, "envoy": {"failOpen": True}},
                                      {"upstream": {"url": "https://llm.example.com"}}])
def test_envoy_accepts_it(tmp_path: Path, document: dict) -> None:
    path = tmp_path / "envoy.yaml"
    path.write_text(render_bootstrap(build_bootstrap(parse_config(document), otlp_endpoint="http://127.0.0.1:4317")))
    result = validate_bootstrap(str(path))
    assert result.returncode == 0, result.stdout + result.stderr


def test_what_a_reload_may_change():
    base = parse_config({})
    assert bootstrap_changes(base, parse_config({"routing": {"scheduler": {"maxWaitSeconds": 30, "use": "fifo"}},
                                                 "estimates": {"samples": 3}})) == []
    assert bootstrap_changes(base, parse_config({"envoy": {"leaseSeconds": 9}})) == ["envoy"]
    assert bootstrap_changes(base, parse_config({"listen": {"http": "127.0.0.1:1"}})) == ["listen"]
    assert bootstrap_changes(base, parse_config({"upstream": {"url": "http://127.0.0.1:1"}})) == ["upstream.url"]
    assert bootstrap_changes(base, parse_config({"security": {"priority": {"trustedHeader": "x-p"}}})) == [
        "security.priority.trustedHeader"]


def _routes(document: dict) -> list[dict]:
    return hcm(build_bootstrap(parse_config(document)))["route_config"]["virtual_hosts"][0]["routes"]


def test_the_management_api_is_refused_by_default_and_scheduled_on_request():
    refused = [r for r in _routes({}) if "direct_response" in r]
    assert [r["match"] for r in refused] == [{"path": "/models/load"}, {"path": "/models/unload"},
                                             {"prefix": "/slots/"}]
    for route in refused:
        assert route["direct_response"]["status"] == 403
        body = json.loads(route["direct_response"]["body"]["inline_string"])
        assert body["error"]["code"] == "management_api_refused" and set(body["error"]) == {
            "message", "type", "param", "code"}
        assert route["typed_per_filter_config"][EXT_AUTHZ]["disabled"] is True  # refused before any Check
    assert not [r for r in _routes({"upstream": {"managementApi": "schedule"}}) if "direct_response" in r]
    # Matched on the path llama-server acts on (it percent-decodes paths).
    config = hcm(build_bootstrap(parse_config({})))
    assert (config["normalize_path"], config["merge_slashes"]) == (True, True)
    assert config["path_with_escaped_slashes_action"] == "UNESCAPE_AND_FORWARD"


@pytest.mark.parametrize(("path", "bypass"), [
    ("/props", True),
    ("/props?model=tiny-a&autoload=false", True),
    ("/props?autoload=0&model=org%2Ftiny", True),
    ("/props?model=tiny-a", False),  # loads tiny-a in router mode
    ("/props?model=tiny-a&autoload=true", False),
    ("/props?%6dodel=tiny-a", False),  # llama-server decodes the key: a load
    ("/props?model=a&autoload=false&model=b", False),
    ("/props?model=a&autoload=fals%65", False),
])
def test_props_skips_the_queue_only_where_it_cannot_load(path: str, bypass: bool):
    (route,) = [r for r in _routes({}) if r["match"].get("prefix") == "/props"]
    method, target = route["match"]["headers"]
    assert method == {"name": ":method", "string_match": {"exact": "GET"}}
    # Envoy's safe_regex (RE2) matches the whole value; this regex means the same in Python.
    assert (re.fullmatch(target["string_match"]["safe_regex"]["regex"], path) is not None) is bypass


def test_a_changed_management_api_needs_a_new_bootstrap():
    assert bootstrap_changes(parse_config({}), parse_config({"upstream": {"managementApi": "schedule"}})) == [
        "upstream.managementApi"]


def test_the_edge_trusts_no_client_and_keeps_its_request_id():
    hcm = build_bootstrap(parse_config({}))["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
        "typed_config"]
    assert hcm["use_remote_address"] is True
    assert hcm["internal_address_config"] == {"unix_sockets": False, "cidr_ranges": []}
    assert hcm["preserve_external_request_id"] is True


def _sidecar_breaker(document: dict) -> dict:
    [cluster] = [c for c in build_bootstrap(parse_config(document))["static_resources"]["clusters"]
                 if c["name"] == "llamaswap_grpc"]
    return cluster["circuit_breakers"]["thresholds"][0]


def test_fail_open_lifts_the_breaker_that_would_fail_open():
    assert _sidecar_breaker({"envoy": {"maxSidecarStreams": 7}})["max_requests"] == 7
    assert _sidecar_breaker({"envoy": {"maxSidecarStreams": 7, "failOpen": True}})["max_requests"] == 2**32 - 1


def test_a_clients_router_controls_are_removed_before_any_filter_reads_them():
    config = hcm(build_bootstrap(parse_config({})))
    first = config["http_filters"][0]
    assert first["name"] == "envoy.filters.http.header_mutation"
    removed = {m["remove"] for m in first["typed_config"]["mutations"]["request_mutations"]}
    assert {"x-envoy-retry-on", "x-envoy-max-retries", "x-envoy-upstream-rq-per-try-timeout-ms",
            "x-envoy-upstream-rq-timeout-ms"} <= removed


def test_envoys_own_answers_say_whether_and_when_to_retry():
    mappers = hcm(build_bootstrap(parse_config({})))["local_reply_config"]["mappers"]
    added = {m["filter"]["status_code_filter"]["comparison"]["value"]["default_value"]:
             {h["header"]["key"]: h["header"]["value"] for h in m["headers_to_add"]} for m in mappers}
    assert added[503] == {"retry-after": "5", "retry-after-ms": "5000"}  # the sidecar unreachable
    assert added[413] == {"x-should-retry": "false"}  # the body is too large whenever it is sent


# -- several upstreams (issue 27): a cluster each, the Check's OK names the one -------------------

TWO = {"gpu0": "http://127.0.0.1:8081", "gpu1": "https://gpu1.example.com:8443"}


def several(urls: dict[str, str], document: dict | None = None):
    """The parsed configuration ``document`` with an `upstreams:` entry per name -> url, in order."""
    return parse_config({**(document or {}), "upstreams": [{"name": name, "url": url} for name, url in urls.items()]})


def _clusters(config) -> dict:
    return {c["name"]: c for c in build_bootstrap(config)["static_resources"]["clusters"]}


def _scheduled(config) -> list[dict]:
    routes = hcm(build_bootstrap(config))["route_config"]["virtual_hosts"][0]["routes"]
    return [r for r in routes if r["match"].get("prefix") == "/"]


def _socket(cluster: dict) -> dict:
    return cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]


def test_each_upstream_has_its_own_cluster_like_the_single_one_had():
    clusters = _clusters(several(TWO))
    assert _socket(clusters["upstream-gpu0"]) == {"address": "127.0.0.1", "port_value": 8081}
    assert _socket(clusters["upstream-gpu1"]) == {"address": "gpu1.example.com", "port_value": 8443}
    assert "transport_socket" not in clusters["upstream-gpu0"]
    assert clusters["upstream-gpu1"]["transport_socket"]["typed_config"]["sni"] == "gpu1.example.com"
    single = _clusters(parse_config({}))["upstream-gpu0"]
    for name in TWO:  # the same limits, buffer and connection reuse as the one upstream had
        for key in ("circuit_breakers", "per_connection_buffer_limit_bytes", "typed_extension_protocol_options"):
            assert clusters[f"upstream-{name}"][key] == single[key]


def test_a_scheduled_request_goes_to_the_upstream_the_check_named():
    config = several(TWO)
    *named, fallback = _scheduled(config)
    assert [(r["match"]["headers"], r["route"]["cluster"]) for r in named] == [
        ([{"name": "x-llamaswap-upstream", "string_match": {"exact": "gpu0"}}], "upstream-gpu0"),
        ([{"name": "x-llamaswap-upstream", "string_match": {"exact": "gpu1"}}], "upstream-gpu1")]
    for route in [*named, fallback]:  # the held Check matches the fallback: no timer on either
        assert (route["route"]["timeout"], route["route"]["idle_timeout"]) == ("0s", "0s")
        assert "typed_per_filter_config" not in route
    # Without failOpen a request no Check named an upstream for reaches none (503).
    assert "headers" not in fallback["match"] and fallback["route"]["cluster"] == "llamaswap_unrouted"
    assert _clusters(config)["llamaswap_unrouted"]["load_assignment"]["endpoints"] == []
    authz = hcm(build_bootstrap(config))["http_filters"][3]["typed_config"]
    assert authz["clear_route_cache"] is True  # the OK's header chooses the route again


def test_fail_open_sends_an_unscheduled_request_to_the_first_upstream():
    config = several(TWO, {"envoy": {"failOpen": True}})
    assert _scheduled(config)[-1]["route"]["cluster"] == "upstream-gpu0"
    assert "llamaswap_unrouted" not in _clusters(config)


def test_what_skips_the_queue_asks_the_first_upstream():
    routes = hcm(build_bootstrap(several({"b": "http://127.0.0.1:1", "a": "http://127.0.0.1:2"})))[
        "route_config"]["virtual_hosts"][0]["routes"]
    upstream = [r for r in routes
                if "typed_per_filter_config" in r and r.get("route", {}).get("cluster", "").startswith("upstream-")]
    assert {r["match"].get("path") or r["match"].get("prefix") for r in upstream} == {"/health", "/v1/models", "/props",
                                                                                    "/models"}
    assert {r["route"]["cluster"] for r in upstream} == {"upstream-b"}


def test_a_clients_own_upstream_header_is_removed_before_envoy_matches_a_route():
    for document in ({"routing": {"retryGraceSeconds": 0}}, {}):
        (early,) = hcm(build_bootstrap(parse_config(document)))["early_header_mutation_extensions"]
        assert early["typed_config"]["mutations"][0] == {"remove": "x-llamaswap-upstream"}


def test_one_upstream_is_routed_as_before_under_its_new_name():
    clusters = _clusters(parse_config({"upstream": {"url": "http://127.0.0.1:9000"}}))
    assert set(clusters) == {"upstream-gpu0", "llamaswap_grpc", "llamaswap_admin", "llamaswap_unrouted"}
    assert _socket(clusters["upstream-gpu0"]) == {"address": "127.0.0.1", "port_value": 9000}
    named, fallback = _scheduled(parse_config({}))
    assert named["route"]["cluster"] == "upstream-gpu0"
    assert named["match"]["headers"][0]["string_match"] == {"exact": "gpu0"}
    assert fallback["route"]["cluster"] == "llamaswap_unrouted"
    assert _scheduled(parse_config({"envoy": {"failOpen": True}}))[-1]["route"]["cluster"] == "upstream-gpu0"


@pytest.mark.parametrize("fail_open", [False, True])
def test_envoy_accepts_several_upstreams(tmp_path: Path, fail_open: bool) -> None:
    path = tmp_path / "envoy.yaml"
    config = several(TWO, {"envoy": {"failOpen": fail_open}})
    path.write_text(render_bootstrap(build_bootstrap(config)))
    result = validate_bootstrap(str(path))
    assert result.returncode == 0, result.stdout + result.stderr


def test_changed_upstreams_need_a_new_bootstrap():
    base = parse_config({})
    assert bootstrap_changes(several(TWO), several(TWO)) == []
    assert bootstrap_changes(base, several(TWO)) == ["upstreams"]
    assert bootstrap_changes(several(TWO), several({**TWO, "gpu1": "http://h:1"})) == ["upstreams"]
