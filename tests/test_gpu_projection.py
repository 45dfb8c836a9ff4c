"""One projection of the GPUs (`runtime/gpu_projection.py`) is what GET /queue, the page's state,
`llamaswap queue` and the gauges (the picker's page among them) read: a field added to it
reaches each of them with that one edit, and the server, not its readers, says whether a GPU
gets a line of its own (``per_gpu``) and its models a slot count each (``per_model``).

A real Coordinator over two GPUs on virtual time (tests/flow.py), with the real Telemetry and
the page's state (`UiState`) beside it.
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

import pytest
from flow import FakeUpstream, Flow, clock, virtual_time
from picker import parse_exposition, parse_spec, read_adapters

from llamaswap.adapters.admin import queue_document
from llamaswap.adapters.ui import UiState
from llamaswap.commands.queue import render
from llamaswap.core.holding import GpuHolding
from llamaswap.runtime.gpu_projection import GpuProjection, ModelProjection, NodeProjection, document_of
from llamaswap.runtime.history import History
from llamaswap.runtime.activity import ActivityLog
from llamaswap.telemetry import instruments as names
from llamaswap.telemetry.observer import Telemetry

APP_JS = pathlib.Path(__file__).resolve().parents[1] / "sidecar" / "llamaswap" / "ui" / "app.js"


def names_of(cls: type) -> list[str]:
    return [field.name for field in dataclasses.fields(cls)]


class Node:
    """Two GPUs (``gpu0`` two slots, ``gpu1`` one) behind a real coordinator, its gauges and the page's state."""

    def __init__(self) -> None:
        self.telemetry = Telemetry(clock=clock())
        entries = [{"name": f"gpu{index}", "url": f"http://127.0.0.1:{8081 + index}", "slots": slots}
                   for index, slots in enumerate((2, 1))]
        self.flow = Flow({"upstreams": entries, "envoy": {"leaseSeconds": 1000}}, observers=[self.telemetry],
                         upstreams=[FakeUpstream(), FakeUpstream()])
        history = History(self.flow.clock, ActivityLog(self.flow.clock))
        self.ui = UiState(self.flow.coordinator, history, jaeger_url=lambda: "")

    def queue(self) -> dict[str, Any]:
        return queue_document(self.flow.coordinator.view())

    def page(self) -> dict[str, Any]:
        return self.ui.state_document()

    def gauges(self) -> NodeProjection:
        return self.flow.recorder.picture().node


async def busy(node: Node) -> None:
    for request_id, model in (("a1", "a"), ("a2", "a"), ("b1", "b"), ("c1", "c")):
        await node.flow.arrive(request_id, model=model)


def test_the_documents_are_the_projections_fields() -> None:
    """Every field, by its own name, and nothing else: no second list of a GPU's keys to keep."""
    model = ModelProjection("m", 1, 2, pinned=True)
    gpu = GpuProjection("g", ("m",), 1, 2, models=(model,), held_back="m", per_model=True)
    node = NodeProjection.of((gpu,))
    document = node.document()
    assert list(document) == names_of(NodeProjection)
    assert list(document["gpus"][0]) == names_of(GpuProjection)
    assert list(document["gpus"][0]["models"][0]) == names_of(ModelProjection)
    assert document["gpus"][0]["state"] == "idle" and document["gpus"][0]["resident_models"] == ["m"]
    assert document["gpu"] == "idle" and document["per_gpu"] is True  # one GPU, shown model by model


@virtual_time
async def test_queue_the_page_and_the_gauges_read_one_projection() -> None:
    node = Node()
    await busy(node)
    await node.flow.idle()
    # The gauges' picture is built when read: after the pump that found what c1 holds back (gpu1's b).
    projection = node.flow.coordinator.view().node
    assert [gpu.slots_busy for gpu in projection.gpus] == [2, 1]  # (c1 waits)
    assert [gpu.held_back for gpu in projection.gpus] == [None, "b"]  # c1 holds b back (room for one)
    # GET /queue and the page's state carry the projection's own document; the gauges its value.
    assert {key: node.queue()[key] for key in projection.document()} == projection.document()
    assert {key: node.page()[key] for key in projection.document()} == projection.document()
    assert node.gauges() == projection
    assert node.queue()["per_gpu"] is True  # two GPUs: a line each


