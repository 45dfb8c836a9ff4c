"""What people see of a node with several upstreams (issue 27): `/queue`, `llamaswap queue`, the
metrics (the picker's page among them), the spans and the page's documents say which GPU each
request runs on, what each GPU has loaded and how many of its slots are busy. Built on a
Scheduler over two GPUs (`two_gpus.py`), no coordinator; one upstream keeps today's shape
(tests/test_telemetry.py, tests/test_ui_documents.py)."""

from __future__ import annotations

from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from picker import parse_exposition, parse_spec, read_adapters
from test_telemetry import by_label, parse_text, value
from two_gpus import TwoGpus

from llamaswap.adapters.admin import queue_document, status_document
from llamaswap.commands.queue import render
from llamaswap.core import ManualClock
from llamaswap.runtime.gpu_projection import GpuProjection, NodeProjection
from llamaswap.runtime.observer import QueuePicture
from llamaswap.telemetry import instruments as names
from llamaswap.telemetry.observer import QUEUE_SPAN, RUN_SPAN, Telemetry


def picture(*gpus: GpuProjection) -> QueuePicture:
    """The gauges' picture of these GPUs, nothing waiting."""
    return QueuePicture((), (), NodeProjection.of(gpus))


def busy_node(observers: tuple = (), clock: ManualClock | None = None) -> tuple[TwoGpus, dict]:
    """x twice on big (its two slots), y on small, z waiting for a free upstream."""
    node = TwoGpus(observers, clock=clock)
    tickets = {rid: node.arrive(rid, model) for rid, model in (("x1", "x"), ("x2", "x"), ("y1", "y"), ("z1", "z"))}
    assert node.grant() == {"x1": "big", "x2": "big", "y1": "small"}
    node.advance(3)
    return node, tickets


def one_model(model: str, busy: int, slots: int, *, loading: bool = False) -> dict:
    """The fields of a GPU's document that describe its models, one resident at a time (issue 37's
    fields, beside the ones before it)."""
    return {"max_loaded": 1, "held_back": None, "blocked": False, "per_model": False,
            "models": [{"model": model, "slots_busy": busy, "slots": slots, "pinned": False, "loading": loading}]}


# -- /queue -------------------------------------------------------------------------------------


def test_the_queue_document_lists_each_gpu_and_where_each_request_runs() -> None:
    node, _ = busy_node()
    document = queue_document(node.view())
    assert document["gpus"] == [
        {"name": "big", "resident_models": ["x"], "slots_busy": 2, "slots": 2, "state": "running",
         **one_model("x", 2, 2, loading=True)},
        {"name": "small", "resident_models": ["y"], "slots_busy": 1, "slots": 1, "state": "running",
         # z waits for small to drain: it holds back y there (issue 45: with room for one model
         # too, the best holds back the models that must go for its load, not the whole GPU).
         **one_model("y", 1, 1, loading=True), "held_back": "y"}]
    assert [(row["request_id"], row["upstream"]) for row in document["running_all"]] == [
        ("x1", "big"), ("x2", "big"), ("y1", "small")]
    # The fields a client of one GPU reads stay: the first running request, the slots over the
    # whole node; the node's resident models are every GPU's, in the configured order.
    assert document["running"]["request_id"] == "x1" and document["running"]["upstream"] == "big"
    assert document["resident_models"] == ["x", "y"]
    assert (document["slots_busy"], document["slots_total"]) == (3, 3)
    assert [row["request_id"] for row in document["waiting"]] == ["z1"]


def test_the_nodes_resident_models_are_every_gpus_once_in_the_configured_order() -> None:
    gpus = (GpuProjection("b", ("y",), 0, 1), GpuProjection("a", ("x", "y"), 0, 1), GpuProjection("c", (), 0, 1))
    assert NodeProjection.of(gpus).resident_models == ("y", "x")


def test_a_running_requests_own_status_names_its_gpu() -> None:
    node, _ = busy_node()

    class Coordinator:  # what status_document asks of the coordinator
        status_of = staticmethod(node.views.status_of)

    status = status_document(Coordinator(), "y1")  # type: ignore[arg-type]
    assert status is not None and status["state"] == "running" and status["upstream"] == "small"


