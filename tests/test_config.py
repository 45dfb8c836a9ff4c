"""YAML configuration: the specification's file, defaults, and every kind of bad file.

Bad files are checked through the real command, ``python -m llamaswap check-config -c F``:
exit status 2 and the key path on stderr.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from llamaswap.config import Config, ConfigError, load_config, parse_config
from llamaswap.core import ManualClock, Policy, QueueFull, Scheduler, parse_priority

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


def write(tmp_path: Path, text: str, name: str = "config.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def check_config(path: Path | str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "llamaswap", "check-config", "-c", str(path)],
        cwd=cwd, capture_output=True, text=True, timeout=60,
    )


# -- good files ----------------------------------------------------------------------------


def test_the_specification_yaml_loads(tmp_path):
    cfg = load_config(write(tmp_path, SPEC_YAML))
    assert cfg.scheduler.use == "serial"
    assert cfg.scheduler.aging_divisor_s == 60
    assert cfg.scheduler.swap_affinity_bonus == 10
    assert dict(cfg.model_priorities) == {}
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
    assert cfg.scheduler.use == "serial"
    assert cfg.scheduler.aging_divisor_s == 60
    assert cfg.scheduler.swap_affinity_bonus == 10
    assert dict(cfg.model_priorities) == {}
    assert cfg.policy().name == "serial"


def test_defaults_without_a_file():
    cfg = load_config(None)
    assert isinstance(cfg, Config)
    assert (cfg.scheduler.use, cfg.scheduler.aging_divisor_s, cfg.scheduler.swap_affinity_bonus) == ("serial", 60, 10)


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
    assert cfg.scheduler.use == "fifo"
    assert dict(cfg.model_priorities) == {"qwen": 10, "llama": 0}
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
    assert cfg.scheduler.aging_divisor_s == 0.5
    assert cfg.scheduler.swap_affinity_bonus == 0
    assert dict(cfg.model_priorities) == {"a": -3}
    assert cfg.policy().aging_divisor_s == 0.5


@pytest.mark.parametrize("divisor", [0, 1, 60, 3600, 0.25])
def test_aging_divisor_accepts_zero_and_positive_numbers(tmp_path, divisor):
    cfg = load_config(write(tmp_path, f"routing: {{scheduler: {{settings: {{serial: {{agingDivisor: {divisor}}}}}}}}}\n"))
    assert cfg.scheduler.aging_divisor_s == divisor


@pytest.mark.parametrize("bonus", [0, 1, 10, 98, 99])
def test_bonus_in_range_loads_without_warning(tmp_path, bonus):
    warnings: list[str] = []
    cfg = load_config(write(tmp_path, f"routing: {{scheduler: {{settings: {{serial: {{swapAffinityBonus: {bonus}}}}}}}}}\n"),
                      warn=warnings.append)
    assert cfg.scheduler.swap_affinity_bonus == bonus
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
    assert dict(cfg.model_priorities) == {"qwen3": 5, "gemma": 0}
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


# -- the swapAffinityBonus cap -------------------------------------------------------------


def test_bonus_above_99_is_capped_with_a_warning(tmp_path):
    path = write(tmp_path, "routing: {scheduler: {settings: {serial: {swapAffinityBonus: 150}}}}\n")
    warnings: list[str] = []
    cfg = load_config(path, warn=warnings.append)
    assert cfg.scheduler.swap_affinity_bonus == 99
    assert cfg.policy().swap_affinity_bonus == 99
    assert len(warnings) == 1
    assert f"{SERIAL}.swapAffinityBonus" in warnings[0]
    assert "99" in warnings[0]
    result = check_config(path, tmp_path)
    assert result.returncode == 0
    assert result.stdout.strip() == "ok"
    assert f"{SERIAL}.swapAffinityBonus" in result.stderr
    assert "warning" in result.stderr.lower()


# -- bad files -----------------------------------------------------------------------------

BAD_FILES = {
    # name: (YAML, key path that stderr must name, another fragment it must contain)
    "unknown serial key": ("routing: {scheduler: {settings: {serial: {agingDivisr: 5}}}}",
                           f"{SERIAL}.agingDivisr", "did you mean 'agingDivisor'"),
    "unknown bonus key": ("routing: {scheduler: {settings: {serial: {swapAfinityBonus: 5}}}}",
                          f"{SERIAL}.swapAfinityBonus", "did you mean 'swapAffinityBonus'"),
    "unknown top-level key": ("rouding:\n  scheduler: {}\n", "rouding", "did you mean 'routing'"),
    "unknown scheduler key": ("routing: {scheduler: {usse: fifo}}", "routing.scheduler.usse", "did you mean 'use'"),
    "unknown model key": ("models: {qwen: {priorty: 3}}", "models.qwen.priorty", "did you mean 'priority'"),
    "unknown key, nothing close": ("routing: {scheduler: {zzzzzz: 1}}", "routing.scheduler.zzzzzz", "unknown key"),
    "divisor is a string": ("routing: {scheduler: {settings: {serial: {agingDivisor: sixty}}}}",
                            f"{SERIAL}.agingDivisor", "number"),
    "divisor is negative": ("routing: {scheduler: {settings: {serial: {agingDivisor: -1}}}}",
                            f"{SERIAL}.agingDivisor", "-1"),
    "divisor is infinite": ("routing: {scheduler: {settings: {serial: {agingDivisor: .inf}}}}",
                            f"{SERIAL}.agingDivisor", ""),
    "divisor is a boolean": ("routing: {scheduler: {settings: {serial: {agingDivisor: true}}}}",
                             f"{SERIAL}.agingDivisor", ""),
    "bonus is fractional": ("routing: {scheduler: {settings: {serial: {swapAffinityBonus: 1.5}}}}",
                            f"{SERIAL}.swapAffinityBonus", "integer"),
    "bonus is a string": ("routing: {scheduler: {settings: {serial: {swapAffinityBonus: ten}}}}",
                          f"{SERIAL}.swapAffinityBonus", "integer"),
    "bonus is negative": ("routing: {scheduler: {settings: {serial: {swapAffinityBonus: -1}}}}",
                          f"{SERIAL}.swapAffinityBonus", "-1"),
    "model priority is a word": ("models: {qwen: {priority: high}}", "models.qwen.priority", "integer"),
    "model priority is fractional": ("models: {qwen: {priority: 2.5}}", "models.qwen.priority", "integer"),
    "bad use": ("routing: {scheduler: {use: lifo}}", "routing.scheduler.use", "lifo"),
    "use is a number": ("routing: {scheduler: {use: 1}}", "routing.scheduler.use", ""),
    "routing is a list": ("routing: [scheduler]", "routing", "mapping"),
    "settings is a scalar": ("routing: {scheduler: {settings: 5}}", "routing.scheduler.settings", "mapping"),
    "models is a list": ("models: [qwen, llama]", "models", "mapping"),
    "a model is a scalar": ("models: {qwen: 5}", "models.qwen", "mapping"),
    "listen without a port": ("listen: {http: localhost}", "listen.http", "host:port"),
    "listen port too big": ("listen: {grpc: '127.0.0.1:99999'}", "listen.grpc", "99999"),
    "listen port not a number": ("listen: {admin: 'localhost:http'}", "listen.admin", ""),
    "listen is a number": ("listen: {http: 8080}", "listen.http", ""),
    "listen unknown key": ("listen: {htp: '127.0.0.1:8080'}", "listen.htp", "did you mean 'http'"),
    "upstream url scheme": ("upstream: {url: 'ftp://127.0.0.1:8081'}", "upstream.url", "http"),
    "upstream url not a url": ("upstream: {url: 'not a url'}", "upstream.url", ""),
    "upstream url without host": ("upstream: {url: 'http://:8081'}", "upstream.url", ""),
    "upstream url bad port": ("upstream: {url: 'http://127.0.0.1:port'}", "upstream.url", "port"),
    "upstream url is a number": ("upstream: {url: 8081}", "upstream.url", ""),
    "maxQueued negative": ("routing: {scheduler: {maxQueued: -1}}", "routing.scheduler.maxQueued", "-1"),
    "maxQueued fractional": ("routing: {scheduler: {maxQueued: 2.5}}", "routing.scheduler.maxQueued", "integer"),
    "maxWaitSeconds negative": ("routing: {scheduler: {maxWaitSeconds: -3}}", "routing.scheduler.maxWaitSeconds", ""),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_file_exits_2_and_names_the_key_path(tmp_path, case):
    text, key_path, fragment = BAD_FILES[case]
    path = write(tmp_path, text + "\n")
    result = check_config(path.name, tmp_path)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert result.stdout.strip() != "ok"
    assert key_path in result.stderr
    assert fragment in result.stderr
    # and the library says the same, with the path as data
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert key_path in [p.path for p in info.value.problems]


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
    """)
    result = check_config(path, tmp_path)
    assert result.returncode == 2
    for key_path in ["routing.scheduler.use", f"{SERIAL}.agingDivisor", f"{SERIAL}.swapAffinityBonus",
                     "models.qwen.priority", "listen.http", "upstream.url"]:
        assert key_path in result.stderr
    assert len([line for line in result.stderr.splitlines() if line.strip()]) >= 6


