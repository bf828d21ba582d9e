"""Graph shapes from real exporters and hand-written variants: what gets fused, what stays byte for byte,
why the rest is not fused, and that the converted model computes what the original did.

Most checks run the rewritten model on stock ORT without the plugin (each fused node then runs its
model-local fallback function, the chain in stock ops): cheap, and it proves the graph surgery. The
plugin itself is built once, for the residual/LayerNorm model, to run it under ORT_ENABLE_ALL.
"""
from __future__ import annotations

import itertools
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx2fused import expr as ex
from onnx2fused.loader import load_model
from onnx2fused.spec import DOMAIN
from onnx_builders import (F16, F32, G, assert_close, assert_every_unfused_layer_explained, assert_untouched_identical,
                           fuse, mlp, plugin_session, rand, run)

BF16 = TensorProto.BFLOAT16


def check_converted(m, feeds, tol=1e-5, chains=None):
    """Fuse m; check the graph surgery and that the fallback computes the original's outputs."""
    plan, specs, r = fuse(m)
    if chains is not None:
        assert [c.widths for c in plan.chains] == chains, plan.describe()
    onnx.checker.check_model(r, full_check=True)
    assert_untouched_identical(m, plan, r)
    assert_every_unfused_layer_explained(m, plan)
    for u, v in zip(run(m, feeds), run(r, feeds)):
        assert_close(v, u, tol)
    return plan, r


# -- torch.onnx.export, both exporters ---------------------------------------------------------------

torch = pytest.importorskip("torch")
nn = torch.nn


def _torch_mlp(seed=0, channels=16):
    """channels=16: PReLU with a per-channel slope (torch's channel axis is 1: 2-D inputs only)."""
    torch.manual_seed(seed)
    prelu = nn.PReLU(channels)
    with torch.no_grad():
        prelu.weight.copy_(torch.linspace(-0.3, 0.5, channels))
    return nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 16), prelu, nn.Linear(16, 12), nn.SiLU(),
                         nn.Linear(12, 12), nn.Hardswish(), nn.Linear(12, 4), nn.Tanh()).eval()


def _export(module, x, path, dynamo, opset):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if dynamo:
            torch.onnx.export(module, (x,), str(path), dynamo=True, opset_version=opset, verbose=False)
        else:
            torch.onnx.export(module, (x,), str(path), dynamo=False, opset_version=opset, input_names=["x"],
                              output_names=["y"], dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}})
    return load_model(path)


@pytest.mark.parametrize("dynamo,opset", [(False, o) for o in range(13, 21)] + [(True, o) for o in (18, 19, 20)])
def test_torch_export_fuses_into_one_chain(dynamo, opset, tmp_path):
    module = _torch_mlp()
    x = torch.randn(5, 6)
    m = _export(module, x, tmp_path / "m.onnx", dynamo, opset)
    batch = 5 if dynamo else 37  # the dynamo export keeps the example's batch size
    plan, r = check_converted(m, {m.graph.input[0].name: rand([batch, 6])}, chains=[(6, 16, 16, 12, 12, 4)])
    assert plan.refusals == []
    assert [n.domain for n in r.graph.node] == [DOMAIN]  # every exported node became the fused one
    acts = plan.chains[0].activations
    assert ex.short_name(acts[0]) == "gelu" and ex.short_name(acts[1]) == "prelu" and acts[4] == ex.tanh()
    with torch.no_grad():
        want = module(torch.from_numpy(rand([batch, 6], seed=4))).numpy()
    (got,) = run(r, {m.graph.input[0].name: rand([batch, 6], seed=4)})
    assert_close(got, want, 1e-5)


@pytest.mark.parametrize("shape", [[2, 7, 6], [2, 3, 4, 6]])
def test_torch_rank3_and_rank4_inputs(shape, tmp_path):
    module = _torch_mlp(1, channels=1)
    m = _export(module, torch.randn(*shape), tmp_path / "m.onnx", False, 17)
    plan, _ = check_converted(m, {"x": rand(shape)}, chains=[(6, 16, 16, 12, 12, 4)])
    assert plan.chains[0].layers[0].linear.op == "MatMul" and plan.refusals == []