def test_a_gpu_frees_and_the_document_follows() -> None:
    node, tickets = busy_node()
    node.finish(tickets["y1"])
    assert node.grant() == {"z1": "small"}  # small swaps y for z; big stays busy with x
    document = queue_document(node.view())
    assert document["gpus"][1] == {"name": "small", "resident_models": ["z"], "slots_busy": 1, "slots": 1,
                                   "state": "running", **one_model("z", 1, 1, loading=True)}
    assert {row["request_id"]: row["upstream"] for row in document["running_all"]} == {
        "x1": "big", "x2": "big", "z1": "small"}


def test_what_holds_each_gpu_comes_from_its_holding() -> None:
    """A settle on one upstream (told to the scheduler, `Scheduler.blocked_by`): that GPU says
    settling, the other what its grants say."""
    node = TwoGpus()
    node.scheduler.blocked_by("small", settling=True, adopted=0)
    document = queue_document(node.view())
    assert [(gpu["name"], gpu["state"]) for gpu in document["gpus"]] == [("big", "idle"), ("small", "settling")]
    lines = render(document).splitlines()
    assert lines[2].split()[0] == "small" and lines[2].endswith("settling (it finishes an abandoned generation)")
    assert lines[1].endswith("idle")
    node.arrive("x1", "x")
    node.grant()
    assert [gpu["state"] for gpu in queue_document(node.view())["gpus"]] == ["running", "settling"]


# -- llamaswap queue ----------------------------------------------------------------------------


def test_the_queue_table_has_a_line_per_gpu_and_a_gpu_column() -> None:
    node, _ = busy_node()
    lines = render(queue_document(node.view())).splitlines()
    assert lines[0] == "policy serial, 2 GPUs, 3 running, slots 3/3, 1 waiting (interactive 0, normal 1, batch 0)"
    assert lines[1].split() == ["big", "slots", "2/2", "loaded", "model", "x", "2", "running"]
    assert lines[2].split()[:8] == ["small", "slots", "1/1", "loaded", "model", "y", "1", "running,"]
    assert lines[2].split()[8:11] == ["holding", "back", "y"]  # z waits for it to drain (issue 45)
    assert lines[3].split()[-2:] == ["MODEL", "GPU"]
    assert [line.split()[2] + ":" + line.split()[-1] for line in lines[4:7]] == ["x1:big", "x2:big", "y1:small"]
    assert lines[7].split()[:3] == ["1", "PD", "z1"] and lines[7].split()[-1] == "z"  # waits: no GPU
    assert len(lines) == 8


def test_one_gpu_keeps_the_table_it_had() -> None:
    document = {"policy": "serial", "resident_models": ["a"], "gpu": "idle", "running_all": [], "waiting": [],
                "gpus": [{"name": "gpu0", "resident_models": ["a"], "slots_busy": 0, "slots": 1}]}
    lines = render(document).splitlines()
    assert lines == ["policy serial, loaded model a, GPU idle, 0 waiting",
                     "POS  ST  REQUEST_ID  PRIORITY  BAND  SCORE  WAIT  TIME  START  MODEL"]


# -- metrics ------------------------------------------------------------------------------------


def metrics(telemetry: Telemetry) -> dict:
    return parse_text(telemetry.prometheus_text()[0].decode())


