"""Issue 14 §4: every split of a chain says why, and the cheap elementwise ops that used to split fuse.

Each op sits between two linear layers (x -> fc0 -> op -> fc1 -> y). A non-elementwise op there must
give the chain end a one-line reason, in the plan and in `inspect`; an elementwise one must fuse, and
the fused kernels (CPU plugin, one g++ build for the whole file) and the stock-op fallback must compute
what stock ONNX Runtime computes. The same for onnx's own function bodies of the elementwise
activations (`*_expanded` test models, built from the onnx package's node test cases), which cast
every constant with CastLike.
"""
from __future__ import annotations

import functools
import shutil
import subprocess
import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx2fused import codegen
from onnx2fused import expr as ex
from onnx2fused.library import build_plugin
from onnx2fused.passes import find_chains
from onnx2fused.spec import GATED_NO_CUDA, LayerSpec, MLPSpec
from onnx_builders import G, assert_close, fuse, plugin_session, run


def c(v, dtype=np.float32):
    return np.array(v, dtype=dtype)


def between(build, opset: int = 17, width: int = 6) -> onnx.ModelProto:
    """x [B, 8] -> fc0 -> 'h' [B, width] -> build(g, 'h') -> fc1 -> y [B, 4]."""
    g = G(opset=opset)
    g.op("Gemm", ["x", g.weight(width, 8), g.vec(width)], name="fc0", outputs=["h"], transB=1)
    out = build(g, "h")
    g.op("Gemm", [out, g.weight(4, width), g.vec(4)], name="fc1", outputs=["y"], transB=1)
    return g.model([("x", ["B", 8])], [("y", ["B", 4])])


def _ln(g, h):
    return g.op("LayerNormalization", [h, g.init(np.ones(6, np.float32)), g.init(np.zeros(6, np.float32))],
                name="ln", axis=-1)


def _split_swap(g, h):  # a [B, 6] row cut in two halves, swapped: still 6 wide for fc1
    a, b = g.op("Split", [h, g.init(np.array([3, 3], np.int64))], name="split", outputs=2, axis=-1)
    return g.op("Concat", [b, a], name="cat", axis=-1)


def _castlike_round_trip(to):
    return lambda g, h: g.op("CastLike", [g.op("CastLike", [h, g.init(np.zeros([], to))], name="to"),
                                          g.init(np.zeros([], np.float32))], name="back")


END = "chain 0 ends: output of layer 1 ('h') feeds "
# name -> (build, opset, the reason the chain end gets)
SPLITS = {
    "layernorm": (_ln, 17, END + "LayerNormalization 'ln': LayerNormalization is a normalisation across the row, "
                                 "not elementwise"),
    "split": (_split_swap, 18, END + "Split 'split': Split cuts the row into pieces (torch chunk/split), "
                                     "not elementwise"),
    "softmax": (lambda g, h: g.op("Softmax", [h], name="sm", axis=-1), 17,
                END + "Softmax 'sm': Softmax normalises across the row, not elementwise"),
    "unsupported_elementwise": (lambda g, h: g.op("Mod", [h, g.init(c(2.0))], name="mod", fmod=1), 17,
                                END + "Mod 'mod': Mod is not a supported elementwise op"),
    "castlike_rounds_to_16_bits": (_castlike_round_trip(np.float16), 17,
                                   END + "CastLike 'to': CastLike to float16 rounds the float32 value"),
    "castlike_to_int": (_castlike_round_trip(np.int32), 17,
                        END + "CastLike 'to': CastLike to int32 (only casts to float types are elementwise no-ops)"),
}


