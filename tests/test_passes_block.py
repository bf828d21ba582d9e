"""Issue 16, second stage: transformer FFN blocks. A norm in front of a chain (LayerNormalization, the
RMSNorm ops, the hand-written RMSNorm's decomposition) and a residual Add of the block's input behind it
are found from both torch exporters, near misses are declined with their reason, and a library with CUDA
kernels fuses them where a fused kernel plans the block, else keeps them stock ops with the reason
(library.block_refusal: a wide chain).

Graph level only, no build: the function body (the stock-op fallback) is run with stock ONNX Runtime.
The kernels are checked in test_block_convert.py.
"""
from __future__ import annotations

import json
import warnings
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import pytest

from onnx2fused.library import block_refusal, find_fusions, fusion_refusals
from onnx2fused.loader import load_model
from onnx2fused.passes import block_key, find_chains
from onnx2fused.plan.choose import make_plan, wgmma_refused, wide_plan
from onnx2fused.plan.options import PlanOptions, WgmmaOptions
from onnx2fused.plan.wide import WIDE_RESIDUAL_ACT, WIDE_RESIDUAL_NARROW
from onnx2fused.spec import BLOCK_NO_CUDA, DOMAIN, LayerSpec, MLPSpec, NormSpec, SpecError
from onnx2fused import expr as ex
from onnx_builders import G, fuse, rand, run

MODELS = Path(__file__).resolve().parent.parent / "models"
ZOO = {m["name"]: m for m in json.loads((MODELS / "zoo.json").read_text())["models"]}
K, H = 8, 12


def _layernorm(g, x, axis=-1, bias=True, name="ln"):
    ins = [x, g.init((1 + 0.1 * g.rng.standard_normal(K)).astype(np.float32))]
    if bias:
        ins.append(g.init((0.1 * g.rng.standard_normal(K)).astype(np.float32)))
    return g.op("LayerNormalization", ins, name=name, axis=axis, epsilon=1e-3)


def _rms(g, x, form="dynamo", weight=True, axes=(-1,), exponent=2.0, swap=False, cast=None):
    """The hand-written RMSNorm's ops: Pow, ReduceMean, Add(eps), Sqrt, then Reciprocal + Mul (dynamo),
    Div(1, .) + Mul (legacy exporter) or Div(x, .) (`div`); then [Cast(to=cast)] and Mul(weight), operands
    swapped with `swap`."""
    sq = g.op("Pow", [x, g.init(np.array(exponent, np.float32))], name="pow")
    if g.opset >= 18:
        mean = g.op("ReduceMean", [sq, g.init(np.array(axes, np.int64))], name="mean", keepdims=1)
    else:
        mean = g.op("ReduceMean", [sq], name="mean", axes=list(axes), keepdims=1)
    s = g.op("Sqrt", [g.op("Add", [mean, g.init(np.array(1e-6, np.float32))], name="add_eps")], name="sqrt")
    if form == "div":
        h = g.op("Div", [x, s], name="scale")
    else:
        r = (g.op("Reciprocal", [s], name="rsqrt") if form == "dynamo"
             else g.op("Div", [g.init(np.array(1.0, np.float32)), s], name="rsqrt"))
        h = g.op("Mul", [x, r], name="scale")
    if cast is not None:
        h = g.op("Cast", [h], name="to_input_dtype", to=cast)
    if weight:
        w = g.init((1 + 0.1 * g.rng.standard_normal(K)).astype(np.float32 if cast in (None, 1) else np.float64))
        h = g.op("Mul", [w, h] if swap else [h, w], name="weight")
    return h


def _layernorm_ops(g, x, gamma=True, beta=True, square="pow", scaling="div"):
    """LayerNorm as both torch exporters write it below opset 17: ReduceMean, Sub, Pow (or Mul(d, d)),
    ReduceMean, Add(eps), Sqrt, Div (or Reciprocal + Mul), then Mul(gamma) and Add(beta)."""
    def mean(t, name):
        if g.opset >= 18:
            return g.op("ReduceMean", [t, g.init(np.array([-1], np.int64))], name=name, keepdims=1)
        return g.op("ReduceMean", [t], name=name, axes=[-1], keepdims=1)
    d = g.op("Sub", [x, mean(x, "mu")], name="dev")
    sq = (g.op("Pow", [d, g.init(np.array(2.0, np.float32))], name="sq") if square == "pow"
          else g.op("Mul", [d, d], name="sq"))
    s = g.op("Sqrt", [g.op("Add", [mean(sq, "var"), g.init(np.array(1e-5, np.float32))], name="add_eps")], name="sqrt")
    h = (g.op("Div", [d, s], name="scale") if scaling == "div"
         else g.op("Mul", [d, g.op("Reciprocal", [s], name="rsqrt")], name="scale"))
    if gamma:
        h = g.op("Mul", [h, g.init((1 + 0.1 * g.rng.standard_normal(K)).astype(np.float32), "gamma")], name="gamma_mul")
    if beta:
        h = g.op("Add", [h, g.init((0.1 * g.rng.standard_normal(K)).astype(np.float32), "beta")], name="beta_add")
    return h


