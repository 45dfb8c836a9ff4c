"""HTTP errors in the OpenAI error JSON shape."""

from __future__ import annotations

import json


def openai_error_body(message: str, error_type: str, code: str, param: str | None = None) -> bytes:
    return json.dumps({"error": {"message": message, "type": error_type, "param": param, "code": code}},
                      separators=(",", ":")).encode()