def test_torch_fp16_model(tmp_path):
    module = _torch_mlp(2).half()
    m = _export(module, torch.randn(5, 6).half(), tmp_path / "m.onnx", False, 17)
    plan, r = check_converted(m, {"x": rand([33, 6], scale=1.0, dtype=np.float16)}, tol=1e-2)
    assert plan.chains[0].input_dtype == "f16" and r.graph.output[0].type.tensor_type.elem_type == F16


def test_torch_flatten_before_first_layer(tmp_path):
    module = nn.Sequential(nn.Flatten(), *list(_torch_mlp(3))).eval()
    m = _export(module, torch.randn(4, 2, 3), tmp_path / "m.onnx", False, 17)
    assert [n.op_type for n in m.graph.node][0] in ("Flatten", "Reshape")
    plan, r = check_converted(m, {"x": rand([11, 2, 3])}, chains=[(6, 16, 16, 12, 12, 4)])
    assert r.graph.node[0].op_type == m.graph.node[0].op_type  # kept, feeding the fused node


# -- scikit-learn --------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind,act,out_act", [
    ("regressor", "relu", ex.identity()),
    ("regressor", "tanh", ex.identity()),
    ("classifier", "logistic", ex.identity()),  # multiclass: the logits feed a Softmax tail, not fused
])
def test_skl2onnx_mlps(kind, act, out_act):
    nnet = pytest.importorskip("sklearn.neural_network")
    skl2onnx = pytest.importorskip("skl2onnx")
    rng = np.random.default_rng(0)
    X = rng.standard_normal((80, 5)).astype(np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if kind == "regressor":
            est = nnet.MLPRegressor(hidden_layer_sizes=(16, 8), activation=act, max_iter=40, random_state=0).fit(X, X @ np.arange(5.0))
        else:
            est = nnet.MLPClassifier(hidden_layer_sizes=(16, 8), activation=act, max_iter=40, random_state=0).fit(X, (X[:, 0] > 0).astype(int) + (X[:, 1] > 0))
    m = skl2onnx.to_onnx(est, X[:1], options={"zipmap": False} if kind == "classifier" else None)
    named = {"relu": ex.relu(), "tanh": ex.tanh(), "logistic": ex.sigmoid()}[act]
    plan, r = check_converted(m, {"X": X}, tol=1e-5)
    (c,) = plan.chains
    assert c.widths[:3] == (5, 16, 8) and c.activations == [named, named, out_act]
    if kind == "classifier":
        assert "Softmax" in [n.op_type for n in r.graph.node]


# -- hand-written Gemm: every attribute combination -----------------------------------------------------

GEMM_BIAS = {"none": None, "vec": [4], "row": [1, 4], "scalar": [], "scalar_1x1": [1, 1]}


@pytest.mark.parametrize("trans_a,trans_b,alpha,beta,bias", list(itertools.product(
    [0, 1], [0, 1], [1.0, 0.5], [1.0, 0.0, 2.0], list(GEMM_BIAS))))
def test_gemm_attribute_combinations(trans_a, trans_b, alpha, beta, bias):
    g = G()
    rng = np.random.default_rng(3)
    w = g.init(rng.standard_normal((4, 6) if trans_b else (6, 4)).astype(np.float32), "w")
    ins = ["x", w]
    if GEMM_BIAS[bias] is not None:
        ins.append(g.init(rng.standard_normal(GEMM_BIAS[bias]).astype(np.float32), "c"))
    g.op("Gemm", ins, name="gemm", outputs=["h"], transA=trans_a, transB=trans_b, alpha=alpha, beta=beta)
    g.op("Relu", ["h"], name="relu", outputs=["y"])
    m = g.model([("x", [6, "B"] if trans_a else ["B", 6])], [("y", ["B", 4])])
    plan, _ = check_converted(m, {"x": rand([6, 5] if trans_a else [5, 6])})
    if trans_a:
        assert plan.chains == [] and [r.reason for r in plan.refusals] == [
            "Gemm 'gemm': transA=1 (transposed input) is not supported"]
    else:
        assert [c.widths for c in plan.chains] == [(6, 4)] and plan.refusals == []
        assert plan.chains[0].layers[0].linear.has_bias == (GEMM_BIAS[bias] is not None and beta != 0.0)


# -- weights from constant subgraphs, external data, dtypes -----------------------------------------

WEIGHT_SOURCES = {  # ways a [6, 8] weight w reaches a MatMul, all foldable to constants
    "constant_node": lambda g, w: g.const_node(w),
    "transpose_of_initializer": lambda g, w: g.op("Transpose", [g.init(w.T.copy())], perm=[1, 0]),
    "cast_of_fp16_initializer": lambda g, w: g.op("Cast", [g.init(w.astype(np.float16))], to=TensorProto.FLOAT),
    "identity_of_reshape": lambda g, w: g.op("Identity", [g.op("Reshape", [g.init(w.reshape(-1)),
                                                                           g.init(np.array([6, 8]))])]),
    "constant_of_shape": lambda g, w: g.op("ConstantOfShape", [g.const_node(np.array([6, 8], np.int64))],
                                           value=numpy_helper.from_array(np.array([0.25], np.float32))),
}


@pytest.mark.parametrize("source", sorted(WEIGHT_SOURCES))
def test_weights_from_constant_subgraphs(source):
    g = G()
    w = WEIGHT_SOURCES[source](g, g.rng.standard_normal((6, 8)).astype(np.float32))
    bias = g.op("ConstantOfShape", [g.const_node(np.array([8], np.int64))],
                value=numpy_helper.from_array(np.array([0.5], np.float32)))
    h = g.op("Relu", [g.op("Add", [g.op("MatMul", ["x", w], name="fc0"), bias])], name="r0")
    g.op("MatMul", [h, g.weight(8, 3)], name="fc1", outputs=["y"])
    m = g.model([("x", ["B", 6])], [("y", ["B", 3])])
    plan, r = check_converted(m, {"x": rand([7, 6])}, chains=[(6, 8, 3)])
    assert plan.chains[0].layers[0].linear.has_bias
    assert [n.op_type for n in r.graph.node] == [plan_spec_name(plan)]  # the folded producers are gone


def plan_spec_name(plan, precision="fp32"):
    return plan.chains[0].to_spec(precision).name


def test_external_data_model(tmp_path):
    m = mlp([8, 32, 32, 4], act="Gelu", opset=20, ir=10)
    path = tmp_path / "ext.onnx"
    onnx.save(m, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location="ext.onnx.data",
              size_threshold=0)
    assert (tmp_path / "ext.onnx.data").stat().st_size >= 4 * (8 * 32 + 32 * 32 + 32 * 4)
    loaded = load_model(path)
    check_converted(loaded, {"x": rand([5, 8])}, chains=[(8, 32, 32, 4)])


def test_fp16_hand_built_model():
    plan, r = check_converted(mlp([8, 16, 4], kind="matmul", act="Sigmoid", elem=F16),
                              {"x": rand([6, 8], dtype=np.float16)}, tol=1e-2, chains=[(8, 16, 4)])
    assert plan.chains[0].input_dtype == "f16"


def _bf16(arr):
    t = numpy_helper.from_array(np.asarray(arr, np.float32))
    return helper.make_tensor(t.name, BF16, arr.shape, (np.asarray(arr, np.float32).view(np.uint32) >> 16).tolist())


def test_bf16_model_refused_with_reason_and_cast_wrapped_bf16_fused():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((8, 4)).astype(np.float32)
    wt = _bf16(w)
    wt.name = "w"
    # bf16 input: the plugin takes float32/float16 only, so the layer is refused with its reason
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", BF16, ["B", 8])],
                          [helper.make_tensor_value_info("y", BF16, ["B", 4])], [wt])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    plan, _, r = fuse(m)
    assert plan.chains == [] and [x.reason for x in plan.refusals] == [
        "MatMul 'mm': input 'x' has element type bfloat16; only float32/float16 are fused"]
    assert r.graph.SerializeToString() == m.graph.SerializeToString()
    # bf16 weights behind a Cast to float32 (a common bf16 checkpoint export): fused, weights in fp32
    nodes = [helper.make_node("Cast", ["w"], ["wf"], name="cw", to=F32),
             helper.make_node("MatMul", ["x", "wf"], ["h"], name="mm"),
             helper.make_node("Tanh", ["h"], ["y"], name="t")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F32, ["B", 8])],
                          [helper.make_tensor_value_info("y", F32, ["B", 4])], [wt])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    check_converted(m, {"x": rand([5, 8])}, chains=[(8, 4)])