def block(norm=_layernorm, residual=True, swap_add=False, out_width=K, opset=17, extra=None, add_other=None):
    """x [B, K] -> norm -> fc1 (H) -> Relu -> fc2 (out_width) -> [+ x] -> y. `extra(g, names)` adds
    what a near miss needs; `add_other` is what the Add adds instead of x."""
    g = G(opset=opset, seed=5)
    t = norm(g, "x") if norm is not None else "x"
    h = g.op("Relu", [g.linear(t, K, H, name="fc1")], name="act")
    y = g.linear(h, H, out_width, name="fc2")
    outs = [("y", ["B", out_width])]
    if residual:
        other = add_other or "x"
        g.op("Add", [other, y] if swap_add else [y, other], name="res", outputs=["y"])
    else:
        g.nodes[-1].output[0] = "y"
    if extra is not None:
        outs += extra(g, {"t": t})
    return g.model([("x", ["B", K])] + ([(add_other, ["B", K])] if add_other == "z" else []), outs)


def one_chain(m):
    plan = find_chains(m)
    assert len(plan.chains) == 1, plan.describe()
    return plan, plan.chains[0]


def check_fallback(m, rows=37, kept=()):
    """The rewritten model (fallback function inlined by stock ORT) computes what the original does;
    `kept`: the op types left beside the fused node."""
    plan, specs, r = fuse(m)
    assert [n.op_type for n in r.graph.node if n.domain != DOMAIN] == list(kept)
    x = rand([rows, K], seed=rows, scale=2.0) + 0.5
    ref, got = run(m, {"x": x})[0], run(r, {"x": x})[0]
    assert np.abs(ref).max() > 0
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    return specs[0]


# -- what fuses -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("swap_add", [False, True], ids=["add(y,x)", "add(x,y)"])
def test_layernorm_and_residual(swap_add):
    m = block(swap_add=swap_add)
    plan, c = one_chain(m)
    assert plan.refusals == [] and c.input == "x" and c.output == "y" and c.residual
    assert c.norm.kind == "layernorm" and c.norm.bias is not None and c.norm.eps == pytest.approx(1e-3)
    spec = check_fallback(m)
    assert spec.norm == NormSpec("layernorm", float(np.float32(1e-3)), True) and spec.residual
    assert spec.name.startswith(f"FusedMLP_{K}x{H}x{K}_ln_relu_id_res_fp32_f32_")


@pytest.mark.parametrize("form", ["dynamo", "legacy", "div"])
@pytest.mark.parametrize("opset", [17, 18])
@pytest.mark.parametrize("swap", [False, True])
def test_rmsnorm_decomposed(form, opset, swap):
    m = block(norm=lambda g, x: _rms(g, x, form=form, swap=swap), opset=opset)
    plan, c = one_chain(m)
    assert plan.refusals == [] and c.norm.kind == "rmsnorm" and c.residual
    assert c.norm.eps == pytest.approx(1e-6) and c.norm.bias is None
    spec = check_fallback(m)
    assert "_rms_relu_id_res_" in spec.name


def test_rmsnorm_with_a_same_type_cast_before_its_weight():
    """HF's LLaMA / Qwen2 / Mistral RMSNorm, `weight * h.to(input_dtype)`: the TorchScript exporter keeps the
    Cast to float of a float32 model, which goes with the norm; a Cast to another type is no norm's."""
    for form in ("legacy", "dynamo"):
        m = block(norm=lambda g, x: _rms(g, x, form=form, cast=onnx.TensorProto.FLOAT))
        plan, c = one_chain(m)
        assert plan.refusals == [] and c.norm.kind == "rmsnorm" and c.residual and c.input == "x", form
        assert "_rms_relu_id_res_" in check_fallback(m).name

    def widened(g, x):
        h = _rms(g, x, cast=onnx.TensorProto.DOUBLE)
        return g.op("Cast", [h], name="back", to=onnx.TensorProto.FLOAT)
    plan = find_chains(block(norm=widened))
    assert plan.chains[0].norm is None and not plan.chains[0].residual

    def cast_also_output(g, names):
        return [(next(n.output[0] for n in g.nodes if n.op_type == "Cast"), ["B", K])]
    m = block(norm=lambda g, x: _rms(g, x, cast=onnx.TensorProto.FLOAT), extra=cast_also_output)
    plan = find_chains(m)
    assert plan.chains[0].norm is None
    assert "the RMS norm's intermediate" in plan.refusals[0].reason and "graph output" in plan.refusals[0].reason


