"""The `batches:` section: the OpenAI Batch API on the public port (`llamaswap.batches`)."""

from __future__ import annotations

import dataclasses
from typing import Annotated

from pydantic import BeforeValidator, Field, model_validator

from llamaswap.config.problems import ConfigError, Meaning, Problem, invalid
from llamaswap.config.section import Section
from llamaswap.config.types import (
    MemorySize,
    StrictBool,
    StrictInt,
    ZeroOrSeconds,
    api_key_reference,
    checked_trusted_header,
    optional_path,
    read_key_reference,
)

# The OpenAI Batch API's own limits (facts: models-and-batches.md).
MAX_REQUESTS_DEFAULT = 50_000
MAX_FILE_BYTES_DEFAULT = 200 * 1024 * 1024
# The longest answer of the upstream a batch line takes: as long as the longest request the listener
# passes by default (envoy.maxRequestBytes), and a few hundred MB of the sidecar's memory at most while
# it is read and parsed (an embeddings answer of 64 MiB is about 3 million numbers: 800 inputs of
# 4096 dimensions). A longer one is the line's error, answer_too_large, never asked again.
MAX_ANSWER_BYTES_DEFAULT = 64 * 1024 * 1024
# `llamaswap up` keeps batches here, under the directory it runs in, unless batches.dir is set.
UP_DIR_DEFAULT = "llamaswap-batches"
# The OpenAI files API's bounds on expires_after[seconds] (an hour to 30 days); outputs keep the longest.
EXPIRY_MIN_S = 3600
EXPIRY_MAX_S = 30 * 24 * 3600
OUTPUT_EXPIRY_DEFAULT_S = EXPIRY_MAX_S


class BatchKey(Section):
    """One caller of the Batch API: its name (the owner of what it creates) and where its key is."""

    name: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._@:-]+$",
                      description="The caller's name: it owns the files and batches it creates (shown in logs).")
    key: Annotated[str, BeforeValidator(api_key_reference)] = Field(
        description="Where the key is: 'file:PATH' or 'env:NAME', never the key itself; callers send it as "
                    "'Authorization: Bearer KEY'. Read at start, never logged.",
        json_schema_extra={"pattern": r"^((file:.+)|(env:[A-Za-z_][A-Za-z0-9_]*))$"})
    admin: StrictBool = Field(
        default=False, description="Sees and manages every caller's files and batches, not only its own.")


@dataclasses.dataclass(frozen=True, slots=True)
class KnownKey:
    """A key read from where batches.apiKeys (or upstream.apiKey) says: the key, who shows it."""

    key: str
    name: str
    admin: bool


