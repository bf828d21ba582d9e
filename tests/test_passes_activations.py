"""Activation recognition: each ONNX elementwise pattern -> expr tree, checked against stock ORT."""
import math

import numpy as np
import onnx
import pytest

from onnx2fused import expr as ex
from onnx2fused.passes.activations import NOT_PER_CHANNEL, describe_expr, match_activation, normalise
from onnx2fused.passes.constants import GraphIndex
from onnx_builders import G, rand, run

F = onnx.TensorProto.FLOAT
S2 = np.float32(1.4142135)


def c(v):
    return np.array(v, dtype=np.float32)


# BatchNormalization's scale, B, mean and var for the 6-wide layer (one variance 0: 1/sqrt(eps))
_BN = (c([1.5, -0.5, 2, 0.25, 1, 3]), c([0.1, -1, 0, 2, 0.5, -3]), c([0.3, -2, 5, 0, 1e3, 0.01]),
       c([0.5, 4, 1e-3, 2, 1e4, 0]))


# name -> (builder(g, x) -> output, opset, expected named expr or None)
CASES = {
    "relu": (lambda g, x: g.op("Relu", [x]), 17, ex.relu()),
    "leaky": (lambda g, x: g.op("LeakyRelu", [x], alpha=0.1), 17, ex.leaky_relu(0.1)),
    "leaky_default": (lambda g, x: g.op("LeakyRelu", [x]), 17, ex.leaky_relu(0.01)),
    "sigmoid": (lambda g, x: g.op("Sigmoid", [x]), 17, ex.sigmoid()),
    "tanh": (lambda g, x: g.op("Tanh", [x]), 17, ex.tanh()),
    "gelu": (lambda g, x: g.op("Gelu", [x]), 20, ex.gelu_erf()),
    "gelu_tanh": (lambda g, x: g.op("Gelu", [x], approximate="tanh"), 20, ex.gelu_tanh()),
    "gelu_torch_erf_chain": (lambda g, x: g.op("Mul", [g.op("Mul", [x, g.op("Add", [
        g.op("Erf", [g.op("Div", [x, g.init(S2)])]), g.init(c(1.0))])]), g.init(c(0.5))]), 17, ex.gelu_erf()),
    "gelu_erf_chain_reordered": (lambda g, x: g.op("Mul", [g.const_node(c(0.5)), g.op("Mul", [g.op("Add", [
        g.init(c(1.0)), g.op("Erf", [g.op("Mul", [g.init(c(1 / math.sqrt(2))), x])])]), x])]), 17, ex.gelu_erf()),
    "gelu_tanh_pow_chain": (lambda g, x: g.op("Mul", [g.op("Mul", [x, g.init(c(0.5))]), g.op("Add", [
        g.init(c(1.0)), g.op("Tanh", [g.op("Mul", [g.init(c(math.sqrt(2 / math.pi))), g.op("Add", [
            x, g.op("Mul", [g.init(c(0.044715)), g.op("Pow", [x, g.init(c(3.0))])])])])])])]), 17, ex.gelu_tanh()),
    "silu": (lambda g, x: g.op("Mul", [x, g.op("Sigmoid", [x])]), 17, ex.silu()),
    "silu_swapped": (lambda g, x: g.op("Mul", [g.op("Sigmoid", [x]), x]), 17, ex.silu()),
    # OpenAI CLIP's QuickGELU as torch exports x * torch.sigmoid(1.702 * x)
    "quickgelu_clip": (lambda g, x: g.op("Mul", [x, g.op("Sigmoid", [g.op("Mul", [g.init(c(1.702)), x])])]), 17,
                       ex.quick_gelu()),
    "softplus": (lambda g, x: g.op("Softplus", [x]), 17, ex.softplus()),
    "softplus_torch_dynamo": (lambda g, x: (lambda m: g.op("Where", [
        g.op("Greater", [m, g.init(c(20.0))]), x, g.op("Div", [g.op("Softplus", [m]), g.init(c(2.0))])]))(
        g.op("Mul", [x, g.init(c(2.0))])), 20, None),
    "elu": (lambda g, x: g.op("Elu", [x], alpha=0.7), 17, ex.elu(0.7)),
    "selu": (lambda g, x: g.op("Selu", [x]), 17, None),
    "celu": (lambda g, x: g.op("Celu", [x], alpha=1.3), 17, None),
    "hardswish": (lambda g, x: g.op("HardSwish", [x]), 17, ex.hard_swish()),
    "hardsigmoid": (lambda g, x: g.op("HardSigmoid", [x], alpha=0.3, beta=0.4), 17, ex.hard_sigmoid(0.3, 0.4)),
    "mish": (lambda g, x: g.op("Mish", [x]), 18, ex.mish()),
    "mish_legacy_chain": (lambda g, x: g.op("Mul", [x, g.op("Tanh", [g.op("Softplus", [x])])]), 17, ex.mish()),
    "sin": (lambda g, x: g.op("Sin", [x]), 17, ex.sin()),
    "cos": (lambda g, x: g.op("Cos", [x]), 17, None),
    "exp": (lambda g, x: g.op("Exp", [x]), 17, None),
    "log_abs": (lambda g, x: g.op("Log", [g.op("Abs", [x])]), 17, None),
    "neg_sqrt": (lambda g, x: g.op("Sqrt", [g.op("Neg", [x])]), 17, None),
    "reciprocal": (lambda g, x: g.op("Reciprocal", [x]), 17, None),
    "pow2": (lambda g, x: g.op("Pow", [x, g.init(c(2.0))]), 17, None),
    "relu6_clip_inputs": (lambda g, x: g.op("Clip", [x, g.init(c(0.0)), g.init(c(6.0))]), 17, ex.clip(0, 6)),
    "clip_attrs_opset10": (lambda g, x: g.op("Clip", [x], min=-1.0, max=2.0), 10, ex.clip(-1, 2)),
    "clip_min_only": (lambda g, x: g.op("Clip", [x, g.init(c(0.5))]), 17, None),
    "clip_max_only": (lambda g, x: g.op("Clip", [x, "", g.init(c(0.5))]), 17, None),
    "scalar_arith": (lambda g, x: g.op("Max", [g.op("Min", [g.op("Div", [g.op("Sub", [g.op("Add", [
        x, g.init(c(1.0))]), g.init(c([0.5]))]), g.init(c(2.0))]), g.init(c(3.0))]), g.init(c(-1.0))]), 17, None),
    "where_greater": (lambda g, x: g.op("Where", [g.op("Greater", [x, g.init(c(0.0))]), x,
                                                  g.op("Mul", [x, g.init(c(0.2))])]), 17, None),
    "where_less": (lambda g, x: g.op("Where", [g.op("Less", [x, g.init(c(1.0))]), g.init(c(0.0)), x]), 17, None),
    "softsign": (lambda g, x: g.op("Softsign", [x]), 17, None),
    "thresholded_relu": (lambda g, x: g.op("ThresholdedRelu", [x], alpha=0.5), 17, None),
    "identity": (lambda g, x: g.op("Identity", [x]), 17, ex.identity()),
    "dropout": (lambda g, x: g.op("Dropout", [x], outputs=1), 17, ex.identity()),
    "cast_double_roundtrip": (lambda g, x: g.op("Relu", [g.op("Cast", [g.op("Cast", [x], to=onnx.TensorProto.DOUBLE)],
                                                             to=F)]), 17, ex.relu()),
    "prelu_scalar": (lambda g, x: g.op("PRelu", [x, g.init(c([0.25]))]), 17, ex.leaky_relu(0.25)),
    "x_times_x": (lambda g, x: g.op("Mul", [x, x]), 17, None),
    "per_tensor_broadcast_equal": (lambda g, x: g.op("Mul", [x, g.init(np.full([6], 3.0, np.float32))]), 17, None),
    # per-channel constants (the layer width is 6): one value per output column
    "prelu_per_channel": (lambda g, x: g.op("PRelu", [x, g.init(c([0.1, 0.2, 0.3, -0.5, 2.0, 0.0]))]), 17, None),
    "prelu_per_channel_1xn": (lambda g, x: g.op("PRelu", [x, g.init(c([[0.1, 0.2, 0.3, 0.4, 0.5, 0.6]]))]), 9, None),
    "scale_shift": (lambda g, x: g.op("Add", [g.op("Mul", [x, g.init(c([1, -2, 3, 0.5, 0, 7]))]),
                                              g.init(c([0.1, 0.2, -0.3, 4, 5, 6]))]), 17, None),
    "div_sub_per_channel": (lambda g, x: g.op("Sub", [g.init(c([1, 2, 3, 4, 5, 6])), g.op("Div", [
        x, g.const_node(c([0.5, -2, 3, 8, 1e-3, 1]))])]), 17, None),
    "max_min_per_channel": (lambda g, x: g.op("Min", [g.op("Max", [x, g.init(c([-1, -2, 0, 0, -5, 1]))]),
                                                      g.init(c([1, 2, 3, 4, 5, 6]))]), 17, None),
    "where_per_channel": (lambda g, x: g.op("Where", [g.op("Greater", [x, g.init(c([0, 1, -1, 2, -2, 0.5]))]), x,
                                                      g.op("Mul", [x, g.init(c([0.1, 0.2, 0.3, 0.4, 0.5, 0.6]))])]),
                          17, None),
    "where_bool_mask": (lambda g, x: g.op("Where", [g.init(np.array([True, False, True, True, False, False])),
                                                    x, g.op("Neg", [x])]), 17, None),
    "pow_per_channel": (lambda g, x: g.op("Pow", [g.op("Abs", [x]), g.init(c([1, 2, 0.5, 3, 1.5, 0]))]), 17, None),
    "siren_per_channel_freq": (lambda g, x: g.op("Sin", [g.op("Mul", [g.init(c([30, 1, 2, 30, 5, 6])), x])]), 17, None),
    # issue 14 §4: elementwise ops that split chains before
    "shrink_default": (lambda g, x: g.op("Shrink", [x]), 17, ex.shrink()),
    "shrink_soft": (lambda g, x: g.op("Shrink", [x], lambd=1.5, bias=1.5), 17, ex.shrink(1.5, 1.5)),
    "swish": (lambda g, x: g.op("Swish", [x], alpha=1.7), 24, ex.swish(1.7)),
    "swish_default_is_silu": (lambda g, x: g.op("Swish", [x]), 24, ex.silu()),
    **{op.lower(): (lambda g, x, op=op: g.op(op, [x]), 17, ex.Op(op.lower(), (ex.X,)))
       for op in ("Sinh", "Cosh", "Tan", "Asin", "Acos", "Atan", "Asinh", "Acosh", "Atanh", "Floor", "Ceil", "Round",
                  "Sign")},
    "sum_variadic": (lambda g, x: g.op("Sum", [x, g.init(c(0.5)), x]), 17, None),
    # ONNX Runtime's own activations (com.microsoft), as its graph optimiser writes them
    "ort_gelu": (lambda g, x: g.op("Gelu", [x], domain="com.microsoft"), 17, ex.gelu_erf()),
    "ort_quickgelu": (lambda g, x: g.op("QuickGelu", [x], domain="com.microsoft"), 17, ex.swish(1.702)),
    "ort_quickgelu_alpha1_is_silu": (lambda g, x: g.op("QuickGelu", [x], domain="com.microsoft", alpha=1.0), 17,
                                     ex.silu()),
    "ort_fastgelu": (lambda g, x: g.op("FastGelu", [x], domain="com.microsoft"), 17, ex.gelu_tanh()),
    "ort_fastgelu_bias": (lambda g, x: g.op("FastGelu", [x, g.init(c([0.1, -0.2, 0.3, 1, -1, 0]))],
                                            domain="com.microsoft"), 17, None),
    "ort_biasgelu": (lambda g, x: g.op("BiasGelu", [x, g.init(c([0.5, -2, 0, 1, 3, -0.25]))],
                                       domain="com.microsoft"), 17, None),
    # torch's BatchNorm1d after a Linear, inference mode: a per-channel affine map (eps default and set)
    "batchnorm": (lambda g, x: g.op("BatchNormalization", [x, *(g.init(v) for v in _BN)]), 15, None),
    "batchnorm_eps_relu": (lambda g, x: g.op("Relu", [g.op("BatchNormalization", [x, *(g.init(v) for v in _BN)],
                                                           epsilon=0.1)]), 9, None),
    # logic on conditions: torch's TorchScript Hardshrink (bool Casts, Or), and And / Not / Xor
    "hardshrink_torchscript": (lambda g, x: g.op("Where", [g.op("Or", [
        g.op("Cast", [g.op("Greater", [x, g.init(c(0.5))])], to=onnx.TensorProto.BOOL),
        g.op("Cast", [g.op("Less", [x, g.init(c(-0.5))])], to=onnx.TensorProto.BOOL)]), x, g.init(c(0.0))]), 17, None),
    "logic_and_not_xor": (lambda g, x: g.op("Where", [g.op("Xor", [
        g.op("And", [g.op("Greater", [x, g.init(c(-1.0))]), g.op("Not", [g.op("Greater", [x, g.init(c(1.0))])])]),
        g.op("Less", [x, g.init(c(0.0))])]), g.op("Mul", [x, g.init(c(2.0))]), x]), 17, None),
    # torch's nn.Flatten between two Linears (TorchScript keeps it), a Reshape to [-1, N]: no-ops at rank 2
    "flatten_relu": (lambda g, x: g.op("Relu", [g.op("Flatten", [x], axis=1)]), 17, ex.relu()),
    "reshape_minus1_tanh": (lambda g, x: g.op("Tanh", [g.op("Reshape", [x, g.init(np.array([-1, 6], np.int64))])]), 17,
                            ex.tanh()),
    # onnx's function bodies cast their constants to the input's type: a CastLike to the chain's type
    "castlike_constant": (lambda g, x: g.op("Mul", [x, g.op("CastLike", [g.const_node(c(0.5)), x])]), 17, None),
    "castlike_double_roundtrip": (lambda g, x: g.op("Relu", [g.op("CastLike", [
        g.op("CastLike", [x, g.init(np.zeros([], np.float64))]), x])]), 17, ex.relu()),
}


