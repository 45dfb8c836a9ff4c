"""The JSON Schema of the configuration document, generated from the sections (the Helm chart's
values.schema.json carries it)."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from llamaswap.config.sections import Config


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
