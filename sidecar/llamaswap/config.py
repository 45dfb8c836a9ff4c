"""YAML configuration -> validated, frozen pydantic models.

Keys follow llama-swap's (``routing.scheduler...``, ``models.<id>...``) so one file can serve
both. The models below are the one definition of every key: its type, range, default and
meaning. The loader, :meth:`Config.to_document` and :func:`json_schema` all come from them.
Every problem names its key path and the fix; all problems are reported at once.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import enum
import logging
import pathlib
import re
import shlex
import typing
from collections.abc import Callable, Iterator, Mapping
from typing import Annotated, Any, ClassVar
from urllib.parse import urlsplit

import yaml
from annotated_types import Ge, Gt, Le, Lt
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    GetCoreSchemaHandler,
    GetJsonSchemaHandler,
    PlainSerializer,
    PrivateAttr,
    Strict,
    ValidationError,
    WithJsonSchema,
    model_validator,
)
from pydantic.alias_generators import to_camel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticCustomError, core_schema

from llamaswap.core.priority import HEADER as PRIORITY_HEADER
from llamaswap.core.priority import PriorityMode, PriorityPolicy
from llamaswap.core.scheduler import Policy, PolicyName

__all__ = [
    "AbandonedGeneration", "ActivityConfig", "Config", "ConfigError", "EnvoyConfig", "EstimatesConfig",
    "FifoSettings", "HostPort", "ListenConfig", "ModelCheck", "ModelConfig", "PriorityMode",
    "PrioritySecurityConfig", "Problem", "RoutingConfig", "SchedulerConfig", "PolicyName",
    "SchedulerSettings", "SecurityConfig", "SerialSettings", "UiConfig", "UpstreamConfig", "json_schema",
    "load_config", "load_document", "parse_config",
]

_log = logging.getLogger(__name__)

# The bands sit 100 apart; the bonus must stay below that so it never lifts a request across one.
BAND_SPACING = 100
MAX_SWAP_AFFINITY_BONUS = BAND_SPACING - 1


# -- problems ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Problem:
    """One thing wrong with a configuration: its key path and what to do about it."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


class ConfigError(Exception):
    """The configuration is invalid; ``problems`` names each key path and its fix."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = problems
        super().__init__("; ".join(str(p) for p in problems))


def describe_value(value: Any) -> str:
    """A value as the YAML author wrote it: ``a string 'abc'``, ``a list``."""
    if value is None:
        return "nothing"
    if isinstance(value, bool):
        return f"a boolean {'true' if value else 'false'}"
    if isinstance(value, (int, float)):
        return f"a number {value!r}"
    if isinstance(value, str):
        return f"a string {value!r}"
    if isinstance(value, (list, tuple)):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return f"a {type(value).__name__} {value!r}"


def _invalid(message: str, **ctx: Any) -> PydanticCustomError:
    """A validation error whose message is final (``ctx['key']`` extends the key path)."""
    return PydanticCustomError("llamaswap", "{message}", {"message": message, **ctx})


# -- value types ---------------------------------------------------------------------------

# host, then port; an IPv6 host is bracketed. Also the JSON Schema's pattern.
_HOST_PORT = r"(\[[0-9A-Fa-f:.]+\]|[^\s\[\]]+):([0-9]{1,5})"


@dataclasses.dataclass(frozen=True, slots=True)
class HostPort:
    """A listen address, written ``host:port`` (``[::1]:8080`` for IPv6)."""

    host: str
    port: int

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    @property
    def connect_host(self) -> str:
        """Where a client on this machine connects: a wildcard address means the loopback."""
        if self.host in ("0.0.0.0", ""):
            return "127.0.0.1"
        if self.host == "::":
            return "::1"
        return self.host

    @classmethod
    def parse(cls, text: str) -> HostPort:
        """``'host:port'`` -> HostPort; ValueError says what is wrong."""
        match = re.fullmatch(_HOST_PORT, text)
        if match is None or int(match.group(2)) > 65535:
            raise ValueError(f"must be 'host:port' with a port 0..65535, got {text!r} (e.g. '127.0.0.1:8080')")
        return cls(match.group(1).strip("[]"), int(match.group(2)))

    @classmethod
    def _validate(cls, value: Any) -> HostPort:
        if isinstance(value, HostPort):
            return value
        if not isinstance(value, str):
            raise _invalid(f"must be a string 'host:port', got {describe_value(value)}")
        try:
            return cls.parse(value)
        except ValueError as exc:
            raise _invalid(str(exc)) from None

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:
        return core_schema.no_info_plain_validator_function(
            cls._validate, serialization=core_schema.plain_serializer_function_ser_schema(str)
        )

    @classmethod
    def __get_pydantic_json_schema__(cls, schema: core_schema.CoreSchema,
                                     handler: GetJsonSchemaHandler) -> dict[str, Any]:
        return {"type": "string", "pattern": f"^{_HOST_PORT}$"}


class ModelCheck(enum.StrEnum):
    """auto: refuse a model the upstream does not list where it routes by name (llama-server's router
    mode, llama-swap); strict: refuse every model it does not list, whatever its kind; off: never
    check. While the upstream cannot be asked, nothing is refused."""

    AUTO = "auto"
    STRICT = "strict"
    OFF = "off"


class AbandonedGeneration(enum.StrEnum):
    """wait: let the generation run to its end; stop: stop it, then wait (at most
    upstream.settleTimeoutSeconds) for the upstream to be idle before the next grant."""

    WAIT = "wait"
    STOP = "stop"


@dataclasses.dataclass(frozen=True)
class _Meaning:
    """What a setting's special value means; range errors quote it. (Pydantic ignores it.)"""

    text: str


