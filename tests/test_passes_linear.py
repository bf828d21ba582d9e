"""Linear-layer canonicalisation: Gemm / MatMul(+Add) -> y = x @ W + b, and its refusals."""
import numpy as np
import onnx
import pytest
from onnx import helper

from onnx2fused.passes.constants import GraphIndex
from onnx2fused.passes.linear import LinearRefusal, match_linear
from onnx_builders import G, rand, run


def _check_equivalent(m, layer, x):
    (y,) = run(m, {"x": x})
    ref = x.astype(np.float32) @ layer.weight + (0 if layer.bias is None else layer.bias)
    np.testing.assert_allclose(y.astype(np.float32), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("trans_b", [0, 1])
@pytest.mark.parametrize("alpha,beta", [(1.0, 1.0), (0.5, 2.0), (1.5, 0.0)])
@pytest.mark.parametrize("c_shape", ["n", "1n", "scalar", "one", "none"])
def test_gemm_attribute_combinations(trans_b, alpha, beta, c_shape):
    g = G()
    k, n = 5, 7
    w = g.init(g.rng.standard_normal((n, k) if trans_b else (k, n)).astype(np.float32), "w")
    c = {"n": [n], "1n": [1, n], "scalar": [], "one": [1], "none": None}[c_shape]
    ins = ["x", w] + ([g.init(g.rng.standard_normal(c).astype(np.float32), "c")] if c is not None else [])
    g.op("Gemm", ins, name="gemm", outputs=["y"], transB=trans_b, alpha=alpha, beta=beta)
    m = g.model([("x", ["B", k])], [("y", ["B", n])])
    layer = match_linear(GraphIndex(m), 0)
    assert layer.weight.shape == (k, n) and layer.weight.dtype == np.float32
    assert layer.nodes == ["gemm"] and layer.input == "x" and layer.output == "y"
    assert (layer.bias is None) == (c is None or beta == 0.0)
    if layer.bias is not None:
        assert layer.bias.shape == (n,) and layer.bias.dtype == np.float32
    _check_equivalent(m, layer, rand([4, k]))


def test_gemm_trans_a_refused():
    g = G()
    g.op("Gemm", ["x", g.weight(5, 3)], name="g1", outputs=["y"], transA=1)
    m = g.model([("x", [5, "B"])], [("y", ["B", 3])])
    with pytest.raises(LinearRefusal, match=r"Gemm 'g1': transA=1 \(transposed input\) is not supported"):
        match_linear(GraphIndex(m), 0)


def test_gemm_weight_not_constant():
    g = G()
    g.op("Gemm", ["x", "w3"], name="fc3", outputs=["y"])
    m = g.model([("x", ["B", 4]), ("w3", [4, 3])], [("y", ["B", 3])])
    with pytest.raises(LinearRefusal) as e:
        match_linear(GraphIndex(m), 0)
    assert str(e.value) == "Gemm 'fc3': weight 'w3' is not a constant"


def test_overridable_initializer_is_not_a_constant():
    g = G()
    w = g.weight(4, 3, name="w")
    g.op("MatMul", ["x", w], name="mm", outputs=["y"])
    m = g.model([("x", ["B", 4]), ("w", [4, 3])], [("y", ["B", 3])])
    with pytest.raises(LinearRefusal) as e:
        match_linear(GraphIndex(m), 0)
    assert str(e.value) == ("MatMul 'mm': weight 'w' is not a constant "
                            "('w' is a graph input (it can be overridden at run time; torch: export with "
                            "keep_initializers_as_inputs=False))")


def test_gemm_bias_not_broadcastable():
    g = G()
    g.op("Gemm", ["x", g.weight(4, 3), g.init(np.ones((2, 3), np.float32), "cc")], name="g", outputs=["y"])
    m = g.model([("x", [2, 4])], [("y", [2, 3])])
    with pytest.raises(LinearRefusal, match=r"Gemm 'g': bias 'cc' of shape \[2, 3\] does not broadcast to \[3\]"):
        match_linear(GraphIndex(m), 0)


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("bias_shape", [[6], [1, 6], [], [1, 1, 6]])
def test_matmul_add_bias_either_side_rank3(side, bias_shape):
    g = G()
    mm = g.op("MatMul", ["x", g.weight(4, 6)], name="mm")
    b = g.init(g.rng.standard_normal(bias_shape).astype(np.float32), "b")
    g.op("Add", [mm, b] if side == "right" else [b, mm], name="add", outputs=["y"])
    m = g.model([("x", ["B", "S", 4])], [("y", ["B", "S", 6])])
    layer = match_linear(GraphIndex(m), 0)
    assert layer.nodes == ["mm", "add"] and layer.output == "y" and layer.bias.shape == (6,)
    _check_equivalent(m, layer, rand([2, 3, 4]))


def test_matmul_bias_of_higher_rank_is_left_alone():
    g = G()
    mm = g.op("MatMul", ["x", g.weight(4, 6)], name="mm")
    g.op("Add", [mm, g.init(np.ones((1, 1, 6), np.float32))], name="add", outputs=["y"])
    m = g.model([("x", ["B", 4])], [("y", [1, "B", 6])])
    layer = match_linear(GraphIndex(m), 0)
    assert layer.nodes == ["mm"] and layer.bias is None and layer.output == mm


def test_matmul_without_bias_and_shared_output():
    g = G()
    mm = g.op("MatMul", ["x", g.weight(4, 6)], name="mm", outputs=["h"])
    g.op("Add", [mm, g.vec(6)], name="add", outputs=["y"])
    m = g.model([("x", ["B", 4])], [("y", ["B", 6]), ("h", ["B", 6])])
    layer = match_linear(GraphIndex(m), 0)  # 'h' is a graph output: the Add cannot be absorbed
    assert layer.nodes == ["mm"] and layer.bias is None and layer.output == "h"


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_low_precision_weights_become_float32(dtype):
    g = G()
    w = np.arange(12, dtype=np.float32).reshape(4, 3) / 8
    if dtype == "float16":
        t = onnx.numpy_helper.from_array(w.astype(np.float16), "w")
    else:
        t = helper.make_tensor("w", onnx.TensorProto.BFLOAT16, [4, 3], w.reshape(-1).tolist())
    g.inits.append(t)
    g.op("MatMul", ["x", "w"], name="mm", outputs=["y"])
    elem = onnx.TensorProto.FLOAT16 if dtype == "float16" else onnx.TensorProto.BFLOAT16
    m = g.model([("x", ["B", 4])], [("y", ["B", 3])], elem=elem)
    layer = match_linear(GraphIndex(m), 0)
    assert layer.weight.dtype == np.float32
    np.testing.assert_array_equal(layer.weight, w)


def test_double_weight_refused():
    g = G()
    g.op("MatMul", ["x", g.weight(4, 3, dtype=np.float64, name="wd")], name="mm", outputs=["y"])
    m = g.model([("x", ["B", 4])], [("y", ["B", 3])], elem=onnx.TensorProto.DOUBLE)
    with pytest.raises(LinearRefusal, match="weight 'wd' has element type float64; only float16/bfloat16/float32"):
        match_linear(GraphIndex(m), 0)


def test_weight_not_2d_and_constant_on_left():
    g = G()
    g.op("MatMul", ["x", g.init(np.ones((2, 4, 3), np.float32), "w3d")], name="mm", outputs=["y"])
    m = g.model([("x", [2, 5, 4])], [("y", [2, 5, 3])])
    with pytest.raises(LinearRefusal, match=r"MatMul 'mm': weight 'w3d' has shape \[2, 4, 3\], not 2-D"):
        match_linear(GraphIndex(m), 0)
    g = G()
    g.op("MatMul", [g.init(np.ones((3, 4), np.float32), "c"), "x"], name="mm", outputs=["y"])
    m = g.model([("x", [4, "B"])], [("y", [3, "B"])])
    with pytest.raises(LinearRefusal, match="the constant 'c' is the left operand"):
        match_linear(GraphIndex(m), 0)


@pytest.mark.parametrize("producer", ["Constant", "Transpose", "Cast", "Identity"])
def test_folded_weight_producers(producer):
    g = G()
    w = g.rng.standard_normal((4, 3)).astype(np.float32)
    if producer == "Constant":
        wn = g.const_node(w, "wk")
    elif producer == "Transpose":
        wn = g.op("Transpose", [g.init(w.T.copy(), "wt")], name="tr", perm=[1, 0])
    elif producer == "Cast":
        wn = g.op("Cast", [g.init(w.astype(np.float16), "wh")], name="cast", to=onnx.TensorProto.FLOAT)
        w = w.astype(np.float16).astype(np.float32)
    else:
        wn = g.op("Identity", [g.init(w, "wi")], name="idn")
    g.op("MatMul", ["x", wn], name="mm", outputs=["y"])
    m = g.model([("x", ["B", 4])], [("y", ["B", 3])])
    ix = GraphIndex(m)
    layer = match_linear(ix, ix.index_of["mm"])
    np.testing.assert_array_equal(layer.weight, w)
    _check_equivalent(m, layer, rand([5, 4]))


def test_arithmetic_on_floating_constants_folds_as_ort_computes_it():
    """Arithmetic on constants (weight_norm's g * v / ||v||, a scaled or negated weight) folds to the value
    stock ORT computes; integer arithmetic (shape computations: ONNX's integer Div truncates) does not
    fold, nor anything with an operand known only at run time."""
    g = G(opset=18)
    v = g.init(g.rng.standard_normal((6, 4)).astype(np.float32), "v")
    gain = g.init(g.rng.uniform(0.5, 2.0, (6, 1)).astype(np.float32), "gain")
    axes = g.init(np.array([1], np.int64), "axes")
    g.op("ReduceL2", [v, axes], name="norm", outputs=["n"], keepdims=1)
    g.op("Div", [gain, "n"], name="div", outputs=["s"])
    g.op("Mul", [v, "s"], name="mul", outputs=["w"])
    g.op("Neg", ["w"], name="neg", outputs=["nw"])
    g.op("ReduceSumSquare", ["nw"], name="rss", outputs=["all"], keepdims=0)   # no axes: every one
    g.op("ReduceMean", ["nw", axes], name="mean", outputs=["m"], keepdims=0)
    g.op("Sqrt", ["all"], name="sqrt", outputs=["r"])
    i7 = g.init(np.array([-7], np.int64), "i7")
    i2 = g.init(np.array([2], np.int64), "i2")
    g.op("Div", [i7, i2], name="idiv", outputs=["q"])
    g.op("Mul", ["s", "x"], name="runtime", outputs=["mx"])   # an operand known only at run time
    outs = {"w": [6, 4], "nw": [6, 4], "all": [], "m": [6], "r": [], "mx": [6, 4]}   # (q: read by no one)
    m = g.model([("x", ["B", 4])], list(outs.items()))
    ix = GraphIndex(m)
    ref = dict(zip(outs, run(m, {"x": rand([1, 4])})))
    for name in ("w", "nw", "all", "m", "r"):
        np.testing.assert_allclose(ix.const(name), ref[name], rtol=2e-6, err_msg=name)
        assert ix.const(name).dtype == ref[name].dtype and ix.const(name).shape == ref[name].shape, name
    assert ix.const("q") is None and ix.const("mx") is None


@pytest.mark.parametrize("equation,transposed", [
    ("bk,kn->bn", False), ("bk,nk->bn", True), ("...k,kn->...n", False), ("bsk,kn->bsn", False),
    ("b s k , k n -> b s n", False), ("bk,kn", False), ("...k,nk", True),
    ("bk,kn->nb", None), ("kn,bk->bn", None), ("bk,bn->bk", None), ("bkk,kn->bkn", None),
    ("bhqd,bhkd->bhqk", None), ("bk,kn,nm->bm", None), ("bk,k->b", None)])
def test_einsum_equations_that_are_linear_layers(equation, transposed):
    from onnx2fused.passes.linear import einsum_weight_transposed
    assert einsum_weight_transposed(equation) is transposed


@pytest.mark.parametrize("equation", ["bk,kn->bn", "bk,nk->bn"])
def test_einsum_with_a_constant_matrix_is_a_layer(equation):
    g = G()
    k, n = 5, 7
    transposed = equation == "bk,nk->bn"
    w = g.init(g.rng.standard_normal((n, k) if transposed else (k, n)).astype(np.float32), "w")
    h = g.op("Einsum", ["x", w], name="ein", equation=equation)
    g.op("Add", [h, g.vec(n)], name="bias", outputs=["y"])
    m = g.model([("x", ["B", k])], [("y", ["B", n])])
    layer = match_linear(GraphIndex(m), 0)
    assert layer.nodes == ["ein", "bias"] and layer.op == "Einsum" and layer.weight.shape == (k, n)
    _check_equivalent(m, layer, rand([4, k]))


def test_einsum_that_is_no_layer_says_why():
    g = G()
    g.op("Einsum", ["x", g.weight(5, 7)], name="ein", outputs=["y"], equation="bk,kn->nb")
    m = g.model([("x", ["B", 5])], [("y", [7, "B"])])
    with pytest.raises(LinearRefusal, match="is not a product x @ W"):
        match_linear(GraphIndex(m), 0)


def _lora_graph(branch_read_elsewhere: bool = False, scale_op: str = "Mul"):
    g = G()
    k, n, r = 6, 5, 2
    base = g.op("Gemm", ["x", g.weight(k, n), g.vec(n)], name="base")
    a = g.op("MatMul", ["x", g.weight(k, r)], name="lora_a")
    bb = g.op("MatMul", [a, g.weight(r, n)], name="lora_b")
    s = g.op(scale_op, [bb, g.init(np.array(2.0 if scale_op == "Mul" else 0.5, np.float32))], name="scale")
    g.op("Add", [base, s], name="add", outputs=["y"])
    outs = [("y", ["B", n])]
    if branch_read_elsewhere:
        g.op("Identity", [a], name="tap", outputs=["tap"])
        outs.append(("tap", ["B", r]))
    return g.model([("x", ["B", k])], outs)


@pytest.mark.parametrize("scale_op", ["Mul", "Div"])
def test_lora_branch_folds_into_its_layer(scale_op):
    m = _lora_graph(scale_op=scale_op)
    ix = GraphIndex(m)
    layer = match_linear(ix, 0)
    assert layer.output == "y" and layer.nodes == ["base", "lora_a", "lora_b", "scale", "add"]
    assert layer.low_rank[0] == ix.index_of["lora_a"]
    x = rand([4, 6])
    (y,) = run(m, {"x": x})
    np.testing.assert_allclose(x @ layer.weight + layer.bias, y, rtol=1e-5, atol=1e-5)


def test_lora_branch_read_elsewhere_stays_apart():
    m = _lora_graph(branch_read_elsewhere=True)
    layer = match_linear(GraphIndex(m), 0)
    assert layer.nodes == ["base"] and not layer.low_rank