def _build(name):
    build, opset, _ = CASES[name]
    g = G(opset=opset)
    out = build(g, "x")
    g.op("Identity", [out], name="sink", outputs=["y"])  # the activation ends at `out`
    return g.model([("x", ["B", 6])], [("y", ["B", 6])]), out


@pytest.mark.parametrize("name", sorted(CASES))
def test_activation_matches_onnxruntime(name):
    m, out = _build(name)
    ix = GraphIndex(m)
    act = match_activation(ix, "x")
    expected = CASES[name][2]
    if name == "identity":  # the sink itself is an Identity: the whole thing is one identity activation
        assert act.output == "y"
    else:
        assert act.output == "y", act.rejected
    # every node, the sink included, is the activation (Constant producers are folded, not consumed)
    assert act.nodes == [k for k, n in zip(ix.keys, m.graph.node) if n.op_type != "Constant"]
    # halves (Round rounds them to even), Shrink's default thresholds, the domain edges of Asin/Acosh/Atanh
    x = np.concatenate([rand([64, 6], seed=3), np.array([[0, -0.0, 1e-3, -1e-3, 7, -7], [0.5, 1.5, 2.5, -0.5, -1.5, -2.5],
                                                         [1, -1, 0.25, -0.25, 0.75, -0.75]], np.float32)])
    (y,) = run(m, {"x": x})
    got = ex.evaluate(act.expr, x)
    np.testing.assert_allclose(got, y, rtol=2e-5, atol=2e-6, equal_nan=True)
    if expected is not None:
        assert act.expr == expected, ex.to_text(act.expr)


