"""Finding the `model` of an OpenAI-style request body without trusting it."""

from __future__ import annotations

import json
import re

# A quick pre-check: a body with no `"model"` key at all needs no JSON parse.
_MODEL_KEY = re.compile(rb'"model"\s*:')
# Bodies above this size are parsed off the event loop (see Coordinator).
LARGE_BODY_BYTES = 256 * 1024
MAX_MODEL_NAME = 512


def model_from_body(body: bytes) -> str | None:
    """The top-level string `model` of a JSON object body, else None (never raises)."""
    if not body or _MODEL_KEY.search(body) is None:
        return None
    try:
        document = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(document, dict):
        return None
    model = document.get("model")
    if not isinstance(model, str) or not model or len(model) > MAX_MODEL_NAME:
        return None
    return model