def test_per_upstream_series_beside_the_node_wide_ones() -> None:
    clock = ManualClock()
    telemetry = Telemetry(clock=clock)
    node, tickets = busy_node((telemetry,), clock)
    samples = metrics(telemetry)
    assert by_label(samples, names.UPSTREAM_SLOTS, "upstream") == {"big": 2, "small": 1}
    assert by_label(samples, names.UPSTREAM_SLOTS_BUSY, "upstream") == {"big": 2, "small": 1}
    assert by_label(samples, names.UPSTREAM_BUSY, "upstream") == {"big": 1, "small": 1}
    assert value(samples, names.UPSTREAM_MODEL, upstream="big", model="x") == 1
    assert value(samples, names.UPSTREAM_MODEL, upstream="small", model="y") == 1
    assert by_label(samples, names.UPSTREAM_DISPATCHED, "upstream") == {"big": 2, "small": 1}
    assert by_label(samples, names.UPSTREAM_LOADS, "upstream") == {"big": 1, "small": 1}
    assert by_label(samples, names.UPSTREAM_SWAPS, "upstream") == {"big": 0, "small": 0}
    # The node-wide series keep their names and labels, and count the whole node.
    assert value(samples, names.GPU_SLOTS) == 3 and value(samples, names.GPU_SLOTS_BUSY) == 3
    assert value(samples, names.LOADS) == 2 and value(samples, names.SWAPS) == 0
    assert sum(by_label(samples, names.DISPATCHED, "band").values()) == 3

    node.finish(tickets["y1"])
    assert node.grant() == {"z1": "small"}
    node.finish(tickets["x1"])
    samples = metrics(telemetry)
    assert by_label(samples, names.UPSTREAM_SLOTS_BUSY, "upstream") == {"big": 1, "small": 1}
    assert by_label(samples, names.UPSTREAM_SWAPS, "upstream") == {"big": 0, "small": 1}
    assert value(samples, names.UPSTREAM_MODEL, upstream="small", model="z") == 1
    assert len(by_label(samples, names.UPSTREAM_MODEL, "model", upstream="small")) == 1  # one series per GPU
    assert value(samples, names.SWAPS) == 1
    node.finish(tickets["x2"])
    node.finish(tickets["z1"])
    samples = metrics(telemetry)
    assert by_label(samples, names.UPSTREAM_BUSY, "upstream") == {"big": 0, "small": 0}
    assert value(samples, names.UPSTREAM_MODEL, upstream="big", model="x") == 1  # still loaded


def test_the_pickers_gauges_cover_every_gpu() -> None:
    clock = ManualClock()
    telemetry = Telemetry(clock=clock)
    node, tickets = busy_node((telemetry,), clock)
    node.arrive("w1", "w")
    page = parse_exposition(telemetry.picker_text()[0].decode())
    assert list(page) == list(names.PICKER)
    whole = parse_exposition(telemetry.prometheus_text()[0].decode())
    assert page == {name: whole[name] for name in names.PICKER}
    adapters = read_adapters(page, parse_spec(names.MODELS_INFO))
    assert adapters is not None
    # Each GPU's loaded model; the pod holds one model per GPU.
    assert adapters.running == ("x", "y") and adapters.waiting == ("z", "w") and adapters.max_adapters == 2
    assert page[names.SATURATION][0].value == 1.0 and page[names.GPU_SLOTS_BUSY][0].value == 3
    node.finish(tickets["x1"])
    node.finish(tickets["x2"])
    page = parse_exposition(telemetry.picker_text()[0].decode())
    assert page[names.SATURATION][0].value == 1 / 3
    adapters = read_adapters(page, parse_spec(names.MODELS_INFO))
    assert adapters is not None and adapters.running == ("x", "y")  # x stays loaded on big


def test_a_model_on_two_gpus_is_listed_once() -> None:
    telemetry = Telemetry(clock=ManualClock())
    telemetry.queue_changed(picture(GpuProjection("a", ("x",), 1, 1),
                                    GpuProjection("b", ("x",), 1, 1)))
    adapters = read_adapters(parse_exposition(telemetry.picker_text()[0].decode()), parse_spec(names.MODELS_INFO))
    assert adapters is not None and adapters.running == ("x",) and adapters.max_adapters == 2


def test_each_resident_model_of_a_gpu_is_a_series_and_listed_once() -> None:
    """Several models resident on one GPU (issue 37 will allow it): a series each, and the node's
    models each once, in the configured order of the GPUs."""
    telemetry = Telemetry(clock=ManualClock())
    telemetry.queue_changed(picture(GpuProjection("a", ("x", "y"), 0, 1),
                                    GpuProjection("b", ("w", "x"), 0, 1)))
    samples = metrics(telemetry)
    assert by_label(samples, names.UPSTREAM_MODEL, "model", upstream="a") == {"x": 1, "y": 1}
    assert by_label(samples, names.UPSTREAM_MODEL, "model", upstream="b") == {"w": 1, "x": 1}
    adapters = read_adapters(parse_exposition(telemetry.picker_text()[0].decode()), parse_spec(names.MODELS_INFO))
    assert adapters is not None and adapters.running == ("x", "y", "w")


def test_a_settle_on_one_gpu_fills_only_that_gpu() -> None:
    """An upstream that finishes an abandoned generation takes no grant: full for the picker,
    busy in its own series; the other GPU's free slots still count as free."""
    telemetry = Telemetry(clock=ManualClock())
    telemetry.queue_changed(picture(GpuProjection("a", ("x",), 0, 2, blocked=True),
                                    GpuProjection("b", (), 0, 2)))
    samples = metrics(telemetry)
    assert value(samples, names.SATURATION) == 0.5
    assert by_label(samples, names.UPSTREAM_BUSY, "upstream") == {"a": 1, "b": 0}
    assert value(samples, names.UPSTREAM_MODEL, upstream="b", model="") == 1


