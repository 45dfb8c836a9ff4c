"""`llamaswap queue`: the live queue as a table, like `squeue --start`.

Reads the sidecar's admin `GET /queue` and prints the running requests first (ST `R`), then
the waiting ones in dispatch order (ST `PD`, pending), with priority, band, score, how long
each has waited, when it is expected to start and the model. The SCORE of a waiting request
is the one it will have at its turn in that order (the swap-affinity bonus counts the model
loaded by then): the score it wins its turn with. START is the
estimate from measured run and swap times (`estimates.*` before anything is measured), and
for the running request TIME is how long it has run and START how long it is expected to
take still. With several upstreams (GPUs) GPU says which one a running request runs on, and one
line per GPU above the table says what it has loaded and how many of its slots are busy (like
`squeue`'s partitions); where a GPU keeps several models resident (`maxLoaded`), its line gives
each model's busy/total slots and the model the best waiting request holds back there. The
sidecar says which of these lines to show (``per_gpu``, and ``per_model`` on each GPU): this
command shows what it says. Places
kept for a client's retry (routing.retryGraceSeconds) come last (ST `K`): WAIT counts from the
first try, TIME is how long the client has been away. Each idle resident model has a line: how long
it has sat idle and in how long it is unloaded for idleness (`models.<id>.ttl`), or that it is kept.
A Batch API line that was stopped for a higher band (`batches.preempt`) gets a note in a last LINE
column: waiting, how often it was stopped and the tokens it resumes from; running, its stops so far
("stopping" first while a stop asked of it has not taken effect).
`--watch N` refreshes every N seconds until
Ctrl-C or SIGTERM; `--json` prints the admin server's document itself (one a line with --watch).

The admin address is `--admin`, or `listen.admin` of the configuration `-c FILE` names, or the
default listen.admin.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Any, TextIO

from llamaswap.commands.arguments import positive_seconds
from llamaswap.commands.table import table_lines
from llamaswap.config import DEFAULT_ADMIN, HostPort
from llamaswap.runtime.gpu_projection import GpuState

COLUMNS = ("POS", "ST", "REQUEST_ID", "PRIORITY", "BAND", "SCORE", "WAIT", "TIME", "START", "MODEL")
# With several upstreams: which one a running request runs on.
GPU_COLUMN = "GPU"
# Where a row is a Batch API line that was stopped (or kept tokens): its progress.
LINE_COLUMN = "LINE"
_RIGHT = {"PRIORITY", "SCORE", "WAIT", "TIME", "START"}
_CLEAR = "\x1b[H\x1b[2J"
_GPU: dict[str, str] = {GpuState.IDLE: "GPU idle", GpuState.RUNNING: "1 running",
        GpuState.SETTLING: "GPU settling (the upstream finishes an abandoned generation)",
        GpuState.ADOPTED: "GPU busy with an exchange granted before this sidecar started"}


# A GPU's own line: what holds it, where its grants do not say it all.
_GPU_LINE: dict[str, str] = {GpuState.IDLE: "idle",
                             GpuState.SETTLING: "settling (it finishes an abandoned generation)",
                             GpuState.ADOPTED: "busy with an exchange granted before this sidecar started"}


class QueueUnavailable(Exception):
    pass


def add_parser(commands: Any) -> argparse.ArgumentParser:
    """Register `queue` on the `llamaswap` subcommands."""
    parser = commands.add_parser("queue", help="show the waiting requests and the running one (like squeue)",
                                 description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_admin_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print the queue document as JSON instead of a table")
    parser.add_argument("--watch", type=positive_seconds, nargs="?", const=2.0, metavar="SECONDS",
                        help="refresh every SECONDS (default 2) until Ctrl-C")
    parser.set_defaults(run=run)
    return parser


def admin_url(address: HostPort) -> str:
    """The admin server's base URL for a listen address (a wildcard host means this machine)."""
    return f"http://{HostPort(address.connect_host, address.port)}"


