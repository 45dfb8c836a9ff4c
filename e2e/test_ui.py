"""The page at /ui in a real headless Chromium (Debian's `chromium` and `chromium-driver`,
driven by Selenium), against the real Envoy and the real sidecar with the fake upstream.

Traffic with an overtake, a swap, a swap-affinity reorder, a client that leaves while waiting
and a refusal (an unknown model); then the page must show the running request, the waiting
ones in /queue's order with /queue's scores, one timeline bar per finished grant in its band's
colour, the refusal and the cancellation as marks, and a request found by its id. Then the
sidecar restarts on the same admin port and the open page carries on with the new one, whose
timeline is read back from the activity log file. A batch of the Batch API shows in the Batches
panel with its progress, and its lines in the queue with a "batch" tag; without batches.dir the
panel says the API is off. A line stopped for a higher band shows its progress beside its id.

Every wait polls the DOM (one script call returns what a check needs) with a deadline.
A screenshot is saved in the test's directory, and to $LLAMASWAP_UI_SCREENSHOT when set
(docs/ui.png, which the README shows, comes from `LLAMASWAP_UI_SCREENSHOT=docs/ui.png`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pathlib
import shutil
import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from client import chat
from fake_llama import FakeLlamaServer
from harness import SidecarProcess, async_wait_for, free_port, get_json, running_stack, wait_for

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
# Scores age by one point a day here: the page's scores (2 decimals) and /queue's agree whenever read.
CONFIG = {"routing": {"scheduler": {"settings": {"serial": {"agingDivisor": 86400}}}}}

# What the checks read from the page, each in one script call (the page re-renders every 250 ms).
READ_PAGE = """
const rows = (selector) => [...document.querySelectorAll(selector)];
return {
  connection: document.getElementById("connection").textContent,
  gpu: document.getElementById("gpu-state").textContent,
  running: rows("#running tbody tr[data-request-id]").map((tr) => tr.dataset.requestId),
  queue: rows("#queue tbody tr[data-request-id]").map((tr) => [tr.dataset.requestId,
      tr.querySelector("td.score").textContent]),
  grants: rows("#timeline rect.grant").map((r) => [r.dataset.requestId, r.dataset.band,
      getComputedStyle(r).fill]),
  runningBars: rows("#timeline rect.running").map((r) => r.dataset.requestId),
  marks: rows("#timeline rect.mark").map((r) => [r.dataset.requestId, r.dataset.outcome]),
  bandCounts: rows("#band-counts .chip").map((c) => [c.dataset.band, c.querySelector("b").textContent]),
  counters: document.getElementById("counters").textContent,
};
"""
READ_FIND = """
const record = {};
for (const row of document.querySelectorAll("#find-record [data-key]")) {
  record[row.dataset.key] = row.querySelector(".v").textContent;
}
return record;
"""
BAND_COLOURS = {"interactive": "rgb(240, 136, 62)", "normal": "rgb(88, 166, 255)", "batch": "rgb(63, 185, 80)"}


@pytest.fixture
def browser(tmp_path: pathlib.Path) -> Iterator[Any]:
    if not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)):
        if os.environ.get("CI"):
            pytest.fail("CI is set but Chromium is not installed (apt-get install chromium chromium-driver)")
        pytest.skip("Chromium is not installed (Debian packages `chromium`, `chromium-driver`); CI installs them")
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", "--window-size=1440,1400", "--hide-scrollbars",
                 f"--user-data-dir={tmp_path / 'chromium-profile'}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER, log_output=str(tmp_path / "chromedriver.log")),
                              options=options)
    try:
        yield driver
    finally:
        driver.quit()


def queued(stack: Any, request_id: str) -> bool:
    return any(row["request_id"] == request_id for row in stack.sidecar.queue()["waiting"])


async def test_the_page_shows_the_gpu_the_queue_the_timeline_and_a_request(tmp_path: pathlib.Path,
                                                                          browser: Any) -> None:
    admin_port = free_port()  # fixed, so the restarted sidecar answers the same page
    config = {**CONFIG, "listen": {"admin": f"127.0.0.1:{admin_port}"},
              "activity": {"path": str(tmp_path / "activity.jsonl")}}
    fake = FakeLlamaServer(router=True, models=("model-a", "model-b", "model-c"))
    with running_stack(tmp_path, config, fake=fake) as stack:
        admin = stack.sidecar.admin_url
        async with aiohttp.ClientSession() as session:

            async def send(test_id: str, priority: str | None, model: str, **kwargs: Any) -> asyncio.Task[Any]:
                task = asyncio.create_task(chat(session, stack.url, test_id, priority=priority, model=model,
                                                **kwargs))
                await async_wait_for(lambda: queued(stack, test_id) or test_id in fake.order(),
                                     what=f"{test_id} queued or running")
                return task

            # Some finished traffic first, so the timeline has history: short grants of each band.
            plan = [("normal", "model-a", 1200), ("batch", "model-a", 900), ("interactive", "model-b", 700),
                    ("normal", "model-b", 1000), ("batch", "model-c", 1500), ("normal", "model-c", 800),
                    ("interactive", "model-a", 600)]
            warm = [await send(f"warm-{index}", priority, model, sleep_ms=sleep_ms)
                    for index, (priority, model, sleep_ms) in enumerate(plan)]
            assert [reply.status for reply in await asyncio.gather(*warm)] == [200] * len(warm)

            blocker = await send("blocker", "normal", "model-a", hold=True)
            tasks = {
                "batch-a": await send("batch-a", "batch", "model-a", hold=True),
                "normal-a": await send("normal-a", "normal", "model-a", hold=True),
                # After inter-b, model-b is loaded: normal-b overtakes normal-a by swap affinity.
                "normal-b": await send("normal-b", "normal", "model-b", hold=True),
                "inter-b": await send("inter-b", "interactive", "model-b", hold=True),  # overtakes all, a swap
            }
            leaver = await send("leaver", "normal", "model-c")
            leaver.cancel()  # the client leaves while waiting: Envoy cancels its Check
            await async_wait_for(lambda: not queued(stack, "leaver"), what="the leaver gone from the queue")
            refused = await chat(session, stack.url, "ghost", model="no-such-model")
            assert refused.status == 404 and refused.json()["error"]["code"] == "model_not_found"
            fake.release("blocker")
            assert (await blocker).status == 200
            await async_wait_for(lambda: fake.order()[-1:] == ["inter-b"], what="inter-b at the upstream")

            browser.get(f"{admin}/ui")
            queue = stack.sidecar.queue()
            assert queue["running"]["request_id"] == "inter-b"
            expected_queue = [[row["request_id"], f"{row['score']:.2f}"] for row in queue["waiting"]]
            assert [row[0] for row in expected_queue] == ["normal-b", "normal-a", "batch-a"]
            records = get_json(f"{admin}/activity")["activity"]
            finished = Counter((r["request_id"], r["serial_band"]) for r in records if r["dispatched"])
            assert len(finished) == len(warm) + 1  # the warm-up and the blocker

            def shows_everything() -> dict[str, Any] | None:
                seen = browser.execute_script(READ_PAGE)
                ok = (seen["connection"] == "live" and seen["gpu"] == "running" and seen["running"] == ["inter-b"]
                      and seen["queue"] == expected_queue and Counter(tuple(g[:2]) for g in seen["grants"]) == finished
                      and sorted(map(tuple, seen["marks"])) == [("ghost", "rejected_unknown_model"),
                                                                 ("leaver", "cancelled_waiting")])
                return seen if ok else None

            seen = await async_wait_for(shows_everything, what="the page showing the GPU, the queue and the timeline")
            assert seen["runningBars"] == ["inter-b"]
            assert all(fill == BAND_COLOURS[band] for _, band, fill in seen["grants"])
            assert dict(seen["bandCounts"]) == {"interactive": "0", "normal": "2", "batch": "1"}
            assert "served" in seen["counters"] and "rejected_unknown_model" in seen["counters"]

            # Find a finished request by its id: its record.
            browser.find_element("id", "find-input").send_keys("warm-2")
            browser.find_element("id", "find-button").click()
            record = await async_wait_for(lambda: browser.execute_script(READ_FIND).get("outcome") == "served"
                                          and browser.execute_script(READ_FIND), what="warm-2's record")
            assert record["state"] == "finished" and record["serial_band"] == "interactive"
            assert record["model"] == "model-b" and record["serial_priority"] == "100"
            # And a waiting one: its live position.
            browser.find_element("id", "find-input").clear()
            browser.find_element("id", "find-input").send_keys("batch-a")
            browser.find_element("id", "find-button").click()
            waiting = await async_wait_for(lambda: browser.execute_script(READ_FIND).get("state") == "waiting"
                                           and browser.execute_script(READ_FIND), what="batch-a's live state")
            assert waiting["position"] == "3" and waiting["band"] == "batch"
            # A finished batch request: who went ahead of it while it waited (the interactive warm-6).
            browser.find_element("id", "find-input").clear()
            browser.find_element("id", "find-input").send_keys("warm-4")
            browser.find_element("id", "find-button").click()
            overtaken = await async_wait_for(lambda: browser.execute_script(READ_FIND).get("serial_band") == "batch"
                                             and browser.execute_script(READ_FIND), what="warm-4's record")
            assert "warm-6 (interactive)" in overtaken.get("overtaken by", ""), overtaken

            # The picture: the last minute, a tooltip on an interactive grant that overtook others.
            from selenium.webdriver.common.action_chains import ActionChains, ScrollOrigin

            bar_width = ("const r = document.querySelector('#timeline rect.grant[data-request-id=\"warm-6\"]');"
                         "return r ? Number(r.getAttribute('width')) : 0")
            browser.find_element("css selector", "#zoom button[data-zoom='60000']").click()
            minute_width = await async_wait_for(lambda: browser.execute_script(bar_width), what="the last minute")
            timeline = browser.find_element("id", "timeline")
            for _ in range(5):  # the wheel zooms in: 60 s * 0.8^5, about 20 s
                ActionChains(browser).scroll_from_origin(ScrollOrigin.from_element(timeline), 0, -100).perform()
            await async_wait_for(lambda: browser.execute_script(bar_width) > 2 * minute_width,
                                 what="the wheel zooming in")
            bar = browser.find_element("css selector", "#timeline rect.grant[data-request-id='warm-6']")
            ActionChains(browser).move_to_element(bar).perform()
            await async_wait_for(lambda: browser.execute_script(
                "return !document.getElementById('tooltip').hidden && "
                "document.getElementById('tooltip').textContent.includes('warm-6')"), what="the tooltip")
            tooltip = browser.find_element("id", "tooltip").text
            assert "priority 100" in tooltip and "served" in tooltip
            shot = tmp_path / "ui.png"
            browser.get_screenshot_as_file(str(shot))
            if os.environ.get("LLAMASWAP_UI_SCREENSHOT"):
                shutil.copyfile(shot, os.environ["LLAMASWAP_UI_SCREENSHOT"])

            for test_id in ("inter-b", "normal-b", "normal-a", "batch-a"):
                fake.release(test_id)
            assert [reply.status for reply in await asyncio.gather(*tasks.values())] == [200] * 4

            # The grants that just finished join the timeline without a reload.
            records = await async_wait_for(
                lambda: (lambda found: found if sum(r["dispatched"] for r in found) == len(warm) + 5 else None)(
                    get_json(f"{admin}/activity")["activity"]), what="every grant recorded")
            finished = Counter((r["request_id"], r["serial_band"]) for r in records if r["dispatched"])
            await async_wait_for(lambda: Counter(tuple(g[:2]) for g in browser.execute_script(READ_PAGE)["grants"])
                                 == finished, what="every finished grant on the timeline")

        # A sidecar restart: the open page reconnects to the new process, whose timeline comes
        # from the activity log file (activity.path): the same grants, in the same bands.
        stack.sidecar.stop()
        await async_wait_for(lambda: browser.execute_script(READ_PAGE)["connection"] == "reconnecting…",
                             what="the page noticing the sidecar gone")
        second = SidecarProcess(stack.config_path, tmp_path, name="sidecar-2")
        try:
            assert second.admin_port == admin_port

            def live_again() -> bool:
                seen = browser.execute_script(READ_PAGE)
                return (seen["connection"] == "live" and seen["gpu"] == "idle" and seen["queue"] == []
                        and "served" not in seen["counters"]  # the new process's own counters
                        and Counter(tuple(g[:2]) for g in seen["grants"]) == finished)

            await async_wait_for(live_again, what="the page live again on the new sidecar, with the old timeline")
        finally:
            second.stop()


READ_ESTIMATES = """
const cells = (selector) => [...document.querySelectorAll(selector)].map((td) => td.textContent);
const dispatched = document.querySelector("#counters .counter .big");
return {
  runningEnd: cells("#running tbody tr[data-request-id] td:last-child"),
  queueStart: cells("#queue tbody tr[data-request-id] td:nth-last-child(2)"),
  dispatched: dispatched ? dispatched.textContent : null,
};
"""


async def test_the_page_says_unknown_past_the_expected_run_and_counts_the_running_grant(
        tmp_path: pathlib.Path, browser: Any) -> None:
    """Issue 25: a request that outran its expected run (here the stated prior,
    estimates.defaultRunSeconds) showed an end already past and starts of "0.00 s" behind it;
    and the Dispatched counter left the running grant out."""
    with running_stack(tmp_path, {"estimates": {"defaultRunSeconds": 0.5}}) as stack:
        async with aiohttp.ClientSession() as session:
            held = asyncio.create_task(chat(session, stack.url, "held", hold=True))
            await async_wait_for(lambda: "held" in stack.upstream.order(), what="held at the upstream")
            after = asyncio.create_task(chat(session, stack.url, "after"))
            await async_wait_for(lambda: queued(stack, "after"), what="after waiting")
            queue = await async_wait_for(
                lambda: (lambda q: q if q["running"]["expected_remaining_s"] is None else None)(stack.sidecar.queue()),
                what="held past its expected run")
            assert queue["waiting"][0]["estimated_start_s"] is None
            browser.get(f"{stack.sidecar.admin_url}/ui")
            seen = await async_wait_for(
                lambda: (lambda page: page if page["runningEnd"] and page["queueStart"] else None)(
                    browser.execute_script(READ_ESTIMATES)), what="the page's running and waiting rows")
            assert seen == {"runningEnd": ["unknown"], "queueStart": ["unknown"], "dispatched": "1"}
            # No batches.dir: the Batches panel says the API is off, and lists nothing.
            panel = browser.execute_script(READ_BATCHES)
            assert panel["shown"] and panel["off"] and panel["rows"] == [], panel
            stack.upstream.release("held")
            replies = [await held, await after]
        assert [reply.status for reply in replies] == [200, 200]


READ_GPUS = """
const rows = (selector) => [...document.querySelectorAll(selector)];
return {
  gpus: rows("#timeline rect.gpu-lane").map((r) => [r.dataset.gpu, Number(r.getAttribute("y"))]),
  grants: rows("#timeline rect.grant").map((r) => [r.dataset.requestId, r.dataset.gpu, Number(r.getAttribute("y"))]),
  runningBars: rows("#timeline rect.running").map((r) => [r.dataset.requestId, r.dataset.gpu,
      Number(r.getAttribute("y"))]),
  header: rows("#gpus .chip").map((c) => [c.dataset.gpu, c.querySelector(".gpu-model").textContent,
      c.querySelector(".gpu-slots").textContent]),
  runningGpu: rows("#running tbody tr[data-request-id]").map((tr) => [tr.dataset.requestId,
      tr.querySelector("td.gpu-name").textContent]),
  counters: document.getElementById("counters").textContent,
};
"""


async def test_the_page_has_a_timeline_row_per_gpu(browser: Any) -> None:
    """Two upstreams (issue 27): a timeline row per GPU with each bar on the GPU it ran on, and
    each GPU's loaded model and busy slots in the header. The page's own documents are served
    in-process over a scheduler of two GPUs (tests/two_gpus.py), without Envoy or an upstream:
    what is checked is the page, and the sidecar's coordinator does not run two upstreams yet.
    Once it does, the same checks belong on a `running_stack` with `upstreams:`."""
    from two_gpus import TwoGpus

    from llamaswap.adapters.ui import UiState
    from llamaswap.core import ManualClock
    from llamaswap.runtime.activity import ActivityLog
    from llamaswap.runtime.history import History

    clock = ManualClock()
    activity = ActivityLog(clock)
    history = History(clock, activity)
    node = TwoGpus((activity, history), clock=clock)
    tickets = {rid: node.arrive(rid, model) for rid, model in (("x1", "x"), ("y1", "y"), ("x2", "x"), ("z1", "z"))}
    assert node.grant() == {"x1": "big", "y1": "small", "x2": "big"}
    clock.advance(2)
    node.finish(tickets["y1"])
    node.finish(tickets["x1"])
    assert node.grant() == {"z1": "small"}
    clock.advance(1)
    with page_served(UiState(node.coordinator, history, jaeger_url=lambda: "")) as port:  # type: ignore[arg-type]
        browser.get(f"http://127.0.0.1:{port}/ui")
        seen = await async_wait_for(
            lambda: (lambda page: page if len(page["grants"]) == 2 and len(page["runningBars"]) == 2 else None)(
                browser.execute_script(READ_GPUS)), what="the page's two GPU rows")
        gpus = dict(seen["gpus"])
        assert list(gpus) == ["big", "small"] and gpus["big"] < gpus["small"]
        bars = {rid: (gpu, y) for rid, gpu, y in seen["grants"] + seen["runningBars"]}
        assert {rid: gpu for rid, (gpu, _) in bars.items()} == {"x1": "big", "y1": "small", "x2": "big",
                                                                 "z1": "small"}
        for gpu, y in bars.values():  # each bar inside its GPU's row
            assert gpus[gpu] < y < gpus[gpu] + 44
        assert seen["header"] == [["big", "x", "1 / 2"], ["small", "z", "1 / 1"]]
        assert dict(seen["runningGpu"]) == {"x2": "big", "z1": "small"}
        if os.environ.get("LLAMASWAP_UI_GPUS_SCREENSHOT"):  # to look at it
            browser.save_screenshot(os.environ["LLAMASWAP_UI_GPUS_SCREENSHOT"])
        assert "Per GPU" in seen["counters"] and "big2 / 0 / 1small2 / 1 / 1" in seen["counters"]


@contextlib.contextmanager
def page_served(ui: Any) -> Iterator[int]:
    """The page's routes over ``ui`` (an `adapters.ui.UiState`) on a free port, in their own
    thread and loop (the browser's driver calls block this one): the port."""
    from aiohttp import web

    from llamaswap.adapters.ui import add_ui_routes

    app = web.Application()
    add_ui_routes(app, ui)
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    port = free_port()

    async def serve() -> None:
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()

    server = threading.Thread(target=loop.run_forever, daemon=True)
    server.start()
    asyncio.run_coroutine_threadsafe(serve(), loop).result(timeout=30)
    try:
        yield port
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=30)
        loop.call_soon_threadsafe(loop.stop)
        server.join(timeout=30)
        loop.close()