@pytest.mark.parametrize("name", sorted(SPLITS))
def test_each_split_says_why(name, tmp_path, monkeypatch):
    import onnx2fused
    build, opset, reason = SPLITS[name]
    m = between(build, opset)
    plan = find_chains(m)
    assert [c.widths for c in plan.chains] == [(8, 6), (6, 4)]
    assert [r.reason for r in plan.refusals] == [reason]
    path = tmp_path / "m.onnx"
    onnx.save(m, str(path))
    res = onnx2fused.inspect(str(path), precision="fp32", with_cuda=False)
    assert res.refusals == [reason]
    assert "\n  " + reason + "\n" in res.format() + "\n"
    if name == "layernorm":  # the norm is chain 1's prologue (issue 16), with CUDA kernels too
        assert plan.chains[1].norm is not None
        res = onnx2fused.inspect(str(path), precision="fp32", with_cuda=True) if shutil.which("nvcc") else None
        assert res is None or res.refusals == [reason]


def test_custom_domain_op_says_why():
    g = G(opset=17)
    g.op("Gemm", ["x", g.weight(6, 8)], name="fc0", outputs=["h"], transB=1)
    g.op("Relu", ["h"], name="myrelu", outputs=["r"], domain="com.example")
    g.op("Gemm", ["r", g.weight(4, 6)], name="fc1", outputs=["y"], transB=1)
    m = g.model([("x", ["B", 8])], [("y", ["B", 4])], check=False)
    m.opset_import.append(helper.make_opsetid("com.example", 1))
    m.graph.value_info.append(helper.make_tensor_value_info("r", TensorProto.FLOAT, ["B", 6]))
    assert [r.reason for r in find_chains(m).refusals] == [
        END + "Relu 'myrelu': Relu of domain 'com.example' is not a supported elementwise op"]


def test_torch_chunk_split_says_why(tmp_path):
    """torch's dynamo exporter writes `chunk` as a Split of the layer's output. p * sigmoid(q) of its two
    halves is a gated layer (issue 16): one chain for a CPU-only library; a library with CUDA kernels
    splits it at the Split and says why (test_passes_gated.py has the rest)."""
    torch = pytest.importorskip("torch")

    class GLU(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(8, 12), torch.nn.Linear(6, 4)

        def forward(self, x):
            p, q = self.a(x).chunk(2, dim=-1)
            return self.b(p * torch.sigmoid(q))

    path = tmp_path / "glu.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(GLU().eval(), (torch.randn(3, 8),), str(path), dynamo=True, verbose=False,
                          dynamic_shapes=({0: torch.export.Dim("B")},), input_names=["x"], output_names=["y"])
    m = onnx.load(str(path))
    plan = find_chains(m)
    assert [c.activation_labels() for c in plan.chains] == [["gated sigmoid", "id"]] and plan.refusals == []
    plan = find_chains(m, gated_refused=GATED_NO_CUDA)
    split = next(n for n in m.graph.node if n.op_type == "Split")
    (reason,) = [r.reason for r in plan.refusals]
    assert reason.startswith("chain 0 ends: output of layer 1 (")
    assert reason.endswith(f"feeds Split '{split.name}': {GATED_NO_CUDA}")


# -- the ops that split before and fuse now ---------------------------------------------------------------

UNARY = ("Sinh", "Cosh", "Tan", "Asin", "Acos", "Atan", "Asinh", "Acosh", "Atanh", "Floor", "Ceil", "Round", "Sign")
# name -> (build, opset, the activation it must become)
FUSABLE = {
    **{op: (lambda g, h, op=op: g.op(op, [h]), 17, ex.Op(op.lower(), (ex.X,))) for op in UNARY},
    "Shrink": (lambda g, h: g.op("Shrink", [h], lambd=1.5, bias=0.5), 17, ex.shrink(1.5, 0.5)),
    "Swish": (lambda g, h: g.op("Swish", [h], alpha=1.7), 24, ex.swish(1.7)),
    "Sum": (lambda g, h: g.op("Sum", [h, g.init(c(0.5))]), 17, ex.X + 0.5),
    "CastLike": (lambda g, h: g.op("Mul", [h, g.op("CastLike", [g.const_node(c(0.25)), h])]), 17, ex.X * 0.25),
}


