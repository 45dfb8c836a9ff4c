"""YAML configuration: the specification's file, defaults, and every kind of bad file.

Bad files are checked through the real command, ``python -m llamaswap check-config -c F``:
exit status 2 and the key path on stderr.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from pydantic import ValidationError

import llamaswap

from llamaswap.config import (
    AbandonedGeneration,
    Config,
    ConfigError,
    HostPort,
    ModelCheck,
    PriorityMode,
    SchedulerName,
    load_config,
    load_document,
    parse_config,
)
from llamaswap.core import ManualClock, Policy, QueueFull, Scheduler, parse_priority
from llamaswap.core.priority import PriorityPolicy

# The Configuration block of ../shared/spec/request-priority.md, verbatim.
SPEC_YAML = """\
routing:
  scheduler:
    use: serial
    settings:
      serial:
        # Seconds of waiting per priority point. 0 disables aging.
        agingDivisor: 60
        # Bonus for a request needing no model swap. 0..99; 0 disables it.
        swapAffinityBonus: 10
"""

SERIAL = "routing.scheduler.settings.serial"


def model_priorities(cfg: Config) -> dict[str, int]:
    return {model_id: model.priority for model_id, model in cfg.models.items()}


def write(tmp_path: Path, text: str, name: str = "config.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


# The command must run the llamaswap this process imports (a relative PYTHONPATH would not reach it from cwd).
_SOURCE_ROOT = str(Path(llamaswap.__file__).resolve().parents[1])


def check_config(path: Path | str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [_SOURCE_ROOT, os.environ.get("PYTHONPATH")]))}
    return subprocess.run(
        [sys.executable, "-m", "llamaswap", "check-config", "-c", str(path)],
        cwd=cwd, capture_output=True, text=True, timeout=60, env=env,
    )


# -- good files ----------------------------------------------------------------------------


def test_the_specification_yaml_loads(tmp_path):
    cfg = load_config(write(tmp_path, SPEC_YAML))
    assert cfg.routing.scheduler.use is SchedulerName.SERIAL
    assert cfg.routing.scheduler.settings.serial.aging_divisor == 60
    assert cfg.routing.scheduler.settings.serial.swap_affinity_bonus == 10
    assert model_priorities(cfg) == {}
    policy = cfg.policy()
    assert policy.name == "serial"
    assert policy.aging_divisor_s == 60
    assert policy.swap_affinity_bonus == 10


def test_the_specification_yaml_passes_check_config(tmp_path):
    path = write(tmp_path, SPEC_YAML)
    result = check_config(path.name, tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
    assert "error" not in result.stderr


@pytest.mark.parametrize("text", ["", "# nothing but a comment\n", "{}\n", "routing:\n", "routing:\n  scheduler:\n"])
def test_defaults(tmp_path, text):
    cfg = load_config(write(tmp_path, text))
    assert cfg.routing.scheduler.use is SchedulerName.SERIAL
    assert cfg.routing.scheduler.settings.serial.aging_divisor == 60
    assert cfg.routing.scheduler.settings.serial.swap_affinity_bonus == 10
    assert model_priorities(cfg) == {}
    assert cfg.policy().name == "serial"
    assert cfg == Config()


def test_defaults_without_a_file():
    cfg = load_config(None)
    assert isinstance(cfg, Config)
    serial = cfg.routing.scheduler.settings.serial
    assert (cfg.routing.scheduler.use, serial.aging_divisor, serial.swap_affinity_bonus) == ("serial", 60, 10)
    assert cfg.source == "<defaults>"


def test_fifo_with_model_priorities_queues_a_batch_request_at_minus_90(tmp_path):
    cfg = load_config(write(tmp_path, """\
        routing:
          scheduler:
            use: fifo
        models:
          qwen:
            priority: 10
            cmd: llama-server --port ${PORT} -m qwen.gguf
          llama:
            cmd: llama-server --port ${PORT} -m llama.gguf
    """))
    assert cfg.routing.scheduler.use is SchedulerName.FIFO
    assert model_priorities(cfg) == {"qwen": 10, "llama": 0}
    policy = cfg.policy()
    assert policy.name == "fifo"
    scheduler = Scheduler(policy, ManualClock())
    scheduler.enqueue("job", parse_priority("batch"), "qwen")
    assert scheduler.score_of("job") == -90


def test_serial_settings_values(tmp_path):
    cfg = load_config(write(tmp_path, """\
        routing:
          scheduler:
            settings:
              serial:
                agingDivisor: 0.5
                swapAffinityBonus: 0
        models:
          a:
            priority: -3
    """))
    assert cfg.routing.scheduler.settings.serial.aging_divisor == 0.5
    assert cfg.routing.scheduler.settings.serial.swap_affinity_bonus == 0
    assert model_priorities(cfg) == {"a": -3}
    assert cfg.policy().aging_divisor_s == 0.5


@pytest.mark.parametrize("divisor", [0, 1, 60, 3600, 0.25])
def test_aging_divisor_accepts_zero_and_positive_numbers(tmp_path, divisor):
    cfg = load_config(write(tmp_path, f"routing: {{scheduler: {{settings: {{serial: {{agingDivisor: {divisor}}}}}}}}}\n"))
    assert cfg.routing.scheduler.settings.serial.aging_divisor == divisor


@pytest.mark.parametrize("bonus", [0, 1, 10, 98, 99])
def test_bonus_in_range_loads_without_warning(tmp_path, bonus):
    warnings: list[str] = []
    cfg = load_config(write(tmp_path, f"routing: {{scheduler: {{settings: {{serial: {{swapAffinityBonus: {bonus}}}}}}}}}\n"),
                      warn=warnings.append)
    assert cfg.routing.scheduler.settings.serial.swap_affinity_bonus == bonus
    assert cfg.policy().swap_affinity_bonus == bonus
    assert warnings == []


def test_models_accept_llama_swap_keys(tmp_path):
    path = write(tmp_path, """\
        healthCheckTimeout: 500
        logLevel: info
        startPort: 10001
        macros:
          server: /usr/bin/llama-server
        models:
          qwen3:
            cmd: ${server} --port ${PORT} -m qwen3.gguf
            proxy: http://127.0.0.1:${PORT}
            ttl: 300
            aliases: [qwen]
            env: ["CUDA_VISIBLE_DEVICES=0"]
            checkEndpoint: /health
            useModelName: qwen3-8b
            unlisted: false
            name: Qwen 3
            description: a model
            priority: 5
          gemma:
            cmd: llama-server -m gemma.gguf
            proxy: http://127.0.0.1:9999
            ttl: 60
        groups:
          all:
            members: [qwen3, gemma]
    """)
    cfg = load_config(path)
    assert model_priorities(cfg) == {"qwen3": 5, "gemma": 0}
    result = check_config(path, tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_queue_limits_reach_the_policy(tmp_path):
    cfg = load_config(write(tmp_path, """\
        routing:
          scheduler:
            use: serial
            maxQueued: 2
            maxWaitSeconds: 30
    """))
    policy = cfg.policy()
    assert (policy.max_queued, policy.max_wait_s) == (2, 30)
    scheduler = Scheduler(policy, ManualClock())
    scheduler.enqueue("a", parse_priority(None))
    scheduler.enqueue("b", parse_priority(None))
    with pytest.raises(QueueFull):
        scheduler.enqueue("c", parse_priority(None))
    assert scheduler.next_deadline_ns() == 30_000_000_000


def test_listen_and_upstream_strings(tmp_path):
    cfg = load_config(write(tmp_path, """\
        listen:
          http: 0.0.0.0:8080
          grpc: "127.0.0.1:9001"
          admin: "[::1]:9091"
        upstream:
          url: http://127.0.0.1:8081
    """))
    assert (cfg.listen.http.host, cfg.listen.http.port) == ("0.0.0.0", 8080)
    assert (cfg.listen.grpc.host, cfg.listen.grpc.port) == ("127.0.0.1", 9001)
    assert (cfg.listen.admin.host, cfg.listen.admin.port) == ("::1", 9091)
    assert cfg.upstream.url == "http://127.0.0.1:8081"


# -- the swapAffinityBonus range -----------------------------------------------------------


def test_bonus_above_99_is_an_error(tmp_path):
    # It used to be capped with a warning; the Helm chart refused it. Both refuse it now.
    path = write(tmp_path, "routing: {scheduler: {settings: {serial: {swapAffinityBonus: 150}}}}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert [str(p) for p in info.value.problems] == [
        f"{SERIAL}.swapAffinityBonus: must be 0..99 (0 disables it; it must stay below the band spacing of 100), "
        "got 150"
    ]
    result = check_config(path.name, tmp_path)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert result.stdout.strip() != "ok"
    assert f"error: {SERIAL}.swapAffinityBonus: must be 0..99" in result.stderr


# -- bad files -----------------------------------------------------------------------------

BAD_FILES = {
    # name: (YAML, key path that stderr must name, another fragment it must contain)
    "unknown serial key": ("routing: {scheduler: {settings: {serial: {agingDivisr: 5}}}}",
                           f"{SERIAL}.agingDivisr", "unknown key; did you mean 'agingDivisor'?"),
    "unknown bonus key": ("routing: {scheduler: {settings: {serial: {swapAfinityBonus: 5}}}}",
                          f"{SERIAL}.swapAfinityBonus", "did you mean 'swapAffinityBonus'"),
    "unknown top-level key": ("rouding:\n  scheduler: {}\n", "rouding", "did you mean 'routing'"),
    "unknown scheduler key": ("routing: {scheduler: {usse: fifo}}", "routing.scheduler.usse", "did you mean 'use'"),
    "unknown model key": ("models: {qwen: {priorty: 3}}", "models.qwen.priorty", "did you mean 'priority'"),
    "unknown key, nothing close": ("routing: {scheduler: {zzzzzz: 1}}", "routing.scheduler.zzzzzz",
                                   "unknown key; allowed here: maxQueued, maxRunSeconds, maxWaitSeconds, settings, "
                                   "use"),
    "divisor is a string": ("routing: {scheduler: {settings: {serial: {agingDivisor: sixty}}}}",
                            f"{SERIAL}.agingDivisor", "must be a number, got a string 'sixty'"),
    "divisor is negative": ("routing: {scheduler: {settings: {serial: {agingDivisor: -1}}}}",
                            f"{SERIAL}.agingDivisor", "must be >= 0 (0 disables aging), got -1"),
    "divisor is infinite": ("routing: {scheduler: {settings: {serial: {agingDivisor: .inf}}}}",
                            f"{SERIAL}.agingDivisor", "must be a finite number, got inf"),
    "divisor is a boolean": ("routing: {scheduler: {settings: {serial: {agingDivisor: true}}}}",
                             f"{SERIAL}.agingDivisor", "must be a number, got a boolean true"),
    "bonus is fractional": ("routing: {scheduler: {settings: {serial: {swapAffinityBonus: 1.5}}}}",
                            f"{SERIAL}.swapAffinityBonus", "must be an integer, got a number 1.5"),
    "bonus is a string": ("routing: {scheduler: {settings: {serial: {swapAffinityBonus: ten}}}}",
                          f"{SERIAL}.swapAffinityBonus", "must be an integer, got a string 'ten'"),
    "bonus is negative": ("routing: {scheduler: {settings: {serial: {swapAffinityBonus: -1}}}}",
                          f"{SERIAL}.swapAffinityBonus", "must be 0..99 (0 disables it"),
    "bonus is 100": ("routing: {scheduler: {settings: {serial: {swapAffinityBonus: 100}}}}",
                     f"{SERIAL}.swapAffinityBonus", "below the band spacing of 100), got 100"),
    "model priority is a word": ("models: {qwen: {priority: high}}", "models.qwen.priority",
                                 "must be an integer, got a string 'high'"),
    "model priority is fractional": ("models: {qwen: {priority: 2.5}}", "models.qwen.priority", "integer"),
    "bad use": ("routing: {scheduler: {use: lifo}}", "routing.scheduler.use",
                "must be one of 'serial', 'fifo', got 'lifo'"),
    "use is a number": ("routing: {scheduler: {use: 1}}", "routing.scheduler.use",
                        "must be one of 'serial', 'fifo', got a number 1"),
    "routing is a list": ("routing: [scheduler]", "routing", "must be a mapping, got a list"),
    "settings is a scalar": ("routing: {scheduler: {settings: 5}}", "routing.scheduler.settings",
                             "must be a mapping, got a number 5"),
    "models is a list": ("models: [qwen, llama]", "models", "must be a mapping, got a list"),
    "a model is a scalar": ("models: {qwen: 5}", "models.qwen", "must be a mapping, got a number 5"),
    "listen without a port": ("listen: {http: localhost}", "listen.http", "must be 'host:port' with a port 0..65535"),
    "listen port too big": ("listen: {grpc: '127.0.0.1:99999'}", "listen.grpc", "99999"),
    "listen port not a number": ("listen: {admin: 'localhost:http'}", "listen.admin", "'localhost:http'"),
    "listen is a number": ("listen: {http: 8080}", "listen.http", "must be a string 'host:port', got a number 8080"),
    "listen unknown key": ("listen: {htp: '127.0.0.1:8080'}", "listen.htp", "did you mean 'http'"),
    "upstream url scheme": ("upstream: {url: 'ftp://127.0.0.1:8081'}", "upstream.url",
                            "must be an http:// or https:// URL with a host"),
    "upstream url not a url": ("upstream: {url: 'not a url'}", "upstream.url", "'not a url'"),
    "upstream url without host": ("upstream: {url: 'http://:8081'}", "upstream.url", "with a host"),
    "upstream url bad port": ("upstream: {url: 'http://127.0.0.1:port'}", "upstream.url", "invalid port"),
    "upstream url is a number": ("upstream: {url: 8081}", "upstream.url", "got a number 8081"),
    "maxQueued negative": ("routing: {scheduler: {maxQueued: -1}}", "routing.scheduler.maxQueued",
                           "must be >= 0 (0 = unlimited), got -1"),
    "maxQueued fractional": ("routing: {scheduler: {maxQueued: 2.5}}", "routing.scheduler.maxQueued", "integer"),
    "maxQueued is a quoted number": ("routing: {scheduler: {maxQueued: '5'}}", "routing.scheduler.maxQueued",
                                     "must be an integer, got a string '5'"),
    "maxWaitSeconds negative": ("routing: {scheduler: {maxWaitSeconds: -3}}", "routing.scheduler.maxWaitSeconds",
                                "must be >= 0 (0 = wait forever), got -3"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_file_exits_2_and_names_the_key_path(tmp_path, case):
    text, key_path, fragment = BAD_FILES[case]
    path = write(tmp_path, text + "\n")
    result = check_config(path.name, tmp_path)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert result.stdout.strip() != "ok"
    assert f"error: {key_path}: " in result.stderr
    assert fragment in result.stderr
    # and the library says the same, with the path as data
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert [p.path for p in info.value.problems] == [key_path]
    assert fragment in info.value.problems[0].message


def test_every_problem_is_reported_at_once(tmp_path):
    path = write(tmp_path, """\
        routing:
          scheduler:
            use: lifo
            settings:
              serial:
                agingDivisor: -5
                swapAffinityBonus: -2
        models:
          qwen:
            priority: high
        listen:
          http: nowhere
        upstream:
          url: gopher://x
          settleTimeoutSeconds: 0
        estimates:
          samples: "5"
    """)
    result = check_config(path, tmp_path)
    assert result.returncode == 2
    key_paths = ["routing.scheduler.use", f"{SERIAL}.agingDivisor", f"{SERIAL}.swapAffinityBonus",
                 "models.qwen.priority", "listen.http", "upstream.url", "upstream.settleTimeoutSeconds",
                 "estimates.samples"]
    for key_path in key_paths:
        assert f"error: {key_path}: " in result.stderr
    assert len([line for line in result.stderr.splitlines() if line.strip()]) == len(key_paths)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert sorted(p.path for p in info.value.problems) == sorted(key_paths)


def test_malformed_yaml(tmp_path):
    path = write(tmp_path, "routing:\n  scheduler: [\n    use: serial\n", name="broken.yaml")
    result = check_config(path.name, tmp_path)
    assert result.returncode == 2
    pattern = r"error: broken\.yaml: is not valid YAML at line \d+, column \d+: \S"
    assert re.search(pattern, result.stderr), result.stderr


def test_tab_indented_yaml(tmp_path):
    path = write(tmp_path, "routing:\n\tscheduler: {}\n", name="tabs.yaml")
    result = check_config(path.name, tmp_path)
    assert result.returncode == 2
    assert "error: tabs.yaml: is not valid YAML at line 2, column 1: " in result.stderr


def test_missing_file(tmp_path):
    result = check_config("does-not-exist.yaml", tmp_path)
    assert result.returncode == 2
    assert "error: does-not-exist.yaml: cannot read the file: No such file or directory" in result.stderr
    assert result.stdout.strip() != "ok"


def test_not_utf8(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("routing: {scheduler: {use: s\xe9rial}}\n".encode("latin-1"))
    result = check_config(path.name, tmp_path)
    assert result.returncode == 2
    assert "error: latin1.yaml: is not UTF-8 text (byte 0xe9 at offset 28)" in result.stderr


@pytest.mark.parametrize("text", ["- routing\n- models\n", "just a string\n", "42\n"])
def test_top_level_must_be_a_mapping(tmp_path, text):
    path = write(tmp_path, text)
    result = check_config(path.name, tmp_path)
    assert result.returncode == 2
    assert "error: (top level): must be a mapping, got " in result.stderr
    with pytest.raises(ConfigError) as info:
        parse_config(yaml.safe_load(text))
    assert [p.path for p in info.value.problems] == ["(top level)"]


def test_parse_config_problems_carry_paths():
    with pytest.raises(ConfigError) as info:
        parse_config({"routing": {"scheduler": {"settings": {"serial": {"swapAffinityBonus": -1, "agingDivisr": 1}}}}})
    paths = {p.path for p in info.value.problems}
    assert paths == {f"{SERIAL}.swapAffinityBonus", f"{SERIAL}.agingDivisr"}
    assert all(str(p) == f"{p.path}: {p.message}" for p in info.value.problems)


def test_policy_from_parsed_config_matches_the_documented_defaults():
    cfg = parse_config({})
    assert cfg.policy() == Policy.serial(60, 10, max_queued=0, max_wait_s=0)


def test_fifo_policy_carries_the_limits():
    cfg = parse_config({"routing": {"scheduler": {"use": "fifo", "maxQueued": 4, "maxWaitSeconds": 2.5}},
                        "models": {"a": {"priority": 3}}})
    assert cfg.policy() == Policy.fifo({"a": 3}, max_queued=4, max_wait_s=2.5)


@pytest.mark.parametrize("document, key_path", [
    ({"routing": {"scheduler": {"settings": {"serial": {"agingDivisor": 1.0e-10}}}}}, f"{SERIAL}.agingDivisor"),
    ({"routing": {"scheduler": {"maxWaitSeconds": 1.0e-10}}}, "routing.scheduler.maxWaitSeconds"),
])
def test_a_tiny_positive_duration_is_rejected(document, key_path):
    # Time is integer nanoseconds: a value that rounds to 0 ns must not silently mean "off".
    with pytest.raises(ConfigError) as info:
        parse_config(document)
    assert [p.path for p in info.value.problems] == [key_path]


@pytest.mark.parametrize("seconds", [0.001, 0.5])
def test_a_millisecond_or_more_is_enforced(seconds):
    cfg = parse_config({"routing": {"scheduler": {"maxWaitSeconds": seconds}}})
    assert cfg.routing.scheduler.max_wait_seconds == seconds
    clock = ManualClock()
    scheduler = Scheduler(cfg.policy(), clock)
    scheduler.enqueue("a", parse_priority(None))
    assert scheduler.next_deadline_ns() == round(seconds * 1e9)
    clock.advance(1)
    assert [r.request_id for r in scheduler.expire_overdue()] == ["a"]
