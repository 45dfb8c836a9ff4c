"""The metric instruments, created once on the one MeterProvider.

Names. Every instrument is created under its final Prometheus name: counters already end in
`_total`, durations in `_seconds`. That gives the same name on every path:

- the admin `GET /metrics` text (our own renderer) prints the names verbatim;
- over OTLP the receiver sees exactly these names;
- the OpenTelemetry collector's Prometheus exporter (and Prometheus's own OTLP receiver)
  translate with prometheus/otlptranslator. With metric suffixes on (the default) a monotonic
  sum gets `_total` only after any existing `total` token is removed, so
  `llamaswap_scheduler_dispatched_total` stays `llamaswap_scheduler_dispatched_total`, and a
  unit suffix is added only when the name lacks it (`s` -> `seconds`, already present). With
  suffixes off the name passes through unchanged.

Units are chosen so no suffix is ever added: `s` on names that end in `_seconds`, curly-brace
annotations such as `{request}` (dropped by the translator) on counts, and no unit on the busy
gauge and the error ratio — the unit `1` would make the translator append `_ratio`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from opentelemetry.metrics import CallbackOptions, Meter, Observation

from llamaswap.core import Band, EvictReason, Outcome, ReorderCause
from llamaswap.runtime.kept import KeptEventKind
from llamaswap.telemetry.histograms import Histograms

QUEUE_DEPTH = "llamaswap_scheduler_queue_depth"
QUEUE_OLDEST_WAIT = "llamaswap_scheduler_queue_oldest_wait_seconds"
DISPATCHED = "llamaswap_scheduler_dispatched_total"
REORDERS = "llamaswap_scheduler_reorders_total"
QUEUE_WAIT = "llamaswap_scheduler_queue_wait_seconds"
RUN = "llamaswap_scheduler_run_seconds"
SWAPS = "llamaswap_scheduler_swaps_total"
LOADS = "llamaswap_scheduler_loads_total"
REQUESTS = "llamaswap_requests_total"
UNPARSEABLE = "llamaswap_priority_unparseable_total"
ABSENT = "llamaswap_priority_absent_total"
GPU_BUSY = "llamaswap_gpu_busy"
GPU_SLOTS = "llamaswap_gpu_slots"
GPU_SLOTS_BUSY = "llamaswap_gpu_slots_busy"
WATCHDOG = "llamaswap_watchdog_fired_total"
MODEL_SWAP = "llamaswap_model_swap_seconds"
MODEL_RUN = "llamaswap_model_run_seconds"
ESTIMATE_RATIO = "llamaswap_estimate_wait_ratio"
SETTLE = "llamaswap_upstream_settle_seconds"
REQUEST_ID_REPLACED = "llamaswap_request_id_replaced_total"
MODEL_LABEL_OTHER = "llamaswap_model_label_other_total"
# For an endpoint picker (llm-d's router, the InferencePool's EPP): unlabelled, one series each,
# so a metric spec that names the family reads the pod's whole figure (the picker takes the
# first series that matches a spec; it cannot sum the per-band depth).
WAITING = "llamaswap_scheduler_waiting_requests"
SATURATION = "llamaswap_gpu_saturation"
MODELS_INFO = "llamaswap_loaded_models_info"
# The LoRA info gauge's label names (vLLM's `vllm:lora_requests_info`, which pickers parse).
RUNNING_ADAPTERS = "running_lora_adapters"
WAITING_ADAPTERS = "waiting_lora_adapters"
MAX_ADAPTERS = "max_lora"
# The picker's four gauges, in the order of its engine config (queued, running, KV use, LoRA).
PICKER = (WAITING, GPU_SLOTS_BUSY, SATURATION, MODELS_INFO)
KEPT_PLACES = "llamaswap_kept_places_total"
PREEMPTIONS = "llamaswap_preemptions_total"
# Per upstream (issue 27: several GPUs behind one queue), label `upstream`: new series beside the
# node-wide ones above, which keep their names and labels (a dashboard over one GPU reads on).
UPSTREAM_SLOTS = "llamaswap_upstream_slots"
UPSTREAM_SLOTS_BUSY = "llamaswap_upstream_slots_busy"
UPSTREAM_BUSY = "llamaswap_upstream_busy"
UPSTREAM_MODEL = "llamaswap_upstream_loaded_model_info"
UPSTREAM_DISPATCHED = "llamaswap_upstream_dispatched_total"
UPSTREAM_SWAPS = "llamaswap_upstream_swaps_total"
UPSTREAM_LOADS = "llamaswap_upstream_loads_total"
# Several models resident on one GPU (issue 37, `maxLoaded`): how many are, and the models a
# grant unloaded to make room for its own (`Decision.evicts`), by why each was the one to go.
MODELS_RESIDENT = "llamaswap_models_resident"
MODEL_EVICTIONS = "llamaswap_model_evictions_total"
PER_UPSTREAM = (UPSTREAM_SLOTS, UPSTREAM_SLOTS_BUSY, UPSTREAM_BUSY, UPSTREAM_MODEL, UPSTREAM_DISPATCHED, UPSTREAM_SWAPS,
                UPSTREAM_LOADS, MODELS_RESIDENT, MODEL_EVICTIONS)

# The four series the specification names (docs: request-priority.md, Observability).
SPECIFIED = (QUEUE_DEPTH, QUEUE_OLDEST_WAIT, DISPATCHED, REORDERS)
ALL = (QUEUE_DEPTH, QUEUE_OLDEST_WAIT, DISPATCHED, REORDERS, QUEUE_WAIT, RUN, SWAPS, LOADS, REQUESTS, UNPARSEABLE,
       ABSENT, GPU_BUSY, GPU_SLOTS, GPU_SLOTS_BUSY, WATCHDOG, MODEL_SWAP, MODEL_RUN, ESTIMATE_RATIO, SETTLE,
       REQUEST_ID_REPLACED, MODEL_LABEL_OTHER, WAITING, SATURATION, MODELS_INFO, KEPT_PLACES, PREEMPTIONS,
       *PER_UPSTREAM)

# The `model` label takes at most this many names; the rest share OTHER_MODEL (a client picks
# the name, up to 512 characters: unbounded series otherwise).
MAX_MODEL_LABELS = 20
OTHER_MODEL = "other"

# Seconds, from a quick local request to a day-long batch wait.
QUEUE_WAIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1200, 1800,
                      3600, 7200, 14400, 28800, 43200, 86400)
RUN_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200,
               14400, 28800, 43200)
SWAP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600)
# Estimated / actual wait: 1 is exact, 0.5 said half as long, 2 twice as long. (A histogram
# takes no negative values, so the ratio, not the difference.)
ESTIMATE_RATIO_BUCKETS = (0.1, 0.25, 0.5, 0.75, 0.9, 1.1, 1.25, 1.5, 2, 4, 10)

# Written once: the page at /metrics (through the SDK) and the picker's own page print them.
DESCRIPTIONS = {
    GPU_SLOTS_BUSY: "Slots held by running grants, over every upstream.",
    WAITING: "Requests waiting for the GPU, all bands together.",
    SATURATION: "Busy slots / the slots of the models in effect, over every upstream; an upstream where no grant "
                "can be made because it finishes an abandoned or adopted generation counts as full.",
    MODELS_INFO: f"One series in the shape of vLLM's LoRA info gauge, for endpoint pickers: {RUNNING_ADAPTERS} the "
                 f"loaded models (each upstream's, comma-separated, in the configured order), {WAITING_ADAPTERS} the "
                 f"models of the waiting requests (comma-separated, in the order they started waiting, at most "
                 f"{MAX_MODEL_LABELS}), {MAX_ADAPTERS} the models the pod holds at once (each upstream's maxLoaded, "
                 "summed); the value is when the labels last changed (Unix seconds).",
}

Callback = Callable[[CallbackOptions], Iterable[Observation]]
Labels = Mapping[str, str]
SeriesKey = tuple[tuple[str, str], ...]


def series_key(labels: Labels | None) -> SeriesKey:
    """A Tally series' key: its labels' (name, value) pairs, in their order."""
    return tuple(labels.items()) if labels else ()


# Resolved once, not per count: a request's band and outcome as a label value and as a Tally
# series' key (`Band.value` alone costs about 0.1 us, the key's dict and tuple 0.2 more).
BAND_LABELS = {band: band.value for band in Band}
BAND_SERIES = {band: series_key({"band": band.value}) for band in Band}
OUTCOME_SERIES = {outcome: series_key({"outcome": outcome.value}) for outcome in Outcome}


class Tally:
    """A counter kept as plain integers and reported through an ObservableCounter: an add costs a
    dict update instead of the SDK's aggregation per call (about 12 us each, several per request).
    The same Sum, monotonic and cumulative, reaches Prometheus and OTLP. Collections on another
    thread copy the counts in one step (a C-level copy under the GIL)."""

    def __init__(self, meter: Meter, name: str, *, unit: str, description: str,
                 series: Iterable[Labels] = ({},)) -> None:
        # Every series exists from the start, at 0: a query never misses a band with no traffic.
        self._counts: dict[SeriesKey, int] = {series_key(labels): 0 for labels in series}
        meter.create_observable_counter(name, [self._observe], unit=unit, description=description)

    def declare(self, labels: Labels) -> None:
        """A series that exists from now on, at 0 until counted."""
        self._counts.setdefault(series_key(labels), 0)

    def add(self, amount: int, attributes: Labels | None = None) -> None:
        key = tuple(attributes.items()) if attributes else ()
        self._counts[key] = self._counts.get(key, 0) + amount

    def add_to(self, key: SeriesKey, amount: int = 1) -> None:
        """`add` to the series of ``key`` (`series_key` of its labels), for callers that resolve
        their labels' key once rather than per count."""
        counts = self._counts
        counts[key] = counts.get(key, 0) + amount

    def _observe(self, options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(count, dict(key)) for key, count in list(self._counts.items())]


