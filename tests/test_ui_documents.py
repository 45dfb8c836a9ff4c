"""The page at /ui: its history (runtime/history.py), its JSON documents and routes
(adapters/ui.py), its setting (ui.jaegerUrl), and its assets (shipped, offline, valid JS).

The documents run against a real Coordinator on virtual time (tests/flow.py); the routes are
called through aiohttp's router with mocked requests (no sockets on a virtual-time loop).
e2e/test_ui.py drives the page itself in a real browser (the two files need distinct names: pytest imports
both folders' tests by their basename).
"""

from __future__ import annotations

import json
import pathlib
import re
import shutil
import subprocess
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request
from flow import FakeUpstream, Flow, Request, clock, current_loop, router, virtual_time
from llamaswap.config import ConfigError, parse_config
from llamaswap.runtime.activity import ActivityLog
from llamaswap.runtime.history import History, _last_lines
from llamaswap.runtime.ticket import ExchangeEnd
from llamaswap.adapters.admin import queue_document
from llamaswap.adapters.ui import (
    UI_BATCHES,
    UI_BATCHES_REFRESH_S,
    UI_CPU_SHARE,
    UI_WAITING_ROWS,
    BatchesProvider,
    StorageProvider,
    UiState,
    add_ui_routes,
    batch_documents,
    batch_rows,
)

UI_DIR = pathlib.Path(__file__).resolve().parents[1] / "sidecar" / "llamaswap" / "ui"
TRACE = "0af7651916cd43dd8448eb211c80319c"
TRACE_PARENT = f"00-{TRACE}-b7ad6b7169203331-01"


class Page:
    """A Flow whose observers include the activity log and the history, and the page's routes."""

    def __init__(self, config: dict[str, Any] | None = None, *, jaeger_url: str = "", capacity: int = 20_000,
                 window_s: float = 86_400, waiting_rows: int = UI_WAITING_ROWS,
                 activity_path: str | None = None, batches: BatchesProvider | None = None,
                 batch_storage: StorageProvider | None = None) -> None:
        self.activity = ActivityLog(clock(), path=activity_path)
        self.history = History(clock(), self.activity, capacity=capacity, window_s=window_s)
        self.flow = Flow({"envoy": {"leaseSeconds": 1000}, **(config or {})}, observers=[self.activity, self.history],
                         upstream=FakeUpstream(router("a", "b")))
        self.ui = UiState(self.flow.coordinator, self.history, jaeger_url=lambda: jaeger_url,
                          waiting_rows=waiting_rows, batches=batches, batch_storage=batch_storage)
        self.app = web.Application()
        add_ui_routes(self.app, self.ui)

    async def get(self, path: str, headers: dict[str, str] | None = None) -> web.Response:
        request = make_mocked_request("GET", path, headers=headers or {}, app=self.app)
        match = await self.app.router.resolve(request)
        request._match_info = match  # what aiohttp's server does before calling the handler
        match.add_app(self.app)
        try:
            response = await match.handler(request)
        except web.HTTPException as exc:
            return web.Response(status=exc.status, headers=exc.headers)
        assert isinstance(response, web.Response)
        return response

    async def get_json(self, path: str, status: int = 200) -> Any:
        response = await self.get(path)
        assert response.status == status, (path, response.status, response.body)
        assert response.content_type == "application/json"
        assert isinstance(response.body, bytes)
        return json.loads(response.body)


async def traffic(page: Page) -> dict[str, Request]:
    """A grant, a swap-affinity reorder, an interactive overtake with a swap, a refusal, a client
    that leaves while waiting, and one that leaves while running (a settle)."""
    flow = page.flow
    run = await flow.arrive("run", model="a", trace_parent=TRACE_PARENT)
    early_b = await flow.arrive("early-b", model="b")
    late_a = await flow.arrive("late-a", model="a")
    await flow.advance(2)
    await flow.complete(run, first_byte_s=0.5)  # late-a goes first: its model is loaded
    inter = await flow.arrive("inter", "interactive", model="b")
    batch = await flow.arrive("batch", "batch", model="a")
    ghost = await flow.arrive("ghost", model="nope")
    leaver = await flow.arrive("leaver", model="a")
    await flow.advance(1)
    await flow.cancel(leaver)
    await flow.complete(late_a)  # inter overtakes early-b, with a swap to b
    await flow.advance(1)
    await flow.complete(inter)
    await flow.complete(early_b)
    await flow.advance(1)
    flow.upstream.busy_answer = True  # still computing for the client that left
    await flow.end(batch, ExchangeEnd.CLIENT_LEFT)  # abandoned: the GPU settles
    await flow.advance(1)
    flow.upstream.busy_answer = False
    await flow.advance(1)
    return {"run": run, "early-b": early_b, "late-a": late_a, "inter": inter, "batch": batch, "ghost": ghost,
            "leaver": leaver}


