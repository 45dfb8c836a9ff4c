"""`llamaswap fetch-models` (sidecar/llamaswap/models_fetch.py) against a local HTTP server on
127.0.0.1 that serves Range requests: a fresh download, a resumed partial file, a file already
there, a wrong checksum, a 404, an unreachable URL, a server that ignores Range, a connection
that breaks off mid-file, and bad arguments. Run as the command the init container runs."""

from __future__ import annotations

import hashlib
import os
import pathlib
import re
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

from file_server import FileServer
from llamaswap.commands.fetch_models import ModelFile, SpecError, parse_argument, parse_spec

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAYLOAD = os.urandom(3 * 1024 * 1024 + 123)  # a few chunks, not a whole number of them
SHA = hashlib.sha256(PAYLOAD).hexdigest()


@pytest.fixture
def server() -> Iterator[FileServer]:
    files = FileServer({"tiny.gguf": PAYLOAD, "other.gguf": b"other model"})
    try:
        yield files
    finally:
        files.close()


def fetch(directory: pathlib.Path, *models: str, extra: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(ROOT / "sidecar")}
    return subprocess.run([sys.executable, "-m", "llamaswap", "fetch-models", "--to", str(directory), *extra, *models],
                          env=env, capture_output=True, text=True, timeout=120, check=False)


def listing(directory: pathlib.Path) -> list[str]:
    return sorted(path.name for path in directory.iterdir())


def test_a_fresh_download_lands_under_its_name_with_progress(server: FileServer, tmp_path: pathlib.Path) -> None:
    result = fetch(tmp_path, f"{server.url('tiny.gguf')}#sha256={SHA}")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "tiny.gguf").read_bytes() == PAYLOAD
    assert listing(tmp_path) == ["tiny.gguf"]  # no part left behind
    assert "tiny.gguf: downloading http://127.0.0.1" in result.stderr
    # The final progress line: the whole size, the share and a rate.
    assert re.search(r"tiny\.gguf: 3\.0 MiB of 3\.0 MiB \(100%\), .*/s", result.stderr), result.stderr
    assert "tiny.gguf: done, sha256 ok" in result.stderr
    assert server.ranges == [None]


def test_a_partial_file_is_resumed_with_a_range_request(server: FileServer, tmp_path: pathlib.Path) -> None:
    (tmp_path / "tiny.gguf.part").write_bytes(PAYLOAD[:1_000_000])
    result = fetch(tmp_path, f"{server.url('tiny.gguf')}#sha256={SHA}")
    assert result.returncode == 0, result.stderr
    assert server.ranges == ["bytes=1000000-"]
    assert "resuming at" in result.stderr
    assert (tmp_path / "tiny.gguf").read_bytes() == PAYLOAD
    assert listing(tmp_path) == ["tiny.gguf"]


def test_a_complete_part_is_checked_and_renamed(server: FileServer, tmp_path: pathlib.Path) -> None:
    """The server answers 416 to a Range past the end: the part already holds the file."""
    (tmp_path / "tiny.gguf.part").write_bytes(PAYLOAD)
    result = fetch(tmp_path, f"{server.url('tiny.gguf')}#sha256={SHA}")
    assert result.returncode == 0, result.stderr
    assert server.ranges == [f"bytes={len(PAYLOAD)}-"]
    assert (tmp_path / "tiny.gguf").read_bytes() == PAYLOAD


def test_a_server_that_ignores_range_rewrites_the_part(server: FileServer, tmp_path: pathlib.Path) -> None:
    server.ignore_range = True
    (tmp_path / "tiny.gguf.part").write_bytes(b"x" * 5000)  # not even the file's start
    result = fetch(tmp_path, f"{server.url('tiny.gguf')}#sha256={SHA}")
    assert result.returncode == 0, result.stderr
    assert "ignored the Range request" in result.stderr
    assert (tmp_path / "tiny.gguf").read_bytes() == PAYLOAD


def test_a_download_that_breaks_off_is_resumed(server: FileServer, tmp_path: pathlib.Path) -> None:
    server.break_after = 1_500_000
    result = fetch(tmp_path, f"{server.url('tiny.gguf')}#sha256={SHA}")
    assert result.returncode == 0, result.stderr
    assert "broke off" in result.stderr
    assert server.ranges == [None, "bytes=1500000-"]
    assert (tmp_path / "tiny.gguf").read_bytes() == PAYLOAD


def test_a_file_already_there_with_the_right_checksum_is_kept(server: FileServer, tmp_path: pathlib.Path) -> None:
    (tmp_path / "tiny.gguf").write_bytes(PAYLOAD)
    before = (tmp_path / "tiny.gguf").stat().st_mtime_ns
    result = fetch(tmp_path, f"{server.url('tiny.gguf')}#sha256={SHA}")
    assert result.returncode == 0, result.stderr
    assert "present with the right checksum, kept" in result.stderr
    assert server.ranges == []  # nothing was asked of the server
    assert (tmp_path / "tiny.gguf").stat().st_mtime_ns == before


