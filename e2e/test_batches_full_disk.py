"""The Batch API's disk with the real Envoy and the real sidecar process: a full disk (a small
tmpfs mounted as batches.dir) pauses a batch, which finishes once space is freed with no line
sent twice; batches.maxStoredBytes refuses an upload that would pass it; files expire (the
sidecar started again with its wall clock ahead, as if the hour had passed)."""

from __future__ import annotations

import collections
import contextlib
import json
import os
import pathlib
import subprocess
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from batches_e2e import (
    batch_config,
    chat_line,
    create,
    each_once,
    ended,
    jsonl,
    leftovers,
    listed_file_ids,
    sdk,
    serves_interactive,
    shifted_clock_command,
    truncate_wal,
    upload,
)
from fake_llama import FakeLlamaServer
from harness import SidecarProcess, Stack, running_stack, wait_for

HOUR_S = 3600


@contextlib.contextmanager
def small_filesystem(path: pathlib.Path, size: str = "4m") -> Iterator[pathlib.Path]:
    """A tmpfs of `size` mounted at `path` (skips the test where mounting is refused)."""
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"a small filesystem for batches.dir cannot be mounted here (mount -t tmpfs: "
                    f"{(mounted.stderr or mounted.stdout).strip()}); needs root and mount rights")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False, capture_output=True)


def fill(directory: pathlib.Path) -> pathlib.Path:
    """A file that takes every byte left on the filesystem of `directory`."""
    filler = directory / "filler"
    with open(filler, "wb", buffering=0) as out:
        for chunk in (1 << 20, 1 << 12, 1):
            try:
                while True:
                    out.write(b"\0" * chunk)
            except OSError:
                continue
    return filler


def test_a_full_disk_pauses_the_batch_and_it_finishes_once_space_is_freed(tmp_path: pathlib.Path) -> None:
    fake = FakeLlamaServer(router=True)
    held, later = b"held;", b"later;"
    fake.hold_marked(held)
    fake.hold_marked(later)
    with small_filesystem(tmp_path / "batches") as batches_dir, \
            running_stack(tmp_path, batch_config(tmp_path, inFlight=4), fake=fake) as stack:
        client = sdk(stack)
        lines = ([chat_line(f"q{n}", f"quick {n}") for n in range(4)] +
                 [chat_line(f"h{n}", f"held; {n}") for n in range(4)] +
                 [chat_line(f"l{n}", f"later; {n}") for n in range(8)])
        batch = create(client, upload(client, lines))
        wait_for(lambda: client.batches.retrieve(batch.id).request_counts.completed == 4  # type: ignore[union-attr]
                 and fake.marked_count(held) == 4, what="four lines done, four held")
        truncate_wal(batches_dir)
        filler = fill(batches_dir)
        # Answers whose results cannot be written: kept, not asked again (the lines started
        # before the write failed are answered too).
        fake.release_marked(held)
        wait_for(lambda: sum(held in body for body in fake.answered) == 4, what="the held lines answered")
        fake.release_marked(later)

        def paused() -> Any:
            batch_now = client.batches.retrieve(batch.id)
            sent_later = fake.marked_count(later)
            answered_later = sum(later in body for body in fake.answered)
            idle = batch_now.model_extra["llamaswap"]["in_flight"] == 0  # type: ignore[index]
            return batch_now if idle and answered_later == sent_later else None
        waiting = wait_for(paused, what="nothing of the batch in flight")
        assert waiting.status == "in_progress" and waiting.request_counts is not None
        # Nothing written while the disk is full: the counts are those from before it filled.
        assert (waiting.request_counts.completed, waiting.request_counts.failed) == (4, 0)
        filler.unlink()
        done = ended(client, batch.id, "completed")
        output, errors = each_once(client, done, [line["custom_id"] for line in lines])
        assert errors == [] and all(record["response"]["status_code"] == 200 for record in output)
        # No line went to the upstream twice: none was sent again for want of a written result.
        sent = collections.Counter(json.loads(body)["messages"][0]["content"] for body in fake.bodies)
        assert sent == collections.Counter(line["body"]["messages"][0]["content"] for line in lines)
        assert leftovers(batches_dir, listed_file_ids(client)) == []
        assert serves_interactive(stack)
        client.close()


