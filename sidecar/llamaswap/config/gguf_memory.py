"""A model's memory from its GGUF file, and memory sizes in the configuration (groundwork for issue 37).

`read_gguf_metadata` reads a GGUF file's header and metadata key/value pairs (the format of ggml's
docs/gguf.md, versions 2 and 3, little- or big-endian) without a third-party GGUF library, and stops
before the tensor infos. Arrays of strings (the tokenizer's vocabulary, its merges: hundreds of
thousands of entries) are skipped, not built: they come back as a `SkippedArray` with their length
only, unless asked for. Arrays of numbers and booleans are read in one go.

`estimate_model_bytes` is the file's size plus its KV cache at the context the model runs with
(`kv_cache_bytes`: K and V, for every layer, every KV head and every position of the context). What
the estimate leaves out:

- llama-server's compute buffers (the graph's scratch memory, which grows with the batch size
  ``-b``/``-ub``) and the output buffer;
- the CUDA context and cuBLAS workspaces of the process (a few hundred MiB per GPU);
- whatever ``--fit`` (or ``-ngl``, ``--n-cpu-moe``, ``-ot``) changes: layers or experts kept in
  host memory make the GPU's share smaller than the file, and the file also holds tensors that
  may stay on the CPU (the token embeddings);
- architectures whose KV cache is not one K and one V per layer at the full context: sliding-window
  layers (a smaller cache), MLA (a compressed one), recurrent state (Mamba, RWKV), and a
  multimodal projector in its own file.

So it is an estimate, to be corrected by ``models.<id>.memory`` where it is off.

llama-server's ``--parallel`` slots share the one context: llama-server splits ``-c`` across its
slots (each gets ``-c / --parallel`` positions), so the KV cache does not multiply by the slots.
Pass the ``-c`` the model runs with (0 or None: the model's trained ``context_length``).

`parse_size` reads a configuration size: ``80GiB``, ``512MiB``, ``1.5GB``, ``1000000`` (bytes).
"""

from __future__ import annotations

import dataclasses
import decimal
import math
import os
import re
import struct
from typing import BinaryIO, Union

MAGIC = b"GGUF"
VERSIONS = (2, 3)

# GGUF value types (docs/gguf.md, gguf_metadata_value_type): number -> (name, struct format).
_SCALARS: dict[int, tuple[str, str]] = {
    0: ("uint8", "B"), 1: ("int8", "b"), 2: ("uint16", "H"), 3: ("int16", "h"),
    4: ("uint32", "I"), 5: ("int32", "i"), 6: ("float32", "f"), 7: ("bool", "?"),
    10: ("uint64", "Q"), 11: ("int64", "q"), 12: ("float64", "d"),
}
_STRING = 8
_ARRAY = 9
_CHUNK = 1 << 20  # bytes read at a time through an array of strings
_TYPE_NAMES = {**{number: name for number, (name, _) in _SCALARS.items()}, _STRING: "string", _ARRAY: "array"}


@dataclasses.dataclass(frozen=True, slots=True)
class SkippedArray:
    """An array whose content was not read (an array of strings, or of arrays): its type and length."""

    element_type: str
    length: int


GgufValue = Union[int, float, bool, str, SkippedArray, list["GgufValue"]]


class GgufError(ValueError):
    """A file that is not a GGUF file llamaswap can read, or metadata without what an estimate needs."""


