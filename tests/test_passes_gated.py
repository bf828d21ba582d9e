"""Issue 16: gated layers (SwiGLU, GeGLU) found by the pass, near misses declined with their reason, and
the one decision whether a library with CUDA kernels fuses them (library.gated_refusal).

Graph level only: no build. The fused kernels and the stock bodies are checked in test_gated_convert.py.
"""
from __future__ import annotations

import json
import warnings
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from onnx2fused import expr as ex
from onnx2fused.library import find_fusions, gated_refusal
from onnx2fused.loader import load_model
from onnx2fused.passes import find_chains
from onnx2fused.plan.choose import make_plan, wgmma_note, wgmma_refused
from onnx2fused.plan.options import PlanOptions
from onnx2fused.plan.wide import wide_reason_refused
from onnx2fused.spec import GATED_NO_CUDA, LayerSpec, MLPSpec, SpecError
from onnx_builders import G, fuse, run

MODELS = Path(__file__).resolve().parent.parent / "models"
ZOO = {m["name"]: m for m in json.loads((MODELS / "zoo.json").read_text())["models"]}
K, H, N = 8, 6, 4


def two_linears(act=lambda g, h: g.op("Sigmoid", [h]), kind="gemm", swap=False, up_input="x", up_width=H,
                opset=17, gate_bias=True, up_bias=True, extra_user=False):
    """x [B, K] -> Mul(act(gate(x)), up(x)) -> down -> y [B, N] (up reads `up_input`)."""
    g = G(opset=opset, seed=3)
    gate = g.linear("x", K, H, kind=kind, bias=gate_bias, name="gate")
    up = g.linear(up_input, K, up_width, kind=kind, bias=up_bias, name="up")
    a = act(g, gate) if act is not None else gate
    p = g.op("Mul", [up, a] if swap else [a, up], name="mul")
    g.op("Gemm", [p, g.weight(N, H), g.vec(N)], name="down", outputs=["y"], transB=1)
    inputs = [("x", ["B", K])] + ([("z", ["B", K])] if up_input == "z" else [])
    outputs = [("y", ["B", N])] + ([(a, ["B", H])] if extra_user else [])
    return g.model(inputs, outputs)


def cut(gate_half=0, form="split", opset=18, sizes=(H, H), act=lambda g, h: g.op("Sigmoid", [h]),
        axis=-1, pre_act=None, both=False):
    """x -> fc1 (sum(sizes) outputs) -> cut in two -> act on half `gate_half` -> Mul -> down -> y."""
    g = G(opset=opset, seed=4)
    h = g.op("Gemm", ["x", g.weight(sum(sizes), K), g.vec(sum(sizes))], name="fc1", transB=1)
    if pre_act is not None:
        h = pre_act(g, h)
    if form == "split":
        if opset >= 18 and sizes[0] == sizes[1]:
            halves = g.op("Split", [h], name="split", outputs=2, axis=axis, num_outputs=2)
        else:
            halves = g.op("Split", [h, g.init(np.array(sizes, np.int64))], name="split", outputs=2, axis=axis)
    else:  # two Slices with constant bounds, the second to INT64_MAX like torch's [..., H:]
        w = sum(sizes)
        bounds = [(0, sizes[0]), (sizes[0], np.iinfo(np.int64).max)]
        halves = [g.op("Slice", [h, g.init(np.array([lo], np.int64)), g.init(np.array([hi], np.int64)),
                                 g.init(np.array([axis], np.int64))], name=f"slice{i}")
                  for i, (lo, hi) in enumerate(bounds)]
        assert w == sizes[0] + sizes[1]
    a, b = halves if gate_half == 0 else halves[::-1]
    ga = act(g, a)
    gb = act(g, b) if both else b
    p = g.op("Mul", [ga, gb], name="mul")
    g.op("Gemm", [p, g.weight(N, sizes[1]), g.vec(N)], name="down", outputs=["y"], transB=1)
    return g.model([("x", ["B", K])], [("y", ["B", N])])