def test_no_elementwise_ops_is_identity():
    g = G()
    g.op("MatMul", ["x", g.weight(6, 6)], name="mm", outputs=["y"])
    m = g.model([("x", ["B", 6])], [("y", ["B", 6])])
    act = match_activation(GraphIndex(m), "x")
    assert act.expr == ex.identity() and act.nodes == [] and act.output == "x"


def test_per_channel_constants_become_chan_leaves():
    g = G()
    r = g.op("Relu", ["x"], name="relu")
    g.op("Mul", [r, g.init(np.arange(6, dtype=np.float32), "scale")], name="scale_mul", outputs=["y"])
    m = g.model([("x", ["B", 6])], [("y", ["B", 6])])
    act = match_activation(GraphIndex(m), "x")
    assert act.expr == ex.relu() * ex.Chan(tuple(range(6))) and act.output == "y" and act.rejected == {}
    slope = ex.Chan((0.1, 0.2, 0.3, -0.5, 2.0, 0.0))
    prelu = match_activation(GraphIndex(_build("prelu_per_channel")[0]), "x").expr
    assert prelu == ex.Op("select", (ex.Op("lt", (ex.X, ex.Const(0.0))), ex.X * slope, ex.X))
    assert ex.short_name(prelu) == "prelu" and describe_expr(prelu) == "prelu[6]"