class _Reader:
    """Reads a GGUF file's values in its byte order; every short read is a truncated file."""

    def __init__(self, stream: BinaryIO, size: int) -> None:
        self.stream = stream
        self.size = size
        self.order = "<"

    def read(self, count: int, what: str) -> bytes:
        data = self.stream.read(count)
        if len(data) != count:
            raise GgufError(f"truncated: the file ends inside {what} (at byte {self.stream.tell()} of {self.size})")
        return data

    def skip(self, count: int, what: str) -> None:
        position = self.stream.tell() + count
        if position > self.size:
            raise GgufError(f"truncated: {what} needs {count} bytes past byte {self.stream.tell()} "
                            f"of a {self.size}-byte file")
        self.stream.seek(position)

    def unpack(self, fmt: str, what: str) -> int | float | bool:
        value: int | float | bool = struct.unpack(self.order + fmt, self.read(struct.calcsize(fmt), what))[0]
        return value

    def integer(self, fmt: str, what: str) -> int:
        return int(self.unpack(fmt, what))

    def string(self, what: str) -> str:
        length = self.integer("Q", f"the length of {what}")
        if length > self.size:
            raise GgufError(f"truncated: {what} claims {length} bytes in a {self.size}-byte file")
        raw = self.read(length, what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as error:
            raise GgufError(f"{what} is not UTF-8: {error}") from error

    def value(self, value_type: int, what: str, read_string_arrays: bool) -> GgufValue:
        if value_type in _SCALARS:
            return self.unpack(_SCALARS[value_type][1], what)
        if value_type == _STRING:
            return self.string(what)
        if value_type == _ARRAY:
            return self.array(what, read_string_arrays)
        raise GgufError(f"unknown value type {value_type} for {what}")

    def array(self, what: str, read_string_arrays: bool) -> GgufValue:
        element_type = self.integer("I", f"the element type of {what}")
        length = self.integer("Q", f"the length of {what}")
        if element_type in _SCALARS:
            fmt = _SCALARS[element_type][1]
            width = struct.calcsize(fmt)
            if length * width > self.size:
                raise GgufError(f"truncated: {what} claims {length} elements in a {self.size}-byte file")
            return list(struct.unpack(f"{self.order}{length}{fmt}", self.read(length * width, what)))
        if element_type not in (_STRING, _ARRAY):
            raise GgufError(f"unknown element type {element_type} of {what}")
        if length > self.size:  # every element takes at least one byte
            raise GgufError(f"truncated: {what} claims {length} elements in a {self.size}-byte file")
        if element_type == _STRING:
            strings = self.strings(length, what, read_string_arrays)
            return strings if read_string_arrays else SkippedArray("string", length)
        if read_string_arrays:
            return [self.value(element_type, f"{what}[{index}]", read_string_arrays) for index in range(length)]
        for index in range(length):
            self.skip_value(element_type, f"{what}[{index}]")
        return SkippedArray(_TYPE_NAMES[element_type], length)

    def strings(self, length: int, what: str, keep: bool) -> list[GgufValue]:
        """The `length` strings of an array (a vocabulary: many short ones), read a chunk at a time and
        walked in memory; decoded only when `keep`, else an empty list."""
        kept: list[GgufValue] = []
        prefix = struct.Struct(self.order + "Q")
        buffer = b""
        offset = 0
        for index in range(length):
            if offset + 8 > len(buffer):
                buffer = buffer[offset:] + self.stream.read(_CHUNK)
                offset = 0
                if len(buffer) < 8:
                    raise GgufError(f"truncated: the file ends inside {what}[{index}]")
            count = prefix.unpack_from(buffer, offset)[0]
            offset += 8
            if offset + count > len(buffer):
                if count > self.size:
                    raise GgufError(f"truncated: {what}[{index}] claims {count} bytes in a {self.size}-byte file")
                buffer = buffer[offset:] + self.stream.read(max(_CHUNK, count))
                offset = 0
                if count > len(buffer):
                    raise GgufError(f"truncated: the file ends inside {what}[{index}]")
            if keep:
                try:
                    kept.append(buffer[offset:offset + count].decode("utf-8"))
                except UnicodeDecodeError as error:
                    raise GgufError(f"{what}[{index}] is not UTF-8: {error}") from error
            offset += count
        self.stream.seek(offset - len(buffer), os.SEEK_CUR)  # give back what was read past the array
        return kept

    def skip_value(self, value_type: int, what: str) -> None:
        if value_type in _SCALARS:
            self.skip(struct.calcsize(_SCALARS[value_type][1]), what)
        elif value_type == _STRING:
            self.skip(self.integer("Q", f"the length of {what}"), what)
        elif value_type == _ARRAY:
            element_type = self.integer("I", f"the element type of {what}")
            length = self.integer("Q", f"the length of {what}")
            if element_type in _SCALARS:
                self.skip(length * struct.calcsize(_SCALARS[element_type][1]), what)
            elif element_type == _STRING:
                self.strings(length, what, keep=False)
            elif element_type == _ARRAY:
                for index in range(length):
                    self.skip_value(element_type, f"{what}[{index}]")
            else:
                raise GgufError(f"unknown element type {element_type} of {what}")
        else:
            raise GgufError(f"unknown value type {value_type} for {what}")


def read_gguf_metadata(path: str | os.PathLike[str], *, read_string_arrays: bool = False) -> dict[str, GgufValue]:
    """The metadata key/value pairs of the GGUF file at `path`, in the file's order.

    Numbers, booleans and strings come back as Python values, arrays of them as lists; an array of
    strings (or of arrays) as a `SkippedArray` with its length, unless `read_string_arrays`. Stops
    before the tensor infos. Raises `GgufError` (naming the path) for a file that is not GGUF, of
    another version, truncated, or with an unknown value type; an unreadable file as well.
    """
    try:
        with open(path, "rb") as stream:
            reader = _Reader(stream, os.fstat(stream.fileno()).st_size)
            magic = stream.read(4)
            if magic != MAGIC:
                raise GgufError(f"not a GGUF file (it starts with {magic!r}, not {MAGIC!r})")
            raw_version = reader.read(4, "the version")
            version = struct.unpack("<I", raw_version)[0]
            if version not in VERSIONS and struct.unpack(">I", raw_version)[0] in VERSIONS:
                reader.order = ">"  # a big-endian GGUF (gguf-py's --bigendian)
                version = struct.unpack(">I", raw_version)[0]
            if version not in VERSIONS:
                raise GgufError(f"GGUF version {version}, and llamaswap reads versions 2 and 3")
            reader.integer("Q", "the tensor count")
            count = reader.integer("Q", "the metadata count")
            metadata: dict[str, GgufValue] = {}
            for index in range(count):
                key = reader.string(f"the key of metadata entry {index}")
                value_type = reader.integer("I", f"the value type of {key!r}")
                metadata[key] = reader.value(value_type, repr(key), read_string_arrays)
            return metadata
    except GgufError as error:
        raise GgufError(f"{os.fspath(path)}: {error}") from error.__cause__
    except OSError as error:
        raise GgufError(f"{os.fspath(path)}: cannot read it: {error}") from error


def _number(metadata: dict[str, GgufValue], key: str) -> int | None:
    value = metadata.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise GgufError(f"{key} is {value!r}, not a whole number of at least 0")
    return value


def _required(metadata: dict[str, GgufValue], key: str) -> int:
    value = _number(metadata, key)
    if value is None:
        raise GgufError(f"the metadata has no {key}")
    return value


def _kv_heads_per_layer(metadata: dict[str, GgufValue], arch: str, blocks: int, heads: int) -> list[int]:
    """`<arch>.attention.head_count_kv` for each layer: one number for all, or (some architectures)
    an array of one per layer; default the head count (no GQA)."""
    key = f"{arch}.attention.head_count_kv"
    value = metadata.get(key)
    if isinstance(value, list):
        if len(value) != blocks or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
            raise GgufError(f"{key} is an array that is not {blocks} whole numbers (one per block)")
        return [int(v) for v in value if isinstance(v, int)]
    kv_heads = _number(metadata, key)
    return [heads if kv_heads is None else kv_heads] * blocks


def kv_cache_bytes(metadata: dict[str, GgufValue], context: int, cache_type_bytes: float = 2.0) -> int:
    """The KV cache of a model with this metadata at `context` positions (0: its `context_length`),
    each element `cache_type_bytes` wide (2.0: f16, llama-server's default; q8_0 is 34/32).

    K and V for every block: block_count x n_kv_heads x (key_length + value_length) x context x bytes,
    with key_length = value_length = embedding_length / head_count (the head dimension) unless
    `<arch>.attention.key_length` / `value_length` say otherwise. Rounded up to a whole byte.
    """
    if context < 0:
        raise GgufError(f"the context is {context}; it must be 0 (the model's own) or more")
    if not cache_type_bytes > 0:
        raise GgufError(f"the bytes per cache element are {cache_type_bytes}; they must be more than 0")
    arch = metadata.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise GgufError(f"general.architecture is {arch!r}, not an architecture's name")
    if context == 0:
        context = _required(metadata, f"{arch}.context_length")
    blocks = _required(metadata, f"{arch}.block_count")
    heads = _required(metadata, f"{arch}.attention.head_count")
    key_length = _number(metadata, f"{arch}.attention.key_length")
    value_length = _number(metadata, f"{arch}.attention.value_length")
    if key_length is None or value_length is None:
        embedding = _required(metadata, f"{arch}.embedding_length")
        if heads == 0:
            raise GgufError(f"{arch}.attention.head_count is 0: no head dimension")
        head_dim = embedding // heads
        key_length = head_dim if key_length is None else key_length
        value_length = head_dim if value_length is None else value_length
    kv_heads = _kv_heads_per_layer(metadata, arch, blocks, heads)
    elements = sum(kv_heads) * (key_length + value_length) * context
    return math.ceil(elements * cache_type_bytes)


def estimate_model_bytes(path: str | os.PathLike[str], context: int | None, cache_type_bytes: float = 2.0) -> int:
    """The file's size plus its KV cache at `context` (None or 0: the model's `context_length`); what
    this leaves out is in the module's docstring. Raises `GgufError` naming the path."""
    metadata = read_gguf_metadata(path)
    try:
        kv = kv_cache_bytes(metadata, context or 0, cache_type_bytes)
        return os.stat(path).st_size + kv
    except GgufError as error:
        raise GgufError(f"{os.fspath(path)}: {error}") from error
    except OSError as error:
        raise GgufError(f"{os.fspath(path)}: cannot read it: {error}") from error


_UNITS: dict[str, int] = {
    "": 1, "b": 1,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
}
_SIZE = re.compile(r"([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)")
SIZE_FORMS = ("a whole number of bytes (1000000), or a number with a unit: KiB, MiB, GiB, TiB (binary) "
              "or KB, MB, GB, TB (decimal), as in 80GiB, 512MiB, 1.5GB")


def parse_size(text: str) -> int:
    """A size in bytes from ``80GiB``, ``512MiB``, ``1.5GB``, ``1000000``: binary (KiB, MiB, GiB, TiB)
    or decimal (KB, MB, GB, TB) units, any case, an optional B for bytes; a fraction of a byte is
    dropped. Raises ValueError naming the accepted forms for anything else."""
    match = _SIZE.fullmatch(text.strip())
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise ValueError(f"{text!r} is not a size: write {SIZE_FORMS}")
    number = match.group(1)
    if _UNITS[unit] == 1 and "." in number:
        raise ValueError(f"{text!r} is not a whole number of bytes: write {SIZE_FORMS}")
    return int(decimal.Decimal(number) * _UNITS[unit])