def test_a_file_there_with_another_checksum_is_replaced(server: FileServer, tmp_path: pathlib.Path) -> None:
    (tmp_path / "tiny.gguf").write_bytes(b"an older file")
    result = fetch(tmp_path, f"{server.url('tiny.gguf')}#sha256={SHA}")
    assert result.returncode == 0, result.stderr
    assert "present with another checksum" in result.stderr
    assert (tmp_path / "tiny.gguf").read_bytes() == PAYLOAD


def test_a_wrong_checksum_fails_and_leaves_nothing_as_if_complete(server: FileServer, tmp_path: pathlib.Path) -> None:
    wrong = "0" * 64
    result = fetch(tmp_path, f"{server.url('tiny.gguf')}#sha256={wrong}")
    assert result.returncode == 1
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: tiny.gguf: wrong checksum: expected sha256 {wrong}, got {SHA} "
                      "(the download was removed)"], result.stderr
    assert listing(tmp_path) == []


def test_a_404_is_one_clear_line(server: FileServer, tmp_path: pathlib.Path) -> None:
    result = fetch(tmp_path, f"{server.url('missing.gguf')}#sha256={SHA}")
    assert result.returncode == 1
    assert f"error: missing.gguf: HTTP 404 Not Found from {server.url('missing.gguf')}" in result.stderr.splitlines()
    assert listing(tmp_path) == []


def test_an_unreachable_url_is_one_clear_line(tmp_path: pathlib.Path) -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"http://127.0.0.1:{port}/tiny.gguf"
    result = fetch(tmp_path, f"{url}#sha256={SHA}")
    assert result.returncode == 1
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(f"error: tiny.gguf: cannot download {url}: "), result.stderr
    assert "Connection refused" in errors[0]
    assert listing(tmp_path) == []


def test_every_file_is_tried_and_each_failure_reported(server: FileServer, tmp_path: pathlib.Path) -> None:
    other = hashlib.sha256(b"other model").hexdigest()
    result = fetch(tmp_path, f"{server.url('missing.gguf')}#sha256={SHA}",
                   f"{server.url('other.gguf')}#sha256={other}&name=renamed.gguf")
    assert result.returncode == 1
    assert listing(tmp_path) == ["renamed.gguf"]
    assert sum(line.startswith("error:") for line in result.stderr.splitlines()) == 1


def test_a_spec_file(server: FileServer, tmp_path: pathlib.Path) -> None:
    models = tmp_path / "models"
    models.mkdir()
    spec = tmp_path / "models.yaml"
    spec.write_text(f"files:\n  - url: {server.url('tiny.gguf')}\n    sha256: {SHA.upper()}\n")
    result = fetch(models, extra=("--spec", str(spec)))
    assert result.returncode == 0, result.stderr
    assert listing(models) == ["tiny.gguf"]


@pytest.mark.parametrize("argument, message", [
    ("http://h/x.gguf", "append the file's checksum as #sha256=HEX"),
    ("ftp://h/x.gguf#sha256=" + "a" * 64, "not an http:// or https:// URL"),
    ("http://h/x.gguf#sha256=abc", "sha256 must be 64 hex digits"),
    ("http://h/#sha256=" + "a" * 64, "is not a plain file name"),
    ("http://h/x.gguf#sha256=" + "a" * 64 + "&name=../etc/x", "is not a plain file name"),
])
def test_bad_arguments_exit_2_with_the_problem(argument: str, message: str, tmp_path: pathlib.Path) -> None:
    result = fetch(tmp_path, argument)
    assert result.returncode == 2
    assert result.stderr.startswith("error: ") and message in result.stderr, result.stderr
    with pytest.raises(SpecError):
        parse_argument(argument)


def test_a_missing_directory_and_duplicate_names_exit_2(tmp_path: pathlib.Path) -> None:
    model = "http://h/x.gguf#sha256=" + "a" * 64
    assert "no such directory" in fetch(tmp_path / "nowhere", model).stderr
    result = fetch(tmp_path, model, model)
    assert result.returncode == 2 and "the same file name twice: x.gguf" in result.stderr


def test_spec_parsing() -> None:
    sha = "b" * 64
    assert parse_spec({"files": [{"url": "https://h/a/b.gguf?download=1", "sha256": sha}]}, "s") == [
        ModelFile(url="https://h/a/b.gguf?download=1", sha256=sha, name="b.gguf")]
    assert parse_spec(None, "s") == []
    for bad, words in (({"files": [{"url": "https://h/b.gguf"}]}, "files[0]: needs url and sha256"),
                       ({"files": [{"url": "https://h/b.gguf", "sha256": sha, "size": 1}]}, "unknown keys ['size']"),
                       ([1], "expected a mapping")):
        with pytest.raises(SpecError, match=re.escape(words)):
            parse_spec(bad, "s")