@pytest.mark.parametrize("adds", ["cast", "x"])
def test_rmsnorm_of_a_same_type_cast_of_x(adds):
    """HF's RMSNorm starts with x.to(float32): in a float32 model the block takes that Cast and reads x,
    whether the residual adds the Cast's output (as the TorchScript exporter writes it) or x itself."""
    def cast_then_rms(g, x):
        c = g.op("Cast", [x], name="to_float", to=onnx.TensorProto.FLOAT, outputs=["xc"])
        return _rms(g, c, form="legacy", cast=onnx.TensorProto.FLOAT)
    m = block(norm=cast_then_rms, add_other="xc" if adds == "cast" else None)
    plan, c = one_chain(m)
    assert plan.refusals == [] and c.input == "x" and c.residual and c.norm.kind == "rmsnorm"
    check_fallback(m)

    def cast_read_elsewhere(g, names):   # the Cast's output is also a graph output: it stays, the chain reads it
        return [("xc", ["B", K])]
    m = block(norm=cast_then_rms, extra=cast_read_elsewhere)
    plan, c = one_chain(m)
    assert plan.refusals == [] and c.input != "x" and c.residual and c.norm.kind == "rmsnorm"


def _fp16_block(where="before_weight", upcast=True):
    """An fp16 block with HF's RMSNorm as an fp16 model writes it: x.to(float32), the norm in float32, then
    rounded to fp16 before the weight (LLaMA, Qwen2: `where`="before_weight") or after it (Gemma:
    "after_weight"); `upcast`=False normalises a float32 value computed from x's copy (not a copy itself)."""
    f16, f32 = onnx.TensorProto.FLOAT16, onnx.TensorProto.FLOAT
    g = G(opset=17, seed=5)
    xf = g.op("Cast", ["x"], name="up", to=f32)
    if not upcast:
        xf = g.op("Relu", [xf], name="relu32")
    h = _rms(g, xf, form="legacy", weight=False)
    w = (1 + 0.1 * g.rng.standard_normal(K))
    if where == "before_weight":
        h = g.op("Mul", [g.init(w.astype(np.float16)), g.op("Cast", [h], name="down", to=f16)], name="weight")
    else:
        h = g.op("Cast", [g.op("Mul", [h, g.init(w.astype(np.float32))], name="weight")], name="down", to=f16)
    y = g.linear(g.op("Relu", [g.linear(h, K, H, name="fc1", dtype=np.float16)], name="act"), H, K, name="fc2",
                 dtype=np.float16)
    g.op("Add", [y, "x"], name="res", outputs=["y"])
    return g.model([("x", ["B", K])], [("y", ["B", K])], elem=onnx.TensorProto.FLOAT16)


@pytest.mark.parametrize("where", ["before_weight", "after_weight"])
def test_rmsnorm_of_an_fp16_model(where):
    """The norm (both Casts with it) and the residual of x join the chain, which reads and writes fp16;
    the function body computes in float32 what the fp16 graph computes with its roundings."""
    m = _fp16_block(where)
    plan, c = one_chain(m)
    assert plan.refusals == [] and c.input == "x" and c.output == "y" and c.residual and c.norm.kind == "rmsnorm"
    plan, specs, r = fuse(m)
    assert [n.domain for n in r.graph.node] == [DOMAIN] and specs[0].io_dtype == "f16"
    x = (rand([37, K], seed=3, scale=2.0) + 0.5).astype(np.float16)
    ref, got = run(m, {"x": x})[0], run(r, {"x": x})[0]
    assert got.dtype == np.float16 and np.abs(ref).max() > 0
    np.testing.assert_allclose(got.astype(np.float32), ref.astype(np.float32), rtol=2e-2, atol=2e-2)

    m = _fp16_block(where, upcast=False)   # relu of x's float32 copy: rounding its norm is not a norm of x
    plan = find_chains(m)
    assert plan.chains[0].norm is None and not plan.chains[0].residual


def test_rmsnorm_without_weight_and_layernorm_without_bias_or_residual():
    plan, c = one_chain(block(norm=lambda g, x: _rms(g, x, weight=False)))
    np.testing.assert_array_equal(c.norm.scale, np.ones(K, np.float32))
    m = block(norm=lambda g, x: _layernorm(g, x, bias=False), residual=False)
    plan, c = one_chain(m)
    assert c.norm.bias is None and not c.residual and c.output == "y"
    spec = check_fallback(m)
    assert spec.norm.has_bias is False and "_ln_relu_id_fp32" in spec.name


@pytest.mark.parametrize("opset", [13, 16, 18])
@pytest.mark.parametrize("form", [dict(), dict(square="mul", scaling="reciprocal"), dict(beta=False),
                                  dict(gamma=False, beta=False)], ids=["pow-div", "mul-reciprocal", "no-beta", "plain"])