@pytest.mark.parametrize("name", sorted(FUSABLE))
def test_elementwise_op_fuses(name):
    build, opset, want = FUSABLE[name]
    plan = find_chains(between(build, opset))
    assert [c.widths for c in plan.chains] == [(8, 6, 4)], plan.describe()
    assert plan.refusals == []
    assert plan.chains[0].activations == [want, ex.identity()], ex.to_text(plan.chains[0].activations[0])


# Layers of exact arithmetic: weights in {0, +-0.5, +-1}, biases in quarters, inputs in halves, so every
# pre-activation is a multiple of 1/4 computed without rounding (any summation order). Round then meets
# exact halves (to even, not away from zero), Floor/Ceil exact integers and Shrink its exact thresholds,
# and the output must equal stock ORT's bit for bit.
STEP_ACTS = [
    lambda g, h: g.op("Round", [h]),
    lambda g, h: g.op("Floor", [h]),
    lambda g, h: g.op("Ceil", [h]),
    lambda g, h: g.op("Shrink", [h], lambd=1.5, bias=0.5),
    lambda g, h: g.op("Sign", [h]),
]
# Smooth ones on ordinary float weights, each kept inside its op's domain and away from the edges where
# its slope is infinite (asin(tanh(9)) turns tanh's last-ulp difference into 3e-4).
SMOOTH_ACTS = [
    lambda g, h: g.op("Asin", [g.op("Mul", [g.op("Tanh", [h]), g.init(c(0.9))])]),
    lambda g, h: g.op("Atan", [h]),
    lambda g, h: g.op("Sinh", [h]),
    lambda g, h: g.op("Acos", [g.op("Mul", [g.op("Tanh", [h]), g.init(c(0.9))])]),
    lambda g, h: g.op("Asinh", [h]),
    lambda g, h: g.op("Acosh", [g.op("Add", [g.op("Abs", [h]), g.init(c(1.0))])]),
    lambda g, h: g.op("Atanh", [g.op("Mul", [g.op("Tanh", [h]), g.init(c(0.9))])]),
    lambda g, h: g.op("Cosh", [h]),
    lambda g, h: g.op("Tan", [g.op("Tanh", [h])]),
    lambda g, h: g.op("Swish", [h], alpha=1.7),
    lambda g, h: g.op("Shrink", [h], lambd=0.5, bias=0.5),  # soft shrink: continuous
    lambda g, h: g.op("Mul", [g.op("Sum", [h, g.op("CastLike", [g.const_node(c(0.5)), h])]),
                              g.op("CastLike", [g.const_node(c(0.75)), h])]),
]
WIDTH = 8


def _chain(g: G, x: str, acts, exact: bool, out: str) -> None:
    """x -> (fc -> act) for each act -> fc -> out, WIDTH wide."""
    h, k = x, WIDTH
    for i, act in enumerate(list(acts) + [None]):
        n = 4 if act is None else WIDTH
        if exact:
            w = g.init((g.rng.integers(-2, 3, (k, n)) * 0.5).astype(np.float32))
            b = g.init((g.rng.integers(-4, 5, n) * 0.25).astype(np.float32))
        else:
            w, b = g.weight(k, n), g.vec(n)
        h = g.op("MatMul", [h, w])
        h = g.op("Add", [h, b], outputs=[out] if act is None else 1)
        if act is not None:
            h = act(g, h)
        k = n


@pytest.fixture(scope="module")
def steps_and_smooth():
    """One model with two chains (exact steps; smooth ops), fused."""
    g = G(opset=24, seed=7)
    _chain(g, "x", STEP_ACTS, True, "y_steps")
    _chain(g, "x", SMOOTH_ACTS, False, "y_smooth")
    m = g.model([("x", ["B", WIDTH])], [("y_steps", ["B", 4]), ("y_smooth", ["B", 4])])
    plan, specs, fused = fuse(m, "fp32")
    assert [c.widths for c in plan.chains] == [(WIDTH,) * 6 + (4,), (WIDTH,) * 13 + (4,)], plan.describe()
    assert plan.refusals == []
    return m, fused, specs