# -- the history ---------------------------------------------------------------------------


@virtual_time
async def test_the_history_keeps_grants_marks_and_settles_with_the_activity_records() -> None:
    page = Page()
    await traffic(page)
    entries = [entry.document() for entry in page.history.entries()]
    assert [(e["kind"], e["request_id"]) for e in entries] == [
        ("grant", "run"), ("mark", "ghost"), ("mark", "leaver"), ("grant", "late-a"), ("grant", "inter"),
        ("grant", "early-b"), ("grant", "batch"), ("settle", "batch")]
    grants = {e["request_id"]: e for e in entries if e["kind"] == "grant"}
    # The activity log's own record is the entry (one format): same keys, same values.
    recent = {r["request_id"]: r for r in page.activity.recent()}
    for request_id in ("run", "late-a", "inter", "early-b"):
        assert {k: v for k, v in grants[request_id].items() if k in recent[request_id]} == recent[request_id]
    assert grants["late-a"]["reordered_by"] == ["swap_affinity"]
    assert [o["request_id"] for o in grants["late-a"]["overtook"]] == ["early-b"]
    assert [o["request_id"] for o in grants["inter"]["overtook"]] == ["early-b"]
    assert grants["inter"]["serial_band"] == "interactive" and grants["inter"]["swap"] is True
    assert grants["batch"]["outcome"] == "cancelled_running"
    for grant in grants.values():
        assert grant["start_ms"] == grant["granted_unix_ms"]
        assert grant["end_ms"] == pytest.approx(grant["time"] * 1000, abs=0.5)
        assert grant["end_ms"] - grant["start_ms"] == pytest.approx(grant["run_ms"], abs=0.01)
    marks = {e["request_id"]: e for e in entries if e["kind"] == "mark"}
    assert marks["ghost"]["outcome"] == "rejected_unknown_model" and marks["leaver"]["outcome"] == "cancelled_waiting"
    settle = entries[-1]
    assert settle["reason"] == "abandoned" and settle["start_ms"] == grants["batch"]["end_ms"]
    assert settle["result"] == "idle" and settle["settle_ms"] >= 1000
    assert [e["seq"] for e in entries] == list(range(1, len(entries) + 1))


@virtual_time
async def test_the_counters() -> None:
    page = Page()
    await traffic(page)
    counters = page.history.counters()
    assert counters["dispatched"] == {"interactive": 1, "normal": 3, "batch": 1}
    assert counters["reorders"] == {"swap_affinity": 1}
    assert (counters["swaps"], counters["loads"]) == (2, 1)  # a -> b (inter), b -> a (batch); the first load
    assert counters["upstreams"] == {"gpu0": {"dispatched": 5, "swaps": 2, "loads": 1}}  # one GPU: all of them
    assert counters["outcomes"] == {"served": 4, "rejected_unknown_model": 1, "cancelled_waiting": 1,
                                    "cancelled_running": 1}
    assert counters["settles"] == {"abandoned": 1}
    estimate = counters["estimate"]
    assert estimate["samples"] >= 1 and estimate["median_ratio"] > 0 and estimate["total_ratio"] > 0


@virtual_time
async def test_the_counters_count_the_running_grants() -> None:
    """With two slots, one grant finished and one running: two dispatched (issue 25: one)."""
    page = Page({"upstream": {"slots": 2}})
    first = await page.flow.arrive("first", model="a")
    second = await page.flow.arrive("second", "interactive", model="a")
    await page.flow.complete(first)
    assert second.granted and second.outcome is None
    counters = (await page.get_json("/ui/state"))["counters"]
    assert counters["dispatched"] == {"interactive": 1, "normal": 1, "batch": 0}
    assert counters["loads"] == 1 and counters["outcomes"] == {"served": 1}


