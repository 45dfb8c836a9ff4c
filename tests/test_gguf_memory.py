"""Reading a GGUF file's metadata, a model's KV cache and memory estimate, and configuration sizes
(llamaswap.config.gguf_memory, groundwork for issue 37). The GGUF files are real: written by gguf-py,
through e2e/tinymodels.py's writer where it fits."""

from __future__ import annotations

import pathlib
import struct

import gguf
import pytest
from tinymodels import N_BLOCKS, N_EMBD, N_HEADS, add_llama_metadata, vocabulary, write_tiny_llama_gguf

from llamaswap.config.gguf_memory import (
    GgufError,
    SkippedArray,
    estimate_model_bytes,
    kv_cache_bytes,
    parse_size,
    read_gguf_metadata,
)


def write_metadata_only(path: pathlib.Path, *, context: int, embedding: int, blocks: int, heads: int, kv_heads: int,
                        key_length: int | None = None, value_length: int | None = None,
                        endianess: gguf.GGUFEndian = gguf.GGUFEndian.LITTLE,
                        vocab_size: int | None = None) -> pathlib.Path:
    """A llama GGUF with tinymodels' metadata (and its vocabulary) and no tensors: the shape is all
    an estimate reads."""
    writer = gguf.GGUFWriter(str(path), "llama", endianess=endianess)
    add_llama_metadata(writer, name="shape", file_type=gguf.LlamaFileType.MOSTLY_F16, context=context,
                       embedding=embedding, blocks=blocks, feed_forward=4 * embedding, heads=heads,
                       kv_heads=kv_heads, rope_base=10000.0, vocabulary=vocabulary(vocab_size))
    if key_length is not None:
        writer.add_key_length(key_length)
    if value_length is not None:
        writer.add_value_length(value_length)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return write_tiny_llama_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", name="tiny-x", context=4096)


# --- reading the metadata ---

def test_reads_the_metadata_of_a_real_model(tiny):
    metadata = read_gguf_metadata(tiny)
    assert metadata["general.architecture"] == "llama"
    assert metadata["general.name"] == "tiny-x"
    assert metadata["llama.context_length"] == 4096
    assert metadata["llama.embedding_length"] == N_EMBD == 64
    assert metadata["llama.block_count"] == N_BLOCKS == 2
    assert metadata["llama.attention.head_count"] == N_HEADS == 4
    assert metadata["llama.attention.head_count_kv"] == 4
    assert metadata["llama.rope.freq_base"] == 10000.0  # a float32
    assert metadata["llama.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-5)
    assert metadata["tokenizer.ggml.model"] == "llama"
    assert metadata["tokenizer.ggml.add_bos_token"] is True  # a bool, not 1
    assert metadata["tokenizer.ggml.add_eos_token"] is False
    assert metadata["tokenizer.ggml.bos_token_id"] == 1


def test_string_arrays_are_skipped_with_their_length_unless_asked(tiny):
    tokens, scores, types = vocabulary()
    metadata = read_gguf_metadata(tiny)
    assert metadata["tokenizer.ggml.tokens"] == SkippedArray("string", len(tokens))
    # Arrays of numbers are read: cheap, and some (per-layer head counts) are needed.
    assert metadata["tokenizer.ggml.scores"] == pytest.approx(scores)
    assert metadata["tokenizer.ggml.token_type"] == types
    full = read_gguf_metadata(tiny, read_string_arrays=True)
    assert full["tokenizer.ggml.tokens"] == [token.decode() for token in tokens]
    assert {key: value for key, value in full.items() if key != "tokenizer.ggml.tokens"} == \
        {key: value for key, value in metadata.items() if key != "tokenizer.ggml.tokens"}


def test_a_vocabulary_larger_than_a_read(tmp_path):
    # 100,000 tokens: over 1 MiB of strings, so the walk through them reads more than one chunk.
    tokens = vocabulary(100_000)[0]
    path = write_metadata_only(tmp_path / "big.gguf", context=512, embedding=64, blocks=2, heads=4, kv_heads=4,
                               vocab_size=100_000)
    assert path.stat().st_size > 1_500_000
    metadata = read_gguf_metadata(path)
    assert metadata["tokenizer.ggml.tokens"] == SkippedArray("string", 100_000)
    assert metadata["tokenizer.ggml.eos_token_id"] == 2  # what follows the array is read in its place
    full = read_gguf_metadata(path, read_string_arrays=True)
    assert full["tokenizer.ggml.tokens"] == [token.decode() for token in tokens]
    assert full["tokenizer.ggml.eos_token_id"] == 2
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:1_200_000])  # inside the tokens, past the first chunk
    for read_string_arrays in (False, True):
        with pytest.raises(GgufError, match=r"truncated: the file ends inside 'tokenizer.ggml.tokens'\[") as caught:
            read_gguf_metadata(cut, read_string_arrays=read_string_arrays)
        assert str(cut) in str(caught.value)


