"""The one GGUF reader: files written by the gguf package read back field for field and byte for
byte; every cut-short or foreign file is refused with the file's name."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from servelab.errors import InvalidArgument, NotFound
from servelab.spec.ggml_types import GGML_TYPE_BY_NAME
from servelab.spec.gguf_reader import gguf_metadata, read_gguf

gguf = pytest.importorskip("gguf")


def write(path: Path, *, tensors: dict[str, tuple[np.ndarray, str]] | None = None, **fields) -> Path:
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in fields.items():
        writer.add_key_value(key.replace("__", "."), value, _value_type(value))
    for name, (array, type_name) in (tensors or {}).items():  # block formats as raw bytes [rows, row bytes]
        if type_name == "F32":
            writer.add_tensor(name, array)
        else:
            writer.add_tensor(name, array, raw_dtype=gguf.GGMLQuantizationType[type_name])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _value_type(value):
    if isinstance(value, bool):
        return gguf.GGUFValueType.BOOL
    if isinstance(value, int):
        return gguf.GGUFValueType.INT64
    if isinstance(value, float):
        return gguf.GGUFValueType.FLOAT64
    if isinstance(value, str):
        return gguf.GGUFValueType.STRING
    return gguf.GGUFValueType.ARRAY


def test_metadata_round_trips(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    writer.add_string("general.name", "tiny")
    writer.add_uint32("llama.context_length", 2048)
    writer.add_float32("llama.rope.freq_base", 10000.0)
    writer.add_bool("tokenizer.ggml.add_bos_token", True)
    writer.add_array("tokenizer.ggml.tokens", ["a", "Ġb", "<|im_end|>", "日本"])
    writer.add_array("tokenizer.ggml.token_type", [1, 1, 3, 1])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    md = gguf_metadata(tmp_path / "t.gguf")
    assert md["general.architecture"] == "llama"
    assert md["general.name"] == "tiny"
    assert md["llama.context_length"] == 2048
    assert md["llama.rope.freq_base"] == 10000.0
    assert md["tokenizer.ggml.add_bos_token"] is True
    assert md["tokenizer.ggml.tokens"] == ["a", "Ġb", "<|im_end|>", "日本"]
    assert md["tokenizer.ggml.token_type"] == [1, 1, 3, 1]


scalars = st.one_of(st.booleans(), st.integers(-(2**63), 2**63 - 1), st.floats(allow_nan=False), st.text(max_size=20))
# The writer stores a list of ints as int32.
values = st.one_of(
    scalars,
    st.lists(st.integers(-(2**31), 2**31 - 1), min_size=1, max_size=5),
    st.lists(st.text(max_size=8), min_size=1, max_size=5),
)


@settings(max_examples=30, deadline=None)
@given(st.dictionaries(st.from_regex(r"[a-z]{1,8}__[a-z]{1,8}", fullmatch=True), values, max_size=6))
def test_any_metadata_round_trips(tmp_path_factory, fields):
    path = write(tmp_path_factory.mktemp("gguf") / "m.gguf", **fields)
    md = read_gguf(path).metadata
    for key, value in fields.items():
        assert md[key.replace("__", ".")] == value


def test_tensor_index_points_at_the_written_bytes(tmp_path):
    rng = np.random.default_rng(0)
    blocks = lambda rows, n, size: rng.integers(0, 256, (rows, n * size), dtype=np.uint8)  # noqa: E731
    arrays = {
        "a.weight": (rng.standard_normal((3, 64)).astype(np.float32), "F32"),
        "b.weight": (blocks(5, 2, 210), "Q6_K"),  # 5 rows of 512 weights
        "c.weight": (blocks(2, 1, 34), "Q8_0"),
    }
    path = write(tmp_path / "t.gguf", tensors=arrays)
    raw = path.read_bytes()
    index = read_gguf(path).tensors
    assert list(index) == list(arrays)
    shapes = {"a.weight": (3, 64), "b.weight": (5, 512), "c.weight": (2, 32)}
    for name, (array, type_name) in arrays.items():
        t = index[name]
        assert t.ggml_type is GGML_TYPE_BY_NAME[type_name]
        assert t.row_major_shape == shapes[name] and t.shape == tuple(reversed(shapes[name]))
        assert t.num_rows == shapes[name][0]
        assert raw[t.offset : t.offset + t.nbytes] == array.tobytes()


def test_every_cut_short_file_is_refused_by_name(tmp_path):
    arrays = {"w": (np.ones((2, 34), dtype=np.uint8), "Q8_0")}
    path = write(tmp_path / "t.gguf", tensors=arrays, general__name="x", tokenizer__tokens=["a", "b"])
    data = path.read_bytes()
    end = max(t.offset + t.nbytes for t in read_gguf(path).tensors.values())
    cut = tmp_path / "cut.gguf"
    for size in range(end):
        cut.write_bytes(data[:size])
        with pytest.raises(InvalidArgument, match="cut.gguf"):
            read_gguf(cut)


def test_foreign_files_are_refused(tmp_path):
    with pytest.raises(NotFound, match="missing.gguf.*does not exist"):
        read_gguf(tmp_path / "missing.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + bytes(40))
    with pytest.raises(InvalidArgument, match=r"bad.gguf.*not a GGUF file \(it starts with b'NOPE'"):
        read_gguf(bad)
    old = tmp_path / "v1.gguf"
    old.write_bytes(b"GGUF" + (1).to_bytes(4, "little") + bytes(16))
    with pytest.raises(InvalidArgument, match="GGUF version 1 is not supported"):
        read_gguf(old)


def test_a_zero_alignment_is_refused_by_name(tmp_path):
    path = write(tmp_path / "t.gguf", general__alignment=0, tokenizer__tokens=["a", "b"])
    with pytest.raises(InvalidArgument, match="general.alignment must be a positive integer, got 0"):
        read_gguf(path)
