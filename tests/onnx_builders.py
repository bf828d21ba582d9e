"""Small hand-built ONNX models for the pass tests (onnx.helper only) and a stock-ORT runner."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

F32, F16 = TensorProto.FLOAT, TensorProto.FLOAT16


class G:
    """A tiny graph builder: g.init(array), g.op("Relu", [x]) -> output name, g.model(...)."""

    def __init__(self, opset: int = 17, ir: int = 8, seed: int = 0):
        self.opset, self.ir = opset, ir
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.rng = np.random.default_rng(seed)
        self._n = 0

    def name(self, base: str) -> str:
        self._n += 1
        return f"{base}{self._n}"

    def init(self, arr, name: str | None = None) -> str:
        name = name or self.name("c")
        self.inits.append(numpy_helper.from_array(np.asarray(arr), name))
        return name

    def const_node(self, arr, name: str | None = None) -> str:
        out = name or self.name("k")
        self.nodes.append(helper.make_node("Constant", [], [out], name=self.name("Constant_"),
                                           value=numpy_helper.from_array(np.asarray(arr), out)))
        return out

    def op(self, op: str, inputs: list[str], name: str | None = None, outputs: int | list[str] = 1,
           domain: str = "", **attrs):
        outs = outputs if isinstance(outputs, list) else [self.name(op.lower() + "_out") for _ in range(outputs)]
        self.nodes.append(helper.make_node(op, inputs, outs, name=name or self.name(op + "_"), domain=domain, **attrs))
        return outs[0] if len(outs) == 1 else outs

    def weight(self, k: int, n: int, dtype=np.float32, name: str | None = None) -> str:
        return self.init((self.rng.standard_normal((k, n)) / np.sqrt(k)).astype(dtype), name or self.name("w"))

    def vec(self, n: int, dtype=np.float32, name: str | None = None) -> str:
        return self.init(self.rng.standard_normal(n).astype(dtype), name or self.name("b"))

    def model(self, inputs: list[tuple[str, list]], outputs: list[tuple[str, list]], elem=F32,
              check: bool = True) -> onnx.ModelProto:
        g = helper.make_graph(
            self.nodes, "g",
            [helper.make_tensor_value_info(n, elem, s) for n, s in inputs],
            [helper.make_tensor_value_info(o, elem, s) for o, s in outputs],
            initializer=self.inits)
        others = sorted({n.domain for n in self.nodes} - {"", "ai.onnx"})   # com.microsoft: ORT's own ops
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", self.opset)] +
                              [helper.make_opsetid(d, 1) for d in others])
        m.ir_version = self.ir
        if check:
            onnx.checker.check_model(m)
        return m

    # -- layers ------------------------------------------------------------------------------------
    def linear(self, x: str, k: int, n: int, kind: str = "gemm", bias: bool = True, name: str | None = None,
               dtype=np.float32) -> str:
        """kind: gemm (transB=1 like torch), gemm_plain, matmul (bias Add on the right), matmul_left."""
        if kind.startswith("gemm"):
            if kind == "gemm":
                w = self.init((self.rng.standard_normal((n, k)) / np.sqrt(k)).astype(dtype), self.name("w"))
                ins = [x, w] + ([self.vec(n, dtype)] if bias else [])
                return self.op("Gemm", ins, name=name, transB=1)
            w = self.weight(k, n, dtype)
            return self.op("Gemm", [x, w] + ([self.vec(n, dtype)] if bias else []), name=name)
        y = self.op("MatMul", [x, self.weight(k, n, dtype)], name=name)
        if not bias:
            return y
        b = self.vec(n, dtype)
        return self.op("Add", [b, y] if kind == "matmul_left" else [y, b])


def mlp(widths, act: str | None = "Relu", kind: str = "gemm", rank: int = 2, opset: int = 17, ir: int = 8,
        bias: bool = True, last_act: bool = False, elem=F32, **act_attrs) -> onnx.ModelProto:
    """x -> [linear -> act] * (len(widths) - 1) -> y, the last layer without activation unless last_act."""
    g = G(opset, ir)
    dtype = np.float16 if elem == F16 else np.float32
    h = "x"
    n = len(widths) - 1
    for i in range(n):
        h = g.linear(h, widths[i], widths[i + 1], kind=kind, bias=bias, name=f"fc{i}", dtype=dtype)
        if act and (i < n - 1 or last_act):
            h = g.op(act, [h], name=f"act{i}", **act_attrs)
    g.nodes[-1].output[0] = "y"  # nothing consumes the last node's output
    lead = ["B", "S", "T", "U"][: rank - 1]
    return g.model([("x", lead + [widths[0]])], [("y", lead + [widths[-1]])], elem=elem)


def skip_mlp(k0: int, widths, at: int, x_first: bool = True, act: str = "Relu", rank: int = 2,
             opset: int = 17, seed: int = 0, other: str = "x", divide: float | None = None,
             elem=F32) -> onnx.ModelProto:
    """NeRF's trunk in small: x (k0 features) -> [linear -> act] per width, layer `at` reading Concat(x, h)
    (x_first) or Concat(h, x) on the last axis; the last layer without activation. `other`: what the
    Concat joins ("x", or "z": a second graph input of k0 features, which is no skip); `divide`: the Concat's
    output divided by that constant (NeuS's / sqrt(2)). Gemm layers (rank 2) or MatMul + Add; `elem`: the
    model's float type (weights and I/O)."""
    g = G(opset, seed=seed)
    dtype = np.float16 if elem == F16 else np.float32
    h, k = "x", k0
    n = len(widths)
    for i, w in enumerate(widths):
        if i == at:
            h = g.op("Concat", [other, h] if x_first else [h, other], name="skip_concat", axis=-1)
            if divide is not None:
                h = g.op("Div", [h, g.init(np.array(divide, dtype))], name="skip_scale")
            k += k0
        h = g.linear(h, k, w, kind="gemm" if rank == 2 else "matmul", name=f"fc{i}", dtype=dtype)
        if i < n - 1:
            h = g.op(act, [h], name=f"act{i}")
        k = w
    g.nodes[-1].output[0] = "y"
    lead = ["B", "S", "T"][: rank - 1]
    inputs = [("x", lead + [k0])] + ([("z", lead + [k0])] if other != "x" else [])
    return g.model(inputs, [("y", lead + [widths[-1]])], elem=elem)


def run(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    """Stock ONNX Runtime (CPU, graph optimisations off: the plain ops)."""
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 3
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def rand(shape, seed: int = 1, scale: float = 3.0, dtype=np.float32) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(dtype)


# -- fusing and checking (shared by the exporter, property and GPU tests) ----------------------------

def fuse(model: onnx.ModelProto, precision: str = "fp32"):
    """(plan, specs, rewritten model) of the whole pass pipeline."""
    from onnx2fused.passes import find_chains, rewrite
    plan = find_chains(model)
    specs = [c.to_spec(precision) for c in plan.chains]
    return plan, specs, rewrite(model, plan, specs)


def assert_untouched_identical(model: onnx.ModelProto, plan, fused: onnx.ModelProto) -> None:
    """Every node outside the chains is in the fused model byte for byte and in the same order; only
    folded constant producers that nothing reads any more may be gone."""
    from onnx2fused.passes.constants import GraphIndex, node_reads
    from onnx2fused.spec import DOMAIN
    ix = GraphIndex(model)
    in_chains = {k for c in plan.chains for k in c.nodes}
    kept = [(k, n.SerializeToString()) for k, n in zip(ix.keys, model.graph.node) if k not in in_chains]
    now = [n.SerializeToString() for n in fused.graph.node if n.domain != DOMAIN]
    reads = {o.name for o in fused.graph.output} | {t for n in fused.graph.node for t in node_reads(n)}
    it = iter(now)
    for key, blob in kept:
        if blob in now:
            assert next(it) == blob, f"node {key} moved"
        else:
            i = ix.index_of[key]
            assert i in ix.const_producers.values(), f"node {key} changed or vanished"
            assert not set(model.graph.node[i].output) & reads, f"dropped constant {key} is still read"
    assert next(it, None) is None, "the fused model has nodes the original had not"


def assert_every_unfused_layer_explained(model: onnx.ModelProto, plan) -> None:
    """Each Gemm/MatMul outside the chains has a one-line refusal naming it."""
    from onnx2fused.passes.constants import node_keys
    in_chains = {k for c in plan.chains for k in c.nodes}
    refused = {r.node: r.reason for r in plan.refusals}
    for key, n in zip(node_keys(model.graph), model.graph.node):
        if n.op_type in ("Gemm", "MatMul") and key not in in_chains:
            assert key in refused, f"{n.op_type} '{key}' is neither fused nor explained"
            assert "\n" not in refused[key] and refused[key]


def plugin_session(model: onnx.ModelProto, library=None, level=None, providers=("CPUExecutionProvider",)):
    """An ORT session of `model`, with the plugin library registered when given."""
    so = ort.SessionOptions()
    so.log_severity_level = 3
    if level is not None:
        so.graph_optimization_level = level
    if library is not None:
        so.register_custom_ops_library(str(library))
    return ort.InferenceSession(model.SerializeToString(), so, providers=list(providers))


def assert_cpu_kernel_matches_stock(model: onnx.ModelProto, specs, fused: onnx.ModelProto, feeds: dict,
                                    cache_dir, rtol: float = 1e-4, atol: float = 1e-5) -> None:
    """The fused model's CPU kernels (a CPU-only plugin built into `cache_dir`; the stock bodies removed, so
    that the kernels must run every node) against the model's stock ops on `feeds` (property tests)."""
    from onnx2fused.library import build_plugin
    lib = build_plugin(specs, with_cuda=False, cache_dir=cache_dir)
    del fused.functions[:]
    sess = plugin_session(fused, lib.path)
    np.testing.assert_allclose(sess.run(None, feeds)[0], run(model, feeds)[0], rtol=rtol, atol=atol)


def assert_close(got: np.ndarray, ref: np.ndarray, tol: float) -> None:
    """|got - ref| <= tol * (|ref| + max|ref|): relative, with the scale of the whole output as a floor."""
    assert got.shape == ref.shape and got.dtype == ref.dtype, (got.shape, got.dtype, ref.shape, ref.dtype)
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    assert np.isfinite(ref).all(), "the reference has inf/NaN: pick another input"
    scale = max(float(np.abs(ref).max(initial=0.0)), 1e-30)
    err = np.abs(got - ref)
    bad = ~(err <= tol * (np.abs(ref) + scale))
    assert not bad.any(), (f"{int(bad.sum())} of {bad.size} outputs differ; worst {float(err.max()):.3g} "
                           f"at {np.unravel_index(int(np.argmax(np.where(np.isnan(err), np.inf, err))), err.shape)}")


# -- activation families with per-channel constants ---------------------------------------------------

def _vec(g: G, n: int, lo: float, hi: float) -> str:
    return g.init(g.rng.uniform(lo, hi, n).astype(np.float32))


def _s(g: G, v: float) -> str:
    return g.init(np.array(v, np.float32))


# Activation builders that know the layer width (for per-channel vectors): name -> f(g, x, width) -> output.
# CONTINUOUS_ACTS are continuous functions: a threshold flipped by a rounding difference in a hidden layer
# changes the output by no more than that difference, so they can be compared with a tight tolerance
# after any number of layers.
CONTINUOUS_ACTS = {
    "none": lambda g, x, n: x,
    "relu": lambda g, x, n: g.op("Relu", [x]),
    "leaky": lambda g, x, n: g.op("LeakyRelu", [x], alpha=0.1),
    "prelu_per_channel": lambda g, x, n: g.op("PRelu", [x, _vec(g, n, -0.5, 0.5)]),
    "elu": lambda g, x, n: g.op("Elu", [x], alpha=0.8),
    "selu": lambda g, x, n: g.op("Selu", [x]),
    "celu": lambda g, x, n: g.op("Celu", [x], alpha=1.5),
    "sigmoid": lambda g, x, n: g.op("Sigmoid", [x]),
    "hardsigmoid": lambda g, x, n: g.op("HardSigmoid", [x], alpha=0.3, beta=0.4),
    "hardswish": lambda g, x, n: g.op("HardSwish", [x]),
    "tanh": lambda g, x, n: g.op("Tanh", [x]),
    "softplus": lambda g, x, n: g.op("Softplus", [x]),
    "softsign": lambda g, x, n: g.op("Softsign", [x]),
    "gelu_erf_chain": lambda g, x, n: g.op("Mul", [g.op("Mul", [x, g.op("Add", [
        g.op("Erf", [g.op("Div", [x, _s(g, 1.4142135)])]), _s(g, 1.0)])]), _s(g, 0.5)]),
    "mish_chain": lambda g, x, n: g.op("Mul", [x, g.op("Tanh", [g.op("Softplus", [x])])]),
    "silu": lambda g, x, n: g.op("Mul", [x, g.op("Sigmoid", [x])]),
    "quickgelu": lambda g, x, n: g.op("Mul", [x, g.op("Sigmoid", [g.op("Mul", [_s(g, 1.702), x])])]),   # CLIP
    "sin_scaled": lambda g, x, n: g.op("Sin", [g.op("Mul", [x, _s(g, 2.0)])]),
    "relu6": lambda g, x, n: g.op("Clip", [x, _s(g, 0.0), _s(g, 6.0)]),
    "scale_shift_per_channel": lambda g, x, n: g.op("Add", [g.op("Mul", [x, _vec(g, n, -2, 2)]), _vec(g, n, -1, 1)]),
    "clamp_per_channel": lambda g, x, n: g.op("Min", [g.op("Max", [x, _vec(g, n, -2, -0.1)]), _vec(g, n, 0.1, 2)]),
    "div_sub_per_channel": lambda g, x, n: g.op("Sub", [g.op("Div", [x, _vec(g, n, 0.5, 2)]), _vec(g, n, -1, 1)]),
    # torch's Linear, BatchNorm1d, ReLU in inference mode (scale, B, mean, var per channel)
    "batchnorm_relu_per_channel": lambda g, x, n: g.op("Relu", [g.op("BatchNormalization", [
        x, _vec(g, n, 0.5, 2), _vec(g, n, -1, 1), _vec(g, n, -1, 1), _vec(g, n, 0.25, 4)])]),
    "where_slope_per_channel": lambda g, x, n: g.op("Where", [g.op("Greater", [x, _s(g, 0.0)]), x,
                                                             g.op("Mul", [x, _vec(g, n, 0, 0.3)])]),
    "tanh_squared": lambda g, x, n: g.op("Pow", [g.op("Tanh", [x]), _s(g, 2.0)]),
    "composite": lambda g, x, n: g.op("Add", [g.op("Mul", [g.op("Sigmoid", [x]), g.op("Tanh", [x])]),
                                              g.op("Mul", [x, _s(g, 0.1)])]),
    "dropout_then_abs": lambda g, x, n: g.op("Abs", [g.op("Dropout", [x])]),
    "cast_roundtrip_relu": lambda g, x, n: g.op("Relu", [g.op("Cast", [g.op("Cast", [x], to=TensorProto.DOUBLE)],
                                                              to=TensorProto.FLOAT)]),
}

# Discontinuous or unbounded ones (compared one family at a time, in fp32 where a threshold decides).
STEP_ACTS = {
    "thresholded_relu": lambda g, x, n: g.op("ThresholdedRelu", [x], alpha=0.3),
    "where_less_per_channel": lambda g, x, n: g.op("Where", [g.op("Less", [x, _vec(g, n, -0.5, 0.5)]), _s(g, 0.0), x]),
    "softplus_torch_form": lambda g, x, n: (lambda m: g.op("Where", [g.op("Greater", [m, _s(g, 20.0)]), x, g.op(
        "Div", [g.op("Softplus", [m]), _s(g, 2.0)])]))(g.op("Mul", [x, _s(g, 2.0)])),
    "siren_sin30": lambda g, x, n: g.op("Sin", [g.op("Mul", [_s(g, 30.0), x])]),
    # torch's TorchScript Hardshrink (bool Casts and Or), and the other logic ops on conditions
    "hardshrink_or": lambda g, x, n: g.op("Where", [g.op("Or", [
        g.op("Cast", [g.op("Greater", [x, _s(g, 0.3)])], to=TensorProto.BOOL),
        g.op("Cast", [g.op("Less", [x, _s(g, -0.3)])], to=TensorProto.BOOL)]), x, _s(g, 0.0)]),
    "logic_and_not_xor": lambda g, x, n: g.op("Where", [g.op("Xor", [
        g.op("And", [g.op("Greater", [x, _s(g, -1.0)]), g.op("Not", [g.op("Greater", [x, _s(g, 1.0)])])]),
        g.op("Less", [x, _s(g, 0.0)])]), g.op("Mul", [x, _s(g, 2.0)]), x]),
}
OTHER_ACTS = {
    "gelu_op": lambda g, x, n: g.op("Gelu", [x]),                    # opset 20
    "gelu_tanh_op": lambda g, x, n: g.op("Gelu", [x], approximate="tanh"),
    "mish_op": lambda g, x, n: g.op("Mish", [x]),
    "exp_neg_abs": lambda g, x, n: g.op("Exp", [g.op("Neg", [g.op("Abs", [x])])]),
    "log_one_plus_abs": lambda g, x, n: g.op("Log", [g.op("Add", [g.op("Abs", [x]), _s(g, 1.0)])]),
    "sqrt_abs": lambda g, x, n: g.op("Sqrt", [g.op("Abs", [x])]),
    "reciprocal_shifted": lambda g, x, n: g.op("Reciprocal", [g.op("Add", [g.op("Abs", [x]), _s(g, 1.0)])]),
    "cos_erf": lambda g, x, n: g.op("Cos", [g.op("Erf", [x])]),
    "neg_identity": lambda g, x, n: g.op("Identity", [g.op("Neg", [x])]),
}


def fp16_keep_io(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` (float32, one input and output) as onnxconverter-common's
    `float16.convert_float_to_float16(model, keep_io_types=True)` writes it: float16 inside, a Cast from
    the float32 input in front and a Cast back to float32 behind."""
    from onnx2fused.bench.models import to_fp16

    m = to_fp16(model)
    g = m.graph
    x, y = g.input[0].name, g.output[0].name
    x16, y16 = x + "_cast_to_fp16", y + "_fp16"
    for n in g.node:
        n.input[:] = [x16 if i == x else i for i in n.input]
        n.output[:] = [y16 if o == y else o for o in n.output]
    g.node.insert(0, helper.make_node("Cast", [x], [x16], name="graph_input_cast0", to=TensorProto.FLOAT16))
    g.node.append(helper.make_node("Cast", [y16], [y], name="graph_output_cast0", to=TensorProto.FLOAT))
    g.input[0].type.tensor_type.elem_type = TensorProto.FLOAT
    g.output[0].type.tensor_type.elem_type = TensorProto.FLOAT
    onnx.checker.check_model(m)
    return m
