"""A scale and shift of a chain's input folded into its first layer (passes/input_affine.py)."""
import numpy as np
import onnx
import pytest

from onnx2fused.passes import find_chains, rewrite
from onnx2fused.passes.input_affine import SCALE_MAX, SCALE_MIN, SHIFT_LIMIT
from onnx_builders import F16, F32, G, rand, run


def _init(m, name):
    return onnx.numpy_helper.to_array(next(t for t in m.graph.initializer if t.name == name))


def _normalised_mlp(mean, std, elem=np.float32, rank=2, extra=None):
    """x -> (x - mean) / std -> fc0 -> ReLU -> fc1 -> y (MatMul + Add layers); extra(g, xn) adds a twist
    and returns more graph outputs."""
    g = G()
    xn = g.op("Div", [g.op("Sub", ["x", g.init(np.asarray(mean, elem), "mean")], name="sub"),
                      g.init(np.asarray(std, elem), "std")], name="div", outputs=["xn"])
    h = g.op("Relu", [g.linear(xn, 8, 16, name="fc0", kind="matmul", dtype=elem)], name="relu")
    g.linear(h, 16, 4, name="fc1", kind="matmul", dtype=elem)
    g.nodes[-1].output[0] = "y"
    outs = extra(g, xn) if extra else []
    lead = ["B", "T"][: rank - 1]
    return g.model([("x", lead + [8])], [("y", lead + [4])] + outs, elem=F16 if elem == np.float16 else F32)


def _check_runs_as_stock(m, plan, x):
    r = rewrite(m, plan, [c.to_spec("fp32") for c in plan.chains])
    np.testing.assert_allclose(run(r, {"x": x})[0].astype(np.float32), run(m, {"x": x})[0].astype(np.float32),
                               rtol=2e-3 if x.dtype == np.float16 else 1e-5, atol=1e-3 if x.dtype == np.float16 else 1e-5)
    return r


def test_standardised_input_folds_into_the_first_layer():
    rng = np.random.default_rng(0)
    mean, std = (rng.random(8) * 2 - 1).astype(np.float32), (rng.random(8) + 0.5).astype(np.float32)  # |t| < 2
    m = _normalised_mlp(mean, std)
    plan = find_chains(m)
    (c,) = plan.chains
    assert plan.refusals == [] and c.input == "x" and c.widths == (8, 16, 4)
    assert c.nodes[:2] == ["sub", "div"] and c.input_map == "Sub/Div"
    fc0 = next(n for n in m.graph.node if n.name == "fc0")
    w = _init(m, fc0.input[1])
    b = _init(m, next(n for n in m.graph.node if n.input and n.input[0] == fc0.output[0]).input[1])
    np.testing.assert_allclose(c.layers[0].linear.weight, w / std[:, None], rtol=1e-6)
    np.testing.assert_allclose(c.layers[0].linear.bias, b - (mean / std) @ w, rtol=1e-5, atol=1e-6)
    r = _check_runs_as_stock(m, plan, rand([9, 8], seed=1) * 3)
    assert [n.op_type for n in r.graph.node] == [c.to_spec("fp32").name]


def test_a_large_shift_stays_a_stock_op_and_says_why():
    """(x - 40) / 0.1: a shift of 400 in the layer's units would cancel in 16-bit arithmetic. The Sub
    stays; the Div after it (a scale alone) still folds."""
    m = _normalised_mlp(np.full(8, 40.0, np.float32), np.full(8, 0.1, np.float32))
    plan = find_chains(m)
    (c,) = plan.chains
    sub_out = next(n for n in m.graph.node if n.name == "sub").output[0]
    assert c.input == sub_out and c.input_map == "Div" and "sub" not in c.nodes
    (r,) = plan.refusals
    assert r.reason == (f"chain 0 starts: input '{sub_out}' comes from Sub 'sub': it shifts the input by up to 400 "
                        "(in the first layer's units), which would cancel in 16-bit arithmetic folded into the "
                        f"layer (limit {SHIFT_LIMIT:g}); it stays a stock op")
    _check_runs_as_stock(m, plan, 40 + rand([9, 8], seed=2) * 0.1)


@pytest.mark.parametrize("twist", ["graph_output", "second_reader"])
def test_a_normalised_input_that_others_read_stays(twist):
    """xn is also a graph output, or feeds another node: the chain reads xn, the normalisation is not its."""
    def extra(g, xn):
        if twist == "graph_output":
            return [(xn, ["B", 8])]
        g.op("Relu", [xn], outputs=["side"])
        return [("side", ["B", 8])]
    m = _normalised_mlp(np.ones(8, np.float32), np.full(8, 2.0, np.float32), extra=extra)
    plan = find_chains(m)
    (c,) = plan.chains
    assert c.input == "xn" and c.input_map == "" and "sub" not in c.nodes and plan.refusals == []


def test_half_input_and_rank_3_fold():
    m = _normalised_mlp(np.full(8, 0.5, np.float32), np.full(8, 0.25, np.float32), elem=np.float16, rank=3)
    plan = find_chains(m)
    (c,) = plan.chains
    assert c.input == "x" and c.input_dtype == "f16" and c.input_map == "Sub/Div"
    _check_runs_as_stock(m, plan, (rand([2, 5, 8], seed=3) * 0.5 + 0.5).astype(np.float16))