def test_reshape_before_first_layer():
    g = G()
    flat = g.op("Reshape", ["x", g.init(np.array([-1, 12]))], name="flat")
    h = g.op("Elu", [g.linear(flat, 12, 16, name="fc0")], name="e0")
    g.linear(h, 16, 2, name="fc1")
    g.nodes[-1].output[0] = "y"
    m = g.model([("x", ["B", 3, 4])], [("y", ["B", 2])])
    _, r = check_converted(m, {"x": rand([5, 3, 4])}, chains=[(12, 16, 2)])
    assert r.graph.node[0].op_type == "Reshape"


def test_weights_shared_by_two_layers_and_two_chains():
    g = G()
    shared = g.weight(16, 16, name="shared")
    h = g.op("Relu", [g.op("MatMul", [g.linear("x", 8, 16, name="fc0"), shared], name="fc1")], name="r1")
    h = g.op("Relu", [g.op("MatMul", [h, shared], name="fc2")], name="r2")  # same weight, same chain
    side = g.op("Tanh", [g.op("MatMul", [g.op("Softmax", [h], name="sm"), shared], name="fc3")], name="t3")
    g.op("Add", [h, side], name="join", outputs=["y"])
    m = g.model([("x", ["B", 8])], [("y", ["B", 16])])
    plan, r = check_converted(m, {"x": rand([6, 8])}, chains=[(8, 16, 16, 16), (16, 16)])
    assert "shared" not in {t.name for t in r.graph.initializer}