@virtual_time
async def test_a_field_added_to_the_projection_reaches_every_reader(monkeypatch: pytest.MonkeyPatch) -> None:
    """One edit: a GPU's projection gains a field (here by a subclass built where it is built),
    and /queue, the page's state and the gauges' picture have it, no reader touched."""

    @dataclasses.dataclass(frozen=True, slots=True)
    class Extended(GpuProjection):
        memory: str = ""

    built = GpuProjection.of

    def of(cls: type, gpu: GpuHolding, held_back: str | None = None) -> GpuProjection:
        base = built(gpu, held_back)
        return Extended(**{field: getattr(base, field) for field in names_of(GpuProjection)}, memory=f"{gpu.name}!")

    monkeypatch.setattr(GpuProjection, "of", classmethod(of))
    node = Node()
    await busy(node)
    await node.flow.idle()
    assert [gpu["memory"] for gpu in node.queue()["gpus"]] == ["gpu0!", "gpu1!"]
    assert [gpu["memory"] for gpu in node.page()["gpus"]] == ["gpu0!", "gpu1!"]
    assert [getattr(gpu, "memory") for gpu in node.gauges().gpus] == ["gpu0!", "gpu1!"]


@virtual_time
async def test_the_gauges_and_the_pickers_page_follow_the_projection() -> None:
    node = Node()
    await busy(node)
    await node.flow.idle()
    projection = node.gauges()
    page = parse_exposition(node.telemetry.picker_text()[0].decode())
    assert page[names.GPU_SLOTS_BUSY][0].value == projection.slots_busy == 3
    adapters = read_adapters(page, parse_spec(names.MODELS_INFO))
    assert adapters is not None and adapters.running == projection.resident_models
    whole = node.telemetry.prometheus_text()[0].decode()
    for gpu in projection.gpus:
        assert f'{names.UPSTREAM_SLOTS}{{upstream="{gpu.name}"}} {gpu.slots}' in whole


def test_llamaswap_queue_shows_a_line_per_gpu_where_the_server_says_so() -> None:
    gpu = GpuProjection("gpu0", ("a",), 0, 1)
    document = {"policy": "serial", "waiting": [], "running_all": [], **NodeProjection.of((gpu,)).document()}
    assert document["per_gpu"] is False and len(render(document).splitlines()) == 2  # summary, header
    document["per_gpu"] = True  # what a server says of a GPU that may keep several models
    lines = render(document).splitlines()
    assert lines[1].split() == ["gpu0", "slots", "0/1", "loaded", "model", "a", "idle"]
    document["gpus"] = [document_of(dataclasses.replace(gpu, per_model=True, models=(ModelProjection("a", 0, 1),)))]
    assert "slots 0/1  models (1 of 1) a 0/1  idle" in render(document).splitlines()[1]


def test_the_page_reads_the_servers_word_for_per_gpu_rows() -> None:
    """The page draws a GPU's chip where the state says ``per_gpu`` and its models one by one
    where it says ``per_model``; it derives neither (e2e/test_ui.py draws them in a browser)."""
    script = APP_JS.read_text()
    assert "doc.per_gpu" in script and "gpu.per_model" in script
    assert "max_loaded || 1) > 1" not in script


def test_a_gpus_projection_is_kept_only_while_its_holding_and_held_back_model_are() -> None:
    from llamaswap.core import Slots
    from llamaswap.core.holding import Running
    from llamaswap.runtime.gpu_projection import Projector

    projector = Projector()
    idle = GpuHolding("gpu0", Slots(2), None, frozenset({"a"}))
    first = projector.node((idle,), {})
    assert projector.node((idle,), {}) is first  # nothing changed: the same value
    held = projector.node((idle,), {"gpu0": "a"})
    assert held is not first and held.gpus[0].held_back == "a"
    assert not held.per_gpu  # a model held back alone does not make one GPU's line rows per model
    busy = idle._replace(running=Running(1, 1, "a"))
    moved = projector.node((busy,), {})
    assert (moved.gpus[0].slots_busy, moved.gpus[0].state, moved.gpus[0].held_back) == (1, "running", None)
    assert (moved.slots_busy, moved.gpu, moved.busy) == (1, "running", True)
