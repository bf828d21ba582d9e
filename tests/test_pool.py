"""A pool over the rows taken into the chain in front of it (passes/pool.py, spec.pool): which ReduceMax,
ReduceSum and ReduceMean nodes it takes and why it leaves the others, and the fused op's three CPU paths
against stock ORT: the model-local function (no plugin), the generated C++ kernel and the stock body (the
plugin pooling their rows), at groups of 1, 37 and 0 rows, float32 and float16."""
from __future__ import annotations

import numpy as np
import onnx
import pytest

from onnx2fused.library import build_plugin
from onnx2fused.passes import find_chains, rewrite
from onnx_builders import F16, G, assert_close, plugin_session, rand, run


POOL_OPS = {"max": "ReduceMax", "sum": "ReduceSum", "mean": "ReduceMean"}


def pooled_mlp(widths, axes=(-2,), keepdims=0, opset=17, rank=3, elem=None, extra_reader=False, seed=0,
               op="ReduceMax"):
    """x [b, m, K0] (rank 3; rank 4: [b, c, m, K0]) -> linear + ReLU ... linear -> op(axes) -> y (the Reduce's
    axes an input from opset 18, ReduceSum's from 13)."""
    g = G(opset=opset, seed=seed)
    dtype = np.float16 if elem == F16 else np.float32
    h = "x"
    for i, (k, n) in enumerate(zip(widths, widths[1:])):
        h = g.linear(h, k, n, kind="matmul", name=f"fc{i}", dtype=dtype)
        if i < len(widths) - 2:
            h = g.op("Relu", [h])
    lead = ["b", "m"] if rank == 3 else ["b", "c", "m"]
    rows_axis = list(axes) in ([-2], [rank - 2])
    outs = [("y", lead[:-1] + [1] * keepdims + [widths[-1]] if rows_axis else None)]
    if extra_reader:
        g.op("Identity", [h], outputs=["rows"])
        outs.append(("rows", lead + [widths[-1]]))
    axes_input = opset >= (13 if op == "ReduceSum" else 18)
    ins = [h] + ([g.init(np.array(axes, dtype=np.int64))] if axes_input else [])
    attrs = {"keepdims": keepdims} | ({} if axes_input else {"axes": list(axes)})
    g.op(op, ins, outputs=["y"], name="pool", **attrs)
    kw = {"elem": elem} if elem is not None else {}
    return g.model([("x", lead + [widths[0]])], outs, check=outs[0][1] is not None, **kw)


@pytest.mark.parametrize("kind", POOL_OPS)
@pytest.mark.parametrize("opset,axes", [(12, (1,)), (17, (-2,)), (17, (1,)), (18, (-2,)), (20, (1,))])
def test_the_pool_joins_the_chain(opset, axes, kind):
    m = pooled_mlp([6, 16, 5], axes=axes, opset=opset, op=POOL_OPS[kind])
    plan = find_chains(m)
    (chain,) = plan.chains
    assert chain.pool == kind and chain.output == "y" and chain.rows_output != "y"
    assert f"_pool{kind}_" in chain.to_spec("fp32").name and plan.refusals == []
    assert f"the {POOL_OPS[kind]} behind it ({kind} over the rows, axis -2)" in plan.describe()
    fused = rewrite(m, plan, [chain.to_spec("fp32")])
    assert [n.op_type for n in fused.graph.node] == [chain.to_spec("fp32").name]
    for shape in ([2, 37, 6], [3, 1, 6]):   # the function inlined: its Reduce over axis -2
        x = rand(shape)
        assert_close(run(fused, {"x": x})[0], run(m, {"x": x})[0], 1e-5)
    empty = run(fused, {"x": rand([1, 0, 6])})[0]   # the pool of no rows: -inf, or 0 (ORT's mean too)
    assert empty.shape == (1, 5) and np.array_equal(empty, run(m, {"x": rand([1, 0, 6])})[0])


@pytest.mark.parametrize("kw,why", [
    (dict(axes=(-1,)), "pools axes [-1], not the rows' axis 1 alone"),
    (dict(axes=(0, 1)), "pools axes [0, 1]"),
])
def test_other_reducemax_stay_stock_and_say_why(kw, why):
    m = pooled_mlp([6, 16, 5], **kw)
    plan = find_chains(m)
    (chain,) = plan.chains
    assert chain.pool == "" and chain.output != "y"
    assert any(r.reason.startswith("chain 0 ends: ") and why in r.reason for r in plan.refusals), plan.describe()