def test_layernorm_as_the_ops_below_opset_17(opset, form):
    """The exporters' LayerNorm below opset 17 is the block's layer norm (gamma and beta taken as its scale
    and bias), with the residual of x; the fallback body writes the same ops where LayerNormalization does
    not exist."""
    m = block(norm=lambda g, x: _layernorm_ops(g, x, **form), opset=opset)
    plan, c = one_chain(m)
    assert plan.refusals == [] and c.input == "x" and c.residual and c.norm.kind == "layernorm", plan.describe()
    assert c.norm.eps == pytest.approx(1e-5) and (c.norm.bias is not None) == form.get("beta", True)
    gamma = next((t for t in m.graph.initializer if t.name == "gamma"), None)
    np.testing.assert_array_equal(c.norm.scale, np.ones(K, np.float32) if gamma is None
                                  else onnx.numpy_helper.to_array(gamma))
    spec = check_fallback(m)
    assert "_ln_relu_id_res_" in spec.name


def test_layernorm_ops_whose_deviations_feed_another_node_stay_stock():
    def extra(g, names):
        dev = next(n for n in g.nodes if n.name == "dev").output[0]
        g.op("Abs", [dev], name="side", outputs=["side"])
        return [("side", ["B", K])]
    m = block(norm=_layernorm_ops, extra=extra, opset=13)
    plan = find_chains(m)
    dev = next(n for n in m.graph.node if n.name == "dev").output[0]
    assert plan.chains[0].norm is None
    assert plan.refusals[0].reason.endswith(f"the layer norm's deviations '{dev}' also feed Abs 'side'"), \
        plan.describe()


@pytest.mark.parametrize("op,opset", [("RMSNormalization", 23), ("SimplifiedLayerNormalization", 17)])
def test_rms_norm_ops(op, opset):
    def norm(g, x):
        return g.op(op, [x, g.init((1 + 0.1 * g.rng.standard_normal(K)).astype(np.float32))], name="rms",
                    axis=-1, epsilon=1e-5)
    m = block(norm=norm, opset=opset, residual=True) if op == "RMSNormalization" else None
    if m is None:  # ORT's own op: not in the onnx schema, so the checker cannot see it
        g = G(opset=opset, seed=5)
        t = norm(g, "x")
        y = g.linear(g.op("Relu", [g.linear(t, K, H)]), H, K)
        g.op("Add", [y, "x"], outputs=["y"])
        m = g.model([("x", ["B", K])], [("y", ["B", K])], check=False)
        m.graph.value_info.append(onnx.helper.make_tensor_value_info(t, onnx.TensorProto.FLOAT, ["B", K]))
    plan, c = one_chain(m)
    assert c.norm.kind == "rmsnorm" and c.residual and plan.refusals == []
    check_fallback(m)


def test_residual_without_norm():
    m = block(norm=None)
    plan, c = one_chain(m)
    assert c.norm is None and c.residual and plan.refusals == []
    assert check_fallback(m).name.startswith(f"FusedMLP_{K}x{H}x{K}_relu_id_res_")


def _zoo_model(name, kind):
    return load_model(str(MODELS / ZOO[name]["files"][kind]["file"]))


@pytest.mark.parametrize("kind", ["dynamo", "opset17"])
@pytest.mark.parametrize("name,norm,labels", [("preln", "layernorm", ["gelu", "id"]),
                                              ("llama", "rmsnorm", ["gated silu", "id"])])
def test_zoo_blocks_from_both_exporters(name, norm, labels, kind):
    """The whole block is one chain: norm, layers (llama's gated SwiGLU too), residual; nothing left."""
    m = _zoo_model(name, kind)
    plan, c = one_chain(m)
    assert plan.refusals == []
    assert c.norm.kind == norm and c.residual and c.activation_labels() == labels
    assert c.input == "x" and c.output == "y" and list(c.widths) == ZOO[name]["widths"]
    assert len(c.nodes) == len(m.graph.node) - sum(n.op_type == "Constant" for n in m.graph.node)


