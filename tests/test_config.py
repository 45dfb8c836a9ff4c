"""YAML configuration: the specification's file, defaults, and every kind of bad file.

Bad files are checked through the real command, ``python -m llamaswap check-config -c F``:
exit status 2 and the key path on stderr.
"""

from __future__ import annotations

import logging
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
    PolicyName,
    load_config,
    load_document,
    parse_config,
)
from llamaswap.core import ManualClock, Policy, QueueFull, Scheduler, Slots, parse_priority
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
    assert cfg.routing.scheduler.use is PolicyName.SERIAL
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
    assert result.stdout.splitlines()[0] == "ok"
    assert "error" not in result.stderr


@pytest.mark.parametrize("text", ["", "# nothing but a comment\n", "{}\n", "routing:\n", "routing:\n  scheduler:\n"])
def test_defaults(tmp_path, text):
    cfg = load_config(write(tmp_path, text))
    assert cfg.routing.scheduler.use is PolicyName.SERIAL
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
    assert cfg.routing.scheduler.use is PolicyName.FIFO
    assert model_priorities(cfg) == {"qwen": 10, "llama": 0}
    policy = cfg.policy()
    assert policy.name == "fifo"
    scheduler = Scheduler(policy, ManualClock())
    scheduler.enqueue("job", parse_priority("batch"), "qwen")
    assert scheduler.snapshot().waiting[0].score == -90


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
    cfg = load_config(write(tmp_path,
                            f"routing: {{scheduler: {{settings: {{serial: {{agingDivisor: {divisor}}}}}}}}}\n"))
    assert cfg.routing.scheduler.settings.serial.aging_divisor == divisor


