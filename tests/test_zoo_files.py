"""The model zoo (models/, built by models/build_zoo.py) is present, valid and self-consistent.

Each model is exported twice from the same weights (torch dynamo exporter, opset 20, weights as
external data; legacy exporter, opset 17, weights inline): both must load with onnx, pass the checker,
have input "x" / output "y" with a symbolic batch dimension, and give the same output in onnxruntime.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "models"
ZOO_JSON = MODELS / "zoo.json"
EXPORTERS = ("dynamo", "opset17")
REQUIRED = ("nerf", "sdf", "gelu", "silu", "mnist", "nobias", "ffn3d", "swiglu", "geglu", "preln", "llama", "tabular")


def _zoo():
    if not ZOO_JSON.is_file():
        pytest.fail(f"{ZOO_JSON} is missing: run `make zoo`")
    return json.loads(ZOO_JSON.read_text())


def _entries():
    try:
        return _zoo()["models"]
    except Exception:  # reported by test_manifest
        return []


ENTRIES = _entries()
FILES = [(e["name"], k) for e in ENTRIES for k in EXPORTERS if k in e["files"]]


def _entry(name):
    return next(e for e in ENTRIES if e["name"] == name)


def _path(name, kind):
    return MODELS / _entry(name)["files"][kind]["file"]


def _layer_shapes(e) -> list[tuple[int, int]]:
    """The (in, out) of each weight matrix the file holds: a gated block (issue 16) has a gate and an up
    projection of H outputs each (swiglu), or one of 2H (geglu, cut in two with chunk), then the down one."""
    w = e["widths"]
    block = e.get("block")
    if block in ("swiglu", "llama"):  # llama: RMSNorm, then swiglu's layers, then the residual
        return [(w[0], w[1]), (w[0], w[1]), (w[1], w[2])]
    if block in ("preln", "tabular"):   # tabular: BatchNorm1d on the input and after each hidden Linear
        return list(zip(w[:-1], w[1:]))
    if block == "geglu":
        return [(w[0], 2 * w[1]), (w[1], w[2])]
    assert block is None, f"unknown block {block!r}"
    return list(zip(w[:-1], w[1:]))


def _input(entry, batch=5, seed=0):
    lead = [batch] + ([3] if entry["rank"] == 3 else [])
    return np.random.default_rng(seed).standard_normal(lead + entry["feature_shape"]).astype(np.float32)


def _run(path, x):
    ort = pytest.importorskip("onnxruntime")
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    (y,) = sess.run(["y"], {"x": x})
    return y


def test_manifest():
    zoo = _zoo()
    names = [e["name"] for e in zoo["models"]]
    assert set(REQUIRED) <= set(names), f"missing from zoo.json: {set(REQUIRED) - set(names)}"
    for e in zoo["models"]:
        assert e["input"] == "x" and e["output"] == "y"
        assert e["widths"][0] == e["feature_shape"][-1]
        assert len(e["activations"]) == len(e["widths"]) - 2
        assert e["files"], f"{e['name']}: no file exported"
    # every exporter failure is recorded; none is expected with torch 2.13
    assert zoo["failed"] == [], zoo["failed"]
    total = sum(p.stat().st_size for p in MODELS.iterdir() if ".onnx" in p.name)
    assert total < 12e6, f"zoo is {total / 1e6:.1f} MB; keep it small"


@pytest.mark.parametrize("name,kind", FILES, ids=[f"{n}.{k}" for n, k in FILES])
def test_file_loads_and_checks(name, kind):
    e = _entry(name)
    info = e["files"][kind]
    path = _path(name, kind)
    assert path.is_file(), f"{path} is missing: run `make zoo`"
    for ext in info["external_data"]:
        assert (MODELS / ext).is_file(), f"external data {ext} of {path.name} is missing"
    onnx.checker.check_model(str(path), full_check=True)  # by path: handles external data
    model = onnx.load(str(path))  # loads external data from the model's folder
    assert model.opset_import[0].version == info["opset"]
    assert [i.name for i in model.graph.input] == ["x"]
    assert [o.name for o in model.graph.output] == ["y"]
    dims = model.graph.input[0].type.tensor_type.shape.dim
    assert len(dims) == e["rank"]
    assert dims[0].dim_param, "batch dimension must be symbolic"
    assert dims[-1].dim_value == e["feature_shape"][-1]
    # the weights in the file are the widths in the manifest (either layout: Gemm transB or MatMul)
    init = {t.name: t for t in model.graph.initializer}
    mats = sorted(tuple(sorted(t.dims)) for t in init.values() if len(t.dims) == 2)
    want = sorted(tuple(sorted(p)) for p in _layer_shapes(e))
    assert mats == want
    vecs = sorted(t.dims[0] for t in init.values() if len(t.dims) == 1 and t.dims[0] > 1)
    if e["bias"]:  # and a transformer block's LayerNorm weight and bias (K0 each)
        norm = [e["widths"][0]] * 2 if e.get("block") == "preln" else []
        if e.get("block") == "tabular":  # scale, bias, mean, var of each BatchNorm the exporter kept: the
            # input's always, the hidden ones where it did not fold them into the Linear before (dynamo does)
            kept = sum(n.op_type == "BatchNormalization" for n in model.graph.node)
            norm = [v for w in e["widths"][:kept] for v in [w] * 4]
        assert sorted([n for _, n in _layer_shapes(e) if n > 1] + norm) == vecs
    for t in init.values():
        assert t.data_location == onnx.TensorProto.DEFAULT  # onnx.load resolved external data
        assert onnx.numpy_helper.to_array(t).size == int(np.prod(t.dims))


@pytest.mark.parametrize("name", sorted({n for n, _ in FILES}))
def test_exporters_agree(name):
    e = _entry(name)
    if not all(k in e["files"] for k in EXPORTERS):
        pytest.skip(f"{name}: only {list(e['files'])} exported")
    for batch in (1, 5, 64):
        x = _input(e, batch=batch, seed=batch)
        a = _run(_path(name, "dynamo"), x)
        b = _run(_path(name, "opset17"), x)
        assert a.shape == b.shape == x.shape[:-1] + (e["widths"][-1],)
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", sorted({n for n, _ in FILES}))
def test_matches_pytorch(name):
    """The file holds the weights of the module build_zoo.py builds (same seed, same torch)."""
    torch = pytest.importorskip("torch")
    zoo = _zoo()
    if torch.__version__.split("+")[0] != zoo["torch"]:
        pytest.skip(f"zoo built with torch {zoo['torch']}, this is {torch.__version__}")
    sys.path.insert(0, str(MODELS))
    try:
        import build_zoo
    finally:
        sys.path.remove(str(MODELS))
    e = _entry(name)
    index = list(build_zoo.model_table()).index(name)
    m = build_zoo.build_module(name, index)
    x = _input(e, batch=7, seed=42)
    with torch.no_grad():
        ref = m(torch.from_numpy(x)).numpy()
    for kind in e["files"]:
        np.testing.assert_allclose(_run(_path(name, kind), x), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_zoo_is_reproducible(tmp_path):
    """models/build_zoo.py rebuilds the committed files byte for byte (same torch version)."""
    import subprocess

    torch = pytest.importorskip("torch")
    pytest.importorskip("onnxscript")
    zoo = _zoo()
    if torch.__version__.split("+")[0] != zoo["torch"]:
        pytest.skip(f"zoo built with torch {zoo['torch']}, this is {torch.__version__}")
    subprocess.run([sys.executable, str(MODELS / "build_zoo.py"), "--out", str(tmp_path)],
                   check=True, capture_output=True)
    for p in sorted(MODELS.iterdir()):
        if ".onnx" in p.name or p.name == "zoo.json":
            assert (tmp_path / p.name).read_bytes() == p.read_bytes(), \
                f"{p.name} differs from a fresh build: run `make zoo` and commit"