@pytest.fixture(scope="module")
def plugin(steps_and_smooth, body_chains, tmp_path_factory):
    """The CPU plugin of every chain of this file: one g++ build."""
    specs = steps_and_smooth[2] + [s for _, _, spec in body_chains for s in spec]
    return build_plugin(specs, with_cuda=False, cache_dir=tmp_path_factory.mktemp("cache")).path


def _halves(rows: int, seed: int) -> np.ndarray:
    return (np.random.default_rng(seed).integers(-8, 9, (rows, WIDTH)) * 0.5).astype(np.float32)


def test_new_ops_on_the_cpu_plugin_match_stock_ort(steps_and_smooth, plugin):
    m, fused, _ = steps_and_smooth
    fused = onnx.ModelProto.FromString(fused.SerializeToString())
    del fused.functions[:]  # the plugin must run both nodes: no stock-op fallback to hide behind
    x = _halves(257, 1)
    ref_steps, ref_smooth = run(m, {"x": x})
    got_steps, got_smooth = plugin_session(fused, plugin).run(None, {"x": x})
    np.testing.assert_array_equal(got_steps, ref_steps)
    assert_close(got_smooth, ref_smooth, 1e-4)


def test_new_ops_fallback_matches_stock_ort(steps_and_smooth):
    """Without the plugin, ORT inlines each node's function: the stock ops emitted from the tree."""
    m, fused, _ = steps_and_smooth
    x = _halves(64, 2)
    ref_steps, ref_smooth = run(m, {"x": x})
    got_steps, got_smooth = run(fused, {"x": x})
    np.testing.assert_array_equal(got_steps, ref_steps)
    assert_close(got_smooth, ref_smooth, 1e-5)


def test_round_is_half_to_even_in_the_reference():
    x = c([0.5, 1.5, 2.5, -0.5, -2.5, 3.5])
    np.testing.assert_array_equal(ex.evaluate(ex.Op("round", (ex.X,)), x), c([0, 2, 2, -0, -2, 4]))
    assert ex.render_c(ex.Op("round", (ex.X,))) == "rintf(v)"  # not roundf: that rounds halves away from 0


# -- onnx's function bodies of the elementwise activations -----------------------------------------------

@functools.lru_cache(maxsize=1)
def expanded_bodies() -> tuple:
    """onnx's `*_expanded` node test models whose body is an elementwise activation of one float tensor
    (further inputs: scalars or per-channel vectors, such as Clip's bounds and PRelu's slope): 40 with
    onnx 1.23. collect_testcases builds them from the op schemas' function bodies (it runs once: a
    second call raises on the names it already holds)."""
    from onnx.backend.test.case.node import collect_testcases
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        cases = collect_testcases()
    out = []
    for t in cases:
        g = t.model.graph
        ins, outs = t.data_sets[0]
        if "_expanded" not in t.name or len(g.output) != 1:
            continue
        if any(n.op_type.startswith(("Reduce", "Random", "Bernoulli")) for n in g.node):
            continue  # softmax, mvn, ...: reductions; bernoulli: random
        if {g.input[0].type.tensor_type.elem_type, g.output[0].type.tensor_type.elem_type} != {TensorProto.FLOAT}:
            continue
        x0, y0 = np.asarray(ins[0]), np.asarray(outs[0])
        if x0.ndim == 0 or x0.shape != y0.shape or any(np.asarray(a).ndim > 1 for a in ins[1:]):
            continue  # SwiGLU's second tensor, attention, rotary embedding, a full-shape PRelu slope
        out.append(t)
    return tuple(out)


