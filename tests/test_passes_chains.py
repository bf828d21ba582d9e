"""Chain finding: maximal chains, where and why they end, refusals as text."""
import numpy as np
import onnx
import pytest

from onnx2fused import expr as ex
from onnx2fused.passes import find_chains, rewrite
from onnx2fused.spec import MLPSpec
from onnx_builders import F16, G, mlp, rand, run


def test_single_chain_gemm_relu():
    plan = find_chains(mlp([8, 16, 16, 16, 4]))
    assert len(plan.chains) == 1 and plan.refusals == []
    c = plan.chains[0]
    assert c.widths == (8, 16, 16, 16, 4) and c.input == "x" and c.output == "y" and c.input_dtype == "f32"
    assert c.activations == [ex.relu(), ex.relu(), ex.relu(), ex.identity()]
    assert c.nodes == ["fc0", "act0", "fc1", "act1", "fc2", "act2", "fc3"]
    assert [l.activation_nodes for l in c.layers] == [["act0"], ["act1"], ["act2"], []]
    spec = c.to_spec("fp16")
    assert isinstance(spec, MLPSpec) and spec.widths == c.widths and spec.io_dtype == "f32"
    assert spec.precision == "fp16" and [l.activation for l in spec.layers] == c.activations
    assert all(l.has_bias for l in spec.layers)


def test_single_layer_is_a_chain_and_no_bias():
    plan = find_chains(mlp([8, 4], kind="matmul", bias=False))
    (c,) = plan.chains
    assert c.widths == (8, 4) and not c.layers[0].linear.has_bias and c.activations == [ex.identity()]
    assert [l.has_bias for l in c.to_spec("fp32").layers] == [False]


def test_rank3_matmul_chain_and_f16():
    plan = find_chains(mlp([8, 16, 4], kind="matmul", rank=3, act="Gelu", opset=20))
    (c,) = plan.chains
    assert c.activations == [ex.gelu_erf(), ex.identity()] and c.widths == (8, 16, 4)
    (c,) = find_chains(mlp([8, 16, 4], kind="matmul", elem=F16)).chains
    assert c.input_dtype == "f16"


def _two_layer_with(extra):
    """x -> fc0 -> relu (h) -> fc1 -> y, then `extra(g)` to add the twist."""
    g = G()
    h = g.op("Relu", [g.linear("x", 8, 16, name="fc0")], name="relu0", outputs=["h"])
    g.linear(h, 16, 4, name="fc1")
    g.nodes[-1].output[0] = "y"
    outs = extra(g) or []
    return g.model([("x", ["B", 8])], [("y", ["B", 4])] + outs)


def test_intermediate_graph_output_ends_chain():
    plan = find_chains(_two_layer_with(lambda g: [("h", ["B", 16])]))
    assert [c.widths for c in plan.chains] == [(8, 16), (16, 4)]
    assert plan.chains[0].output == "h" and plan.chains[1].input == "h"
    assert [r.reason for r in plan.refusals] == ["chain 0 ends: output of layer 1 ('h') is also a graph output"]
    assert plan.refusals[0].node == "relu0"


def test_second_consumer_ends_chain():
    def extra(g):
        g.op("Softmax", ["h"], name="side", outputs=["s"])
        return [("s", ["B", 16])]
    plan = find_chains(_two_layer_with(extra))
    assert len(plan.chains) == 2
    assert plan.refusals[0].reason == "chain 0 ends: output of layer 1 ('h') has 2 consumers (Gemm 'fc1', Softmax 'side')"


def test_non_constant_weight_refusal_and_break():
    g = G()
    h = g.op("Relu", [g.linear("x", 8, 16, name="fc0")], name="relu0", outputs=["h"])
    g.op("Gemm", [h, "w3"], name="fc3", outputs=["y"])
    m = g.model([("x", ["B", 8]), ("w3", [16, 4])], [("y", ["B", 4])])
    plan = find_chains(m)
    assert [c.widths for c in plan.chains] == [(8, 16)]
    assert [(r.node, r.reason) for r in plan.refusals] == [
        ("relu0", "chain 0 ends: output of layer 1 ('h') feeds Gemm 'fc3', which is not fused"),
        ("fc3", "Gemm 'fc3': weight 'w3' is not a constant"),
    ]