def check_equivalent(model):
    """One chain; the rewritten model (its stock-op function) computes what the original computes."""
    plan, specs, fused = fuse(model)
    x = np.random.default_rng(0).standard_normal((5, K)).astype(np.float32)
    feeds = {"x": x}
    if any(i.name == "z" for i in model.graph.input):
        feeds["z"] = x
    ref = run(model, feeds)[0]
    np.testing.assert_allclose(run(fused, feeds)[0], ref, rtol=1e-5, atol=1e-5)
    return plan, specs


# -- the forms ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["gemm", "matmul", "matmul_left", "gemm_plain"])
@pytest.mark.parametrize("swap", [False, True], ids=["act*up", "up*act"])
def test_two_linears_fuse_into_one_gated_layer(kind, swap):
    m = two_linears(kind=kind, swap=swap)
    plan, specs = check_equivalent(m)
    (chain,) = plan.chains
    assert chain.widths == (K, H, N) and plan.refusals == []
    gated = chain.layers[0]
    assert gated.gated and not chain.layers[1].gated
    assert gated.activation == ex.Op("sigmoid", (ex.X,))
    assert gated.linear.weight.shape == (K, 2 * H)
    assert specs[0].layers[0].gated and "_gsigmoid_" in specs[0].name


def test_weights_are_gate_then_up():
    m = two_linears(kind="matmul", swap=True)
    inits = {t.name: t for t in m.graph.initializer}
    from onnx import numpy_helper
    nodes = {n.name: n for n in m.graph.node}
    wg = numpy_helper.to_array(inits[nodes["gate"].input[1]])
    wu = numpy_helper.to_array(inits[nodes["up"].input[1]])
    (chain,) = find_chains(m).chains
    np.testing.assert_array_equal(chain.layers[0].linear.weight, np.concatenate([wg, wu], axis=1))


def test_bias_on_one_projection_only_is_zeros_for_the_other():
    plan, specs = check_equivalent(two_linears(kind="matmul", gate_bias=False))
    b = plan.chains[0].layers[0].linear.bias
    assert b.shape == (2 * H,) and not b[:H].any() and b[H:].any()


def test_bilinear_glu_without_activation():
    plan, specs = check_equivalent(two_linears(act=None))
    assert plan.chains[0].layers[0].gated and plan.chains[0].activations[0] == ex.identity()
    assert "_gid_" in specs[0].name


@pytest.mark.parametrize("form", ["split", "slice"])
@pytest.mark.parametrize("gate_half", [0, 1], ids=["gate-first", "gate-last"])
def test_one_linear_cut_in_two(form, gate_half):
    m = cut(gate_half=gate_half, form=form)
    plan, specs = check_equivalent(m)
    (chain,) = plan.chains
    assert chain.widths == (K, H, N) and plan.refusals == [], plan.describe()
    assert chain.layers[0].gated and chain.layers[0].linear.weight.shape == (K, 2 * H)


@pytest.mark.parametrize("opset", [11, 13], ids=["split-attribute", "split-input"])
def test_split_sizes_as_attribute_or_input(opset):
    g = G(opset=opset, seed=1)
    h = g.op("Gemm", ["x", g.weight(2 * H, K), g.vec(2 * H)], transB=1)
    if opset < 13:
        a, b = g.op("Split", [h], outputs=2, axis=1, split=[H, H])
    else:
        a, b = g.op("Split", [h, g.init(np.array([H, H], np.int64))], outputs=2, axis=-1)
    p = g.op("Mul", [g.op("Tanh", [a]), b])
    g.op("Gemm", [p, g.weight(N, H)], outputs=["y"], transB=1)
    plan, _ = check_equivalent(g.model([("x", ["B", K])], [("y", ["B", N])]))
    assert plan.chains[0].activation_labels() == ["gated tanh", "id"]