def test_a_map_that_broadcasts_or_changes_type_is_not_taken():
    """A constant of shape [5, 8] broadcasts over rows (not per channel); a Cast from float16 changes the
    type the chain would read: neither folds."""
    g = G()
    xb = g.op("Mul", ["x", g.init(np.ones((5, 8), np.float32), "rows")], name="rows_mul")
    g.linear(xb, 8, 4, name="fc0")
    g.nodes[-1].output[0] = "y"
    (c,) = find_chains(g.model([("x", [5, 8])], [("y", [5, 4])])).chains
    assert c.input == xb and c.input_map == ""
    g = G()
    xc = g.op("Cast", ["x"], name="up", to=onnx.TensorProto.FLOAT)
    g.linear(xc, 8, 4, name="fc0")
    g.nodes[-1].output[0] = "y"
    m = g.model([("x", ["B", 8])], [("y", ["B", 4])], check=False)
    m.graph.input[0].type.tensor_type.elem_type = F16
    (c,) = find_chains(m).chains
    assert c.input == xc and c.input_dtype == "f32" and c.input_map == ""


def test_a_norm_in_front_is_not_an_input_map():
    """A LayerNorm in front is the block's norm (its gamma Mul is not folded as an input scale)."""
    g = G()
    ln = g.op("LayerNormalization", ["x", g.vec(8, name="gamma"), g.vec(8, name="beta")], name="ln", axis=-1)
    g.linear(ln, 8, 4, name="fc0")
    g.nodes[-1].output[0] = "y"
    (c,) = find_chains(g.model([("x", ["B", 8])], [("y", ["B", 4])])).chains
    assert c.norm is not None and c.input == "x" and c.input_map == ""


@pytest.mark.parametrize("std,limit", [(5000.0, "SCALE_MIN"), (1e-5, "SCALE_MAX")])
def test_a_scale_for_inputs_outside_the_16_bit_range_stays(std, limit):
    """(x - mean) / 5000: the raw x is of order 10^4, which the kernel would hold in fp16 (validation, whose
    inputs are drawn near 0, could not tell); / 1e-5: x of order 10^-5, fp16's subnormals. Neither folds;
    the Sub in front of the Div does not either (nothing after it was taken)."""
    m = _normalised_mlp(np.zeros(8, np.float32), np.full(8, std, np.float32))
    plan = find_chains(m)
    (c,) = plan.chains
    assert c.input == "xn" and c.input_map == ""
    (r,) = plan.refusals
    bound = {"SCALE_MIN": SCALE_MIN, "SCALE_MAX": SCALE_MAX}[limit]
    assert r.reason.startswith("chain 0 starts: input 'xn' comes from Div 'div': it scales the input by ")
    assert r.reason.endswith(f"in 16 bits (limit {bound:g}); it stays a stock op")


@pytest.mark.parametrize("form", ["two_linears", "cut"])
def test_a_gated_first_layer_takes_the_fold_in_both_halves(form):
    """A SwiGLU (gate and up reading the normalised input) or a GluMlp (one layer cut in two): the scale and
    shift fold into the gate's and the up projection's rows alike; the chain reads x."""
    g = G(seed=5)
    xn = g.op("Add", [g.op("Mul", ["x", g.init(np.linspace(0.5, 2, 8).astype(np.float32))], name="scale"),
                      g.init(np.float32(-0.5))], name="shift")
    if form == "two_linears":
        gate = g.op("Sigmoid", [g.linear(xn, 8, 6, name="gate")])
        p = g.op("Mul", [gate, g.linear(xn, 8, 6, name="up")])
    else:
        a, b = g.op("Split", [g.linear(xn, 8, 12, name="fc1")], outputs=2, axis=-1, num_outputs=2)
        p = g.op("Mul", [g.op("Sigmoid", [a]), b])
    g.linear(p, 6, 4, name="down")
    g.nodes[-1].output[0] = "y"
    g.opset = 18   # Split's num_outputs
    m = g.model([("x", ["B", 8])], [("y", ["B", 4])])
    plan = find_chains(m)
    (c,) = plan.chains
    assert plan.refusals == [] and c.input == "x" and c.input_map == "Mul/Add" and c.layers[0].gated
    assert c.widths == (8, 6, 4)
    _check_runs_as_stock(m, plan, rand([7, 8], seed=6))


def test_onnx_ml_scaler_folds():
    """scikit-learn's StandardScaler before an MLP, as skl2onnx writes it: Scaler (domain ai.onnx.ml,
    (x - offset) * scale), a Cast to float, then MatMul + Add layers. ONNX Runtime has no CUDA kernel for
    Scaler; folded, the chain reads X itself."""
    rng = np.random.default_rng(4)
    offset, scale = rng.uniform(-1, 1, 8).astype(np.float32), rng.uniform(0.5, 2, 8).astype(np.float32)
    g = G()
    s = g.op("Scaler", ["x"], name="scaler", domain="ai.onnx.ml", offset=offset.tolist(), scale=scale.tolist())
    h = g.op("Relu", [g.linear(g.op("Cast", [s], name="cast", to=onnx.TensorProto.FLOAT), 8, 16, kind="matmul")])
    g.linear(h, 16, 3, kind="matmul")
    g.nodes[-1].output[0] = "y"
    m = g.model([("x", ["B", 8])], [("y", ["B", 3])])
    plan = find_chains(m)
    (c,) = plan.chains
    assert c.input == "x" and c.input_map == "Scaler/Cast" and plan.refusals == [], plan.describe()
    _check_runs_as_stock(m, plan, rand([9, 8], seed=7) * 2)
