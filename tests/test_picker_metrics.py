"""The gauges an endpoint picker reads (llm-d's router for an InferencePool), read the way it
reads them (`picker.py`): one series per figure, the loaded and waiting models in the LoRA info
gauge's shape. The end-to-end twin is e2e/test_inference_pool.py; the cost, bench/picker_scrape.py."""

from __future__ import annotations

import pytest
from flow import FakeUpstream, virtual_time
from picker import Adapters, MetricSpec, SpecError, parse_exposition, parse_spec, read_adapters, read_gauge
from test_telemetry import LONG_LEASE, Traced

from llamaswap.runtime.ticket import ExchangeEnd
from llamaswap.telemetry import instruments as names

WAITING = parse_spec(names.WAITING)
RUNNING = parse_spec(names.GPU_SLOTS_BUSY)
SATURATION = parse_spec(names.SATURATION)
MODELS = parse_spec(names.MODELS_INFO)


def read(traced: Traced) -> dict:
    return parse_exposition(traced.telemetry.prometheus_text()[0].decode())


def picture(traced: Traced) -> tuple[float, float, float, object]:
    families = read(traced)
    # The picker's own page is the same four families, word for word, as the whole page's.
    picker_page = parse_exposition(traced.telemetry.picker_text()[0].decode())
    assert list(picker_page) == list(names.PICKER)
    assert picker_page == {name: families[name] for name in names.PICKER}
    whole = traced.telemetry.prometheus_text()[0].decode()
    for line in traced.telemetry.picker_text()[0].decode().splitlines():
        assert line in whole.splitlines(), line
    return (read_gauge(families, WAITING), read_gauge(families, RUNNING), read_gauge(families, SATURATION),
            read_adapters(families, MODELS))


@virtual_time
async def test_the_picker_reads_waiting_running_saturation_and_models() -> None:
    traced = Traced({**LONG_LEASE, "upstream": {"slots": 2}})
    flow = traced.flow
    waiting, running, saturation, adapters = picture(traced)
    assert (waiting, running, saturation) == (0, 0, 0)
    # Nothing loaded, nothing waiting: the one series lists no adapter (the family is there, so
    # the picker reads "none", not "no information").
    assert adapters == Adapters((), (), 1)
    families = read(traced)
    assert [series.labels for series in families[names.MODELS_INFO]] == [
        {"running_lora_adapters": "", "waiting_lora_adapters": "", "max_lora": "1"}]

    a1 = await flow.arrive("a1", "batch", "a")
    a2 = await flow.arrive("a2", "batch", "a")
    b1 = await flow.arrive("b1", "interactive", "b")
    c1 = await flow.arrive("c1", None, "c")
    b2 = await flow.arrive("b2", None, "b")
    assert a1.granted and a2.granted and not b1.granted
    waiting, running, saturation, adapters = picture(traced)
    assert (waiting, running, saturation) == (3, 2, 1.0)
    assert adapters is not None
    assert adapters.running == ("a",) and adapters.waiting == ("b", "c") and adapters.max_adapters == 1
    # The whole figure, not a band's: the per-band depth says 1 interactive, 2 normal.
    assert waiting == sum(series.value for series in read(traced)[names.QUEUE_DEPTH])

    await flow.complete(a1)
    waiting, running, saturation, adapters = picture(traced)
    assert (waiting, running, saturation) == (3, 1, 0.5)  # b waits for a's slots to drain
    await flow.complete(a2)
    assert b1.granted and b2.granted  # b swapped in, both of its requests in its two slots
    waiting, running, saturation, adapters = picture(traced)
    assert (waiting, running, saturation) == (1, 2, 1.0)
    assert adapters is not None and adapters.running == ("b",) and adapters.waiting == ("c",)

    await flow.cancel(c1)  # a waiting request that leaves takes its model off the list
    _, _, _, adapters = picture(traced)
    assert adapters is not None and adapters.running == ("b",) and adapters.waiting == ()
    await flow.complete(b1)
    await flow.complete(b2)
    waiting, running, saturation, adapters = picture(traced)
    assert (waiting, running, saturation) == (0, 0, 0)
    assert adapters is not None and adapters.running == ("b",)  # still loaded
    assert c1.outcome is not None


