"""The token path's pure rules (`batches/resume.py`): which lines can be continued exactly, where
a stream may be cut, the requests of each part and the one answer a stopped line gets; and the
progress the store keeps for a stopped line (the end wins over a stop)."""

from __future__ import annotations

import pathlib
from typing import Any

import pytest

from llamaswap.batches import resume
from llamaswap.batches.lifecycle import LineOutcome
from llamaswap.batches.resume import Part, Progress
from llamaswap.batches.store import Store
from llamaswap.batches.validate import InputLine

CHAT: dict[str, Any] = {"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]}


def _event(tokens: list[int], content: str, predicted: int, *, stop: bool = False,
           stop_type: str | None = None) -> dict[str, Any]:
    event: dict[str, Any] = {"content": content, "tokens": tokens, "tokens_predicted": predicted, "stop": stop}
    if stop_type is not None:
        event["stop_type"] = stop_type
    return event


@pytest.mark.parametrize(("extra", "why"), [
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, resume.TOOLS),
    ({"tool_choice": "auto"}, resume.TOOLS),
    ({"n": 2}, resume.CHOICES),
    ({"logprobs": True}, resume.LOGPROBS),
    ({"top_logprobs": 3}, resume.LOGPROBS),
    ({"response_format": {"type": "json_object"}}, resume.FORMAT),
    ({"grammar": "root ::= \"a\""}, resume.FORMAT),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, resume.MEDIA),
    ({"messages": [{"role": "tool", "content": "42", "tool_call_id": "c"}]}, resume.TOOLS),
    ({"chat_template_kwargs": {"enable_thinking": False}}, resume.UNKNOWN),
    ({"model": 7}, resume.UNKNOWN),
])
def test_lines_that_cannot_be_continued_exactly_keep_the_plain_path(extra: dict[str, Any], why: str) -> None:
    assert resume.not_continuable({**CHAT, **extra}) == why


@pytest.mark.parametrize("extra", [
    {}, {"temperature": 0, "seed": 4, "stop": ["\n"], "top_p": 0.9, "n": 1, "logprobs": False},
    {"response_format": {"type": "text"}, "tools": [], "service_tier": "flex"},
    {"messages": [{"role": "system", "content": [{"type": "text", "text": "be brief"}]},
                  {"role": "user", "content": "hi"}]},
])
def test_plain_chat_lines_can_be_continued(extra: dict[str, Any]) -> None:
    assert resume.not_continuable({**CHAT, **extra}) is None


def test_a_resume_asks_for_the_prompt_and_the_kept_tokens_and_the_tokens_left() -> None:
    body = {**CHAT, "temperature": 0, "stop": "END", "seed": 9, "user": "u"}
    first = resume.completion_body(body, Progress((1, 2, 3)))
    assert first == {"model": "m", "prompt": [1, 2, 3], "n_predict": 10, "stream": True, "return_tokens": True,
                     "cache_prompt": True, "temperature": 0, "stop": ["END"], "seed": 9}
    later = resume.completion_body(body, Progress((1, 2, 3), kept=(7, 8, 9, 10)))
    assert (later["prompt"], later["n_predict"]) == ([1, 2, 3, 7, 8, 9, 10], 6)
    unbounded = resume.completion_body({"model": "m", "messages": CHAT["messages"]}, Progress((1,), kept=(5,)))
    assert unbounded["n_predict"] == -1
    assert resume.completion_body({**CHAT, "max_completion_tokens": 4}, Progress((1,)))["n_predict"] == 4


def test_a_stop_keeps_the_tokens_read_and_their_text() -> None:
    part = Part()
    for n, (token, text) in enumerate([(11, "a"), (12, "b"), (13, "c")], start=1):
        part.add(_event([token], text, n))
    progress = Progress((1, 2), first_sent_at=5.0).stopped(part)
    assert (progress.kept, progress.text, progress.stops, progress.first_sent_at) == ((11, 12, 13), "abc", 1, 5.0)
    broken = progress.stopped(part, counted=False)
    assert (broken.kept, broken.stops) == ((11, 12, 13) * 2, 1)


