"""The documentation's promises that can drift: the configuration block is the code's defaults
and names every key, the metric table names every metric, every outcome is named and every
refusal tabled, and every relative link in README.md and docs/ leads somewhere."""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import yaml

from llamaswap.adapters.outcomes import REFUSALS
from llamaswap.config import Config, json_schema
from llamaswap.core import Outcome
from llamaswap.telemetry import instruments
from llamaswap.telemetry import batches as batch_telemetry

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
LINKED = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


def section(path: Path, title: str) -> str:
    """The text under the heading `## title`, up to the next `## ` heading."""
    text = path.read_text(encoding="utf-8")
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else None]


def test_the_configuration_block_is_the_defaults():
    block = re.search(r"```yaml\n(.*?)```", section(DOCS / "configuration.md", "The defaults"), re.S)
    assert block is not None
    assert yaml.safe_load(block.group(1)) == Config().to_document()


def _settings(node: Mapping[str, Any], path: str = "") -> Iterator[str]:
    """The key path of every setting in the configuration's JSON Schema (llama-swap's ignored
    keys and deprecated ones aside), `models.<id>.priority` for the per-model ones."""
    for key, sub in node.get("properties", {}).items():
        where = f"{path}{key}"
        if sub.get("type") == "object" and sub.get("properties") is not None:
            yield from _settings(sub, f"{where}.")
        elif isinstance(sub.get("additionalProperties"), dict) and sub["additionalProperties"].get("properties"):
            yield from _settings(sub["additionalProperties"], f"{where}.<id>.")
        elif not sub.get("deprecated") and any(k in sub for k in ("type", "enum", "anyOf")):
            yield where


def test_every_key_is_explained():
    text = (DOCS / "configuration.md").read_text(encoding="utf-8")
    keys = list(_settings(json_schema()))
    assert len(keys) > 20  # the walk found the settings, not nothing
    for key in keys:
        row = re.search(rf"^\| `{re.escape(key)}` \| [^|]+ \| \S", text, re.M)
        assert row, f"{key} has no row in docs/configuration.md"
        # The reload table's rows name a verdict, not a default: a key has one row of each kind at most.
        defaults = re.findall(rf"^\| `{re.escape(key)}` \| `", text, re.M)
        assert len(defaults) == 1, f"{key} has {len(defaults)} default rows in docs/configuration.md"


def test_every_metric_is_documented():
    metrics = section(DOCS / "observability.md", "Metrics")
    documented = set(re.findall(r"`(llamaswap_[a-z_]+)", metrics))
    # Shared prefixes are written once: `llamaswap_scheduler_swaps_total` / `_loads_total`.
    for short in re.findall(r"/ `(_[a-z_]+)`|, `(_[a-z_]+)`", metrics):
        documented.update(short)
    for name in (*instruments.ALL, batch_telemetry.BATCH_REQUESTS, batch_telemetry.BATCHES):
        assert name in documented or any(name.endswith(s) for s in documented if s.startswith("_")), name


def test_every_batch_outcome_and_status_is_named():
    """The Batch API's metric labels: every way a line ends and every status of a batch."""
    from llamaswap.batches.lifecycle import BatchStatus, LineOutcome

    metrics = section(DOCS / "observability.md", "Metrics")
    page = (DOCS / "batches.md").read_text(encoding="utf-8")
    for outcome in LineOutcome:
        assert f"`{outcome.value}`" in metrics and f"`{outcome.value}`" in page, outcome
    for status in BatchStatus:
        assert f"`{status.value}`" in page, status


def test_every_outcome_is_named_and_every_refusal_tabled():
    metrics = section(DOCS / "observability.md", "Metrics")
    outcomes = section(DOCS / "observability.md", "Outcomes")
    for outcome in Outcome:
        assert f"`{outcome.value}`" in metrics, outcome
        assert f"| `{outcome.value}` |" in outcomes, outcome
    refusals = section(DOCS / "operations.md", "What a refused client gets")
    for outcome, error in REFUSALS.items():
        if outcome is Outcome.CANCELLED_WAITING:
            continue  # never seen by a client
        assert f"| `{outcome.value}` | {error.status} | `{error.code}` |" in refusals, outcome


def test_every_glossary_term_is_defined():
    headings = set(re.findall(r"^### (.+)$", (DOCS / "glossary.md").read_text(encoding="utf-8"), re.M))
    for term in ("grant", "lease", "settle", "adopted", "ticket", "band", "score", "swap affinity", "aging",
                 "outcome", "swap", "load", "batch", "line", "in flight"):
        assert term in headings, term


# -- links ---------------------------------------------------------------------------------