@pytest.mark.parametrize("shape,why", [
    ([6, 1], "of shape [6, 1] does not broadcast per channel (the layer's width is 6)"),
    ([2, 6], "of shape [2, 6] does not broadcast per channel (the layer's width is 6)"),
    ([3], "of shape [3] does not broadcast per channel (the layer's width is 6)"),
    ([1, 1, 6], "of rank 3 would broadcast the value to a higher rank"),
])
def test_constants_that_would_broadcast_the_value_are_refused(shape, why):
    g = G()
    g.op("Mul", ["x", g.init(np.arange(np.prod(shape), dtype=np.float32).reshape(shape) + 1, "k")],
         name="mul", outputs=["y"])
    m = g.model([("x", ["B", 6])], [("y", None)], check=False)
    act = match_activation(GraphIndex(m), "x")
    assert act.output == "x" and act.rejected == {0: f"Mul 'mul': constant 'k' {why}"}
    assert NOT_PER_CHANNEL in why or "higher rank" in why


def test_vector_clip_bound_refused():
    g = G()
    g.op("Clip", ["x", g.init(-np.arange(6, dtype=np.float32), "lo")], name="clip", outputs=["y"])
    m = g.model([("x", ["B", 6])], [("y", ["B", 6])], check=False)
    act = match_activation(GraphIndex(m), "x")
    assert act.rejected == {0: "Clip 'clip': the min 'lo' is a vector; ONNX takes a scalar there"}


