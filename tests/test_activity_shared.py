"""One activity record per finished request (issue 49): the page's history (runtime/history.py)
takes the record and the line the activity log (runtime/activity.py) made, instead of building
and encoding its own."""

from __future__ import annotations

import pathlib

import pytest
from flow import FakeUpstream, Flow, clock, router, virtual_time
from llamaswap.runtime import json_line
from llamaswap.runtime.activity import ActivityLog
from llamaswap.runtime.history import History
from llamaswap.runtime.ticket import ExchangeEnd

CONFIG = {"envoy": {"leaseSeconds": 1000}}


@virtual_time
async def test_the_page_history_shares_the_record_the_activity_log_built(monkeypatch: pytest.MonkeyPatch,
                                                                         tmp_path: pathlib.Path) -> None:
    """One record per finished request (issue 49): the timeline's entry is the activity log's
    record, from its line, with the entry's own fields after it, the bytes the encoder would
    write for that dict; a History without the log builds its own."""
    built: list[str] = []
    build = ActivityLog.record

    def counted(self: ActivityLog, ticket):  # type: ignore[no-untyped-def]
        built.append(ticket.request_id)
        return build(self, ticket)

    monkeypatch.setattr(ActivityLog, "record", counted)
    activity = ActivityLog(clock(), path=str(tmp_path / "activity.jsonl"))  # a line to share
    history = History(clock(), activity)
    flow = Flow(CONFIG, observers=[activity, history])
    a = await flow.arrive("a", "interactive", "a")
    b = await flow.arrive("b", "batch", "b")
    await flow.advance(1)
    await flow.complete(a, 200)
    assert b.granted  # after a
    await flow.complete(b)
    assert built == ["a", "b"]
    records = {r["request_id"]: r for r in activity.recent()}
    for entry in history.entries():
        document = entry.document()
        assert document["seq"] == entry.seq and document["kind"] == entry.kind
        own = {"seq", "kind", "start_ms", "end_ms", "overtook"}
        assert {k: v for k, v in document.items() if k not in own} == records[entry.request_id]
        assert list(document)[:2 + len(records[entry.request_id])] == ["seq", "kind", *records[entry.request_id]]
        assert entry.body == json_line.line(document)
        assert not own & records[entry.request_id].keys()  # the log's record is not changed, nor names an own key

    alone = History(clock(), ActivityLog(clock()))
    flow_alone = Flow(CONFIG, observers=[alone])
    c = await flow_alone.arrive("c", "interactive", "a")
    await flow_alone.complete(c)
    assert built[2:] == ["c"] and [e.request_id for e in alone.entries()] == ["c"]


@virtual_time
async def test_a_timeline_entry_is_the_same_bytes_whenever_it_is_first_read() -> None:
    """An entry's JSON is joined when first read (issue 49), not when it is made: the bytes
    are those of the entry as it was made whenever they are read, though the activity log's
    record changes after (an abandoned request's gets its settle), and they are kept once read."""
    activity = ActivityLog(clock())
    read_at_once = History(clock(), activity)
    read_later = History(clock(), activity)
    flow = Flow(CONFIG, observers=[activity, read_at_once, read_later], upstream=FakeUpstream(router("a", "b")))
    bodies: dict[int, bytes] = {}

    def read() -> None:
        bodies.update((entry.seq, entry.body) for entry in read_at_once.entries())

    served = await flow.arrive("served", "interactive", "a")
    left = await flow.arrive("left", "batch", "a")
    refused = await flow.arrive("refused", "normal", "nope")
    read()
    await flow.advance(1)
    await flow.complete(served, 200)
    read()
    assert left.granted
    flow.upstream.busy_answer = True  # still computing for the client that left: the GPU settles
    await flow.end(left, ExchangeEnd.CLIENT_LEFT)
    read()
    await flow.advance(1)
    flow.upstream.busy_answer = False
    await flow.advance(1)
    read()
    assert refused.refusal.outcome.value == "rejected_unknown_model"

    later = read_later.entries()
    assert [(entry.kind, entry.request_id) for entry in later] == [
        ("mark", "refused"), ("grant", "served"), ("grant", "left"), ("settle", "left")]
    assert {entry.seq: entry.body for entry in later} == bodies
    for entry in later:
        assert entry.body is entry.body  # joined once
        assert entry.body == json_line.line(entry.document())
    left_record = next(r for r in activity.recent() if r["request_id"] == "left")
    assert left_record["settle_ms"] >= 1000 and later[2].document()["settle_ms"] == 0.0  # as it ended