_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def _anchor(heading: str) -> str:
    """GitHub's id for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = _FENCE.sub("", path.read_text(encoding="utf-8"))
    return {_anchor(heading) for heading in re.findall(r"^#{1,6} (.+)$", text, re.M)}


def _links(path: Path) -> Iterator[str]:
    yield from _LINK.findall(_FENCE.sub("", path.read_text(encoding="utf-8")))


def test_the_anchor_rule_matches_github():
    assert _anchor("How long a band waits: `check-config`") == "how-long-a-band-waits-check-config"
    assert _anchor("Against the goals (issue \"Data path v2\")") == "against-the-goals-issue-data-path-v2"
    assert _anchor("swap affinity") == "swap-affinity"


def test_every_relative_link_leads_to_a_file_and_heading():
    checked = 0
    for page in LINKED:
        for target in _links(page):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:: not ours to check
                continue
            file_part, _, fragment = target.partition("#")
            linked = (page.parent / unquote(file_part)).resolve() if file_part else page
            assert linked.exists(), f"{page.relative_to(ROOT)}: {target} leads nowhere"
            if fragment and linked.suffix == ".md":
                assert fragment in _anchors(linked), f"{page.relative_to(ROOT)}: {target} has no such heading"
            checked += 1
    assert checked > 30  # the pattern found the links


def _subcommands() -> dict[str, Any]:
    import argparse

    from llamaswap.commands.main import build_parser

    parser = build_parser()
    [commands] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(commands.choices)


def test_the_command_table_names_every_command_and_option():
    """docs/operations.md's command table: a row per subcommand with each of its options (simulate's
    are in docs/simulate.md); README's layout names every subcommand."""
    rows = {}
    for line in section(DOCS / "operations.md", "Commands").splitlines():
        match = re.match(r"\| `llamaswap ([a-z-]+)(.*?)` \|", line)
        if match:
            rows[match.group(1)] = match.group(2)
    commands = _subcommands()
    assert set(rows) == set(commands)
    simulate = (DOCS / "simulate.md").read_text()
    for name, parser in commands.items():
        for action in parser._actions:
            if not action.option_strings or action.dest in ("help", "log_level"):
                continue
            where = simulate if name == "simulate" else rows[name]
            assert any(option in where for option in action.option_strings), (name, action.option_strings)
    layout = (ROOT / "README.md").read_text().split("commands/    ", 1)[1].splitlines()[0]
    assert all(name in layout for name in commands), layout


def test_the_configuration_tables_sit_under_their_sections():
    """docs/configuration.md: a key's row is under the `## section` its first word names."""
    text = (DOCS / "configuration.md").read_text()
    heading = ""
    for line in text.splitlines():
        if line.startswith("## "):
            heading = line[3:].strip()
        match = re.match(r"\| `([a-zA-Z]+)\.[^`]*` \| `", line)  # a key row: | `key` | `default` |
        if match and heading not in ("The defaults", "Reloading", "Checking a file"):
            assert match.group(1) == heading, (heading, line[:60])


def _routes(node: Any) -> Iterator[dict[str, Any]]:
    if isinstance(node, dict):
        if "match" in node:
            yield node
        for value in node.values():
            yield from _routes(value)
    elif isinstance(node, list):
        for value in node:
            yield from _routes(value)


def test_the_public_listener_routes_to_the_sidecar_are_the_documented_ones():
    """Every path Envoy's listener sends to the sidecar's admin server is named where the docs
    say what the listener exposes (configuration.md's security note)."""
    from llamaswap.config import Config
    from llamaswap.envoy.bootstrap import SIDECAR_ADMIN_CLUSTER, build_bootstrap

    to_sidecar = [route["match"] for route in _routes(build_bootstrap(Config()))
                  if route.get("route", {}).get("cluster") == SIDECAR_ADMIN_CLUSTER]
    paths = {match.get("path") or match.get("prefix") or match.get("path_separated_prefix")
             or match.get("safe_regex", {}).get("regex", "") for match in to_sidecar}
    assert len(paths) == 6, paths
    security = " ".join(section(DOCS / "configuration.md", "security").split())
    assert "`/metrics`" in security and "`/llamaswap/v1/upstream/metrics`" in security
    # The Batch API (llamaswap.batches.api), served by the sidecar's admin server.
    assert {"/v1/files", "/v1/batches"} <= paths, paths
    assert "`/v1/files`" in security and "`/v1/batches`" in security
    assert "`/llamaswap/v1/picker/metrics`" in security and "/llamaswap/v1/picker/metrics" in paths
    assert "request status" in security  # the status route: /llamaswap/v1/requests/{id}
    assert any(path.startswith("/llamaswap/v1/requests") or "requests" in path for path in paths), paths
    assert "/metrics" in paths and "/llamaswap/v1/upstream/metrics" in paths


