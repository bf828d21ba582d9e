"""Issue 16: a gated FFN block converts (CPU-only library) into ONE fused op that matches stock ONNX Runtime
on the CPU EP, through the generated C++ kernel and through the plugin's stock-body path (a gated chain
whose kernel the cost model declines), and without the plugin (the model-local function).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest

ort = pytest.importorskip("onnxruntime")

import onnx2fused  # noqa: E402
from onnx2fused import codegen  # noqa: E402
from onnx2fused import expr as ex  # noqa: E402
from onnx2fused.spec import DOMAIN, LayerSpec, MLPSpec  # noqa: E402

from onnx_builders import G  # noqa: E402

MODELS = Path(__file__).resolve().parent.parent / "models"
ZOO = {m["name"]: m for m in json.loads((MODELS / "zoo.json").read_text())["models"]}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("o2f-cache")


def rel_l2(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.abs(b).max() > 0 and np.isfinite(a).all()
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def stock(path, feeds):
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"]).run(None, feeds)[0]


def ran_ops(path, feeds, library, tmp: Path):
    """(output, {op type: provider}) of a plain ORT CPU session, the plugin registered when given."""
    so = ort.SessionOptions()
    so.enable_profiling = True
    so.profile_file_prefix = str(tmp / "prof")
    so.intra_op_num_threads = 2
    if library is not None:
        so.register_custom_ops_library(str(library))
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    y = sess.run(None, feeds)[0]
    events = json.loads(Path(sess.end_profiling()).read_text())
    return y, {e["args"]["op_name"]: e["args"].get("provider", "") for e in events
               if e.get("cat") == "Node" and "op_name" in e.get("args", {})}


def check_fused(src: Path, res, x: np.ndarray, tmp: Path, kernel: bool, tol: float) -> None:
    """One fused op; plugin (kernel or stock body, as `kernel` says) and function fallback match stock."""
    assert res.validation is not None and res.validation.passed and not res.with_cuda
    (chain,) = res.chains
    assert chain.activations[0].startswith("gated ")
    assert ("CPU: fused CPU kernel" if kernel else "CPU: stock ops") in chain.cuda_plan
    out = Path(res.output_path)
    fused = onnx.load(str(out))
    assert [n.op_type for n in fused.graph.node if n.domain == DOMAIN] == [chain.name]
    assert not {n.op_type for n in fused.graph.node} & {"Gemm", "MatMul", "Mul", "Split", "Slice"}
    ref = stock(src, {"x": x})
    y, ran = ran_ops(out, {"x": x}, res.library_path, tmp)
    assert ran.get(chain.name) == "CPUExecutionProvider", ran
    assert y.shape == ref.shape and rel_l2(y, ref) <= tol, rel_l2(y, ref)
    y, ran = ran_ops(out, {"x": x}, None, tmp)          # no plugin: the model-local function, inlined
    assert chain.name not in ran and ran.keys() & {"MatMul", "Gemm"}, ran
    assert rel_l2(y, ref) <= 1e-5


@pytest.mark.parametrize("name,kind,precision", [("swiglu", "opset17", "fp32"), ("swiglu", "dynamo", "auto"),
                                                 ("geglu", "opset17", "auto"), ("geglu", "dynamo", "fp32")])
def test_zoo_gated_block_is_one_op_and_matches_stock(name, kind, precision, cache, tmp_path):
    src = MODELS / ZOO[name]["files"][kind]["file"]
    res = onnx2fused.convert(src, tmp_path / "m.fused.onnx", precision=precision, cache_dir=cache,
                             with_cuda=False)
    assert res.chains[0].widths == ZOO[name]["widths"]
    x = np.random.default_rng(5).standard_normal((1031, ZOO[name]["widths"][0])).astype(np.float32)
    check_fused(src, res, x, tmp_path, kernel=True, tol=1e-5)


def odd_chain(gate_act: str) -> onnx.ModelProto:
    """x [B, 20] -> gated(20 -> 37, two linears, `gate_act`) -> gated(37 -> 24, 2H layer Split, gate on the
    second half, Tanh) -> linear 24 -> 5: widths off the vector width, two gated layers in a row."""
    g = G(opset=18, seed=11)
    gate, up = g.linear("x", 20, 37), g.linear("x", 20, 37, kind="matmul")
    h = g.op("Mul", [up, g.op(gate_act, [gate])])
    a, b = g.op("Split", [g.linear(h, 37, 48)], outputs=2, axis=-1, num_outputs=2)
    h = g.op("Mul", [a, g.op("Tanh", [b])])
    g.op("Gemm", [h, g.weight(5, 24), g.vec(5)], outputs=["y"], transB=1)
    return g.model([("x", ["B", 20])], [("y", ["B", 5])])


@pytest.mark.parametrize("gate_act,kernel", [("Sigmoid", True), ("Sin", False)],
                         ids=["kernel", "stock-body"])
def test_gated_chain_kernel_and_stock_body(gate_act, kernel, cache, tmp_path):
    """Sigmoid: the generated kernel (tails of 37 and 24 columns, 1031 rows: partial row blocks). Sin: the
    cost model declines the kernel (scalar sinf), so the plugin runs the stock body in an inner session,
    the gated layer as MatMul, Add, Slice, Mul: fp32-exact up to summation order."""
    src = tmp_path / "odd.onnx"
    onnx.save(odd_chain(gate_act), str(src))
    res = onnx2fused.convert(src, tmp_path / "odd.fused.onnx", precision="fp32", cache_dir=cache,
                             with_cuda=False)
    assert res.chains[0].widths == [20, 37, 24, 5]
    assert res.chains[0].activations == [f"gated {gate_act.lower()}", "gated tanh", "id"]
    for rows in (1, 7, 1031):
        x = np.random.default_rng(rows).standard_normal((rows, 20)).astype(np.float32)
        check_fused(src, res, x, tmp_path, kernel=kernel, tol=1e-5 if kernel else 1e-6)


def test_plugin_checks_the_gated_weight_shape(cache, tmp_path):
    """The plugin's input check knows a gated layer's [K, 2H] weight (registry weight_cols)."""
    src = tmp_path / "odd.onnx"
    onnx.save(odd_chain("Sigmoid"), str(src))
    res = onnx2fused.convert(src, tmp_path / "odd.fused.onnx", precision="fp32", cache_dir=cache,
                             with_cuda=False, validate=False)
    m = onnx.load(res.output_path)
    node = next(n for n in m.graph.node if n.domain == DOMAIN)
    w0 = next(t for t in m.graph.initializer if t.name == node.input[1])
    assert list(w0.dims) == [20, 74]
    half = onnx.numpy_helper.to_array(w0)[:, :37]
    w0.CopyFrom(onnx.numpy_helper.from_array(np.ascontiguousarray(half), w0.name))
    bad = tmp_path / "bad.onnx"
    onnx.save(m, str(bad))
    so = ort.SessionOptions()
    so.register_custom_ops_library(res.library_path)
    sess = ort.InferenceSession(str(bad), so, providers=["CPUExecutionProvider"])
    with pytest.raises(Exception, match=r"weight W_0 must be float32 \[20, 74\]"):
        sess.run(None, {"x": np.zeros((2, 20), np.float32)})


def test_render_gated_and_plain_sources():
    """Gated specs render the gated kernel and the registry's weight columns; plain specs neither."""
    gated = MLPSpec((LayerSpec(20, 37, True, ex.silu(), gated=True), LayerSpec(37, 5, True, ex.identity())))
    plain = MLPSpec((LayerSpec(20, 37, True, ex.silu()), LayerSpec(37, 5, True, ex.identity())))
    g = codegen.render([gated], with_cuda=False)
    p = codegen.render([plain], with_cuda=False)
    assert "gated_layer<20, 37, true, Act0, MR>" in g[f"{gated.name}_cpu.cc"]
    assert "kWeightCols0[] = { 74, 5 }" in g["registry.cc"]
    assert "gated_layer" not in p[f"{plain.name}_cpu.cc"] and "tile_g" not in p[f"{plain.name}_cpu.cc"]
    assert "kWeightCols" not in p["registry.cc"]