READ_RESIDENTS = """
const chips = [...document.querySelectorAll("#gpus .chip")];
return chips.map((c) => ({
  gpu: c.dataset.gpu,
  models: [...c.querySelectorAll(".gpu-resident")].map((m) => [m.dataset.model, m.textContent]),
  max: (c.querySelector(".gpu-max") || {}).textContent,
  held: (c.querySelector(".gpu-held") || {}).textContent,
  slots: c.querySelector(".gpu-slots").textContent,
}));
"""


async def test_the_page_shows_each_resident_model_and_what_is_held_back(browser: Any) -> None:
    """One GPU keeping several models resident (issue 37): its chip lists each model with its own
    busy / total slots, how many are resident of maxLoaded, and the model the best waiting request
    holds back. Served in-process over hand-built GPU holdings (tests/test_views_residents.py)."""
    from test_views_residents import BUSY, Resident

    from llamaswap.adapters.ui import UiState
    from llamaswap.runtime.activity import ActivityLog
    from llamaswap.runtime.history import History

    node = Resident(BUSY, held_back="chat")
    history = History(node.clock, ActivityLog(node.clock))
    with page_served(UiState(node, history, jaeger_url=lambda: "")) as port:  # type: ignore[arg-type]
        browser.get(f"http://127.0.0.1:{port}/ui")
        (chip,) = await async_wait_for(lambda: browser.execute_script(READ_RESIDENTS) or None,
                                       what="the GPU's chip")
        assert chip["gpu"] == "gpu0" and chip["slots"] == "3 / 8"
        assert chip["models"] == [["chat", "chat 2 / 2"], ["code", "code 0 / 2"], ["embed", "embed (pinned) 1 / 4"]]
        assert chip["max"] == "(3 of 3)" and chip["held"] == "holding back chat"