# Strict: YAML "5" is not an integer and true is not a number.
_Int = Annotated[int, Strict()]
_Number = Annotated[float, Strict(), Field(allow_inf_nan=False)]
_Bool = Annotated[bool, Strict()]


def _not_below_a_millisecond(value: float) -> float:
    # Time is integer nanoseconds downstream: 0 < value < 1 ms would round to 0, the "off" value.
    if 0 < value < 0.001:
        raise PydanticCustomError("sub_millisecond", "is below 0.001 seconds and would round to 0")
    return value


# 0, or at least a millisecond.
_ZeroOrSeconds = Annotated[
    _Number,
    AfterValidator(_not_below_a_millisecond),
    Field(json_schema_extra={"not": {"exclusiveMinimum": 0, "exclusiveMaximum": 0.001}}),
]


def _model_id(value: Any) -> Any:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)  # `7:` in YAML is the model "7"
    if not isinstance(value, str):
        raise _invalid(f"a model id must be a string, got {describe_value(value)}")
    return value


def _none_is_empty(value: Any) -> Any:
    return {} if value is None else value


def _is_argument(value: Any) -> bool:
    return isinstance(value, (str, int, float)) and not isinstance(value, bool)


def _command(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        try:
            return tuple(shlex.split(value))
        except ValueError as exc:
            raise _invalid(f"is not a valid command line ({exc}): {value!r}") from None
    # A tuple comes from Python (``()`` is no command); YAML gives lists, and an empty one is a mistake.
    if (isinstance(value, tuple) or (isinstance(value, list) and value)) and all(map(_is_argument, value)):
        return tuple(str(a) for a in value)
    raise _invalid("must be a command line string or a non-empty list of arguments (strings or numbers), "
                   f"got {describe_value(value)}")


def _command_document(command: tuple[str, ...]) -> list[str] | str:
    return list(command) if command else ""


def _upstream_url(value: Any) -> str:
    if not isinstance(value, str):
        raise _invalid(f"must be an http:// or https:// URL, got {describe_value(value)}")
    url = value.rstrip("/")
    parts = urlsplit(url)
    if not url.startswith(("http://", "https://")) or not parts.hostname or any(c.isspace() for c in url):
        raise _invalid(f"must be an http:// or https:// URL with a host, got {value!r} (e.g. 'http://127.0.0.1:8081')")
    try:
        port = parts.port
    except ValueError:
        port = 0
    if port == 0:
        raise _invalid(f"has an invalid port (1..65535): {value!r}")
    return url


def _optional_http_url(value: Any) -> str:
    """An http(s) URL with a host, or "" for none (a link the page at /ui offers)."""
    if value is None or value == "":
        return ""
    url = value.rstrip("/") if isinstance(value, str) else ""
    if not url.startswith(("http://", "https://")) or not urlsplit(url).hostname or any(c.isspace() for c in url):
        raise _invalid(f"must be an http:// or https:// URL with a host, or empty for none, got "
                       f"{describe_value(value)} (e.g. 'http://127.0.0.1:16686')")
    return url


def _health_path(value: Any) -> str:
    if not isinstance(value, str) or not value.startswith("/"):
        raise _invalid(f"must be a path starting with '/', got {describe_value(value)}")
    return value


_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9a-z-]+")


