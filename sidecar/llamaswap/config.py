"""YAML configuration -> validated, frozen dataclasses.

Keys follow llama-swap's (``routing.scheduler...``, ``models.<id>...``) so one file can serve
both. Every problem names its key path and the fix; all problems are reported at once.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import math
import pathlib
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import urlsplit

import yaml

from llamaswap.core.priority import PriorityMode, PriorityPolicy
from llamaswap.core.scheduler import Policy

_log = logging.getLogger(__name__)

MAX_SWAP_AFFINITY_BONUS = 99

# llama-swap's own per-model keys: accepted (so a llama-swap file loads) and ignored.
_LLAMA_SWAP_MODEL_KEYS = frozenset(
    {"cmd", "cmdStop", "proxy", "aliases", "env", "checkEndpoint", "ttl", "useModelName", "unlisted",
     "filters", "name", "description", "concurrencyLimit", "metadata", "macros", "sendLoadingState"}
)


@dataclasses.dataclass(frozen=True)
class Problem:
    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


class ConfigError(Exception):
    """The configuration is invalid; ``problems`` names each key path and its fix."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = problems
        super().__init__("; ".join(str(p) for p in problems))


@dataclasses.dataclass(frozen=True)
class HostPort:
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    use: str = "serial"
    aging_divisor_s: float = 60.0
    swap_affinity_bonus: int = 10
    max_queued: int = 0
    max_wait_s: float = 0.0
    max_run_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class ListenConfig:
    http: HostPort = HostPort("127.0.0.1", 8080)
    grpc: HostPort = HostPort("127.0.0.1", 9000)
    admin: HostPort = HostPort("127.0.0.1", 9090)


@dataclasses.dataclass(frozen=True)
class UpstreamConfig:
    url: str = "http://127.0.0.1:8081"
    command: tuple[str, ...] = ()
    health_path: str = "/health"
    startup_timeout_s: float = 300.0
    # How often to ask a llama-server in router mode which model is loaded; 0 turns it off.
    models_poll_s: float = 5.0

    @property
    def host(self) -> str:
        return urlsplit(self.url).hostname or "127.0.0.1"

    @property
    def port(self) -> int:
        parts = urlsplit(self.url)
        return parts.port or (443 if parts.scheme == "https" else 80)

    @property
    def tls(self) -> bool:
        return urlsplit(self.url).scheme == "https"


@dataclasses.dataclass(frozen=True)
class EnvoyConfig:
    """Envoy timers and limits the generated bootstrap uses."""

    # Applies to routes that bypass the queue; scheduled routes wait without an idle timer.
    stream_idle_timeout_s: float = 300.0
    ext_proc_message_timeout_ms: int = 10_000
    max_request_bytes: int = 64 * 1024 * 1024
    # Connections to the sidecar; each waiting request holds two gRPC streams.
    max_sidecar_streams: int = 100_000
    fail_open: bool = False


@dataclasses.dataclass(frozen=True)
class Config:
    scheduler: SchedulerConfig = SchedulerConfig()
    model_priorities: Mapping[str, int] = dataclasses.field(default_factory=dict)
    listen: ListenConfig = ListenConfig()
    upstream: UpstreamConfig = UpstreamConfig()
    envoy: EnvoyConfig = EnvoyConfig()
    priority_policy: PriorityPolicy = PriorityPolicy(PriorityMode.TRUST, -100, 100, None)
    source: str = "<defaults>"

    def policy(self) -> Policy:
        s = self.scheduler
        if s.use == "fifo":
            return Policy.fifo(model_priorities=self.model_priorities, max_queued=s.max_queued, max_wait_s=s.max_wait_s)
        return Policy.serial(aging_divisor_s=s.aging_divisor_s, swap_affinity_bonus=s.swap_affinity_bonus,
                             max_queued=s.max_queued, max_wait_s=s.max_wait_s)