def test_envoys_own_refusals_are_tabled():
    """README and operations.md name the answers Envoy gives itself, without x-llamaswap-outcome."""
    from llamaswap.config import Config
    from llamaswap.envoy.bootstrap import build_bootstrap

    direct = [route["direct_response"] for route in _routes(build_bootstrap(Config())) if "direct_response" in route]
    assert {response["status"] for response in direct} == {403}
    table = section(DOCS / "operations.md", "What a refused client gets").split("### Envoy's own refusals", 1)[1]
    for row in ("| 403 |", "`management_api_refused`", "| 413 |", "`envoy overloaded`", "`envoy.failOpen`"):
        assert row in table
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert "403 for llama-server's management API, 413" in readme


def test_get_activity_says_how_many_records():
    from llamaswap.adapters.admin import ACTIVITY_DEFAULT_LIMIT

    activity = section(DOCS / "observability.md", "Activity log")
    assert f"most recent {ACTIVITY_DEFAULT_LIMIT} records (`?limit=N`" in activity


def test_no_one_grant_at_a_time():
    """Slots allow several grants: where the one-at-a-time rule is stated, the slots are too."""
    from llamaswap.commands.main import DESCRIPTION

    grant = (DOCS / "glossary.md").read_text().split("### grant", 1)[1].split("###", 1)[0]
    for text in (DESCRIPTION, grant, (ROOT / "README.md").read_text()):
        flat = " ".join(text.split())
        assert "one grant exists at a time" not in flat and "upstream.slots" in flat


def test_the_documented_warning_is_what_check_config_says():
    from llamaswap.config import parse_config
    from llamaswap.config.advice import advice

    checking = section(DOCS / "configuration.md", "Checking a file")
    documented = re.search(r"^warning: (.*)$", checking, re.M)
    assert documented is not None
    said = advice(parse_config({"models": {"qwen3-8b": {"priority": 10}}}))
    assert [str(problem) for problem in said] == [documented.group(1)]


def test_the_layer_table_names_every_package_and_command():
    """docs/architecture.md's layer table: a row per package of sidecar/llamaswap/, and the
    commands row names every subcommand."""
    rows = {}
    for line in section(DOCS / "architecture.md", "The layers").splitlines():
        match = re.match(r"\| `sidecar/llamaswap/([a-z_]+)/` \| (.*) \|$", line)
        if match:
            rows[match.group(1)] = match.group(2)
    packages = {path.name for path in (ROOT / "sidecar" / "llamaswap").iterdir()
                if path.is_dir() and path.name != "__pycache__"}
    assert set(rows) == packages
    assert all(f"`{name}`" in rows["commands"] for name in _subcommands()), rows["commands"]


def test_kubernetes_md_says_whether_simulate_pods_is_built():
    """docs/kubernetes.md says `simulate --pods` is not built exactly while the command has no
    such option (issue 28's replay over many pods waits for issue 27)."""
    simulate = _subcommands()["simulate"]
    built = any("--pods" in action.option_strings for action in simulate._actions)
    many_nodes = " ".join(section(DOCS / "kubernetes.md", "Many nodes").split())
    assert ("`llamaswap simulate --pods N` is not built" in many_nodes) is not built


def test_the_routes_that_skip_the_queue_are_named():
    """docs/architecture.md's list of requests that skip the queue names every path of a route
    that Envoy's bootstrap sends on without the Check."""
    from llamaswap.config import Config
    from llamaswap.envoy.bootstrap import build_bootstrap

    unscheduled = {route["match"].get("path") or route["match"].get("prefix")
                   or route["match"].get("path_separated_prefix")
                   for route in _routes(build_bootstrap(Config()))
                   if "route" in route and route.get("typed_per_filter_config", {})
                   .get("envoy.filters.http.ext_authz", {}).get("disabled")}
    assert "/llamaswap/v1/upstream/metrics" in unscheduled and "/health" in unscheduled
    assert "/v1/batches" in unscheduled and "/v1/files" in unscheduled
    text = (DOCS / "architecture.md").read_text()
    paragraph = text.split("Requests that do not use the GPU skip the queue:", 1)[1].split("\n\n", 1)[0]
    skipping = " ".join(paragraph.split())
    for path in unscheduled:
        assert f"`{path.rstrip('/')}" in skipping or f"`GET {path}" in skipping, path


def test_the_check_config_example_is_what_the_defaults_explain():
    """docs/scheduling.md's check-config example: its lines after `...` are what check-config
    says of the default settings."""
    from llamaswap.core.explain import explain_policy

    example = section(DOCS / "scheduling.md", "How long a band waits: `check-config`")
    block = example.split("```\n", 1)[1].split("```", 1)[0].splitlines()
    assert block[:2] == ["ok", "  ..."]
    assert block[2:] == [f"  {line}" for line in explain_policy(Config().policy())]
