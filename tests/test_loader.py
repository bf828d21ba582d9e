"""load_model: external data, checks, and one clear ConversionError line per failure."""
import os

import numpy as np
import onnx
import pytest

from onnx2fused.errors import ConversionError
from onnx2fused.loader import load_model
from onnx_builders import mlp


def _one_line(e):
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_loads_and_infers_shapes(tmp_path):
    p = tmp_path / "m.onnx"
    m = mlp([8, 16, 4])
    onnx.save(m, p)
    before = p.read_bytes()
    out = load_model(p)
    assert isinstance(out, onnx.ModelProto) and len(out.graph.node) == 3
    assert any(v.name == out.graph.node[0].output[0] for v in out.graph.value_info)  # shapes inferred
    assert p.read_bytes() == before


def test_external_data(tmp_path):
    p = tmp_path / "m.onnx"
    m = mlp([64, 128, 4])
    w0 = onnx.numpy_helper.to_array(m.graph.initializer[0])
    onnx.save(m, p, save_as_external_data=True, all_tensors_to_one_file=True, location="m.onnx.data",
              size_threshold=0)
    out = load_model(p)
    w = [t for t in out.graph.initializer if t.name == m.graph.initializer[0].name][0]
    np.testing.assert_array_equal(onnx.numpy_helper.to_array(w), w0)
    os.remove(tmp_path / "m.onnx.data")
    with pytest.raises(ConversionError) as e:
        load_model(p)
    assert "missing external data file 'm.onnx.data'" in _one_line(e)


def test_truncated_external_data(tmp_path):
    p = tmp_path / "m.onnx"
    onnx.save(mlp([64, 128, 4]), p, save_as_external_data=True, location="d.bin", size_threshold=0)
    data = (tmp_path / "d.bin").read_bytes()
    (tmp_path / "d.bin").write_bytes(data[:100])
    with pytest.raises(ConversionError) as e:
        load_model(p)
    assert "external data file 'd.bin' is truncated" in _one_line(e)


def test_not_a_file(tmp_path):
    with pytest.raises(ConversionError) as e:
        load_model(tmp_path / "nope.onnx")
    assert _one_line(e).endswith("nope.onnx: no such file")
    with pytest.raises(ConversionError) as e:
        load_model(tmp_path)
    assert "is a directory" in _one_line(e)
    (tmp_path / "empty.onnx").write_bytes(b"")
    with pytest.raises(ConversionError, match="the file is empty"):
        load_model(tmp_path / "empty.onnx")


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads everything")
def test_unreadable(tmp_path):
    p = tmp_path / "m.onnx"
    onnx.save(mlp([8, 4]), p)
    p.chmod(0)
    with pytest.raises(ConversionError, match="cannot read the file"):
        load_model(p)


def test_garbage_and_truncated(tmp_path):
    p = tmp_path / "g.onnx"
    p.write_bytes(b"\xff\xfe this is not a protobuf at all \x00\x01" * 10)
    with pytest.raises(ConversionError) as e:
        load_model(p)
    assert "not an ONNX model" in _one_line(e)
    p.write_text("hello world, plain text")
    with pytest.raises(ConversionError, match="not an ONNX model"):
        load_model(p)
    full = mlp([64, 128, 4]).SerializeToString()
    p.write_bytes(full[: len(full) // 2])
    with pytest.raises(ConversionError) as e:
        load_model(p)
    assert "truncated or corrupt ONNX file" in _one_line(e)


@pytest.mark.parametrize("ir,opset,msg", [
    (14, 17, "IR version 14 is outside what onnxruntime supports (3..13)"),
    (8, 27, "opset 27 is outside the supported range 7..26"),
    (3, 6, "opset 6 is outside the supported range 7..26"),
])
def test_versions(tmp_path, ir, opset, msg):
    m = mlp([8, 4], kind="matmul", bias=False)
    m.ir_version = ir
    m.opset_import[0].version = opset
    p = tmp_path / "m.onnx"
    p.write_bytes(m.SerializeToString())
    with pytest.raises(ConversionError) as e:
        load_model(p)
    assert msg in _one_line(e)


def test_checker_failure_is_one_line(tmp_path):
    m = mlp([8, 4])
    m.graph.node[0].input[1] = "missing_weight"
    p = tmp_path / "m.onnx"
    p.write_bytes(m.SerializeToString())
    with pytest.raises(ConversionError) as e:
        load_model(p)
    assert "the ONNX checker rejects the model" in _one_line(e)
