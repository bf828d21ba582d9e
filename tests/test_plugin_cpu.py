"""The CPU plugin end to end: build, load into stock onnxruntime, compare with the numpy reference."""
from __future__ import annotations


import numpy as np
import pytest

ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from onnx2fused import expr as ex  # noqa: E402
from onnx2fused.library import build_plugin  # noqa: E402
from onnx2fused.spec import LayerSpec, MLPSpec  # noqa: E402
from thread_support import run_threads  # noqa: E402


def mlp(widths, acts, bias=True, io="f32") -> MLPSpec:
    bias = bias if isinstance(bias, (list, tuple)) else [bias] * len(acts)
    return MLPSpec(tuple(LayerSpec(a, b, hb, act) for a, b, hb, act in zip(widths, widths[1:], bias, acts)),
                   io_dtype=io)


SPECS = {
    "relu": mlp([32, 64, 64, 16], [ex.relu(), ex.relu(), ex.identity()]),
    "odd": mlp([13, 37, 5], [ex.gelu_erf(), ex.tanh()], bias=[False, True]),
    "f16": mlp([24, 40, 24], [ex.silu(), ex.sigmoid()], io="f16"),
    "mixed": mlp([9, 17, 33, 1], [ex.elu(), ex.hard_swish(), ex.mish()], bias=False),
    "wide": mlp([70, 130, 10], [ex.leaky_relu(0.1), ex.softplus()]),
}


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    lib = build_plugin(list(SPECS.values()), with_cuda=False, cache_dir=tmp_path_factory.mktemp("cache"))
    assert lib.path.is_file()
    return lib


def weights(spec: MLPSpec, seed=0):
    rng = np.random.default_rng(seed)
    ws, bs = [], []
    for l in spec.layers:
        ws.append((rng.standard_normal((l.in_features, l.out_features)) / np.sqrt(l.in_features)).astype(np.float32))
        b = rng.standard_normal(l.out_features).astype(np.float32) * 0.5
        bs.append(b if l.has_bias else np.zeros_like(b))
    return ws, bs


def fused_model(spec: MLPSpec, ws, bs, widths=None, x_shape=None):
    io = TensorProto.FLOAT16 if spec.io_dtype == "f16" else TensorProto.FLOAT
    inits, inputs = [], ["X"]
    for i, (w, b) in enumerate(zip(ws, bs)):
        inits += [numpy_helper.from_array(w, f"W_{i}"), numpy_helper.from_array(b, f"B_{i}")]
        inputs += [f"W_{i}", f"B_{i}"]
    node = helper.make_node(spec.name, inputs, ["Y"], domain="onnx2fused",
                            widths=list(widths or spec.widths),
                            activations=[ex.to_text(l.activation) for l in spec.layers])
    x_shape = x_shape or ["batch", spec.widths[0]]
    x_shape = None if x_shape == "any" else x_shape  # "any": unknown rank
    y_shape = ["batch", spec.widths[-1]] if x_shape == ["batch", spec.widths[0]] else None
    graph = helper.make_graph([node], "fused", [helper.make_tensor_value_info("X", io, x_shape)],
                              [helper.make_tensor_value_info("Y", io, y_shape)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("onnx2fused", 1)],
                             ir_version=9)


def session(library, model, threads=2):
    so = ort.SessionOptions()
    so.register_custom_ops_library(str(library.path))
    so.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def reference(spec: MLPSpec, ws, bs, x):
    h = x.astype(np.float32).reshape(-1, spec.widths[0])
    for l, w, b in zip(spec.layers, ws, bs):
        h = ex.evaluate(l.activation, (h.astype(np.float64) @ w + b).astype(np.float32))
    return h.reshape(x.shape[:-1] + (spec.widths[-1],))


def check(spec, y, ref):
    assert y.dtype == (np.float16 if spec.io_dtype == "f16" else np.float32)
    assert y.shape == ref.shape
    if ref.size:
        assert np.abs(ref).max() > 0  # an all-zero kernel cannot pass
    if spec.io_dtype == "f16":
        np.testing.assert_allclose(y.astype(np.float32), ref.astype(np.float16).astype(np.float32), rtol=2e-3, atol=2e-3)
    else:
        np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-4)


def make_x(spec, shape, seed=1):
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    return x.astype(np.float16) if spec.io_dtype == "f16" else x