def _init(m, name):
    return onnx.numpy_helper.to_array(next(t for t in m.graph.initializer if t.name == name))


def test_per_channel_scale_after_a_layer_folds_into_it():
    """A LayerScale-like per-channel gamma right after a layer is part of its linear map: it folds into
    the weights and bias (the activation is the identity, the chain the plain GEMMs the kernels like)."""
    g = G()
    lin = g.linear("x", 8, 16, name="fc0", kind="matmul")
    h = g.op("Mul", [lin, g.vec(16, name="gamma")], name="scale")
    g.linear(g.op("Relu", [h]), 16, 4, name="fc1")
    g.nodes[-1].output[0] = "y"
    m = g.model([("x", ["B", 8])], [("y", ["B", 4])])
    plan = find_chains(m)
    assert [c.widths for c in plan.chains] == [(8, 16, 4)] and plan.refusals == []
    gamma = _init(m, "gamma")
    first = plan.chains[0].layers[0]
    assert first.activation == ex.relu()
    w, b = (_init(m, n) for n in (m.graph.node[0].input[1], m.graph.node[1].input[1]))
    np.testing.assert_array_equal(first.linear.weight, w * gamma[None, :])
    np.testing.assert_array_equal(first.linear.bias, b * gamma)
    r = rewrite(m, plan, [plan.chains[0].to_spec("fp32")])
    x = rand([9, 8], seed=3)
    np.testing.assert_allclose(run(r, {"x": x})[0], run(m, {"x": x})[0], rtol=1e-5, atol=1e-6)


def test_a_scale_and_shift_after_the_activation_fold_into_the_next_layer():
    """Linear, ReLU, BatchNorm, Linear: relu(x) * s + t is the next layer's input map (its rows scaled by
    s, t W added to its bias), so the first activation is the named ReLU; on the last layer, with no
    layer after it, it stays in f."""
    g = G()
    h = g.op("Relu", [g.linear("x", 8, 16, name="fc0", kind="matmul")])
    h = g.op("Add", [g.op("Mul", [h, g.vec(16, name="gamma")]), g.vec(16, name="beta")])
    h = g.linear(h, 16, 4, name="fc1", kind="matmul", bias=False)
    g.op("Mul", [g.op("Relu", [h]), g.vec(4, name="gamma_last")], outputs=["y"])
    m = g.model([("x", ["B", 8])], [("y", ["B", 4])])
    plan = find_chains(m)
    (c,) = plan.chains
    assert c.widths == (8, 16, 4) and plan.refusals == []
    assert c.activations[0] == ex.relu()
    assert c.activations[1] == ex.relu() * ex.Chan(tuple(_init(m, "gamma_last")))
    w1 = _init(m, next(n for n in m.graph.node if n.name == "fc1").input[1])
    gamma, beta = _init(m, "gamma"), _init(m, "beta")
    np.testing.assert_allclose(c.layers[1].linear.weight, w1 * gamma[:, None], rtol=1e-6)
    np.testing.assert_allclose(c.layers[1].linear.bias, beta @ w1, rtol=1e-5, atol=1e-6)
    r = rewrite(m, plan, [c.to_spec("fp32")])
    x = rand([9, 8], seed=4)
    np.testing.assert_allclose(run(r, {"x": x})[0], run(m, {"x": x})[0], rtol=1e-5, atol=1e-5)


def test_non_per_channel_constant_ends_chain_with_reason():
    g = G()
    h = g.op("Mul", [g.linear("x", 8, 16, name="fc0", kind="matmul"), g.init(np.ones((2, 16), np.float32), "k2")],
             name="scale")
    g.op("ReduceSum", [h], name="rs", outputs=["y"], keepdims=0)
    plan = find_chains(g.model([("x", ["B", 8])], [("y", [])]))
    assert [c.widths for c in plan.chains] == [(8, 16)]
    assert [r.reason for r in plan.refusals] == [
        "chain 0 ends: output of layer 1 ('add_out4') feeds Mul 'scale': constant 'k2' of shape [2, 16] "
        "does not broadcast per channel (the layer's width is 16)"]