def test_per_channel_width_comes_from_the_layer_when_shapes_are_unknown():
    g = G()
    g.op("Add", ["x", g.init(np.arange(4, dtype=np.float32), "shift")], name="add", outputs=["y"])
    m = g.model([("x", None)], [("y", None)], check=False)
    ix = GraphIndex(m)
    assert match_activation(ix, "x").rejected == {
        0: "Add 'add': constant 'shift' of shape [4] does not broadcast per channel (the layer's width is unknown)"}
    assert match_activation(ix, "x", width=4).expr == ex.X + ex.Chan((0, 1, 2, 3))


def test_intermediate_used_outside_shrinks_region():
    g = G()
    s = g.op("Sigmoid", ["x"], name="sig", outputs=["s"])
    g.op("Mul", ["x", s], name="mul", outputs=["y"])
    m = g.model([("x", ["B", 6])], [("y", ["B", 6]), ("s", ["B", 6])])
    act = match_activation(GraphIndex(m), "x")
    # 's' is a graph output and x is read by the Mul as well: no closed region beyond x itself.
    assert act.expr == ex.identity() and act.output == "x"


def test_value_used_twice_outside_stops_at_the_value():
    g = G()
    r = g.op("Relu", ["x"], name="relu")
    s = g.op("Sigmoid", [r], name="sig")
    g.op("Add", [r, g.op("Softmax", [s], name="sm")], name="add", outputs=["y"])
    m = g.model([("x", ["B", 6])], [("y", ["B", 6])])
    act = match_activation(GraphIndex(m), "x")
    assert act.expr == ex.relu() and act.output == r


