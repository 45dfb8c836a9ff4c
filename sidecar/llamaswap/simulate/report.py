"""Simulation results as rows: a table for people, one JSON document for programs, one JSON
line per request, and a plot of wait against the swept settings (matplotlib, optional)."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import textwrap
from collections.abc import Mapping, Sequence
from typing import Any

from llamaswap.core import BAND_NAMES
from llamaswap.simulate.concurrency import SpeedChoice
from llamaswap.simulate.results import Metrics, Simulation
from llamaswap.simulate.settings import (
    IDLE_KEYS,
    STOPPING_KEYS,
    Settings,
    idling,
    model_slots_text,
    model_ttl_text,
    shown_keys,
    stopping,
)

PLOT_HINT = "pip install 'llamaswap[plot]', or pip install matplotlib"


class PlotUnavailable(RuntimeError):
    pass


@dataclasses.dataclass(frozen=True, slots=True)
class Row:
    settings: Settings
    metrics: Metrics


@dataclasses.dataclass(frozen=True, slots=True)
class Summary:
    """What was replayed, for the header of every output."""

    source: str
    requests: int  # replayed
    not_replayed: Mapping[str, int]
    skipped_lines: int
    malformed: int
    first_problem: str | None
    settings_note: str | None  # e.g. the log changed settings after its first record
    concurrency: SpeedChoice | None = None  # the concurrency speed table the rows ran with
    # The log's `eviction` records, by reason (empty: none; a workload has none).
    recorded_evictions: Mapping[str, int] = dataclasses.field(default_factory=dict)


def row_document(row: Row, *, stops: bool = False, idle: bool = False) -> dict[str, Any]:
    """One row; ``stops``: with the stopping settings and the stops (null: stopping off);
    ``idle``: with the idle time and the idle unloads."""
    m = row.metrics
    values = row.settings.values()
    hidden = (frozenset() if stops else STOPPING_KEYS) | (frozenset() if idle else IDLE_KEYS)
    values = {name: value for name, value in values.items() if name not in hidden}
    if idle:
        values["modelTtl"] = row.settings.model_ttl
    document = {
        "settings": values,
        "requests": m.requests,
        "bands": {band: dataclasses.asdict(stats) for band, stats in m.bands.items()},
        "swaps": m.swaps,
        "reorders": dict(m.reorders),
        "busy_fraction": round(m.busy_fraction, 6),
        "left": m.left,
        "expired": m.expired,
        "rejected": m.rejected,
        "peak_waiting": m.peak_waiting,
        "worst_inversion": dataclasses.asdict(m.inversion) if m.inversion is not None else None,
        "gpus": {name: {"swaps": gpu.swaps, "busy_fraction": round(gpu.busy_fraction, 6)}
                 for name, gpu in m.gpus.items()},
        "evictions": dict(m.evictions),
    }
    if stops:
        document["stops"] = dataclasses.asdict(m.stops) if m.stops is not None else None
    if idle:
        document["idle"] = dataclasses.asdict(m.idle) if m.idle is not None else None
    return document


def document(summary: Summary, swept: Sequence[str], rows: Sequence[Row]) -> dict[str, Any]:
    return {
        "source": summary.source,
        "requests": summary.requests,
        "not_replayed": dict(summary.not_replayed),
        "skipped_lines": summary.skipped_lines,
        "malformed_records": summary.malformed,
        "swept": list(swept),
        "concurrency_speed": summary.concurrency.document() if summary.concurrency is not None else None,
        "recorded_evictions": dict(summary.recorded_evictions),
        "rows": [row_document(row, stops=_stopping(swept, rows), idle=_idling(swept, rows)) for row in rows],
    }


def render_json(summary: Summary, swept: Sequence[str], rows: Sequence[Row], *, indent: int | None = 2) -> str:
    return json.dumps(document(summary, swept, rows), indent=indent) + "\n"


# -- the table -----------------------------------------------------------------------------


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    if value < 10:
        return f"{value:.2f}"
    if value < 100:
        return f"{value:.1f}"
    return f"{value:.0f}"


def _setting(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return f"{value:g}" if isinstance(value, float) else str(value)


def header_lines(summary: Summary) -> list[str]:
    text = f"replayed {summary.requests:,} requests from {summary.source}"
    notes = []
    if summary.not_replayed:
        total = sum(summary.not_replayed.values())
        detail = ", ".join(f"{count} {outcome}" for outcome, count in sorted(summary.not_replayed.items()))
        notes.append(f"{total} not replayed: {detail}")
    if summary.skipped_lines:
        notes.append(f"{summary.skipped_lines} other lines skipped")
    if summary.malformed:
        notes.append(f"{summary.malformed} unusable records skipped, first at {summary.first_problem}")
    lines = [text + (f" ({'; '.join(notes)})" if notes else "")]
    if summary.settings_note:
        lines.append(summary.settings_note)
    return lines


def render_table(summary: Summary, swept: Sequence[str], rows: Sequence[Row]) -> str:
    lines = header_lines(summary)
    # Which concurrency table ran, where it can matter: a table, or a row with several slots.
    concurrency = summary.concurrency
    if concurrency is not None and (concurrency.speed is not None or any(r.settings.most_slots > 1 for r in rows)):
        lines.append(concurrency.describe())
    first = rows[0].settings
    idle = _idling(swept, rows)
    fixed = [name for name in shown_keys([row.settings for row in rows], swept) if name not in swept]
    values = first.values()
    label = "settings" if not swept else "fixed settings"
    lines.append(f"{label}: " + ", ".join(f"{name} {_setting(values[name])}" for name in fixed)
                 + _model_priorities(first) + ("" if "slots" in swept else model_slots_text(first))
                 + (model_ttl_text(first) if idle else ""))
    groups: list[tuple[str, list[str]]] = [("", list(swept))] if swept else []
    for band in BAND_NAMES:
        groups.append((band, ["n", "p50", "p95", "max"]))
    evicting = _evicting(summary, rows)
    stops = _stopping(swept, rows)
    if idle:
        groups.append(("idle", ["unloads", "reloads", "freed"]))
    groups.append(("", ["swaps", *(["evictions"] if evicting else []), *(["stops", "stopped"] if stops else []),
                        "aging", "affinity", "busy", "left", "expired", "rejected", "inversion"]))
    body = []
    for row in rows:
        m = row.metrics
        cells = [_setting(row.settings.values()[name]) for name in swept]
        for band in BAND_NAMES:
            stats = m.bands[band]
            cells += [str(stats.served), _seconds(stats.wait_p50_s), _seconds(stats.wait_p95_s),
                      _seconds(stats.wait_max_s)]
        if idle:
            cells += ([str(m.idle.unloads), str(m.idle.reloads), _seconds(m.idle.freed_s / 3600)]
                      if m.idle is not None else ["-", "-", "-"])
        inversion = "-" if m.inversion is None else f"{_seconds(m.inversion.seconds)} ({m.inversion.request_id})"
        evictions = [str(sum(m.evictions.values()))] if evicting else []
        if stops:
            evictions += [str(m.stops.total), str(m.stops.lines)] if m.stops is not None else ["-", "-"]
        cells += [str(m.swaps), *evictions, str(m.reorders.get("aging", 0)), str(m.reorders.get("swap_affinity", 0)),
                  f"{m.busy_fraction:.3f}", str(m.left), str(m.expired), str(m.rejected), inversion]
        body.append(cells)
    names = [name for _, group in groups for name in group]
    widths = [max(len(name), *(len(cells[i]) for cells in body)) for i, name in enumerate(names)]
    # One line naming the band over its four columns, then the column names.
    top, at = [], 0
    for title, group in groups:
        span = sum(widths[at:at + len(group)]) + 2 * (len(group) - 1)
        top.append(title.center(span, "-") if title else " " * span)
        at += len(group)
    lines.append("")
    lines.append("  ".join(top).rstrip())
    lines.append("  ".join(name.rjust(w) for name, w in zip(names, widths)))
    for cells in body:
        # The inversion names a request: left-aligned, the numbers right-aligned.
        line = "  ".join(cell.rjust(w) for cell, w in zip(cells[:-1], widths[:-1]))
        lines.append((line + "  " + cells[-1]).rstrip())
    if any(len(row.metrics.gpus) > 1 for row in rows):
        lines.append("")
        for number, row in enumerate(rows, 1):
            gpus = row.metrics.gpus
            lines.append((f"row {number}: " if len(rows) > 1 else "per GPU: ") + "; ".join(
                f"{name} swaps {gpu.swaps} busy {gpu.busy_fraction:.3f}{_idle_of(row, name) if idle else ''}"
                for name, gpu in gpus.items()))
    if evicting:
        lines.append("")
        lines += _eviction_lines(summary, rows)
    if stops:
        lines.append("")
        lines += _stop_lines(rows)
    lines.append("")
    lines += textwrap.wrap(_LEGEND + (_EVICTION_LEGEND if evicting else "") + (_STOP_LEGEND if stops else "")
                           + (_IDLE_LEGEND if idle else ""), width=100)
    return "\n".join(lines) + "\n"


_LEGEND = ("n: granted the GPU; p50/p95/max: seconds from arrival to grant; swaps: grants that loaded a model; "
           "aging/affinity: grants that term reordered; busy: GPU held / (last release - first arrival), "
           "the mean of the GPUs'; left: clients that gave up; expired: maxWaitSeconds; rejected: maxQueued; "
           "inversion: the worst priority "
           "inversion in seconds, and its request (see --help)")


_EVICTION_LEGEND = ("; evictions: resident models the replay's grants unloaded to make room for their own "
                    "(maxLoaded above 1), by reason below, beside the log's own")


_STOP_LEGEND = ("; stops: Batch API lines stopped for a higher band (--preempt; -: off), by the stopped "
                "line's band below; stopped: lines stopped at least once")


_IDLE_LEGEND = ("; idle unloads: resident models unloaded after sitting idle their idle time (--idle-unload, "
                "models.<id>.ttl), each also an eviction; reloads: loads of a model on the GPU that idle-unloaded "
                "it, by its first grant there after, where it would have stayed resident; freed: model-hours "
                "they kept models out of memory that would have stayed, up to the last release (docs/simulate.md)")


def _idling(swept: Sequence[str], rows: Sequence[Row]) -> bool:
    """Idle unloads are worth columns: some row may unload idle models, or the idle time is swept."""
    return idling([row.settings for row in rows], swept)


def _idle_of(row: Row, gpu: str) -> str:
    idle = row.metrics.idle
    own = idle.gpus.get(gpu) if idle is not None else None
    return "" if own is None else f" idle unloads {own.unloads} reloads {own.reloads} freed {own.freed_s / 3600:.2f} h"


def _stopping(swept: Sequence[str], rows: Sequence[Row]) -> bool:
    """Stops are worth columns: some row stops lines, or a stopping key is swept."""
    return stopping([row.settings for row in rows], swept)


def _stop_lines(rows: Sequence[Row]) -> list[str]:
    """Each row's stops by the stopped line's band."""
    lines = []
    for number, row in enumerate(rows, 1):
        stops = row.metrics.stops
        text = "stopping off" if stops is None else (
            f"stops {_reasons(stops.bands)}, {stops.lines} line{'s' if stops.lines != 1 else ''} stopped")
        lines.append((f"row {number}: " if len(rows) > 1 else "") + text)
    return lines


def _evicting(summary: Summary, rows: Sequence[Row]) -> bool:
    """Evictions are worth a column: the log recorded some, or a row made some."""
    return bool(summary.recorded_evictions) or any(any(row.metrics.evictions.values()) for row in rows)


def _reasons(counts: Mapping[str, int]) -> str:
    total = sum(counts.values())
    detail = ", ".join(f"{reason} {n}" for reason, n in sorted(counts.items()) if n)
    return f"{total}" + (f" ({detail})" if detail else "")


def _eviction_lines(summary: Summary, rows: Sequence[Row]) -> list[str]:
    """The evictions by reason: the log's (its `eviction` records), then each row's."""
    recorded = f"recorded {_reasons(summary.recorded_evictions)}" if summary.recorded_evictions else "none recorded"
    if len(rows) == 1:
        return [f"evictions: {recorded}; replayed {_reasons(rows[0].metrics.evictions)}"]
    return [f"evictions: {recorded}"] + [f"row {number}: evictions {_reasons(row.metrics.evictions)}"
                                         for number, row in enumerate(rows, 1)]


def _model_priorities(settings: Settings) -> str:
    if not settings.model_priorities:
        return ""
    return ", model priorities " + ", ".join(f"{m} {p:+d}" for m, p in sorted(settings.model_priorities.items()))


# -- per request ---------------------------------------------------------------------------


def request_lines(simulation: Simulation, setting: int | None = None) -> list[str]:
    """One JSON line per request, in arrival order; ``setting`` (the row) only when sweeping."""
    lines = []
    for result in simulation.results:
        request = result.request
        item: dict[str, Any] = {
            "request_id": request.record.request_id,
            "band": request.priority.band.value,
            "priority": request.priority.value,
            "model": request.record.model,
            "start_ms": round(result.start_ns / 1e6, 3) if result.start_ns is not None else None,
            "wait_ms": round(result.wait_ns / 1e6, 3),
            "outcome": result.outcome.value,
            "upstream": result.gpu,  # the GPU it ran on (None: never granted)
            "grant": result.grant,  # its place in the order of grants (None: never granted)
            "model_load": result.model_load,  # its grant loaded its model first
            "evicted": list(result.evicted),  # the resident models its grant unloaded
        }
        if simulation.metrics.stops is not None:  # stopping on: how often it was stopped, its end
            item["stops"] = result.stops
            item["end_ms"] = round(result.release_ns / 1e6, 3) if result.release_ns is not None else None
        if setting is not None:
            item["setting"] = setting
        lines.append(json.dumps(item, separators=(",", ":")))
    return lines


# -- the plot ------------------------------------------------------------------------------


def check_plot_available() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise PlotUnavailable(f"--plot needs matplotlib, which is not installed: {PLOT_HINT}") from exc


def plot(path: str | pathlib.Path, swept: Sequence[str], rows: Sequence[Row]) -> None:
    """Wait p50 and p95 per band against each swept setting, one panel per key; the other swept
    keys stay at their first value (named in the panel's title)."""
    check_plot_available()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if not swept:
        raise ValueError("nothing is swept")
    figure = Figure(figsize=(6.0 * len(swept), 4.5), layout="constrained")
    FigureCanvasAgg(figure)
    first = rows[0].settings.values()
    for panel, key in enumerate(swept):
        axes = figure.add_subplot(1, len(swept), panel + 1)
        others = [other for other in swept if other != key]
        chosen = [row for row in rows if all(row.settings.values()[o] == first[o] for o in others)]
        xs = [_setting(row.settings.values()[key]) if key in ("scheduler", "preempt")
              else row.settings.values()[key]
              for row in chosen]
        for colour, band in enumerate(BAND_NAMES):  # one colour per band: p50 solid, p95 dashed
            for stat, style in (("wait_p50_s", "-o"), ("wait_p95_s", "--s")):
                ys = [getattr(row.metrics.bands[band], stat) for row in chosen]
                if any(y is not None for y in ys):
                    axes.plot(xs, [y if y is not None else float("nan") for y in ys], style, color=f"C{colour}",
                              label=f"{band} {stat[5:8]}")
        axes.set_xlabel(key)
        axes.set_ylabel("wait, arrival to grant (s)")
        title = f"wait against {key}"
        if others:
            title += "\n(" + ", ".join(f"{o} {_setting(first[o])}" for o in others) + ")"
        axes.set_title(title)
        axes.grid(True, alpha=0.3)
        axes.legend(fontsize="small")
    figure.savefig(str(path))