# -- spans --------------------------------------------------------------------------------------


def test_the_spans_name_the_gpu() -> None:
    clock = ManualClock()
    exporter = InMemorySpanExporter()
    telemetry = Telemetry(clock=clock, span_processors=[SimpleSpanProcessor(exporter)], sampler=ALWAYS_ON)
    node, tickets = busy_node((telemetry,), clock)
    node.finish(tickets["y1"])
    node.grant()
    spans = {(span.name, span.attributes["llamaswap.request_id"]): span for span in exporter.get_finished_spans()}
    assert {rid: spans[(QUEUE_SPAN, rid)].attributes["llamaswap.upstream"] for rid in ("x1", "x2", "y1", "z1")} == {
        "x1": "big", "x2": "big", "y1": "small", "z1": "small"}
    assert spans[(RUN_SPAN, "y1")].attributes["llamaswap.upstream"] == "small"


# -- the page's documents -------------------------------------------------------------------------


def test_the_pages_state_and_timeline_name_each_gpu() -> None:
    import json

    from llamaswap.adapters.ui import UiState
    from llamaswap.runtime.activity import ActivityLog
    from llamaswap.runtime.history import History

    clock = ManualClock()
    activity = ActivityLog(clock)
    history = History(clock, activity)
    node, tickets = busy_node((activity, history), clock)
    node.finish(tickets["y1"])
    node.grant()
    ui = UiState(node.coordinator, history, jaeger_url=lambda: "")  # type: ignore[arg-type]
    state = ui.state_document()
    assert state["gpus"] == [
        {"name": "big", "resident_models": ["x"], "slots_busy": 2, "slots": 2, "state": "running",
         **one_model("x", 2, 2, loading=True)},
        {"name": "small", "resident_models": ["z"], "slots_busy": 1, "slots": 1, "state": "running",
         **one_model("z", 1, 1, loading=True)}]
    assert {row["request_id"]: row["upstream"] for row in state["running"]} == {"x1": "big", "x2": "big",
                                                                                "z1": "small"}
    assert state["counters"]["upstreams"] == {"big": {"dispatched": 2, "swaps": 0, "loads": 1},
                                              "small": {"dispatched": 2, "swaps": 1, "loads": 1}}
    entries = json.loads(ui.timeline(since_ms=None, after_seq=0))["entries"]
    assert [(entry["kind"], entry["request_id"], entry["upstream"]) for entry in entries] == [
        ("grant", "y1", "small")]


def test_a_settle_on_the_timeline_names_its_gpu() -> None:
    import json

    from llamaswap.runtime.activity import ActivityLog
    from llamaswap.runtime.history import History
    from llamaswap.runtime.observer import Settle, SettleReason, SettleResult

    clock = ManualClock()
    history = History(clock, ActivityLog(clock))
    history.settled(Settle(SettleReason.ABANDONED, SettleResult.IDLE, "y", "y1", 0, 2_000_000_000, gpu="small"))
    (entry,) = history.entries()
    assert json.loads(entry.body)["upstream"] == "small"


def test_the_dashboard_shows_each_gpu_with_series_that_exist() -> None:
    import json
    import pathlib
    import re

    board = json.loads((pathlib.Path(__file__).resolve().parents[1] / "charts" / "llamaswap" / "dashboards"
                        / "llamaswap.json").read_text())
    expressions = [target["expr"] for panel in board["panels"] for target in panel["targets"]]
    per_gpu = [e for e in expressions if "by (instance, upstream)" in e]
    assert {name for e in per_gpu for name in re.findall(r"llamaswap_[a-z_]+", e)} == {
        names.UPSTREAM_SLOTS_BUSY, names.UPSTREAM_SLOTS, names.UPSTREAM_DISPATCHED, names.UPSTREAM_SWAPS}
    # Every series the dashboard reads is one the sidecar writes (a histogram by its _bucket).
    for name in {name for e in expressions for name in re.findall(r"llamaswap_[a-z_]+", e)}:
        assert name in names.ALL or name.removesuffix("_bucket") in names.ALL, name