def test_gated_layers_continue_chains():
    """x -> fc0 relu -> gated (two linears) -> gated (cut) -> fc -> y: one chain of four layers."""
    g = G(opset=20, seed=2)  # Gelu
    h = g.op("Relu", [g.linear("x", K, 10)])
    gate, up = g.linear(h, 10, H), g.linear(h, 10, H)
    h = g.op("Mul", [g.op("Sigmoid", [gate]), up])
    a, b = g.op("Split", [g.linear(h, H, 2 * 5)], outputs=2, axis=-1, num_outputs=2)
    h = g.op("Mul", [a, g.op("Gelu", [b])])
    g.op("Gemm", [h, g.weight(N, 5)], outputs=["y"], transB=1)
    m = g.model([("x", ["B", K])], [("y", ["B", N])])
    plan, specs, _ = fuse(m)
    (chain,) = plan.chains
    assert chain.widths == (K, 10, H, 5, N) and plan.refusals == []
    assert [l.gated for l in chain.layers] == [False, True, True, False]
    assert chain.activation_labels() == ["relu", "gated sigmoid", "gated gelu", "id"]
    x = np.random.default_rng(1).standard_normal((3, K)).astype(np.float32)
    np.testing.assert_allclose(run(fuse(m)[2], {"x": x})[0], run(m, {"x": x})[0], rtol=1e-5, atol=1e-5)


def test_product_with_two_consumers_ends_the_chain_after_the_gated_layer():
    g = G(opset=17, seed=6)
    p = g.op("Mul", [g.op("Sigmoid", [g.linear("x", K, H)]), g.linear("x", K, H)], outputs=["p"])
    g.op("Gemm", [p, g.weight(N, H)], name="down", outputs=["y"], transB=1)
    m = g.model([("x", ["B", K])], [("y", ["B", N]), ("p", ["B", H])])
    plan = find_chains(m)
    assert [c.widths for c in plan.chains] == [(K, H), (H, N)]
    assert [r.reason for r in plan.refusals] == ["chain 0 ends: output of layer 1 ('p') is also a graph output"]


# -- both exporters (the zoo: models/build_zoo.py) ---------------------------------------------------

@pytest.mark.parametrize("name,labels", [("swiglu", ["gated silu", "id"]), ("geglu", ["gated gelu", "id"])])
@pytest.mark.parametrize("kind", ["dynamo", "opset17"])
def test_zoo_exports_are_one_gated_chain(name, labels, kind):
    entry = ZOO[name]
    m = load_model(str(MODELS / entry["files"][kind]["file"]))
    plan = find_chains(m)
    (chain,) = plan.chains
    assert list(chain.widths) == entry["widths"] and plan.refusals == []
    assert chain.activation_labels() == labels
    assert len(chain.nodes) == sum(1 for n in m.graph.node if n.op_type != "Constant")  # Shape maths too


