"""convert() end to end on every model of the zoo (both exporters), CPU-only builds.

The fused model must validate (fp16 -> judged on the CPU EP), hold one custom node per chain, record its
plugin in metadata_props, and match stock ORT on fresh inputs both through onnx2fused.InferenceSession
(the plugin) and through plain onnxruntime with the plugin registered by hand and without it (the
model-local function fallback), with ONNX Runtime's profile telling which implementation ran.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest

ort = pytest.importorskip("onnxruntime")

import onnx2fused  # noqa: E402
from onnx2fused.convert import PLUGIN_KEY  # noqa: E402
from onnx2fused.spec import DOMAIN  # noqa: E402

from onnx_builders import mlp, run  # noqa: E402

MODELS = Path(__file__).resolve().parent.parent / "models"
ZOO = json.loads((MODELS / "zoo.json").read_text())["models"]
CASES = [pytest.param(m, kind, id=f"{m['name']}.{kind}") for m in ZOO for kind in sorted(m["files"])]


@pytest.fixture(scope="session")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("o2f-cache")


def rel_l2(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def fresh_inputs(dims, batch=7, seq=3, seed=99):
    shape = [batch if d == "batch" else seq if isinstance(d, str) else d for d in dims]
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def ops_run(path, feeds, plugin=None, prefix="prof"):
    """(outputs, op types of the nodes ONNX Runtime ran) of a plain onnxruntime CPU session on `path`,
    with the plugin library registered by hand when given (as the README shows), from its profile."""
    so = ort.SessionOptions()
    so.enable_profiling = True
    so.profile_file_prefix = str(Path(path).parent / prefix)
    if plugin is not None:
        so.register_custom_ops_library(str(plugin))
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    ys = sess.run(None, feeds)
    events = json.loads(Path(sess.end_profiling()).read_text())
    return ys, {e["args"]["op_name"] for e in events if e.get("cat") == "Node" and "op_name" in e.get("args", {})}


def stock(path, feeds):
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"]).run(None, feeds)


@pytest.mark.parametrize("entry,kind", CASES)
def test_zoo_converts(entry, kind, cache, tmp_path):
    f = entry["files"][kind]
    src = MODELS / f["file"]
    before = src.read_bytes()
    out = tmp_path / "m.fused.onnx"
    res = onnx2fused.convert(src, out, precision="fp16", cache_dir=cache, with_cuda=False)
    assert src.read_bytes() == before

    assert res.validation is not None and res.validation.passed
    assert res.validation.provider == "CPUExecutionProvider"
    assert "CPU EP" in res.validation.tolerance_note
    assert len(res.chains) == 1
    assert res.chains[0].widths == entry["widths"]
    for e in res.validation.outputs:
        assert e.rel_l2 <= 1e-4 and e.reference_nonzero

    fused = onnx.load(str(out))
    custom = [n for n in fused.graph.node if n.domain == DOMAIN]
    assert len(custom) == len(res.chains)
    assert {n.op_type for n in custom} == {c.name for c in res.chains}
    meta = {p.key: p.value for p in fused.metadata_props}
    assert meta[PLUGIN_KEY] == "m.fused.onnx2fused.so"
    assert (out.parent / meta[PLUGIN_KEY]).is_file()
    assert Path(res.library_path) == out.parent / meta[PLUGIN_KEY]
    assert not list(tmp_path.glob(".*tmp*")), "temp files left behind"

    x = fresh_inputs(f["input_dims"])
    ref = stock(src, {entry["input"]: x})[0]
    sess = onnx2fused.InferenceSession(out, providers=["CPUExecutionProvider"])
    assert sess.plugin_path == out.parent / meta[PLUGIN_KEY]
    y_plugin = sess.run(None, {entry["input"]: x})[0]
    y_fallback = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]).run(None, {entry["input"]: x})[0]
    assert y_plugin.shape == ref.shape == y_fallback.shape
    assert rel_l2(y_plugin, ref) <= 1e-4
    assert rel_l2(y_fallback, ref) <= 1e-5

    # Plain onnxruntime, plugin registered by hand: the fused node always runs as one node (the generated
    # CPU kernel where cpu_policy registered it, the report's plan says which, else the plugin's inner
    # session on the stock body); without the plugin, the model-local function is inlined. The profiles
    # show which ran, so a silent fallback cannot pass for the plugin.
    op = res.chains[0].name
    kernel = "CPU: fused CPU kernel" in res.chains[0].cuda_plan
    assert kernel or "CPU: stock ops" in res.chains[0].cuda_plan
    (y_plain,), ran = ops_run(out, {entry["input"]: x}, plugin=out.parent / meta[PLUGIN_KEY], prefix="with")
    assert op in ran and not ran & {"Gemm", "MatMul"}, (op, ran)
    assert y_plain.shape == ref.shape and rel_l2(y_plain, ref) <= (1e-4 if kernel else 1e-5)
    (y_plain,), ran = ops_run(out, {entry["input"]: x}, prefix="without")
    assert op not in ran and ran & {"Gemm", "MatMul"}, ran
    assert y_plain.shape == ref.shape and rel_l2(y_plain, ref) <= 1e-5


def test_rank3_handbuilt(cache, tmp_path):
    src = tmp_path / "r3.onnx"
    onnx.save(mlp([12, 24, 20, 6], act="Tanh", kind="matmul", rank=3), str(src))
    out = tmp_path / "r3.fused.onnx"
    res = onnx2fused.convert(src, out, cache_dir=cache, with_cuda=False)
    assert len(res.chains) == 1 and res.validation.passed
    assert any("5" in c for c in res.validation.cases)  # the symbolic S dimension got a small value
    x = np.random.default_rng(3).standard_normal((4, 9, 12)).astype(np.float32)
    ref = run(onnx.load(str(src)), {"x": x})[0]
    y = onnx2fused.InferenceSession(out).run(None, {"x": x})[0]
    assert y.shape == (4, 9, 6) and rel_l2(y, ref) <= 1e-4