def test_double_input_refused():
    m = mlp([8, 4], kind="matmul", bias=False)
    m.graph.input[0].type.tensor_type.elem_type = onnx.TensorProto.DOUBLE
    m.graph.output[0].type.tensor_type.elem_type = onnx.TensorProto.DOUBLE
    m.graph.initializer[0].CopyFrom(onnx.numpy_helper.from_array(
        onnx.numpy_helper.to_array(m.graph.initializer[0]).astype(np.float64), m.graph.initializer[0].name))
    plan = find_chains(m)
    assert plan.chains == []
    assert [r.reason for r in plan.refusals] == [
        "MatMul 'fc0': weight 'w1' has element type float64; only float16/bfloat16/float32 are fused"]


def test_two_chains_around_softmax_and_describe():
    g = G()
    h = g.op("Tanh", [g.linear("x", 8, 16, name="a0")], name="t0")
    s = g.op("Softmax", [g.linear(h, 16, 16, name="a1")], name="sm")
    g.op("Sigmoid", [g.linear(s, 16, 4, name="b0")], name="sig", outputs=["y"])
    plan = find_chains(g.model([("x", ["B", 8])], [("y", ["B", 4])]))
    assert [(c.widths, c.activations) for c in plan.chains] == [
        ((8, 16, 16), [ex.tanh(), ex.identity()]), ((16, 4), [ex.sigmoid()])]
    # the Softmax splits what would be one chain, so the split says why
    assert [r.reason for r in plan.refusals] == [
        "chain 0 ends: output of layer 2 ('gemm_out7') feeds Softmax 'sm': Softmax normalises across the row, "
        "not elementwise"]
    text = plan.describe()
    assert "2 chain(s) to fuse:" in text
    assert "chain 0: 'x' -> " in text and "widths 8 -> 16 -> 16, activations [tanh, id], f32" in text
    assert "widths 16 -> 4, activations [sigmoid]" in text


def test_softmax_tail_is_a_natural_end():
    g = G()
    g.op("Softmax", [g.linear(g.op("Relu", [g.linear("x", 8, 16, name="a0")]), 16, 4, name="a1")], name="sm",
         outputs=["y"])
    plan = find_chains(g.model([("x", ["B", 8])], [("y", ["B", 4])]))
    assert [c.widths for c in plan.chains] == [(8, 16, 4)]
    assert plan.refusals == []  # no layer after it: nothing was split


def test_transa_gemm_refused_in_plan():
    g = G()
    g.op("Gemm", ["x", g.weight(8, 4)], name="gt", outputs=["y"], transA=1)
    plan = find_chains(g.model([("x", [8, "B"])], [("y", ["B", 4])]))
    assert plan.chains == [] and [r.reason for r in plan.refusals] == [
        "Gemm 'gt': transA=1 (transposed input) is not supported"]
    assert "Gemm 'gt': transA=1" in plan.describe()