def test_dropout_with_used_mask_and_int_cast_refused():
    g = G()
    d, mask = g.op("Dropout", ["x"], name="drop", outputs=["d", "mask"])
    m = g.model([("x", ["B", 6])], [("d", ["B", 6])], check=False)
    m.graph.output.append(onnx.helper.make_tensor_value_info("mask", onnx.TensorProto.BOOL, ["B", 6]))
    act = match_activation(GraphIndex(m), "x")
    assert act.output == "x" and act.rejected == {0: "Dropout 'drop': its mask output is used"}
    g = G()
    g.op("Cast", ["x"], name="to_int", outputs=["y"], to=onnx.TensorProto.INT32)
    m = g.model([("x", ["B", 6])], [("y", ["B", 6])], check=False)
    act = match_activation(GraphIndex(m), "x")
    assert act.rejected == {0: "Cast 'to_int': Cast to int32 (only casts to float types are elementwise no-ops)"}


@pytest.mark.parametrize("case,why", [
    ("rank3", "BatchNormalization normalises axis 1, which is the layer's features only for a rank-2 value "
              "(this one's rank is 3)"),
    ("training", "BatchNormalization in training mode (it updates its statistics)"),
    ("input_mean", "its mean 'mean_in' is not a constant"),
])
def test_batchnorm_refusals(case, why):
    g = G(opset=15)
    ins = ["x", *(g.init(v) for v in _BN)]
    extra = {}
    if case == "input_mean":
        ins[3] = "mean_in"
    if case == "training":
        extra = {"training_mode": 1}
    g.op("BatchNormalization", ins, name="bn", outputs=["y"], **extra)
    inputs = [("x", ["B", 6] if case != "rank3" else ["B", 6, 6])] + ([("mean_in", [6])] if case == "input_mean" else [])
    m = g.model(inputs, [("y", None)], check=False)
    act = match_activation(GraphIndex(m), "x", width=6)
    assert act.output == "x" and act.rejected == {0: f"BatchNormalization 'bn': {why}"}


def test_non_constant_other_operand_refused():
    g = G()
    g.op("Add", ["x", "z"], name="resid", outputs=["y"])
    m = g.model([("x", ["B", 6]), ("z", ["B", 6])], [("y", ["B", 6])])
    act = match_activation(GraphIndex(m), "x")
    assert act.rejected == {0: "Add 'resid': input 'z' is neither derived from the layer output nor a constant"}


def test_normalise_keeps_unknown_and_distinguishes_near_misses():
    assert normalise(ex.clip(0.0, 1e9)) == ex.clip(0.0, 1e9)  # not relu: differs above 1e9
    assert normalise(ex.leaky_relu(1e-7)) == ex.leaky_relu(1e-7)
    assert normalise(ex.Op("sigmoid", (ex.X,)) * ex.X) == ex.silu()


