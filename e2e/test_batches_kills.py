"""The sidecar killed (SIGKILL) inside each window of a batch's work, with the real Envoy and the
real sidecar process: after answers came and before their results were written, during
validation (once: it resumes; twice: the batch fails and the node does not crash again), during
finalize before and after the rename of the output file, during a cancel and during an upload.
After the restart every custom_id is in the output and error files exactly once, nothing
temporary is left in batches.dir, the batch reaches a terminal status, and the sidecar serves.

Each window is found without a hook in the sidecar: the fake upstream holds lines until told;
strace holds the sidecar's renames or its reads of one file (`batches_e2e.RenameHold`); another
process holds the database's write lock; a FIFO stands in for an input file being read."""

from __future__ import annotations

import collections
import errno
import json
import os
import pathlib
import signal
import socket
from typing import Any

import pytest

from batches_e2e import (
    RenameHold,
    batch_config,
    chat_line,
    create,
    database_write_lock,
    each_once,
    ended,
    jsonl,
    leftovers,
    listed_file_ids,
    sdk,
    serves_interactive,
    strace_missing,
    upload,
)
from fake_llama import FakeLlamaServer
from harness import SidecarProcess, Stack, running_stack, wait_for

INGRESS_COMPLETED = "http.ingress.downstream_rq_completed"


def _kill(stack: Stack, hold: RenameHold | None = None) -> None:
    stack.sidecar.signal(signal.SIGKILL)
    if hold is not None:
        hold.stop()  # a traced process's end reaches its parent once its tracer lets it go
    stack.sidecar.popen.wait(timeout=30)


def _restart(stack: Stack, name: str = "sidecar-again") -> None:
    stack.sidecar.stop()
    stack.sidecar = SidecarProcess(stack.config_path, stack.workdir, name=name)


def _contents(fake: FakeLlamaServer) -> collections.Counter[str]:
    return collections.Counter(json.loads(body)["messages"][0]["content"] for body in fake.bodies)


def _output_id(batch_id: str) -> str:
    return f"file-{batch_id.removeprefix('batch_')}-output"


def _clean_and_serving(stack: Stack, client: Any) -> None:
    batches_dir = stack.workdir / "batches"
    assert leftovers(batches_dir, listed_file_ids(client)) == []
    assert serves_interactive(stack)


def test_a_kill_after_answers_came_and_before_their_results_were_written(tmp_path: pathlib.Path) -> None:
    fake = FakeLlamaServer(router=True)
    first, second = b"first;", b"second;"
    fake.hold_marked(first)
    fake.hold_marked(second)
    with running_stack(tmp_path, batch_config(tmp_path, inFlight=4), fake=fake) as stack:
        client = sdk(stack)
        lines = ([chat_line(f"q{n}", f"quick {n}") for n in range(4)] +
                 [chat_line(f"a{n}", f"first; {n}") for n in range(4)] +
                 [chat_line(f"b{n}", f"second; {n}") for n in range(4)])
        batch = create(client, upload(client, lines))
        wait_for(lambda: client.batches.retrieve(batch.id).request_counts.completed == 4  # type: ignore[union-attr]
                 and fake.marked_count(first) == 4, what="four lines done, four held upstream")
        answered_before = stack.envoy.stat(INGRESS_COMPLETED)
        with database_write_lock(tmp_path / "batches"):
            # The four held lines are answered and their answers delivered through Envoy; the
            # sidecar cannot commit their results: kill it there.
            fake.release_marked(first)
            wait_for(lambda: sum(first in body for body in fake.answered) == 4
                     and stack.envoy.stat(INGRESS_COMPLETED) >= answered_before + 4,
                     what="the four answers delivered to the sidecar")
            _kill(stack)
        fake.hold_marked(first)  # what is sent again waits, so the counts below are the kill's
        _restart(stack)
        resumed = client.batches.retrieve(batch.id)
        assert resumed.status == "in_progress" and resumed.request_counts is not None
        # The kill landed in the window: four results kept, the four answered ones lost.
        assert (resumed.request_counts.completed, resumed.request_counts.failed) == (4, 0)
        fake.release_marked(first)
        fake.release_marked(second)
        done = ended(client, batch.id, "completed")
        output, errors = each_once(client, done, [line["custom_id"] for line in lines])
        assert errors == [] and all(record["response"]["status_code"] == 200 for record in output)
        sent = _contents(fake)
        assert all(sent[f"first; {n}"] == 2 for n in range(4)) and all(sent[f"quick {n}"] == 1 for n in range(4))
        _clean_and_serving(stack, client)
        client.close()