def test_torch_nn_layernorm_and_rmsnorm(tmp_path):
    """torch's own modules: nn.LayerNorm (both exporters: LayerNormalization) and nn.RMSNorm (dynamo:
    the decomposed ops; the legacy exporter cannot export it), and HF's LLaMA RMSNorm (the legacy exporter
    keeps its Cast to float)."""
    torch = pytest.importorskip("torch")

    class Block(torch.nn.Module):
        def __init__(self, norm):
            super().__init__()
            self.norm, self.a, self.b = norm, torch.nn.Linear(K, H), torch.nn.Linear(H, K)

        def forward(self, x):
            return x + self.b(torch.relu(self.a(self.norm(x))))

    class LlamaRMSNorm(torch.nn.Module):   # as HF transformers writes it (LLaMA, Qwen2, Mistral)
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(K))

        def forward(self, h):
            dtype = h.dtype
            h = h.to(torch.float32)
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
            return self.weight * h.to(dtype)

    # (the legacy exporter below opset 17 writes nn.LayerNorm as its ops: ReduceMean, Sub, Pow, ...)
    cases = [(torch.nn.LayerNorm(K), True, "layernorm", 17), (torch.nn.LayerNorm(K), False, "layernorm", 17),
             (torch.nn.LayerNorm(K), False, "layernorm", 14), (torch.nn.LayerNorm(K), False, "layernorm", 11),
             (torch.nn.RMSNorm(K, eps=1e-5), True, "rmsnorm", 17), (LlamaRMSNorm(), False, "rmsnorm", 17),
             (LlamaRMSNorm(), True, "rmsnorm", 17)]
    for i, (norm, dynamo, kind, opset) in enumerate(cases):
        path = tmp_path / f"b{i}.onnx"
        with torch.no_grad():
            for p in norm.parameters():   # not the identity's 1 and 0
                p.add_(0.1 * torch.randn(p.shape))
        kw = dict(dynamo=True, dynamic_shapes=({0: torch.export.Dim("B")},)) if dynamo else \
            dict(dynamo=False, opset_version=opset, dynamic_axes={"x": {0: "B"}})
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(Block(norm).eval(), (torch.randn(3, K),), str(path), input_names=["x"],
                              output_names=["y"], verbose=False, **kw)
        m = load_model(str(path))
        plan, c = one_chain(m)
        assert c.norm.kind == kind and c.residual and plan.refusals == [], (i, plan.describe())
        _, _, r = fuse(m)
        assert [n.domain for n in r.graph.node] == [DOMAIN], i
        x = rand([9, K], seed=i, scale=2.0) + 0.5
        np.testing.assert_allclose(run(r, {"x": x})[0], run(m, {"x": x})[0], rtol=1e-5, atol=1e-5)


def test_llama_block_fallback_matches_stock():
    """The rewritten LLaMA block (RMSNorm, gated layer, residual), its function body on stock ORT."""
    for kind in ("dynamo", "opset17"):
        m = _zoo_model("llama", kind)
        plan, specs, r = fuse(m)
        assert [n.domain for n in r.graph.node] == [DOMAIN]
        x = np.random.default_rng(3).standard_normal((33, 64)).astype(np.float32)
        ref, got = run(m, {"x": x})[0], run(r, {"x": x})[0]
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


# -- near misses, each with its reason ----------------------------------------------------------------

START = "chain 0 starts: input '{t}' comes from {node}: "
END = "chain 0 ends: output of layer 2 ('{y}') "


def _reasons(m, **kw):
    return [r.reason for r in find_chains(m, **kw).refusals]


def test_norm_of_another_axis():
    g = G(opset=17, seed=5)
    t = _layernorm(g, "x", axis=1)
    h = g.linear(g.op("Relu", [g.linear(t, K, H, kind="matmul")]), H, K, kind="matmul")
    g.op("Add", [h, "x"], outputs=["y"])
    m = g.model([("x", ["B", 3, K])], [("y", ["B", 3, K])])
    plan = find_chains(m)
    assert plan.chains[0].norm is None and not plan.chains[0].residual
    t = m.graph.node[0].output[0]
    assert [r.reason for r in plan.refusals] == [
        START.format(t=t, node="LayerNormalization 'ln'") + "LayerNormalization 'ln' normalises from axis 1, "
        "not the last (feature) axis alone",
        END.format(y=plan.chains[0].output) + "feeds Add '" + m.graph.node[-1].name + "', not a residual of the "
        "block: it adds 'x', the input of the layer norm in front, which is not fused with the chain"]


def test_rms_mean_over_another_axis():
    g = G(opset=18, seed=5)
    t = _rms(g, "x", axes=(1,))
    g.linear(g.op("Relu", [g.linear(t, K, H, kind="matmul")]), H, 3, kind="matmul", bias=False)
    g.nodes[-1].output[0] = "y"
    m = g.model([("x", ["B", 3, K])], [("y", ["B", 3, 3])])
    (reason,) = _reasons(m)
    assert reason == START.format(t=t, node="Mul 'weight'") + "ReduceMean 'mean' averages over axes [1], " \
                                                             "not the last (feature) axis alone"


def test_normalised_tensor_also_feeds_another_node():
    def extra(g, names):
        g.op("Tanh", [names["t"]], name="side", outputs=["side"])
        return [("side", ["B", K])]
    m = block(extra=extra)
    plan = find_chains(m)
    c = plan.chains[0]
    assert c.norm is None and c.input == m.graph.node[0].output[0]
    assert [r.reason for r in plan.refusals] == [
        START.format(t=c.input, node="LayerNormalization 'ln'")
        + f"the normalised tensor '{c.input}' also feeds Tanh 'side'",
        END.format(y=c.output) + "feeds Add 'res', not a residual of the block: it adds 'x', the input of the "
        "layer norm in front, which is not fused with the chain"]


def test_rms_intermediate_read_elsewhere():
    def extra(g, names):
        return [("sqrt_out2", ["B", 1])]
    g = G(opset=17, seed=5)
    t = _rms(g, "x")
    g.linear(g.op("Relu", [g.linear(t, K, H)]), H, 3)
    g.nodes[-1].output[0] = "y"
    sqrt = next(n for n in g.nodes if n.op_type == "Sqrt").output[0]
    m = g.model([("x", ["B", K])], [("y", ["B", 3]), (sqrt, ["B", 1])])
    (reason,) = _reasons(m)
    assert reason == START.format(t=t, node="Mul 'weight'") + f"the RMS norm's intermediate '{sqrt}' is also a graph output"


