"""Several models resident on one upstream, the configuration side (issue 37): upstream.maxLoaded
and memory (and on each entry of upstreams), models.<id>.memory and pinned; the sizes from GGUF
files; `Config.residency_of`; what check-config says about them."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import yaml
from test_gguf_memory import write_metadata_only

from llamaswap.config import ConfigError, Config, json_schema, parse_config
from llamaswap.config.advice import advice
from llamaswap.config.gguf_memory import estimate_model_bytes
from llamaswap.config.llama_command import router_models_max
from llamaswap.config.residency import describe_residency
from llamaswap.core.residency import Residency

GiB = 1 << 30
SOURCE_ROOT = str(pathlib.Path(__file__).resolve().parents[1] / "sidecar")
URL = "http://127.0.0.1:8081"


def problems_of(document: dict) -> list[tuple[str, str]]:
    with pytest.raises(ConfigError) as info:
        parse_config(document)
    return [(problem.path, problem.message) for problem in info.value.problems]


def check_config(path: pathlib.Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [SOURCE_ROOT, os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "llamaswap", "check-config", "-c", str(path)],
                          cwd=path.parent, capture_output=True, text=True, timeout=60, env=env)


RAG = {
    "upstream": {"url": URL, "maxLoaded": 3, "memory": "80GiB"},
    "models": {"chat": {"memory": "40GiB"}, "embed": {"memory": "1GiB", "pinned": True},
               "big": {"memory": "90GiB"}},
}


# -- the keys ----------------------------------------------------------------------------------


def test_the_defaults_keep_one_model_and_no_budget() -> None:
    cfg = Config()
    assert (cfg.upstream.max_loaded, cfg.upstream.memory) == (1, None)
    assert cfg.residency_of("gpu0") == Residency()
    assert cfg.residency_of("gpu0").max_loaded == 1
    document = cfg.to_document()
    assert (document["upstream"]["maxLoaded"], document["upstream"]["memory"]) == (1, None)


def test_the_keys_reach_the_residency_of_the_one_upstream() -> None:
    cfg = parse_config(RAG)
    residency = cfg.residency_of("gpu0")
    assert residency == Residency(3, frozenset({"embed"}), 80 * GiB,
                                  {"chat": 40 * GiB, "embed": GiB, "big": 90 * GiB})
    assert residency.fits({"chat", "embed"}) and residency.never_fits("big")
    assert (cfg.models["embed"].pinned, cfg.models["chat"].pinned, cfg.models["chat"].memory) == (True, False, 40 * GiB)


@pytest.mark.parametrize(("written", "size", "document"), [
    ("80GiB", 80 * GiB, "80GiB"), ("512MiB", 512 << 20, "512MiB"), ("1.5GB", 1_500_000_000, 1_500_000_000),
    (1 << 20, 1 << 20, "1MiB"), ("1000", 1000, 1000), ("2 gib", 2 * GiB, "2GiB"),
])
def test_a_size_is_read_in_any_unit_and_written_back_whole(written, size, document) -> None:
    cfg = parse_config({"upstream": {"url": URL, "maxLoaded": 2, "memory": written},
                        "models": {"m": {"memory": written}}})
    assert (cfg.upstream.memory, cfg.models["m"].memory) == (size, size)
    out = cfg.to_document()
    assert (out["upstream"]["memory"], out["models"]["m"]["memory"]) == (document, document)
    assert parse_config(yaml.safe_load(yaml.safe_dump(out))) == cfg


def test_each_entry_of_upstreams_has_its_own_or_takes_upstreams() -> None:
    cfg = parse_config({
        "upstream": {"maxLoaded": 2, "memory": "24GiB"},
        "upstreams": [
            {"name": "big", "url": URL, "maxLoaded": 4, "memory": "141GiB"},
            {"name": "small", "url": "http://127.0.0.1:8082", "models": ["embed", "chat"]},
            {"name": "one", "url": "http://127.0.0.1:8083", "maxLoaded": 1, "models": ["chat"]},
        ],
        "models": {"embed": {"memory": "1GiB", "pinned": True}, "chat": {"memory": "16GiB"},
                   "huge": {"memory": "100GiB"}},
    })
    big, small, one = (cfg.residency_of(name) for name in ("big", "small", "one"))
    assert (big.max_loaded, big.memory_bytes, big.pinned) == (4, 141 * GiB, frozenset({"embed"}))
    assert big.model_bytes == {"embed": GiB, "chat": 16 * GiB, "huge": 100 * GiB}
    # small lists its models: only they need a size there, and embed is pinned there too
    assert (small.max_loaded, small.memory_bytes, small.pinned) == (2, 24 * GiB, frozenset({"embed"}))
    assert small.model_bytes == {"embed": GiB, "chat": 16 * GiB}
    # one does not serve embed: nothing pinned, and one model at a time
    assert (one.max_loaded, one.pinned) == (1, frozenset())
    assert [(e.name, e.max_loaded, e.memory) for e in cfg.gpu_entries] == [
        ("big", 4, 141 * GiB), ("small", 2, 24 * GiB), ("one", 1, 24 * GiB)]


def test_an_unknown_upstream_is_a_key_error_naming_the_ones_there_are() -> None:
    with pytest.raises(KeyError, match="gpu7.*gpu0"):
        Config().residency_of("gpu7")


def test_the_schema_describes_the_keys_and_takes_the_example() -> None:
    import jsonschema

    schema = json_schema()
    validator = jsonschema.Draft202012Validator(schema)
    validator.validate(RAG)
    validator.validate(parse_config(RAG).to_document())
    for bad in ({"upstream": {"maxLoaded": 0}}, {"upstream": {"memory": True}}, {"models": {"m": {"pinned": "yes"}}}):
        assert list(validator.iter_errors(bad)), bad


# -- refused -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("document", "path", "fragment"), [
    ({"upstream": {"maxLoaded": 0}}, "upstream.maxLoaded", ">= 1"),
    ({"upstream": {"maxLoaded": "3"}}, "upstream.maxLoaded", "integer"),
    ({"upstream": {"memory": "lots"}}, "upstream.memory", "80GiB"),
    ({"upstream": {"memory": "0GiB"}}, "upstream.memory", "more than 0"),
    ({"upstream": {"memory": "1.5"}}, "upstream.memory", "whole number of bytes"),
    ({"models": {"m": {"memory": [1]}}}, "models.m.memory", "a size such as"),
    ({"models": {"m": {"pinned": 1}}}, "models.m.pinned", "true or false"),
    ({"upstreams": [{"name": "gpu0", "url": URL, "maxLoaded": -1}]}, "upstreams[0].maxLoaded", ">= 1"),
    ({"upstreams": [{"name": "gpu0", "url": URL, "memory": "1XB"}]}, "upstreams[0].memory", "KiB"),
    # pinned needs room beside it
    ({"models": {"embed": {"pinned": True}}}, "models.embed.pinned", "set upstream.maxLoaded >= 2"),
    ({"upstreams": [{"name": "a", "url": URL, "maxLoaded": 1}], "upstream": {"maxLoaded": 3},
      "models": {"embed": {"pinned": True}}}, "models.embed.pinned", "set upstreams[0].maxLoaded >= 2"),
    ({"upstream": {"maxLoaded": 2}, "models": {"a": {"pinned": True}, "b": {"pinned": True}, "c": {"pinned": True}}},
     "upstream.maxLoaded", "pins 3 models (a, b, c) and keeps 2 at once: set upstream.maxLoaded to 4"),
    ({"upstream": {"maxLoaded": 2, "memory": "10GiB"}, "models": {"a": {"pinned": True, "memory": "11GiB"}}},
     "models.a.pinned", "a takes 11.0 GiB (models.a.memory), more than gpu0's memory (upstream.memory: 10GiB)"),
    ({"upstream": {"maxLoaded": 3, "memory": "10GiB"},
      "models": {"a": {"pinned": True, "memory": "6GiB"}, "b": {"pinned": True, "memory": "6GiB"}}},
     "upstream.memory", "the pinned models (a, b) take 12.0 GiB together"),
    # a budget needs every model's size
    ({"upstream": {"maxLoaded": 2, "memory": "10GiB"}, "models": {"a": {"memory": "1GiB"}, "b": {}}},
     "models.b.memory", "its command gives no --models-dir"),
    ({"upstream": {"maxLoaded": 2, "memory": "10GiB"}}, "upstream.memory",
     "knows no model it serves (no models.<id>, and its command gives no --models-dir): set models.<id>.memory"),
    ({"upstream": {"maxLoaded": 2, "memory": "10GiB", "url": URL, "command": "llama-server --models-dir /nowhere"}},
     "upstream.memory", "knows no model it serves (no GGUF file in /nowhere, its command's --models-dir)"),
    ({"upstreams": [{"name": "gpu0", "url": URL, "maxLoaded": 2, "memory": "10GiB", "models": ["x"]}]},
     "models.x.memory", "(upstreams[0].memory: 10GiB)"),
])
def test_a_bad_residency_names_its_key_and_the_fix(document, path, fragment) -> None:
    problems = problems_of(document)
    assert [p for p, _ in problems] == [path], problems
    assert fragment in problems[0][1]


def test_check_config_refuses_a_model_without_a_size_with_exit_2(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"upstream": {"url": URL, "maxLoaded": 2, "memory": "10GiB"},
                                    "models": {"chat": {}}}))
    result = check_config(path)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "models.chat.memory: is needed" in result.stderr and "Set models.chat.memory" in result.stderr


# -- sizes from GGUF files ---------------------------------------------------------------------


@pytest.fixture
def models(tmp_path: pathlib.Path) -> pathlib.Path:
    directory = tmp_path / "models"
    directory.mkdir()
    write_metadata_only(directory / "chat.gguf", context=8192, embedding=256, blocks=4, heads=8, kv_heads=2)
    write_metadata_only(directory / "embed.gguf", context=512, embedding=128, blocks=2, heads=4, kv_heads=4)
    (directory / "mmproj-chat.gguf").write_bytes(b"not read")
    (directory / "notes.txt").write_text("not a model")
    return directory


def test_a_budget_estimates_each_gguf_of_the_models_dir_at_the_commands_context(models) -> None:
    command = ["llama-server", "--models-dir", str(models), "-c", "2048", "--port", "8081"]
    cfg = parse_config({"upstream": {"url": URL, "command": command, "maxLoaded": 2, "memory": "1GiB"},
                        "models": {"embed": {"memory": "100MiB", "pinned": True}}})
    residency = cfg.residency_of("gpu0")
    assert residency.model_bytes == {"chat": estimate_model_bytes(models / "chat.gguf", 2048),
                                     "embed": 100 << 20}
    assert cfg.model_sizes("gpu0")["chat"].source == (f"estimated from {models / 'chat.gguf'}: file + KV cache at "
                                                      "context 2048")
    assert cfg.model_sizes("gpu0")["embed"].source == "models.embed.memory"


def test_without_a_context_the_estimate_is_at_the_models_own_and_reads_the_cache_type(models) -> None:
    command = ["llama-server", f"--models-dir={models}", "--cache-type-k", "q8_0", "-ctv", "q8_0"]
    cfg = parse_config({"upstream": {"url": URL, "command": command, "maxLoaded": 2, "memory": "1GiB"}})
    assert cfg.residency_of("gpu0").model_bytes == {
        "chat": estimate_model_bytes(models / "chat.gguf", 0, 34 / 32),
        "embed": estimate_model_bytes(models / "embed.gguf", 0, 34 / 32)}
    assert "at its trained context" in cfg.model_sizes("gpu0")["chat"].source


def test_a_model_with_no_file_in_the_models_dir_needs_its_memory(models) -> None:
    command = ["llama-server", "--models-dir", str(models)]
    problems = problems_of({"upstream": {"url": URL, "command": command, "maxLoaded": 2, "memory": "1GiB"},
                            "models": {"ghost": {}}})
    assert problems == [("models.ghost.memory",
                         f"is needed: gpu0 has a memory budget (upstream.memory: 1GiB) and llamaswap cannot estimate "
                         f"ghost's size (no ghost.gguf in {models}). Set models.ghost.memory to what it takes loaded "
                         f"(its file plus its KV cache, e.g. 8GiB), or remove the budget")]


def test_an_unreadable_gguf_needs_its_memory(models) -> None:
    (models / "broken.gguf").write_bytes(b"GGUF\x03")
    command = ["llama-server", "--models-dir", str(models)]
    problems = problems_of({"upstream": {"url": URL, "command": command, "maxLoaded": 2, "memory": "1GiB"}})
    assert [path for path, _ in problems] == ["models.broken.memory"]
    assert "its GGUF file cannot be read" in problems[0][1]
    fixed = parse_config({"upstream": {"url": URL, "command": command, "maxLoaded": 2, "memory": "1GiB"},
                          "models": {"broken": {"memory": "10MiB"}}})
    assert fixed.residency_of("gpu0").bytes_of("broken") == 10 << 20


def test_without_a_budget_no_file_is_read(tmp_path) -> None:
    command = ["llama-server", "--models-dir", str(tmp_path / "absent")]
    cfg = parse_config({"upstream": {"url": URL, "command": command, "maxLoaded": 3},
                        "models": {"a": {"memory": "2GiB"}, "b": {}}})
    assert cfg.residency_of("gpu0") == Residency(3, frozenset(), None, {"a": 2 * GiB})


# -- what check-config says --------------------------------------------------------------------


def test_check_config_explains_what_fits() -> None:
    assert describe_residency(parse_config(RAG)) == [
        "gpu0: up to 3 models resident at once (upstream.maxLoaded), within 80.0 GiB (upstream.memory)",
        "gpu0: pinned, never evicted: embed",
        "gpu0: sizes: big 90.0 GiB (models.big.memory), chat 40.0 GiB (models.chat.memory), "
        "embed 1.0 GiB (models.embed.memory)",
        "gpu0: big (90.0 GiB) can never be resident in 80.0 GiB: it is larger than the budget",
        "gpu0: chat and embed fit together",
    ]


def test_check_config_names_the_pairs_that_never_fit_together() -> None:
    cfg = parse_config({"upstream": {"maxLoaded": 3, "memory": "80GiB"},
                        "models": {"chat": {"memory": "40GiB"}, "code": {"memory": "45GiB"},
                                   "small": {"memory": "4GiB"}, "embed": {"memory": "1GiB", "pinned": True}}})
    assert describe_residency(cfg)[3:] == [
        "gpu0: chat and code are never resident together (86.0 GiB with the pinned models, over 80.0 GiB)"]


def test_check_config_says_one_model_beside_the_pinned_ones_and_any_two() -> None:
    cfg = parse_config({"upstream": {"maxLoaded": 2, "memory": "80GiB"},
                        "models": {"chat": {"memory": "40GiB"}, "code": {"memory": "30GiB"},
                                   "embed": {"memory": "1GiB", "pinned": True}}})
    assert describe_residency(cfg)[-1] == "gpu0: one model at a time beside the pinned ones (embed)"
    cfg = parse_config({"upstream": {"maxLoaded": 2, "memory": "80GiB"},
                        "models": {"a": {"memory": "10GiB"}, "b": {"memory": "10GiB"}, "c": {"memory": "10GiB"}}})
    assert describe_residency(cfg)[-1] == "gpu0: any two of a, b and c fit together, not all at once"


def test_check_config_says_nothing_for_one_model_and_counts_without_a_budget() -> None:
    assert describe_residency(Config()) == []
    cfg = parse_config({"upstream": {"maxLoaded": 4}, "models": {"e": {"pinned": True}}})
    assert describe_residency(cfg) == ["gpu0: up to 4 models resident at once (upstream.maxLoaded)",
                                       "gpu0: pinned, never evicted: e"]


def test_advice_warns_of_a_budget_with_one_model_and_a_router_that_evicts_on_its_own() -> None:
    cfg = parse_config({"upstream": {"memory": "80GiB"}, "models": {"m": {"memory": "1GiB"}}})
    assert [(p.path, p.message.split(",")[0]) for p in advice(cfg)] == [
        ("upstream.memory", "gpu0 keeps one model at a time (upstream.maxLoaded: 1)")]
    assert describe_residency(cfg) == [
        "gpu0: one model resident at a time (upstream.maxLoaded: 1): the memory budget does not apply"]
    command = "llama-server --models-dir /models --models-max 2 --port 8081"
    cfg = parse_config({"upstream": {"url": URL, "command": command, "maxLoaded": 3}})
    [warning] = advice(cfg)
    assert warning.path == "upstream.maxLoaded"
    assert "keeping 2 models (--models-max)" in warning.message and "Pass --models-max 3" in warning.message
    # the router's default is 4; --models-max above maxLoaded is no problem
    assert router_models_max(["llama-server", "--models-dir", "/m"]) == 4
    assert router_models_max(["llama-server", "-m", "/m/a.gguf"]) is None
    wide = command + " --models-max=8"
    assert advice(parse_config({"upstream": {"url": URL, "maxLoaded": 5, "command": wide}})) == []
    assert [p.path for p in advice(parse_config({"upstream": {"url": URL, "maxLoaded": 5,
                                                             "command": "llama-server --models-dir /m"}}))] == [
        "upstream.maxLoaded"]


def test_check_config_prints_the_residency(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(RAG))
    result = check_config(path)
    assert result.returncode == 0, result.stderr
    lines = [line.strip() for line in result.stdout.splitlines()]
    assert "gpu0: up to 3 models resident at once (upstream.maxLoaded), within 80.0 GiB (upstream.memory)" in lines
    assert "gpu0: big (90.0 GiB) can never be resident in 80.0 GiB: it is larger than the budget" in lines


def test_advice_warns_when_the_pinned_models_fill_every_place() -> None:
    cfg = parse_config({"upstream": {"maxLoaded": 2}, "models": {"a": {"pinned": True}, "b": {"pinned": True}}})
    [warning] = advice(cfg)
    assert warning.path == "upstream.maxLoaded"
    assert warning.message == ("gpu0 pins 2 models (a, b) and keeps 2 at once: no other model can ever load there. "
                               "Set upstream.maxLoaded to 3 or more, or unpin one")
    assert advice(parse_config({"upstream": {"maxLoaded": 3}, "models": {"a": {"pinned": True}}})) == []


def test_the_commands_variables_count_where_it_gives_no_flag(models) -> None:
    command = ["env", "CUDA_VISIBLE_DEVICES=0", f"LLAMA_ARG_MODELS_DIR={models}", "LLAMA_ARG_CTX_SIZE=1024",
               "LLAMA_ARG_CACHE_TYPE_K=q8_0", "llama-server", "--port", "8081"]
    cfg = parse_config({"upstream": {"url": URL, "command": command, "maxLoaded": 2, "memory": "1GiB"}})
    assert cfg.residency_of("gpu0").bytes_of("chat") == estimate_model_bytes(models / "chat.gguf", 1024,
                                                                            (34 / 32 + 2) / 2)
    # a flag wins over the variable, as in llama-server
    assert router_models_max(["env", "LLAMA_ARG_MODELS_MAX=2", "llama-server", "--models-max", "5"]) == 5
    assert router_models_max(["env", "LLAMA_ARG_MODELS_MAX=2", "llama-server"]) == 2
    # 0 is no limit: nothing to warn of
    assert router_models_max(["llama-server", "--models-dir", "/m", "--models-max", "0"]) is None
