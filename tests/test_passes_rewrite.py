"""Rewrite: one onnx2fused node per chain, fallback function runs in plain ORT and matches."""
import numpy as np
import onnx
import pytest

from onnx2fused.passes import find_chains, rewrite
from onnx2fused.spec import DOMAIN
from onnx_builders import F16, G, mlp, rand, run
from test_passes_activations import CASES


def fuse(m, precision="fp32"):
    plan = find_chains(m)
    specs = [c.to_spec(precision) for c in plan.chains]
    return plan, specs, rewrite(m, plan, specs)


def check_fused(m, x, plan, specs, r, tol=1e-5):
    onnx.checker.check_model(r, full_check=True)
    assert r.ir_version == m.ir_version
    assert onnx.helper.make_opsetid(DOMAIN, 1) in r.opset_import
    fused = [n for n in r.graph.node if n.domain == DOMAIN]
    assert len(fused) == len(plan.chains)
    assert {f.name for f in r.functions} == {s.name for s in specs}
    removed = {k for c in plan.chains for k in c.nodes}
    orig = {n.name: n.SerializeToString() for n in m.graph.node}
    for n in r.graph.node:
        if n.domain != DOMAIN and n.name in orig:
            assert n.SerializeToString() == orig[n.name], n.name  # untouched nodes: byte-identical
        assert n.name not in removed
    for n, spec, c in zip(fused, specs, plan.chains):
        assert n.op_type == spec.name and list(n.output) == [c.output] and n.input[0] == c.input
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
        assert attrs["widths"] == list(spec.widths) and len(attrs["activations"]) == len(spec.layers)
    a, b = run(m, {"x": x}), run(r, {"x": x})
    for u, v in zip(a, b):
        np.testing.assert_allclose(v.astype(np.float32), u.astype(np.float32), rtol=tol, atol=tol)
    # initializers that only the chains used are gone; the new weights are all used
    used = {i for n in r.graph.node for i in n.input}
    assert all(t.name in used for t in r.graph.initializer)


@pytest.mark.parametrize("kw,shape", [
    (dict(widths=[8, 16, 16, 4]), [5, 8]),
    (dict(widths=[8, 16, 16, 4], kind="gemm_plain", act="Tanh", last_act=True), [5, 8]),
    (dict(widths=[8, 16, 4], kind="matmul", rank=3, act="Gelu", opset=20, ir=10), [2, 3, 8]),
    (dict(widths=[8, 16, 4], kind="matmul_left", act="Sigmoid", last_act=True), [5, 8]),
    (dict(widths=[8, 16, 4], kind="matmul", bias=False, act="LeakyRelu", alpha=0.2), [5, 8]),
    (dict(widths=[8, 12, 4], kind="matmul", rank=4, act="Elu"), [2, 2, 3, 8]),
    (dict(widths=[8, 16, 4], kind="gemm", act="HardSwish", opset=14, ir=7), [5, 8]),
])
def test_rewrite_runs_in_plain_ort(kw, shape):
    m = mlp(**kw)
    plan, specs, r = fuse(m)
    assert len(plan.chains) == 1
    assert [n.op_type for n in r.graph.node] == [specs[0].name]
    check_fused(m, rand(shape), plan, specs, r)


def test_rewrite_f16_model():
    m = mlp([8, 16, 4], kind="matmul", elem=F16)
    plan, specs, r = fuse(m, "fp16")
    assert specs[0].io_dtype == "f16"
    check_fused(m, rand([5, 8], dtype=np.float16), plan, specs, r, tol=2e-2)


@pytest.mark.parametrize("name", sorted(CASES))
def test_fallback_emits_every_activation(name):
    build, opset, _ = CASES[name]
    g = G(opset=opset)
    h = build(g, g.linear("x", 6, 6, name="fc0", kind="matmul"))
    g.op("MatMul", [h, g.weight(6, 3)], name="fc1", outputs=["y"])
    m = g.model([("x", ["B", 6])], [("y", ["B", 3])])
    plan, specs, r = fuse(m)
    assert len(plan.chains) == 1 and plan.chains[0].widths == (6, 6, 3), plan.describe()
    assert [n.op_type for n in r.graph.node] == [specs[0].name]  # Constant producers dropped too
    check_fused(m, rand([16, 6], seed=5), plan, specs, r, tol=2e-5)