def test_a_second_reader_keeps_the_rows():
    plan = find_chains(pooled_mlp([6, 16, 5], extra_reader=True))
    assert plan.chains[0].pool == ""


def test_two_pools_of_one_output_stay_stock_and_say_why():
    """DGCNN's max and mean of the same tensor: the op writes one pool, so both stay, with the reason."""
    m = pooled_mlp([6, 16, 5])
    h = m.graph.node[-1].input[0]
    m.graph.node.append(onnx.helper.make_node("ReduceMean", [h], ["z"], axes=[-2], keepdims=0, name="mean"))
    m.graph.output.append(onnx.helper.make_tensor_value_info("z", onnx.TensorProto.FLOAT, None))
    plan = find_chains(m)
    assert plan.chains[0].pool == ""
    assert any("2 pools of one output; the op takes one pool only" in r.reason for r in plan.refusals), plan.describe()


def test_a_reducesum_of_no_axes_that_does_nothing_stays_stock_and_says_why():
    m = pooled_mlp([6, 16, 5], op="ReduceSum", opset=13, axes=())
    m.graph.node[-1].attribute.append(onnx.helper.make_attribute("noop_with_empty_axes", 1))
    del m.graph.node[-1].input[1:]
    plan = find_chains(m)
    assert plan.chains[0].pool == ""
    assert any("noop_with_empty_axes=1 (an identity, not a pool)" in r.reason for r in plan.refusals), plan.describe()


def test_reducemin_is_no_pool():
    m = pooled_mlp([6, 16, 5])
    m.graph.node[-1].op_type = "ReduceMin"
    assert find_chains(m).chains[0].pool == ""


@pytest.mark.parametrize("kind,keepdims", [("max", 0), ("max", 1), ("sum", 0), ("mean", 1)])
@pytest.mark.parametrize("elem", [None, F16], ids=["f32", "f16"])
@pytest.mark.parametrize("widths", [[6, 16, 5], [40, 600, 600, 7]], ids=["cpu_kernel", "stock_body"])
def test_cpu_paths_pool_like_stock(widths, elem, kind, keepdims, tmp_path):
    """[6, 16, 5]: the generated C++ kernel; 40 -> 600 -> 600 -> 7 (1.5 MiB of weights): the CPU policy
    runs the stock body in the plugin. Both pool their rows in the plugin; fused nodes only (no function).
    keepdims=1 (fxia22's PointNet: torch.max(x, 2, keepdim=True)): the op keeps the pooled axis as 1.
    Sums and means add in float (float16 rows widened); a group of no rows is -inf (max) or 0."""
    m = pooled_mlp(widths, elem=elem, rank=4, keepdims=keepdims, op=POOL_OPS[kind])
    plan = find_chains(m)
    specs = [c.to_spec("fp32") for c in plan.chains]
    assert specs[0].pool == kind + ("k" if keepdims else "")
    lib = build_plugin(specs, with_cuda=False, cache_dir=tmp_path)
    fused = rewrite(m, plan, specs)
    del fused.functions[:]   # the plugin must run the node
    sess = plugin_session(fused, lib.path)
    dtype = np.float16 if elem == F16 else np.float32
    for shape in ([2, 3, 37, widths[0]], [1, 2, 1, widths[0]], [2, 1, 0, widths[0]], [0, 2, 5, widths[0]]):
        x = rand(shape, scale=1.0, dtype=dtype)
        got, ref = sess.run(None, {"x": x})[0], run(m, {"x": x})[0]
        assert got.shape == ref.shape == tuple(shape[:2] + [1] * keepdims + [widths[-1]])
        if ref.size:
            assert np.array_equal(np.isneginf(got), np.isneginf(ref))
            finite = np.isfinite(ref)
            tol = (2e-3 if elem else 1e-5) * (4 if kind != "max" else 1)   # (sums: rounding adds up)
            assert_close(got[finite].astype(np.float32), ref[finite].astype(np.float32), tol)


