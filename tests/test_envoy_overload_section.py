"""The overload manager section of the bootstrap (sidecar/llamaswap/envoy_overload.py): its heap
budget from envoy.maxHeapBytes or a memory limit, none without either, and a bootstrap with it
that the real Envoy accepts (e2e/test_envoy_overload.py runs it under load)."""

from __future__ import annotations

from pathlib import Path

from llamaswap.config import parse_config
from llamaswap.envoy.binary import validate_bootstrap
from llamaswap.envoy.bootstrap import build_bootstrap, render_bootstrap
from llamaswap.envoy.overload import HEAP_SHARE_OF_MEMORY_LIMIT, heap_budget


def test_the_heap_budget() -> None:
    default = parse_config({})
    assert heap_budget(default, None) == 0
    assert heap_budget(default, 1024 * 2**20) == int(1024 * 2**20 * HEAP_SHARE_OF_MEMORY_LIMIT)
    fixed = parse_config({"envoy": {"maxHeapBytes": 300_000_000}})
    assert heap_budget(fixed, None) == heap_budget(fixed, 2**30) == 300_000_000


def test_no_budget_no_overload_manager() -> None:
    assert "overload_manager" not in build_bootstrap(parse_config({}))


def test_envoy_accepts_the_overload_manager(tmp_path: Path) -> None:
    bootstrap = build_bootstrap(parse_config({}), memory_limit_bytes=512 * 2**20)
    actions = {a["name"]: a["triggers"][0]["threshold"]["value"] for a in bootstrap["overload_manager"]["actions"]}
    assert actions["envoy.overload_actions.stop_accepting_requests"] == 0.95
    assert actions["envoy.overload_actions.shrink_heap"] < 0.95
    path = tmp_path / "envoy.yaml"
    path.write_text(render_bootstrap(bootstrap))
    result = validate_bootstrap(str(path))
    assert result.returncode == 0, result.stdout + result.stderr