@pytest.mark.parametrize("bonus", [0, 1, 10, 98, 99])
def test_bonus_in_range_loads_without_warning(tmp_path, bonus):
    warnings: list[str] = []
    cfg = load_config(write(tmp_path,
                            f"routing: {{scheduler: {{settings: {{serial: {{swapAffinityBonus: {bonus}}}}}}}}}\n"),
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
    assert result.stdout.splitlines()[0] == "ok"


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
    assert "ok" not in result.stdout.splitlines()
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
    "objective priority is a word": ("routing: {objectives: {chat: urgent}}", "routing.objectives.chat",
                                     "must be a priority: a 64-bit integer or one of interactive, normal, batch"),
    "objective priority is fractional": ("routing: {objectives: {chat: 1.5}}", "routing.objectives.chat",
                                         "got a number 1.5"),
    "objective name is not a Kubernetes name": ("routing: {objectives: {Chat_1: 5}}", "routing.objectives.Chat_1",
                                                "named like a Kubernetes object"),
    "a model is a scalar": ("models: {qwen: 5}", "models.qwen", "must be a mapping, got a number 5"),
    "listen without a port": ("listen: {http: localhost}", "listen.http", "must be 'host:port' with a port 0..65535"),
    "listen port too big": ("listen: {grpc: '127.0.0.1:99999'}", "listen.grpc", "99999"),
    "listen port not a number": ("listen: {admin: 'localhost:http'}", "listen.admin", "'localhost:http'"),
    "listen is a number": ("listen: {http: 8080}", "listen.http", "must be a string 'host:port', got a number 8080"),
    "grpc on every address": ("listen: {grpc: '0.0.0.0:9000'}", "listen.grpc",
                              "not a loopback address: anyone who reaches it can renew leases for ever"),
    "admin on a pod address": ("listen: {admin: '10.0.0.5:9090'}", "listen.admin", "set listen.allowRemote: true"),
    "admin on a host name": ("listen: {admin: 'sidecar.example:9090'}", "listen.admin", "Bind it to 127.0.0.1"),
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
    "reservedSlots not below the slots": ("routing: {scheduler: {settings: {serial: {reservedSlots: 1}}}}",
                                          f"{SERIAL}.reservedSlots",
                                          "leave upstream.slots (1) no slot for non-interactive requests: "
                                          "set it below 1, or raise upstream.slots"),
    "upstream slots zero": ("upstream: {slots: 0}", "upstream.slots",
                            "must be an integer >= 1 or 'auto' (ask the upstream), got a number 0"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_file_exits_2_and_names_the_key_path(tmp_path, case):
    text, key_path, fragment = BAD_FILES[case]
    path = write(tmp_path, text + "\n")
    result = check_config(path.name, tmp_path)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "ok" not in result.stdout.splitlines()
    assert f"error: {key_path}: " in result.stderr
    assert fragment in result.stderr
    # and the library says the same, with the path as data
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert [p.path for p in info.value.problems] == [key_path]
    assert fragment in info.value.problems[0].message


# Exact problems, through the library: (document, "path: message").
BAD_DOCUMENTS = {
    # strict types: no coercion of strings or booleans
    "integer as a string": ({"estimates": {"samples": "50"}},
                            "estimates.samples: must be an integer, got a string '50'"),
    "integer as a boolean": ({"routing": {"scheduler": {"maxQueued": True}}},
                             "routing.scheduler.maxQueued: must be an integer, got a boolean true"),
    "integer as a whole float": ({"envoy": {"maxSidecarStreams": 10.0}},
                                 "envoy.maxSidecarStreams: must be an integer, got a number 10.0"),
    "number as a boolean": ({"routing": {"scheduler": {"maxRunSeconds": True}}},
                            "routing.scheduler.maxRunSeconds: must be a number, got a boolean true"),
    "number as a string": ({"envoy": {"leaseSeconds": "3"}}, "envoy.leaseSeconds: must be a number, got a string '3'"),
    "boolean as a string": ({"envoy": {"failOpen": "true"}},
                            "envoy.failOpen: must be true or false, got a string 'true'"),
    "boolean as a number": ({"envoy": {"failOpen": 1}}, "envoy.failOpen: must be true or false, got a number 1"),
    "boolean as nothing": ({"envoy": {"failOpen": None}}, "envoy.failOpen: must be true or false, got nothing"),
    # sub-millisecond values would round to 'off'
    "tiny maxWaitSeconds": ({"routing": {"scheduler": {"maxWaitSeconds": 1e-10}}},
                            "routing.scheduler.maxWaitSeconds: must be 0 (0 = wait forever) or at least 0.001 seconds, "
                            "got 1e-10: a smaller positive value would round to 0"),
    "tiny agingDivisor": ({"routing": {"scheduler": {"settings": {"serial": {"agingDivisor": 0.0004}}}}},
                          f"{SERIAL}.agingDivisor: must be 0 (0 disables aging) or at least 0.001 seconds, got 0.0004: "
                          "a smaller positive value would round to 0"),
    "maxRunSeconds negative": ({"routing": {"scheduler": {"maxRunSeconds": -1}}},
                               "routing.scheduler.maxRunSeconds: must be >= 0 (0 = off), got -1"),
    "fifo takes only reservedSlots": ({"routing": {"scheduler": {"settings": {"fifo": {"agingDivisor": 1}}}}},
                                      "routing.scheduler.settings.fifo.agingDivisor: unknown key; "
                                      "allowed here: reservedSlots"),
    "unknown top-level key": ({"zzzzzz": 1}, "zzzzzz: unknown key; allowed here: activity, batches, envoy, estimates, "
                                             "globalTTL, listen, models, routing, security, ui, upstream, upstreams "
                                             "(and llama-swap's keys, which are ignored)"),
    "non-string key": ({1: 2}, "1: keys must be strings, got a number 1"),
    # batches
    "batches.inFlight 0": ({"batches": {"inFlight": 0}},
                           "batches.inFlight: must be >= 1 (null = the node's slots), got 0"),
    "batches.dir a number": ({"batches": {"dir": 5}},
                             "batches.dir: must be a file path, or empty for none, got a number 5"),
    "batches.maxAnswerBytes under 64 KiB": ({"batches": {"maxAnswerBytes": 1000}},
                                            "batches.maxAnswerBytes: must be >= 65536, got 1000"),
    "batches.maxAnswerBytes a size string": ({"batches": {"maxAnswerBytes": "64MiB"}},
                                             "batches.maxAnswerBytes: must be an integer, got a string '64MiB'"),
    "batches.maxFileBytes a float": ({"batches": {"maxFileBytes": 1.5}},
                                     "batches.maxFileBytes: must be an integer, got a number 1.5"),
    "batches.apiKeys a key itself": ({"batches": {"apiKeys": [{"name": "a", "key": "sk-123"}]}},
                                     "batches.apiKeys[0].key: must say where the key is, 'file:PATH' or 'env:NAME' "
                                     "(an environment variable), not the key itself (the value is not repeated "
                                     "here)"),
    "batches.apiKeys a name twice": ({"batches": {"apiKeys": [{"name": "a", "key": "env:A"},
                                                              {"name": "a", "key": "env:B"}]}},
                                     "batches.apiKeys: names a more than once: give each key its own name"),
    "batches.adminCallers without callerHeader": ({"batches": {"adminCallers": ["ops"]}},
                                                  "batches.adminCallers: names admin callers but callerHeader is "
                                                  "unset: set callerHeader to the header your proxy names callers "
                                                  "in, or remove adminCallers"),
    "batches.outputExpirySeconds under an hour": ({"batches": {"outputExpirySeconds": 60}},
                                                  "batches.outputExpirySeconds: must be 3600..2592000 (null = "
                                                  "never), got 60"),
    "batches.maxStoredBytes not a size": ({"batches": {"maxStoredBytes": "lots"}},
                                          "batches.maxStoredBytes: must be a size, a whole number of bytes "
                                          "(1000000), or a number with a unit: KiB, MiB, GiB, TiB (binary) or KB, "
                                          "MB, GB, TB (decimal), as in 80GiB, 512MiB, 1.5GB; got a string 'lots'"),
    "top level is a list": ([1], "(top level): must be a mapping, got a list"),
    # upstream
    "url port 0": ({"upstream": {"url": "http://127.0.0.1:0"}},
                   "upstream.url: has an invalid port (1..65535): 'http://127.0.0.1:0'"),
    "url upper-case scheme": ({"upstream": {"url": "HTTP://h"}},
                              "upstream.url: must be an http:// or https:// URL with a host, got 'HTTP://h' "
                              "(e.g. 'http://127.0.0.1:8081')"),
    "command empty list": ({"upstream": {"command": []}},
                           "upstream.command: must be a command line string or a non-empty list of arguments "
                           "(strings or numbers), got a list"),
    "command with a mapping": ({"upstream": {"command": ["a", {"b": 1}]}},
                               "upstream.command: must be a command line string or a non-empty list of arguments "
                               "(strings or numbers), got a list"),
    "command unclosed quote": ({"upstream": {"command": "llama-server -m 'x.gguf"}},
                               "upstream.command: is not a valid command line (No closing quotation): "
                               "\"llama-server -m 'x.gguf\""),
    "healthPath relative": ({"upstream": {"healthPath": "health"}},
                            "upstream.healthPath: must be a path starting with '/', got a string 'health'"),
    "startupTimeoutSeconds zero": ({"upstream": {"startupTimeoutSeconds": 0}},
                                   "upstream.startupTimeoutSeconds: must be > 0, got 0"),
    "modelsPollSeconds negative": ({"upstream": {"modelsPollSeconds": -1}},
                                   "upstream.modelsPollSeconds: must be >= 0 (0 = off), got -1"),
    "modelCheck unknown": ({"upstream": {"modelCheck": "maybe"}},
                           "upstream.modelCheck: must be one of 'auto', 'strict', 'off', got 'maybe'"),
    "modelCheck boolean": ({"upstream": {"modelCheck": False}},
                           "upstream.modelCheck: must be one of 'auto', 'strict', 'off', got a boolean false"),
    "abandonedGeneration unknown": ({"upstream": {"abandonedGeneration": "kill"}},
                                    "upstream.abandonedGeneration: must be one of 'wait', 'stop', got 'kill'"),
    "settleTimeoutSeconds zero": ({"upstream": {"settleTimeoutSeconds": 0}},
                                  "upstream.settleTimeoutSeconds: must be > 0, got 0"),
    "settleTimeoutSeconds string": ({"upstream": {"settleTimeoutSeconds": "600"}},
                                    "upstream.settleTimeoutSeconds: must be a number, got a string '600'"),
    # envoy
    "streamIdleTimeoutSeconds zero": ({"envoy": {"streamIdleTimeoutSeconds": 0}},
                                      "envoy.streamIdleTimeoutSeconds: must be > 0, got 0"),
    "maxRequestBytes small": ({"envoy": {"maxRequestBytes": 1023}}, "envoy.maxRequestBytes: must be >= 1024, got 1023"),
    "maxSidecarStreams zero": ({"envoy": {"maxSidecarStreams": 0}}, "envoy.maxSidecarStreams: must be >= 1, got 0"),
    "leaseSeconds short": ({"envoy": {"leaseSeconds": 0.29}}, "envoy.leaseSeconds: must be >= 0.3, got 0.29"),
    # security
    "priority mode unknown": ({"security": {"priority": {"mode": "off"}}},
                              "security.priority.mode: must be one of 'trust', 'clamp', 'strip', got 'off'"),
    "priority min above max": ({"security": {"priority": {"min": 5, "max": 3}}},
                               "security.priority.min: must not exceed security.priority.max (5 > 3)"),
    "priority min above the default max": ({"security": {"priority": {"min": 101}}},
                                           "security.priority.min: must not exceed security.priority.max (101 > 100)"),
    "trustedHeader is the priority header": ({"security": {"priority": {"trustedHeader": " X-LlamaSwap-Priority "}}},
                                             "security.priority.trustedHeader: must be a header set only by your "
                                             "authenticating proxy, not x-llamaswap-priority (callers set that one)"),
    "trustedHeader not a header name": ({"security": {"priority": {"trustedHeader": "x user"}}},
                                        "security.priority.trustedHeader: must be an HTTP header name, got 'x user'"),
    "trustedHeader a number": ({"security": {"priority": {"trustedHeader": 5}}},
                               "security.priority.trustedHeader: must be a header name, or empty for none, "
                               "got a number 5"),
    # activity and estimates
    "activity path a number": ({"activity": {"path": 5}},
                               "activity.path: must be a file path, or empty for none, got a number 5"),
    "activity recent negative": ({"activity": {"recent": -1}}, "activity.recent: must be >= 0 (0 keeps none), got -1"),
    "activity unknown key": ({"activity": {"paht": "/tmp/a"}}, "activity.paht: unknown key; did you mean 'path'?"),
    "defaultRunSeconds zero": ({"estimates": {"defaultRunSeconds": 0}},
                               "estimates.defaultRunSeconds: must be > 0, got 0"),
    "defaultSwapSeconds negative": ({"estimates": {"defaultSwapSeconds": -0.5}},
                                    "estimates.defaultSwapSeconds: must be >= 0, got -0.5"),
    "samples zero": ({"estimates": {"samples": 0}}, "estimates.samples: must be >= 1, got 0"),
    "model id is null": ({"models": {None: {}}}, "models.None: a model id must be a string, got nothing"),
    # slots
    "slots a string": ({"upstream": {"slots": "four"}},
                       "upstream.slots: must be an integer >= 1 or 'auto' (ask the upstream), got a string 'four'"),
    "slots a boolean": ({"upstream": {"slots": True}},
                        "upstream.slots: must be an integer >= 1 or 'auto' (ask the upstream), got a boolean true"),
    "slots a float": ({"upstream": {"slots": 2.0}},
                      "upstream.slots: must be an integer >= 1 or 'auto' (ask the upstream), got a number 2.0"),
    "model slots zero": ({"models": {"a": {"slots": 0}}},
                         "models.a.slots: must be >= 1 (null = upstream.slots), got 0"),
    "reservedSlots negative": ({"routing": {"scheduler": {"settings": {"fifo": {"reservedSlots": -1}}}}},
                               "routing.scheduler.settings.fifo.reservedSlots: must be >= 0 (0 reserves none), got -1"),
    "reservedSlots leave a model none": (
        {"upstream": {"slots": 4}, "models": {"small": {"slots": 2}},
         "routing": {"scheduler": {"settings": {"serial": {"reservedSlots": 2}}}}},
        f"{SERIAL}.reservedSlots: 2 reserved slots leave models.small.slots (2) no slot for non-interactive "
        "requests: set it below 2, or raise models.small.slots"),
    "reservedSlots leave a configured model none under auto": (
        {"upstream": {"slots": "auto"}, "models": {"small": {"slots": 1}},
         "routing": {"scheduler": {"settings": {"serial": {"reservedSlots": 1}}}}},
        f"{SERIAL}.reservedSlots: 1 reserved slots leave models.small.slots (1) no slot for non-interactive "
        "requests: set it below 1, or raise models.small.slots"),
    "fifo reservedSlots checked under fifo": (
        {"upstream": {"slots": 2},
         "routing": {"scheduler": {"use": "fifo", "settings": {"fifo": {"reservedSlots": 2}}}}},
        "routing.scheduler.settings.fifo.reservedSlots: 2 reserved slots leave upstream.slots (2) no slot for "
        "non-interactive requests: set it below 2, or raise upstream.slots"),
}


@pytest.mark.parametrize("case", sorted(BAD_DOCUMENTS))
def test_bad_document_names_the_key_path_and_the_fix(case):
    document, expected = BAD_DOCUMENTS[case]
    with pytest.raises(ConfigError) as info:
        parse_config(document)
    assert [str(p) for p in info.value.problems] == [expected]


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
    assert "ok" not in result.stdout.splitlines()


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


def test_slots_reach_the_policy():
    cfg = parse_config({"upstream": {"slots": 4}, "models": {"small": {"slots": 2}, "other": {}},
                        "routing": {"scheduler": {"settings": {"serial": {"reservedSlots": 1}}}}})
    assert cfg.policy().gpu("gpu0").slots == Slots(4, {"small": 2}, 1)
    fifo = parse_config({"upstream": {"slots": 3}, "routing": {"scheduler": {
        "use": "fifo", "settings": {"fifo": {"reservedSlots": 2}, "serial": {"reservedSlots": 0}}}}})
    assert fifo.policy().gpu("gpu0").slots == Slots(3, {}, 2)
    # serial's reservation does not apply under fifo, and is not checked against the slots there
    assert parse_config({"routing": {"scheduler": {"use": "fifo", "settings": {
        "serial": {"reservedSlots": 5}}}}}).policy().gpu("gpu0").slots == Slots()


def test_slots_default_to_one_grant_at_a_time():
    slots = Config().policy().gpu("gpu0").slots
    assert slots == Slots() and slots.single


def test_auto_slots_take_what_the_upstream_says_and_fit_the_reservation():
    cfg = parse_config({"upstream": {"slots": "auto"}, "routing": {"scheduler": {"settings": {
        "serial": {"reservedSlots": 2}}}}})
    assert cfg.upstream.slots == "auto"
    assert cfg.gpu_policy("gpu0", {None: 4}).slots == Slots(4, {}, 2)
    # fewer slots than reserved: lowered, not refused (the caller compares with reserved_slots to warn)
    assert cfg.gpu_policy("gpu0", {None: 2}).slots == Slots(2, {}, 1)
    assert cfg.policy().gpu("gpu0").slots == Slots(1, {}, 0)
    assert cfg.reserved_slots == 2
    assert cfg.to_document()["upstream"]["slots"] == "auto"


def test_auto_slots_in_router_mode_are_per_model_and_configured_ones_win():
    cfg = parse_config({"upstream": {"slots": "auto"}, "models": {"c": {"slots": 1}}})
    # The last model learnt gives the default for models not asked about yet.
    assert cfg.gpu_policy("gpu0", {"a": 4, "b": 2}).slots == Slots(2, {"a": 4, "b": 2, "c": 1}, 0)
    assert cfg.gpu_policy("gpu0", {"c": 3}).slots == Slots(3, {"c": 1}, 0)


def test_policy_from_parsed_config_matches_the_documented_defaults():
    cfg = parse_config({})
    assert cfg.policy() == Policy.serial(aging_divisor_s=60, swap_affinity_bonus=10, max_queued=0, max_wait_s=0,
                                         stop_min_run_s=1)


def test_fifo_policy_carries_the_limits():
    cfg = parse_config({"routing": {"scheduler": {"use": "fifo", "maxQueued": 4, "maxWaitSeconds": 2.5}},
                        "models": {"a": {"priority": 3}}})
    assert cfg.policy() == Policy.fifo(model_priorities={"a": 3}, max_queued=4, max_wait_s=2.5, stop_min_run_s=1)


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


# -- every key -----------------------------------------------------------------------------

# Every key, each set to something other than its default.
EVERY_KEY = {
    "routing": {"scheduler": {
        "use": "fifo", "maxQueued": 7, "maxWaitSeconds": 2.5, "maxRunSeconds": 900.0,
        "settings": {"serial": {"agingDivisor": 30.0, "swapAffinityBonus": 99, "reservedSlots": 3},
                     "fifo": {"reservedSlots": 1}},
    }, "objectives": {"interactive": 90, "normal": 5, "batch": -90}, "retryGraceSeconds": 30.0,
                "keepAlive": {"honour": True, "maxSeconds": 1800.0}},
    "models": {"qwen": {"priority": 10, "slots": 2, "memory": "8GiB", "pinned": True, "ttl": 60.0},
               "gemma": {"priority": -5, "slots": None, "memory": "512MiB", "pinned": False, "ttl": 0.0}},
    "listen": {"http": "0.0.0.0:8000", "grpc": "[::1]:9001", "admin": "10.0.0.5:9091", "allowRemote": True},
    "upstream": {
        "url": "https://llm.example.com:8443/base", "command": ["llama-server", "--port", "8081"],
        "healthPath": "/ready", "startupTimeoutSeconds": 60.0, "modelsPollSeconds": 0.0, "modelCheck": "strict",
        "abandonedGeneration": "stop", "settleTimeoutSeconds": 30.0, "managementApi": "schedule", "slots": 4,
        "maxLoaded": 3, "memory": "80GiB", "idleUnloadSeconds": 300.0, "apiKey": "env:LLAMASWAP_UPSTREAM_API_KEY",
    },
    "globalTTL": 300,  # (llama-swap's name of upstream.idleUnloadSeconds: the two agree)
    "envoy": {"streamIdleTimeoutSeconds": 60.0, "maxRequestBytes": 1024, "maxSidecarStreams": 10,
              "failOpen": True, "leaseSeconds": 0.3, "maxHeapBytes": 100_000_000},
    "security": {"priority": {"mode": "clamp", "min": -5, "max": 5, "trustedHeader": "x-user-priority"}},
    "activity": {"path": "/var/log/llamaswap/activity.jsonl", "recent": 0},
    "estimates": {"defaultRunSeconds": 2.5, "defaultSwapSeconds": 0.0, "samples": 1},
    "ui": {"jaegerUrl": "http://127.0.0.1:16686"},
    "batches": {"dir": "/var/lib/llamaswap/batches", "maxRequests": 1000, "maxFileBytes": 1048576, "inFlight": 3,
                "maxLineBytes": 65536, "maxAnswerBytes": 131072,
                "apiKeys": [{"name": "team-a", "key": "env:TEAM_A_KEY", "admin": True}], "callerHeader": "x-user",
                "adminCallers": ["ops"], "maxStoredBytes": "10GiB", "outputExpirySeconds": 86400, "preempt": True,
                "maxPreemptions": 1, "minRunSeconds": 30},
}


def leaves(document: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in document.items():
        if isinstance(value, dict) and key != "models":
            out.update(leaves(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def test_every_key_reaches_its_attribute():
    cfg = parse_config(EVERY_KEY)
    s = cfg.routing.scheduler
    assert (s.use, s.max_queued, s.max_wait_seconds, s.max_run_seconds) == ("fifo", 7, 2.5, 900)
    assert (s.settings.serial.aging_divisor, s.settings.serial.swap_affinity_bonus) == (30, 99)
    assert (s.settings.serial.reserved_slots, s.settings.fifo.reserved_slots) == (3, 1)
    assert model_priorities(cfg) == {"qwen": 10, "gemma": -5}
    assert cfg.policy().gpu("gpu0").slots == Slots(4, {"qwen": 2}, 1)
    assert (str(cfg.listen.http), str(cfg.listen.grpc), str(cfg.listen.admin)) == \
        ("0.0.0.0:8000", "[::1]:9001", "10.0.0.5:9091")
    u = cfg.upstream
    assert (u.url, u.command, u.health_path) == ("https://llm.example.com:8443/base",
                                                 ("llama-server", "--port", "8081"), "/ready")
    assert (u.startup_timeout_seconds, u.models_poll_seconds, u.settle_timeout_seconds) == (60, 0, 30)
    assert (u.model_check, u.abandoned_generation) == (ModelCheck.STRICT, AbandonedGeneration.STOP)
    assert (u.host, u.port, u.tls) == ("llm.example.com", 8443, True)
    e = cfg.envoy
    assert (e.stream_idle_timeout_seconds, e.max_request_bytes, e.max_sidecar_streams, e.fail_open,
            e.lease_seconds) == (60, 1024, 10, True, 0.3)
    p = cfg.security.priority
    assert (p.mode, p.min, p.max, p.trusted_header) == (PriorityMode.CLAMP, -5, 5, "x-user-priority")
    assert cfg.priority_policy() == PriorityPolicy(mode="clamp", minimum=-5, maximum=5,
                                                   trusted_header="x-user-priority",
                                                   objectives={"interactive": 90, "normal": 5, "batch": -90})
    assert (cfg.activity.path, cfg.activity.recent) == ("/var/log/llamaswap/activity.jsonl", 0)
    es = cfg.estimates
    assert (es.default_run_seconds, es.default_swap_seconds, es.samples) == (2.5, 0, 1)
    b = cfg.batches
    assert (b.dir, b.max_requests, b.max_file_bytes, b.in_flight) == ("/var/lib/llamaswap/batches", 1000, 1048576, 3)
    assert (b.max_line_bytes, b.max_answer_bytes) == (65536, 131072)


def test_the_defaults():
    cfg = Config()
    s = cfg.routing.scheduler
    assert (s.use, s.max_queued, s.max_wait_seconds, s.max_run_seconds) == (PolicyName.SERIAL, 0, 0, 0)
    assert (s.settings.serial.aging_divisor, s.settings.serial.swap_affinity_bonus) == (60, 10)
    assert dict(cfg.models) == {}
    assert (cfg.listen.http, cfg.listen.grpc, cfg.listen.admin) == \
        (HostPort("127.0.0.1", 8080), HostPort("127.0.0.1", 9000), HostPort("127.0.0.1", 9090))
    u = cfg.upstream
    assert (u.url, u.command, u.health_path, u.startup_timeout_seconds, u.models_poll_seconds) == \
        ("http://127.0.0.1:8081", (), "/health", 300, 5)
    assert (u.model_check, u.abandoned_generation, u.settle_timeout_seconds) == \
        (ModelCheck.AUTO, AbandonedGeneration.WAIT, 600)
    assert (u.host, u.port, u.tls) == ("127.0.0.1", 8081, False)
    e = cfg.envoy
    assert (e.stream_idle_timeout_seconds, e.max_request_bytes, e.max_sidecar_streams, e.fail_open,
            e.lease_seconds) == (300, 67108864, 100000, False, 3)
    p = cfg.security.priority
    assert (p.mode, p.min, p.max, p.trusted_header) == (PriorityMode.TRUST, -100, 100, None)
    assert cfg.priority_policy() == PriorityPolicy(mode="trust", minimum=-100, maximum=100, trusted_header=None,
                                                   objectives={"interactive": 100, "normal": 0, "batch": -100})
    assert (cfg.activity.path, cfg.activity.recent) == (None, 1000)
    es = cfg.estimates
    assert (es.default_run_seconds, es.default_swap_seconds, es.samples) == (10, 2.5, 50)


def test_every_key_example_differs_from_the_defaults():
    # So the round trip below exercises every key: a new key must be added to EVERY_KEY.
    # (upstreams replaces upstream.url and command: its example is in test_config_upstreams.py.)
    defaults = leaves(Config().to_document())
    every = leaves(parse_config(EVERY_KEY).to_document())
    del defaults["upstreams"], every["upstreams"]
    assert set(every) == set(defaults)
    assert [key for key in defaults if every[key] == defaults[key]] == []


@pytest.mark.parametrize("cfg", [Config(), parse_config(EVERY_KEY)], ids=["defaults", "every key"])
def test_to_document_round_trips(cfg):
    document = cfg.to_document()
    assert parse_config(document) == cfg
    assert parse_config(yaml.safe_load(yaml.safe_dump(document))) == cfg


def test_to_document_fills_in_every_default():
    document = parse_config({"routing": {"scheduler": {"maxQueued": 3}}}).to_document()
    assert document["routing"]["scheduler"]["maxQueued"] == 3
    assert document["routing"]["scheduler"]["settings"]["serial"] == {"agingDivisor": 60, "swapAffinityBonus": 10,
                                                                      "reservedSlots": 0}
    assert document["upstream"]["slots"] == 1
    assert document["listen"] == {"http": "127.0.0.1:8080", "grpc": "127.0.0.1:9000", "admin": "127.0.0.1:9090",
                                  "allowRemote": False}
    assert document["upstream"]["url"] == "http://127.0.0.1:8081"
    assert document["upstream"]["command"] == ""
    assert document["security"]["priority"]["trustedHeader"] is None
    assert "source" not in document


def test_to_document_is_the_yaml_shape():
    document = parse_config(EVERY_KEY).to_document()
    assert document == {**EVERY_KEY, "upstreams": None}


def test_source_is_where_it_came_from_and_not_part_of_equality(tmp_path):
    path = write(tmp_path, "routing: {scheduler: {maxQueued: 3}}\n")
    from_file = load_config(path)
    from_memory = parse_config({"routing": {"scheduler": {"maxQueued": 3}}})
    assert (from_file.source, from_memory.source, Config().source) == (str(path), "<memory>", "<defaults>")
    assert parse_config({}, source="<built-in default>").source == "<built-in default>"
    assert from_file == from_memory
    assert from_file != Config()


def test_the_configuration_is_frozen():
    cfg = Config()
    with pytest.raises(ValidationError):
        cfg.routing.scheduler.max_queued = 5  # type: ignore[misc]
    with pytest.raises(ValidationError):
        cfg.upstream = cfg.upstream  # type: ignore[misc]


def test_python_names_build_the_same_configuration():
    from llamaswap.config import RoutingConfig, SchedulerConfig

    built = Config(routing=RoutingConfig(scheduler=SchedulerConfig(max_queued=3, use=PolicyName.FIFO)))
    assert built == parse_config({"routing": {"scheduler": {"maxQueued": 3, "use": "fifo"}}})


@pytest.mark.parametrize("text", [
    "models:\n", "models: {qwen: }\n", "security:\n", "security: {priority: }\n", "activity:\n", "estimates:\n",
    "upstream:\n", "envoy:\n", "listen:\n", "batches:\n", "routing: {scheduler: {settings: {serial: , fifo: }}}\n",
])
def test_a_section_with_nothing_under_it_means_its_defaults(tmp_path, text):
    cfg = load_config(write(tmp_path, text))
    expected = Config().to_document() | ({"models": {"qwen": {"priority": 0, "slots": None, "memory": None,
                                                                 "pinned": False, "ttl": None}}}
                                                 if "qwen" in text else {})
    assert cfg.to_document() == expected


# -- the deprecated key --------------------------------------------------------------------

DEPRECATED = "envoy.extProcMessageTimeoutMs: no longer used (the data path has no ext_proc); remove it"


def test_ext_proc_message_timeout_is_accepted_and_ignored_with_a_warning(tmp_path):
    path = write(tmp_path, "envoy: {extProcMessageTimeoutMs: 10000, failOpen: true}\n")
    warnings: list[str] = []
    cfg = load_config(path, warn=warnings.append)
    assert warnings == [DEPRECATED]
    assert cfg.envoy.fail_open is True
    assert "extProcMessageTimeoutMs" not in cfg.to_document()["envoy"]
    assert cfg == parse_config({"envoy": {"failOpen": True}})
    result = check_config(path.name, tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0] == "ok"
    assert f"warning: {DEPRECATED}" in result.stderr


def test_the_warning_is_logged_without_a_callback(caplog):
    with caplog.at_level("WARNING", logger="llamaswap.config"):
        parse_config({"envoy": {"extProcMessageTimeoutMs": 1}})
    assert [record.getMessage() for record in caplog.records] == [DEPRECATED]


def test_no_warning_without_the_deprecated_key():
    warnings: list[str] = []
    parse_config(EVERY_KEY, warn=warnings.append)
    assert warnings == []


# -- values --------------------------------------------------------------------------------


@pytest.mark.parametrize("text, host, port, connect_host", [
    ("0.0.0.0:8080", "0.0.0.0", 8080, "127.0.0.1"),
    ("[::]:8080", "::", 8080, "::1"),
    ("[::1]:8080", "::1", 8080, "::1"),
    ("10.1.2.3:0", "10.1.2.3", 0, "10.1.2.3"),
    ("sidecar.svc:65535", "sidecar.svc", 65535, "sidecar.svc"),
])
def test_host_port(text, host, port, connect_host):
    address = parse_config({"listen": {"grpc": text, "allowRemote": True}}).listen.grpc
    assert (address.host, address.port, address.connect_host, str(address)) == (host, port, connect_host, text)


def test_connect_host_of_an_empty_host():
    assert HostPort("", 80).connect_host == "127.0.0.1"


@pytest.mark.parametrize("url, expected, host, port, tls", [
    ("http://127.0.0.1:8081/", "http://127.0.0.1:8081", "127.0.0.1", 8081, False),
    ("http://upstream", "http://upstream", "upstream", 80, False),
    ("https://upstream/v1/", "https://upstream/v1", "upstream", 443, True),
    ("http://[::1]:8081", "http://[::1]:8081", "::1", 8081, False),
])
def test_upstream_url(url, expected, host, port, tls):
    upstream = parse_config({"upstream": {"url": url}}).upstream
    assert (upstream.url, upstream.host, upstream.port, upstream.tls) == (expected, host, port, tls)


@pytest.mark.parametrize("command, expected", [
    ("llama-server -m 'my model.gguf' --port 8081", ("llama-server", "-m", "my model.gguf", "--port", "8081")),
    (["llama-server", "--port", 8081, "--temp", 0.5], ("llama-server", "--port", "8081", "--temp", "0.5")),
    ("", ()),
    (None, ()),
])
def test_upstream_command(command, expected):
    assert parse_config({"upstream": {"command": command}}).upstream.command == expected


@pytest.mark.parametrize("value, expected", [
    (" X-User-Priority ", "x-user-priority"), ("", None), (None, None), ("   ", None),
])
def test_trusted_header(value, expected):
    cfg = parse_config({"security": {"priority": {"trustedHeader": value}}})
    assert cfg.security.priority.trusted_header == expected
    assert cfg.priority_policy().trusted_header == expected


@pytest.mark.parametrize("value, expected", [("/tmp/activity.jsonl", "/tmp/activity.jsonl"), ("", None), (None, None)])
def test_activity_path(value, expected):
    assert parse_config({"activity": {"path": value}}).activity.path == expected


@pytest.mark.parametrize("key, value", [
    ("modelCheck", ModelCheck.AUTO), ("modelCheck", ModelCheck.STRICT), ("modelCheck", ModelCheck.OFF),
    ("abandonedGeneration", AbandonedGeneration.WAIT), ("abandonedGeneration", AbandonedGeneration.STOP),
])
def test_upstream_choices(key, value):
    upstream = parse_config({"upstream": {key: str(value)}}).upstream
    attribute = {"modelCheck": "model_check", "abandonedGeneration": "abandoned_generation"}[key]
    assert getattr(upstream, attribute) is value


@pytest.mark.parametrize("mode", ["trust", "clamp", "strip"])
def test_priority_modes_reach_the_policy(mode):
    cfg = parse_config({"security": {"priority": {"mode": mode, "min": -1, "max": 1}}})
    assert cfg.security.priority.mode is PriorityMode(mode)
    assert cfg.priority_policy() == PriorityPolicy(mode=mode, minimum=-1, maximum=1, trusted_header=None,
                                                   objectives=Config().routing.objectives)


def test_model_ids_that_yaml_reads_as_numbers_are_strings():
    cfg = parse_config(yaml.safe_load("models: {7: {priority: 1}}"))
    assert model_priorities(cfg) == {"7": 1}


# -- load_document -------------------------------------------------------------------------


def test_load_document_parses_without_validating(tmp_path):
    path = write(tmp_path, "routing: {scheduler: {use: lifo}}\nextra: 1\n")
    assert load_document(path) == {"routing": {"scheduler": {"use": "lifo"}}, "extra": 1}


def test_load_document_of_an_empty_file_is_none(tmp_path):
    assert load_document(write(tmp_path, "# nothing\n")) is None


def test_load_document_names_the_file(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_document(tmp_path / "nope.yaml")
    assert [p.path for p in info.value.problems] == [str(tmp_path / "nope.yaml")]
    assert info.value.problems[0].message == "cannot read the file: No such file or directory"


@pytest.mark.parametrize("address", ["127.0.0.1:9000", "127.1.2.3:9000", "[::1]:9000", "localhost:9000"])
def test_the_sidecar_ports_on_the_loopback_need_nothing(address: str) -> None:
    config = parse_config({"listen": {"grpc": address, "admin": address}})
    assert config.listen.grpc.is_loopback and config.listen.admin.is_loopback and not config.listen.allow_remote


def test_allow_remote_accepts_the_sidecar_ports_anywhere_and_serve_warns(caplog: pytest.LogCaptureFixture) -> None:
    from llamaswap.commands.serve import warn_remote_listen  # what Sidecar.start calls first

    config = parse_config({"listen": {"grpc": "0.0.0.0:9000", "admin": "10.0.0.5:9090", "allowRemote": True}})
    caplog.set_level(logging.WARNING, logger="llamaswap")
    warn_remote_listen(parse_config({"listen": {"allowRemote": True}}).listen)
    assert caplog.records == []
    warn_remote_listen(config.listen)
    warnings = [r.getMessage() for r in caplog.records if "not the loopback" in r.getMessage()]
    assert len(warnings) == 2 and "listen.grpc" in warnings[0] and "listen.admin" in warnings[1]


def test_the_upstream_api_key_is_a_reference_never_the_key(tmp_path, monkeypatch):
    for inline in ("sk-secret-123", "file:", "env:1BAD", "env:", 42):
        with pytest.raises(ConfigError) as caught:
            parse_config({"upstream": {"apiKey": inline}})
        text = str(caught.value)
        assert text.startswith("upstream.apiKey: must say where the key is, 'file:PATH' or 'env:NAME'")
        assert "sk-secret-123" not in text  # a key pasted inline is not repeated in a log
    key_file = tmp_path / "key"
    key_file.write_text("  sk-from-file \n")
    assert parse_config({"upstream": {"apiKey": f"file:{key_file}"}}).upstream.read_api_key() == "sk-from-file"
    monkeypatch.setenv("LLAMASWAP_TEST_KEY", "sk-from-env")
    assert parse_config({"upstream": {"apiKey": "env:LLAMASWAP_TEST_KEY"}}).upstream.read_api_key() == "sk-from-env"
    assert parse_config({"upstream": {"apiKey": ""}}).upstream.read_api_key() is None
    for reference, message in ((f"file:{tmp_path / 'none'}", "cannot read the file"),
                               ("env:LLAMASWAP_TEST_UNSET", "the environment variable LLAMASWAP_TEST_UNSET is unset")):
        with pytest.raises(ConfigError, match=f"upstream.apiKey: {message}"):
            parse_config({"upstream": {"apiKey": reference}}).upstream.read_api_key()
    key_file.write_text("one\ntwo\n")
    with pytest.raises(ConfigError) as caught:
        parse_config({"upstream": {"apiKey": f"file:{key_file}"}}).upstream.read_api_key()
    assert "more than one line" in str(caught.value) and "two" not in str(caught.value)
