"""Our GGUF container reader (models/src/gguf_file.py) against the `gguf` package's own reader and writer:
every metadata value type, quantized and float tensors, alignment, and damaged files."""

import numpy as np
import pytest

from interp.errors import CheckpointError
from interp.models.formats.gguf import _reader
from interp.models.formats.gguf_file import dequantize as _dequantize
from interp.models.formats.gguf_file import GGUFFile

gguf = pytest.importorskip("gguf")


def _write(path, alignment=None):
    w = gguf.GGUFWriter(str(path), "llama")
    if alignment:
        w.add_custom_alignment(alignment)
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -7)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 0.1)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", 1 / 3)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "naïve — 東京 🤖")
    w.add_string("t.empty", "")
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, 1.5])
    w.add_array("t.strs", ["a", "", "ü b"])
    w.add_array("t.bools", [True, False])
    w.add_array("t.nested", [[1, 2], [3]])
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((2, 4)).astype(np.float16))
    w.add_tensor("vec", rng.standard_normal(7).astype(np.float32))
    Q = gguf.GGMLQuantizationType
    for name, kind in (("q8", Q.Q8_0), ("q5", Q.Q5_0), ("q4", Q.Q4_0)):
        values = rng.standard_normal((5, 256)).astype(np.float32)
        w.add_tensor(name, gguf.quants.quantize(values, kind), raw_dtype=kind)
    for name, kind in (("q4k", Q.Q4_K), ("q6k", Q.Q6_K)):  # the package cannot quantize these: random blocks
        blocks = rng.integers(0, 256, (300, gguf.GGML_QUANT_SIZES[kind][1]), dtype=np.uint8)
        scale = np.frombuffer(np.full((300, 2), 0.01, np.float16).tobytes(), np.uint8).reshape(300, 4)
        blocks[:, :4], blocks[:, -2:] = scale, scale[:, :2]  # finite fp16 scales (Q4_K's first, Q6_K's last)
        w.add_tensor(name, blocks.reshape(100, -1), raw_dtype=kind)  # 100 rows of 3 blocks
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("alignment", [None, 64])
def test_fields_and_tensors_equal_the_gguf_packages_reader(tmp_path, alignment):
    path = _write(tmp_path / "all.gguf", alignment)
    ours, theirs = GGUFFile(path), gguf.GGUFReader(str(path))
    assert list(ours.fields) == [k for k in theirs.fields if not k.startswith("GGUF.")]
    for key, value in ours.fields.items():
        if key != "t.nested":  # the package flattens arrays of arrays ([1, 2, 3]); we keep their shape
            assert value == theirs.fields[key].contents(), key
    assert ours.fields["t.str"] == "naïve — 東京 🤖" and ours.fields["t.u64"] == 2**63 + 5
    assert ours.fields["t.nested"] == [[1, 2], [3]] and ours.fields["t.bools"] == [True, False]
    assert ours.alignment == (alignment or 32)
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert a.tensor_type == b.tensor_type and a.shape == tuple(b.shape.tolist()), a.name
        assert a.data.dtype == b.data.dtype and np.array_equal(a.data, b.data), a.name
        # our slab-wise dequantization = the package's own entry, value for value
        np.testing.assert_array_equal(_dequantize(a.data, a.tensor_type), gguf.quants.dequantize(b.data, b.tensor_type))
    assert not ours.tensors[0].data.flags.writeable  # a view of the read-only map


@pytest.mark.parametrize("cut", [3, 30, 200, -10])
def test_a_file_cut_anywhere_is_one_clear_error(tmp_path, cut):
    good = _write(tmp_path / "good.gguf").read_bytes()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(good[:cut])
    with pytest.raises(CheckpointError, match=r"could not read the GGUF file .*truncated or not a GGUF file"):
        _reader(bad)


@pytest.mark.parametrize("content, message", [(b"", "empty"), (b"GGML" + bytes(40), "magic"),
                                               (b"GGUF" + (7).to_bytes(4, "little") + bytes(16), "version 7")])
def test_not_gguf_files_name_what_is_wrong(tmp_path, content, message):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(content)
    with pytest.raises(CheckpointError, match=message):
        _reader(bad)