@pytest.mark.parametrize("dynamo", [True, False], ids=["dynamo", "opset17"])
def test_timm_glumlp_gate_last_from_torch(dynamo, tmp_path):
    """timm's GluMlp default (gate_last): x1 * act(x2), the activation on the second half of chunk."""
    torch = pytest.importorskip("torch")
    if dynamo:
        pytest.importorskip("onnxscript")

    class GluMlp(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = torch.nn.Linear(K, 2 * H), torch.nn.Linear(H, N)

        def forward(self, x):
            x1, x2 = self.fc1(x).chunk(2, dim=-1)
            return self.fc2(x1 * torch.nn.functional.silu(x2))

    path = tmp_path / "glu.onnx"
    torch.manual_seed(0)
    kw = (dict(dynamo=True, dynamic_shapes=({0: torch.export.Dim("B")},)) if dynamo else
          dict(dynamo=False, opset_version=17, dynamic_axes={"x": {0: "B"}}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(GluMlp().eval(), (torch.randn(3, K),), str(path), input_names=["x"],
                          output_names=["y"], **kw)
    m = load_model(str(path))
    plan, specs, fused = fuse(m)
    assert [c.activation_labels() for c in plan.chains] == [["gated silu", "id"]] and plan.refusals == []
    x = np.random.default_rng(2).standard_normal((5, K)).astype(np.float32)
    np.testing.assert_allclose(run(fused, {"x": x})[0], run(m, {"x": x})[0], rtol=1e-5, atol=1e-5)


# -- near misses: one line each, in the chain-end style of test_split_reasons -------------------------

def _reasons(m) -> list[str]:
    return [r.reason for r in find_chains(m).refusals]


NEAR_MISSES = {
    "different inputs": (lambda: two_linears(up_input="z"), [
        "chain 0 ends: output of layer 1 ('sigmoid_out{}') feeds Mul 'mul', not a gated layer: the two linear "
        "layers read different inputs ('x' and 'z')",
        "chain 1 ends: output of layer 1 ('gemm_out{}') feeds Mul 'mul', not a gated layer: the two linear layers read "
        "different inputs ('x' and 'z')"]),
    "different widths": (lambda: two_linears(up_width=1), [
        "chain 0 ends: output of layer 1 ('sigmoid_out{}') feeds Mul 'mul', not a gated layer: the two linear "
        "layers have different widths (6 and 1)",
        "chain 1 ends: output of layer 1 ('gemm_out{}') feeds Mul 'mul', not a gated layer: the two linear layers have "
        "different widths (6 and 1)"]),
    "activation used elsewhere": (lambda: two_linears(extra_user=True), [
        "chain 0 ends: output of layer 1 ('sigmoid_out{}') is also a graph output",
        "chain 1 ends: output of layer 1 ('gemm_out{}') feeds Mul 'mul', not a gated layer: the operand "
        "'sigmoid_out{}' is also a graph output"]),
    "activation on both halves": (lambda: cut(both=True), [
        "chain 0 ends: output of layer 1 ('gemm_out{}') feeds Split 'split', not a gated layer: both operands "
        "have an activation (sigmoid on 'split_out{}', sigmoid on 'split_out{}'); a gated layer activates one"]),
    "unequal halves": (lambda: cut(sizes=(5, 1), opset=17), [
        "chain 0 ends: output of layer 1 ('gemm_out{}') feeds Split 'split', not a gated layer: the halves are "
        "unequal (5 and 1 of 6 columns)"]),
    "not the last axis": (lambda: cut(axis=0), [
        "chain 0 ends: output of layer 1 ('gemm_out{}') feeds Split 'split', not a gated layer: Split 'split' "
        "cuts axis 0, not the last (feature) axis"]),
    "activation before the cut": (lambda: cut(pre_act=lambda g, h: g.op("Relu", [h], name="relu")), [
        "chain 0 ends: output of layer 1 ('relu_out{}') feeds Split 'split', not a gated layer: the layer's "
        "activation (relu) comes before the cut; a gated layer cuts the linear output"]),
    "opset 9": (lambda: two_linears(opset=9), [
        "chain 0 ends: output of layer 1 ('sigmoid_out{}') feeds Mul 'mul', not a gated layer: the model's "
        "opset 9 has no Slice with input bounds, which the stock body of a gated layer needs (opset >= 10)",
        "chain 1 ends: output of layer 1 ('gemm_out{}') feeds Mul 'mul', not a gated layer: the model's opset 9 has no "
        "Slice with input bounds, which the stock body of a gated layer needs (opset >= 10)"]),
}


def _fill(pattern: str, got: str) -> bool:
    """`pattern` with each {} standing for a number (generated tensor names)."""
    import re
    return re.fullmatch(re.escape(pattern).replace(r"\{\}", r"\d+"), got) is not None


@pytest.mark.parametrize("name", sorted(NEAR_MISSES))
def test_near_miss_says_why(name, tmp_path):
    import onnx
    import onnx2fused
    build, want = NEAR_MISSES[name]
    m = build()
    got = _reasons(m)
    assert len(got) == len(want) and all(any(_fill(w, r) for r in got) for w in want), got
    assert not any(c.layers[0].gated for c in find_chains(m).chains)
    path = tmp_path / "m.onnx"
    onnx.save(m, str(path))
    res = onnx2fused.inspect(str(path), precision="fp32", with_cuda=False)
    assert res.refusals == got


# -- a library with CUDA kernels fuses them too (resident/streamed), splits them where no fused kernel can --

def test_gated_refusal_is_decided_by_the_library_kind():
    assert gated_refusal(False) is None
    assert gated_refusal(True) is None   # no chain that the fused CUDA kernels cannot hold


@pytest.mark.parametrize("name", ["swiglu", "geglu"])
@pytest.mark.parametrize("kind", ["dynamo", "opset17"])
def test_cuda_library_fuses_gated_blocks(name, kind):
    entry = ZOO[name]
    m = load_model(str(MODELS / entry["files"][kind]["file"]))
    plan = find_fusions(m, True)
    (chain,) = plan.chains
    assert chain.activation_labels()[0].startswith("gated ")
    for precision in ("fp16", "bf16", "tf32"):   # swiglu's and geglu's gated layers (>= 128): wgmma on Hopper (16-bit only)
        plan = make_plan(chain.to_spec(precision))
        wgmma = precision != "tf32"
        assert plan.design == "wgmma" if wgmma else plan.design in ("resident", "streamed"), plan.describe()
        if wgmma:
            assert plan.fallback.design in ("resident", "streamed")


# the wide design unavailable (no CUTLASS headers on the host)
NO_WIDE = PlanOptions(wide_unavailable="no CUTLASS headers (test)")


def _big_gated():
    """x [B, 256] -> SwiGLU of 4096 -> 256: no fused CUDA kernel holds it (the streamed design's 16-row tile
    of hidden rows does not fit shared memory at fp16); the wide design does, where CUTLASS can be found."""
    g = G(opset=17, seed=3)
    k, h = 256, 4096
    gate = g.linear("x", k, h, kind="matmul", bias=False, name="gate")
    up = g.linear("x", k, h, kind="matmul", bias=False, name="up")
    p = g.op("Mul", [g.op("Sigmoid", [gate]), up], name="mul")
    g.op("Gemm", [p, g.weight(k, h), g.vec(k)], name="down", outputs=["y"], transB=1)
    return g.model([("x", ["B", k])], [("y", ["B", k])])


def test_cuda_library_splits_gated_chains_no_cuda_design_holds():
    """Without the wide design, no CUDA kernel holds the big SwiGLU: its gate, up and down split, each
    fusing on its own, and every split says why."""
    m = _big_gated()
    assert any(l.gated for c in find_chains(m).chains for l in c.layers)   # CPU-only: fused
    why = gated_refusal(True, find_chains(m).chains, NO_WIDE)
    assert why is not None and why.startswith("gated layer: no CUDA kernel holds its chain (")
    assert "the wide design cannot take it either: no CUTLASS headers (test)" in why
    plan = find_fusions(m, True, NO_WIDE)
    assert not any(l.gated for c in plan.chains for l in c.layers)
    reasons = [r.reason for r in plan.refusals]
    assert reasons and all(r.endswith(": " + why) for r in reasons), reasons
    assert all(make_plan(c.to_spec("fp16"), NO_WIDE) is not None for c in plan.chains)  # each piece has a plan


def test_cuda_library_fuses_big_gated_chains_in_the_wide_design():
    """With the wide design, the big SwiGLU is ONE gated chain (LLaMA's MLP shape): a GEMM of the gate and
    up columns, the glu pass, the down GEMM; at tf32, which no design plans, automatic precision skips to
    fp32 (CUDA cores) instead of failing (convert.plannable)."""
    from onnx2fused.convert import plannable
    from onnx2fused.precision import PrecisionChoice
    m = _big_gated()
    wide = PlanOptions(wide_unavailable="")
    assert gated_refusal(True, find_chains(m).chains, wide) is None
    plan = find_fusions(m, True, wide)
    (chain,) = plan.chains
    assert plan.refusals == [] and chain.activation_labels()[0].startswith("gated ")
    p = make_plan(chain.to_spec("fp16"), wide)
    assert p.design == "wide" and [g.gated for g in p.gemms] == [True, False]
    assert "gated layer 0 as one GEMM of gate and up columns and a glu pass" in p.describe()
    assert plannable(chain, PrecisionChoice("bf16", "test"), wide).precision == "bf16"
    up = plannable(chain, PrecisionChoice("tf32", "test"), wide)
    assert up.precision == "fp32" and up.why.startswith("tf32 has no CUDA plan (") and up.why.endswith("; test")


@pytest.mark.parametrize("name", ["swiglu", "geglu"])
def test_find_chains_splits_gated_blocks_when_refused(name):
    entry = ZOO[name]
    m = load_model(str(MODELS / entry["files"]["opset17"]["file"]))
    why = GATED_NO_CUDA.format(why="test")
    plan = find_chains(m, gated_refused=why)
    assert not any(l.gated for c in plan.chains for l in c.layers)
    k, h, n = entry["widths"]
    if name == "swiglu":   # gate, up, down: three one-layer chains, as before issue 16
        assert sorted(c.widths for c in plan.chains) == sorted([(k, h), (k, h), (h, n)])
    else:                  # fc1 (2H), fc2
        assert sorted(c.widths for c in plan.chains) == sorted([(k, 2 * h), (h, n)])
    reasons = [r.reason for r in plan.refusals]
    assert reasons and all(r.endswith(": " + why) for r in reasons), reasons


def test_inspect_with_cuda_fuses_the_block(tmp_path):
    import onnx2fused
    res = onnx2fused.inspect(str(MODELS / ZOO["swiglu"]["files"]["opset17"]["file"]), precision="fp16",
                             with_cuda=True)
    assert len(res.chains) == 1 and res.chains[0].activations == ["gated silu", "id"]
    assert "streamed weights" in res.chains[0].cuda_plan   # 512 GEMM columns (gate and up of 256)
    cpu = onnx2fused.inspect(str(MODELS / ZOO["swiglu"]["files"]["opset17"]["file"]), precision="fp16",
                             with_cuda=False)
    assert len(cpu.chains) == 1 and cpu.chains[0].activations == ["gated silu", "id"]


def test_plan_takes_a_gated_spec():
    spec = MLPSpec((LayerSpec(K, H, True, ex.silu(), gated=True), LayerSpec(H, N, True, ex.identity())))
    plan = make_plan(spec)
    assert plan.design == "resident" and plan.layers[0].gated and plan.layers[0].cols == 2 * plan.layers[0].np_
    # wgmma: it could run it, but a gated layer of < 128 outputs does not win (tests/test_wgmma_plan.py)
    assert H < 128 and wgmma_refused(spec) is None and "no hidden layer of >= 128 outputs (mma.sync" in wgmma_note(spec, plan)
    assert wide_reason_refused(replace(spec, precision="bf16")) is None
    glu_head = MLPSpec((LayerSpec(K, H, True, ex.identity()), LayerSpec(H, N, True, ex.silu(), gated=True)))
    assert "gated last layer" in wide_reason_refused(glu_head)



# -- the spec --------------------------------------------------------------------------------------

def test_gated_spec_name_and_sizes():
    plain = MLPSpec((LayerSpec(K, H, True, ex.silu()), LayerSpec(H, N, True, ex.identity())))
    gated = MLPSpec((LayerSpec(K, H, True, ex.silu(), gated=True), LayerSpec(H, N, True, ex.identity())))
    assert plain.name.startswith(f"FusedMLP_{K}x{H}x{N}_silu_id_fp16_f32_")
    assert gated.name.startswith(f"FusedMLP_{K}x{H}x{N}_gsilu_id_fp16_f32_") and gated.name != plain.name
    assert ":gated" in gated.key_text() and "gated" not in plain.key_text()
    assert gated.flops_per_row == 2 * K * 2 * H + 2 * H * N
    assert gated.num_parameters == K * 2 * H + 2 * H + H * N + N
    assert gated.has_gated and not plain.has_gated