def _gelu_graph(sqrt2: float, elem) -> onnx.ModelProto:
    """x * (erf(x / sqrt2) + 1) * 0.5 with the constants in `elem` (as a 16-bit export stores them)."""
    dt = np.float16 if elem == onnx.TensorProto.FLOAT16 else np.float32
    g = G()
    d = g.op("Div", ["x", g.const_node(np.array(sqrt2, dt))])
    e = g.op("Add", [g.op("Erf", [d]), g.const_node(np.array(1.0, dt))])
    g.op("Mul", [g.op("Mul", ["x", e]), g.const_node(np.array(0.5, dt))], outputs=["y"])
    return g.model([("x", ["B", 6])], [("y", ["B", 6])], elem=elem)


def test_16_bit_graphs_match_named_activations_within_their_constants_rounding():
    """An fp16 export's GELU divides by fp16's sqrt(2), 1.4140625: within that rounding it is the erf GELU
    (so the kernels' fast and packed forms apply), in an fp16 graph only; a float32 graph with the same
    constant keeps it as written, and a 16-bit function further off a named one stays itself."""
    half = float(np.float16(math.sqrt(2.0)))
    assert half == 1.4140625
    act = match_activation(GraphIndex(_gelu_graph(half, onnx.TensorProto.FLOAT16)), "x")
    assert act.output == "y" and act.expr == ex.gelu_erf()
    act = match_activation(GraphIndex(_gelu_graph(half, F)), "x")
    assert act.output == "y" and act.expr != ex.gelu_erf() and describe_expr(act.expr) != "gelu"
    assert match_activation(GraphIndex(_gelu_graph(math.sqrt(2.0), F)), "x").expr == ex.gelu_erf()
    # hard-swish with fp16's 1/6 (0.16663): 3.7e-4 off near x = 3, beyond the tolerance
    one_sixth = float(np.float16(1 / 6))
    near = ex.X * ex.Op("max", (ex.Const(0.0), ex.Op("min", (ex.Const(1.0), ex.Const(one_sixth) * ex.X + ex.Const(0.5)))))
    assert normalise(near, half=True) == near and normalise(near) == near
    assert normalise(ex.hard_swish(), half=True) == ex.hard_swish()


def test_cast_that_rounds_a_float32_value_is_not_an_activation():
    g = G()
    h = g.op("Cast", ["x"], name="to_half", to=onnx.TensorProto.FLOAT16)
    g.op("Cast", [h], name="back", outputs=["y"], to=F)
    m = g.model([("x", ["B", 6])], [("y", ["B", 6])])
    act = match_activation(GraphIndex(m), "x")
    assert act.output == "x" and act.rejected == {0: "Cast 'to_half': Cast to float16 rounds the float32 value"}
    # in a float16 model the same round trip is exact: it is fused
    g = G()
    h = g.op("Cast", ["x"], name="up", to=F)
    g.op("Cast", [g.op("Tanh", [h])], name="down", outputs=["y"], to=onnx.TensorProto.FLOAT16)
    m = g.model([("x", ["B", 6])], [("y", ["B", 6])], elem=onnx.TensorProto.FLOAT16)
    act = match_activation(GraphIndex(m), "x")
    assert act.output == "y" and act.expr == ex.tanh()


def test_erf_evaluation_is_math_erf_rounded_to_float32():
    """The numpy evaluation of erf (GELU's erf form, in the numerics model and the activation checks) is
    vectorised, and gives math.erf's value rounded to float32 everywhere: both tails, the switch to +-1,
    signed zeros, infinities and NaN."""
    import math
    from onnx2fused.expr import ERF_ONE_FROM, _erf_np
    rng = np.random.default_rng(5)
    x = np.concatenate([np.linspace(-8, 8, 100001), rng.standard_normal(50000) * 3,
                        [0.0, -0.0, 1e-30, -1e-30, ERF_ONE_FROM, np.nextafter(ERF_ONE_FROM, 0), 3.83, -3.84,
                         np.inf, -np.inf, np.nan]]).astype(np.float32)
    got = _erf_np(x)
    want = np.array([math.erf(float(v)) for v in x], np.float64).astype(np.float32)
    assert got.dtype == np.float32
    nan = np.isnan(x)
    assert np.isnan(got[nan]).all() and np.array_equal(got[~nan], want[~nan])
    assert np.signbit(_erf_np(np.array([-0.0], np.float32)))[0]