def add_admin_arguments(parser: argparse.ArgumentParser) -> None:
    """--admin or -c: where a command finds the sidecar's admin server (read by `admin_of`)."""
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--admin", help=f"the sidecar's admin address (default: listen.admin, {DEFAULT_ADMIN})")
    where.add_argument("-c", "--config", help="the stack's YAML configuration: its listen.admin is asked")


def admin_of(args: argparse.Namespace) -> str:
    """The admin server's base URL: --admin, else listen.admin of -c FILE, else the default."""
    if args.admin:
        return str(args.admin)
    if args.config:
        from llamaswap.commands.loading import load_or_exit

        return admin_url(load_or_exit(args.config).listen.admin)
    return admin_url(DEFAULT_ADMIN)


def fetch_queue(admin: str, timeout_s: float = 5.0) -> dict[str, Any]:
    url = admin.rstrip("/") + "/queue"
    if "://" not in url:
        url = "http://" + url
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        raise QueueUnavailable(f"GET {url}: HTTP {exc.code}") from exc
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise QueueUnavailable(f"GET {url}: {reason}") from exc


def format_duration(seconds: float | None) -> str:
    """squeue's TIME format: M:SS, H:MM:SS, or D-HH:MM:SS."""
    if seconds is None:
        return ""
    total = max(0, int(seconds))
    days, rest = divmod(total, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}-{hours:02d}:{minutes:02d}:{secs:02d}"
    if hours:
        return f"{hours}:{minutes:02d}:{secs:02d}"
    return f"{minutes}:{secs:02d}"


def columns_of(document: dict[str, Any]) -> tuple[str, ...]:
    """The table's columns: COLUMNS, then GPU_COLUMN with several GPUs, then LINE_COLUMN where a
    row has a line's note."""
    gpu = (GPU_COLUMN,) if len(_gpus(document)) > 1 else ()
    return (*COLUMNS, *gpu, *((LINE_COLUMN,) if _line_notes(document) else ()))


def rows(document: dict[str, Any]) -> list[tuple[str, ...]]:
    """The table's rows, in `columns_of`'s order."""
    gpu_column = len(_gpus(document)) > 1
    line_column = _line_notes(document)
    table: list[tuple[str, ...]] = []

    def add(row: tuple[str, ...], gpu: str, note: str) -> None:
        table.append((*row, *((gpu,) if gpu_column else ()), *((note,) if line_column else ())))

    for running in _running(document):
        add(("-", "R", str(running.get("request_id", "")), str(running.get("priority", "")),
             str(running.get("band", "")), _score(running.get("score")),
             format_duration(running.get("queue_wait_s")), format_duration(running.get("running_s")),
             _start(running, "expected_remaining_s"), running.get("model") or "-"),
            str(running.get("upstream") or "-"), line_note(running.get("line"), running=True))
    for item in _waiting(document):
        add((str(item.get("position", "")), "PD", str(item.get("request_id", "")),
             str(item.get("priority", "")), str(item.get("band", "")), _score(item.get("score")),
             format_duration(item.get("waited_s")), "", _start(item, "estimated_start_s"),
             item.get("model") or "-"), "", line_note(item.get("line"), running=False))
    for item in document.get("kept") or []:
        add(("-", "K", str(item.get("request_id", "")), str(item.get("priority", "")),
             str(item.get("band", "")), "", format_duration(item.get("waited_s")),
             format_duration(item.get("away_s")), "", item.get("model") or "-"), "", "")
    return table


def line_note(line: Any, *, running: bool) -> str:
    """A Batch API line's progress (a row's ``line``): waiting, "stopped 1x, 120 tokens kept" (the
    tokens it resumes from); running, "stopped 1x, 180 tokens" (its stops so far and its tokens
    now), and "stopping" once a stop was asked of it; nothing for a line never stopped (nor,
    waiting, with no tokens kept) or another request."""
    if not isinstance(line, dict):
        return ""
    stops, tokens = line.get("stops"), line.get("tokens")
    stopping = running and line.get("stopping") is True
    if not isinstance(stops, int) or not isinstance(tokens, int) or not (stops or stopping or (tokens and not running)):
        return ""
    counted = f"{tokens} token{'' if tokens == 1 else 's'}{'' if running else ' kept'}"
    note = f"stopped {stops}x, {counted}" if stops else counted
    return f"stopping, {note}" if stopping else note


