"""`llamaswap batches`: the batches of the OpenAI Batch API on this llamaswap, as a table.

Reads the sidecar's admin `GET /batches` (every caller's batches, every page, newest first; the
admin server's own route, which Envoy's listener does not serve) and prints the space the files
take (used, the quota batches.maxStoredBytes, what is left, the disk's free space), then one
line per batch: its id, status, lines DONE (completed), FAILED (failed, expired or cancelled)
and TOTAL, when it STARTED (in_progress_at, local time), when it should FINISH (llamaswap's
estimate from the rate its latest lines ended; "-" before two lines ended or once it ended) and
the PRIORITY its lines run at. `--json` prints the list document itself, every page's batches
in one `data`, and the space in `storage`.

The admin address is `--admin`, or `listen.admin` of the configuration `-c FILE` names, or the
default listen.admin. Exit status 1 when the admin server cannot be reached or the Batch API is
off there (batches.dir unset).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, TextIO

from llamaswap.commands.queue import add_admin_arguments, admin_of
from llamaswap.commands.table import table_lines
from llamaswap.config.types import size_text

COLUMNS = ("ID", "STATUS", "DONE/FAILED/TOTAL", "STARTED", "FINISH", "PRIORITY")
_RIGHT = {"DONE/FAILED/TOTAL", "PRIORITY"}
# The most batches one GET /v1/batches answers (the API's own limit).
PAGE = 100
# The admin server's list of every caller's batches, with the space the files take.
SUMMARY_PATH = "/batches"
OFF_CODE = "batches_off"


class BatchesUnavailable(Exception):
    """The admin server cannot be asked, or answered something else than a list of batches."""


class BatchesOff(BatchesUnavailable):
    """The Batch API is off on this llamaswap (batches.dir unset)."""


def add_parser(commands: Any) -> argparse.ArgumentParser:
    """Register `batches` on the `llamaswap` subcommands."""
    parser = commands.add_parser("batches", help="list the batches of the OpenAI Batch API and their progress",
                                 description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_admin_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print the list of batches as JSON instead of a table")
    parser.set_defaults(run=run)
    return parser


def _get(url: str, timeout_s: float) -> dict[str, Any]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            document = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        error = _error_of(exc)
        if exc.code == 404 and error.get("code") == OFF_CODE:
            admin = url.split(SUMMARY_PATH + "?", 1)[0]
            raise BatchesOff(f"the Batch API is off on the llamaswap at {admin}: batches.dir is unset "
                             "(set it to a directory, a persistent volume, to turn it on)") from exc
        detail = f": {error['message']}" if error.get("message") else ""
        raise BatchesUnavailable(f"GET {url}: HTTP {exc.code}{detail}") from exc
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise BatchesUnavailable(f"GET {url}: {reason}") from exc
    if not isinstance(document, dict) or not isinstance(document.get("data"), list):
        raise BatchesUnavailable(f"GET {url}: not a list of batches")
    return document


def _error_of(exc: urllib.error.HTTPError) -> dict[str, Any]:
    """The OpenAI error of an HTTP error's body ({} when it holds none)."""
    try:
        error = json.loads(exc.read()).get("error")
    except (OSError, ValueError, AttributeError):
        return {}
    return error if isinstance(error, dict) else {}


def fetch_batches(admin: str, timeout_s: float = 5.0) -> dict[str, Any]:
    """Every batch, newest first, following `has_more`: one list document (the API's shape),
    with the space the files take (`storage`, from the last page) where the sidecar says."""
    base = admin.rstrip("/")
    if "://" not in base:
        base = "http://" + base
    batches: list[dict[str, Any]] = []
    after: str | None = None
    while True:
        query = {"limit": str(PAGE), **({"after": after} if after is not None else {})}
        page = _get(f"{base}{SUMMARY_PATH}?{urllib.parse.urlencode(query)}", timeout_s)
        batches.extend(item for item in page["data"] if isinstance(item, dict))
        last = page.get("last_id")
        # A page that does not move the cursor ends the walk (never an endless loop).
        if not page.get("has_more") or not isinstance(last, str) or last == after:
            break
        after = last
    document = {"object": "list", "data": batches, "first_id": batches[0].get("id") if batches else None,
                "last_id": batches[-1].get("id") if batches else None, "has_more": False}
    if isinstance(page.get("storage"), dict):
        document["storage"] = page["storage"]
    return document


def local_time(seconds: Any) -> str:
    """Unix seconds as local time, "-" for none."""
    if not isinstance(seconds, (int, float)) or isinstance(seconds, bool):
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(seconds))


def _count(counts: dict[str, Any], key: str) -> str:
    value = counts.get(key)
    return str(value) if isinstance(value, int) else "?"


def rows(document: dict[str, Any]) -> list[tuple[str, ...]]:
    """The table's rows, in COLUMNS order."""
    table: list[tuple[str, ...]] = []
    for batch in document.get("data") or []:
        counts = batch.get("request_counts") or {}
        own = batch.get("llamaswap") or {}
        priority = own.get("priority")
        table.append((str(batch.get("id", "")), str(batch.get("status", "")),
                      "/".join(_count(counts, key) for key in ("completed", "failed", "total")),
                      local_time(batch.get("in_progress_at")), local_time(own.get("estimated_finish_at")),
                      "-" if priority is None else str(priority)))
    return table


def _size(value: Any) -> str | None:
    return size_text(value) if isinstance(value, int) and not isinstance(value, bool) else None


def storage_line(storage: Any) -> str | None:
    """The space the files take: ``files: 1.2 GiB in 14 (quota 2.0 GiB, 819.2 MiB left); disk: ...``."""
    if not isinstance(storage, dict):
        return None
    used, quota = _size(storage.get("used_bytes")), _size(storage.get("max_bytes"))
    left = _size(storage.get("left_bytes"))
    count = storage.get("files")
    line = f"files: {used or '?'} in {count if isinstance(count, int) else '?'}"
    line += f" (quota {quota}, {left or '?'} left)" if quota else f" (no quota, {left or '?'} left)"
    free = _size(storage.get("disk_free_bytes"))
    return line + (f"; disk: {free} free" if free else "")


def render(document: dict[str, Any]) -> str:
    batches = document.get("data") or []
    statuses: dict[str, int] = {}
    for batch in batches:
        statuses[str(batch.get("status"))] = statuses.get(str(batch.get("status")), 0) + 1
    summary = f"{len(batches)} batch{'' if len(batches) == 1 else 'es'}"
    if statuses:
        summary += ": " + ", ".join(f"{count} {status}" for status, count in statuses.items())
    space = storage_line(document.get("storage"))
    return "\n".join([summary, *([space] if space else []), *table_lines(COLUMNS, rows(document), right=_RIGHT)]) + "\n"


def run(args: argparse.Namespace, *, out: TextIO | None = None, err: TextIO | None = None) -> int:
    out = out or sys.stdout
    err = err or sys.stderr
    try:
        document = fetch_batches(admin_of(args))
    except BatchesUnavailable as exc:
        err.write(f"error: {exc}\n")
        return 1
    out.write(json.dumps(document) + "\n" if args.json else render(document))
    return 0