def test_residual_adds_another_tensor_or_the_normalised_one():
    m = block(add_other="z")
    plan = find_chains(m)
    assert plan.chains[0].norm is not None and not plan.chains[0].residual
    assert [r.reason for r in plan.refusals] == [
        END.format(y=plan.chains[0].output) + "feeds Add 'res', not a residual of the block: it adds 'z', "
        "not the block's input 'x'"]
    # Add(y, LN(x)): the normalised tensor feeds the Add too, so the norm stays a stock op and the
    # chain's input is the normalised tensor, which the Add adds: a residual of that chain
    g = G(opset=17, seed=5)
    t = _layernorm(g, "x")
    y = g.linear(g.op("Relu", [g.linear(t, K, H)]), H, K)
    g.op("Add", [y, t], name="res", outputs=["y"])
    m = g.model([("x", ["B", K])], [("y", ["B", K])])
    plan, c = one_chain(m)
    assert c.norm is None and c.residual and c.input == t
    assert [r.reason for r in plan.refusals] == [
        START.format(t=t, node="LayerNormalization 'ln'") + f"the normalised tensor '{t}' also feeds Add 'res'"]
    check_fallback(m, kept=["LayerNormalization"])


def test_residual_of_another_width():
    m = block(norm=None, residual=False, out_width=1)
    g_add = onnx.helper.make_node("Add", [m.graph.node[-1].output[0], "x"], ["sum"], name="res")
    m.graph.node[-1].output[0] = "y1"
    g_add.input[0] = "y1"
    m.graph.node.append(g_add)
    m.graph.output[0].CopyFrom(onnx.helper.make_tensor_value_info("sum", onnx.TensorProto.FLOAT, ["B", K]))
    plan = find_chains(m)
    assert [r.reason for r in plan.refusals] == [
        END.format(y="y1") + "feeds Add 'res', not a residual of the block: the block's input 'x' has 8 features "
                             "and its output 1 (in != out width)"]


def test_residual_shapes_by_symbol_names_and_known_sizes():
    """Shape inference names fresh dims behind a Split ('unk__N': Phi-3's chunked gated layer from the
    TorchScript exporter); other names than x's are no reason to refuse the residual, known sizes that
    differ are (the Add broadcasts)."""
    def with_layer_output_shape(dims, x_dims=("B", K)):
        m = block(norm=None)
        fc2 = next(n for n in m.graph.node if n.name == "res").input[0]
        m.graph.input[0].CopyFrom(onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, list(x_dims)))
        m.graph.value_info.append(onnx.helper.make_tensor_value_info(fc2, onnx.TensorProto.FLOAT, list(dims)))
        return m, fc2
    m, _ = with_layer_output_shape(["unk__3", K])
    plan, c = one_chain(m)
    assert plan.refusals == [] and c.residual
    check_fallback(m)
    m, fc2 = with_layer_output_shape([1, K], x_dims=(5, K))
    assert _reasons(m) == [END.format(y=fc2) + "feeds Add 'res', not a residual of the block: shapes differ "
                           f"([1, {K}] and [5, {K}]), the Add broadcasts"]


# -- a library with CUDA kernels: the fused kernels take blocks, the wide design's chains keep them stock --

# the wide design available (CUTLASS headers or not on this host): the cost model decides
WIDE = PlanOptions()


def test_cuda_blocks_are_on_by_default_and_can_be_switched_off_with_the_reason():
    """The block kernels passed tests/test_gpu_block.py: a CUDA library fuses the norm and the Add by
    default; ONNX2FUSED_CUDA_BLOCKS=off keeps them stock around the fused layers, and says so."""
    m = block()
    assert PlanOptions.from_env({}).cuda_blocks is True
    assert PlanOptions.from_env({"ONNX2FUSED_CUDA_BLOCKS": "off"}).cuda_blocks is False
    (fused,) = find_fusions(m, True, PlanOptions()).chains
    assert fused.norm is not None and fused.residual
    plan = find_fusions(m, True, PlanOptions.from_env({"ONNX2FUSED_CUDA_BLOCKS": "off"}))
    (c,) = plan.chains
    assert c.norm is None and not c.residual and list(c.widths) == [K, H, K]
    assert len(plan.refusals) == 2
    assert all("ONNX2FUSED_CUDA_BLOCKS=off keeps a block's norm and residual out of the CUDA kernels" in r.reason
               for r in plan.refusals)
    assert find_fusions(m, False, PlanOptions(cuda_blocks=False)).chains[0].residual   # CPU-only: fused


def _refused(what, why):
    return BLOCK_NO_CUDA.format(what=what, why=why)