def test_reads_a_big_endian_file(tmp_path):
    path = write_metadata_only(tmp_path / "be.gguf", context=512, embedding=64, blocks=3, heads=4, kv_heads=2,
                               endianess=gguf.GGUFEndian.BIG)
    assert path.read_bytes()[4:8] == struct.pack(">I", 3)
    metadata = read_gguf_metadata(path)
    assert metadata["llama.block_count"] == 3
    assert metadata["tokenizer.ggml.tokens"] == SkippedArray("string", len(vocabulary()[0]))


def every_type_file(path: pathlib.Path) -> pathlib.Path:
    writer = gguf.GGUFWriter(str(path), "test")
    writer.add_uint8("t.u8", 255)
    writer.add_int8("t.i8", -128)
    writer.add_uint16("t.u16", 65535)
    writer.add_int16("t.i16", -32768)
    writer.add_uint32("t.u32", 2**32 - 1)
    writer.add_int32("t.i32", -(2**31))
    writer.add_float32("t.f32", 0.5)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "h\u00e9llo")
    writer.add_uint64("t.u64", 2**64 - 1)
    writer.add_int64("t.i64", -(2**63))
    writer.add_float64("t.f64", 0.1)
    writer.add_array("t.ints", [1, 2, 3])
    writer.add_array("t.nested", [[1, 2], [3]])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return path


def test_every_value_type(tmp_path):
    metadata = read_gguf_metadata(every_type_file(tmp_path / "types.gguf"))
    assert {key: value for key, value in metadata.items() if key.startswith("t.")} == {
        "t.u8": 255, "t.i8": -128, "t.u16": 65535, "t.i16": -32768, "t.u32": 2**32 - 1, "t.i32": -(2**31),
        "t.f32": 0.5, "t.bool": True, "t.str": "h\u00e9llo", "t.u64": 2**64 - 1, "t.i64": -(2**63),
        "t.f64": 0.1, "t.ints": [1, 2, 3], "t.nested": SkippedArray("array", 2),
    }
    full = read_gguf_metadata(tmp_path / "types.gguf", read_string_arrays=True)
    assert full["t.nested"] == [[1, 2], [3]]


def test_empty_arrays(tmp_path):
    # By hand (gguf-py writes no empty array): an empty array of strings, then one of float64.
    path = tmp_path / "empty.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 2) + struct.pack("<Q", 1) + b"s" + struct.pack("<IIQ", 9, 8, 0)
                     + struct.pack("<Q", 1) + b"d" + struct.pack("<IIQ", 9, 12, 0))
    assert read_gguf_metadata(path) == {"s": SkippedArray("string", 0), "d": []}
    assert read_gguf_metadata(path, read_string_arrays=True) == {"s": [], "d": []}


def test_stops_before_the_tensor_infos(tiny):
    # A file cut right after the metadata (the tensor infos and data gone) still reads.
    data = tiny.read_bytes()
    reader = gguf.GGUFReader(tiny)
    # The end of the metadata: the offset gguf-py's reader records after the last field.
    last = max(reader.fields.values(), key=lambda field: field.offset)
    end = last.offset + sum(part.nbytes for part in last.parts)
    cut = tiny.parent / "cut.gguf"
    cut.write_bytes(data[:end])
    assert read_gguf_metadata(cut) == read_gguf_metadata(tiny)
    cut.write_bytes(data[:end - 1])
    with pytest.raises(GgufError, match="truncated"):
        read_gguf_metadata(cut)


# --- the one error type, naming the path ---

def test_a_truncated_file(tiny, tmp_path):
    data = tiny.read_bytes()
    for length in (6, 20, 200, 3000):  # in the version, the counts, a key, the vocabulary
        cut = tmp_path / f"cut-{length}.gguf"
        cut.write_bytes(data[:length])
        with pytest.raises(GgufError, match="truncated") as caught:
            read_gguf_metadata(cut)
        assert str(cut) in str(caught.value)


def test_a_file_that_is_not_gguf(tmp_path):
    for name, content in (("text.gguf", b"hello, this is not a model\n"), ("empty.gguf", b""),
                          ("ggml.bin", b"lmgg" + b"\0" * 64)):
        path = tmp_path / name
        path.write_bytes(content)
        with pytest.raises(GgufError, match="not a GGUF file") as caught:
            read_gguf_metadata(path)
        assert str(path) in str(caught.value)
        assert isinstance(caught.value, ValueError)