# -- residual blocks and broken chains: fuse every piece, keep the rest -------------------------------

def residual_model():
    """x -> [x + MLP(x)] -> LayerNorm -> [MLP] -> Concat with a side MLP -> MLP -> y, with a second
    consumer of one hidden value and a graph output in the middle."""
    g = G(opset=17)
    h1 = g.op("Gelu" if g.opset >= 20 else "Relu", [g.linear("x", 16, 32, name="r0a")], name="r0act")
    r0 = g.op("Add", ["x", g.linear(h1, 32, 16, name="r0b")], name="res0")       # x + MLP(x)
    ln = g.op("LayerNormalization", [r0, g.init(np.ones(16, np.float32)), g.init(np.zeros(16, np.float32))],
              name="ln", axis=-1)
    a = g.op("Tanh", [g.linear(ln, 16, 24, name="m0")], name="m0act", outputs=["mid"])  # also a graph output
    s = g.op("Sigmoid", [g.linear(ln, 16, 8, name="s0")], name="s0act")
    cat = g.op("Concat", [a, s], name="cat", axis=-1)
    hid = g.op("Relu", [g.linear(cat, 32, 32, name="t0")], name="t0act")
    side = g.op("ReduceMean", [hid], name="second_consumer", keepdims=1)
    out = g.linear(hid, 32, 4, name="t1")
    g.op("Add", [out, side], name="plus_side", outputs=["y"])
    return g.model([("x", ["B", 16])], [("y", ["B", 4]), ("mid", ["B", 24])])


