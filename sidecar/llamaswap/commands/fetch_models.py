"""`llamaswap fetch-models`: download GGUF files into a models directory, checked by sha256.

What the Helm chart's `fetch-models` init container runs (the sidecar image) to fill the
models volume before llama-server starts:

    llamaswap fetch-models --to /models 'https://host/qwen3-8b-q4_k_m.gguf#sha256=HEX' ...
    llamaswap fetch-models --to /models --spec /etc/llamaswap/models.yaml

- A file already there whose sha256 matches is kept (nothing is downloaded).
- A download goes to `NAME.part` beside it and is renamed to NAME only after its checksum
  matched: llama-server never sees a half-written or wrong file under a model's name.
- An interrupted download resumes from the end of `NAME.part` with an HTTP Range request
  (a server that ignores Range sends the whole file again, and the part is rewritten).
- A wrong checksum removes the part (resuming it could never succeed) and fails.
- Progress lines go to standard error; every failure is one line, `error: NAME: ...`,
  and a non-zero exit (1; 2 for a bad argument or spec file).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import http.client
import logging
import os
import pathlib
import re
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from typing import IO, Any

import yaml

LOG = logging.getLogger("llamaswap.commands.fetch_models")

EXIT_FAILED = 1
EXIT_USAGE = 2
CHUNK_BYTES = 1024 * 1024
READ_TIMEOUT_S = 60.0
# A download that broke off after some progress is resumed this many times before failing.
RESUME_ATTEMPTS = 5
PROGRESS_EVERY_S = 5.0
PART_SUFFIX = ".part"
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
# A plain file name: no directory parts, no hidden files (a .part is hidden from nothing, but
# llama-server lists only *.gguf).
_FILE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")


class FetchError(Exception):
    """A model file could not be fetched: the message is the one line the log shows."""


class SpecError(ValueError):
    """A model given on the command line or in the spec file is malformed."""


@dataclasses.dataclass(frozen=True)
class ModelFile:
    """One file to fetch: where from, its expected sha256 and its name in the models directory."""

    url: str
    sha256: str
    name: str


def model_file(url: str, sha256: str, name: str | None = None) -> ModelFile:
    """A checked ModelFile; the name defaults to the URL's last path segment."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise SpecError(f"{url!r}: not an http:// or https:// URL")
    digest = sha256.strip().lower()
    if not _SHA256.match(digest):
        raise SpecError(f"{url}: sha256 must be 64 hex digits, got {sha256!r}")
    file_name = name or urllib.parse.unquote(parts.path.rstrip("/").rsplit("/", 1)[-1])
    if not _FILE_NAME.match(file_name) or file_name.endswith(PART_SUFFIX):
        raise SpecError(f"{url}: {file_name!r} is not a plain file name (give one with name:)")
    return ModelFile(url=urllib.parse.urlunsplit(parts._replace(fragment="")), sha256=digest, name=file_name)


def parse_argument(text: str) -> ModelFile:
    """`URL#sha256=HEX` (optionally `&name=FILE`)."""
    url, _, fragment = text.partition("#")
    fields = dict(urllib.parse.parse_qsl(fragment))
    if "sha256" not in fields:
        raise SpecError(f"{text!r}: append the file's checksum as #sha256=HEX")
    return model_file(url, fields["sha256"], fields.get("name"))


def parse_spec(document: Any, source: str) -> list[ModelFile]:
    """The spec file: `files: [{url: ..., sha256: ..., name: ...}]` (name optional)."""
    if document is None:
        return []
    if not isinstance(document, dict) or not isinstance(document.get("files", []), list):
        raise SpecError(f"{source}: expected a mapping with a list under 'files'")
    files = []
    for index, entry in enumerate(document.get("files") or []):
        where = f"{source}: files[{index}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("url"), str) \
                or not isinstance(entry.get("sha256"), str):
            raise SpecError(f"{where}: needs url and sha256 (strings)")
        unknown = set(entry) - {"url", "sha256", "name"}
        if unknown:
            raise SpecError(f"{where}: unknown keys {sorted(unknown)} (url, sha256, name)")
        try:
            files.append(model_file(entry["url"], entry["sha256"], entry.get("name") or None))
        except SpecError as exc:
            raise SpecError(f"{where}: {exc}") from exc
    return files


