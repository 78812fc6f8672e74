"""The one GGUF reader: a file's header, metadata and tensor index, in pure Python over an mmap.

The model description (spec/model.py), the weight loader and the tokenizer all read GGUF files
through `read_gguf`. It copies no tensor data: each tensor comes back as its type, shape and byte
range in the file, and the loader maps those bytes itself. (gguf.GGUFReader wraps each of the
~50k vocabulary strings in a numpy view and takes seconds to open SmolLM2; see docs/benchmarks.md.)
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from servelab.errors import InvalidArgument, NotFound
from servelab.spec.ggml_types import GGML_TYPE_BY_ID, GGMLType

SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32  # of the tensor data, unless general.alignment says otherwise

_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_U64 = struct.Struct("<Q")


@dataclass(frozen=True, slots=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # ggml order: shape[0] is the contiguous (input) dimension
    ggml_type: GGMLType
    offset: int  # of the first byte in the file
    nbytes: int

    @property
    def row_major_shape(self) -> tuple[int, ...]:
        """[out, in], as PyTorch and HF checkpoints write a weight."""
        return tuple(reversed(self.shape))

    @property
    def num_rows(self) -> int:
        return math.prod(self.shape[1:])


@dataclass(frozen=True, slots=True)
class GGUFFile:
    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensorInfo]


def read_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """Header, metadata (plain Python values, arrays as lists) and tensor index of a GGUF file.
    NotFound when the file is missing; InvalidArgument naming the file when it is not GGUF, is of
    an unsupported version, or is cut short."""
    path = Path(path)
    if not path.is_file():
        raise NotFound(f"GGUF file {str(path)!r} does not exist", param="model")
    if path.stat().st_size < 24:  # mmap cannot map an empty file; a header alone is 24 bytes
        raise InvalidArgument(f"{str(path)!r} is not a GGUF file: it is shorter than a GGUF header", param="model")
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _parse(path, buf)
    except struct.error as exc:  # the header runs past the end of the file
        raise InvalidArgument(f"{str(path)!r} is a truncated or corrupt GGUF file: {exc}", param="model") from None


def gguf_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Every metadata field of a GGUF file as plain Python values (arrays become lists)."""
    return read_gguf(path).metadata


def _parse(path: Path, buf: mmap.mmap) -> GGUFFile:
    magic = buf[:4]
    if magic != b"GGUF":
        raise InvalidArgument(
            f"{str(path)!r} is not a GGUF file (it starts with {magic!r}, not b'GGUF')", param="model"
        )
    version, tensor_count, kv_count = struct.unpack_from("<IQQ", buf, 4)
    if version not in SUPPORTED_VERSIONS:
        raise InvalidArgument(
            f"{str(path)!r}: GGUF version {version} is not supported (supported: 2, 3)", param="model"
        )
    pos = 24
    metadata: dict[str, Any] = {}
    for _ in range(kv_count):
        key, pos = _read_string(buf, pos)
        (value_type,) = struct.unpack_from("<I", buf, pos)
        metadata[key], pos = _read_value(buf, pos + 4, value_type, path)

    index = []
    for _ in range(tensor_count):
        name, pos = _read_string(buf, pos)
        (n_dims,) = struct.unpack_from("<I", buf, pos)
        shape = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
        pos += 4 + 8 * n_dims
        type_id, offset = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        index.append((name, tuple(int(d) for d in shape), type_id, offset))

    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment <= 0:
        raise InvalidArgument(f"GGUF metadata: general.alignment must be a positive integer, got {alignment!r}")
    data_start = -(-pos // alignment) * alignment
    file_size = len(buf)
    tensors = {}
    for name, shape, type_id, offset in index:
        ggml_type = GGML_TYPE_BY_ID.get(type_id)
        if ggml_type is None:
            raise InvalidArgument(f"{str(path)!r}: tensor {name!r} has unknown ggml type id {type_id}", param="model")
        if not shape or shape[0] % ggml_type.block_weights:
            raise InvalidArgument(
                f"{str(path)!r}: tensor {name!r} of shape {shape} is not whole {ggml_type.name} blocks", param="model"
            )
        nbytes = math.prod(shape[1:]) * ggml_type.row_bytes(shape[0])
        begin = data_start + offset
        if begin + nbytes > file_size:
            raise InvalidArgument(f"{str(path)!r} is truncated: tensor {name!r} runs past its end", param="model")
        tensors[name] = GGUFTensorInfo(name, shape, ggml_type, begin, nbytes)
    return GGUFFile(path, version, metadata, tensors)


def _read_string(buf: mmap.mmap, pos: int) -> tuple[str, int]:
    (length,) = _U64.unpack_from(buf, pos)
    end = pos + 8 + length
    if end > len(buf):
        raise struct.error(f"a string of {length} bytes at offset {pos} runs past the end")
    raw = buf[pos + 8 : end]
    try:
        return raw.decode("utf-8"), end
    except UnicodeDecodeError:  # llama.cpp writes some SPM byte pieces raw; keep going
        return raw.decode("utf-8", errors="replace"), end


def _read_value(buf: mmap.mmap, pos: int, value_type: int, path: Path) -> tuple[Any, int]:
    fmt = _SCALAR_FORMATS.get(value_type)
    if fmt is not None:
        (value,) = struct.unpack_from("<" + fmt, buf, pos)
        return value, pos + struct.calcsize(fmt)
    if value_type == _STRING:
        return _read_string(buf, pos)
    if value_type == _ARRAY:
        element_type, count = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        fmt = _SCALAR_FORMATS.get(element_type)
        if fmt is not None:
            values = list(struct.unpack_from(f"<{count}{fmt}", buf, pos))
            return values, pos + count * struct.calcsize(fmt)
        if element_type == _STRING:  # the vocabulary and merges: ~100k strings, so inlined
            strings = []
            unpack_length = _U64.unpack_from
            for _ in range(count):
                (length,) = unpack_length(buf, pos)
                raw = buf[pos + 8 : pos + 8 + length]
                try:
                    strings.append(raw.decode("utf-8"))
                except UnicodeDecodeError:
                    strings.append(raw.decode("utf-8", errors="replace"))
                pos += 8 + length
            if pos > len(buf):
                raise struct.error(f"a string array of {count} entries runs past the end")
            return strings, pos
        values = []
        for _ in range(count):
            value, pos = _read_value(buf, pos, element_type, path)
            values.append(value)
        return values, pos
    raise InvalidArgument(f"{str(path)!r}: unknown GGUF metadata value type {value_type}", param="model")
