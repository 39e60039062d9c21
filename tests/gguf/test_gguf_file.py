"""llambda's lazy GGUF reader against gguf.GGUFReader: the same values, the same tensor views."""
import gguf
import numpy as np
import pytest

from llambda.errors import UserError
from llambda.gguf.reader import GGUFFile


def reference_values(reader):
    values = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            values[key] = field.contents()
        except UnicodeDecodeError:
            strings = [bytes(field.parts[i]).decode("utf-8", "surrogateescape") for i in field.data]
            values[key] = strings if len(field.types) > 1 else strings[0]
    return values


def assert_same_as_gguf_reader(path):
    ours, reader = GGUFFile(path), gguf.GGUFReader(path)
    expected = reference_values(reader)
    got = ours.metadata()
    assert list(got) == list(expected)
    for key, value in expected.items():
        if key == "t.nested":   # GGUFReader flattens arrays of arrays; ours keeps them nested
            assert got[key] == [[1, 2], [3]]
            continue
        assert got[key] == value and type(got[key]) is type(value), key
    assert [t.name for t in ours.tensors] == [t.name for t in reader.tensors]
    for mine, theirs in zip(ours.tensors, reader.tensors):
        assert mine.tensor_type == theirs.tensor_type
        assert mine.shape == tuple(theirs.shape.tolist())
        assert mine.data.dtype == theirs.data.dtype and mine.data.shape == theirs.data.shape
        np.testing.assert_array_equal(mine.data, theirs.data)


@pytest.fixture
def every_value_type(tmp_path):
    path = tmp_path / "values.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -3)
    writer.add_uint16("t.u16", 65000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 0.1)
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float64("t.f64", 1e-300)
    writer.add_bool("t.yes", True)
    writer.add_bool("t.no", False)
    writer.add_string("t.text", "naïve ▁ 😀")
    writer.add_string("t.empty", "")
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.5, -1.25])
    writer.add_array("t.strings", ["a", "", "ü", "<0x0A>"])
    writer.add_array("t.bools", [True, False])
    writer.add_array("t.nested", [[1, 2], [3]])
    writer.add_uint32("general.alignment", 64)
    rng = np.random.default_rng(0)
    writer.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    writer.add_tensor("f16", rng.standard_normal((2, 64)).astype(np.float16))
    q8 = rng.integers(0, 256, (4, 2 * 34), dtype=np.uint8)
    writer.add_tensor("q8", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("vec", np.arange(7, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_every_value_type_and_tensor_view_matches_gguf_reader(every_value_type):
    assert_same_as_gguf_reader(every_value_type)


def test_a_real_model_matches_gguf_reader(default_gguf):
    assert_same_as_gguf_reader(default_gguf)


def test_values_are_decoded_on_demand(every_value_type):
    f = GGUFFile(every_value_type)
    assert "t.strings" in f and "absent" not in f
    assert f.array_length("t.strings") == 4 and f.array_length("t.text") is None
    assert f.value("absent", 7) == 7
    assert f.metadata(lambda key: key.startswith("t.i")) == {"t.i8": -3, "t.i16": -30000,
                                                              "t.i32": -2_000_000_000,
                                                              "t.i64": -(2**62), "t.ints": [1, -2, 3]}


def test_damaged_files_are_user_errors_naming_the_file(every_value_type, tmp_path):
    data = every_value_type.read_bytes()
    cases = {"empty.gguf": b"", "magic.gguf": b"GGUX" + data[4:], "cut.gguf": data[:200]}
    for name, content in cases.items():
        path = tmp_path / name
        path.write_bytes(content)
        with pytest.raises(UserError, match=name):
            GGUFFile(path)
    cut_data = tmp_path / "cut_data.gguf"
    cut_data.write_bytes(data[:-16])
    f = GGUFFile(cut_data)
    with pytest.raises(UserError, match="vec runs past the end"):
        f.tensors[-1].data
    with pytest.raises(UserError, match="no such file"):
        GGUFFile(tmp_path / "absent.gguf")