class _Reader:
    """Walks a parsed YAML tree, collecting problems instead of stopping at the first."""

    def __init__(self) -> None:
        self.problems: list[Problem] = []
        self.warnings: list[Problem] = []

    def fail(self, path: str, message: str) -> None:
        self.problems.append(Problem(path or "(top level)", message))

    def mapping(self, node: Any, path: str, allowed: set[str] | frozenset[str]) -> dict[str, Any]:
        if node is None:
            return {}
        if not isinstance(node, dict):
            self.fail(path, f"must be a mapping, got {_kind(node)}")
            return {}
        for key in node:
            if not isinstance(key, str):
                self.fail(f"{path}.{key}" if path else str(key), "keys must be strings")
            elif key not in allowed:
                self.fail(_join(path, key), f"unknown key{_did_you_mean(key, allowed)}")
        return {k: v for k, v in node.items() if isinstance(k, str) and k in allowed}

    def number(self, node: dict[str, Any], key: str, path: str, default: float, *, minimum: float = 0.0) -> float:
        if key not in node or node[key] is None:
            return default
        value = node[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            self.fail(_join(path, key), f"must be a number, got {_kind(value)} {value!r}")
            return default
        if value < minimum:
            self.fail(_join(path, key), f"must be >= {minimum:g}, got {value!r}")
            return default
        return float(value)

    def integer(self, node: dict[str, Any], key: str, path: str, default: int, *, minimum: int | None = None) -> int:
        if key not in node or node[key] is None:
            return default
        value = node[key]
        if isinstance(value, bool) or not isinstance(value, int):
            self.fail(_join(path, key), f"must be an integer, got {_kind(value)} {value!r}")
            return default
        if minimum is not None and value < minimum:
            self.fail(_join(path, key), f"must be >= {minimum}, got {value}")
            return default
        return value

    def boolean(self, node: dict[str, Any], key: str, path: str, default: bool) -> bool:
        value = node.get(key, default)
        if not isinstance(value, bool):
            self.fail(_join(path, key), f"must be true or false, got {value!r}")
            return default
        return value

    def string(self, node: dict[str, Any], key: str, path: str, default: str) -> str:
        value = node.get(key, default)
        if not isinstance(value, str) or not value:
            self.fail(_join(path, key), f"must be a non-empty string, got {_kind(value)} {value!r}")
            return default
        return value

    def host_port(self, node: dict[str, Any], key: str, path: str, default: HostPort) -> HostPort:
        if key not in node:
            return default
        text = node[key]
        where = _join(path, key)
        if not isinstance(text, str):
            self.fail(where, f"must be a string 'host:port', got {_kind(text)} {text!r}")
            return default
        host, sep, port_text = text.rpartition(":")
        host = host.strip("[]")
        if not sep or not host or not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
            self.fail(where, f"must be 'host:port' with a port 0..65535, got {text!r} (e.g. '127.0.0.1:8080')")
            return default
        return HostPort(host, int(port_text))


def _kind(value: Any) -> str:
    return {dict: "a mapping", list: "a list", str: "a string", bool: "a boolean", type(None): "nothing"}.get(
        type(value), type(value).__name__
    )


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _did_you_mean(key: str, allowed: set[str] | frozenset[str]) -> str:
    close = difflib.get_close_matches(key, sorted(allowed), n=1, cutoff=0.6)
    if close:
        return f"; did you mean '{close[0]}'?"
    return f"; allowed here: {', '.join(sorted(allowed))}"


def _at_least_a_millisecond(r: _Reader, value: float, path: str, off: str) -> float:
    """Sub-millisecond positive values would round to 0 ns, which means 'off': refuse them."""
    if 0 < value < 0.001:
        r.fail(path, f"must be {off} or at least 0.001 seconds, got {value!r}")
        return 0.0
    return value


def parse_config(data: Any, *, source: str = "<memory>", warn: Callable[[str], None] | None = None) -> Config:
    """Validate a parsed YAML document. Raises ConfigError listing every problem."""
    r = _Reader()
    top = r.mapping(data, "", {"routing", "models", "listen", "upstream", "envoy", "security",
                                 # llama-swap top-level keys, accepted and ignored
                                 "healthCheckTimeout", "logLevel", "metricsMaxInMemory", "startPort",
                                 "macros", "groups", "hooks", "includeAliasesInList", "logRequests"})
    routing = r.mapping(top.get("routing"), "routing", {"scheduler"})
    sched = r.mapping(routing.get("scheduler"), "routing.scheduler",
                      {"use", "settings", "maxQueued", "maxWaitSeconds", "maxRunSeconds"})
    use = sched.get("use", "serial")
    if use not in ("serial", "fifo"):
        r.fail("routing.scheduler.use", f"must be 'serial' or 'fifo', got {use!r}")
        use = "serial"
    settings = r.mapping(sched.get("settings"), "routing.scheduler.settings", {"serial", "fifo"})
    serial = r.mapping(settings.get("serial"), "routing.scheduler.settings.serial",
                       {"agingDivisor", "swapAffinityBonus"})
    r.mapping(settings.get("fifo"), "routing.scheduler.settings.fifo", set())
    serial_path = "routing.scheduler.settings.serial"
    aging = r.number(serial, "agingDivisor", serial_path, 60.0)
    if 0 < aging < 0.001:
        r.fail(f"{serial_path}.agingDivisor", f"must be 0 (no aging) or at least 0.001 seconds, got {aging!r}")
        aging = 60.0
    bonus = r.integer(serial, "swapAffinityBonus", serial_path, 10)
    if bonus < 0:
        r.fail(f"{serial_path}.swapAffinityBonus", f"must be 0..{MAX_SWAP_AFFINITY_BONUS} (0 disables it), got {bonus}")
        bonus = 10
    elif bonus > MAX_SWAP_AFFINITY_BONUS:
        r.warnings.append(Problem(f"{serial_path}.swapAffinityBonus",
                                  f"{bonus} is above {MAX_SWAP_AFFINITY_BONUS}; capped at {MAX_SWAP_AFFINITY_BONUS} "
                                  "so it can never lift a request across a band"))
        bonus = MAX_SWAP_AFFINITY_BONUS
    scheduler = SchedulerConfig(
        use=use,
        aging_divisor_s=aging,
        swap_affinity_bonus=bonus,
        max_queued=r.integer(sched, "maxQueued", "routing.scheduler", 0, minimum=0),
        max_wait_s=_at_least_a_millisecond(r, r.number(sched, "maxWaitSeconds", "routing.scheduler", 0.0),
                                           "routing.scheduler.maxWaitSeconds", "0 (wait forever)"),
        max_run_s=r.number(sched, "maxRunSeconds", "routing.scheduler", 0.0),
    )

    models_node = top.get("models")
    priorities: dict[str, int] = {}
    if models_node is not None and not isinstance(models_node, dict):
        r.fail("models", f"must be a mapping of model id to settings, got {_kind(models_node)}")
    for model_id, model_node in (models_node or {}).items() if isinstance(models_node, dict) else ():
        path = f"models.{model_id}"
        model = r.mapping(model_node, path, _LLAMA_SWAP_MODEL_KEYS | {"priority"})
        priorities[str(model_id)] = r.integer(model, "priority", path, 0)

    listen_node = r.mapping(top.get("listen"), "listen", {"http", "grpc", "admin"})
    defaults = ListenConfig()
    listen = ListenConfig(
        http=r.host_port(listen_node, "http", "listen", defaults.http),
        grpc=r.host_port(listen_node, "grpc", "listen", defaults.grpc),
        admin=r.host_port(listen_node, "admin", "listen", defaults.admin),
    )

    up = r.mapping(top.get("upstream"), "upstream",
                   {"url", "command", "healthPath", "startupTimeoutSeconds", "modelsPollSeconds"})
    url = r.string(up, "url", "upstream", UpstreamConfig.url)
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        r.fail("upstream.url", f"must be an http:// or https:// URL with a host, got {url!r} "
                               "(e.g. 'http://127.0.0.1:8081')")
    else:
        try:
            parts.port
        except ValueError:
            r.fail("upstream.url", f"has an invalid port: {url!r}")
    command: tuple[str, ...] = ()
    raw_command = up.get("command")
    if isinstance(raw_command, str) and raw_command.strip():
        import shlex
        command = tuple(shlex.split(raw_command))
    elif isinstance(raw_command, list) and raw_command and all(isinstance(a, (str, int, float)) for a in raw_command):
        command = tuple(str(a) for a in raw_command)
    elif raw_command is not None:
        r.fail("upstream.command", "must be a command line string or a non-empty list of arguments")
    health_path = r.string(up, "healthPath", "upstream", "/health")
    if not health_path.startswith("/"):
        r.fail("upstream.healthPath", f"must start with '/', got {health_path!r}")
    upstream = UpstreamConfig(
        url=url.rstrip("/"),
        command=command,
        health_path=health_path,
        startup_timeout_s=r.number(up, "startupTimeoutSeconds", "upstream", 300.0),
        models_poll_s=r.number(up, "modelsPollSeconds", "upstream", 5.0),
    )

    env_node = r.mapping(top.get("envoy"), "envoy",
                         {"streamIdleTimeoutSeconds", "extProcMessageTimeoutMs", "maxRequestBytes",
                          "maxSidecarStreams", "failOpen"})
    envoy = EnvoyConfig(
        stream_idle_timeout_s=r.number(env_node, "streamIdleTimeoutSeconds", "envoy", 300.0),
        ext_proc_message_timeout_ms=r.integer(env_node, "extProcMessageTimeoutMs", "envoy", 10_000, minimum=1),
        max_request_bytes=r.integer(env_node, "maxRequestBytes", "envoy", 64 * 1024 * 1024, minimum=1024),
        max_sidecar_streams=r.integer(env_node, "maxSidecarStreams", "envoy", 100_000, minimum=1),
        fail_open=r.boolean(env_node, "failOpen", "envoy", False),
    )
    if envoy.ext_proc_message_timeout_ms > 3_600_000:
        r.fail("envoy.extProcMessageTimeoutMs", "must be at most 3600000 (Envoy caps message timeouts at 1 h)")

    security = r.mapping(top.get("security"), "security", {"priority"})
    prio = r.mapping(security.get("priority"), "security.priority", {"mode", "min", "max", "trustedHeader"})
    mode = prio.get("mode", "trust")
    if mode not in ("trust", "clamp", "strip"):
        r.fail("security.priority.mode", f"must be 'trust', 'clamp' or 'strip', got {mode!r}")
        mode = "trust"
    minimum = r.integer(prio, "min", "security.priority", -100)
    maximum = r.integer(prio, "max", "security.priority", 100)
    if minimum > maximum:
        r.fail("security.priority.min", f"must not exceed security.priority.max ({minimum} > {maximum})")
    trusted = prio.get("trustedHeader")
    if trusted is not None and (not isinstance(trusted, str) or not trusted.strip()
                                or trusted.lower() in ("x-llamaswap-priority", "x-llamaswap-ticket")):
        r.fail("security.priority.trustedHeader",
               "must be a header name set only by your authenticating proxy (not x-llamaswap-priority)")
        trusted = None
    priority_policy = PriorityPolicy(PriorityMode(mode), minimum, maximum, trusted.strip().lower() if trusted else None)

    if r.problems:
        raise ConfigError(r.problems)
    for warning in r.warnings:
        (warn or (lambda text: _log.warning("%s", text)))(str(warning))
    return Config(scheduler, priorities, listen, upstream, envoy, priority_policy, source)


def load_config(path: str | pathlib.Path | None, *, warn: Callable[[str], None] | None = None) -> Config:
    """Read and validate a YAML file; ``None`` gives the defaults."""
    if path is None:
        return Config()
    path = pathlib.Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError([Problem(str(path), f"cannot read the file: {exc.strerror or exc}")]) from exc
    except UnicodeDecodeError as exc:
        raise ConfigError([Problem(str(path), "is not UTF-8 text")]) from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        reason = getattr(exc, "problem", None) or str(exc)
        raise ConfigError([Problem(str(path), f"is not valid YAML{where}: {reason}")]) from exc
    return parse_config(data, source=str(path), warn=warn)