def test_a_wrong_version(tiny, tmp_path):
    data = tiny.read_bytes()
    for version in (1, 4):
        path = tmp_path / f"v{version}.gguf"
        path.write_bytes(data[:4] + struct.pack("<I", version) + data[8:])
        with pytest.raises(GgufError, match=f"GGUF version {version}, and llamaswap reads versions 2 and 3") as caught:
            read_gguf_metadata(path)
        assert str(path) in str(caught.value)
    # Version 2 has the same layout as 3 (64-bit counts and lengths): it reads.
    path = tmp_path / "v2.gguf"
    path.write_bytes(data[:4] + struct.pack("<I", 2) + data[8:])
    assert read_gguf_metadata(path)["llama.block_count"] == 2


def test_an_unknown_value_type(tmp_path):
    # Header, one key "k" whose value type is 13 (there is none).
    path = tmp_path / "unknown.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1) + b"k" + struct.pack("<I", 13))
    with pytest.raises(GgufError, match="unknown value type 13 for 'k'") as caught:
        read_gguf_metadata(path)
    assert str(path) in str(caught.value)
    # An unknown element type of an array, skipped or not.
    header = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1) + b"k"
    path.write_bytes(header + struct.pack("<IIQ", 9, 42, 0))
    for read_string_arrays in (False, True):
        with pytest.raises(GgufError, match="unknown element type 42 of 'k'"):
            read_gguf_metadata(path, read_string_arrays=read_string_arrays)
    # Inside a skipped array of arrays.
    path.write_bytes(header + struct.pack("<IIQ", 9, 9, 1) + struct.pack("<IQ", 42, 0))
    with pytest.raises(GgufError, match=r"unknown element type 42 of 'k'\[0\]"):
        read_gguf_metadata(path)


def test_a_missing_file_and_bad_utf8(tmp_path):
    with pytest.raises(GgufError, match="cannot read it") as caught:
        read_gguf_metadata(tmp_path / "absent.gguf")
    assert isinstance(caught.value.__cause__, FileNotFoundError)
    path = tmp_path / "latin1.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1) + b"\xe9")
    with pytest.raises(GgufError, match="not UTF-8") as caught:
        read_gguf_metadata(path)
    assert isinstance(caught.value.__cause__, UnicodeDecodeError)
    assert str(path) in str(caught.value)


# --- the KV cache and the estimate ---

def test_kv_cache_of_the_tiny_model(tiny):
    metadata = read_gguf_metadata(tiny)
    # 2 (K and V) x 2 blocks x 4 KV heads x 16 head dim (64 / 4) x context x 2 bytes (f16)
    assert kv_cache_bytes(metadata, 1024) == 2 * 2 * 4 * 16 * 1024 * 2 == 524_288
    # Context 0: the model's own (4096).
    assert kv_cache_bytes(metadata, 0) == 2 * 2 * 4 * 16 * 4096 * 2 == 2_097_152
    # q8_0: 34 bytes per 32 elements.
    assert kv_cache_bytes(metadata, 1024, 34 / 32) == 2 * 2 * 4 * 16 * 1024 * 34 // 32 == 278_528


def test_kv_cache_of_a_gqa_model(tmp_path):
    # Llama-3-8B's shape: 32 blocks, 32 heads, 8 KV heads, embedding 4096 (head dim 128).
    path = write_metadata_only(tmp_path / "gqa.gguf", context=8192, embedding=4096, blocks=32, heads=32, kv_heads=8)
    metadata = read_gguf_metadata(path)
    # 2 x 32 blocks x 8 KV heads x 128 x 8192 positions x 2 bytes = 1 GiB (not 4 GiB: GQA)
    assert kv_cache_bytes(metadata, 8192) == 2 * 32 * 8 * 128 * 8192 * 2 == 1 << 30
    assert kv_cache_bytes(metadata, 0) == 1 << 30
    assert kv_cache_bytes(metadata, 2048) == 2 * 32 * 8 * 128 * 2048 * 2 == 256 << 20


def test_kv_cache_without_head_count_kv_uses_the_head_count(tiny):
    metadata = read_gguf_metadata(tiny)
    del metadata["llama.attention.head_count_kv"]
    metadata["llama.attention.head_count"] = 8  # head dim 64 / 8 = 8
    assert kv_cache_bytes(metadata, 100) == 2 * 2 * 8 * 8 * 100 * 2 == 51_200


