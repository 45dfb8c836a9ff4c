"""Random-weight llama GGUF files with the shapes of real models, for measuring on a GPU.

No model can be downloaded on the GPU machine, and the costs measured there (a load, a
token's step, several models on one device) depend on a model's shapes and bytes, not on what
its weights say. So the files are written there: llama architecture, float16 weights drawn once
and shared by every tensor (each tensor a view of one buffer: writing 16 GB costs a copy to
disk, not 8 billion random draws), a SentencePiece-style vocabulary padded to `vocab` pieces (e2e/tinymodels.py's).

Shapes (`SHAPES`): `1b` is Llama 3.2 1B's, `8b` Llama 3 8B's, both with a 32,000-piece
vocabulary instead of 128,256 (the output layer is then smaller than the real one's: 0.13 of
1.24 billion weights for 1b, 0.13 of 8.03 for 8b, against 0.53 each); `cpu` is a small one for
trying the whole script on a CPU (and `cpu2`, the same shape with other weights).

Usage: python bench/gpu/models.py DIR [NAME ...]   (default: 1b 8b)
"""

from __future__ import annotations

import dataclasses
import pathlib
import sys

import gguf
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent.parent / "e2e"))
from tinymodels import add_llama_metadata, vocabulary  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Shape:
    embedding: int
    blocks: int
    heads: int
    kv_heads: int
    feed_forward: int
    vocab: int
    context: int

    @property
    def head_dim(self) -> int:
        return self.embedding // self.heads

    def parameters(self) -> int:
        """Weights in the file (norms included)."""
        kv = self.kv_heads * self.head_dim
        per_block = (2 * self.embedding * self.embedding + 2 * self.embedding * kv
                     + 3 * self.embedding * self.feed_forward + 2 * self.embedding)
        return self.blocks * per_block + 2 * self.vocab * self.embedding + self.embedding


SHAPES: dict[str, Shape] = {
    "1b": Shape(embedding=2048, blocks=16, heads=32, kv_heads=8, feed_forward=8192, vocab=32000, context=8192),
    "8b": Shape(embedding=4096, blocks=32, heads=32, kv_heads=8, feed_forward=14336, vocab=32000, context=8192),
    "cpu": Shape(embedding=256, blocks=2, heads=4, kv_heads=2, feed_forward=512, vocab=1000, context=8192),
}
SHAPES["cpu2"] = SHAPES["cpu"]

def write_model(path: pathlib.Path, shape: Shape, *, name: str, seed: int = 0) -> pathlib.Path:
    """Write a float16 llama GGUF of `shape` to `path` and return the path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    kv = shape.kv_heads * shape.head_dim
    largest = max(shape.vocab * shape.embedding, shape.feed_forward * shape.embedding)
    rng = np.random.default_rng(seed)
    # Small values keep activations finite through untrained layers.
    weights = (rng.standard_normal(largest, dtype=np.float32) * 0.02).astype(np.float16)

    def matrix(rows: int, cols: int) -> np.ndarray:  # numpy's (rows, cols) is GGUF's ne = [cols, rows]
        return weights[: rows * cols].reshape(rows, cols)

    ones = np.ones(shape.embedding, dtype=np.float32)
    writer = gguf.GGUFWriter(str(path), "llama")
    add_llama_metadata(writer, name=name, file_type=gguf.LlamaFileType.MOSTLY_F16, context=shape.context,
                       embedding=shape.embedding, blocks=shape.blocks, feed_forward=shape.feed_forward,
                       heads=shape.heads, kv_heads=shape.kv_heads, rope_base=500000.0,
                       vocabulary=vocabulary(shape.vocab))
    writer.add_tensor("token_embd.weight", matrix(shape.vocab, shape.embedding))
    writer.add_tensor("output_norm.weight", ones)
    writer.add_tensor("output.weight", matrix(shape.vocab, shape.embedding))
    for i in range(shape.blocks):
        block = f"blk.{i}"
        writer.add_tensor(f"{block}.attn_norm.weight", ones)
        writer.add_tensor(f"{block}.attn_q.weight", matrix(shape.embedding, shape.embedding))
        writer.add_tensor(f"{block}.attn_k.weight", matrix(kv, shape.embedding))
        writer.add_tensor(f"{block}.attn_v.weight", matrix(kv, shape.embedding))
        writer.add_tensor(f"{block}.attn_output.weight", matrix(shape.embedding, shape.embedding))
        writer.add_tensor(f"{block}.ffn_norm.weight", ones)
        writer.add_tensor(f"{block}.ffn_gate.weight", matrix(shape.feed_forward, shape.embedding))
        writer.add_tensor(f"{block}.ffn_up.weight", matrix(shape.feed_forward, shape.embedding))
        writer.add_tensor(f"{block}.ffn_down.weight", matrix(shape.embedding, shape.feed_forward))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python bench/gpu/models.py DIR [NAME ...]  (names: " + ", ".join(SHAPES) + ")",
              file=sys.stderr)
        return 2
    directory = pathlib.Path(argv[0])
    names = argv[1:] or ["1b", "8b"]
    unknown = [n for n in names if n not in SHAPES]
    if unknown:
        print(f"unknown model shape(s) {unknown}; known: {', '.join(SHAPES)}", file=sys.stderr)
        return 2
    for seed, name in enumerate(names):
        path = write_model(directory / f"{name}.gguf", SHAPES[name], name=name, seed=seed)
        print(f"{path}: {SHAPES[name].parameters() / 1e9:.2f} B weights, {path.stat().st_size / 2**30:.2f} GiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