def test_cuda_library_fuses_norm_and_residual():
    """The resident/streamed/fp32 kernels run the norm prologue and the residual epilogue: a CUDA library
    fuses the whole block, as a CPU-only one does."""
    m = block()
    plan = find_chains(m)
    assert block_refusal(False, plan.chains) == {} and block_refusal(True, plan.chains, WIDE) == {}
    assert fusion_refusals(True, plan.chains, WIDE) == {"gated_refused": None, "block_refused": {}, "skip_refused": {},
                                                     "pool_refused": {}}
    plan = find_fusions(m, True, WIDE)
    (c,) = plan.chains
    assert c.norm is not None and c.residual and plan.refusals == []
    assert make_plan(c.to_spec("fp16"), WIDE).design == "resident"
    assert [n.domain for n in fuse_with_cuda(m).graph.node] == [DOMAIN]


@pytest.mark.parametrize("kind", ["dynamo", "opset17"])
@pytest.mark.parametrize("name", ["preln", "llama"])
def test_cuda_library_zoo_blocks(name, kind):
    """preln (LayerNorm, GELU FFN) and LLaMA's block (RMSNorm, gated SwiGLU): one chain with the norm
    and the residual, on a CUDA library too; a fused kernel plans it at every precision (fp16 and bf16 on
    Hopper: the wgmma kernel, its hidden layer >= 128 wide)."""
    m = _zoo_model(name, kind)
    plan = find_fusions(m, True, WIDE)
    (c,) = plan.chains
    assert plan.refusals == [] and c.norm is not None and c.residual
    assert list(c.widths) == ZOO[name]["widths"]
    for precision in ("fp16", "bf16", "tf32", "fp32"):
        want = ("wgmma",) if precision in ("fp16", "bf16") else ("resident", "streamed", "fp32")
        assert make_plan(c.to_spec(precision), WIDE).design in want


def test_refused_block_keeps_norm_and_residual_stock():
    """A block the library refuses (block_refused names its chain) keeps its norm and Add stock ops with
    the reason; the layers between them fuse."""
    m = block()
    (chain,) = find_chains(m).chains
    reason = BLOCK_NO_CUDA.format(what="{what}", why="a reason {with braces}".replace("{", "{{").replace("}", "}}"))
    for refused in (reason, {block_key(chain): reason}):
        plan = find_chains(m, block_refused=refused)
        (c,) = plan.chains
        assert c.norm is None and not c.residual and list(c.widths) == [K, H, K]
        t = m.graph.node[0].output[0]
        assert [r.reason for r in plan.refusals] == [
            START.format(t=t, node="LayerNormalization 'ln'") + _refused("layer norm in front", "a reason {with braces}"),
            END.format(y=c.output) + "feeds Add 'res': " + _refused("residual Add behind", "a reason {with braces}")]
    plan = find_chains(m, block_refused={block_key(chain) + 1: reason})   # another chain's refusal
    assert plan.chains[0].norm is not None and plan.chains[0].residual


def fuse_with_cuda(m):
    from onnx2fused.passes import rewrite
    plan = find_fusions(m, True, WIDE)
    return rewrite(m, plan, [c.to_spec("fp32") for c in plan.chains])


def _wide_block(k=768, h=3072, act_after_last=False):
    """x [B, k] -> LayerNorm -> fc k -> h -> Relu -> fc h -> k [-> Relu] -> + x: BERT-base's FFN block."""
    g = G(opset=17, seed=9)
    t = g.op("LayerNormalization", ["x", g.init(np.ones(k, np.float32)), g.init(np.zeros(k, np.float32))],
             name="ln", axis=-1, epsilon=1e-5)
    y = g.linear(g.op("Relu", [g.linear(t, k, h, name="fc1")]), h, k, name="fc2")
    if act_after_last:
        y = g.op("Relu", [y])
    g.op("Add", [y, "x"], name="res", outputs=["y"])
    return g.model([("x", ["B", k])], [("y", ["B", k])])


def test_cuda_library_fuses_a_wide_block():
    """768 -> 3072 -> 768: the cost model runs the block in the wide design, whose conversion pass
    normalises the rows and whose last GEMM takes the residual as its source operand: one chain with the
    norm and the Add, on a CUDA library as on a CPU-only one; bf16 plans wide too and fp32 (automatic
    precision skips tf32, which no CUDA design plans here) on CUDA cores."""
    m = _wide_block()
    plan = find_fusions(m, True, WIDE)
    (c,) = plan.chains
    assert c.norm is not None and c.residual and plan.refusals == []
    spec = c.to_spec("fp16")
    wide_block = make_plan(spec, WIDE)
    assert wide_block.design == "wide" and "a layer norm pass writing the 16-bit rows" in wide_block.describe()
    assert "the residual as the last GEMM's source operand" in wide_block.describe()
    assert make_plan(replace(spec, precision="bf16"), WIDE).design == "wide"
    assert make_plan(replace(spec, precision="fp32"), WIDE).design == "fp32"
    assert find_fusions(m, False).chains[0].residual   # CPU-only: fused
    no_wide = PlanOptions(wide_unavailable="no CUTLASS here")
    plan = find_fusions(m, True, no_wide)
    assert plan.chains[0].norm is None
    assert "tf32 + residual: even a 16-row tile needs" in plan.refusals[0].reason