def test_residual_layernorm_concat_and_second_consumer_pieces():
    m = residual_model()
    plan, r = check_converted(m, {"x": rand([9, 16])}, chains=[(16, 32, 16), (16, 24), (16, 8), (32, 32), (32, 4)])
    reasons = [x.reason for x in plan.refusals]
    # x + MLP(x) is a residual block (issue 16): the Add is in chain 0; the LayerNorm feeds two chains,
    # so it is neither's prologue, and each says so
    assert plan.chains[0].residual and plan.chains[0].input == "x"
    assert [r for r in reasons if "LayerNormalization 'ln'" in r] == [
        f"chain {k} starts: input '{ln}' comes from LayerNormalization 'ln': the normalised tensor '{ln}' also "
        f"feeds Gemm '{other}'" for k, other in ((1, "s0"), (2, "m0")) for ln in [plan.chains[1].input]]
    assert "chain 1 ends: output of layer 1 ('mid') is also a graph output" in reasons
    assert any(x.startswith("chain 3 ends: output of layer 1 (") and "has 2 consumers (ReduceMean 'second_consumer', "
               "Gemm 't1')" in x for x in reasons), reasons
    kept = [n.op_type for n in r.graph.node if n.domain != DOMAIN]
    assert kept == ["LayerNormalization", "Concat", "ReduceMean", "Add"]


@pytest.fixture(scope="module")
def residual_plugin(tmp_path_factory):
    from onnx2fused.library import build_plugin
    m = residual_model()
    plan, specs, r = fuse(m)
    lib = build_plugin(specs, with_cuda=False, cache_dir=tmp_path_factory.mktemp("cache"))
    return m, r, lib.path


@pytest.mark.parametrize("level", [ort.GraphOptimizationLevel.ORT_ENABLE_ALL, ort.GraphOptimizationLevel.ORT_ENABLE_BASIC])
@pytest.mark.parametrize("with_plugin", [True, False])
def test_ort_optimisations_still_run_on_the_converted_model(residual_plugin, level, with_plugin, tmp_path):
    m, r, lib = residual_plugin
    so_path = tmp_path / "optimised.onnx"
    sess = plugin_session(r, lib if with_plugin else None, level)
    x = rand([37, 16], seed=2)
    ref = run(m, {"x": x})
    for u, v in zip(ref, sess.run(None, {"x": x})):
        assert_close(v, u, 1e-4)
    # ORT really optimised around the fused nodes: save what it ran and look
    so = ort.SessionOptions()
    so.graph_optimization_level = level
    so.optimized_model_filepath = str(so_path)
    if with_plugin:
        so.register_custom_ops_library(str(lib))
    ort.InferenceSession(r.SerializeToString(), so, providers=["CPUExecutionProvider"])
    ops = [n.op_type for n in onnx.load(str(so_path)).graph.node]
    if with_plugin:
        assert sum(op.startswith("FusedMLP_") for op in ops) == 5, ops
    else:
        assert not any(op.startswith("FusedMLP_") for op in ops)  # the functions were inlined


# -- every refusal kind, as `inspect` prints it ---------------------------------------------------------

