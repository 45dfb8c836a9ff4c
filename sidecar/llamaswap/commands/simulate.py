"""`llamaswap simulate`: replay recorded (or synthetic) traffic through the real scheduler.

Each request of the activity log arrives at its recorded time with its priority and model and
holds the GPU for its recorded run (plus settle) time, plus or minus its model's measured swap
cost when the simulated order changes whether it needs a model load. Requests that never ran
take their model's expected run time; clients that gave up keep their patience; expired and
rejected requests wait as the simulated settings let them. Records of rejected_unknown_model,
internal_error and shutdown are not replayed. Costs are measured from the log's served requests
with the sidecar's own estimator, per GPU where the log names upstreams. Time is virtual: a day
of traffic replays in seconds. Try other settings with the flags, or several at once with
--sweep (every combination runs, one row each).

Settings, later ones win: the log's first settings record (the defaults without one), -c FILE,
the single flags, --sweep.

Slots: --slots N (else the log's or -c FILE's, else 1; sweepable) lets N generations of the
loaded model run at once, as the scheduler grants them; --reserved-slots R keeps R of them for
the interactive band. While n run, each progresses at speed(n)/n of its solo rate, speed(n)
being the aggregate throughput of n at once relative to one: measured from the log where
generations overlapped (from the grant times, each generation's work its max_tokens where
recorded, else one unit per request; least squares), or --concurrency-speed 1:1,2:1.8,4:3.1,
which overrides it; neither: n at once run as fast as one each. Levels between the points are
interpolated, beyond the last flat. Recorded runs are first turned into solo time by the same
table. The report's "concurrency speed" line says which table ran and where it came from.

Columns, per band (interactive, normal, batch): n granted the GPU, wait p50 / p95 / max in
seconds from arrival to grant; then swaps (grants that loaded a model), grants reordered by
aging and by swap affinity, GPU busy fraction (GPU held / (last release - first arrival)),
clients that left (patience), expired (maxWaitSeconds), rejected (maxQueued), and the worst
priority inversion.

Priority inversion: the inversion time of a request R is the GPU time of the grants made while
R waited to requests that arrived after R with a lower priority than R's (the priority the
scheduler orders by: with fifo, plus the model's); a grant still running when R left the queue
(granted, gave up, expired) counts up to that moment. The worst inversion is the request with
the largest inversion time (shown with its seconds). A lower-priority request that was already
running, or arrived before R, is not an inversion; under serial settings inversions come from
swap affinity (a later, lower request with the loaded model goes first).

Resident models: --max-loaded N (sweepable: --sweep maxLoaded=1,3) lets each GPU keep N models
loaded at once, as `upstream.maxLoaded` does (-c FILE's maxLoaded, pinned models and memory
budgets apply without the flag, else those the log's settings record says each upstream ran
with; with it, its N on every GPU, the pins and budgets kept). The log's eviction records are
not replayed: the replay makes its own, counted by reason beside the recorded ones.

GPUs: --gpus N (sweepable: --sweep gpus=1,2,4) puts N upstreams behind the one queue, named
gpu0..gpuN-1, each with the slots above, its own loaded model, swaps and concurrency; the
scheduler's node rule places each request. A log whose grants record several upstreams replays
with those (by name) unless --gpus says otherwise. Each GPU runs with its own measured run
times and swap costs, the node's where it has none (a GPU of --gpus named as no recorded
one). The table then gives each GPU's swaps and busy fraction below the rows (busy in the
row: their mean).

Many nodes: --pods N (with --gpus G per pod) replays the traffic over N pods three ways: routed
by an endpoint picker's rule (least queued, with model affinity), by round-robin, and as one
queue over every GPU; one row each with the interactive p95 wait, swaps, loads and the GPU time
idle while work waited (docs/kubernetes.md).

Stopping Batch API lines: --preempt (sweepable: --sweep preempt=off,on) lets the scheduler stop
a running line (a record with batch_line: true; a workload class with stoppable: true) for a
request of a higher band that starts nowhere (core/preemption.py); the line keeps the work it
did, is sent again at once to take back its first arrival and order, and runs what it had left,
plus 5% of the work done to read its kept tokens again. --min-run S (sweepable: minRun) lets a
line run S seconds before it is stopped. The rows then count the stops, by the stopped line's
band, and the lines stopped at least once.

Idle unloads: --idle-unload S (sweepable: --sweep idleUnload=0,60,600) unloads a resident model
once it has sat idle S seconds, as `upstream.idleUnloadSeconds` does on every GPU (-c FILE's
models.<id>.ttl and idle times apply without the flag; with it, a model's own ttl still wins).
Every GPU is taken as llama-server's router, which can unload a model (but for -c FILE's upstreams
whose command starts a single-model llama-server, which cannot), and the unload as instant.
The rows then count the idle unloads, the reloads (loads of a model on the GPU that unloaded it,
by its first grant there after, where it would have stayed resident) and the model-hours freed
(docs/simulate.md).

Synthetic traffic: --workload FILE.yaml instead of --activity-log, e.g.

  duration: 3600
  seed: 1
  classes:
    - {name: chat, rate: 0.2, priority: interactive, models: {qwen3: 3, gemma3: 1},
       run: {lognormal: {median: 4, sigma: 0.6}}, patience: {uniform: [30, 120]}, swap: 8}
    - {name: nightly, rate: 0.01, priority: batch, models: qwen3, run: {uniform: [60, 600]},
       stoppable: true}

(distributions: {fixed: S}, {uniform: [A, B]}, {exponential: MEAN}, {lognormal: {median: S, sigma: X}}).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import logging
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any, TextIO

from llamaswap.core import Policy
from llamaswap.core.estimate import Figures
from llamaswap.simulate import report
from llamaswap.simulate.concurrency import (
    ConcurrencySpeed,
    ConcurrencySpeedError,
    Measurement,
    RecordedConcurrency,
    SpeedChoice,
    as_solo,
    measure,
)
from llamaswap.simulate.engine import NOT_REPLAYED, measure_costs, prepare, simulate
from llamaswap.simulate.pods import Routing, render_pods_json, render_pods_table, simulate_pods
from llamaswap.simulate.records import Activity, RequestRecord, read_activity, recorded_gpus, single_model
from llamaswap.simulate.settings import (
    KEYS,
    Settings,
    SettingsError,
    combinations,
    fit_reserved,
    override,
    parse_sweep,
)
from llamaswap.simulate.workload import WorkloadError, costs as workload_costs, generate, load_workload

_log = logging.getLogger(__name__)

EXIT_USAGE = 2
# Used when the configuration has no `estimates` section (the values of its defaults).
_ESTIMATE_DEFAULTS = (10.0, 5.0, 50)


class UsageError(Exception):
    """Bad arguments or input: each message printed as ``error: ...``, exit status 2."""

    def __init__(self, *messages: str) -> None:
        super().__init__("; ".join(messages))
        self.messages = messages


def add_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:  # type: ignore[type-arg]
    """Register `simulate` on the `llamaswap` subcommands."""
    parser = commands.add_parser("simulate", help="replay recorded traffic through the scheduler with other settings",
                                 description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--activity-log", "--activity", dest="activity", metavar="FILE",
                        help="the sidecar's activity log (JSON lines; what `up --activity-log` writes)")
    source.add_argument("--workload", metavar="FILE.yaml", help="synthetic traffic described in YAML (see above)")
    parser.add_argument("-c", "--config", metavar="FILE", help="a llamaswap configuration whose settings apply")
    parser.add_argument("--scheduler", metavar="serial|fifo", help="the scheduler")
    parser.add_argument("--aging-divisor", metavar="S", help="seconds of waiting per priority point (0: no aging)")
    parser.add_argument("--swap-affinity-bonus", metavar="N", help="0..99 (0: off)")
    parser.add_argument("--max-queued", metavar="N", help="waiting requests before rejections (0: unlimited)")
    parser.add_argument("--max-wait", metavar="S", help="seconds of waiting before expiry (0: forever)")
    parser.add_argument("--slots", metavar="N",
                        help="generations of the loaded model at once, every model (default: the log's or "
                             "-c FILE's, else 1)")
    parser.add_argument("--reserved-slots", metavar="N", help="of the slots, kept for the interactive band")
    parser.add_argument("--gpus", metavar="N",
                        help="upstreams (GPUs) behind the one queue, gpu0..gpuN-1, each with the slots (default: "
                             "the log's recorded upstreams, else -c FILE's, else 1)")
    parser.add_argument("--max-loaded", metavar="N",
                        help="models each GPU keeps resident at once, evicting by what the queue needs least (1: "
                             "one model at a time; default: -c FILE's maxLoaded, else the log's, else 1; sweepable)")
    parser.add_argument("--preempt", action="store_true",
                        help="the Batch API lines (batch_line in the log, stoppable in a workload) may be stopped "
                             "for a higher band and resumed where they stopped (sweepable: preempt=off,on)")
    parser.add_argument("--min-run", metavar="S",
                        help="seconds a line runs before it may be stopped (with --preempt; default 0)")
    parser.add_argument("--idle-unload", metavar="S",
                        help="seconds a resident model may sit idle before it is unloaded, every GPU (0: never; "
                             "default: -c FILE's idle times, else 0; sweepable: idleUnload)")
    parser.add_argument("--pods", metavar="N", type=_pods_flag,
                        help="many nodes: N pods of --gpus GPUs each, the workload routed to them by an endpoint "
                             "picker's rule (least queued, with model affinity), by round-robin, and as one queue "
                             "over every GPU; one row each (see docs/kubernetes.md)")
    parser.add_argument("--concurrency-speed", type=_speed_flag, metavar="N:SPEED,...",
                        help="aggregate throughput of N at once relative to one, e.g. 1:1,2:1.8,4:3.1 "
                             "(default: measured from the log, else linear)")
    parser.add_argument("--sweep", action="append", default=[], metavar="KEY=V1,V2,...",
                        help="run every value (repeatable: every combination); keys "
                             + ", ".join(KEYS))
    parser.add_argument("--format", choices=("table", "json"), default="table", help="output (default table)")
    parser.add_argument("--requests", nargs="?", const="-", metavar="FILE",
                        help="also one JSON line per simulated request (request_id, band, priority, model, "
                             "start_ms from the first arrival, wait_ms, outcome, upstream, grant: its place "
                             "in the order of grants, model_load, evicted), to FILE or, "
                             "without one, to stdout before the summary (which is then one JSON line with "
                             "--format json)")
    parser.add_argument("--plot", metavar="FILE.png",
                        help="draw wait p50/p95 per band against each swept setting, one panel per "
                             f"key (needs matplotlib: {report.PLOT_HINT})")
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace, *, out: TextIO | None = None, err: TextIO | None = None) -> int:
    out = out or sys.stdout
    err = err or sys.stderr
    try:
        return _run(args, out, err)
    except UsageError as exc:
        for message in exc.messages:
            err.write(f"error: {message}\n")
        return EXIT_USAGE


def _run(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    try:
        sweeps = [parse_sweep(text) for text in args.sweep]
        combinations(_defaults(), sweeps)  # refuses a key swept twice, before any work
    except SettingsError as exc:
        raise UsageError(str(exc)) from None
    if args.pods is not None and (sweeps or args.plot or args.requests):
        raise UsageError("--pods compares three routings for one setting: drop --sweep, --plot and --requests")
    if args.pods is not None and (args.preempt or args.min_run is not None):
        raise UsageError("--pods does not replay stopped lines: drop --preempt and --min-run")
    if args.pods is not None and args.idle_unload is not None:
        raise UsageError("--pods does not replay idle unloads: drop --idle-unload")
    if args.plot:
        if not sweeps:
            raise UsageError("--plot draws wait against a swept setting: add --sweep KEY=V1,V2,...")
        try:
            report.check_plot_available()
        except report.PlotUnavailable as exc:
            raise UsageError(str(exc)) from None

    config = _load_config(args.config, err) if args.config else None
    started = time.perf_counter()
    notes: list[str] = []
    peak = 0
    if args.activity:
        with _collector_paused():
            activity = _read_activity(args.activity)
        records: Sequence[RequestRecord] = activity.requests
        base, note = _recorded_settings(activity, configured=config is not None)
        named = recorded_gpus(records)
        if named:  # the log's grants ran on these: the replay has them
            base = dataclasses.replace(base, gpus=len(named), named_gpus=named)
        recorded = RecordedConcurrency.of(records)
        peak = recorded.peak
        measurement: Measurement | None = measure(records, recorded)
        concurrency = SpeedChoice.choose(args.concurrency_speed, measurement)
        if concurrency.speed is not None:
            records = as_solo(records, recorded, concurrency.speed)
        run_s, swap_s, samples = _estimates(config)
        costs: Figures = measure_costs(records, default_run_s=run_s, default_swap_s=swap_s, samples=samples)
        source = args.activity
    else:
        try:
            workload = load_workload(args.workload)
        except WorkloadError as exc:
            raise UsageError(*exc.problems) from None
        records = generate(workload)
        if not records:
            raise UsageError(f"{args.workload}: the workload produced no arrivals (raise duration or rate)")
        activity = Activity((), tuple(records), len(records), 0, 0, None)
        base, note = _defaults(), None
        concurrency = SpeedChoice.choose(args.concurrency_speed, None)
        costs = workload_costs(workload, list(records))
        source = args.workload
    if note:
        notes.append(note)
    if config is not None:
        # models.<id>.slots as the sidecar applied them: on a single-model upstream every entry
        # describes its one model, whatever the id (`config.model_key`).
        configured = Settings.from_policy(_node_policy(config, single_model(records), base.slots))
        if configured.gpus == 1 and base.gpus > 1:  # a configuration of one upstream keeps the log's
            configured = dataclasses.replace(configured, gpus=base.gpus, named_gpus=base.named_gpus)
        base = configured
    try:
        base = override(base, {"scheduler": args.scheduler, "agingDivisor": args.aging_divisor,
                               "swapAffinityBonus": args.swap_affinity_bonus, "maxQueued": args.max_queued,
                               "maxWaitSeconds": args.max_wait, "slots": args.slots,
                               "reservedSlots": args.reserved_slots, "gpus": args.gpus,
                               "maxLoaded": args.max_loaded, "preempt": "on" if args.preempt else None,
                               "minRun": args.min_run, "idleUnload": args.idle_unload})
        settings = combinations(base, sweeps)
        explicit = args.reserved_slots is not None or any(s.key.name == "reservedSlots" for s in sweeps)
        settings, lowered = fit_reserved(settings, explicit=explicit)
        policies = [setting.policy() for setting in settings]
    except SettingsError as exc:
        raise UsageError(str(exc)) from None
    if lowered:
        notes.append(lowered)
    preempting = any(setting.preempt for setting in settings)
    if not preempting and (args.min_run is not None or any(s.key.name == "minRun" for s in sweeps)):
        raise UsageError("minRun is how long a stopped line runs first: add --preempt or --sweep preempt=off,on")
    if preempting and not any(record.batch_line for record in records):
        notes.append("--preempt: no request is a Batch API line (batch_line in the log, stoppable in the "
                     "workload): nothing is stopped")
    most = max(setting.most_slots for setting in settings)
    if peak > most:
        notes.append(f"the log ran up to {peak} requests at once, the simulation {most} at most per upstream "
                     "(--slots or --sweep slots=... to give more)")

    if args.pods is not None:
        replayed = [record for record in records if record.outcome not in NOT_REPLAYED]
        if not replayed:
            raise UsageError(f"{source}: no request can be replayed")
        results = [simulate_pods(replayed, policies[0], costs, pods=args.pods, gpus=settings[0].gpus, routing=routing)
                   for routing in Routing]
        out.write(render_pods_json(source, results) if args.format == "json" else render_pods_table(source, results))
        return 0
    with _collector_paused():
        replay = prepare(records)
    if not replay.requests:
        raise UsageError(f"{source}: no request can be replayed "
                         f"({', '.join(f'{n} {o}' for o, n in replay.not_replayed.items())})")
    one_model = _one_model_gpus(config)
    if one_model and any(setting.idles and len(setting.configured) == setting.gpus for setting in settings):
        notes.append(f"no idle unload on {', '.join(sorted(one_model))}: a single-model llama-server (-m in the "
                     "command) cannot unload its model, only the router can")
    rows, simulations = [], []
    with _long_lived():
        for setting, policy in zip(settings, policies):
            # (GPUs named by --gpus N are not the configured ones: each is taken as a router.)
            unloading = (frozenset(gpu.name for gpu in policy.gpus if gpu.name not in one_model)
                         if one_model and len(setting.configured) == setting.gpus else None)
            simulation = simulate(replay, policy, costs, concurrency_speed=concurrency.speed,
                                  preempt=setting.preempt, idle_gpus=unloading)
            simulations.append(simulation)
            rows.append(report.Row(setting, simulation.metrics))
    _log.debug("simulated %d settings over %d requests in %.3f s", len(settings), len(replay.requests),
               time.perf_counter() - started)

    summary = report.Summary(source, len(replay.requests), replay.not_replayed, activity.skipped,
                             activity.malformed, activity.first_problem, "; ".join(notes) or None, concurrency,
                             activity.evictions)
    swept = [sweep.key.name for sweep in sweeps]
    requests_to_stdout = args.requests == "-"
    if args.requests:
        _write_requests(args.requests, simulations, out if requests_to_stdout else None)
    if args.format == "json":
        out.write(report.render_json(summary, swept, rows, indent=None if requests_to_stdout else 2))
    else:
        out.write(report.render_table(summary, swept, rows))
    if args.plot:
        try:
            report.plot(args.plot, swept, rows)
        except OSError as exc:
            raise UsageError(f"cannot write the plot to {args.plot}: {exc.strerror or exc}") from None
        out.flush()  # the table first, then the note about the plot
        err.write(f"plot written to {args.plot}\n")
    return 0


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Reading a log and preparing its replay make a record per line and no reference cycle: the
    cyclic collector is paused meanwhile, as its passes would walk every record made so far
    (reference counting frees what is dropped, as ever)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


# The young generation's threshold while replays run: a replay makes objects that are freed by
# reference counting at once or live to its end, so a young pass rarely finds garbage.
_REPLAY_YOUNG_THRESHOLD = 50_000


@contextlib.contextmanager
def _long_lived() -> Iterator[None]:
    """The log's records and the replay's requests live for every replay: set apart from the
    cyclic collector (`gc.freeze`) while the replays run, so its full passes stop walking them,
    and its young passes come less often; both handed back after. (At 100,000 requests the
    collector took a tenth of a replay: bench/README.)"""
    threshold = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(_REPLAY_YOUNG_THRESHOLD, *threshold[1:])
    try:
        yield
    finally:
        gc.set_threshold(*threshold)
        gc.unfreeze()


def _node_policy(config: Any, single: str | None, recorded_slots: int) -> Policy:
    """The scheduler's policy over the configured node, as the runtime builds it
    (`runtime.gpus.node_policy`; one GPU is a node of one): a GPU per upstream entry (without
    ``upstreams:``, the one of ``upstream:``), named as configured, with the entry's slots (``auto``:
    the slots the log recorded, as if learnt) and the models it may serve. Each GPU keeps the
    models resident that the configuration lets it (`Config.residency_of`: maxLoaded, pinned
    models, memory)."""
    from llamaswap.config import SLOTS_AUTO

    return config.policy([config.gpu_policy(entry.name, {None: recorded_slots} if entry.slots == SLOTS_AUTO else None,
                                            single)
                          for entry in config.gpu_entries])


def _one_model_gpus(config: Any) -> frozenset[str]:
    """The configured upstreams that cannot unload a model: their command starts a single-model
    llama-server (`config.idle.one_model_command`)."""
    if config is None:
        return frozenset()
    from llamaswap.config.idle import one_model_command

    return frozenset(entry.name for entry in config.gpu_entries if one_model_command(entry))


def _pods_flag(text: str) -> int:
    try:
        pods = int(text)
    except ValueError:
        pods = 0
    if not 1 <= pods <= 1000:
        raise argparse.ArgumentTypeError(f"must be a whole number of pods from 1 to 1000, not {text!r}")
    return pods


def _speed_flag(text: str) -> ConcurrencySpeed:
    try:
        return ConcurrencySpeed.parse(text)
    except ConcurrencySpeedError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _defaults() -> Settings:
    from llamaswap.config import Config

    return Settings.from_policy(Config().policy(), configured=False)


def _load_config(path: str, err: TextIO) -> Any:
    from llamaswap.config import ConfigError, load_config

    def warn(text: str) -> None:
        err.write(f"warning: {text}\n")

    try:
        return load_config(path, warn=warn)
    except ConfigError as exc:
        raise UsageError(*(str(problem) for problem in exc.problems)) from None


def _estimates(config: Any) -> tuple[float, float, int]:
    """The estimator's defaults and window from the configuration, where it has them."""
    if config is None:
        from llamaswap.config import Config

        config = Config()
    estimates = getattr(config, "estimates", None)
    if estimates is None:
        return _ESTIMATE_DEFAULTS
    run_s, swap_s, samples = _ESTIMATE_DEFAULTS
    return (float(getattr(estimates, "default_run_seconds", run_s)),
            float(getattr(estimates, "default_swap_seconds", swap_s)), int(getattr(estimates, "samples", samples)))


