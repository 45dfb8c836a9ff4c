"""Tiny random-weight llama GGUF models for end-to-end tests.

The real llama-server needs a real model file; shipping or fetching one is not
an option, so these files are generated on the fly: a float32 llama with a
SentencePiece-style vocabulary, small enough (well under 1 MB) that loading and
generating take milliseconds. The output is gibberish, which is fine: the tests
only care about timing, token counts and model swapping.

Usage: ``python e2e/tinymodels.py DIR`` writes ``DIR/tiny-a.gguf`` and
``DIR/tiny-b.gguf``.
"""

from __future__ import annotations

import pathlib
import sys

import gguf
import numpy as np

# Model shape. Small but llama-shaped: head_dim = 64 / 4 = 16, which every CPU
# kernel handles; no GQA (kv heads == heads) to keep the tensor shapes obvious.
N_EMBD = 64
N_BLOCKS = 2
N_HEADS = 4
N_FF = 256
N_CTX = 2048  # trained context; llama-server's default -c follows it

# Pieces beyond the special and byte tokens. "\u2581" is SentencePiece's word
# boundary marker; having whole words lets the tokenizer produce multi-byte
# tokens instead of falling back to bytes for everything.
_WORDS = (
    "the a an and of to in is it that for on with as was be at by this are or "
    "from not but have hello world model token test swap load fast slow yes no"
).split()
_PIECES: list[str] = ["\u2581"] + [f"\u2581{w}" for w in _WORDS] + list("abcdefghijklmnopqrstuvwxyz")

UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
# A logit_bias that bans the byte tokens 0x80..0xFF (after unk, bos and eos): the pieces of
# multi-byte characters, whose ids llama-server leaves out of its stream when one comes alone, so
# that every token a stopped line read can be kept (issue 46's tests and bench/preempt.py).
BANNED_HIGH_BYTES = {str(EOS_ID + 1 + byte): -1000 for byte in range(0x80, 0x100)}


def vocabulary(size: int | None = None) -> tuple[list[bytes], list[float], list[int]]:
    """Token texts, scores and types in the layout llama.cpp's SPM tokenizer expects: the special
    tokens, the 256 byte tokens, the pieces above, then numbered pieces up to `size` tokens (a real
    vocabulary's size, for bench/gpu/models.py) where given."""
    tokens: list[bytes] = [b"<unk>", b"<s>", b"</s>"]
    types: list[int] = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    scores: list[float] = [0.0, 0.0, 0.0]
    # Byte-fallback tokens make any input text tokenizable.
    for b in range(256):
        tokens.append(f"<0x{b:02X}>".encode())
        types.append(gguf.TokenType.BYTE)
        scores.append(0.0)
    pieces = _PIECES
    if size is not None:
        pieces = pieces + [f"\u2581p{i}" for i in range(size - len(tokens) - len(pieces))]
    # SPM merges greedily by score: longer pieces get higher scores so that
    # whole words win over single letters.
    for piece in pieces:
        tokens.append(piece.encode("utf-8"))
        types.append(gguf.TokenType.NORMAL)
        scores.append(float(len(piece)) - 10.0)
    return tokens, scores, [int(t) for t in types]


def add_llama_metadata(writer: gguf.GGUFWriter, *, name: str, file_type: gguf.LlamaFileType, context: int,
                       embedding: int, blocks: int, feed_forward: int, heads: int, kv_heads: int, rope_base: float,
                       vocabulary: tuple[list[bytes], list[float], list[int]]) -> None:
    """The keys llama.cpp needs of a llama GGUF, with an SPM vocabulary (tokens, scores, types) whose
    first three are unk, bos and eos. Shared with bench/gpu/models.py (real shapes, on a GPU)."""
    tokens, scores, types = vocabulary
    writer.add_name(name)
    writer.add_file_type(file_type)
    writer.add_context_length(context)
    writer.add_embedding_length(embedding)
    writer.add_block_count(blocks)
    writer.add_feed_forward_length(feed_forward)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(embedding // heads)
    writer.add_rope_freq_base(rope_base)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("llama")  # "llama" = SentencePiece (SPM) in llama.cpp
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(UNK_ID)
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_ID)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)


def write_tiny_llama_gguf(path: pathlib.Path, *, seed: int = 0, name: str = "tiny",
                          context: int = N_CTX) -> pathlib.Path:
    """Write a random-weight float32 llama GGUF to ``path`` and return the path.

    Different seeds give different weights (and so different outputs), which
    lets tests tell two models apart. ``context``: the trained context, which
    caps llama-server's ``-c``.
    """
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    tokens, scores, types = vocabulary()
    n_vocab = len(tokens)

    def rand(*shape: int) -> np.ndarray:
        # Small scale keeps activations finite through the untrained layers.
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    def ones(n: int) -> np.ndarray:
        # Norm weights of 1 make RMSNorm a plain normalisation.
        return np.ones(n, dtype=np.float32)

    writer = gguf.GGUFWriter(str(path), "llama")
    add_llama_metadata(writer, name=name, file_type=gguf.LlamaFileType.ALL_F32, context=context, embedding=N_EMBD,
                       blocks=N_BLOCKS, feed_forward=N_FF, heads=N_HEADS, kv_heads=N_HEADS, rope_base=10000.0,
                       vocabulary=(tokens, scores, types))

    # numpy shapes are the reverse of GGUF's ne[]: (rows=out, cols=in).
    writer.add_tensor("token_embd.weight", rand(n_vocab, N_EMBD))
    writer.add_tensor("output_norm.weight", ones(N_EMBD))
    writer.add_tensor("output.weight", rand(n_vocab, N_EMBD))
    for i in range(N_BLOCKS):
        blk = f"blk.{i}"
        writer.add_tensor(f"{blk}.attn_norm.weight", ones(N_EMBD))
        writer.add_tensor(f"{blk}.attn_q.weight", rand(N_EMBD, N_EMBD))
        writer.add_tensor(f"{blk}.attn_k.weight", rand(N_EMBD, N_EMBD))
        writer.add_tensor(f"{blk}.attn_v.weight", rand(N_EMBD, N_EMBD))
        writer.add_tensor(f"{blk}.attn_output.weight", rand(N_EMBD, N_EMBD))
        writer.add_tensor(f"{blk}.ffn_norm.weight", ones(N_EMBD))
        writer.add_tensor(f"{blk}.ffn_gate.weight", rand(N_FF, N_EMBD))
        writer.add_tensor(f"{blk}.ffn_up.weight", rand(N_FF, N_EMBD))
        writer.add_tensor(f"{blk}.ffn_down.weight", rand(N_EMBD, N_FF))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_tiny_pair(directory: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    """Write tiny-a.gguf and tiny-b.gguf (different seeds) into ``directory``."""
    directory = pathlib.Path(directory)
    a = write_tiny_llama_gguf(directory / "tiny-a.gguf", seed=1, name="tiny-a")
    b = write_tiny_llama_gguf(directory / "tiny-b.gguf", seed=2, name="tiny-b")
    return a, b


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python e2e/tinymodels.py DIR", file=sys.stderr)
        return 2
    for p in write_tiny_pair(pathlib.Path(args[0])):
        print(f"{p} ({p.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
