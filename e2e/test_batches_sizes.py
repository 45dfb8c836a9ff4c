"""Big inputs through the Batch API, with the real Envoy and the real sidecar process: a 100 MB
file of one line is refused by its line number, never read whole (the sidecar's peak memory
grows by less than the line), while the sidecar serves; a 50,000-line batch (batches.maxRequests'
default) completes with every custom_id once."""

from __future__ import annotations

import json
import pathlib
import threading

import openai
import pytest

from batches_e2e import batch_config, chat_line, create, each_once, ended, jsonl, sdk, serves_interactive
from fake_llama import FakeLlamaServer
from harness import running_stack

MB = 1024 * 1024


def _vm_bytes(pid: int, field: str) -> int:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def test_a_100_mb_line_is_refused_by_its_number_without_being_read_whole(tmp_path: pathlib.Path) -> None:
    with running_stack(tmp_path, batch_config(tmp_path), fake=FakeLlamaServer(router=True)) as stack:
        client = sdk(stack)
        pid = stack.sidecar.popen.pid
        assert serves_interactive(stack)
        peak_before = _vm_bytes(pid, "VmHWM")
        line = json.dumps(chat_line("big", "@")).replace('"@"', json.dumps("x" * (100 * MB))).encode()
        data = jsonl([chat_line("small-1"), line, chat_line("small-3")])
        served: list[bool] = []
        try:
            file_id = client.files.create(file=("big.jsonl", data), purpose="batch").id
        except openai.BadRequestError as refused:  # refused as it arrives: it names the line too
            assert "line 2" in str(refused.value) and "batches.maxLineBytes" in str(refused.value)
        else:
            batch = create(client, file_id)
            # An interactive request while the sidecar reads the file, and one after.
            beside = threading.Thread(target=lambda: served.append(serves_interactive(stack)))
            beside.start()
            failed = ended(client, batch.id, "failed")
            beside.join(60)
            assert served == [True]
            assert failed.errors is not None and failed.errors.data is not None
            assert [(error.line, error.code) for error in failed.errors.data] == [(2, "line_too_long")]
            assert "batches.maxLineBytes" in (failed.errors.data[0].message or "")
        assert serves_interactive(stack)
        # The upload streams to disk and the line is skipped, not parsed: the sidecar's peak
        # memory grew by less than the line itself (parsing it would hold it a few times over).
        assert _vm_bytes(pid, "VmHWM") - peak_before < 100 * MB
        client.close()


@pytest.mark.slow
def test_a_50000_line_batch_completes_with_every_line_once(tmp_path: pathlib.Path) -> None:
    with running_stack(tmp_path, batch_config(tmp_path), fake=FakeLlamaServer(router=True)) as stack:
        client = sdk(stack)
        lines = [chat_line(f"n{n}", f"q{n}") for n in range(50_000)]
        batch = create(client, client.files.create(file=("many.jsonl", jsonl(lines)), purpose="batch").id)
        done = ended(client, batch.id, "completed", timeout=1200)
        assert done.request_counts is not None and done.request_counts.completed == 50_000
        output, errors = each_once(client, done, [line["custom_id"] for line in lines])
        assert errors == [] and [record["custom_id"] for record in output] == [line["custom_id"] for line in lines]
        assert serves_interactive(stack)
        client.close()