def _read_activity(path: str) -> Activity:
    try:
        activity = read_activity(path)
    except OSError as exc:
        raise UsageError(f"{path}: cannot read the file: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise UsageError(f"{path}: is not UTF-8 text") from None
    if not activity.requests:
        detail = f"{activity.lines} lines, {activity.skipped} skipped, {activity.malformed} unusable"
        if activity.first_problem:
            detail += f"; first: {activity.first_problem}"
        raise UsageError(f"{path}: no request records ({detail})")
    return activity


def _recorded_settings(activity: Activity, *, configured: bool) -> tuple[Settings, str | None]:
    base = _defaults()
    if not activity.settings:
        return base, None if configured else "no settings record in the log: the configuration defaults apply"
    first = base.with_recorded(activity.settings[0])
    changed = sum(1 for record in activity.settings[1:] if base.with_recorded(record) != first)
    note = None
    if changed and not configured:
        note = (f"the log's settings changed {changed} time(s) after its first settings record; "
                "the simulation starts from the first")
    return first, note


def _write_requests(target: str, simulations: Sequence[Any], out: TextIO | None) -> None:
    sweeping = len(simulations) > 1
    lines = (line for index, simulation in enumerate(simulations)
             for line in report.request_lines(simulation, index if sweeping else None))
    if out is not None:
        for line in lines:
            out.write(line + "\n")
        return
    try:
        with open(target, "w", encoding="utf-8") as handle:
            for line in lines:
                handle.write(line + "\n")
    except OSError as exc:
        raise UsageError(f"cannot write the requests to {target}: {exc.strerror or exc}") from None


def main(argv: Sequence[str] | None = None) -> int:
    """Run `simulate` on its own (until the `llamaswap` command registers it)."""
    parser = argparse.ArgumentParser(prog="llamaswap")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["simulate", *(sys.argv[1:] if argv is None else argv)])
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
