"""One activity record per finished request (issue 49): the page's history (runtime/history.py)
takes the record and the line the activity log (runtime/activity.py) made, instead of building
and encoding its own."""

from __future__ import annotations

import pathlib

import pytest
from flow import Flow, clock, virtual_time
from llamaswap.runtime import json_line
from llamaswap.runtime.activity import ActivityLog
from llamaswap.runtime.history import History

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
        assert "start_ms" not in records[entry.request_id]  # the log's record is not changed

    alone = History(clock(), ActivityLog(clock()))
    flow_alone = Flow(CONFIG, observers=[alone])
    c = await flow_alone.arrive("c", "interactive", "a")
    await flow_alone.complete(c)
    assert built[2:] == ["c"] and [e.request_id for e in alone.entries()] == ["c"]