@virtual_time
async def test_the_series_value_is_when_its_labels_changed() -> None:
    traced = Traced(LONG_LEASE)
    flow = traced.flow
    first = await flow.arrive("first", None, "a")
    await flow.arrive("second", None, "a")
    before = read(traced)[names.MODELS_INFO][0]
    assert before.labels["running_lora_adapters"] == "a" and before.labels["waiting_lora_adapters"] == "a"
    await flow.advance(1)
    await flow.arrive("third", None, "a")  # a already listed as waiting: the labels stay
    assert read(traced)[names.MODELS_INFO][0].value == before.value
    await flow.arrive("fourth", None, "b")
    series = read(traced)[names.MODELS_INFO]
    assert len(series) == 1  # one series at a time, whatever changed before
    assert series[0].labels["waiting_lora_adapters"] == "a,b" and series[0].value > before.value
    assert first.granted


@virtual_time
async def test_a_settle_saturates_the_gpu() -> None:
    """After a client left a running generation the upstream still computes it: no grant can be
    made, so the picker should see a full pod, not an idle one."""
    traced = Traced(LONG_LEASE, upstream=FakeUpstream(busy=True))
    flow = traced.flow
    one = await flow.arrive("one", None, "a")
    await flow.arrive("two", None, "a")
    await flow.end(one, ExchangeEnd.CLIENT_LEFT)
    waiting, running, saturation, _ = picture(traced)
    assert (waiting, running, saturation) == (1, 0, 1.0)


@virtual_time
async def test_the_waiting_models_label_is_bounded() -> None:
    """Clients name models: without modelCheck any name waits, and the label stays bounded."""
    traced = Traced({**LONG_LEASE, "upstream": {"modelCheck": "off"}})
    await traced.flow.arrive("running", None, "a")
    order = [f"m{index:02d}" for index in reversed(range(names.MAX_MODEL_LABELS + 5))]
    for index, model in enumerate(order):
        await traced.flow.arrive(f"r{index}", None, model)
    adapters = read_adapters(read(traced), MODELS)
    assert adapters is not None
    assert adapters.waiting == tuple(order[:names.MAX_MODEL_LABELS])  # the first to start waiting
    await traced.flow.cancel(traced.flow.requests["r0"])  # m24 leaves: the 21st comes in
    adapters = read_adapters(read(traced), MODELS)
    assert adapters is not None and adapters.waiting == tuple(order[1:names.MAX_MODEL_LABELS + 1])


@pytest.mark.parametrize(("text", "spec"), [
    ("llamaswap_gpu_saturation", MetricSpec("llamaswap_gpu_saturation", {})),
    (" vllm:num_requests_waiting ", MetricSpec("vllm:num_requests_waiting", {})),
    ("m{model=a, band = batch}", MetricSpec("m", {"model": "a", "band": "batch"})),
    ('nv_trt_llm_request_metrics{request_type="waiting"}', MetricSpec("nv_trt_llm_request_metrics",
                                                                      {"request_type": "waiting"})),
    ('m{a="b,c", d!=e}', MetricSpec("m", {"a": "b,c"})),  # only = selects
    ("m{}", MetricSpec("m", {})),
    ("m{a=b=c}", MetricSpec("m", {"a": "b=c"})),
])
def test_metric_specs_parse_as_the_picker_parses_them(text: str, spec: MetricSpec) -> None:
    assert parse_spec(text) == spec


@pytest.mark.parametrize("text", ["", "{a=b}", "m{a=b", "m}a=b{", "m{a=b}x", "m{a}", "m{=b}", "m{a=}", "9m",
                                  "m{a=b c=d}"])
def test_metric_specs_the_picker_refuses(text: str) -> None:
    with pytest.raises(SpecError):
        parse_spec(text)