def _fifo_in_place_of(path: pathlib.Path) -> bytes:
    """Put a FIFO where the file is (the test writes what the sidecar reads); the file's bytes."""
    data = path.read_bytes()
    path.unlink()
    os.mkfifo(path)
    return data


def _reader_opened(fifo: pathlib.Path) -> int | None:
    """A write end of the FIFO once a reader has it open (the sidecar began to read), else None."""
    try:
        return os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ENXIO:
            return None
        raise


def _validation_lines(count: int) -> list[dict[str, Any]]:
    # Lines of about 2 KB: the file spans several of the validator's reads.
    return [chat_line(f"v{n}", f"line {n} " + "x" * 2000) for n in range(count)]


def _start_reading_and_kill(stack: Stack, fifo: pathlib.Path, data: bytes) -> None:
    """Once the sidecar opened the FIFO to validate it, give it half the file, then kill it."""
    writer = wait_for(lambda: _reader_opened(fifo), what="the sidecar validating (the input opened)")
    try:
        os.set_blocking(writer, True)
        os.write(writer, data[:len(data) // 2])
        _kill(stack)
    finally:
        os.close(writer)


def test_a_kill_during_validation_validates_again_after_the_restart(tmp_path: pathlib.Path) -> None:
    with running_stack(tmp_path, batch_config(tmp_path), fake=FakeLlamaServer(router=True)) as stack:
        client = sdk(stack)
        lines = _validation_lines(600)
        file_id = upload(client, lines)
        stored = tmp_path / "batches" / "files" / file_id
        data = _fifo_in_place_of(stored)
        batch = create(client, file_id)
        _start_reading_and_kill(stack, stored, data)
        stored.unlink()
        stored.write_bytes(data)
        _restart(stack)
        done = ended(client, batch.id, "completed")
        each_once(client, done, [line["custom_id"] for line in lines])
        _clean_and_serving(stack, client)
        client.close()


def test_a_batch_whose_validation_is_killed_twice_fails_and_the_sidecar_serves(tmp_path: pathlib.Path) -> None:
    from llamaswap.batches.output import Stage

    with running_stack(tmp_path, batch_config(tmp_path), fake=FakeLlamaServer(router=True)) as stack:
        client = sdk(stack)
        file_id = upload(client, _validation_lines(600))
        stored = tmp_path / "batches" / "files" / file_id
        data = _fifo_in_place_of(stored)
        batch = create(client, file_id)
        _start_reading_and_kill(stack, stored, data)
        _restart(stack)
        _start_reading_and_kill(stack, stored, data)  # the second attempt, killed as the first
        stored.unlink()
        stored.write_bytes(data)
        _restart(stack, "sidecar-third")
        failed = ended(client, batch.id, "failed")
        assert failed.errors is not None and failed.errors.data is not None
        assert [error.code for error in failed.errors.data] == [Stage.VALIDATE.failure[0]]
        assert failed.output_file_id is None and failed.error_file_id is None
        _clean_and_serving(stack, client)
        client.close()


def _finalize_killed(tmp_path: pathlib.Path, at: str) -> None:
    """A batch's last lines answered with the sidecar's renames held by strace (at `at`): kill it
    as it renames its output file into place, start it again."""
    fake = FakeLlamaServer(router=True)
    last = b"last;"
    fake.hold_marked(last)
    with running_stack(tmp_path, batch_config(tmp_path, inFlight=4), fake=fake) as stack:
        client = sdk(stack)
        lines = [chat_line(f"f{n}", f"quick {n}") for n in range(6)] + [chat_line(f"l{n}", f"last; {n}")
                                                                       for n in range(2)]
        batch = create(client, upload(client, lines))
        wait_for(lambda: client.batches.retrieve(batch.id).request_counts.completed == 6  # type: ignore[union-attr]
                 and fake.marked_count(last) == 2, what="six lines done, the last two held")
        files_dir = tmp_path / "batches" / "files"
        output = files_dir / _output_id(batch.id)
        hold = RenameHold(stack.sidecar.popen.pid, tmp_path, at=at)
        try:
            fake.release_marked(last)
            wait_for(lambda: hold.holding(output.name), what="the output file's rename held")
            if at == "enter":
                # Written in full under a temporary name, not yet renamed into place.
                assert not output.exists()
            else:
                wait_for(output.exists, what="the output file in place")
            _kill(stack, hold)
        finally:
            hold.stop()
        _restart(stack)
        done = ended(client, batch.id, "completed")
        written, errors = each_once(client, done, [line["custom_id"] for line in lines])
        assert errors == [] and done.output_file_id == output.name
        # Each line went to the upstream once: finalizing again read the results kept.
        assert max(_contents(fake).values()) == 1
        _clean_and_serving(stack, client)
        client.close()


@pytest.mark.skipif(strace_missing() is not None, reason=strace_missing() or "")
def test_a_kill_during_finalize_before_the_output_file_is_renamed(tmp_path: pathlib.Path) -> None:
    _finalize_killed(tmp_path, "enter")


@pytest.mark.skipif(strace_missing() is not None, reason=strace_missing() or "")
def test_a_kill_during_finalize_after_the_output_file_is_renamed(tmp_path: pathlib.Path) -> None:
    _finalize_killed(tmp_path, "exit")


@pytest.mark.skipif(strace_missing() is not None, reason=strace_missing() or "")
def test_a_kill_during_a_cancel_ends_the_batch_cancelled_after_the_restart(tmp_path: pathlib.Path) -> None:
    fake = FakeLlamaServer(router=True)
    held = b"held;"
    fake.hold_marked(held)
    with running_stack(tmp_path, batch_config(tmp_path, inFlight=2), fake=fake) as stack:
        client = sdk(stack)
        lines = [chat_line(f"c{n}", f"quick {n}") for n in range(2)] + [chat_line(f"h{n}", f"held; {n}")
                                                                       for n in range(8)]
        batch = create(client, upload(client, lines))
        wait_for(lambda: client.batches.retrieve(batch.id).request_counts.completed == 2  # type: ignore[union-attr]
                 and fake.marked_count(held) == 2, what="two lines done, two held")
        output = tmp_path / "batches" / "files" / _output_id(batch.id)
        hold = RenameHold(stack.sidecar.popen.pid, tmp_path)
        try:
            assert client.batches.cancel(batch.id).status == "cancelling"
            # The cancel's end: the lines in flight abandoned, the rest ended cancelled, the
            # files being put in place: kill it there.
            wait_for(lambda: hold.holding(output.name), what="the cancelled batch's output rename held")
            _kill(stack, hold)
        finally:
            hold.stop()
        _restart(stack)
        done = ended(client, batch.id, "cancelled")
        written, errors = each_once(client, done, [line["custom_id"] for line in lines])
        assert sorted(record["custom_id"] for record in written) == ["c0", "c1"]
        assert {record["error"]["code"] for record in errors} == {"batch_cancelled"}
        # Nothing of the batch was sent after the cancel, nor after the restart.
        assert fake.marked_count(held) == 2
        fake.release_marked(held)
        _clean_and_serving(stack, client)
        client.close()


def test_a_kill_during_an_upload_leaves_no_file_and_nothing_on_disk(tmp_path: pathlib.Path) -> None:
    with running_stack(tmp_path, batch_config(tmp_path), fake=FakeLlamaServer(router=True)) as stack:
        client = sdk(stack)
        content = jsonl([chat_line(f"u{n}", "x" * 1000) for n in range(8000)])  # about 8 MB
        boundary = "llamaswap-e2e-boundary"
        head = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
                f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"big.jsonl\"\r\n"
                "Content-Type: application/jsonl\r\n\r\n").encode()
        tail = f"\r\n--{boundary}--\r\n".encode()
        batches_dir = tmp_path / "batches"
        before = {path for path in batches_dir.rglob("*") if path.is_file()}
        with socket.create_connection(("127.0.0.1", stack.envoy.port), timeout=30) as sock:
            sock.sendall((f"POST /v1/files HTTP/1.1\r\nHost: llamaswap\r\nAuthorization: Bearer unused\r\n"
                          f"Content-Type: multipart/form-data; boundary={boundary}\r\n"
                          f"Content-Length: {len(head) + len(content) + len(tail)}\r\n\r\n").encode() + head)
            sock.sendall(content[:len(content) // 2])

            def receiving() -> bool:
                return any(path.is_file() and path.stat().st_size > 0 and path not in before
                           for path in batches_dir.rglob("*"))
            # Half the file on its way to disk, the rest never sent: kill the sidecar there.
            wait_for(receiving, what="the upload being written to batches.dir")
            _kill(stack)
        _restart(stack)
        assert client.files.list().data == []
        _clean_and_serving(stack, client)
        client.close()
