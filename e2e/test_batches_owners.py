"""Who sees what in the Batch API, with the real Envoy and the real sidecar process: each caller
(by its key in batches.apiKeys, or by the header the operator's proxy sets) sees only the files
and batches it created, others get 404 as if none were there, and an admin sees all."""

from __future__ import annotations

import pathlib
from typing import Any

import openai
import pytest

from batches_e2e import batch_config, chat_line, create, ended, records, sdk, upload
from fake_llama import FakeLlamaServer
from harness import Stack, running_stack

KEYS = {"ALICE_KEY": "alice-secret", "BOB_KEY": "bob-secret", "OPS_KEY": "ops-secret"}


def _keys_config(tmp_path: pathlib.Path) -> dict[str, Any]:
    return batch_config(tmp_path, apiKeys=[{"name": "alice", "key": "env:ALICE_KEY"},
                                           {"name": "bob", "key": "env:BOB_KEY"},
                                           {"name": "ops", "key": "env:OPS_KEY", "admin": True}])


def _sees_none_of(other: openai.OpenAI, file_id: str, batch_id: str) -> None:
    """`other` finds neither the file nor the batch: not listed, 404 for every call that names them."""
    assert other.files.list().data == []
    assert other.batches.list().data == []
    for call in (lambda: other.files.retrieve(file_id), lambda: other.files.content(file_id),
                 lambda: other.files.delete(file_id), lambda: other.batches.retrieve(batch_id),
                 lambda: other.batches.cancel(batch_id),
                 lambda: create(other, file_id)):
        with pytest.raises(openai.NotFoundError):
            call()


def _alice_batch(stack: Stack, alice: openai.OpenAI) -> tuple[str, Any]:
    file_id = upload(alice, [chat_line(f"a{n}", f"alice's prompt {n}") for n in range(3)])
    return file_id, ended(alice, create(alice, file_id).id, "completed")


def test_a_caller_by_key_sees_only_its_own_and_the_admin_key_sees_all(tmp_path: pathlib.Path) -> None:
    with running_stack(tmp_path, _keys_config(tmp_path), fake=FakeLlamaServer(router=True),
                       sidecar_env=KEYS) as stack:
        alice, bob, ops = sdk(stack, KEYS["ALICE_KEY"]), sdk(stack, KEYS["BOB_KEY"]), sdk(stack, KEYS["OPS_KEY"])
        file_id, batch = _alice_batch(stack, alice)
        assert [record["custom_id"] for record in records(alice, batch.output_file_id)] == ["a0", "a1", "a2"]
        _sees_none_of(bob, file_id, batch.id)
        with pytest.raises(openai.NotFoundError):
            bob.files.content(batch.output_file_id)  # type: ignore[arg-type]
        # Bob's own work is his: Alice does not see it either.
        bob_file = upload(bob, [chat_line("b0", "bob's prompt")])
        assert [item.id for item in bob.files.list().data] == [bob_file]
        assert bob_file not in {item.id for item in alice.files.list().data}
        with pytest.raises(openai.NotFoundError):
            alice.files.retrieve(bob_file)
        # The admin key sees and reads everyone's.
        assert {item.id for item in ops.files.list().data} == {file_id, batch.output_file_id, bob_file}
        assert [item.id for item in ops.batches.list().data] == [batch.id]
        assert ops.batches.retrieve(batch.id).status == "completed"
        assert [record["custom_id"] for record in records(ops, batch.output_file_id)] == ["a0", "a1", "a2"]
        # No key, or one not configured: refused.
        for stranger in (sdk(stack, "nobody"),):
            with pytest.raises(openai.AuthenticationError):
                stranger.files.list()
            stranger.close()
        for client in (alice, bob, ops):
            client.close()


def test_a_caller_named_by_the_trusted_header_sees_only_its_own(tmp_path: pathlib.Path) -> None:
    config = batch_config(tmp_path, callerHeader="x-caller", adminCallers=["ops"])
    with running_stack(tmp_path, config, fake=FakeLlamaServer(router=True)) as stack:
        alice, bob = sdk(stack, **{"x-caller": "alice"}), sdk(stack, **{"x-caller": "bob"})
        ops = sdk(stack, **{"x-caller": "ops"})
        file_id, batch = _alice_batch(stack, alice)
        _sees_none_of(bob, file_id, batch.id)
        assert {item.id for item in ops.files.list().data} == {file_id, batch.output_file_id}
        assert ops.batches.retrieve(batch.id).id == batch.id
        for client in (alice, bob, ops):
            client.close()
