"""The base of every configuration section: camelCase keys, frozen, unknown keys refused,
llama-swap's own keys accepted and ignored."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, model_validator
from pydantic.alias_generators import to_camel


def _schema_of_ignored_keys(schema: dict[str, Any], cls: type) -> None:
    """The keys a section accepts and ignores are part of its schema too."""
    assert issubclass(cls, Section)
    properties = schema.setdefault("properties", {})
    for key in sorted(cls._llama_swap_keys):
        properties[key] = {"description": "A llama-swap key: accepted and ignored."}
    for key, advice in cls._deprecated_keys.items():
        properties[key] = {"description": f"Deprecated: {advice}.", "deprecated": True}


class Section(BaseModel):
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