def test_plugin_rejects_rank2_input_to_a_pooled_op(tmp_path):
    m = pooled_mlp([6, 16, 5])
    plan = find_chains(m)
    specs = [c.to_spec("fp32") for c in plan.chains]
    lib = build_plugin(specs, with_cuda=False, cache_dir=tmp_path)
    fused = rewrite(m, plan, specs)
    del fused.functions[:]
    fused.graph.input[0].type.tensor_type.shape.ClearField("dim")
    sess = plugin_session(fused, lib.path)
    with pytest.raises(Exception, match=r"rank >= 3: the op pools over axis -2"):
        sess.run(None, {"x": rand([4, 6])})


def test_spec_refuses_a_pool_with_a_residual():
    from onnx2fused.spec import LayerSpec, MLPSpec, SpecError
    from onnx2fused import expr as ex
    layers = (LayerSpec(8, 8, True, ex.identity()),)
    assert MLPSpec(layers, pool="max").name.count("_poolmax_") == 1
    with pytest.raises(SpecError, match="pool after a residual"):
        MLPSpec(layers, residual=True, pool="max")
    assert MLPSpec(layers, pool="meank").describe().endswith(", mean over rows (kept axis)")
    with pytest.raises(SpecError, match="unknown pool"):
        MLPSpec(layers, pool="min")
    assert onnx is not None


@pytest.mark.parametrize("kind", ["max", "mean"])
@pytest.mark.parametrize("elem", [None, F16], ids=["f32", "f16"])
@pytest.mark.parametrize("widths", [[6, 16, 300], [40, 600, 600, 300]], ids=["cpu_kernel", "stock_body"])
def test_cpu_pool_over_threads_and_column_blocks(widths, elem, kind, tmp_path):
    """Enough rows and columns (3 x 2 groups of 150 rows, 300 columns) that the work spreads over the
    session's threads: the generated kernel in tasks of a group's rows, each pooled in cache into a partial
    max (sum), the partials then combined; the stock body's rows pooled a group and block of 256 columns a
    task."""
    m = pooled_mlp(widths, elem=elem, rank=4, op=POOL_OPS[kind])
    plan = find_chains(m)
    specs = [c.to_spec("fp32") for c in plan.chains]
    lib = build_plugin(specs, with_cuda=False, cache_dir=tmp_path)
    fused = rewrite(m, plan, specs)
    del fused.functions[:]
    sess = plugin_session(fused, lib.path)
    x = rand([3, 2, 150, widths[0]], scale=1.0, dtype=np.float16 if elem == F16 else np.float32)
    got, ref = sess.run(None, {"x": x})[0], run(m, {"x": x})[0]
    assert got.shape == ref.shape == (3, 2, 300)
    assert_close(got.astype(np.float32), ref.astype(np.float32), 2e-3 if elem else 1e-5)


@pytest.mark.parametrize("pool,dynamo", [("sum", False), ("mean", False), ("sum", True)])
def test_deep_sets_pool_joins_its_phi_network(pool, dynamo, tmp_path):
    """Deep Sets (benchmarks/deepsets.py: phi 3 -> 256 x 3 with ReLU, the sum or mean over the set, rho 256 ->
    256 -> 40) from both exporters: phi and its ReduceSum / ReduceMean one op, rho a second chain; converted
    CPU-only (the generated kernels), matching torch at another batch."""
    import sys
    from pathlib import Path
    import torch
    import onnx2fused
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from deepsets import DeepSets, export
    torch.manual_seed(4)
    module = DeepSets(pool)
    src = export(module, tmp_path / "ds.onnx", points=40, dynamo=dynamo)
    res = onnx2fused.convert(src, tmp_path / "ds.fused.onnx", cache_dir=tmp_path / "cache", with_cuda=False)
    assert [list(c.widths) for c in res.chains] == [[3, 256, 256, 256], [256, 256, 40]]
    assert f"_pool{pool}_" in res.chains[0].name and not res.validation.failures
    fused = onnx.load(str(tmp_path / "ds.fused.onnx"))
    assert not {"ReduceSum", "ReduceMean", "MatMul", "Gemm"} & {n.op_type for n in fused.graph.node}
    sess = plugin_session(fused, res.library_path)
    x = rand([3, 40, 3], seed=7, scale=1.0)
    with torch.no_grad():
        want = module(torch.from_numpy(x)).numpy()
    assert_close(sess.run(None, {sess.get_inputs()[0].name: x})[0], want, 1e-4)