@pytest.mark.parametrize("key", list(SPECS))
@pytest.mark.parametrize("batch", [0, 1, 3, 7, 129, 2000])   # 1, 3: fewer rows than a micro-kernel (run_block<1>)
def test_matches_reference(library, key, batch):
    spec = SPECS[key]
    ws, bs = weights(spec)
    sess = session(library, fused_model(spec, ws, bs))
    x = make_x(spec, (batch, spec.widths[0]))
    y = sess.run(None, {"X": x})[0]
    check(spec, y, reference(spec, ws, bs, x))


@pytest.mark.parametrize("key", ["relu", "f16"])
def test_rank3_input(library, key):
    spec = SPECS[key]
    ws, bs = weights(spec)
    sess = session(library, fused_model(spec, ws, bs, x_shape=["a", "b", spec.widths[0]]))
    x = make_x(spec, (3, 41, spec.widths[0]))
    y = sess.run(None, {"X": x})[0]
    assert y.shape == (3, 41, spec.widths[-1])
    check(spec, y, reference(spec, ws, bs, x))


def test_single_thread_session(library):
    spec = SPECS["wide"]
    ws, bs = weights(spec)
    sess = session(library, fused_model(spec, ws, bs), threads=1)
    x = make_x(spec, (1000, spec.widths[0]))
    check(spec, sess.run(None, {"X": x})[0], reference(spec, ws, bs, x))


def test_wrong_last_dim_is_an_ort_error_and_the_process_lives(library):
    spec = SPECS["relu"]
    ws, bs = weights(spec)
    sess = session(library, fused_model(spec, ws, bs, x_shape="any"))
    bad = np.ones((4, spec.widths[0] + 1), np.float32)
    with pytest.raises(Exception) as err:
        sess.run(None, {"X": bad})
    assert f"[..., {spec.widths[0]}]" in str(err.value) and "[4, 33]" in str(err.value)
    with pytest.raises(Exception) as err:
        sess.run(None, {"X": np.ones((spec.widths[0],), np.float32)})
    assert "rank >= 2" in str(err.value)
    x = make_x(spec, (5, spec.widths[0]))
    check(spec, sess.run(None, {"X": x})[0], reference(spec, ws, bs, x))


def test_wrong_weight_shape_is_an_ort_error(library):
    spec = SPECS["odd"]
    ws, bs = weights(spec)
    so = ort.SessionOptions()
    so.register_custom_ops_library(str(library.path))
    # W_1 fed at run time (not an initializer) with a wrong shape
    model = fused_model(spec, ws, bs)
    model.graph.initializer.pop(2)  # W_1
    model.graph.input.append(helper.make_tensor_value_info("W_1", TensorProto.FLOAT, ["k", "n"]))
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    x = make_x(spec, (3, spec.widths[0]))
    with pytest.raises(Exception) as err:
        sess.run(None, {"X": x, "W_1": np.ones((37, 6), np.float32)})
    assert "W_1 must be float32 [37, 5]" in str(err.value)
    y = sess.run(None, {"X": x, "W_1": ws[1]})[0]
    check(spec, y, reference(spec, ws, bs, x))


def test_widths_attribute_mismatch_is_refused(library):
    spec = SPECS["relu"]
    ws, bs = weights(spec)
    model = fused_model(spec, ws, bs, widths=[32, 64, 64, 17])
    with pytest.raises(Exception) as err:
        session(library, model)
    assert "library was built for a different model" in str(err.value)


def test_concurrent_runs_on_one_session(library):
    spec = SPECS["relu"]
    ws, bs = weights(spec)
    sess = session(library, fused_model(spec, ws, bs))
    xs = [make_x(spec, (300 + 17 * i, spec.widths[0]), seed=i) for i in range(8)]
    out: dict[int, np.ndarray] = {}

    def work(i):
        for _ in range(5):
            out[i] = sess.run(None, {"X": xs[i]})[0]

    run_threads(work, [(i,) for i in range(8)])
    for i, x in enumerate(xs):
        check(spec, out[i], reference(spec, ws, bs, x))


def test_special_values_propagate(library):
    spec = SPECS["relu"]
    ws, bs = weights(spec)
    sess = session(library, fused_model(spec, ws, bs))
    x = make_x(spec, (8, spec.widths[0]))
    x[3, 5] = np.nan
    y = sess.run(None, {"X": x})[0]
    ref = reference(spec, ws, bs, x)
    assert np.isnan(y[3]).all() == np.isnan(ref[3]).all()
    np.testing.assert_allclose(np.delete(y, 3, 0), np.delete(ref, 3, 0), rtol=1e-4, atol=1e-4)