def test_nothing_after_a_token_whose_id_never_came_is_kept() -> None:
    # llama-server leaves out the ids of tokens whose text is an incomplete UTF-8 sequence.
    part = Part()
    part.add(_event([11], "a", 1))
    part.add(_event([14], "é", 3))  # two tokens made it: one id is missing
    part.add(_event([15], "b", 4))
    assert (part.safe_tokens, part.safe_text) == (1, 1)
    assert Progress((1,)).stopped(part).kept == (11,)


def test_text_that_may_begin_a_stop_string_is_not_a_place_to_cut() -> None:
    part = Part(["STOP"])
    part.add(_event([11], "x", 1))
    part.add(_event([12], "ST", 2))  # may be the start of STOP: held back by llama-server
    assert (part.safe_tokens, part.safe_text) == (1, 1)
    part.add(_event([13], "A", 3))  # "STA": no stop string begins so
    assert (part.safe_tokens, part.safe_text) == (3, 4)


def test_the_answer_is_one_chat_completion_as_if_it_ran_once() -> None:
    progress = Progress((1, 2, 3, 4), kept=(11, 12), text="ab", stops=2)
    last = Part()
    last.add(_event([13], "c", 1))
    last.add(_event([], "", 1, stop=True, stop_type="eos"))
    answer = resume.answer(CHAT, progress, last, "batch_x:q1", 100)
    assert answer == {
        "id": "chatcmpl-batch_x:q1", "object": "chat.completion", "created": 100, "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "abc"}, "logprobs": None,
                     "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7},
        "llamaswap": {"stops": 2}}
    at_limit = Part()
    at_limit.add(_event([], "", 8, stop=True, stop_type="limit"))
    assert resume.answer(CHAT, progress, at_limit, "r", 1)["choices"][0]["finish_reason"] == "length"
    assert resume.answer(CHAT, progress, at_limit, "r", 1)["usage"]["completion_tokens"] == 10


def test_a_line_whose_kept_tokens_reach_its_bound_needs_no_resume() -> None:
    assert resume.finished_by_stops(CHAT, Progress((1,), kept=tuple(range(9)))) is None
    last = resume.finished_by_stops(CHAT, Progress((1,), kept=tuple(range(10))))
    assert last is not None and last.ended and last.finish_reason == "length"


def test_events_are_read_from_their_data_lines() -> None:
    assert resume.parse_event(b'data: {"content": "a"}') == {"content": "a"}
    assert resume.parse_event(b"data: [DONE]") is None
    assert resume.parse_event(b"") is None
    assert resume.parse_event(b": keep-alive") is None


def test_the_store_keeps_a_stopped_lines_progress_until_its_result(tmp_path: pathlib.Path) -> None:
    store = Store(tmp_path / "batches")
    try:
        progress = Progress((1, 2), kept=(5, 6), text="xy", stops=1, first_sent_at=1234.5)
        assert store.keep_progress("batch_a", 3, "batch_a:q3", progress)
        assert store.progress("batch_a", 3) == progress
        assert store.progress_of_request("batch_a:q3") == progress
        later = Progress((1, 2), kept=(5, 6, 7), text="xyz", stops=2, first_sent_at=1234.5)
        assert store.keep_progress("batch_a", 3, "batch_a:q3", later)
        assert store.progress("batch_a", 3) == later
        # the line's result deletes its progress, and no progress is kept after it (the end wins)
        batch = store.create_batch(endpoint="/v1/chat/completions", input_file_id="file-x", completion_window="24h",
                                   window_s=60, metadata=None, priority=-100, trace_id="t" * 32, span_id="s" * 16)
        assert store.keep_progress(batch.id, 3, f"{batch.id}:q3", progress)
        assert store.record_result(batch.id, InputLine(3, "q3", 0, 1), LineOutcome.COMPLETED, "{}")
        assert store.progress(batch.id, 3) is None
        assert not store.keep_progress(batch.id, 3, f"{batch.id}:q3", later)
        assert store.progress_of_request(f"{batch.id}:q3") is None
    finally:
        store.close()
