"""llama-server's command line, known in one module (`config.llama_command`): what the configuration
reads of a command and what `llamaswap up` writes into it agree."""

from __future__ import annotations

import pytest

from llamaswap.commands.resident import router_command
from llamaswap.config.llama_command import (
    ROUTER_MODELS_MAX_DEFAULT,
    flag_value,
    models_dir,
    router_models_max,
    with_models_max,
)

ROUTERS = [
    ["llama-server", "--models-dir", "/m"],
    ["llama-server", "--models-dir=/m"],
    ["env", "LLAMA_ARG_MODELS_DIR=/m", "llama-server"],
    ["llama-server", "--models-dir", "/m", "--models-max", "2"],
    ["llama-server", "--models-max=7", "--models-dir", "/m"],
]
NOT_ROUTERS = [
    ["llama-server", "-m", "/m/a.gguf"],
    ["llama-server", "-m", "/m/a.gguf", "--port", "8082"],
    ["python", "-m", "fake_upstream"],
]


@pytest.mark.parametrize("command", ROUTERS)
def test_what_up_writes_into_a_router_command_is_what_the_configuration_reads_back(command: list[str]) -> None:
    written = with_models_max(command, 5)
    assert written is not None
    assert router_models_max(written) == 5
    assert models_dir(written) == models_dir(command) is not None
    assert router_command(" ".join(command), 5) == written  # a command written as a string too


@pytest.mark.parametrize("command", NOT_ROUTERS)
def test_a_command_that_starts_no_router_is_left_alone_and_read_as_none(command: list[str]) -> None:
    assert with_models_max(command, 5) is None
    assert router_models_max(command) is None
    assert router_command(command, 5) == command


def test_a_router_without_models_max_keeps_llama_servers_default() -> None:
    assert router_models_max(["llama-server", "--models-dir", "/m"]) == ROUTER_MODELS_MAX_DEFAULT


def test_the_last_flag_wins_and_a_flag_beats_the_variable() -> None:
    command = ["env", "LLAMA_ARG_CTX_SIZE=1024", "llama-server", "-c", "2048", "--ctx-size=4096"]
    assert flag_value(command, ("-c", "--ctx-size"), "LLAMA_ARG_CTX_SIZE") == "4096"
    assert flag_value(command[:2] + ["llama-server"], ("-c", "--ctx-size"), "LLAMA_ARG_CTX_SIZE") == "1024"
