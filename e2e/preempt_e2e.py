"""What the whole-stack stopping tests share (e2e/test_preempt_*.py, issue 46): a line of a
batch by the token path, the undisturbed answer it must come to (the fake's deterministic model,
e2e/fake_tokens.py), and reading the sidecar's `stop` records and a line's parts."""

from __future__ import annotations

from typing import Any

from fake_tokens import generate, prompt_text, text_of, tokenize
from harness import get_json

MAX_TOKENS = 12


def messages(content: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": content}]


def line(custom_id: str, content: str, model: str = "model-a") -> dict[str, Any]:
    """A chat line that can be continued exactly (temperature 0, text only): it takes the token path."""
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model, "max_tokens": MAX_TOKENS, "temperature": 0, "messages": messages(content)}}


def prompt_of(content: str) -> list[int]:
    return tokenize(prompt_text(messages(content)))


def check_answer(record: dict[str, Any], content: str, model: str, stops: int) -> None:
    """The line's one record is the undisturbed run's whole answer, with its stops counted."""
    prompt = prompt_of(content)
    assert record["response"]["status_code"] == 200 and record["error"] is None, record
    body = record["response"]["body"]
    assert body["object"] == "chat.completion" and body["model"] == model
    assert body["choices"][0]["message"] == {"role": "assistant", "content": text_of(generate(prompt, MAX_TOKENS))}
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": MAX_TOKENS,
                             "total_tokens": len(prompt) + MAX_TOKENS}
    assert body["llamaswap"] == {"stops": stops}


def stop_records(admin_url: str) -> list[dict[str, Any]]:
    return get_json(f"{admin_url}/activity?event=stop")["activity"]


def parts(admin_url: str, request_id: str) -> list[dict[str, Any]]:
    """The request records of a line's generating parts (its /completion sends), oldest first."""
    return [record for record in get_json(f"{admin_url}/activity")["activity"]
            if record.get("request_id") == request_id and record.get("generation") and record.get("max_tokens")]


def waiting_line(admin_url: str, request_id: str) -> dict[str, Any] | None:
    """The line's row in GET /queue's waiting list (a stopped line waiting to resume), if there."""
    rows = [row for row in get_json(f"{admin_url}/queue")["waiting"] if row["request_id"] == request_id]
    return rows[0] if rows else None
