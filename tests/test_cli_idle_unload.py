"""`llamaswap up --idle-unload S` (issue 48): upstream.idleUnloadSeconds S in the configuration `up`
runs, over the file's and its globalTTL, a model's own ttl kept."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from llamaswap.commands.main import build_parser
from llamaswap.commands.resident import idle_unload_flag, with_idle_unload
from llamaswap.commands.up import effective_config, reload_parser
from llamaswap.core.clock import NS_PER_S

URL = "http://127.0.0.1:9001"
ROUTER = "llama-server --models-dir /m --port 9001"


def test_the_document_gets_the_idle_time_on_the_upstream_and_the_entries_that_set_their_own() -> None:
    document = {"globalTTL": 60, "upstream": {"slots": 2},
                "upstreams": [{"name": "a", "url": URL, "idleUnloadSeconds": 5},
                              {"name": "b", "url": "http://127.0.0.1:9002"}]}
    assert with_idle_unload(document, 300.0) == {
        "upstream": {"slots": 2, "idleUnloadSeconds": 300.0},
        "upstreams": [{"name": "a", "url": URL, "idleUnloadSeconds": 300.0},
                      {"name": "b", "url": "http://127.0.0.1:9002"}]}
    assert document["globalTTL"] == 60 and "idleUnloadSeconds" not in document["upstream"]  # (not changed)


def test_the_flag_over_the_file_keeps_a_models_own_ttl() -> None:
    document = {"globalTTL": 60, "upstream": {"url": URL, "command": ROUTER, "maxLoaded": 2},
                "models": {"a": {"ttl": 10}, "b": {}}}
    config, built_in = effective_config(document, source="f.yaml", idle_unload=600.0)
    assert not built_in and config.upstream.idle_unload_seconds == 600.0
    idle = config.policy().gpu("gpu0").residency.idle
    assert (idle.after_ns("a"), idle.after_ns("b")) == (10 * NS_PER_S, 600 * NS_PER_S)
    assert reload_parser(None, None, 600.0)(document, "f.yaml") == config  # a reload reads it as `up` started it
    assert effective_config(document, source="f.yaml")[0].upstream.idle_unload_seconds == 60.0  # without: globalTTL


def test_the_flag_is_seconds() -> None:
    assert idle_unload_flag("600") == 600.0 and idle_unload_flag("0") == 0.0 and idle_unload_flag("1.5") == 1.5
    for bad in ("-1", "ten", "nan", "0.0001"):
        with pytest.raises(ValueError, match="seconds a model may sit idle"):
            idle_unload_flag(bad)
    assert build_parser().parse_args(["up", "--idle-unload", "30"]).idle_unload == 30.0
    assert build_parser().parse_args(["up"]).idle_unload is None


def test_up_print_config_shows_it_and_a_bad_value_exits_2(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(f"upstream: {{url: '{URL}', command: '{ROUTER}'}}\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parents[1] / "sidecar"),
                                                                     os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, "-m", "llamaswap", "up", "-c", str(path), "--idle-unload", "30",
                             "--print-config"], capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr
    assert yaml.safe_load(result.stdout)["upstream"]["idleUnloadSeconds"] == 30.0
    bad = subprocess.run([sys.executable, "-m", "llamaswap", "up", "--idle-unload", "-5", "--print-config"],
                         capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env)
    assert bad.returncode == 2 and "--idle-unload: must be the seconds a model may sit idle" in bad.stderr