def test_cuda_library_keeps_a_wide_block_the_wide_design_cannot_take_stock():
    """A ReLU after the last layer: the residual would enter the GEMM's epilogue before it, so the wide
    design cannot take the block; its layers stay wide and the norm and the Add stock ops, with the reason."""
    m = _wide_block(act_after_last=True)
    plan = find_fusions(m, True, WIDE)
    (c,) = plan.chains
    assert c.norm is None and not c.residual and list(c.widths) == [768, 3072, 768]
    start, end = (r.reason for r in plan.refusals)
    why = ("the cost model runs its layers 768 -> 3072 -> 768 in the wide design (~",
           "with the norm and the Add as stock ops, vs ~", f"in one streamed kernel), and {WIDE_RESIDUAL_ACT} "
           "(CPU-only libraries fuse it)")
    assert start.startswith(START.format(t=m.graph.node[0].output[0], node="LayerNormalization 'ln'")
                            + "layer norm in front: no fused CUDA kernel takes it: " + why[0])
    assert end.startswith(END.format(y=c.output) + "feeds Add 'res': residual Add behind: no fused CUDA kernel "
                                                   "takes it: " + why[0])
    assert all(w in r for w in why for r in (start, end))
    assert find_fusions(m, False).chains[0].residual   # CPU-only: fused


def test_forced_wide_takes_blocks_but_not_a_narrow_residual():
    m = block()   # 8 -> 12 -> 8: the residual after 8 outputs has no GEMM epilogue (the narrow layer's kernel)
    plan = find_fusions(m, True, PlanOptions(design="wide"))
    assert plan.chains[0].norm is None and not plan.chains[0].residual
    assert f"run in the wide design (ONNX2FUSED_CUDA_DESIGN=wide), and {WIDE_RESIDUAL_NARROW}" in plan.refusals[0].reason
    (c,) = find_fusions(_wide_block(k=40, h=100), True, PlanOptions(design="wide")).chains
    assert c.norm is not None and c.residual


def test_plan_takes_a_block_spec():
    """make_plan plans a block in the fused kernels, the wgmma kernel (forced here: its hidden layer is narrow)
    and the wide design; wgmma with its block support off refuses it with a reason, and fp16 I/O."""
    layers = (LayerSpec(K, H, True, ex.relu()), LayerSpec(H, K, True, ex.identity()))
    ln = MLPSpec(layers, norm=NormSpec("layernorm", 1e-5, True), residual=True)
    assert make_plan(ln).design == "resident"
    assert make_plan(replace(ln, precision="fp32")).design == "fp32"
    assert make_plan(ln, PlanOptions(design="streamed")).design == "streamed"
    assert make_plan(ln, PlanOptions(design="wgmma")).design == "wgmma" and wgmma_refused(ln) is None
    off = PlanOptions(design="wgmma", wgmma_overrides=WgmmaOptions(blocks=False))
    assert make_plan(ln, off).design == "resident" and "transformer block" in wgmma_refused(ln, off)
    assert "fp16 I/O" in wgmma_refused(replace(ln, io_dtype="f16"))
    with pytest.raises(SpecError, match="a residual after a last layer of at most 8 outputs"):
        wide_plan(MLPSpec(layers, residual=True))
    wide40 = (LayerSpec(40, H, True, ex.relu()), LayerSpec(H, 40, True, ex.identity()))
    assert wide_plan(MLPSpec(wide40, norm=NormSpec("rmsnorm", 1e-6), residual=True)).norm_offset > 0
    with pytest.raises(SpecError, match="the last layer must have none"):
        wide_plan(MLPSpec((wide40[0], LayerSpec(H, 40, True, ex.tanh())), residual=True))


def test_spec_checks_and_names():
    layers = (LayerSpec(K, H, True, ex.relu()), LayerSpec(H, 4, True, ex.identity()))
    with pytest.raises(SpecError, match="widths 8 and 4 differ"):
        MLPSpec(layers, residual=True)
    with pytest.raises(SpecError, match="an RMS norm has no bias"):
        NormSpec("rmsnorm", 1e-6, True)
    plain = MLPSpec(layers)
    a, b = MLPSpec(layers, norm=NormSpec("rmsnorm", 1e-6)), MLPSpec(layers, norm=NormSpec("rmsnorm", 1e-5))
    assert "_rms_" in a.name and a.name != b.name and "norm" not in plain.key_text()
    assert plain.describe() == "8 -> 12 -> 4 [relu, id] fp16"
    assert a.describe() == "RMS norm -> 8 -> 12 -> 4 [relu, id] fp16"
