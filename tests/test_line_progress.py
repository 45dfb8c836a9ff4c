"""A stopped Batch API line seen (issue 46): its row in the queue, waiting or running, carries its
progress as its owner tells it (`Lines.progress`: stops so far, tokens), and GET /queue, the page's
state, the admin status and `llamaswap queue` show it. A real Coordinator on virtual time, the
feeder's side faked (tests/test_line_stops.py's FakeLines)."""

from __future__ import annotations

from typing import Any

from flow import Flow, clock, virtual_time
from test_line_stops import FakeLines

from llamaswap.adapters.admin import public_status_document, queue_document, status_document
from llamaswap.adapters.ui import UiState
from llamaswap.commands.queue import COLUMNS, GPU_COLUMN, LINE_COLUMN, columns_of, line_note, render
from llamaswap.runtime.activity import ActivityLog
from llamaswap.runtime.history import History
from llamaswap.runtime.ticket import ExchangeEnd

LINE = "batch_1:line-a"


def table(document: dict[str, Any]) -> dict[str, list[str]]:
    """`llamaswap queue`'s table by request id (the header under "REQUEST_ID"), each row's cells."""
    lines = render(document).splitlines()
    header = next(line for line in lines if line.startswith("POS"))
    starts = [header.index(column) for column in header.split()]
    rows = lines[lines.index(header):]
    cells = {}
    for row in rows:
        split = [row[start:end].strip() for start, end in zip(starts, [*starts[1:], None])]
        cells[split[2]] = split
    return cells


def page_state(flow: Flow) -> dict[str, Any]:
    return UiState(flow.coordinator, History(clock(), ActivityLog(clock())), jaeger_url=str).state_document()


@virtual_time
async def test_a_stopped_line_waits_with_its_stops_and_tokens_kept_and_runs_with_its_stops() -> None:
    lines = FakeLines(LINE)
    flow = Flow(lines=lines)
    line = await flow.arrive(LINE, "batch", model="m")
    assert line.granted
    lines.tokens[LINE] = 40
    [running] = flow.coordinator.view().running
    assert (running.line.stops, running.line.tokens) == (0, 40)  # type: ignore[union-attr]
    # A line never stopped: no note, and the table has no LINE column.
    assert queue_document(flow.coordinator.view())["running"]["line"] == {"stops": 0, "tokens": 40, "stopping": False}
    assert table(queue_document(flow.coordinator.view()))["REQUEST_ID"][-1] == "MODEL"

    person = await flow.arrive("person", "interactive", model="m")
    assert lines.stopped == [LINE]
    # Asked to stop, its part has not let go yet: its row says so, as do the page and the table.
    document = queue_document(flow.coordinator.view())
    assert document["running"]["line"] == {"stops": 0, "tokens": 40, "stopping": True}
    assert page_state(flow)["running"][0]["line"]["stopping"] is True
    assert table(document)[LINE][-1] == "stopping, 40 tokens"
    lines.tokens[LINE] = 120  # where its stop came
    lines.let_go(LINE)
    await flow.end(line, ExchangeEnd.CLIENT_LEFT)  # the feeder closed its stream
    await flow.advance(1)
    assert person.granted
    resumed = await flow.arrive(LINE, "batch", model="m")
    assert resumed.waiting and resumed.ticket.takeover is not None

    view = flow.coordinator.view()
    [waiting] = view.waiting
    assert waiting.request_id == LINE and (waiting.line.stops, waiting.line.tokens) == (1, 120)  # type: ignore[union-attr]
    assert [row.line for row in view.running] == [None]  # the person: not a line
    document = queue_document(view)
    assert document["waiting"][0]["line"] == {"stops": 1, "tokens": 120, "stopping": False}
    assert document["running"]["request_id"] == "person" and document["running"]["line"] is None
    state = page_state(flow)
    assert state["waiting"][0]["line"] == {"stops": 1, "tokens": 120, "stopping": False}
    assert state["running"][0]["line"] is None
    assert status_document(flow.coordinator, LINE)["line"] == {"stops": 1, "tokens": 120, "stopping": False}  # type: ignore[index]
    assert "line" not in public_status_document(flow.coordinator, LINE)  # type: ignore[operator]
    rows = table(document)
    assert rows["REQUEST_ID"][-1] == LINE_COLUMN
    assert rows[LINE][1:3] == ["PD", LINE] and rows[LINE][-1] == "stopped 1x, 120 tokens kept"
    assert rows["person"][1] == "R" and rows["person"][-1] == ""

    await flow.complete(person)
    await flow.advance(1)
    assert resumed.granted
    lines.tokens[LINE] = 150
    document = queue_document(flow.coordinator.view())
    assert document["running"]["line"] == {"stops": 1, "tokens": 150, "stopping": False} and document["waiting"] == []
    assert page_state(flow)["running"][0]["line"] == {"stops": 1, "tokens": 150, "stopping": False}
    assert status_document(flow.coordinator, LINE)["line"] == {"stops": 1, "tokens": 150, "stopping": False}  # type: ignore[index]
    assert table(document)[LINE][-1] == "stopped 1x, 150 tokens"


@virtual_time
async def test_a_client_s_request_has_no_line_progress() -> None:
    lines = FakeLines(LINE)
    flow = Flow(lines=lines)
    await flow.arrive("a-client", "batch", model="m")
    await flow.arrive("b-client", "batch", model="m")
    document = queue_document(flow.coordinator.view())
    assert document["running"]["line"] is None and [row["line"] for row in document["waiting"]] == [None]
    assert columns_of(document) == COLUMNS


def test_the_note_says_a_waiting_line_s_stops_and_tokens_kept_and_a_running_line_s_stops() -> None:
    assert line_note({"stops": 2, "tokens": 1}, running=False) == "stopped 2x, 1 token kept"
    assert line_note({"stops": 0, "tokens": 30}, running=False) == "30 tokens kept"  # (after a broken stream)
    assert line_note({"stops": 0, "tokens": 0}, running=False) == ""  # a first part waiting
    assert line_note({"stops": 1, "tokens": 80}, running=True) == "stopped 1x, 80 tokens"
    assert line_note({"stops": 0, "tokens": 80}, running=True) == ""  # never stopped
    assert line_note(None, running=False) == "" and line_note({"stops": "1"}, running=True) == ""


def test_the_line_column_comes_after_the_gpu_column_and_only_where_a_row_has_a_note() -> None:
    gpus = [{"name": "gpu0", "slots": 1, "slots_busy": 1}, {"name": "gpu1", "slots": 1, "slots_busy": 0}]
    running = {"request_id": "r", "priority": 0, "band": "batch", "score": 0.0, "queue_wait_s": 1.0,
               "running_s": 2.0, "expected_remaining_s": 3.0, "model": "m", "upstream": "gpu0"}
    waiting = {"request_id": LINE, "position": 1, "priority": -100, "band": "batch", "score": -100.0,
               "waited_s": 4.0, "estimated_start_s": 3.0, "model": "m", "line": {"stops": 1, "tokens": 7}}
    document = {"policy": "serial", "gpus": gpus, "running_all": [running], "waiting": [waiting]}
    assert columns_of(document) == (*COLUMNS, GPU_COLUMN, LINE_COLUMN)
    rows = table(document)
    assert rows[LINE][-2:] == ["", "stopped 1x, 7 tokens kept"] and rows["r"][-2:] == ["gpu0", ""]
    # An older sidecar's rows (no "line"): the table it had.
    older = {**document, "waiting": [{key: value for key, value in waiting.items() if key != "line"}]}
    assert columns_of(older) == (*COLUMNS, GPU_COLUMN)
