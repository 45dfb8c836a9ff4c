"""llamaswap's configuration: YAML -> validated, frozen pydantic models.

- `sections`: the sections and `Config`, the one definition of every key;
- `types`: value types (`HostPort`, the enums, strict numbers) and validators;
- `problems`: `Problem`, `ConfigError`, and pydantic's errors as key-path problems;
- `load`: reading and validating a file or a document;
- `schema`: the JSON Schema of the document;
- `upstreams`: `GpuEntry`, an upstream of the node (`Config.gpu_entries`), and the checks of the list.
- `llama_command`: llama-server's command line, the one place that knows its flags.

This package's public names, which the rest of llamaswap imports from here.
"""

from llamaswap.config.load import load_config, load_document, parse_config
from llamaswap.config.problems import ConfigError, Problem, describe_value
from llamaswap.config.schema import json_schema
from llamaswap.config.sections import (
    DEFAULT_ADMIN,
    DEFAULT_UPSTREAM_PORT,
    SLOTS_AUTO,
    ActivityConfig,
    Config,
    EnvoyConfig,
    EstimatesConfig,
    FifoSettings,
    ListenConfig,
    ModelConfig,
    PrioritySecurityConfig,
    RoutingConfig,
    SchedulerConfig,
    SchedulerSettings,
    SecurityConfig,
    SerialSettings,
    UiConfig,
    UpstreamConfig,
    UpstreamItem,
)
from llamaswap.config.types import AbandonedGeneration, HostPort, ManagementApi, ModelCheck
from llamaswap.config.upstreams import GpuEntry
from llamaswap.core.priority import PriorityMode
from llamaswap.core.policy import IMPLICIT_GPU, PolicyName

__all__ = [
    "DEFAULT_ADMIN", "DEFAULT_UPSTREAM_PORT", "IMPLICIT_GPU", "SLOTS_AUTO", "AbandonedGeneration",
    "ActivityConfig", "Config", "ConfigError", "EnvoyConfig", "EstimatesConfig", "FifoSettings", "HostPort",
    "ListenConfig", "ManagementApi", "ModelCheck", "ModelConfig",
    "PriorityMode", "PrioritySecurityConfig", "Problem", "RoutingConfig", "SchedulerConfig", "PolicyName",
    "SchedulerSettings", "SecurityConfig", "SerialSettings", "UiConfig", "UpstreamConfig", "GpuEntry",
    "UpstreamItem", "describe_value", "json_schema",
    "load_config", "load_document", "parse_config",
]
