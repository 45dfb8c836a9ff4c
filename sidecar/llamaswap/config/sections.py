"""The configuration's sections: validated, frozen pydantic models, the one definition of every key.

Keys follow llama-swap's (``routing.scheduler...``, ``models.<id>...``) so one file can serve
both. Each key's type, range, default and meaning is written here once; the loader
(`llamaswap.config.load`), :meth:`Config.to_document` and the JSON Schema
(`llamaswap.config.schema`) all come from these models.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BeforeValidator, ConfigDict, Field, PrivateAttr, WithJsonSchema, model_validator

from llamaswap.config.batches import BatchesConfig
from llamaswap.config.idle import (TTL_SCHEMA, KeepAliveConfig, global_ttl_as_upstream, global_ttl_problems,
                                   ttl_value)
from llamaswap.config.model_key import single_model_slots
from llamaswap.config.section import Section
from llamaswap.config.problems import Meaning, describe_value, invalid, invalid_all
from llamaswap.config.types import (
    UrlParts,
    AbandonedGeneration,
    HostPort,
    ManagementApi,
    ModelCheck,
    StrictBool,
    StrictInt,
    MemorySize,
    StrictNumber,
    ZeroOrSeconds,
    checked_health_path,
    model_id,
    none_is_empty,
    api_key_reference,
    objective_name,
    optional_http_url,
    optional_path,
    priority_value,
    read_key_reference,
    checked_trusted_header,
    upstream_url,
)
from llamaswap.config.residency import ModelSize, model_sizes, residency_of, residency_problems
from llamaswap.config.upstreams import (
    IMPLICIT_GPU,
    SLOTS_AUTO,
    UPSTREAM_URL_PATTERN,
    Command,
    GpuEntry,
    UpstreamItem,
    duplicates,
    moved_keys,
    slots_left_unreserved,
    unserved_models,
    upstream_list,
)
from llamaswap.core.priority import ALIASES, PriorityMode, PriorityPolicy
from llamaswap.core import GpuPolicy, InvalidSlots, Policy, PolicyName, Slots
from llamaswap.core.residency import Residency

# The anchors (batch -100, normal 0, interactive 100) sit this far apart. The swap affinity
# bonus stays below it, so it never lifts a request at one anchor over a request at the next
# one up; off the anchors it can cross a band's edge (45 + 10 beats 50), and aging lifts any
# request in time.
BAND_SPACING = ALIASES["interactive"] - ALIASES["normal"]
MAX_SWAP_AFFINITY_BONUS = BAND_SPACING - 1

# Where the sidecar's admin HTTP server listens by default (listen.admin), which
# `llamaswap queue` asks when it is given neither an address nor a configuration.
DEFAULT_ADMIN = HostPort("127.0.0.1", 9090)
# The upstream's default port (upstream.url), where `llamaswap up` starts its built-in llama-server.
DEFAULT_UPSTREAM_PORT = 8081


# routing.retryGraceSeconds: the OpenAI SDKs back off at most 8 s between tries (facts:
# components.md, "Clients"); 10 s covers that and the client's new connection. At most an hour.
RETRY_GRACE_SECONDS_DEFAULT = 10.0
MAX_RETRY_GRACE_SECONDS = 3600.0

RESERVED_SLOTS_MEANING = (
    "Of a model's slots, this many are kept for the interactive band (priority >= 50); it must be below "
    "every model's slots. 0 reserves none.")


def _slots_value(value: Any) -> Any:
    if value == SLOTS_AUTO or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        return value
    raise invalid(f"must be an integer >= 1 or 'auto' (ask the upstream), got {describe_value(value)}")


def _at_least_one_item(schema: dict[str, Any]) -> None:
    """An empty list is refused (upstreams: [] names no upstream); null is the default."""
    for branch in schema.get("anyOf", []):
        if branch.get("type") == "array":
            branch["minItems"] = 1


class SerialSettings(Section):
    """The serial scheduler: score = priority + swap affinity + aging; the best score goes next."""

    aging_divisor: Annotated[ZeroOrSeconds, Meaning("0 disables aging")] = Field(
        default=60.0, ge=0,
        description="Seconds of waiting per priority point (aging = waited seconds / agingDivisor); "
                    "0 disables aging. A positive value below 0.001 is refused: it would round to 0.")
    swap_affinity_bonus: Annotated[StrictInt, Meaning(
        f"0 disables it; it must stay below the band spacing of {BAND_SPACING}")] = Field(
        default=10, ge=0, le=MAX_SWAP_AFFINITY_BONUS,
        description=f"Bonus for a request that needs no model swap, 0..{MAX_SWAP_AFFINITY_BONUS}; 0 disables it. "
                    f"It stays below the band spacing of {BAND_SPACING}, so it never lifts a request at one anchor "
                    "(batch, normal, interactive) over the next; off the anchors it can (45 + 10 beats 50).")
    reserved_slots: Annotated[StrictInt, Meaning("0 reserves none")] = Field(
        default=0, ge=0, description=RESERVED_SLOTS_MEANING)


class FifoSettings(Section):
    """The fifo scheduler (a model's priority is models.<id>.priority)."""

    reserved_slots: Annotated[StrictInt, Meaning("0 reserves none")] = Field(
        default=0, ge=0, description=RESERVED_SLOTS_MEANING)


class SchedulerSettings(Section):
    """Each scheduler's settings; only those of routing.scheduler.use apply."""

    serial: SerialSettings = Field(default_factory=SerialSettings)
    fifo: FifoSettings = Field(default_factory=FifoSettings)


class SchedulerConfig(Section):
    """Which request gets the GPU next, and how long the queue may grow."""

    use: PolicyName = Field(default=PolicyName.SERIAL, description="The scheduler: serial or fifo.")
    max_queued: Annotated[StrictInt, Meaning("0 = unlimited")] = Field(
        default=0, ge=0, description="Waiting requests before new ones get 429 + Retry-After; 0 = unlimited.")
    max_wait_seconds: Annotated[ZeroOrSeconds, Meaning("0 = wait forever")] = Field(
        default=0.0, ge=0,
        description="A request that waited longer gets 503 + Retry-After; 0 = wait forever. "
                    "A positive value below 0.001 is refused: it would round to 0 ('forever').")
    max_run_seconds: Annotated[StrictNumber, Meaning("0 = off")] = Field(
        default=0.0, ge=0, description="Watchdog: free the GPU from a grant older than this; 0 = off.")
    settings: SchedulerSettings = Field(default_factory=SchedulerSettings)


# The Helm chart's three InferenceObjectives, named after the bands.
DEFAULT_OBJECTIVES: Mapping[str, int] = dict(ALIASES)


class RoutingConfig(Section):
    """How requests are scheduled onto the one GPU."""

    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    objectives: Annotated[Mapping[Annotated[str, BeforeValidator(objective_name)],
                                  Annotated[int, BeforeValidator(priority_value),
                                            WithJsonSchema({"anyOf": [{"type": "integer"},
                                                                      {"enum": list(ALIASES)}]})]],
                          BeforeValidator(none_is_empty)] = Field(
        default_factory=lambda: dict(DEFAULT_OBJECTIVES),
        description="The priority of a request that sends no X-LlamaSwap-Priority but names an InferenceObjective "
                    "in x-llm-d-inference-objective (llm-d's router in front of an InferencePool): objective name -> "
                    "an integer or interactive, normal, batch. An objective not listed counts as no header (0); "
                    "{} ignores the objective header.")
    retry_grace_seconds: Annotated[ZeroOrSeconds, Meaning("0 = off")] = Field(
        default=RETRY_GRACE_SECONDS_DEFAULT, ge=0, le=MAX_RETRY_GRACE_SECONDS,
        description="A waiting request whose client leaves keeps its place this long: the client's retry of the "
                    "same request (same caller, and the same client-chosen x-request-id, or else the same body, "
                    "model and priority) takes it over, with its arrival time. 0 = off (no body reaches the "
                    "sidecar). A change between 0 and a positive value needs a restart (Envoy's bootstrap).")
    keep_alive: KeepAliveConfig = Field(default_factory=KeepAliveConfig)


class ModelConfig(Section):
    """One model, by the id requests name in "model". llama-swap's per-model keys are accepted and ignored."""

    _llama_swap_keys: ClassVar[frozenset[str]] = frozenset({
        "cmd", "cmdStop", "proxy", "aliases", "env", "checkEndpoint", "useModelName", "unlisted",
        "filters", "name", "description", "concurrencyLimit", "metadata", "macros", "sendLoadingState",
    })

    priority: StrictInt = Field(
        default=0, description="fifo only: added to the caller's X-LlamaSwap-Priority for this model "
                               "(a model at 10 with a batch header queues at -90).")
    slots: Annotated[StrictInt | None, Meaning("null = upstream.slots")] = Field(
        default=None, ge=1, description="Generations of this model at once; overrides upstream.slots. "
                                        "Null (the default) takes upstream.slots.")
    memory: MemorySize = Field(
        default=None,
        description="What this model takes on a GPU once loaded (weights, KV cache, buffers), e.g. 40GiB, counted "
                    "against upstream.memory; null: llamaswap's estimate from its GGUF file.")
    pinned: StrictBool = Field(
        default=False,
        description="Loaded and never evicted, on each upstream that may serve it (needs maxLoaded >= 2 there).")
    ttl: Annotated[float | None, BeforeValidator(ttl_value), WithJsonSchema(TTL_SCHEMA)] = Field(
        default=None,
        description="llama-swap's key: seconds this model may sit idle (nothing running, loading or waiting for "
                    "it) before it is unloaded; 0 = never; -1 or null (the default): the upstream's "
                    "idleUnloadSeconds.")


class ListenConfig(Section):
    """The addresses the stack listens on, each 'host:port' ('[::1]:8080' for IPv6)."""

    http: HostPort = Field(default=HostPort("127.0.0.1", 8080), description="Envoy's listener: clients connect here.")
    grpc: HostPort = Field(default=HostPort("127.0.0.1", 9000),
                           description="The sidecar's gRPC server, which Envoy calls.")
    admin: HostPort = Field(default=DEFAULT_ADMIN,
                            description="The sidecar's admin HTTP: /healthz /readyz /metrics /queue /activity, "
                                        "and the page /ui.")
    allow_remote: StrictBool = Field(
        default=False,
        description="Allow listen.grpc and listen.admin on an address other than the loopback. Whoever reaches "
                    "the gRPC port can hold or renew grants for ever, and the admin port shows the queue: "
                    "only behind a network policy that admits Envoy alone.")

    @model_validator(mode="after")
    def _sidecar_ports_local(self) -> ListenConfig:
        if self.allow_remote:
            return self
        for key, address, reach in (("grpc", self.grpc, "can renew leases for ever"),
                                    ("admin", self.admin, "can read the queue and every request's record")):
            if not address.is_loopback:
                raise invalid(f"{address} is not a loopback address: anyone who reaches it {reach}. Bind it to "
                              f"127.0.0.1 (Envoy runs beside the sidecar), or set listen.allowRemote: true "
                              f"behind a network policy", key=key)
        return self


class UpstreamConfig(UrlParts, Section):
    """The OpenAI-compatible server behind the queue: llama-server, llama-swap, or any other."""

    url: Annotated[str, BeforeValidator(upstream_url)] = Field(
        default=f"http://127.0.0.1:{DEFAULT_UPSTREAM_PORT}",
        description="The upstream's base URL, http:// or https://; a trailing '/' is dropped.",
        json_schema_extra={"pattern": UPSTREAM_URL_PATTERN})
    command: Command = Field(default=(), description="`llamaswap up` starts this and waits for healthPath: a "
                                                     "command line (split like a shell does) or a list of "
                                                     "arguments; empty for none.")
    health_path: Annotated[str, BeforeValidator(checked_health_path)] = Field(
        default="/health", description="The upstream's health check path, starting with '/'.",
        json_schema_extra={"pattern": "^/"})
    startup_timeout_seconds: StrictNumber = Field(
        default=300.0, gt=0, description="How long `llamaswap up` waits for the upstream's health check to pass.")
    models_poll_seconds: Annotated[StrictNumber, Meaning("0 = off")] = Field(
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
    settle_timeout_seconds: StrictNumber = Field(
        default=600.0, gt=0,
        description="The longest wait for the upstream to become idle after an abandoned generation.")
    management_api: ManagementApi = Field(
        default=ManagementApi.REFUSE,
        description="llama-server's management API on Envoy's listener (POST /models/load, /models/unload, "
                    "/slots/N?action=...): refuse (403), or schedule it like a generation.")
    slots: Annotated[int | Literal["auto"], BeforeValidator(_slots_value)] = Field(
        default=1,
        description="Generations of the loaded model at once (llama-server's --parallel): an integer >= 1, or "
                    "'auto': ask the upstream (/props total_slots; 1 with a log line if it cannot tell). 1 (the "
                    "default) grants one request at a time.",
        json_schema_extra={"anyOf": [{"type": "integer", "minimum": 1}, {"const": "auto"}]})
    max_loaded: StrictInt = Field(
        default=1, ge=1,
        description="Models resident on the upstream at once (llama-server's router: --models-max); llamaswap "
                    "evicts, by what the queue needs least, to make room. 1 (the default): a load replaces the "
                    "resident model.")
    memory: MemorySize = Field(
        default=None,
        description="A memory budget the resident models must fit in together (80GiB, 512MiB, 1.5GB or bytes): "
                    "each model then needs models.<id>.memory, or a GGUF file llamaswap can read to estimate it "
                    "(its size plus its KV cache). Null (the default): count models only (maxLoaded).")
    idle_unload_seconds: Annotated[ZeroOrSeconds, Meaning("0 = never")] = Field(
        default=0.0, ge=0,
        description="Unload a resident model (POST /models/unload) once it has sat idle this long: nothing running, "
                    "loading or waiting for it since its last request ended; never a pinned one. 0 (the default) "
                    "= never; models.<id>.ttl overrides it per model (llama-swap's globalTTL is read as it).")
    api_key: Annotated[str | None, BeforeValidator(api_key_reference)] = Field(
        default=None,
        description="Where the upstream's API key is (llama-server's --api-key): 'file:PATH' or 'env:NAME', never "
                    "the key itself. The sidecar sends it as 'Authorization: Bearer' on its own requests to the "
                    "upstream, and `llamaswap up` gives it to the upstream it starts; read at start, never logged. "
                    "Empty or null for none.",
        json_schema_extra={"pattern": r"^((file:.+)|(env:[A-Za-z_][A-Za-z0-9_]*))?$"})

    def read_api_key(self) -> str | None:
        """The upstream's API key, read from where upstream.apiKey says; None without one. Raises
        ConfigError (naming the file or variable, never the value) when it cannot be read."""
        return None if self.api_key is None else read_key_reference(self.api_key, "upstream.apiKey")


# Envoy reports a running exchange this many times per envoy.leaseSeconds (its access-log
# flush interval is leaseSeconds / RENEWALS_PER_LEASE).
RENEWALS_PER_LEASE = 3


class EnvoyConfig(Section):
    """Envoy's timers and limits, used by the generated bootstrap."""

    _deprecated_keys: ClassVar[Mapping[str, str]] = {
        "extProcMessageTimeoutMs": "no longer used (the data path has no ext_proc); remove it",
    }

    stream_idle_timeout_seconds: StrictNumber = Field(
        default=300.0, gt=0, description="Idle timeout of the routes that skip the queue.")
    max_request_bytes: StrictInt = Field(
        default=64 * 1024 * 1024, ge=1024, description="Largest request body; larger ones get 413.")
    max_sidecar_streams: StrictInt = Field(
        default=100_000, ge=1,
        description="Concurrent gRPC streams from Envoy to the sidecar; waiting requests hold them.")
    fail_open: StrictBool = Field(
        default=False,
        description="With the sidecar down: false = refuse clients (503/500), true = pass them unscheduled.")
    lease_seconds: StrictNumber = Field(
        default=3.0, ge=0.3, description="A grant Envoy has not reported on for this long is released.")
    max_heap_bytes: StrictInt = Field(
        default=0, ge=0,
        description="Envoy's heap budget (overload manager): past 95% of it new requests get 503 + Retry-After "
                    "instead of Envoy being killed at its memory limit with the whole queue. 0 = 75% of the limit "
                    "passed to `llamaswap envoy-config --memory-limit-bytes` (the Helm chart passes the Envoy "
                    "container's), or none without one.")


class PrioritySecurityConfig(Section):
    """What callers may claim with X-LlamaSwap-Priority."""

    mode: PriorityMode = Field(default=PriorityMode.TRUST, description="trust, clamp or strip the caller's priority.")
    min: StrictInt = Field(default=-100, description="clamp: the lowest priority a caller may claim.")
    max: StrictInt = Field(default=100, description="clamp: the highest priority a caller may claim.")
    trusted_header: Annotated[str | None, BeforeValidator(checked_trusted_header)] = Field(
        default=None,
        description="A header set only by your authenticating proxy (which drops clients' copies): its value is the "
                    "priority, unclamped. Case-insensitive; empty or null for none.")

    @model_validator(mode="after")
    def _min_not_above_max(self) -> PrioritySecurityConfig:
        if self.min > self.max:
            raise invalid(f"must not exceed security.priority.max ({self.min} > {self.max})", key="min")
        return self


class SecurityConfig(Section):
    """What callers are allowed to do."""

    priority: PrioritySecurityConfig = Field(default_factory=PrioritySecurityConfig)


class ActivityConfig(Section):
    """The activity log: one JSON record per finished request."""

    path: Annotated[str | None, BeforeValidator(optional_path)] = Field(
        default=None, description="Append the records to this file, one JSON object a line; empty or null for none.")
    recent: Annotated[StrictInt, Meaning("0 keeps none")] = Field(
        default=1000, ge=0, description="Records kept in memory for GET /activity; 0 keeps none.")


class EstimatesConfig(Section):
    """Expected run and swap times, before (and between) measurements."""

    default_run_seconds: StrictNumber = Field(
        default=10.0, gt=0, description="Expected run time of a request for a model before anything is measured.")
    # 2.5 s: an 8B model at f16 (15 GB) loaded in 2.2-2.6 s on an H200 from the page cache, a 1B
    # in 0.8 s (bench/gpu, docs/gpu.md); 5 s, the figure before, held requests back for loads
    # that take half as long on the models most nodes serve.
    default_swap_seconds: StrictNumber = Field(
        default=2.5, ge=0, description="Expected extra cost of a model swap before anything is measured.")
    samples: StrictInt = Field(default=50, ge=1, description="Recent measurements per model behind the rolling median.")


class UiConfig(Section):
    """The page at GET /ui on the admin server."""

    jaeger_url: Annotated[str, BeforeValidator(optional_http_url)] = Field(
        default="", description="The Jaeger UI's address as the browser reaches it (e.g. http://127.0.0.1:16686): "
                                "the page links each request to its trace there; empty for no links.")


class Config(Section):
    """llamaswap's configuration file. Every key is optional; a section with nothing under it means its defaults."""

    model_config = ConfigDict(title="llamaswap configuration")

    _llama_swap_keys: ClassVar[frozenset[str]] = frozenset({
        "healthCheckTimeout", "logLevel", "metricsMaxInMemory", "startPort", "macros", "groups", "hooks",
        "includeAliasesInList", "logRequests",
    })

    routing: RoutingConfig = Field(default_factory=RoutingConfig)
    models: Annotated[Mapping[Annotated[str, BeforeValidator(model_id)], ModelConfig],
                      BeforeValidator(none_is_empty)] = Field(
        default_factory=dict, description="Per-model settings, by model id.")
    listen: ListenConfig = Field(default_factory=ListenConfig)
    upstream: UpstreamConfig = Field(default_factory=UpstreamConfig)
    upstreams: Annotated[tuple[UpstreamItem, ...] | None, BeforeValidator(upstream_list)] = Field(
        default=None,
        description="Several upstreams behind the one queue, each one llama-server (a GPU): name, url, and "
                    "optionally slots, models, command. Null (the default): upstream.url, slots and command are "
                    f"the one upstream, named {IMPLICIT_GPU}. With a list, those three go in the entries "
                    "(upstream.slots stays the default of an entry's slots); a change needs a restart.",
        json_schema_extra=_at_least_one_item)
    envoy: EnvoyConfig = Field(default_factory=EnvoyConfig)
    security: SecurityConfig = Field(default_factory=SecurityConfig)
    activity: ActivityConfig = Field(default_factory=ActivityConfig)
    estimates: EstimatesConfig = Field(default_factory=EstimatesConfig)
    ui: UiConfig = Field(default_factory=UiConfig)
    batches: BatchesConfig = Field(default_factory=BatchesConfig)
    global_ttl: Annotated[StrictInt | None, Meaning("null = upstream.idleUnloadSeconds")] = Field(
        default=None, ge=0, alias="globalTTL",
        description="llama-swap's key, read as upstream.idleUnloadSeconds (set one of the two).")

    _source: str = PrivateAttr("<defaults>")
    # The node's GPUs (`gpu_entries`), built once when the file is validated.
    _entries: tuple[GpuEntry, ...] = PrivateAttr(default=())
    # Each upstream's model sizes (`residency.model_sizes`), read once when the file is validated.
    _model_sizes: Mapping[str, Mapping[str, ModelSize]] = PrivateAttr(default_factory=dict)

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

    @model_validator(mode="before")
    @classmethod
    def _global_ttl(cls, data: Any) -> Any:
        return global_ttl_as_upstream(data)

    @model_validator(mode="after")
    def _gpus_built(self) -> Config:
        # First of the validators: the others read the list. Without ``upstreams`` it is one
        # entry, IMPLICIT_GPU, of upstream.url, slots and command; an entry's settings default to
        # upstream's.
        upstream = self.upstream
        problems = global_ttl_problems(upstream.idle_unload_seconds, self.global_ttl)
        if problems:
            raise invalid_all(type(self).__name__, problems)
        idle_s = upstream.idle_unload_seconds  # (globalTTL's where the file gives only that: `global_ttl_as_upstream`)
        if self.upstreams is None:
            self._entries = (GpuEntry(IMPLICIT_GPU, upstream.url, upstream.slots, None, upstream.command,
                                           upstream.max_loaded, upstream.memory, idle_s),)
        else:
            self._entries = tuple(
                GpuEntry(item.name, item.url, upstream.slots if item.slots is None else item.slots,
                              None if item.models is None else frozenset(item.models), item.command,
                              upstream.max_loaded if item.max_loaded is None else item.max_loaded,
                              upstream.memory if item.memory is None else item.memory,
                              idle_s if item.idle_unload_seconds is None else item.idle_unload_seconds)
                for item in self.upstreams)
        return self

    @model_validator(mode="after")
    def _upstreams_fit(self) -> Config:
        # The list's problems together. The moved upstream keys only once the list is right: `up`
        # adds upstream.url and command to a file that names neither, which must not bury the rest.
        if self.upstreams is None:
            return self
        entries = self.gpu_entries
        own_slots = [item.slots is not None for item in self.upstreams]
        reserved_key = f"routing.scheduler.settings.{self.routing.scheduler.use}.reservedSlots"
        problems = [*duplicates(entries), *unserved_models(entries, self.models),
                    *slots_left_unreserved(entries, own_slots, self.reserved_slots, reserved_key)]
        if not problems:
            fields = type(self.upstream).model_fields
            problems = moved_keys({fields[name].alias or name for name in self.upstream.model_fields_set}, own_slots)
        if problems:
            raise invalid_all(type(self).__name__, problems)
        return self

    @model_validator(mode="after")
    def _slots_fit(self) -> Config:
        # The one check across sections: a reservation must leave every model a non-interactive slot.
        try:
            if self.upstreams is None:
                self.slots(IMPLICIT_GPU)
            else:  # the upstreams' own slots are checked above; models.<id>.slots here
                per_model = {model_id: model.slots for model_id, model in self.models.items()
                             if model.slots is not None}
                Slots(self.reserved_slots + 1, per_model, self.reserved_slots)
        except InvalidSlots as exc:
            use = self.routing.scheduler.use
            reserved_key = f"routing.scheduler.settings.{use}.reservedSlots"
            slots_key = "upstream.slots" if exc.model is None else f"models.{exc.model}.slots"
            raise invalid(f"{exc.reserved} reserved slots leave {slots_key} ({exc.slots}) no slot for "
                          f"non-interactive requests: set it below {exc.slots}, or raise {slots_key}",
                          key=reserved_key) from None
        return self

    @model_validator(mode="after")
    def _residency_fits(self) -> Config:
        # Where an upstream has a memory budget, every model it serves needs a size (read from
        # GGUF files here, once); pinned models must be able to stay.
        sizes, problems = model_sizes(self)
        problems += residency_problems(self, sizes)
        if problems:
            raise invalid_all(type(self).__name__, problems)
        self._model_sizes = sizes
        return self

    def residency_of(self, gpu: str) -> Residency:
        """How many models the upstream named ``upstream`` keeps resident at once, which are
        pinned, and its memory budget with each model's size (``models.<id>.memory`` or the GGUF
        estimate): what its `GpuPolicy` carries. KeyError for a name it does not have."""
        return residency_of(self, gpu, self._model_sizes)

    def model_sizes(self, gpu: str) -> Mapping[str, ModelSize]:
        """The sizes of the models of ``upstream`` and where each comes from (a key or its GGUF file)."""
        return self._model_sizes.get(gpu, {})

    @property
    def gpu_entries(self) -> tuple[GpuEntry, ...]:
        """The node's GPUs, in the file's order: ``upstreams``, or without it one entry
        (IMPLICIT_GPU) of upstream.url, slots and command. An entry's slots default to upstream.slots."""
        return self._entries

    def entry(self, gpu: str) -> GpuEntry:
        """The GPU named ``gpu``; KeyError for a name the file does not have."""
        for entry in self._entries:
            if entry.name == gpu:
                return entry
        names = ", ".join(entry.name for entry in self._entries)
        raise KeyError(f"no upstream named {gpu!r} (the configuration has {names})")

    @property
    def reserved_slots(self) -> int:
        """routing.scheduler.settings.<use>.reservedSlots of the scheduler in use."""
        settings = self.routing.scheduler.settings
        return (settings.fifo if self.routing.scheduler.use == PolicyName.FIFO else settings.serial).reserved_slots

    def slots(self, gpu: str, learnt: Mapping[str | None, int] | None = None, single: str | None = None) -> Slots:
        """The slots of every model on the GPU named ``gpu`` (its entry's slots). With ``slots:
        auto``, ``learnt`` is what its upstream said: by model in router mode, under None for a
        single-model upstream. A model configured in ``models.<id>.slots`` keeps its number; one
        asked about has what it said; every other has the last number learnt (a router's
        children mostly share --parallel), 1 before any. A reservation that does not fit learnt
        numbers is lowered (`Slots.fitted`: compare ``.reserved`` with `reserved_slots` to warn);
        configured numbers are checked as written (InvalidSlots), under ``auto`` too. ``single``
        is the key of a single-model upstream's one model (`model_key`): every
        ``models.<id>.slots`` describes it."""
        per_model = {model_id: model.slots for model_id, model in self.models.items() if model.slots is not None}
        if single is not None:
            per_model = single_model_slots(single, per_model)
        configured = self.entry(gpu).slots
        if configured == SLOTS_AUTO:
            # The numbers written in models.<id>.slots must hold the reservation as they are.
            Slots(self.reserved_slots + 1, per_model, self.reserved_slots)
            learnt = dict(learnt or {})
            default = learnt.get(None, next(reversed(learnt.values()), 1))
            asked = {model: slots for model, slots in learnt.items() if model is not None}
            return Slots.fitted(default, {**asked, **per_model}, self.reserved_slots)
        assert isinstance(configured, int)
        return Slots(configured, per_model, self.reserved_slots)

    def gpu_policy(self, gpu: str, learnt_slots: Mapping[str | None, int] | None = None,
                   single: str | None = None) -> GpuPolicy:
        """The GPU named ``gpu`` as the scheduler's policy has it: its slots (``learnt_slots``,
        ``single``: as for `slots`), the models it may serve and its residency (`residency_of`)."""
        return GpuPolicy(gpu, self.slots(gpu, learnt_slots, single), self.entry(gpu).models, self.residency_of(gpu))

    def policy(self, gpus: Sequence[GpuPolicy] | None = None) -> Policy:
        """The scheduler's policy over ``gpus`` (None: every GPU as configured, `gpu_policy`, with
        nothing learnt)."""
        s = self.routing.scheduler
        over = tuple(gpus) if gpus is not None else tuple(self.gpu_policy(entry.name) for entry in self._entries)
        min_run_s = float(self.batches.min_run_seconds)  # a resumed Batch API line's (`core/preemption.py`)
        if s.use == PolicyName.FIFO:
            priorities = {model_id: model.priority for model_id, model in self.models.items()}
            policy = Policy.fifo(model_priorities=priorities, max_queued=s.max_queued, max_wait_s=s.max_wait_seconds,
                                 stop_min_run_s=min_run_s)
        else:
            serial = s.settings.serial
            policy = Policy.serial(aging_divisor_s=serial.aging_divisor, swap_affinity_bonus=serial.swap_affinity_bonus,
                                   max_queued=s.max_queued, max_wait_s=s.max_wait_seconds, stop_min_run_s=min_run_s)
        return policy.with_gpus(over)

    def priority_policy(self) -> PriorityPolicy:
        """What callers may claim with X-LlamaSwap-Priority."""
        p = self.security.priority
        return PriorityPolicy(mode=p.mode, minimum=p.min, maximum=p.max, trusted_header=p.trusted_header,
                              objectives=self.routing.objectives)

    def to_document(self) -> dict[str, Any]:
        """The effective configuration in the YAML shape, every default filled in. With
        ``upstreams``, upstream.url and command are left out: the entries have them."""
        exclude = None if self.upstreams is None else {"upstream": {"url", "command"}}
        return self.model_dump(mode="json", by_alias=True, exclude=exclude)