@virtual_time
async def test_the_timeline_is_bounded_by_count_and_by_age() -> None:
    page = Page(capacity=3)
    await traffic(page)
    assert [e.request_id for e in page.history.entries()] == ["early-b", "batch", "batch"]
    assert page.history.seq == 8  # the sequence goes on: the page asks for what is after its last
    short = Page(window_s=10)
    first = await short.flow.arrive("first", model="a")
    await short.flow.complete(first)
    await short.flow.advance(11)
    second = await short.flow.arrive("second", model="a")
    await short.flow.complete(second)
    assert [e.request_id for e in short.history.entries()] == ["second"]


@virtual_time
async def test_entries_since_a_time_or_after_a_sequence_number() -> None:
    page = Page()
    await traffic(page)
    every = page.history.entries()
    assert [e.seq for e in page.history.entries(after_seq=5)] == [6, 7, 8]
    cut = every[4].end_ms
    assert [e.seq for e in page.history.entries(since_ms=cut)] == [e.seq for e in every if e.end_ms >= cut]
    assert page.history.entries(after_seq=8) == []


@virtual_time
async def test_a_restarted_sidecar_loads_the_timeline_from_the_activity_log_file(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "activity.jsonl"
    page = Page(activity_path=str(path))
    await traffic(page)
    page.activity.close()
    before = [entry.document() for entry in page.history.entries()]
    with path.open("a") as file:
        file.write('{"event":"request","request_id":"torn","ti\n')  # a line cut by a crash: skipped
    restarted = History(clock(), ActivityLog(clock()))
    assert restarted.load(str(path)) == len(before)
    after = [entry.document() for entry in restarted.entries()]
    assert [(e["kind"], e["request_id"]) for e in after] == [(e["kind"], e["request_id"]) for e in before]
    for old, new in zip(before, after):
        if old["kind"] == "settle":
            assert new["settle_ms"] == old["settle_ms"] and new["start_ms"] == pytest.approx(old["start_ms"], abs=1)
        else:
            assert {k: v for k, v in new.items() if k not in ("seq", "overtook", "end_ms", "settle_ms")} == \
                {k: v for k, v in old.items() if k not in ("seq", "overtook", "end_ms", "settle_ms")}
            assert new["end_ms"] == pytest.approx(old["end_ms"], abs=0.5)  # the file's `time` is in whole ms
    assert restarted.counters()["outcomes"] == {}  # the counters are this process's own
    # At most `capacity` entries, no file is no history, and only the last day.
    small = History(clock(), ActivityLog(clock()), capacity=2)
    small.load(str(path))
    assert [e.request_id for e in small.entries()] == ["batch", "batch"]
    assert History(clock(), ActivityLog(clock())).load(str(tmp_path / "missing.jsonl")) == 0
    two_days_on = History(clock(), ActivityLog(clock()))
    await page.flow.advance(2 * 86_400)
    assert two_days_on.load(str(path)) == 0


@virtual_time
async def test_a_loaded_settle_is_named_from_its_request_s_outcome(tmp_path: pathlib.Path) -> None:
    """The file keeps a settle only as its request's settle_ms: a stopped line's is `stopped`, any
    other `abandoned`."""
    path = tmp_path / "activity.jsonl"
    activity = ActivityLog(clock())
    now_ms = activity.unix_ms(clock().now_ns())
    lines = [{"event": "request", "request_id": request_id, "time": now_ms / 1000, "dispatched": True,
              "granted_unix_ms": now_ms - 50, "settle_ms": 12.5, "outcome": outcome}
             for request_id, outcome in (("line", "stopped"), ("client", "cancelled_running"))]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    history = History(clock(), activity)
    assert history.load(str(path)) == 4
    assert [(e.document()["request_id"], e.document()["reason"]) for e in history.entries()
            if e.document()["kind"] == "settle"] == [("line", "stopped"), ("client", "abandoned")]


def test_the_last_lines_of_a_long_file(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "long.jsonl"
    path.write_bytes(b"".join(b'{"n":%d}\n' % n for n in range(20_000)))  # several read blocks
    assert _last_lines(str(path), 15_000) == [b'{"n":%d}' % n for n in range(5_000, 20_000)]
    assert _last_lines(str(path), 30_000)[0] == b'{"n":0}'
    path.write_bytes(b"")
    assert _last_lines(str(path), 10) == []


# -- /ui/state -----------------------------------------------------------------------------


@virtual_time
async def test_the_state_has_the_queue_in_its_order_with_the_score_split_into_its_terms() -> None:
    page = Page({"routing": {"scheduler": {"settings": {"serial": {"agingDivisor": 10, "swapAffinityBonus": 20}}}}})
    flow = page.flow
    run = await flow.arrive("run", model="a")
    await flow.arrive("b-normal", model="b")
    await flow.arrive("a-batch", "batch", model="a")
    await flow.arrive("b-inter", "interactive", model="b")
    await flow.advance(5)
    state = json.loads(page.ui.state()[1])
    queue = queue_document(flow.coordinator.view())
    assert [row["request_id"] for row in state["waiting"]] == [row["request_id"] for row in queue["waiting"]]
    for mine, theirs in zip(state["waiting"], queue["waiting"]):
        assert {k: mine[k] for k in theirs} == theirs  # /queue's row, the same numbers
        terms = mine["terms"]
        assert terms["priority"] + terms["affinity"] + terms["aging"] == pytest.approx(mine["score"])
        assert terms["aging"] == pytest.approx(mine["waited_s"] / 10)
        assert terms["affinity"] == (20 if mine["swap_affinity"] else 0)
        # What the page shows of the start: the server's instant (the page derives nothing).
        assert mine["estimated_start_ms"] == pytest.approx(state["as_of_ms"] + mine["estimated_start_s"] * 1000)
    assert state["aging_per_s"] == pytest.approx(0.1)  # the rate the page grows the aging term at
    assert state["gpu"] == "running" and state["resident_models"] == ["a"] and state["waiting_total"] == 3
    [running] = state["running"]
    assert running["request_id"] == "run" and running["running_s"] == 5.0
    assert running["granted_ms"] == pytest.approx(state["as_of_ms"] - 5000)
    assert running["expected_end_ms"] == pytest.approx(running["granted_ms"] + running["expected_end_s"] * 1000)
    assert state["aging_divisor_s"] == 10 and state["swap_affinity_bonus"] == 20
    assert state["bands"]["interactive"]["depth"] == 1 and state["timeline_seq"] == 0
    await flow.complete(run)
    assert json.loads(page.ui.state()[1])["timeline_seq"] == 1


@virtual_time
async def test_the_state_is_built_once_per_change() -> None:
    page = Page()
    flow = page.flow
    await flow.arrive("one", model="a")
    etag, body = page.ui.state()
    await flow.advance(3)  # time alone changes nothing the page cannot extrapolate
    assert page.ui.state() == (etag, body)
    assert page.ui.state()[1] is body  # the same bytes: not built again
    await flow.arrive("two", model="a")
    etag_two, body_two = page.ui.state()
    assert etag_two != etag and json.loads(body_two)["waiting_total"] == 1


@virtual_time
async def test_a_slow_build_is_kept_a_while_however_often_the_queue_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A deep queue's state takes long to build: while changes keep coming, it is rebuilt at
    most once per (build time / UI_CPU_SHARE), so polling pages cannot eat the event loop."""
    page = Page()
    flow = page.flow
    view = flow.coordinator.view

    def slow_view() -> Any:
        flow.clock.advance(0.1)  # as if the walk took 100 ms
        return view()

    monkeypatch.setattr(flow.coordinator, "view", slow_view)
    await flow.arrive("one", model="a")
    etag, _ = page.ui.state()
    await flow.arrive("two", model="a")
    await flow.advance(0.1 / UI_CPU_SHARE - 0.2)  # 0.1 s of the 0.5 s already passed while building
    assert page.ui.state()[0] == etag  # changed, but kept
    await flow.advance(0.1)
    rebuilt, body = page.ui.state()
    assert rebuilt != etag and json.loads(body)["waiting_total"] == 1


@virtual_time
async def test_at_ten_thousand_waiting_the_state_holds_the_first_rows_and_the_counts() -> None:
    page = Page()
    flow = page.flow
    await flow.arrive("holder", model="a")
    priorities = ("interactive", None, "batch", None)  # 2,500 interactive, 5,000 normal, 2,500 batch
    for index in range(10_000):
        await flow.arrive(f"w{index}", priorities[index % 4], model="a")
    state = json.loads(page.ui.state()[1])
    assert len(state["waiting"]) == UI_WAITING_ROWS < state["waiting_total"] == 10_000
    assert {name: band["depth"] for name, band in state["bands"].items()} == {
        "interactive": 2_500, "normal": 5_000, "batch": 2_500}
    assert [row["position"] for row in state["waiting"]] == list(range(1, UI_WAITING_ROWS + 1))
    assert [row["request_id"] for row in state["waiting"]] == flow.waiting_ids()[:UI_WAITING_ROWS]
    # A few hundred rows, not ten thousand: the poll stays small.
    assert len(page.ui.state()[1]) < 200_000


@virtual_time
async def test_the_state_route_answers_304_while_nothing_changed() -> None:
    page = Page()
    await page.flow.arrive("one", model="a")
    first = await page.get("/ui/state")
    etag = first.headers["etag"]
    assert first.status == 200 and json.loads(first.body)["running"][0]["request_id"] == "one"  # type: ignore[arg-type]
    await page.flow.advance(7)
    again = await page.get("/ui/state", {"if-none-match": etag})
    assert again.status == 304 and again.headers["etag"] == etag and not again.body
    # The answer's own time, for the page's clock: the document is as old as the last change.
    assert float(again.headers["x-llamaswap-now-ms"]) == pytest.approx(page.history.now_ms(), abs=0.001)
    as_of_ms = json.loads(first.body)["as_of_ms"]  # type: ignore[arg-type]
    assert page.history.now_ms() - as_of_ms == pytest.approx(7000, abs=0.01)
    await page.flow.arrive("two", model="a")
    changed = await page.get("/ui/state", {"if-none-match": etag})
    assert changed.status == 200 and changed.headers["etag"] != etag


# -- /ui/timeline --------------------------------------------------------------------------


@virtual_time
async def test_the_timeline_route() -> None:
    page = Page()
    await traffic(page)
    document = await page.get_json("/ui/timeline?after=6")
    assert document["instance"] == page.ui.instance and document["last_seq"] == 8
    assert [(e["seq"], e["kind"], e["request_id"]) for e in document["entries"]] == [
        (7, "grant", "batch"), (8, "settle", "batch")]
    every = (await page.get_json("/ui/timeline"))["entries"]
    assert len(every) == 8
    since = every[5]["end_ms"]
    recent = (await page.get_json(f"/ui/timeline?since_ms={since}"))["entries"]
    assert [e["seq"] for e in recent] == [e["seq"] for e in every if e["end_ms"] >= since]
    for query in ("since_ms=soon", "after=x", "since_ms=nan"):
        error = await page.get_json(f"/ui/timeline?{query}", status=400)
        assert error["error"]["code"] == "invalid_parameter" and error["error"]["type"] == "invalid_request_error"


# -- /ui/request/{id} ----------------------------------------------------------------------


@virtual_time
async def test_finding_a_request() -> None:
    page = Page(jaeger_url="http://127.0.0.1:16686/")
    flow = page.flow
    await traffic(page)
    found = await page.get_json("/ui/request/inter")
    assert found["state"] == "finished" and found["status"] is None
    [record] = found["records"]
    assert record["kind"] == "grant" and record["outcome"] == "served" and record["serial_band"] == "interactive"
    assert found["trace_url"] is None  # it had no traceparent
    run = await page.get_json("/ui/request/run")
    assert run["trace_id"] == TRACE and run["trace_url"] == f"http://127.0.0.1:16686/trace/{TRACE}"
    batch = await page.get_json("/ui/request/batch")
    assert [r["kind"] for r in batch["records"]] == ["grant", "settle"]
    ghost = await page.get_json("/ui/request/ghost")
    assert ghost["records"][0]["outcome"] == "rejected_unknown_model"
    # Who went ahead of early-b while it waited: late-a (its model loaded), then inter.
    early_b = await page.get_json("/ui/request/early-b")
    assert [(o["request_id"], o["band"]) for o in early_b["overtaken_by"]] == [("late-a", "normal"),
                                                                              ("inter", "interactive")]
    assert early_b["overtaken_by"][0]["granted_ms"] < early_b["overtaken_by"][1]["granted_ms"]
    assert run["overtaken_by"] == []
    missing = await page.get_json("/ui/request/nobody", status=404)
    assert missing["error"]["code"] == "request_not_found" and "nobody" in missing["error"]["message"]
    # A waiting one: its live status, and its position each time it changes while watched.
    holder = await flow.arrive("holder", model="a")
    await flow.arrive("first", model="a")
    waiting = await flow.arrive("watched", "batch", model="a", trace_parent=TRACE_PARENT)
    await flow.arrive("ahead", "interactive", model="a")
    watched = await page.get_json("/ui/request/watched")
    assert watched["state"] == "waiting" and watched["status"]["position"] == 3
    assert [p[1] for p in watched["positions"]] == [3] and watched["trace_id"] == TRACE
    await flow.complete(holder)
    page.ui.state()
    await flow.complete(flow.requests["ahead"])
    page.ui.state()
    later = await page.get_json("/ui/request/watched")
    assert [p[1] for p in later["positions"]] == [3, 2, 1]
    assert later["positions"][0][0] <= later["positions"][1][0] <= later["positions"][2][0]
    assert later["status"]["position"] == 1 and waiting.waiting


@virtual_time
async def test_no_trace_link_without_ui_jaeger_url() -> None:
    page = Page()
    await traffic(page)
    run = await page.get_json("/ui/request/run")
    assert run["trace_id"] == TRACE and run["trace_url"] is None


# -- the page's assets and its setting -----------------------------------------------------


@virtual_time
async def test_the_page_and_its_assets_are_served() -> None:
    page = Page()
    html = await page.get("/ui")
    assert html.status == 200 and html.content_type == "text/html"
    text = html.body.decode()  # type: ignore[union-attr]
    assert '<script src="/ui/app.js">' in text and 'href="/ui/style.css"' in text
    script = await page.get("/ui/app.js")
    assert script.content_type == "text/javascript" and b"/ui/state" in script.body  # type: ignore[operator]
    style = await page.get("/ui/style.css")
    assert style.content_type == "text/css" and style.headers["cache-control"] == "no-cache"
    moved = await page.get("/ui/")
    assert moved.status == 302 and moved.headers["location"] == "/ui"


def test_the_page_loads_nothing_from_elsewhere() -> None:
    """Offline: every asset is this origin's; no CDN, no font or script from the network."""
    for path in UI_DIR.iterdir():
        text = path.read_text()
        # The one absolute URL is the SVG namespace, which is a name, not a fetch.
        urls = set(re.findall(r"https?://[^\s\"'`)]+", text)) - {"http://www.w3.org/2000/svg"}
        assert not urls, (path.name, urls)
    assert {p.name for p in UI_DIR.iterdir()} == {"index.html", "app.js", "style.css"}


def test_the_page_derives_no_scheduling_term() -> None:
    """The page shows the server's numbers (issue 36): the aging term grows at the rate the
    state sends (aging_per_s), a waiting request's start is the server's instant
    (estimated_start_ms) and a running one's end too (expected_end_ms); it does not divide by
    the aging divisor, nor age starts by a running request's remaining time."""
    script = (UI_DIR / "app.js").read_text()
    assert "aging_per_s" in script and "estimated_start_ms" in script and "expected_end_ms" in script
    assert not re.search(r"/\s*doc\.aging_divisor_s", script)
    assert "expected_remaining_s" not in script and "expected_end_s" not in script and "expected_run_s" not in script
    assert not re.search(r"estimated_start_s\s*-", script)


@pytest.mark.skipif(shutil.which("node") is None, reason="needs Node.js")
def test_the_page_script_parses() -> None:
    for path in UI_DIR.glob("*.js"):
        result = subprocess.run(["node", "--check", str(path)], capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr


def test_ui_jaeger_url() -> None:
    assert parse_config({}).ui.jaeger_url == ""
    assert parse_config({"ui": {"jaegerUrl": None}}).ui.jaeger_url == ""
    assert parse_config({"ui": {"jaegerUrl": "https://jaeger.example:16686/"}}).ui.jaeger_url == \
        "https://jaeger.example:16686"
    for bad in ("jaeger:16686", "http://", 16686, "http://a b"):
        with pytest.raises(ConfigError) as info:
            parse_config({"ui": {"jaegerUrl": bad}})
        [problem] = info.value.problems
        assert problem.path == "ui.jaegerUrl" and "http:// or https:// URL" in problem.message



@virtual_time
async def test_every_admin_route_is_documented() -> None:
    """Each GET route of the sidecar's admin server (the page's among them) is named in README.md
    or docs/, its path up to the first {parameter} (the page's own files aside)."""
    from llamaswap.adapters.admin import build_admin_app

    root = pathlib.Path(__file__).resolve().parents[1]
    docs = "\n".join(path.read_text() for path in [root / "README.md", *sorted((root / "docs").glob("*.md"))])
    page = Page()
    app = build_admin_app(page.flow.coordinator, page.activity, history=page.history)
    add_ui_routes(app, page.ui)
    paths = {resource.canonical for resource in app.router.resources()}
    assert "/ui/timeline" in paths and "/activity" in paths
    for path in paths - {"/ui/", "/ui/app.js", "/ui/style.css"}:
        assert f"`{path.split('{', 1)[0]}" in docs, path


# -- the batches (the Batch API's, when batches.dir is set) ------------------------------------


def batch_object(batch_id: str, status: str, *, created_at: int, completed: int = 0, failed: int = 0,
                 total: int = 10, ended_at: int | None = None, finish: float | None = None) -> dict[str, Any]:
    """A batch object as the Batch API makes it (its own batch_document)."""
    from llamaswap.batches.documents import batch_document
    from llamaswap.batches.lifecycle import STATUS_TIMESTAMP, BatchStatus
    from llamaswap.batches.store import BatchRecord, Counts

    timestamps: dict[str, int | None] = {name: None for name in STATUS_TIMESTAMP.values() if name}
    timestamps["in_progress_at"] = None if status == "validating" else created_at + 1
    if ended_at is not None:
        timestamps[f"{status}_at"] = ended_at
    record = BatchRecord(id=batch_id, endpoint="/v1/chat/completions", input_file_id="file-1",
                         completion_window="24h", created_at=created_at, expires_at=created_at + 86400,
                         status=BatchStatus(status), metadata=None, priority=-100, errors=None, output_file_id=None,
                         error_file_id=None, total=total, timestamps=timestamps, trace_id="0" * 32, span_id="0" * 16)
    return batch_document(record, Counts(total, completed, failed), in_flight=3 if status == "in_progress" else 0,
                          estimated_finish_at=finish)


@virtual_time
async def test_without_the_batch_api_the_state_says_it_is_off() -> None:
    page = Page()
    await page.ui.refresh_batches()  # nothing to ask
    assert page.ui.state_document()["batches"] is None
    response = await page.get("/ui/state")
    assert json.loads(response.body)["batches"] is None  # type: ignore[arg-type]


@virtual_time
async def test_the_state_carries_the_batches_and_a_change_of_theirs_is_a_new_state() -> None:
    asked = []
    documents: list[dict[str, Any]] = []

    def provider() -> list[dict[str, Any]]:
        asked.append(1)
        return [dict(document) for document in documents]

    page = Page(batches=provider)
    current_loop().allow_blocking()  # the provider runs in a worker thread (it reads SQLite)
    now_s = int(page.history.now_ms() / 1000)
    documents.append(batch_object("batch_a", "in_progress", created_at=now_s - 60, completed=4, failed=1,
                                  finish=now_s + 30))
    first = await page.get("/ui/state")
    assert first.status == 200 and len(asked) == 1
    [row] = json.loads(first.body)["batches"]  # type: ignore[arg-type]
    assert row == {"id": "batch_a", "status": "in_progress", "endpoint": "/v1/chat/completions",
                   "created_at": now_s - 60, "in_progress_at": now_s - 59, "ended_at": None, "total": 10,
                   "completed": 4, "failed": 1, "in_flight": 3, "priority": -100, "estimated_finish_at": now_s + 30}
    etag = first.headers["etag"]
    # Polls within UI_BATCHES_REFRESH_S do not ask again (however many pages poll).
    documents[0] = batch_object("batch_a", "in_progress", created_at=now_s - 60, completed=6, failed=1,
                                finish=now_s + 30)
    await page.flow.advance(UI_BATCHES_REFRESH_S / 2)
    assert (await page.get("/ui/state", {"if-none-match": etag})).status == 304 and len(asked) == 1
    # Then they do: the batch moved on, and so does the state, though the queue did not change.
    await page.flow.advance(UI_BATCHES_REFRESH_S / 2)
    moved = await page.get("/ui/state", {"if-none-match": etag})
    assert moved.status == 200 and moved.headers["etag"] != etag and len(asked) == 2
    assert json.loads(moved.body)["batches"][0]["completed"] == 6  # type: ignore[arg-type]
    # Asked again and nothing changed: the same state.
    await page.flow.advance(UI_BATCHES_REFRESH_S)
    again = await page.get("/ui/state", {"if-none-match": moved.headers["etag"]})
    assert again.status == 304 and len(asked) == 3


@virtual_time
async def test_the_state_carries_the_space_the_batch_files_take() -> None:
    storage = {"used_bytes": 600, "files": 2, "max_bytes": 1000, "left_bytes": 400, "disk_free_bytes": 5000}
    page = Page(batches=lambda: [], batch_storage=lambda: dict(storage))
    current_loop().allow_blocking()  # the providers run in a worker thread (they read SQLite)
    first = await page.get("/ui/state")
    assert json.loads(first.body)["batches_storage"] == storage  # type: ignore[arg-type]
    # The space changed, nothing else did: a new state.
    storage["used_bytes"], storage["left_bytes"] = 900, 100
    await page.flow.advance(UI_BATCHES_REFRESH_S)
    moved = await page.get("/ui/state", {"if-none-match": first.headers["etag"]})
    assert moved.status == 200 and json.loads(moved.body)["batches_storage"]["left_bytes"] == 100  # type: ignore[arg-type]
    assert Page().ui.state_document()["batches_storage"] is None  # the Batch API off: nothing to show


@virtual_time
async def test_a_failing_store_keeps_the_batches_the_page_has(caplog: pytest.LogCaptureFixture) -> None:
    answers: list[Any] = [[batch_object("batch_a", "validating", created_at=0)], OSError("disk gone")]

    def provider() -> list[dict[str, Any]]:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return list(answer)

    page = Page(batches=provider)
    current_loop().allow_blocking()
    await page.ui.refresh_batches()
    await page.flow.advance(UI_BATCHES_REFRESH_S)
    await page.ui.refresh_batches()
    assert [row["id"] for row in page.ui.state_document()["batches"]] == ["batch_a"]
    assert "the batches could not be read: disk gone" in caplog.text


def test_the_page_gets_the_last_day_s_batches_at_most_twenty() -> None:
    now = 10_000_000
    ended_long_ago = batch_object("batch_old", "completed", created_at=now - 100_000, completed=10,
                                  ended_at=now - 86_401)
    ended_today = batch_object("batch_today", "cancelled", created_at=now - 100_000, completed=2, failed=8,
                               ended_at=now - 86_000)
    unfinished_old = batch_object("batch_slow", "in_progress", created_at=now - 200_000)
    rows = batch_rows([ended_today, ended_long_ago, unfinished_old], now_s=now)
    assert [(row["id"], row["ended_at"]) for row in rows] == [("batch_today", now - 86_000), ("batch_slow", None)]
    many = [batch_object(f"batch_{n}", "in_progress", created_at=now - n) for n in range(30)]
    assert [row["id"] for row in batch_rows(many, now_s=now)] == [f"batch_{n}" for n in range(UI_BATCHES)]


def test_batch_documents_asks_the_service_for_its_newest_batches_only() -> None:
    class Store:
        def batches(self) -> list[str]:
            return [f"batch_{n}" for n in range(30)]  # newest first, as the store lists them

    class Service:
        store = Store()
        documented: list[str] = []

        def document(self, batch: str) -> dict[str, Any]:
            self.documented.append(batch)
            return {"id": batch}

    assert batch_documents(None) is None
    service = Service()
    provider = batch_documents(service)
    assert provider is not None
    assert provider() == [{"id": f"batch_{n}"} for n in range(UI_BATCHES)]
    assert service.documented == [f"batch_{n}" for n in range(UI_BATCHES)]  # the older ones cost nothing