def _body_nodes(t, h: str, out: str, prefix: str) -> tuple[list, list]:
    """The body's nodes reading `h` and writing `out` (other tensors prefixed), and its extra inputs as
    initializers."""
    g = t.model.graph
    ins, _ = t.data_sets[0]
    rename = {g.input[0].name: h, g.output[0].name: out}
    inits = [numpy_helper.from_array(np.asarray(a), prefix + vi.name) for vi, a in zip(g.input[1:], ins[1:])]
    nodes = []
    for k, n in enumerate(g.node):
        n = onnx.NodeProto.FromString(n.SerializeToString())
        for field in (n.input, n.output):
            for j, name in enumerate(field):
                if name:
                    field[j] = rename.get(name, prefix + name)
        n.name = f"{prefix}{k}_{n.op_type}"  # the bodies' nodes have no names
        nodes.append(n)
    return nodes, inits


def _body_width(t) -> int:
    ins, _ = t.data_sets[0]
    vectors = [np.asarray(a).shape[0] for a in ins[1:] if np.asarray(a).ndim == 1 and np.asarray(a).size > 1]
    return vectors[0] if vectors else 5  # PRelu's slope fixes the width; any other body takes any


def _dyadic(rng, shape, step: float) -> np.ndarray:
    return (rng.integers(-2, 3, shape) * step).astype(np.float32)


def wrap_bodies(bodies, width: int, exact: bool, opset: int | None = None) -> onnx.ModelProto:
    """x [B, 5] -> fc -> body_1 -> fc -> body_2 -> ... -> fc -> y [B, 3]. `exact`: dyadic weights, so
    with dyadic inputs each body sees the same values in every summation order."""
    rng = np.random.default_rng(len(bodies))
    nodes, inits, h, k = [], [], "x", 5
    for i, t in enumerate(list(bodies) + [None]):
        n = 3 if t is None else width
        w = _dyadic(rng, (k, n), 0.5) if exact else (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
        b = _dyadic(rng, (n,), 0.25) if exact else rng.standard_normal(n).astype(np.float32) * 0.1
        inits += [numpy_helper.from_array(w, f"W{i}"), numpy_helper.from_array(b, f"B{i}")]
        lin = "y" if t is None else f"lin{i}"
        nodes.append(helper.make_node("Gemm", [h, f"W{i}", f"B{i}"], [lin], name=f"fc{i}"))
        if t is not None:
            body, extra = _body_nodes(t, lin, f"act{i}", f"b{i}_")
            nodes, inits, h = nodes + body, inits + extra, f"act{i}"
        k = n
    graph = helper.make_graph(nodes, "bodies", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", 5])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", 3])], initializer=inits)
    versions = [o.version for t in bodies for o in t.model.opset_import if o.domain in ("", "ai.onnx")]
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset or max(versions))])
    m.ir_version = max(t.model.ir_version for t in bodies)
    onnx.checker.check_model(m)
    return m


def test_expanded_bodies_are_the_forty_of_the_issue():
    names = [t.name for t in expanded_bodies()]
    assert len(names) == 40, names
    assert {"test_swish_expanded", "test_shrink_soft_expanded_ver18", "test_celu_expanded",
            "test_prelu_broadcast_expanded", "test_gelu_tanh_1_expanded"} <= set(names)