def _trusted_header(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise _invalid(f"must be a header name, or empty for none, got {describe_value(value)}")
    name = value.strip().lower()
    if not name:
        return None
    if not _HEADER_NAME.fullmatch(name):
        raise _invalid(f"must be an HTTP header name, got {value!r}")
    if name == PRIORITY_HEADER:
        raise _invalid(f"must be a header set only by your authenticating proxy, not {PRIORITY_HEADER} "
                       "(callers set that one)")
    return name


def _optional_path(value: Any) -> str | None:
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise _invalid(f"must be a file path, or empty for none, got {describe_value(value)}")
    return value


# -- the sections --------------------------------------------------------------------------


def _schema_of_ignored_keys(schema: dict[str, Any], cls: type) -> None:
    """The keys a section accepts and ignores are part of its schema too."""
    assert issubclass(cls, _Section)
    properties = schema.setdefault("properties", {})
    for key in sorted(cls._llama_swap_keys):
        properties[key] = {"description": "A llama-swap key: accepted and ignored."}
    for key, advice in cls._deprecated_keys.items():
        properties[key] = {"description": f"Deprecated: {advice}.", "deprecated": True}


class _Section(BaseModel):
    """A mapping of the YAML file: snake_case attributes, camelCase keys."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        frozen=True,
        protected_namespaces=(),
        json_schema_extra=_schema_of_ignored_keys,
    )

    # llama-swap's own keys here: accepted (so a llama-swap file loads) and ignored.
    _llama_swap_keys: ClassVar[frozenset[str]] = frozenset()
    # Keys no longer used: accepted and ignored, with a warning (key -> the advice).
    _deprecated_keys: ClassVar[Mapping[str, str]] = {}

    @model_validator(mode="before")
    @classmethod
    def _accept_null_and_ignored_keys(cls, data: Any) -> Any:
        if data is None:  # `routing:` with nothing under it: the defaults
            return {}
        if isinstance(data, dict) and (cls._llama_swap_keys or cls._deprecated_keys):
            return {k: v for k, v in data.items() if k not in cls._llama_swap_keys and k not in cls._deprecated_keys}
        return data


class SerialSettings(_Section):
    """The serial scheduler: score = priority + swap affinity + aging; the best score goes next."""

    aging_divisor: Annotated[_ZeroOrSeconds, _Meaning("0 disables aging")] = Field(
        default=60.0, ge=0,
        description="Seconds of waiting per priority point (aging = waited seconds / agingDivisor); "
                    "0 disables aging. A positive value below 0.001 is refused: it would round to 0.")
    swap_affinity_bonus: Annotated[_Int, _Meaning(
        f"0 disables it; it must stay below the band spacing of {BAND_SPACING}")] = Field(
        default=10, ge=0, le=MAX_SWAP_AFFINITY_BONUS,
        description=f"Bonus for a request that needs no model swap, 0..{MAX_SWAP_AFFINITY_BONUS}; 0 disables it. "
                    f"It stays below the band spacing of {BAND_SPACING}, so it never lifts a request across a band.")


class FifoSettings(_Section):
    """The fifo scheduler takes no settings (a model's priority is models.<id>.priority)."""


class SchedulerSettings(_Section):
    """Each scheduler's settings; only those of routing.scheduler.use apply."""

    serial: SerialSettings = Field(default_factory=SerialSettings)
    fifo: FifoSettings = Field(default_factory=FifoSettings)


class SchedulerConfig(_Section):
    """Which request gets the GPU next, and how long the queue may grow."""

    use: PolicyName = Field(default=PolicyName.SERIAL, description="The scheduler: serial or fifo.")
    max_queued: Annotated[_Int, _Meaning("0 = unlimited")] = Field(
        default=0, ge=0, description="Waiting requests before new ones get 429 + Retry-After; 0 = unlimited.")
    max_wait_seconds: Annotated[_ZeroOrSeconds, _Meaning("0 = wait forever")] = Field(
        default=0.0, ge=0,
        description="A request that waited longer gets 503 + Retry-After; 0 = wait forever. "
                    "A positive value below 0.001 is refused: it would round to 0 ('forever').")
    max_run_seconds: Annotated[_Number, _Meaning("0 = off")] = Field(
        default=0.0, ge=0, description="Watchdog: free the GPU from a grant older than this; 0 = off.")
    settings: SchedulerSettings = Field(default_factory=SchedulerSettings)


class RoutingConfig(_Section):
    """How requests are scheduled onto the one GPU."""

    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)


class ModelConfig(_Section):
    """One model, by the id requests name in "model". llama-swap's per-model keys are accepted and ignored."""

    _llama_swap_keys: ClassVar[frozenset[str]] = frozenset({
        "cmd", "cmdStop", "proxy", "aliases", "env", "checkEndpoint", "ttl", "useModelName", "unlisted",
        "filters", "name", "description", "concurrencyLimit", "metadata", "macros", "sendLoadingState",
    })

    priority: _Int = Field(
        default=0, description="fifo only: added to the caller's X-LlamaSwap-Priority for this model "
                               "(a model at 10 with a batch header queues at -90).")


class ListenConfig(_Section):
    """The addresses the stack listens on, each 'host:port' ('[::1]:8080' for IPv6)."""

    http: HostPort = Field(default=HostPort("127.0.0.1", 8080), description="Envoy's listener: clients connect here.")
    grpc: HostPort = Field(default=HostPort("127.0.0.1", 9000),
                           description="The sidecar's gRPC server, which Envoy calls.")
    admin: HostPort = Field(default=HostPort("127.0.0.1", 9090),
                            description="The sidecar's admin HTTP: /healthz /readyz /metrics /queue /activity, "
                                        "and the page /ui.")


class UpstreamConfig(_Section):
    """The OpenAI-compatible server behind the queue: llama-server, llama-swap, or any other."""

    url: Annotated[str, BeforeValidator(_upstream_url)] = Field(
        default="http://127.0.0.1:8081",
        description="The upstream's base URL, http:// or https://; a trailing '/' is dropped.",
        json_schema_extra={"pattern": r"^https?://[^\s/?#]+(/\S*)?$"})
    command: Annotated[
        tuple[str, ...],
        BeforeValidator(_command),
        PlainSerializer(_command_document),
        WithJsonSchema({"anyOf": [
            {"type": "string"},
            {"type": "array", "items": {"type": ["string", "number"]}, "minItems": 1},
            {"type": "null"},
        ]}),
    ] = Field(default=(), description="`llamaswap up` starts this and waits for healthPath: a command line "
                                      "(split like a shell does) or a list of arguments; empty for none.")
    health_path: Annotated[str, BeforeValidator(_health_path)] = Field(
        default="/health", description="The upstream's health check path, starting with '/'.",
        json_schema_extra={"pattern": "^/"})
    startup_timeout_seconds: _Number = Field(
        default=300.0, gt=0, description="How long `llamaswap up` waits for the upstream's health check to pass.")
    models_poll_seconds: Annotated[_Number, _Meaning("0 = off")] = Field(
        default=5.0, ge=0,
        description="How often to ask the upstream what it serves and (router mode) which model is loaded, "
                    "while the GPU is idle; 0 = off.")
    model_check: ModelCheck = Field(
        default=ModelCheck.AUTO,
        description="Refuse requests for models the upstream does not serve, at once: auto (where it routes by "
                    "model name: llama-server's router mode, llama-swap), strict (any model it does not list) or "
                    "off.")
    abandoned_generation: AbandonedGeneration = Field(
        default=AbandonedGeneration.WAIT,
        description="When a client leaves a running generation that the upstream goes on computing: wait for it "
                    "to end (GET /slots) or stop it (router mode: unload the model) before the next grant.")
    settle_timeout_seconds: _Number = Field(
        default=600.0, gt=0,
        description="The longest wait for the upstream to become idle after an abandoned generation.")

    @property
    def host(self) -> str:
        return urlsplit(self.url).hostname or ""

    @property
    def port(self) -> int:
        port = urlsplit(self.url).port
        if port is not None:
            return port
        return 443 if self.tls else 80

    @property
    def tls(self) -> bool:
        return urlsplit(self.url).scheme == "https"


class EnvoyConfig(_Section):
    """Envoy's timers and limits, used by the generated bootstrap."""

    _deprecated_keys: ClassVar[Mapping[str, str]] = {
        "extProcMessageTimeoutMs": "no longer used (the data path has no ext_proc); remove it",
    }

    stream_idle_timeout_seconds: _Number = Field(
        default=300.0, gt=0, description="Idle timeout of the routes that skip the queue.")
    max_request_bytes: _Int = Field(
        default=64 * 1024 * 1024, ge=1024, description="Largest request body; larger ones get 413.")
    max_sidecar_streams: _Int = Field(
        default=100_000, ge=1, description="Concurrent gRPC streams from Envoy to the sidecar; waiting requests hold them.")
    fail_open: _Bool = Field(
        default=False,
        description="With the sidecar down: false = refuse clients (503/500), true = pass them unscheduled.")
    lease_seconds: _Number = Field(
        default=3.0, ge=0.3, description="A grant Envoy has not reported on for this long is released.")


class PrioritySecurityConfig(_Section):
    """What callers may claim with X-LlamaSwap-Priority."""

    mode: PriorityMode = Field(default=PriorityMode.TRUST, description="trust, clamp or strip the caller's priority.")
    min: _Int = Field(default=-100, description="clamp: the lowest priority a caller may claim.")
    max: _Int = Field(default=100, description="clamp: the highest priority a caller may claim.")
    trusted_header: Annotated[str | None, BeforeValidator(_trusted_header)] = Field(
        default=None,
        description="A header set only by your authenticating proxy (which drops clients' copies): its value is the "
                    "priority, unclamped. Case-insensitive; empty or null for none.")

    @model_validator(mode="after")
    def _min_not_above_max(self) -> PrioritySecurityConfig:
        if self.min > self.max:
            raise _invalid(f"must not exceed security.priority.max ({self.min} > {self.max})", key="min")
        return self


class SecurityConfig(_Section):
    """What callers are allowed to do."""

    priority: PrioritySecurityConfig = Field(default_factory=PrioritySecurityConfig)


class ActivityConfig(_Section):
    """The activity log: one JSON record per finished request."""

    path: Annotated[str | None, BeforeValidator(_optional_path)] = Field(
        default=None, description="Append the records to this file, one JSON object a line; empty or null for none.")
    recent: Annotated[_Int, _Meaning("0 keeps none")] = Field(
        default=1000, ge=0, description="Records kept in memory for GET /activity; 0 keeps none.")


class EstimatesConfig(_Section):
    """Expected run and swap times, before (and between) measurements."""

    default_run_seconds: _Number = Field(
        default=10.0, gt=0, description="Expected run time of a request for a model before anything is measured.")
    default_swap_seconds: _Number = Field(
        default=5.0, ge=0, description="Expected extra cost of a model swap before anything is measured.")
    samples: _Int = Field(default=50, ge=1, description="Recent measurements per model behind the rolling median.")


class UiConfig(_Section):
    """The page at GET /ui on the admin server."""

    jaeger_url: Annotated[str, BeforeValidator(_optional_http_url)] = Field(
        default="", description="The Jaeger UI's address as the browser reaches it (e.g. http://127.0.0.1:16686): "
                                "the page links each request to its trace there; empty for no links.")


class Config(_Section):
    """llamaswap's configuration file. Every key is optional; a section with nothing under it means its defaults."""

    model_config = ConfigDict(title="llamaswap configuration")

    _llama_swap_keys: ClassVar[frozenset[str]] = frozenset({
        "healthCheckTimeout", "logLevel", "metricsMaxInMemory", "startPort", "macros", "groups", "hooks",
        "includeAliasesInList", "logRequests",
    })

    routing: RoutingConfig = Field(default_factory=RoutingConfig)
    models: Annotated[Mapping[Annotated[str, BeforeValidator(_model_id)], ModelConfig],
                      BeforeValidator(_none_is_empty)] = Field(
        default_factory=dict, description="Per-model settings, by model id.")
    listen: ListenConfig = Field(default_factory=ListenConfig)
    upstream: UpstreamConfig = Field(default_factory=UpstreamConfig)
    envoy: EnvoyConfig = Field(default_factory=EnvoyConfig)
    security: SecurityConfig = Field(default_factory=SecurityConfig)
    activity: ActivityConfig = Field(default_factory=ActivityConfig)
    estimates: EstimatesConfig = Field(default_factory=EstimatesConfig)
    ui: UiConfig = Field(default_factory=UiConfig)

    _source: str = PrivateAttr("<defaults>")

    @property
    def source(self) -> str:
        """Where this came from: a file path, ``<defaults>`` or ``<memory>``."""
        return self._source

    def __eq__(self, other: object) -> bool:
        """The same settings; where they came from (``source``) does not count."""
        if not isinstance(other, Config):
            return NotImplemented
        return self.__dict__ == other.__dict__

    __hash__ = None  # type: ignore[assignment]  # models is a dict

    def policy(self) -> Policy:
        """The scheduler's policy."""
        s = self.routing.scheduler
        if s.use == PolicyName.FIFO:
            priorities = {model_id: model.priority for model_id, model in self.models.items()}
            return Policy.fifo(model_priorities=priorities, max_queued=s.max_queued, max_wait_s=s.max_wait_seconds)
        serial = s.settings.serial
        return Policy.serial(aging_divisor_s=serial.aging_divisor, swap_affinity_bonus=serial.swap_affinity_bonus,
                             max_queued=s.max_queued, max_wait_s=s.max_wait_seconds)

    def priority_policy(self) -> PriorityPolicy:
        """What callers may claim with X-LlamaSwap-Priority."""
        p = self.security.priority
        return PriorityPolicy(mode=p.mode, minimum=p.min, maximum=p.max, trusted_header=p.trusted_header)

    def to_document(self) -> dict[str, Any]:
        """The effective configuration in the YAML shape, every default filled in."""
        return self.model_dump(mode="json", by_alias=True)


# -- pydantic's errors -> problems ---------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _MappingOf:
    """A mapping key (``models``) whose values are sections."""

    section: type[_Section]


def _field(section: type[_Section], key: Any) -> FieldInfo | None:
    for name, info in section.model_fields.items():
        if key in (info.alias, name):
            return info
    return None


def _unannotated(annotation: Any) -> Any:
    return typing.get_args(annotation)[0] if typing.get_origin(annotation) is Annotated else annotation


def _child(section: type[_Section], key: Any) -> type[_Section] | _MappingOf | None:
    """What is under ``key`` of a section: a section, a mapping of sections, or a value (None)."""
    info = _field(section, key)
    if info is None:
        return None
    annotation = _unannotated(info.annotation)
    if isinstance(annotation, type) and issubclass(annotation, _Section):
        return annotation
    if typing.get_origin(annotation) in (dict, Mapping):
        value = _unannotated(typing.get_args(annotation)[1])
        if isinstance(value, type) and issubclass(value, _Section):
            return _MappingOf(value)
    return None


def _section_at(loc: tuple[Any, ...]) -> type[_Section] | None:
    node: type[_Section] | _MappingOf | None = Config
    for part in loc:
        if isinstance(node, _MappingOf):
            node = node.section
        elif node is not None:
            node = _child(node, part)
    return node if isinstance(node, type) else None


def _field_at(loc: tuple[Any, ...]) -> FieldInfo | None:
    section = _section_at(loc[:-1]) if loc else None
    return _field(section, loc[-1]) if section is not None else None


def _dotted(loc: tuple[Any, ...]) -> str:
    return ".".join(str(part) for part in loc if part != "[key]") or "(top level)"


def _unknown_key(loc: tuple[Any, ...]) -> str:
    section = _section_at(loc[:-1])
    if section is None:
        return "unknown key"
    known = [info.alias or name for name, info in section.model_fields.items()]
    close = difflib.get_close_matches(str(loc[-1]), known + sorted(section._llama_swap_keys), n=1, cutoff=0.6)
    if close:
        return f"unknown key; did you mean '{close[0]}'?"
    if not known:
        return "unknown key; nothing is allowed here"
    ignored = " (and llama-swap's keys, which are ignored)" if section._llama_swap_keys else ""
    return f"unknown key; allowed here: {', '.join(sorted(known))}{ignored}"


def _range(info: FieldInfo | None) -> tuple[str, str]:
    """(the allowed range, what its special value means) of a numeric field."""
    low = high = meaning = ""
    for item in info.metadata if info is not None else ():
        if isinstance(item, Ge):
            low = f"{item.ge!r}"
        elif isinstance(item, Gt):
            low = f"> {item.gt!r}"
        elif isinstance(item, Le):
            high = f"{item.le!r}"
        elif isinstance(item, Lt):
            high = f"< {item.lt!r}"
        elif isinstance(item, _Meaning):
            meaning = item.text
    if low and high and not low.startswith(">") and not high.startswith("<"):
        bounds = f"{low}..{high}"
    elif low:
        bounds = low if low.startswith(">") else f">= {low}"
    else:
        bounds = high if high.startswith("<") else f"<= {high}"
    return bounds, meaning


_TYPE_MESSAGES = {
    "int_type": "must be an integer", "int_parsing": "must be an integer", "int_from_float": "must be an integer",
    "float_type": "must be a number", "float_parsing": "must be a number",
    "bool_type": "must be true or false", "bool_parsing": "must be true or false",
    "string_type": "must be a string",
    "model_type": "must be a mapping", "model_attributes_type": "must be a mapping", "dict_type": "must be a mapping",
}


def _problem(error: Mapping[str, Any]) -> Problem:
    loc = tuple(error["loc"])
    kind = error["type"]
    value = error.get("input")
    ctx = error.get("ctx") or {}
    if kind == "llamaswap":
        return Problem(_dotted(loc + ((ctx["key"],) if "key" in ctx else ())), str(error["msg"]))
    if kind == "extra_forbidden":
        message = _unknown_key(loc)
    elif kind == "invalid_key":
        message = f"keys must be strings, got {describe_value(loc[-1] if loc else value)}"
    elif kind in _TYPE_MESSAGES:
        message = f"{_TYPE_MESSAGES[kind]}, got {describe_value(value)}"
    elif kind == "finite_number":
        message = f"must be a finite number, got {value!r}"
    elif kind == "enum":
        info = _field_at(loc)
        choices = info.annotation if info is not None and isinstance(info.annotation, type) else None
        expected = ", ".join(repr(str(c)) for c in choices) if choices else ctx.get("expected", "")
        got = repr(value) if isinstance(value, str) else describe_value(value)
        message = f"must be one of {expected}, got {got}"
    elif kind in ("greater_than_equal", "greater_than", "less_than_equal", "less_than"):
        bounds, meaning = _range(_field_at(loc))
        message = f"must be {bounds}{f' ({meaning})' if meaning else ''}, got {value!r}"
    elif kind == "sub_millisecond":
        _, meaning = _range(_field_at(loc))
        message = (f"must be 0{f' ({meaning})' if meaning else ''} or at least 0.001 seconds, got {value!r}: "
                   "a smaller positive value would round to 0")
    else:
        message = str(error["msg"])
    return Problem(_dotted(loc), message)


def _deprecated_keys(data: Any, section: type[_Section], loc: tuple[Any, ...] = ()) -> Iterator[Problem]:
    """The deprecated keys a document uses, each with its advice."""
    if not isinstance(data, dict):
        return
    for key, value in data.items():
        if key in section._deprecated_keys:
            yield Problem(_dotted(loc + (key,)), section._deprecated_keys[key])
            continue
        child = _child(section, key)
        if isinstance(child, _MappingOf) and isinstance(value, dict):
            for item_key, item in value.items():
                yield from _deprecated_keys(item, child.section, loc + (key, item_key))
        elif isinstance(child, type):
            yield from _deprecated_keys(value, child, loc + (key,))


# -- loading -------------------------------------------------------------------------------


def _log_warning(text: str) -> None:
    _log.warning("%s", text)


def parse_config(data: Any, *, source: str = "<memory>", warn: Callable[[str], None] | None = None) -> Config:
    """Validate a parsed YAML document. Raises ConfigError listing every problem."""
    try:
        config = Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError([_problem(error) for error in exc.errors(include_url=False)]) from None
    config._source = source
    for problem in _deprecated_keys(data, Config):
        (warn or _log_warning)(str(problem))
    return config


def load_document(path: str | pathlib.Path) -> Any:
    """Read and YAML-parse a file, without validating it. Raises ConfigError naming the file."""
    path = pathlib.Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError([Problem(str(path), f"cannot read the file: {exc.strerror or exc}")]) from exc
    except UnicodeDecodeError as exc:
        raise ConfigError([Problem(str(path), f"is not UTF-8 text (byte {exc.object[exc.start]:#04x} "
                                              f"at offset {exc.start})")]) from exc
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        reason = getattr(exc, "problem", None) or str(exc)
        raise ConfigError([Problem(str(path), f"is not valid YAML{where}: {reason}")]) from exc


def load_config(path: str | pathlib.Path | None, *, warn: Callable[[str], None] | None = None) -> Config:
    """Read and validate a YAML file; ``None`` gives the defaults."""
    if path is None:
        return Config()
    return parse_config(load_document(path), source=str(path), warn=warn)


# -- the JSON Schema -----------------------------------------------------------------------


def _inline(node: Any, defs: Mapping[str, Any]) -> Any:
    """Replace every $ref with its definition and drop the generated titles: one readable tree."""
    if isinstance(node, list):
        return [_inline(item, defs) for item in node]
    if not isinstance(node, dict):
        return node
    node = dict(node)
    all_of = node.get("allOf")
    if isinstance(all_of, list) and len(all_of) == 1 and "$ref" in all_of[0]:
        node.update(node.pop("allOf")[0])
    ref = node.pop("$ref", None)
    if ref is not None:
        node = {**copy.deepcopy(defs[ref.rsplit("/", 1)[-1]]), **node}  # the use's own description wins
    node.pop("title", None)
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in ("properties", "$defs"):
            out[key] = {name: _inline(sub, defs) for name, sub in value.items()}
        elif key in ("default", "enum", "const", "examples"):
            out[key] = value
        else:
            out[key] = _inline(value, defs)
    return out


def _set_defaults(schema: dict[str, Any], document: Mapping[str, Any]) -> None:
    """Each setting's default, as ``to_document()`` writes it."""
    for key, sub in schema.get("properties", {}).items():
        if key not in document:
            continue  # an ignored key
        if "properties" in sub and isinstance(document[key], dict):
            _set_defaults(sub, document[key])
        else:
            sub["default"] = document[key]


def json_schema() -> dict[str, Any]:
    """The JSON Schema of the configuration document (camelCase keys), self-contained: no $refs."""
    generated = Config.model_json_schema(by_alias=True, mode="validation")
    title = generated.get("title")
    schema = _inline(generated, generated.pop("$defs", {}))
    _set_defaults(schema, Config().to_document())
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "title": title, **schema}