def _line_notes(document: dict[str, Any]) -> bool:
    """Whether a running or waiting row has a line's note (then the table has LINE_COLUMN)."""
    return (any(line_note(row.get("line"), running=True) for row in _running(document))
            or any(line_note(row.get("line"), running=False) for row in _waiting(document)))


def _waiting(document: dict[str, Any]) -> list[dict[str, Any]]:
    return [row for row in document.get("waiting") or [] if isinstance(row, dict)]


def _gpus(document: dict[str, Any]) -> list[dict[str, Any]]:
    """The upstreams (``gpus``; an older sidecar lists none)."""
    gpus = document.get("gpus")
    return [gpu for gpu in gpus if isinstance(gpu, dict)] if isinstance(gpus, list) else []


def gpu_lines(document: dict[str, Any]) -> list[str]:
    """One line per upstream where the sidecar says so (``per_gpu``: there are several, or one
    keeps several models resident): its name, busy slots, resident models (each one's busy/total
    slots where the GPU says ``per_model``) and what holds it, then the model held back there, if any."""
    gpus = _gpus(document)
    if not document.get("per_gpu") or not gpus:
        return []
    names = [str(gpu.get("name", "?")) for gpu in gpus]
    width = max(len(name) for name in names)
    lines = []
    for name, gpu in zip(names, gpus):
        busy, slots = gpu.get("slots_busy", 0), gpu.get("slots", 1)
        state = _GPU_LINE.get(str(gpu.get("state")), f"{busy} running" if busy else "idle")
        loaded = _models(gpu) if gpu.get("per_model") else _loaded(gpu)
        line = f"  {name.ljust(width)}  slots {busy}/{slots}  {loaded}  {state}"
        held_back = gpu.get("held_back")
        if held_back:
            line += f", holding back {held_back} (no new grants until it drains and is unloaded)"
        lines.append(line)
    return lines


def _models(gpu: dict[str, Any]) -> str:
    """"models (2 of 3) a 1/2, b 0/4 pinned": how many are resident of ``max_loaded``, and each
    model's busy/total slots (from ``models``; a document without them: the names alone)."""
    rows = [row for row in gpu.get("models") or [] if isinstance(row, dict)]
    if not rows:
        return _loaded(gpu)
    resident = gpu.get("resident_models") or []
    count = f"({len(resident)} of {gpu['max_loaded']})" if isinstance(gpu.get("max_loaded"), int) else ""
    shown = []
    for row in rows:
        text = f"{row.get('model')} {row.get('slots_busy', 0)}/{row.get('slots', 1)}"
        if row.get("pinned"):
            text += " pinned"
        if row.get("model") not in resident:
            text += " (not known resident)"
        shown.append(text)
    return " ".join(part for part in ("models", count, ", ".join(shown)) if part)


def _loaded(document: dict[str, Any]) -> str:
    """"loaded model NAME" ("-": none known), "loaded models A,B" where there are several; an older
    sidecar's document says ``loaded_model``, one name or null."""
    names = document.get("resident_models")
    if not isinstance(names, list):
        older = document.get("loaded_model")
        names = [older] if isinstance(older, str) else []
    names = [str(name) for name in names]
    return f"loaded model{'s' if len(names) > 1 else ''} {','.join(names) or '-'}"


def _running(document: dict[str, Any]) -> list[dict[str, Any]]:
    """Every running request: ``running_all`` (with slots), else the one ``running`` (older sidecars)."""
    every = document.get("running_all")
    if isinstance(every, list):
        return [row for row in every if isinstance(row, dict)]
    running = document.get("running")
    return [running] if isinstance(running, dict) else []