def test_skl2onnx_mlp_classifier():
    sk = pytest.importorskip("sklearn.neural_network")
    skl2onnx = pytest.importorskip("skl2onnx")
    import warnings
    from onnx2fused.passes import rewrite
    from onnx_builders import run
    rng = np.random.default_rng(0)
    X = rng.standard_normal((60, 5)).astype(np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        clf = sk.MLPClassifier((16, 8), max_iter=30, random_state=0).fit(X, (X[:, 0] > 0).astype(int))
    m = skl2onnx.to_onnx(clf, X[:1], options={"zipmap": False})
    plan = find_chains(m)
    (c,) = plan.chains
    assert c.widths == (5, 16, 8, 1) and c.activations == [ex.relu(), ex.relu(), ex.sigmoid()]  # binary: logistic out
    r = rewrite(m, plan, [c.to_spec("fp32")])
    onnx.checker.check_model(r, full_check=True)
    for u, v in zip(run(m, {"X": X}), run(r, {"X": X})):
        np.testing.assert_allclose(v, u, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("op", ["Flatten", "Reshape", "Reshape_static"])
def test_a_flatten_or_reshape_that_changes_the_shape_ends_the_chain(op):
    """At rank 3 a Flatten (axis 1) merges the sequence into the features, and a Reshape to a fixed batch
    size is not the identity for every batch: the chain ends there and says why (a Flatten of a rank-2
    value, a Reshape to [-1, N], are: test_passes_activations). Where the batch is fixed too, the Reshape
    keeps the shape it has and the chain goes on."""
    g = G()
    h = g.linear("x", 8, 16, name="fc0", kind="matmul")
    if op == "Flatten":
        f = g.op("Flatten", [h], name="flat", axis=1)
        k, shape_in, shape_out = 48, ["B", 3, 8], ["B", 4]
    else:
        f = g.op("Reshape", [h, g.init(np.array([5, 16], np.int64))], name="flat")
        k, shape_in, shape_out = 16, [5 if op == "Reshape_static" else "B", 8], [5, 4]
    g.linear(f, k, 4, name="fc1", kind="matmul")
    g.nodes[-1].output[0] = "y"
    plan = find_chains(g.model([("x", shape_in)], [("y", shape_out)]))
    if op == "Reshape_static":
        assert [c.widths for c in plan.chains] == [(8, 16, 4)] and not plan.refusals, plan.describe()
        return
    assert len(plan.chains) == 2
    why = ("regroups the rows into shape [5, 16], and no Reshape back to the layer's shape follows within the "
           "activation" if op == "Reshape" else "Flatten changes the tensor's shape or layout, not elementwise")
    assert plan.refusals[0].reason.endswith(f"feeds {op} 'flat': {why}"), plan.describe()


@pytest.mark.parametrize("where", ["inside", "outside"])
def test_reshapes_that_regroup_rows_inside_an_activation(where):
    """A Reshape to [B, T, N] after a layer of [B*T, N] rows and one back to [-1, N] before the next layer
    (HF Conv1D's views) leave the activation elementwise: one chain. Their shapes are computed from the
    activation's own tensor (Shape -> Gather -> Concat, as the TorchScript exporter writes `view`): those
    nodes go with the chain when only its Reshapes read them ("inside"); where a Reshape of another tensor
    reads that shape too ("outside"), the chain cannot remove the tensor the Shape reads, and it ends
    before the activation instead of leaving a node that reads a tensor that is gone."""
    g = G()
    rows = g.op("Reshape", ["x", g.init(np.array([-1, 8], np.int64))], name="flat")
    h = g.linear(rows, 8, 16, name="fc0")
    bt = g.op("Slice", [g.op("Shape", ["x"]), g.init(np.array([0], np.int64)), g.init(np.array([2], np.int64))])
    h3 = g.op("Reshape", [h, g.op("Concat", [bt, g.init(np.array([16], np.int64))], axis=0)], name="view")
    r = g.op("Tanh", [g.op("Mul", [h3, g.init(np.float32(0.5))])])
    shape_r = g.op("Shape", [r], name="shape_of_act")
    n = g.op("Slice", [shape_r, g.init(np.array([-1], np.int64)), g.init(np.array([3], np.int64))])
    back = g.op("Reshape", [r, g.op("Concat", [g.init(np.array([-1], np.int64)), n], axis=0)], name="back")
    g.linear(back, 16, 4, name="fc1")
    g.nodes[-1].output[0] = "y"
    outputs = [("y", ["R", 4])]
    if where == "outside":
        g.op("Reshape", ["z", shape_r], name="other", outputs=["w"])
        outputs.append(("w", ["B", "T", 16]))
    m = onnx.shape_inference.infer_shapes(
        g.model([("x", ["B", "T", 8])] + ([("z", ["B", "T", 16])] if where == "outside" else []), outputs),
        data_prop=True)
    plan = find_chains(m)
    if where == "inside":
        (c,) = plan.chains
        assert c.widths == (8, 16, 4) and c.activations[1] == ex.identity(), plan.describe()
    else:
        assert [c.widths for c in plan.chains] == [(8, 16), (16, 4)], plan.describe()
    r_model = rewrite(m, plan, [c.to_spec("fp32") for c in plan.chains])
    onnx.checker.check_model(r_model, full_check=True)
    if where == "inside":   # the Shape of the activation and what it computed went with the chain
        assert "shape_of_act" not in {n.name for n in r_model.graph.node}
    feeds = {"x": rand((2, 3, 8))} | ({"z": rand((2, 3, 16), seed=2)} if where == "outside" else {})
    for a, b in zip(run(m, feeds), run(r_model, feeds)):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)