def _refusal_models():
    """name -> (model, the expected refusal lines)."""
    out = {}
    g = G()
    g.op("MatMul", ["x", "w"], name="mm", outputs=["y"])
    out["weight_not_constant"] = (g.model([("x", ["B", 8]), ("w", [8, 4])], [("y", ["B", 4])]),
                                  ["MatMul 'mm': weight 'w' is not a constant"])
    g = G()
    w = g.weight(8, 4, name="w")
    g.op("MatMul", ["x", w], name="mm", outputs=["y"])
    m = g.model([("x", ["B", 8]), ("w", [8, 4])], [("y", ["B", 4])])
    out["weight_overridable"] = (m, ["MatMul 'mm': weight 'w' is not a constant ('w' is a graph input (it can be "
                                     "overridden at run time; torch: export with keep_initializers_as_inputs=False))"])
    g = G()
    g.op("MatMul", [g.weight(4, 8, name="c"), "x"], name="mm", outputs=["y"])
    out["constant_left_operand"] = (g.model([("x", [8, "B"])], [("y", [4, "B"])]),
                                    ["MatMul 'mm': the constant 'c' is the left operand (c @ x is not a linear layer on x)"])
    g = G()
    g.op("MatMul", ["x", g.init(np.ones((2, 8, 4), np.float32), "w3")], name="mm", outputs=["y"])
    out["weight_3d"] = (g.model([("x", ["B", 8])], [("y", [2, "B", 4])]),
                        ["MatMul 'mm': weight 'w3' has shape [2, 8, 4], not 2-D"])
    g = G()
    g.op("MatMul", ["x", g.init(np.ones((8, 4), np.int32), "wi")], name="mm", outputs=["y"])
    m = g.model([("x", ["B", 8])], [("y", ["B", 4])], check=False)
    for v in list(m.graph.input) + list(m.graph.output):
        v.type.tensor_type.elem_type = TensorProto.INT32
    out["int_weight"] = (m, ["MatMul 'mm': weight 'wi' has element type int32; only float16/bfloat16/float32 are fused"])
    g = G()
    g.op("Gemm", ["x", g.weight(8, 4), g.init(np.ones((3, 4), np.float32), "c")], name="gm", outputs=["y"])
    out["gemm_bias_shape"] = (g.model([("x", [3, 8])], [("y", [3, 4])]),
                              ["Gemm 'gm': bias 'c' of shape [3, 4] does not broadcast to [4]"])
    g = G()
    g.op("Gemm", ["x", g.weight(8, 4)], name="gm", outputs=["y"], transA=1)
    out["gemm_trans_a"] = (g.model([("x", [8, "B"])], [("y", ["B", 4])]),
                           ["Gemm 'gm': transA=1 (transposed input) is not supported"])
    g = G()
    h = g.op("Relu", [g.linear("x", 8, 16, name="fc0")], name="r0", outputs=["h"])
    g.op("Gemm", [h, "wv"], name="fc1", outputs=["y"])
    out["feeds_refused_layer"] = (g.model([("x", ["B", 8]), ("wv", [16, 4])], [("y", ["B", 4])]), [
        "chain 0 ends: output of layer 1 ('h') feeds Gemm 'fc1', which is not fused",
        "Gemm 'fc1': weight 'wv' is not a constant"])
    g = G()
    h = g.op("Cast", [g.linear("x", 8, 4, name="fc0")], name="to16", outputs=["y"], to=TensorProto.FLOAT16)
    m = g.model([("x", ["B", 8])], [("y", ["B", 4])])
    m.graph.output[0].type.tensor_type.elem_type = F16
    out["cast_to_float16_at_the_end"] = (m, [  # the layer is fused; the rounding Cast stays a stock op
        "chain 0 ends: output of layer 1 ('gemm_out3') feeds Cast 'to16': Cast to float16 rounds the float32 value"])
    return out


REFUSALS = _refusal_models()


@pytest.mark.parametrize("name", sorted(REFUSALS))
def test_inspect_explains_each_refusal_kind(name, tmp_path):
    import onnx2fused
    m, want = REFUSALS[name]
    path = tmp_path / f"{name}.onnx"
    onnx.save(m, str(path))
    plan, _, r = fuse(m)
    assert [x.reason for x in plan.refusals] == want
    assert_every_unfused_layer_explained(m, plan)
    assert_untouched_identical(m, plan, r)
    try:
        res = onnx2fused.inspect(str(path))
    except onnx2fused.ConversionError as e:  # the loader rejects the model: the passes' reasons still hold
        pytest.skip(f"loader refuses this hand-built model: {e}")
    assert res.refusals == want
    text = res.format()
    assert all(line in text for line in want)