def _sha256_of(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for block in iter(lambda: file.read(CHUNK_BYTES), b""):
            digest.update(block)
    return digest.hexdigest()


def _size(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    raise AssertionError("unreachable")


class _Progress:
    """A line every PROGRESS_EVERY_S seconds: bytes so far, of how many, and the rate."""

    def __init__(self, name: str, start_bytes: int, total: int | None, clock: Callable[[], float]) -> None:
        self.name, self.total, self.clock = name, total, clock
        self.start_bytes = start_bytes
        self.started = self.last = clock()

    def update(self, done: int, *, final: bool = False) -> None:
        now = self.clock()
        if not final and now - self.last < PROGRESS_EVERY_S:
            return
        self.last = now
        rate = (done - self.start_bytes) / max(now - self.started, 1e-6)
        share = f" ({100 * done / self.total:.0f}%)" if self.total else ""
        of = f" of {_size(self.total)}" if self.total else ""
        LOG.info("%s: %s%s%s, %s/s", self.name, _size(done), of, share, _size(rate))


def _open(url: str, offset: int) -> Any:
    request = urllib.request.Request(url, headers={"User-Agent": "llamaswap-fetch-models"})
    if offset:
        request.add_header("Range", f"bytes={offset}-")
    return urllib.request.urlopen(request, timeout=READ_TIMEOUT_S)  # noqa: S310 - http(s) only, checked above


def _total_from(response: Any, offset: int) -> int | None:
    """The whole file's size, from Content-Range (206) or Content-Length (200)."""
    content_range = response.headers.get("Content-Range") or ""
    match = re.match(r"bytes \d+-\d+/(\d+)$", content_range.strip())
    if match:
        return int(match.group(1))
    length = response.headers.get("Content-Length")
    return int(length) + (offset if response.status == 206 else 0) if length and length.isdigit() else None


def _download_once(model: ModelFile, part: pathlib.Path, clock: Callable[[], float]) -> None:
    """One HTTP exchange: append to the part from where it ends (or rewrite it)."""
    offset = part.stat().st_size if part.exists() else 0
    try:
        response = _open(model.url, offset)
    except urllib.error.HTTPError as exc:
        if exc.code == 416 and offset:  # the part already holds the whole file
            LOG.info("%s: %s already downloaded", model.name, _size(offset))
            return
        raise FetchError(f"{model.name}: HTTP {exc.code} {exc.reason} from {model.url}") from exc
    with response:
        if offset and response.status != 206:
            LOG.info("%s: the server ignored the Range request; downloading from the start", model.name)
            offset = 0
        elif offset:
            LOG.info("%s: resuming at %s", model.name, _size(offset))
        total = _total_from(response, offset)
        progress = _Progress(model.name, offset, total, clock)
        with part.open("ab" if offset else "wb") as file:
            _copy(response, file, progress, offset)
            file.flush()
            os.fsync(file.fileno())
        done = part.stat().st_size
        progress.update(done, final=True)
        if total is not None and done < total:
            raise ConnectionError(f"the connection closed at {done} of {total} bytes")


def _copy(response: IO[bytes], file: IO[bytes], progress: _Progress, done: int) -> None:
    while True:
        try:
            block = response.read(CHUNK_BYTES)
        except http.client.IncompleteRead as exc:
            file.write(exc.partial)  # what did arrive counts: the resume starts after it
            raise
        if not block:
            return
        file.write(block)
        done += len(block)
        progress.update(done)


def fetch_one(model: ModelFile, directory: pathlib.Path, *, clock: Callable[[], float] = time.monotonic) -> bool:
    """Make `directory/NAME` the file with the model's checksum. True if it was downloaded,
    False if it was there already. Raises FetchError."""
    target = directory / model.name
    part = directory / (model.name + PART_SUFFIX)
    if target.exists():
        LOG.info("%s: present, checking its sha256", model.name)
        if _sha256_of(target) == model.sha256:
            LOG.info("%s: present with the right checksum, kept", model.name)
            return False
        LOG.warning("%s: present with another checksum, downloading it again", model.name)
    LOG.info("%s: downloading %s", model.name, model.url)
    attempts = 0
    while True:
        before = part.stat().st_size if part.exists() else 0
        try:
            _download_once(model, part, clock)
            break
        except FetchError:
            raise
        except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
            reason = getattr(exc, "reason", None) or exc
            grew = (part.stat().st_size if part.exists() else 0) > before
            attempts += 1
            if not grew or attempts > RESUME_ATTEMPTS:
                raise FetchError(f"{model.name}: cannot download {model.url}: {reason}") from exc
            LOG.warning("%s: the download broke off (%s); resuming", model.name, reason)
    actual = _sha256_of(part)
    if actual != model.sha256:
        part.unlink()
        raise FetchError(f"{model.name}: wrong checksum: expected sha256 {model.sha256}, got {actual} "
                         f"(the download was removed)")
    os.replace(part, target)
    LOG.info("%s: done, sha256 ok", model.name)
    return True


def fetch_all(models: Sequence[ModelFile], directory: pathlib.Path) -> list[str]:
    """Fetch every model; the failures' messages (each one line), after trying all of them."""
    failures = []
    for model in models:
        try:
            fetch_one(model, directory)
        except FetchError as exc:
            failures.append(str(exc))
    return failures


def _run(args: argparse.Namespace) -> int:
    directory = pathlib.Path(args.to)
    try:
        models = [parse_argument(text) for text in args.models]
        if args.spec:
            try:
                text = pathlib.Path(args.spec).read_text(encoding="utf-8")
            except OSError as exc:
                raise SpecError(f"{args.spec}: {exc.strerror or exc}") from exc
            try:
                models += parse_spec(yaml.safe_load(text), args.spec)
            except yaml.YAMLError as exc:
                raise SpecError(f"{args.spec}: not YAML: {exc}") from exc
        names = [m.name for m in models]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise SpecError(f"the same file name twice: {', '.join(duplicates)}")
    except SpecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if not directory.is_dir():
        print(f"error: {directory}: no such directory (--to)", file=sys.stderr)
        return EXIT_USAGE
    if not models:
        LOG.info("no model files to fetch")
        return 0
    failures = fetch_all(models, directory)
    for message in failures:
        print(f"error: {message}", file=sys.stderr)
    if failures:
        return EXIT_FAILED
    LOG.info("%d model file(s) in %s", len(models), directory)
    return 0


def add_parser(commands: Any) -> None:
    """Register `llamaswap fetch-models` on the CLI's subcommands."""
    parser = commands.add_parser(
        "fetch-models", help="download GGUF files with sha256 checksums into a models directory",
        description="Download model files into DIR: resumes partial downloads, keeps files already there "
                    "with the right checksum, renames a file into place only after its checksum matched.")
    parser.add_argument("--to", required=True, metavar="DIR", help="the models directory (llama-server's --models-dir)")
    parser.add_argument("--spec", metavar="FILE", help="YAML file: files: [{url, sha256, name}] (name optional)")
    parser.add_argument("models", nargs="*", metavar="URL#sha256=HEX",
                        help="a file to fetch; add &name=FILE to the fragment to name it")
    parser.set_defaults(run=_run)