def test_untouched_parts_kept_and_order():
    g = G()
    pre = g.op("Softmax", ["x"], name="pre")
    h = g.op("Relu", [g.linear(pre, 8, 16, name="fc0")], name="r0")
    mid = g.op("Softmax", [g.linear(h, 16, 16, name="fc1")], name="mid")
    shared = g.weight(16, 4, name="shared_w")
    g.op("MatMul", [mid, shared], name="fc2", outputs=["y1"])
    g.op("Gemm", [mid, "wv"], name="fcv", outputs=["y2"])  # non-constant weight: refused, untouched
    g.op("MatMul", [g.op("Exp", [mid], name="e"), shared], name="fc3", outputs=["y3"])
    m = g.model([("x", ["B", 8]), ("wv", [16, 2])], [("y1", ["B", 4]), ("y2", ["B", 2]), ("y3", ["B", 4])])
    plan, specs, r = fuse(m)
    assert [c.widths for c in plan.chains] == [(8, 16, 16), (16, 4), (16, 4)]
    assert [rf.reason for rf in plan.refusals] == [  # the Softmax between layers splits chain 0 from the rest
        "chain 0 ends: output of layer 2 ('gemm_out8') feeds Softmax 'mid': Softmax normalises across the row, "
        "not elementwise",
        "Gemm 'fcv': weight 'wv' is not a constant"]
    ops = [(n.op_type if n.domain != DOMAIN else "F") for n in r.graph.node]
    assert ops == ["Softmax", "F", "Softmax", "F", "Gemm", "Exp", "F"]
    assert "shared_w" not in {t.name for t in r.graph.initializer}
    assert len({f.name for f in r.functions}) == 2  # the two 16->4 chains share one spec and function
    feeds = {"x": rand([3, 8]), "wv": rand([16, 2], seed=9)}
    onnx.checker.check_model(r, full_check=True)
    for u, v in zip(run(m, feeds), run(r, feeds)):
        np.testing.assert_allclose(v, u, rtol=1e-5, atol=1e-5)


def test_constant_node_weights_and_shared_initializer_kept():
    g = G()
    w = g.const_node(g.rng.standard_normal((8, 4)).astype(np.float32), "wk")
    s = g.weight(8, 4, name="shared")
    g.op("MatMul", ["x", w], name="mm", outputs=["y"])
    g.op("MatMul", [g.op("Transpose", ["x"], name="tr", perm=[0, 1]), s], name="mm2", outputs=["y2"])
    m = g.model([("x", ["B", 8])], [("y", ["B", 4]), ("y2", ["B", 4])])
    plan, specs, r = fuse(m)
    assert len(plan.chains) == 2
    assert "Constant" not in [n.op_type for n in r.graph.node]
    assert "shared" not in {t.name for t in r.graph.initializer}
    onnx.checker.check_model(r, full_check=True)
    x = rand([3, 8])
    for u, v in zip(run(m, {"x": x}), run(r, {"x": x})):
        np.testing.assert_allclose(v, u, rtol=1e-5, atol=1e-5)


def test_value_info_added_and_input_model_unchanged():
    m = mlp([8, 16, 4])
    before = m.SerializeToString()
    g = G()
    h = g.op("Relu", [g.linear("x", 8, 16, name="fc0")], name="r0", outputs=["h"])
    g.op("Softmax", [h], name="sm", outputs=["y"])
    m2 = g.model([("x", ["B", 8])], [("y", ["B", 16])])
    _, _, r = fuse(m2)
    vi = {v.name: v for v in r.graph.value_info}
    assert "h" in vi and [d.dim_param or d.dim_value for d in vi["h"].type.tensor_type.shape.dim] == ["B", 16]
    fuse(m)
    assert m.SerializeToString() == before


def test_spec_count_mismatch_is_an_error():
    from onnx2fused.errors import ConversionError
    m = mlp([8, 4])
    with pytest.raises(ConversionError, match="rewrite got 0 specs for 1 chains"):
        rewrite(m, find_chains(m), [])