READ_BATCHES = """
const section = document.getElementById("batches-section");
const rows = [...document.querySelectorAll("#batches tbody tr[data-batch-id]")];
const tagged = (selector) => [...document.querySelectorAll(selector)].filter((tr) => tr.querySelector(".tag"))
  .map((tr) => tr.dataset.requestId);
return {
  shown: !section.hidden,
  off: !document.getElementById("batches-off").hidden,
  rows: rows.map((tr) => ({
    id: tr.dataset.batchId, status: tr.dataset.status,
    done: tr.querySelector("td.done").textContent,
    inFlight: tr.children[4].textContent, priority: tr.children[5].textContent,
    started: tr.children[6].textContent, finish: tr.querySelector("td.finish").textContent,
    bar: [tr.querySelector(".progress .completed").style.width, tr.querySelector(".progress .failed").style.width],
  })),
  taggedQueue: tagged("#queue tbody tr[data-request-id]"),
  taggedRunning: tagged("#running tbody tr[data-request-id]"),
};
"""
GATE = "wait-for-the-gate"


async def test_the_page_shows_a_batch_with_its_progress(tmp_path: pathlib.Path, browser: Any) -> None:
    """Two batches made through the Batch API (the openai SDK, through Envoy), one line of each in
    flight (batches.inFlight: 1). The first: one line refused (its model gone from the upstream
    since the sidecar read its list), four answered, then one held at the upstream by a gate: the
    panel shows 4 / 10 and 1 failed, its bar 40 % and 10 %, its priority and an estimated finish.
    The second's first line waits behind it. Both lines show in the GPU and queue tables with a
    "batch" tag. The gate opens: both complete, and the panel says so."""
    openai = pytest.importorskip("openai")

    fake = FakeLlamaServer(router=True, models=("model-a", "model-gone"))
    fake.gate_marker = GATE.encode()
    # Fixed ports: the feeder sends the lines to Envoy's listener, which must be known at start.
    config = {"listen": {"http": f"127.0.0.1:{free_port()}", "grpc": f"127.0.0.1:{free_port()}",
                         "admin": f"127.0.0.1:{free_port()}"},
              "batches": {"dir": str(tmp_path / "batches"), "inFlight": 1}}

    def jsonl(lines: list[tuple[str, str]]) -> bytes:
        """An input file of (model, content) lines, line-0 first."""
        return "".join(json.dumps({"custom_id": f"line-{n}", "method": "POST", "url": "/v1/chat/completions",
                                   "body": {"model": model, "max_tokens": 4,
                                            "messages": [{"role": "user", "content": content}]}}) + "\n"
                       for n, (model, content) in enumerate(lines)).encode()

    with running_stack(tmp_path, config, fake=fake) as stack:
        with fake.lock:  # the sidecar read it at its start (modelsPollSeconds: 0): the upstream answers 400
            del fake.states["model-gone"]
        client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=30)

        def create(lines: list[tuple[str, str]]) -> Any:
            upload = client.files.create(file=("input.jsonl", jsonl(lines)), purpose="batch")
            return client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                         completion_window="24h")

        first = create([("model-gone", "refused")] + [("model-a", f"question {n}") for n in range(1, 5)]
                       + [("model-a", GATE)] * 5)

        def answered() -> bool:
            counts = client.batches.retrieve(first.id).request_counts
            return counts is not None and (counts.completed, counts.failed) == (4, 1)

        wait_for(answered, what="four lines answered and one refused")
        second = create([("model-a", GATE)] * 3)
        queue = wait_for(lambda: (lambda q: q if len(q["waiting"]) == 1 else None)(stack.sidecar.queue()),
                         what="the second batch's first line waiting")
        assert [row["request_id"] for row in queue["running_all"]] == [f"{first.id}:line-5"]
        assert [row["request_id"] for row in queue["waiting"]] == [f"{second.id}:line-0"]
        assert get_json(f"{stack.sidecar.admin_url}/ui/state")["batches"] is not None, \
            "the sidecar gives its page no batches: Sidecar passes UiState batches=batch_documents(self.batches)"
        browser.get(f"{stack.sidecar.admin_url}/ui")

        def progress() -> dict[str, Any] | None:
            seen = browser.execute_script(READ_BATCHES)
            rows = seen["rows"]
            return seen if (len(rows) == 2 and rows[1]["done"] == "4 / 10 1 failed" and rows[1]["finish"] != "–"
                            and seen["taggedQueue"] and seen["taggedRunning"]) else None

        seen = await async_wait_for(progress, what="both batches' progress in the panel")
        newest, oldest = seen["rows"]
        assert seen["shown"] and not seen["off"]
        assert (oldest["id"], oldest["status"], oldest["inFlight"], oldest["priority"]) == (
            first.id, "in_progress", "1", "-100")
        assert oldest["bar"] == ["40%", "10%"]
        assert oldest["started"] != "–" and ("(in " in oldest["finish"] or "(overdue)" in oldest["finish"]), oldest
        # The second: nothing ended yet, so no estimate.
        assert (newest["id"], newest["status"], newest["done"], newest["bar"], newest["finish"]) == (
            second.id, "in_progress", "0 / 3", ["0%", "0%"], "–")
        assert seen["taggedRunning"] == [f"{first.id}:line-5"]
        assert seen["taggedQueue"] == [f"{second.id}:line-0"]
        browser.execute_script("document.getElementById('batches-section').scrollIntoView()")
        shot = tmp_path / "ui-batches.png"
        browser.get_screenshot_as_file(str(shot))
        if os.environ.get("LLAMASWAP_UI_BATCHES_SCREENSHOT"):
            shutil.copyfile(shot, os.environ["LLAMASWAP_UI_BATCHES_SCREENSHOT"])

        fake.open_gate()
        ended = await async_wait_for(
            lambda: (lambda rows: rows if [row["status"] for row in rows] == ["completed"] * 2 else None)(
                browser.execute_script(READ_BATCHES)["rows"]), what="both batches completed in the panel")
        assert [row["done"] for row in ended] == ["3 / 3", "9 / 10 1 failed"]
        assert [row["bar"] for row in ended] == [["100%", "0%"], ["90%", "10%"]]
        assert all(row["finish"].startswith("ended ") and row["inFlight"] == "0" for row in ended)
        client.close()