class BatchesConfig(Section):
    """The OpenAI Batch API (POST /v1/files, /v1/batches on Envoy's listener): its files and state."""

    dir: Annotated[str | None, BeforeValidator(optional_path)] = Field(
        default=None,
        description="Where batches keep their state (SQLite) and files; null turns the Batch API off "
                    f"(`llamaswap up` uses ./{UP_DIR_DEFAULT} unless set). Put it on a persistent volume: "
                    "a batch resumes from here after a restart.")
    max_requests: StrictInt = Field(
        default=MAX_REQUESTS_DEFAULT, ge=1, description="The most lines one batch's input file may have.")
    max_file_bytes: StrictInt = Field(
        default=MAX_FILE_BYTES_DEFAULT, ge=1, description="The largest file POST /v1/files accepts, in bytes.")
    max_line_bytes: Annotated[StrictInt | None, Meaning("null = envoy.maxRequestBytes")] = Field(
        default=None, ge=1024,
        description="The longest line of a batch's input file, in bytes: a longer one is refused by its line "
                    "number without being read whole (the batch fails validation). Null: envoy.maxRequestBytes "
                    "(a longer request could not pass the listener anyway).")
    max_answer_bytes: StrictInt = Field(
        default=MAX_ANSWER_BYTES_DEFAULT, ge=64 * 1024,
        description="The longest answer of the upstream to one line, in bytes: a longer one is not read "
                    "(the line ends in the error file as answer_too_large and is not sent again), so no "
                    "answer can exhaust the sidecar's memory. Raise it for embeddings of many inputs.")
    in_flight: Annotated[StrictInt | None, Meaning("null = the node's slots")] = Field(
        default=None, ge=1,
        description="The most lines of one batch waiting or running at once; null: the node's slots (the "
                    "sum of every upstream's), so a batch never floods the queue.")
    api_keys: tuple[BatchKey, ...] = Field(
        default=(),
        description="The callers of the Batch API, each with its own key: each sees only the files and "
                    "batches it created (others get 404), an admin key sees all. Empty: upstream.apiKey where "
                    "set (one caller), else callerHeader, else the Batch API is open to every caller.")
    caller_header: Annotated[str | None, BeforeValidator(checked_trusted_header)] = Field(
        default=None,
        description="A header your authenticating proxy sets to the caller's name (and strips from clients' "
                    "requests): it names the owner of what a request creates. Null: not read.")
    admin_callers: tuple[str, ...] = Field(
        default=(),
        description="Callers named by callerHeader that see and manage every caller's files and batches.")
    max_stored_bytes: Annotated[MemorySize, Meaning("null = no quota")] = Field(
        default=None,
        description="A quota for the files kept (uploads and outputs together: 10GiB, 512MiB or bytes): an "
                    "upload that would pass it is refused with 413 storage_quota_exceeded. Null: none (the "
                    "disk is the bound).")
    preempt: StrictBool = Field(
        default=False,
        description="Send chat lines that can be continued exactly by llama-server's token path (/apply-template, "
                    "/tokenize, a streamed /completion), so that a line can be stopped at a token and resumed "
                    "where it stopped, with the same answer at temperature 0; on an upstream without that path "
                    "(not llama-server) a stopped chat line is sent again from its beginning. "
                    "Off: every line is sent as it is and is never stopped.")
    max_preemptions: StrictInt = Field(
        default=10, ge=0, le=1000,
        description="How many times one line may be stopped for a higher band (batches.preempt); after that "
                    "it runs to its end. 0: never stopped.")
    min_run_seconds: ZeroOrSeconds = Field(
        default=1.0, ge=0, le=86400,
        description="How long a line resumed after a stop runs before it may be stopped again for a higher "
                    "band: a stop may cost the line a re-read of its tokens, so it is not stopped again at once. "
                    "A line's first part may be stopped at once.")
    output_expiry_seconds: Annotated[StrictInt | None, Meaning("null = never")] = Field(
        default=OUTPUT_EXPIRY_DEFAULT_S, ge=EXPIRY_MIN_S, le=EXPIRY_MAX_S,
        description="How long a batch's output and error files are kept after they are written (an hour to "
                    "30 days, the OpenAI files API's bounds); then they are deleted. Null: until deleted.")

    @model_validator(mode="after")
    def _distinct_names(self) -> BatchesConfig:
        names = [entry.name for entry in self.api_keys]
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise invalid(f"names {', '.join(twice)} more than once: give each key its own name", key="apiKeys")
        if self.admin_callers and self.caller_header is None:
            raise invalid("names admin callers but callerHeader is unset: set callerHeader to the header your "
                          "proxy names callers in, or remove adminCallers", key="adminCallers")
        return self

    def read_keys(self, upstream_key: str | None) -> tuple[KnownKey, ...]:
        """The keys callers may show: batches.apiKeys, read now (ConfigError naming the entry when
        one cannot be read), or else the upstream's key as one caller (who sees all: today's one
        key shared by every caller)."""
        if not self.api_keys:
            return () if upstream_key is None else (KnownKey(upstream_key, "upstream-key", True),)
        keys = tuple(KnownKey(read_key_reference(entry.key, f"batches.apiKeys[{index}].key"), entry.name, entry.admin)
                     for index, entry in enumerate(self.api_keys))
        seen: dict[str, str] = {}
        for index, known in enumerate(keys):
            if known.key in seen:
                raise ConfigError([Problem(f"batches.apiKeys[{index}].key",
                                           f"holds the same key as {seen[known.key]}: give each caller its own")])
            seen[known.key] = known.name
        return keys

    @property
    def open_to_all(self) -> bool:
        """Whether nothing tells callers apart (no key of its own, no caller header): every caller
        who reaches the listener sees every file and batch (upstream.apiKey aside)."""
        return not self.api_keys and self.caller_header is None