def test_malformed_yaml(tmp_path):
    path = write(tmp_path, "routing:\n  scheduler: [\n    use: serial\n", name="broken.yaml")
    result = check_config(path.name, tmp_path)
    assert result.returncode == 2
    assert "broken.yaml" in result.stderr
    assert "YAML" in result.stderr
    assert "line" in result.stderr


def test_tab_indented_yaml(tmp_path):
    path = write(tmp_path, "routing:\n\tscheduler: {}\n", name="tabs.yaml")
    result = check_config(path.name, tmp_path)
    assert result.returncode == 2
    assert "tabs.yaml" in result.stderr


def test_missing_file(tmp_path):
    result = check_config("does-not-exist.yaml", tmp_path)
    assert result.returncode == 2
    assert "does-not-exist.yaml" in result.stderr
    assert result.stdout.strip() != "ok"


def test_not_utf8(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("routing: {scheduler: {use: s\xe9rial}}\n".encode("latin-1"))
    result = check_config(path.name, tmp_path)
    assert result.returncode == 2
    assert "latin1.yaml" in result.stderr


@pytest.mark.parametrize("text", ["- routing\n- models\n", "just a string\n", "42\n"])
def test_top_level_must_be_a_mapping(tmp_path, text):
    path = write(tmp_path, text)
    result = check_config(path.name, tmp_path)
    assert result.returncode == 2
    assert "mapping" in result.stderr
    with pytest.raises(ConfigError):
        parse_config(yaml.safe_load(text))


def test_parse_config_problems_carry_paths():
    with pytest.raises(ConfigError) as info:
        parse_config({"routing": {"scheduler": {"settings": {"serial": {"swapAffinityBonus": -1, "agingDivisr": 1}}}}})
    paths = {p.path for p in info.value.problems}
    assert paths == {f"{SERIAL}.swapAffinityBonus", f"{SERIAL}.agingDivisr"}
    assert all(str(p).startswith(p.path + ":") for p in info.value.problems)


def test_policy_from_parsed_config_matches_scheduler_defaults():
    cfg = parse_config({})
    assert cfg.policy() == Policy.serial(60, 10)


def test_a_tiny_positive_aging_divisor_is_rejected_or_ages(tmp_path):
    # Time is integer nanoseconds: a divisor that rounds to 0 ns must not silently mean "no aging".
    path = write(tmp_path, "routing: {scheduler: {settings: {serial: {agingDivisor: 1.0e-10}}}}\n")
    try:
        cfg = load_config(path)
    except ConfigError as exc:
        assert f"{SERIAL}.agingDivisor" in [p.path for p in exc.problems]
        return
    clock = ManualClock()
    scheduler = Scheduler(cfg.policy(), clock)
    scheduler.enqueue("old", parse_priority("0"))
    clock.advance(1)
    scheduler.enqueue("new", parse_priority("5"))
    assert scheduler.next().request_id == "old"  # a second of waiting is worth ~1e10 points


def test_a_tiny_positive_max_wait_is_rejected_or_enforced(tmp_path):
    path = write(tmp_path, "routing: {scheduler: {maxWaitSeconds: 1.0e-10}}\n")
    try:
        cfg = load_config(path)
    except ConfigError as exc:
        assert "routing.scheduler.maxWaitSeconds" in [p.path for p in exc.problems]
        return
    clock = ManualClock()
    scheduler = Scheduler(cfg.policy(), clock)
    scheduler.enqueue("a", parse_priority(None))
    assert scheduler.next_deadline_ns() is not None
    clock.advance(1)
    assert [r.request_id for r in scheduler.expire_overdue()] == ["a"]
