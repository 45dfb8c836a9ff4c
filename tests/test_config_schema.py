"""The configuration's JSON Schema (for the Helm chart's values.schema.json) agrees with the loader."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from llamaswap.config import Config, ConfigError, json_schema, parse_config

VALIDATORS = [jsonschema.Draft202012Validator, jsonschema.Draft7Validator]


def schemas(node: Any, path: str = "") -> list[tuple[str, dict[str, Any]]]:
    """Every property schema in the tree, by key path (a model's settings under models.*)."""
    out: list[tuple[str, dict[str, Any]]] = []
    if not isinstance(node, dict):
        return out
    for key, sub in node.get("properties", {}).items():
        out.append((f"{path}{key}", sub))
        out.extend(schemas(sub, f"{path}{key}."))
        if isinstance(sub.get("additionalProperties"), dict):
            out.extend(schemas(sub["additionalProperties"], f"{path}{key}.*."))
    return out


@pytest.mark.parametrize("validator", VALIDATORS, ids=lambda v: v.__name__)
def test_the_schema_is_a_valid_schema(validator):
    validator.check_schema(json_schema())


def test_the_schema_is_self_contained_json():
    text = json.dumps(json_schema())
    assert "$ref" not in text
    assert "$defs" not in text
    assert json.loads(text) == json_schema()


def test_every_key_has_a_description():
    found = schemas(json_schema())
    assert len(found) > 40
    assert [path for path, sub in found if not sub.get("description")] == []


def test_the_schema_uses_the_yaml_names():
    top = json_schema()["properties"]
    assert set(top["routing"]["properties"]["scheduler"]["properties"]) == {
        "use", "maxQueued", "maxWaitSeconds", "maxRunSeconds", "settings"}
    assert top["envoy"]["properties"]["extProcMessageTimeoutMs"]["deprecated"] is True
    assert "cmd" in top["models"]["additionalProperties"]["properties"]


def test_the_schema_defaults_are_the_documents():
    defaults = Config().to_document()
    for path, sub in schemas(json_schema()):
        if "default" not in sub or ".*." in path:
            continue
        value: Any = defaults
        for key in path.split("."):
            value = value[key]
        assert sub["default"] == value, path


@pytest.mark.parametrize("validator", VALIDATORS, ids=lambda v: v.__name__)
@pytest.mark.parametrize("document", [
    Config().to_document(),
    {},
    {"routing": {"scheduler": {"use": "fifo"}}, "models": {"qwen": {"priority": 10, "cmd": "llama-server", "ttl": 5}},
     "logLevel": "info", "envoy": {"extProcMessageTimeoutMs": 10000}},
    {"upstream": {"command": "llama-server --port 8081"}, "listen": {"http": "[::]:8080"}},
    {"routing": {"scheduler": {"maxWaitSeconds": 0.001, "settings": {"serial": {"agingDivisor": 0}}}}},
], ids=["defaults", "empty", "llama-swap keys", "strings", "boundaries"])
def test_documents_the_loader_accepts_pass_the_schema(validator, document):
    parse_config(document)
    validator(json_schema()).validate(document)


BAD = {
    "bonus above 99": {"routing": {"scheduler": {"settings": {"serial": {"swapAffinityBonus": 150}}}}},
    "unknown key": {"routing": {"scheduler": {"usse": "fifo"}}},
    "unknown top-level key": {"rouding": {}},
    "bad use": {"routing": {"scheduler": {"use": "lifo"}}},
    "integer as a string": {"routing": {"scheduler": {"maxQueued": "5"}}},
    "number as a boolean": {"routing": {"scheduler": {"settings": {"serial": {"agingDivisor": True}}}}},
    "tiny maxWaitSeconds": {"routing": {"scheduler": {"maxWaitSeconds": 0.0001}}},
    "listen without a port": {"listen": {"http": "localhost"}},
    "upstream url scheme": {"upstream": {"url": "ftp://x"}},
    "empty command list": {"upstream": {"command": []}},
    "relative healthPath": {"upstream": {"healthPath": "health"}},
    "short lease": {"envoy": {"leaseSeconds": 0.1}},
    "boolean as a string": {"envoy": {"failOpen": "true"}},
    "fifo takes no keys": {"routing": {"scheduler": {"settings": {"fifo": {"x": 1}}}}},
    "unknown model key": {"models": {"qwen": {"priorty": 1}}},
    "bad modelCheck": {"upstream": {"modelCheck": "maybe"}},
    "zero samples": {"estimates": {"samples": 0}},
}


@pytest.mark.parametrize("validator", VALIDATORS, ids=lambda v: v.__name__)
@pytest.mark.parametrize("case", sorted(BAD))
def test_documents_the_loader_refuses_fail_the_schema(validator, case):
    with pytest.raises(ConfigError):
        parse_config(BAD[case])
    assert list(validator(json_schema()).iter_errors(BAD[case])) != []