class ModelLabels:
    """The `model` label's values: the first MAX_MODEL_LABELS models measured keep their name (with
    modelCheck the models the upstream serves, the ones in use), every later one is OTHER_MODEL."""

    def __init__(self, limit: int = MAX_MODEL_LABELS) -> None:
        self._limit = limit
        self._named: set[str] = set()

    def label(self, model: str) -> str | None:
        """The model's own name, or None when it falls under OTHER_MODEL."""
        if model in self._named:
            return model
        if len(self._named) < self._limit:
            self._named.add(model)
            return model
        return None


class Instruments:
    """Gauges (callbacks) and Tallies on the SDK's meter; histograms kept plain in ``histograms``."""

    def __init__(self, meter: Meter, histograms: Histograms, *, queue_depth: Callback, oldest_wait: Callback,
                 gpu_busy: Callback, gpu_slots: Callback, gpu_slots_busy: Callback, waiting: Callback,
                 saturation: Callback, models_info: Callback, upstream_slots: Callback, upstream_slots_busy: Callback,
                 upstream_busy: Callback, upstream_model: Callback, models_resident: Callback) -> None:
        meter.create_observable_gauge(
            QUEUE_DEPTH, [queue_depth], unit="{request}", description="Requests waiting for the GPU, by band.")
        meter.create_observable_gauge(
            QUEUE_OLDEST_WAIT, [oldest_wait], unit="s",
            description="How long the longest-waiting request of the band has waited (0 when none waits).")
        meter.create_observable_gauge(
            GPU_BUSY, [gpu_busy],
            description="1 while the GPU is busy (a grant holds it, or the upstream finishes an abandoned "
                        "generation), else 0.")
        meter.create_observable_gauge(
            GPU_SLOTS, [gpu_slots], unit="{slot}",
            description="Generations of the loaded model the GPU may run at once (upstream.slots, models.<id>.slots).")
        meter.create_observable_gauge(
            GPU_SLOTS_BUSY, [gpu_slots_busy], unit="{slot}", description=DESCRIPTIONS[GPU_SLOTS_BUSY])
        meter.create_observable_gauge(WAITING, [waiting], unit="{request}", description=DESCRIPTIONS[WAITING])
        meter.create_observable_gauge(SATURATION, [saturation], description=DESCRIPTIONS[SATURATION])
        meter.create_observable_gauge(MODELS_INFO, [models_info], description=DESCRIPTIONS[MODELS_INFO])
        meter.create_observable_gauge(
            UPSTREAM_SLOTS, [upstream_slots], unit="{slot}",
            description="Generations of its loaded model an upstream may run at once, by upstream.")
        meter.create_observable_gauge(
            UPSTREAM_SLOTS_BUSY, [upstream_slots_busy], unit="{slot}",
            description="Slots of an upstream held by running grants, by upstream.")
        meter.create_observable_gauge(
            UPSTREAM_BUSY, [upstream_busy],
            description="1 while an upstream is busy (a grant holds it, or it finishes an abandoned or adopted "
                        "generation), else 0, by upstream.")
        meter.create_observable_gauge(
            UPSTREAM_MODEL, [upstream_model],
            description="1 for each model the scheduler knows resident on the upstream (model=\"\": none known), "
                        "by upstream and model.")
        meter.create_observable_gauge(
            MODELS_RESIDENT, [models_resident], unit="{model}",
            description="Models the scheduler knows resident (loaded) on the upstream, by upstream.")
        bands = [{"band": band.value} for band in Band]
        self.dispatched = Tally(meter, DISPATCHED, unit="{request}", description="Requests granted the GPU, by band.",
                                series=bands)
        self.reorders = Tally(
            meter, REORDERS, unit="{dispatch}",
            description="Dispatches where aging or swap affinity changed which request went next, by band of the "
                        "winner and reason.",
            series=[{"band": band.value, "reason": cause.value} for band in Band for cause in ReorderCause])
        self.queue_wait = histograms.histogram(
            QUEUE_WAIT, unit="s", description="Time from arrival to grant of dispatched requests, by band.",
            bounds=QUEUE_WAIT_BUCKETS, labels=("band",))
        self.run = histograms.histogram(
            RUN, unit="s", description="Time from grant to release (the GPU held), by band.",
            bounds=RUN_BUCKETS, labels=("band",))
        self.upstream_dispatched = Tally(meter, UPSTREAM_DISPATCHED, unit="{request}",
                                         description="Requests granted an upstream, by upstream.", series=())
        self.upstream_swaps = Tally(meter, UPSTREAM_SWAPS, unit="{dispatch}",
                                    description="Dispatches that replaced an upstream's loaded model with another one, "
                                                "by upstream.", series=())
        self.upstream_loads = Tally(meter, UPSTREAM_LOADS, unit="{dispatch}",
                                    description="Dispatches that loaded a model on an upstream where none was known to "
                                                "be loaded, by upstream.", series=())
        reasons = ", ".join(reason.value for reason in EvictReason)
        self.evictions = Tally(meter, MODEL_EVICTIONS, unit="{model}",
                               description="Resident models unloaded to make room for a granted request's model, by "
                                           f"upstream and reason ({reasons}).", series=())
        self.swaps = Tally(meter, SWAPS, unit="{dispatch}",
                           description="Dispatches that replaced the loaded model with another one (a swap).")
        self.loads = Tally(meter, LOADS, unit="{dispatch}",
                           description="Dispatches that loaded a model while none was known to be loaded (the first "
                                       "load, or after a failure or a stop).")
        self.requests = Tally(meter, REQUESTS, unit="{request}", description="Requests by how they ended (outcome).",
                              series=[{"outcome": outcome.value} for outcome in Outcome])
        self.unparseable = Tally(
            meter, UNPARSEABLE, unit="{request}",
            description="Requests whose X-LlamaSwap-Priority header could not be parsed (treated as 0).")
        self.absent = Tally(
            meter, ABSENT, unit="{request}",
            description="Requests without an X-LlamaSwap-Priority header, or with an empty one (treated as 0).")
        self.watchdog = Tally(meter, WATCHDOG, unit="{request}",
                              description="Grants released by the maxRunSeconds watchdog.")
        self.model_swap = histograms.histogram(
            MODEL_SWAP, unit="s",
            description="For dispatches that had to load their model (a swap or a first load): from the request "
                        "reaching the upstream to its first response byte, by model. The cost swap affinity "
                        "avoids.",
            bounds=SWAP_BUCKETS, labels=("model",))
        self.model_run = histograms.histogram(
            MODEL_RUN, unit="s", description="Grant to release, by model.", bounds=RUN_BUCKETS, labels=("model",))
        self.estimate_ratio = histograms.histogram(
            ESTIMATE_RATIO,
            description="For dispatched requests: the wait estimated at arrival / the actual wait (an actual "
                        "wait below 0.1 s counts as 0.1 s), by band. 1 is exact.",
            bounds=ESTIMATE_RATIO_BUCKETS, labels=("band",))
        self.request_id_replaced = Tally(
            meter, REQUEST_ID_REPLACED, unit="{request}",
            description="Requests whose x-request-id was longer than 128 characters and was replaced by Envoy's "
                        "own id for the request.")
        self.model_label_other = Tally(
            meter, MODEL_LABEL_OTHER, unit="{request}",
            description=f"Measurements recorded under model=\"{OTHER_MODEL}\": the model label keeps "
                        f"{MAX_MODEL_LABELS} model names, the first measured.")
        self.model_labels = ModelLabels()
        self.kept_places = Tally(
            meter, KEPT_PLACES, unit="{place}",
            description="Places kept for a client's retry (routing.retryGraceSeconds), by event: kept (a waiting "
                        "request's client left), taken_over (its retry took the place), expired (nobody did).",
            series=[{"event": kind.value} for kind in KeptEventKind])
        self.preemptions = Tally(
            meter, PREEMPTIONS, unit="{stop}",
            description="Running Batch API lines stopped at a token for a request of a higher band that could "
                        "start nowhere, by the band of the line stopped (it resumes where it stopped).",
            series=[{"band": band.value} for band in Band])
        self.settle = histograms.histogram(
            SETTLE, unit="s",
            description="Time the GPU waited for the upstream to become idle before the next grant, by reason "
                        "(abandoned, startup, adopted) and result (idle, stopped, timeout, unanswered, unsupported, "
                        "ended, lapsed).",
            bounds=RUN_BUCKETS, labels=("reason", "result"))
