"""`llamaswap simulate --max-loaded N` and a configuration's maxLoaded, pinned models and memory
(issue 37): the replay's GPUs carry the residency the sidecar would give them."""

from __future__ import annotations

import dataclasses
import io
import json
import pathlib

import pytest
from test_simulate import EXACT, parser, write_log

from llamaswap.commands.simulate import _node_policy
from llamaswap.config import parse_config
from llamaswap.core.residency import Residency
from llamaswap.simulate.settings import Settings, SettingsError, override, parse_sweep, combinations

GiB = 1 << 30
PINNING = {
    "upstream": {"url": "http://127.0.0.1:8081", "maxLoaded": 3, "memory": "80GiB"},
    "models": {"A": {"memory": "40GiB"}, "B": {"memory": "1GiB", "pinned": True}},
}


def run(tmp_path: pathlib.Path, argv: list[str]) -> tuple[dict | None, str, int]:
    log = write_log(tmp_path / "activity.log", EXACT)
    out, err = io.StringIO(), io.StringIO()
    args = parser().parse_args(["simulate", "--activity", str(log), "--format", "json", *argv])
    status = args.run(args, out=out, err=err)
    return (json.loads(out.getvalue()) if status == 0 else None), err.getvalue(), status


def configured() -> Settings:
    return Settings.from_policy(_node_policy(parse_config(PINNING), None, 1))


def test_the_configuration_gives_each_gpu_its_residency() -> None:
    settings = configured()
    assert settings.max_loaded == 3 and not settings.max_loaded_everywhere
    (gpu,) = settings.policy().gpus
    assert gpu.residency == Residency(3, frozenset({"B"}), 80 * GiB, {"A": 40 * GiB, "B": GiB})


def test_a_flag_sets_every_gpus_max_loaded_and_keeps_pins_and_budget() -> None:
    (gpu,) = override(configured(), {"maxLoaded": "2"}).policy().gpus
    assert gpu.residency == Residency(2, frozenset({"B"}), 80 * GiB, {"A": 40 * GiB, "B": GiB})
    # 1: one model at a time, exactly as before
    (gpu,) = override(configured(), {"maxLoaded": "1"}).policy().gpus
    assert gpu.residency == Residency()


def test_without_a_configuration_the_flag_gives_every_gpu_n() -> None:
    from llamaswap.config import Config

    base = dataclasses.replace(Settings.from_policy(Config().policy()), gpus=2)
    assert [gpu.residency for gpu in base.policy().gpus] == [Residency(), Residency()]
    gpus = override(base, {"maxLoaded": "3"}).policy().gpus
    assert [(gpu.name, gpu.residency) for gpu in gpus] == [("gpu0", Residency(3)), ("gpu1", Residency(3))]


def test_fewer_than_the_pinned_models_is_refused() -> None:
    settings = Settings.from_policy(_node_policy(parse_config({
        "upstream": {"maxLoaded": 4},
        "models": {"A": {"pinned": True}, "B": {"pinned": True}, "C": {"pinned": True}}}), None, 1))
    with pytest.raises(SettingsError, match=r"maxLoaded 2: gpu0 pins 3 models \(A, B, C\) in -c FILE"):
        override(settings, {"maxLoaded": "2"}).policy()
    assert override(settings, {"maxLoaded": "3"}).policy().gpus[0].residency.max_loaded == 3


def test_the_flag_and_the_sweep_reach_the_report(tmp_path: pathlib.Path) -> None:
    document, err, status = run(tmp_path, ["--max-loaded", "3"])
    assert status == 0, err
    assert document["rows"][0]["settings"]["maxLoaded"] == 3
    settings = combinations(configured(), [parse_sweep("maxLoaded=1,3")])
    assert [(s.max_loaded, s.max_loaded_everywhere) for s in settings] == [(1, True), (3, True)]
    document, err, status = run(tmp_path, ["--sweep", "maxLoaded=1,2"])
    assert status == 0, err
    assert [row["settings"]["maxLoaded"] for row in document["rows"]] == [1, 2]


def test_the_configurations_max_loaded_is_the_default(tmp_path: pathlib.Path) -> None:
    config = tmp_path / "llamaswap.yaml"
    config.write_text(json.dumps(PINNING))
    document, err, status = run(tmp_path, ["-c", str(config)])
    assert status == 0, err
    assert document["rows"][0]["settings"]["maxLoaded"] == 3


@pytest.mark.parametrize("value", ["0", "x", "-2"])
def test_a_bad_max_loaded_exits_2(tmp_path: pathlib.Path, value: str) -> None:
    _, err, status = run(tmp_path, ["--max-loaded", value])
    assert status == 2
    assert f"error: --max-loaded {value}:" in err