def test_the_quota_refuses_an_upload_that_would_pass_it(tmp_path: pathlib.Path) -> None:
    with running_stack(tmp_path, batch_config(tmp_path, maxStoredBytes=100_000),
                       fake=FakeLlamaServer(router=True)) as stack:
        client = sdk(stack)
        data = jsonl([chat_line(f"r{n}", "x" * 500) for n in range(100)])  # about 60 KB
        kept = client.files.create(file=("first.jsonl", data), purpose="batch")
        with pytest.raises(openai.APIStatusError) as refused:
            client.files.create(file=("second.jsonl", data), purpose="batch")
        assert refused.value.status_code == 413
        assert refused.value.code == "storage_quota_exceeded"  # type: ignore[attr-defined]
        assert "batches.maxStoredBytes" in str(refused.value)
        assert listed_file_ids(client) == {kept.id}
        assert leftovers(tmp_path / "batches", {kept.id}) == []
        # Space given back (the first file deleted), the same upload fits.
        client.files.delete(kept.id)
        again = client.files.create(file=("second.jsonl", data), purpose="batch")
        assert listed_file_ids(client) == {again.id}
        client.close()


def _restart_later(stack: Stack, offset_s: int, name: str) -> None:
    """The sidecar stopped and started again with its wall clock `offset_s` ahead."""
    stack.sidecar.stop()
    stack.sidecar = SidecarProcess(stack.config_path, stack.workdir, name=name,
                                   command=shifted_clock_command(offset_s))


def test_files_expire_an_upload_at_its_expires_after_and_an_output_at_the_default(tmp_path: pathlib.Path) -> None:
    config = batch_config(tmp_path, outputExpirySeconds=2 * HOUR_S)
    with running_stack(tmp_path, config, fake=FakeLlamaServer(router=True)) as stack:
        client = sdk(stack)
        lines = [chat_line(f"x{n}") for n in range(3)]
        short = client.files.create(file=("short.jsonl", jsonl(lines)), purpose="batch",
                                    expires_after={"anchor": "created_at", "seconds": HOUR_S})
        assert short.expires_at == short.created_at + HOUR_S
        kept = client.files.create(file=("kept.jsonl", jsonl(lines)), purpose="batch")
        assert kept.expires_at is None
        done = ended(client, create(client, kept.id).id, "completed")
        output = client.files.retrieve(done.output_file_id)  # type: ignore[arg-type]
        assert output.expires_at is not None and output.created_at <= output.expires_at <= output.created_at + \
            2 * HOUR_S + 5
        files_dir = tmp_path / "batches" / "files"
        # An hour and a minute later: the short upload is gone (row and bytes), the rest stay.
        _restart_later(stack, HOUR_S + 60, "sidecar-later")
        wait_for(lambda: not (files_dir / short.id).exists(), what="the expired upload deleted")
        with pytest.raises(openai.NotFoundError):
            client.files.retrieve(short.id)
        assert listed_file_ids(client) == {kept.id, output.id}
        # Past the output's expiry: it goes too; the upload without expires_after stays.
        _restart_later(stack, 2 * HOUR_S + 120, "sidecar-later-still")
        wait_for(lambda: not (files_dir / output.id).exists(), what="the expired output deleted")
        assert listed_file_ids(client) == {kept.id}
        with pytest.raises(openai.NotFoundError):
            client.files.content(output.id)
        assert leftovers(tmp_path / "batches", {kept.id}) == []
        assert sorted(os.listdir(files_dir)) == [kept.id]
        assert serves_interactive(stack)
        client.close()