def test_kv_cache_with_key_and_value_lengths(tmp_path):
    # Gemma-style: head dim 256 though 2048 / 8 = 256 would agree; make them disagree on purpose.
    path = write_metadata_only(tmp_path / "kv.gguf", context=4096, embedding=2048, blocks=18, heads=8, kv_heads=1,
                               key_length=192, value_length=128)
    metadata = read_gguf_metadata(path)
    assert metadata["llama.attention.key_length"] == 192
    # 18 blocks x 1 KV head x (192 K + 128 V) x 4096 x 2 bytes
    assert kv_cache_bytes(metadata, 4096) == 18 * 1 * (192 + 128) * 4096 * 2 == 47_185_920
    # Only a key length: V keeps the head dimension (2048 / 8 = 256).
    del metadata["llama.attention.value_length"]
    assert kv_cache_bytes(metadata, 4096) == 18 * 1 * (192 + 256) * 4096 * 2 == 66_060_288


def test_kv_cache_with_per_layer_kv_heads(tiny):
    metadata = read_gguf_metadata(tiny)
    metadata["llama.attention.head_count_kv"] = [4, 0]  # the second block has no attention
    assert kv_cache_bytes(metadata, 1024) == 2 * (4 + 0) * 16 * 1024 * 2 == 262_144
    metadata["llama.attention.head_count_kv"] = [4, 4, 4]
    with pytest.raises(GgufError, match="one per block"):
        kv_cache_bytes(metadata, 1024)


def test_kv_cache_of_incomplete_metadata(tiny):
    metadata = read_gguf_metadata(tiny)
    for key, message in (("general.architecture", "general.architecture is None"),
                         ("llama.block_count", "no llama.block_count"),
                         ("llama.embedding_length", "no llama.embedding_length")):
        broken = dict(metadata)
        del broken[key]
        with pytest.raises(GgufError, match=message):
            kv_cache_bytes(broken, 1024)
    broken = dict(metadata)
    del broken["llama.context_length"]
    assert kv_cache_bytes(broken, 1024) == 524_288  # not needed with a context given
    with pytest.raises(GgufError, match="no llama.context_length"):
        kv_cache_bytes(broken, 0)
    with pytest.raises(GgufError, match="the context is -1"):
        kv_cache_bytes(metadata, -1)
    with pytest.raises(GgufError, match="block_count is 'two'"):
        kv_cache_bytes({**metadata, "llama.block_count": "two"}, 1024)


def test_estimate_is_the_file_plus_its_kv_cache(tiny, tmp_path):
    size = tiny.stat().st_size
    assert size > 100_000  # the tensors are in the file
    assert estimate_model_bytes(tiny, 1024) == size + 2 * 2 * 4 * 16 * 1024 * 2
    assert estimate_model_bytes(tiny, None) == size + 2 * 2 * 4 * 16 * 4096 * 2
    assert estimate_model_bytes(tiny, 0) == estimate_model_bytes(tiny, None)
    no_arch = tmp_path / "noarch.gguf"
    writer = gguf.GGUFWriter(str(no_arch), "llama")
    writer.kv_data[0].pop("general.architecture")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    with pytest.raises(GgufError, match="general.architecture is None") as caught:
        estimate_model_bytes(no_arch, 1024)
    assert str(no_arch) in str(caught.value)


# --- sizes in the configuration ---

@pytest.mark.parametrize(("text", "expected"), [
    ("1000000", 1_000_000), ("0", 0), ("512B", 512),
    ("1KiB", 1024), ("1MiB", 1024**2), ("80GiB", 80 * 1024**3), ("2TiB", 2 * 1024**4),
    ("1KB", 1000), ("3MB", 3_000_000), ("1.5GB", 1_500_000_000), ("2TB", 2 * 10**12),
    ("512mib", 512 * 1024**2), ("80gib", 80 * 1024**3), ("1.5gb", 1_500_000_000), ("4kb", 4000),
    ("1.5GiB", 1536 * 1024**2), ("0.5KiB", 512), (" 80 GiB ", 80 * 1024**3),
    ("1.1KiB", 1126),  # 1126.4 bytes: the fraction of a byte dropped
])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", " ", "80 parsecs", "-1GiB", "GiB", "1.5", "80GIBS", "1e9", "80 G", "1,5GB",
                                  "0x10", "80GiB extra", ".5GB", "5.GB"])
def test_parse_size_refuses(text):
    with pytest.raises(ValueError, match="KiB, MiB, GiB, TiB .binary. or KB, MB, GB, TB .decimal.") as caught:
        parse_size(text)
    assert repr(text) in str(caught.value)