_S, _T = ex.Chan((1.0, -2.0, 0.5)), ex.Chan((0.25, 0.0, -1.0))


@pytest.mark.parametrize("e,g,s,t", [
    (ex.X * _S + _T, ex.X, _S.values, _T.values),                                       # BatchNorm, inference
    (ex.Op("max", (ex.X * _S + _T, ex.Const(0.0))), ex.relu(), _S.values, _T.values),
    (ex.Op("erf", (ex.X + _T,)) * (ex.X + _T), ex.Op("erf", (ex.X,)) * ex.X, 1.0, _T.values),   # BiasGelu-like
    (ex.Op("div", (ex.Op("sub", (ex.X, _T)), ex.Const(2.0))), ex.X, 0.5, tuple(-v / 2 for v in _T.values)),
    (ex.Op("sub", (_T, ex.X)), ex.X, -1.0, _T.values),                                   # c - x
    (ex.Op("neg", (ex.X * _S,)), ex.X, tuple(-v for v in _S.values), 0.0),
])
def test_leading_affine_folds(e, g, s, t):
    scale, shift = _assert_fold(ex.leading_affine(e), g, s, t)
    x = rand([5, 3], seed=9)
    np.testing.assert_allclose(ex.evaluate(g, x * scale + shift), ex.evaluate(e, x), rtol=1e-6, atol=1e-6)


def _assert_fold(got, g, s, t):
    """got == (g, s, t); s and t as float32 arrays."""
    assert got is not None and got[0] == g
    np.testing.assert_allclose(np.broadcast_to(got[1], 3), np.broadcast_to(s, 3))
    np.testing.assert_allclose(np.broadcast_to(got[2], 3), np.broadcast_to(t, 3))
    return np.asarray(got[1], np.float32), np.asarray(got[2], np.float32)


@pytest.mark.parametrize("e", [
    ex.relu() * _S,                               # the scale after a ReLU: not a map of x's linear output
    ex.X * ex.Const(30.0),                        # scalar-only: stays (a SIREN's gain)
    ex.Op("div", (_S, ex.X)),                     # c / x
    ex.X * _S + ex.X,                             # x outside the affine subtree
    ex.Op("sin", (ex.X * _S,)) + ex.Op("cos", (ex.X * _T,)),   # two different maps
])
def test_leading_affine_declines(e):
    assert ex.leading_affine(e) is None


@pytest.mark.parametrize("e,g,s,t", [
    (ex.relu() * _S + _T, ex.relu(), _S.values, _T.values),                  # Linear, ReLU, BatchNorm
    (ex.Op("neg", (ex.tanh() / ex.Const(2.0),)) - _T, ex.tanh(), -0.5, tuple(-v for v in _T.values)),
])
def test_trailing_affine_folds(e, g, s, t):
    scale, shift = _assert_fold(ex.trailing_affine(e), g, s, t)
    x = rand([5, 3], seed=10)
    np.testing.assert_allclose(ex.evaluate(g, x) * scale + shift, ex.evaluate(e, x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("e", [
    ex.X * _S + _T,                  # affine in x itself: the layer's own fold (leading_affine)
    ex.relu() * ex.Const(0.5),       # scalar-only
    ex.relu(),                       # nothing after the activation
    ex.Op("div", (_S, ex.relu())),   # c / f(x)
])
def test_trailing_affine_declines(e):
    assert ex.trailing_affine(e) is None
