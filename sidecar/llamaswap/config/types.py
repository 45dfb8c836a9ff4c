"""The configuration's value types and validators: `HostPort`, the enums, strict numbers, and the
checks behind the sections' string keys (URLs, commands, header names, paths)."""

from __future__ import annotations

import dataclasses
import enum
import ipaddress
import os
import pathlib
import re
import shlex
from typing import Annotated, Any
from urllib.parse import urlsplit

from pydantic import (
    AfterValidator,
    BeforeValidator,
    Field,
    GetCoreSchemaHandler,
    GetJsonSchemaHandler,
    PlainSerializer,
    Strict,
    WithJsonSchema,
)
from pydantic_core import PydanticCustomError, core_schema

from llamaswap.config.gguf_memory import SIZE_FORMS, parse_size
from llamaswap.config.problems import ConfigError, Problem, describe_value, invalid
from llamaswap.core.priority import ALIASES, INT64_MAX, INT64_MIN
from llamaswap.core.priority import HEADER as PRIORITY_HEADER

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
    def is_loopback(self) -> bool:
        """Reachable from this machine only (127.0.0.0/8, ::1, localhost)."""
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:  # a host name: it resolves to whatever DNS says
            return False

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
            raise invalid(f"must be a string 'host:port', got {describe_value(value)}")
        try:
            return cls.parse(value)
        except ValueError as exc:
            raise invalid(str(exc)) from None

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


class ManagementApi(enum.StrEnum):
    """llama-server's management API on the public listener (`POST /models/load`, `/models/unload`,
    `/slots/N?action=...`): refuse (403), or schedule it like a generation."""

    REFUSE = "refuse"
    SCHEDULE = "schedule"


# Strict: YAML "5" is not an integer and true is not a number.
StrictInt = Annotated[int, Strict()]
StrictNumber = Annotated[float, Strict(), Field(allow_inf_nan=False)]
StrictBool = Annotated[bool, Strict()]


def _not_below_a_millisecond(value: float) -> float:
    # Time is integer nanoseconds downstream: 0 < value < 1 ms would round to 0, the "off" value.
    if 0 < value < 0.001:
        raise PydanticCustomError("sub_millisecond", "is below 0.001 seconds and would round to 0")
    return value


# 0, or at least a millisecond.
ZeroOrSeconds = Annotated[
    StrictNumber,
    AfterValidator(_not_below_a_millisecond),
    Field(json_schema_extra={"not": {"exclusiveMinimum": 0, "exclusiveMaximum": 0.001}}),
]


def model_id(value: Any) -> Any:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)  # `7:` in YAML is the model "7"
    if not isinstance(value, str):
        raise invalid(f"a model id must be a string, got {describe_value(value)}")
    return value


def none_is_empty(value: Any) -> Any:
    return {} if value is None else value


# An InferenceObjective's name is a Kubernetes object name (a DNS subdomain).
_OBJECT_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")


def objective_name(value: Any) -> str:
    if not isinstance(value, str) or not _OBJECT_NAME.fullmatch(value):
        raise invalid(f"an objective is named like a Kubernetes object (lowercase letters, digits, '-', '.'), "
                      f"got {describe_value(value)}")
    return value


def priority_value(value: Any) -> int:
    """An integer, or an alias of X-LlamaSwap-Priority (interactive, normal, batch)."""
    if isinstance(value, str) and value.strip().lower() in ALIASES:
        return ALIASES[value.strip().lower()]
    if isinstance(value, int) and not isinstance(value, bool) and INT64_MIN <= value <= INT64_MAX:
        return value
    raise invalid(f"must be a priority: a 64-bit integer or one of {', '.join(ALIASES)}, got {describe_value(value)}")


def _is_argument(value: Any) -> bool:
    return isinstance(value, (str, int, float)) and not isinstance(value, bool)


def command_line(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        try:
            return tuple(shlex.split(value))
        except ValueError as exc:
            raise invalid(f"is not a valid command line ({exc}): {value!r}") from None
    # A tuple comes from Python (``()`` is no command); YAML gives lists, and an empty one is a mistake.
    if (isinstance(value, tuple) or (isinstance(value, list) and value)) and all(map(_is_argument, value)):
        return tuple(str(a) for a in value)
    raise invalid("must be a command line string or a non-empty list of arguments (strings or numbers), "
                   f"got {describe_value(value)}")


def command_document(command: tuple[str, ...]) -> list[str] | str:
    return list(command) if command else ""


def upstream_url(value: Any) -> str:
    if not isinstance(value, str):
        raise invalid(f"must be an http:// or https:// URL, got {describe_value(value)}")
    url = value.rstrip("/")
    parts = urlsplit(url)
    if not url.startswith(("http://", "https://")) or not parts.hostname or any(c.isspace() for c in url):
        raise invalid(f"must be an http:// or https:// URL with a host, got {value!r} (e.g. 'http://127.0.0.1:8081')")
    try:
        port = parts.port
    except ValueError:
        port = 0
    if port == 0:
        raise invalid(f"has an invalid port (1..65535): {value!r}")
    return url


def optional_http_url(value: Any) -> str:
    """An http(s) URL with a host, or "" for none (a link the page at /ui offers)."""
    if value is None or value == "":
        return ""
    url = value.rstrip("/") if isinstance(value, str) else ""
    if not url.startswith(("http://", "https://")) or not urlsplit(url).hostname or any(c.isspace() for c in url):
        raise invalid(f"must be an http:// or https:// URL with a host, or empty for none, got "
                      f"{describe_value(value)} (e.g. 'http://127.0.0.1:16686')")
    return url


def checked_health_path(value: Any) -> str:
    if not isinstance(value, str) or not value.startswith("/"):
        raise invalid(f"must be a path starting with '/', got {describe_value(value)}")
    return value


_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9a-z-]+")