@pytest.mark.parametrize("index", range(40))
def test_expanded_body_fuses_and_matches_stock_ort(index):
    """Each body between two layers fuses into one chain; its expression and the fused model's stock-op
    fallback compute what stock ORT computes on the original."""
    t = expanded_bodies()[index]
    m = wrap_bodies([t], _body_width(t), exact=True)
    plan, specs, fused = fuse(m, "fp32")
    assert [len(c.layers) for c in plan.chains] == [2], f"{t.name}: {plan.describe()}"
    assert plan.refusals == [], t.name
    x = (np.random.default_rng(index).integers(-8, 9, (33, 5)) * 0.5).astype(np.float32)
    (ref,) = run(m, {"x": x})
    (got,) = run(fused, {"x": x})
    assert_close(got, ref, 1e-5)
    # the recognised expression on the first layer's (exact) output against the body run alone
    h = x @ onnx.numpy_helper.to_array(m.graph.initializer[0]) + onnx.numpy_helper.to_array(m.graph.initializer[1])
    body = onnx.ModelProto.FromString(t.model.SerializeToString())
    for vi in (body.graph.input[0], body.graph.output[0]):
        vi.type.tensor_type.ClearField("shape")  # the test case's shape is not [rows, width]
    extra = {vi.name: np.asarray(a) for vi, a in zip(body.graph.input[1:], t.data_sets[0][0][1:])}
    (want,) = run(body, {body.graph.input[0].name: h, **extra})
    np.testing.assert_allclose(ex.evaluate(plan.chains[0].activations[0], h), want, rtol=1e-5, atol=1e-6)


# Bodies whose function is discontinuous: a flipped threshold after inexact layers is not an error.
STEP_BODIES = ("thresholdedrelu", "shrink_hard")


@pytest.fixture(scope="module")
def body_chains():
    """Every continuous body, one after another between layers, eight to a chain (a deeper chain's
    kernel name is too long for a file name): [(model, fused model, specs)]."""
    bodies = [t for t in expanded_bodies() if not any(s in t.name for s in STEP_BODIES)]
    out = []
    for k in range(0, len(bodies), 8):
        m = wrap_bodies(bodies[k:k + 8], 5, exact=False, opset=24)
        plan, specs, fused = fuse(m, "fp32")
        assert [len(c.layers) for c in plan.chains] == [len(bodies[k:k + 8]) + 1], plan.describe()
        assert plan.refusals == []
        out.append((m, fused, specs))
    return out


def test_expanded_bodies_on_the_cpu_plugin(body_chains, plugin):
    x = np.random.default_rng(3).standard_normal((129, 5)).astype(np.float32)
    for m, fused, _ in body_chains:
        fused = onnx.ModelProto.FromString(fused.SerializeToString())
        del fused.functions[:]  # the plugin must run the node: no stock-op fallback to hide behind
        (ref,) = run(m, {"x": x})
        (got,) = plugin_session(fused, plugin).run(None, {"x": x})
        assert_close(got, ref, 1e-4)


@pytest.mark.cuda_build
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
def test_new_ops_compile_for_the_gpu(tmp_path):
    """The tensor-core kernel with every new op compiles (PTX, no GPU needed); Round is cvt.rni (half
    to even), Floor/Ceil cvt.rmi/rpi."""
    acts = [ex.Op(op.lower(), (ex.X,)) for op in UNARY] + [ex.shrink(1.5, 0.5), ex.swish(1.7)]
    spec = MLPSpec(tuple(LayerSpec(16, 16, True, a) for a in acts) + (LayerSpec(16, 8, True, ex.identity()),),
                   "fp16", "f32")
    from onnx2fused.plan.choose import make_plans
    files = codegen.render([spec], True, plans=make_plans([spec]))
    for name, text in files.items():   # the headers the source includes (o2f_*.cuh)
        if name.endswith(".cuh"):
            (tmp_path / name).write_text(text)
    src = files[f"{spec.name}_cuda.cu"]
    assert "rintf(" in src and "o2f_sign(" in src
    (tmp_path / "k.cu").write_text(src)   # a short name: nvcc's temporary files are named after the source
    r = subprocess.run([shutil.which("nvcc"), "-ptx", "-std=c++17", "-arch=compute_80", str(tmp_path / "k.cu"),
                        "-o", str(tmp_path / "k.ptx")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    ptx = (tmp_path / "k.ptx").read_text()
    assert all(f"cvt.{m}.f32.f32" in ptx for m in ("rni", "rmi", "rpi"))