def _score(value: Any) -> str:
    return f"{value:.3f}" if isinstance(value, (int, float)) else ""


def _start(row: dict[str, Any], key: str) -> str:
    """squeue --start style: in how long, from now; "unknown" where the sidecar says it cannot
    tell (null), nothing where it does not say (an older sidecar)."""
    seconds = row.get(key)
    if isinstance(seconds, (int, float)) and not isinstance(seconds, bool):
        return f"+{format_duration(seconds)}"
    return "unknown" if key in row and seconds is None else ""


def render(document: dict[str, Any]) -> str:
    waiting = document.get("waiting") or []
    running = len(_running(document))
    gpu = _GPU.get(str(document.get("gpu")), "1 running" if running else "GPU idle")
    if running > 1 and document.get("gpu") == GpuState.RUNNING:
        gpu = f"{running} running"
    slots_total = document.get("slots_total")
    if isinstance(slots_total, int) and slots_total > 1:
        gpu += f", slots {document.get('slots_busy', running)}/{slots_total}"
    gpus = gpu_lines(document)
    gpu_column = len(_gpus(document)) > 1
    # Several GPUs: each one's resident models are on its own line.
    loaded = f"{len(gpus)} GPUs" if gpu_column else _loaded(document)
    summary = f"policy {document.get('policy', '?')}, {loaded}, {gpu}, {len(waiting)} waiting"
    bands = document.get("bands") or {}
    if bands:
        summary += " (" + ", ".join(f"{name} {stats.get('depth', 0)}" for name, stats in bands.items()) + ")"
    kept = document.get("kept") or []
    if kept:
        summary += f", {len(kept)} kept for a retry"
    lines = [summary, *gpus, *idle_lines(document), *table_lines(columns_of(document), rows(document), right=_RIGHT)]
    return "\n".join(lines) + "\n"


def idle_lines(document: dict[str, Any]) -> list[str]:
    """One line per idle resident model (``idle``): how long it has sat idle, and in how long it is
    unloaded for idleness (models.<id>.ttl, upstream.idleUnloadSeconds), or that it is kept."""
    idle = [row for row in document.get("idle") or [] if isinstance(row, dict)]
    gpu_named = len(_gpus(document)) > 1
    lines = []
    for row in idle:
        where = f" on {row.get('upstream')}" if gpu_named else ""
        unload_in = row.get("unload_in_s")
        when = "kept" if unload_in is None else f"unloaded in {format_duration(unload_in)}"
        lines.append(f"  idle {row.get('model')}{where} for {format_duration(row.get('idle_s'))}, {when}")
    return lines


def run(args: argparse.Namespace, *, out: TextIO | None = None, err: TextIO | None = None) -> int:
    out = out or sys.stdout
    err = err or sys.stderr
    admin = admin_of(args)
    show = _as_json if getattr(args, "json", False) else render
    if not args.watch:
        try:
            out.write(show(fetch_queue(admin)))
        except QueueUnavailable as exc:
            err.write(f"error: {exc}\n")
            return 1
        return 0
    stop = threading.Event()
    # Set both explicitly: a job started in the background inherits SIGINT as ignored, and
    # Python then never turns it into KeyboardInterrupt.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    clear = _CLEAR if out.isatty() else ""
    while not stop.is_set():
        if show is _as_json:
            try:
                out.write(show(fetch_queue(admin)))
            except QueueUnavailable as exc:
                err.write(f"error: {exc}\n")
        else:
            try:
                text = render(fetch_queue(admin))
            except QueueUnavailable as exc:
                text = f"error: {exc}\n"
            out.write(f"{clear}{time.strftime('%Y-%m-%d %H:%M:%S')}  every {args.watch:g}s  (Ctrl-C to stop)\n{text}\n")
        out.flush()
        stop.wait(args.watch)
    return 0


def _as_json(document: dict[str, Any]) -> str:
    """The document as GET /queue answered it, on one line."""
    return json.dumps(document, sort_keys=False) + "\n"