def checked_trusted_header(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise invalid(f"must be a header name, or empty for none, got {describe_value(value)}")
    name = value.strip().lower()
    if not name:
        return None
    if not _HEADER_NAME.fullmatch(name):
        raise invalid(f"must be an HTTP header name, got {value!r}")
    if name == PRIORITY_HEADER:
        raise invalid(f"must be a header set only by your authenticating proxy, not {PRIORITY_HEADER} "
                       "(callers set that one)")
    return name


def optional_path(value: Any) -> str | None:
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise invalid(f"must be a file path, or empty for none, got {describe_value(value)}")
    return value


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def api_key_reference(value: Any) -> str | None:
    """upstream.apiKey: ``file:PATH`` or ``env:NAME``. Anything else is refused without quoting
    it: it may be the key itself, which must not reach a log."""
    if value is None or value == "":
        return None
    if isinstance(value, str):
        kind, colon, where = value.partition(":")
        if colon and kind == "file" and where.strip():
            return f"file:{where.strip()}"
        if colon and kind == "env" and _ENV_NAME.fullmatch(where):
            return value
    raise invalid("must say where the key is, 'file:PATH' or 'env:NAME' (an environment variable), not the key "
                  "itself (the value is not repeated here)")


def read_key_reference(reference: str, key_path: str) -> str:
    """The key a ``file:PATH`` or ``env:NAME`` reference (api_key_reference) points at. Raises
    ConfigError at ``key_path`` (naming the file or variable, never the value) when it cannot be read."""
    kind, _, where = reference.partition(":")
    if kind == "file":
        try:
            key = pathlib.Path(where).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else "not UTF-8 text"
            raise ConfigError([Problem(key_path, f"cannot read the file {where}: {reason}")]) from None
        empty = f"the file {where} is empty"
    else:
        key = os.environ.get(where, "").strip()
        empty = f"the environment variable {where} is unset or empty"
    if not key:
        raise ConfigError([Problem(key_path, empty)])
    if any(c in key for c in "\r\n"):
        raise ConfigError([Problem(key_path, f"{reference} holds more than one line: put one key in it")])
    return key


class UrlParts:
    """The host, port and TLS of an upstream's ``url`` (upstream: and each of upstreams:)."""

    url: str

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


def memory_size(value: Any) -> int | None:
    """A memory size (upstream.memory, models.<id>.memory): ``80GiB``, ``512MiB``, ``1.5GB`` or a
    whole number of bytes, more than 0; null for none."""
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    elif isinstance(value, str):
        try:
            size = parse_size(value)
        except ValueError:
            raise invalid(f"must be a size, {SIZE_FORMS}; got {describe_value(value)}") from None
    else:
        raise invalid(f"must be a size such as 80GiB or 512MiB (or a whole number of bytes), got "
                      f"{describe_value(value)}")
    if size <= 0:
        raise invalid(f"must be more than 0 bytes, got {describe_value(value)} (leave it out for none)")
    return size


_BINARY_UNITS = (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))


def size_document(size: int | None) -> str | int | None:
    """A size as the file writes it: in the largest binary unit that holds it whole (80GiB), else bytes."""
    if size is None:
        return None
    for unit, factor in _BINARY_UNITS:
        if size % factor == 0:
            return f"{size // factor}{unit}"
    return size


def size_text(size: int) -> str:
    """A size for people: ``40.0 GiB``, ``512.0 MiB``."""
    for unit, factor in _BINARY_UNITS:
        if size >= factor:
            return f"{size / factor:.1f} {unit}"
    return f"{size} B"


MEMORY_SIZE_SCHEMA = {"anyOf": [{"type": "string", "pattern": r"^\s*[0-9]+(\.[0-9]+)?\s*[A-Za-z]*\s*$"},
                                {"type": "integer", "minimum": 1}, {"type": "null"}]}
# A memory size in the file (``80GiB``), bytes in Python, written back in the largest whole unit.
MemorySize = Annotated[int | None, BeforeValidator(memory_size), PlainSerializer(size_document),
                       WithJsonSchema(MEMORY_SIZE_SCHEMA)]