READ_LINE_NOTES = """
const notes = (selector) => [...document.querySelectorAll(selector)].map((tr) => [tr.dataset.requestId,
  (tr.querySelector(".line-note") || {}).textContent || ""]);
return {queue: notes("#queue tbody tr[data-request-id]"), running: notes("#running tbody tr[data-request-id]")};
"""


async def test_the_page_notes_a_stopped_line_s_progress(browser: Any) -> None:
    """Issue 46: a Batch API line stopped for a higher band shows its progress beside its id (the
    rows' ``line``): waiting, its stops and the tokens kept; running, its stops and tokens now;
    nothing on a line never stopped nor on a client's request. Served in-process over hand-built
    rows (what tests/test_line_progress.py shows the views build)."""
    import dataclasses

    from test_line_stops import Kept
    from test_views_residents import BUSY, Resident

    from llamaswap.adapters.ui import UiState
    from llamaswap.core import Band
    from llamaswap.runtime.activity import ActivityLog
    from llamaswap.runtime.history import History
    from llamaswap.runtime.views import QueueView, RunningRow, WaitingRow

    class WithLines(Resident):
        def view(self) -> QueueView:
            waiting = (WaitingRow("batch_1:line-a", 1, -100, Band.BATCH, -100.0, False, 4.0, "chat", 3.0,
                                  line=Kept(1, 120)),
                       WaitingRow("batch_1:line-c", 2, -100, Band.BATCH, -100.0, False, 2.0, "chat", 9.0,
                                  line=Kept(0, 0)),
                       WaitingRow("chat-2", 3, 0, Band.NORMAL, 0.0, False, 1.0, "chat", 12.0))
            running = (RunningRow("batch_1:line-b", -100, Band.BATCH, -100.0, "chat", 1.0, 2.0, 10.0, 8.0,
                                  line=Kept(2, 300)),
                       RunningRow("chat-1", 0, Band.NORMAL, 0.0, "chat", 0.5, 1.0, 10.0, 9.0))
            return dataclasses.replace(super().view(), waiting=waiting, running=running)

    node = WithLines(BUSY)
    history = History(node.clock, ActivityLog(node.clock))
    with page_served(UiState(node, history, jaeger_url=lambda: "")) as port:  # type: ignore[arg-type]
        browser.get(f"http://127.0.0.1:{port}/ui")
        seen = await async_wait_for(lambda: (lambda notes: notes if notes["queue"] and notes["running"] else None)(
            browser.execute_script(READ_LINE_NOTES)), what="the page's waiting and running rows")
        assert seen["queue"] == [["batch_1:line-a", "stopped 1x, 120 tokens kept"], ["batch_1:line-c", ""],
                                 ["chat-2", ""]]
        assert seen["running"] == [["batch_1:line-b", "stopped 2x, 300 tokens"], ["chat-1", ""]]
