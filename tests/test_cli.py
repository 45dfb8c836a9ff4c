"""The `llamaswap` command as a user meets it: help, check-config's explanation, exit statuses."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


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
