"""Pointwise Convs (kernel 1) as linear layers over channels-last rows (passes/pointwise_conv.py): the
rewritten model computes what the original did on stock ORT, the runs become one chain, pools read the
channels-last rows, Convs of kernel 1 that are not per-position layers say why, and PointNet-style
exports from both torch exporters convert end to end (CPU-only plugin)."""
from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import onnx2fused
from onnx2fused.library import fusion_plan
from onnx2fused.passes import rewrite
from onnx2fused.passes.pointwise_conv import as_channels_last
from onnx2fused.spec import DOMAIN
from onnx_builders import G, assert_close, plugin_session, rand, run

ACTS = {
    "relu": lambda g, t: g.op("Relu", [t]),
    "silu": lambda g, t: g.op("Mul", [t, g.op("Sigmoid", [t])]),
    "gelu": lambda g, t: g.op("Mul", [g.op("Mul", [t, g.op("Add", [g.op("Erf", [g.op("Div", [t, g.init(np.float32(
        np.sqrt(2)))])]), g.init(np.float32(1))])]), g.init(np.float32(0.5))]),
    "leaky": lambda g, t: g.op("LeakyRelu", [t], alpha=0.1),
    "none": lambda g, t: t,
}


def conv_model(widths, acts, rank=3, bias=True, pool=None, opset=17, extra_output=False, seed=0, spatial=None):
    """x [B, C0, *spatial] -> Conv(k=1) -> act -> ... ; `pool`: (op, axes or None, keepdims) after the last
    Conv, else the last tensor is y. extra_output: the first Conv's output is a graph output too. `spatial`:
    static spatial dims (else symbolic)."""
    g = G(opset=opset, seed=seed)
    t = "x"
    ones = [1] * (rank - 2)
    outs = []
    for i, (k, n) in enumerate(zip(widths, widths[1:])):
        w = g.init((g.rng.standard_normal((n, k, *ones)) / np.sqrt(k)).astype(np.float32))
        ins = [t, w] + ([g.vec(n)] if bias else [])
        t = g.op("Conv", ins, kernel_shape=ones, outputs=[f"conv{i}"])
        if extra_output and i == 0:
            outs.append(("conv0", None))
        if i < len(acts):
            t = ACTS[acts[i]](g, t)
    if pool is not None:
        op, axes, keep = pool
        attrs = {"keepdims": keep}
        ins = [t]
        if axes is not None and (opset >= 18 or (op == "ReduceSum" and opset >= 13)):
            ins.append(g.init(np.array(axes, dtype=np.int64)))
        elif axes is not None:
            attrs["axes"] = axes
        t = g.op(op, ins, outputs=["y"], **attrs)
    else:
        t = g.op("Identity", [t], outputs=["y"])
    dims = list(spatial) if spatial is not None else [f"s{j}" for j in range(rank - 2)]
    return g.model([("x", ["b", widths[0]] + dims)], [("y", None)] + outs, check=False)


def _ops(m):
    return [n.op_type for n in m.graph.node]


def _same_outputs(a, b, feeds, tol=1e-5):
    for u, v in zip(run(a, feeds), run(b, feeds)):
        assert_close(v, u, tol)


@pytest.mark.parametrize("rank", [3, 4, 5])
def test_runs_become_one_chain_over_channels_last_rows(rank):
    m = conv_model([5, 16, 12, 3], ["silu", "gelu"], rank=rank)
    res = as_channels_last(m)
    assert _ops(res.model).count("Conv") == 0 and _ops(res.model).count("MatMul") == 3
    assert _ops(res.model)[0] == "Transpose" and "Transpose back" in res.rewritten[0]
    assert "3 pointwise Conv" in res.rewritten[0] and "5 -> 16 -> 12 -> 3 channels" in res.rewritten[0]
    x = rand([2, 5] + [3, 4, 2][:rank - 2])
    _same_outputs(m, res.model, {"x": x})
    model, plan = fusion_plan(m, with_cuda=False)
    assert [c.widths for c in plan.chains] == [(5, 16, 12, 3)] and plan.channels_last == res.rewritten
    fused = rewrite(model, plan, [c.to_spec("fp32") for c in plan.chains])
    assert [n.op_type for n in fused.graph.node] == ["Transpose", plan.chains[0].to_spec("fp32").name, "Transpose"]
    _same_outputs(m, fused, {"x": x})   # the fused node's stock fallback function


# transposes: the one in front, and one of the pooled tensor where keepdims=1 or the kept axes come out of
# the channels-last rows in another order (channels before the spatial axes they were in front of); a pool
# over a whole map reshapes its pooled tensor instead
@pytest.mark.parametrize("pool,opset,rank,transposes", [
    (("ReduceMax", [2], 0), 17, 3, 1), (("ReduceMax", [-1], 0), 18, 3, 1), (("ReduceMax", [2], 1), 13, 3, 2),
    (("ReduceMean", [2, 3], 1), 17, 4, 1), (("ReduceMean", [2, 3], 0), 18, 4, 1), (("ReduceSum", [2], 0), 13, 3, 1),
    (("ReduceMin", [3], 0), 17, 4, 2), (("ReduceMax", None, 0), 17, 3, 1), (("ReduceMean", [1, 3], 0), 17, 4, 1),
])
def test_pools_read_the_channels_last_rows(pool, opset, rank, transposes):
    m = conv_model([4, 8, 6], ["relu"], rank=rank, pool=pool, opset=opset)
    res = as_channels_last(m)
    # (a pool over a whole map reads its positions flattened: the shape's ops, a Reshape of the pooled tensor)
    ops = [o for o in _ops(res.model) if o not in ("Shape", "Gather", "ReduceProd", "Concat", "Reshape")]
    # no full-size Transpose back: the pool reads the channels-last rows
    assert ops[:2] == ["Transpose", "MatMul"] and ops.index(pool[0]) > ops.index("MatMul")
    assert f"{pool[0]} over the channels-last rows" in res.rewritten[0]
    assert ops.count("Transpose") == transposes
    _same_outputs(m, res.model, {"x": rand([3, 4] + [5, 7][:rank - 2])})
    assert not [t for t in res.model.graph.initializer if t.name not in
                {x for n in res.model.graph.node for x in n.input}], "unread initializers left behind"


@pytest.mark.parametrize("pool,spatial", [
    (("ReduceMean", [2, 3], 1), [5, 7]), (("ReduceMean", [-2, -1], 0), [5, 7]), (("ReduceMax", [2, 3], 1), [6, 6]),
    (("ReduceSum", [2, 3, 4], 0), [2, 3, 4]), (("ReduceMean", [2, 3, 4], 1), [3, 1, 5]),
])
def test_a_global_pool_of_a_map_reads_its_positions_flattened_into_the_op(pool, spatial):
    """A pool over every spatial axis of a static 2-D or 3-D map (a CNN head's global average pool): the rows
    are [B, H W, C] (a Reshape after the Transpose in front), the pool is over their axis 1, so the chain takes
    it in (keepdims: the pooled [B, 1, M] reshaped to [B, M, 1, 1]); the same outputs as the original."""
    rank = 2 + len(spatial)
    m = conv_model([4, 8, 6], ["relu"], rank=rank, pool=pool, spatial=spatial)
    res = as_channels_last(m)
    assert _ops(res.model)[:3] == ["Transpose", "Reshape", "MatMul"] and "Transpose" not in _ops(res.model)[1:]
    assert "positions flattened into one axis" in res.rewritten[0]
    feeds = {"x": rand([3, 4] + spatial)}
    _same_outputs(m, res.model, feeds)
    _same_outputs(m, res.model, {"x": rand([0, 4] + spatial)})   # (an empty batch: the Reshapes copy it)
    model, plan = fusion_plan(m, with_cuda=False)
    (chain,) = plan.chains
    assert chain.pool == {"ReduceMean": "mean", "ReduceMax": "max", "ReduceSum": "sum"}[pool[0]] + "k" * pool[2]
    fused = rewrite(model, plan, [chain.to_spec("fp32")])
    assert pool[0] not in _ops(fused)
    _same_outputs(m, fused, feeds)   # the fused node's stock fallback function


@pytest.mark.parametrize("opset,rank", [(13, 4), (18, 4), (17, 5)])
def test_a_global_pool_of_a_map_of_dynamic_size_flattens_by_its_shape(opset, rank):
    """Symbolic spatial dims (a CNN exported for any image size): the Reshape's shape is computed from x's
    (a -1 could not be inferred for an empty batch), so the pool joins the op at any map size, 0 images too."""
    axes = list(range(2, rank))
    m = conv_model([4, 8, 6], ["relu"], rank=rank, pool=("ReduceMean", axes, 1), opset=opset)
    res = as_channels_last(m)
    assert {"Shape", "ReduceProd", "Reshape"} <= set(_ops(res.model)) and "positions flattened" in res.rewritten[0]
    model, plan = fusion_plan(m, with_cuda=False)
    assert plan.chains[0].pool == "meank"
    fused = rewrite(model, plan, [plan.chains[0].to_spec("fp32")])
    for spatial in ([5, 7, 2][:rank - 2], [1, 3, 4][:rank - 2]):
        for b in (2, 0):
            _same_outputs(m, fused, {"x": rand([b, 4] + spatial)})


def test_a_tensor_read_elsewhere_ends_the_run_and_stays_channels_first():
    m = conv_model([4, 8, 8, 8, 2], ["relu", "relu", "relu"], extra_output=True)
    res = as_channels_last(m)
    # conv0 (a graph output) ends the first run, a lone Conv that stays one; the other three are a run
    assert len(res.rewritten) == 1 and "3 pointwise Conv1d" in res.rewritten[0]
    assert [n.op_type for n in res.model.graph.node][:2] == ["Conv", "Relu"]
    _same_outputs(m, res.model, {"x": rand([2, 4, 9])})


def test_per_channel_constants_stay_channels_first():
    g = G()
    ws = [g.init(g.rng.standard_normal(sh).astype(np.float32)) for sh in ((8, 4, 1), (8, 8, 1), (8, 8, 1), (3, 8, 1))]
    h = g.op("Relu", [g.op("Conv", ["x", ws[0]], kernel_shape=[1])])
    h = g.op("Conv", [h, ws[1]], kernel_shape=[1])
    h = g.op("Mul", [g.op("Relu", [h]), g.init(np.linspace(0.5, 2, 8, dtype=np.float32).reshape(8, 1))])
    h = g.op("Relu", [g.op("Conv", [h, ws[2]], kernel_shape=[1])])
    g.op("Conv", [h, ws[3]], kernel_shape=[1], outputs=["y"])
    m = g.model([("x", ["b", 4, "n"])], [("y", None)], check=False)
    res = as_channels_last(m)
    assert len(res.rewritten) == 2   # the [C, 1] Mul between two runs
    mul = next(n for n in res.model.graph.node if n.op_type == "Mul")
    back = next(n for n in res.model.graph.node if n.op_type == "Transpose" and n.output[0] == mul.input[0])
    assert list(back.attribute[0].ints) == [0, 2, 1]   # the Mul still reads channels-first
    _same_outputs(m, res.model, {"x": rand([2, 4, 6])})


@pytest.mark.parametrize("attrs,why", [
    (dict(strides=[2]), "strides [2] skip positions"),
    (dict(pads=[1, 1]), "pads [1, 1] add positions"),
    (dict(group=2), "2 groups, not one linear layer"),
])
def test_kernel_one_convs_that_are_not_layers_say_why(attrs, why):
    g = G()
    cin = 4
    w = g.init(g.rng.standard_normal((6, cin // attrs.get("group", 1), 1)).astype(np.float32))
    g.op("Relu", [g.op("Conv", ["x", w], kernel_shape=[1], name="odd", **attrs)], outputs=["y"])
    m = g.model([("x", ["b", cin, 10])], [("y", None)], check=False)
    res = as_channels_last(m)
    assert res.model is m and res.rewritten == []
    assert res.refusals == [("odd", f"Conv 'odd' (kernel 1): {why}" + ("" if "groups" not in why else
                                                                      " over the channels"))]
    _, plan = fusion_plan(m, with_cuda=False)
    assert any(r.node == "odd" and why in r.reason for r in plan.refusals)


def test_real_convolutions_are_left_alone_without_a_word():
    g = G()
    w = g.init(g.rng.standard_normal((6, 4, 3)).astype(np.float32))
    w1 = g.init(g.rng.standard_normal((2, 6, 1)).astype(np.float32))
    h = g.op("Relu", [g.op("Conv", ["x", w], kernel_shape=[3])])
    g.op("Conv", [h, w1], kernel_shape=[1], outputs=["y"])
    m = g.model([("x", ["b", 4, 10])], [("y", None)], check=False)
    w2 = g.init(g.rng.standard_normal((5, 2, 1)).astype(np.float32))
    g.op("Conv", ["y", w2], kernel_shape=[1], outputs=["z"])
    m2 = g.model([("x", ["b", 4, 10])], [("z", None)], check=False)
    res = as_channels_last(m)
    assert res.refusals == [] and res.model is m   # the 3-wide one stays, and the lone 1x1 after it
    res = as_channels_last(m2)   # two 1x1 Convs after it: a run
    assert res.refusals == [] and _ops(res.model).count("Conv") == 1 and len(res.rewritten) == 1
    _same_outputs(m2, res.model, {"x": rand([2, 4, 10])})


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rank=st.integers(3, 5), widths=st.lists(st.integers(1, 20), min_size=2, max_size=5),
       acts=st.lists(st.sampled_from(sorted(ACTS)), min_size=4, max_size=4), bias=st.booleans(),
       pool=st.sampled_from([None, "ReduceMax", "ReduceMean", "ReduceSum"]), keep=st.integers(0, 1),
       opset=st.sampled_from([13, 17, 18, 20]), axes_seed=st.integers(0, 1000))
def test_property_rewrite_is_exact_on_stock_ort(rank, widths, acts, bias, pool, keep, opset, axes_seed):
    rng = np.random.default_rng(axes_seed)
    axes = sorted(rng.choice(rank, size=int(rng.integers(1, rank)), replace=False).tolist())
    m = conv_model(widths, acts[:len(widths) - 2], rank=rank, bias=bias, opset=opset,
                   pool=None if pool is None else (pool, axes, keep), seed=axes_seed)
    res = as_channels_last(m)
    # a lone Conv stays one unless a pool reads it
    assert _ops(res.model).count("Conv") == (0 if len(widths) > 2 or pool is not None else 1)
    x = rand([2, widths[0]] + [3, 2, 4][:rank - 2], seed=axes_seed)
    _same_outputs(m, res.model, {"x": x})


# -- torch exports, converted end to end (CPU-only plugin) --------------------------------------------

torch = pytest.importorskip("torch")
nn = torch.nn


class PointNetFeat(nn.Module):
    """PointNet's shared MLP and max pool (Qi et al. 2017): Conv1d(k=1) + BatchNorm1d + ReLU on [B, 3, N];
    `keepdim`: as fxia22's pointnet.pytorch writes the pool, torch.max(x, 2, keepdim=True)[0].view(-1, C)."""

    def __init__(self, keepdim=False):
        super().__init__()
        self.keepdim = keepdim
        layers = []
        for i, (k, n) in enumerate(zip((3, 64, 128), (64, 128, 256))):
            layers += [nn.Conv1d(k, n, 1), nn.BatchNorm1d(n)] + ([nn.ReLU()] if i < 2 else [])
        self.mlp = nn.Sequential(*layers)
        for bn in self.mlp:
            if isinstance(bn, nn.BatchNorm1d):
                bn.running_mean.uniform_(-0.2, 0.2)
                bn.running_var.uniform_(0.5, 2.0)

    def forward(self, x):
        if self.keepdim:
            return torch.max(self.mlp(x), 2, keepdim=True)[0].view(-1, 256)
        return torch.max(self.mlp(x), 2)[0]


class PointNetFeatKeepdim(PointNetFeat):
    def __init__(self):
        super().__init__(keepdim=True)


class ConvHead(nn.Module):
    """A 1x1 Conv2d head on a feature map with SiLU, and its global average pool as a second output."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(32, 48, 1), nn.SiLU(), nn.Conv2d(48, 5, 1, bias=False))

    def forward(self, x):
        y = self.net(x)
        return y, y.mean(dim=(2, 3))


class ConvPoolHead(nn.Module):
    """A CNN's classifier head on a 7 x 7 map: 1x1 Conv2d + BatchNorm2d + ReLU, 1x1 Conv2d + SiLU, then its
    global pool: AdaptiveAvgPool2d(1) and flatten ("gap"), x.mean((2, 3)) ("mean") or x.amax((2, 3),
    keepdim=True) ("max")."""

    def __init__(self, mode="gap"):
        super().__init__()
        self.mode = mode
        self.net = nn.Sequential(nn.Conv2d(16, 32, 1), nn.BatchNorm2d(32), nn.ReLU(), nn.Conv2d(32, 48, 1), nn.SiLU())

    def forward(self, x):
        h = self.net(x)
        if self.mode == "gap":
            return nn.functional.adaptive_avg_pool2d(h, 1).flatten(1)
        return h.mean((2, 3)) if self.mode == "mean" else h.amax((2, 3), keepdim=True)


def _export(module, x, path, dynamo):
    dims = {0: "b"} | {k: f"s{k}" for k in range(2, x.dim())}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if dynamo:
            dyn = {k: torch.export.Dim(v, min=2, max=4096) for k, v in dims.items()}
            torch.onnx.export(module, (x,), str(path), dynamo=True, dynamic_shapes=({**dyn},), verbose=False)
        else:
            torch.onnx.export(module, (x,), str(path), dynamo=False, opset_version=17, input_names=["x"],
                              dynamic_axes={"x": dims})
    return path


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
@pytest.mark.parametrize("build", [PointNetFeat, PointNetFeatKeepdim, ConvHead])
def test_torch_pointwise_conv_models_convert(build, dynamo, tmp_path):
    torch.manual_seed(0)
    module = build().eval()
    x = torch.randn(2, 32, 6, 5) if build is ConvHead else torch.randn(2, 3, 50)
    src = _export(module, x, tmp_path / "m.onnx", dynamo)
    res = onnx2fused.convert(src, tmp_path / "m.fused.onnx", cache_dir=tmp_path / "cache", with_cuda=False)
    assert len(res.chains) == 1 and res.validation is not None and not res.validation.failures
    assert any("pointwise Conv" in w for w in res.rewritten), res.rewritten
    fused = onnx.load(str(tmp_path / "m.fused.onnx"))
    assert [n.domain for n in fused.graph.node].count(DOMAIN) == 1
    # PointNet: the Transpose in front (and with keepdim, the pooled [B, 1, C] back, then the view); the head:
    # in front and behind its map output (its mean pool reads the channels-last rows)
    assert "Conv" not in _ops(fused) and "ReduceMax" not in _ops(fused)
    assert _ops(fused).count("Transpose") == {PointNetFeat: 1, PointNetFeatKeepdim: 2, ConvHead: 2}[build]
    sess = plugin_session(fused, res.library_path)
    xs = rand([3] + list(x.shape[1:-1]) + [x.shape[-1] + 7], seed=5)
    with torch.no_grad():
        want = module(torch.from_numpy(xs))
    want = want if isinstance(want, tuple) else (want,)
    for got, w in zip(sess.run(None, {sess.get_inputs()[0].name: xs}), want):
        assert_close(got, w.numpy(), 1e-4)


@pytest.mark.parametrize("mode,dynamo,pool,any_size", [("gap", False, "meank", False), ("gap", True, "meank", False),
                                                     ("mean", True, "mean", False), ("max", False, "maxk", False),
                                                     ("gap", False, "meank", True)])
def test_a_cnn_heads_global_pool_joins_its_fused_op(mode, dynamo, pool, any_size, tmp_path):
    """ConvPoolHead from both exporters: its two 1x1 Convs and the global pool over the 7 x 7 map one op
    (the positions flattened, the pool inside), converted CPU-only, matching torch at another batch;
    `any_size`: exported for any map size (H, W symbolic), matching torch on a 5 x 9 map too."""
    torch.manual_seed(5)
    module = ConvPoolHead(mode).eval()
    for m in module.net:
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.2, 0.2)
            m.running_var.uniform_(0.5, 2.0)
    x = torch.randn(2, 16, 7, 7)
    path = tmp_path / "head.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if dynamo:
            torch.onnx.export(module, (x,), str(path), dynamo=True, input_names=["x"],
                              dynamic_shapes=({0: torch.export.Dim("b")},), verbose=False)
        else:
            torch.onnx.export(module, (x,), str(path), dynamo=False, opset_version=17, input_names=["x"],
                              dynamic_axes={"x": {0: "b", 2: "h", 3: "w"} if any_size else {0: "b"}})
    res = onnx2fused.convert(path, tmp_path / "head.fused.onnx", cache_dir=tmp_path / "cache", with_cuda=False)
    assert [list(c.widths) for c in res.chains] == [[16, 32, 48]] and f"_pool{pool}_" in res.chains[0].name
    assert not res.validation.failures
    fused = onnx.load(str(tmp_path / "head.fused.onnx"))
    assert not {"Conv", "GlobalAveragePool", "ReduceMean", "ReduceMax"} & set(_ops(fused))
    _matches_torch(plugin_session(fused, res.library_path), module,
                   [[3, 16, 7, 7]] + ([[2, 16, 5, 9]] if any_size else []), seed=8)


@pytest.mark.parametrize("any_size", [False, True], ids=["7x7", "any_size"])
def test_mobilenet_head_builder_converts_with_its_pool_in_the_op(any_size, tmp_path):
    """benchmarks/cnn_head.py (MobileNetV2's head, narrowed: 24 -> 40 channels, 10 classes): its lone 1x1 Conv
    with the BatchNorm and ReLU6 and the average pool one op, the classifier a second chain; CPU-only, matching
    torch (a 5 x 3 map too where exported for any size)."""
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from cnn_head import MobileNetV2Head, export
    torch.manual_seed(7)
    module = MobileNetV2Head(channels=24, features=40, classes=10)
    src = export(module, tmp_path / "head.onnx", any_size)
    res = onnx2fused.convert(src, tmp_path / "head.fused.onnx", cache_dir=tmp_path / "cache", with_cuda=False)
    assert [list(c.widths) for c in res.chains] == [[24, 40], [40, 10]] and "_poolmeank_" in res.chains[0].name
    fused = onnx.load(str(tmp_path / "head.fused.onnx"))
    assert not {"Conv", "GlobalAveragePool", "ReduceMean", "Clip"} & set(_ops(fused))
    _matches_torch(plugin_session(fused, res.library_path), module,
                   [[3, 24, 7, 7]] + ([[2, 24, 5, 3]] if any_size else []), seed=9)


def _matches_torch(sess, module, shapes, seed):
    """The fused model's first output against the torch module's at random inputs of each shape."""
    for shape in shapes:
        xs = rand(shape, seed=seed, scale=1.0)
        with torch.no_grad():
            want = module(torch.from_numpy(xs)).numpy()
        assert_close(sess.run(None, {sess.get_inputs()[0].name: xs})[0], want, 1e-4)


def test_lone_pointwise_convs_of_a_cnn_stay_convs():
    """A ResNet bottleneck (1x1 -> ReLU -> 3x3 -> ReLU -> 1x1, + x): each 1x1 Conv is alone between real
    convolutions and the residual Add, so the model is left as it is; one 1x1 Conv before a global max pool
    is taken (PointNet with a single layer)."""
    g = G()
    w = [g.init(g.rng.standard_normal(s).astype(np.float32) * 0.3) for s in ((4, 8, 1, 1), (4, 4, 3, 3), (8, 4, 1, 1))]
    h = g.op("Relu", [g.op("Conv", ["x", w[0]], kernel_shape=[1, 1])])
    h = g.op("Relu", [g.op("Conv", [h, w[1]], kernel_shape=[3, 3], pads=[1, 1, 1, 1])])
    g.op("Add", [g.op("Conv", [h, w[2]], kernel_shape=[1, 1]), "x"], outputs=["y"])
    m = g.model([("x", ["b", 8, 6, 6])], [("y", ["b", 8, 6, 6])])
    res = as_channels_last(m)
    assert res.model is m and res.rewritten == [] and res.refusals == []
    single = conv_model([3, 16], [], pool=("ReduceMax", [2], 0))
    res = as_channels_last(single)
    assert len(res.rewritten) == 1 and "ReduceMax over the channels-last rows" in res.rewritten[0]


class SetAbstractionMLP(nn.Module):
    """PointNet++'s set abstraction MLP (pointnet2 in PyTorch): Conv2d(k=1) + BatchNorm2d + ReLU on the grouped
    points [B, C, samples, centres], then the max over each centre's samples (dim 2)."""

    def __init__(self):
        super().__init__()
        layers = []
        for k, n in ((6, 32), (32, 32), (32, 64)):
            layers += [nn.Conv2d(k, n, 1), nn.BatchNorm2d(n), nn.ReLU()]
        self.mlp = nn.Sequential(*layers)

    def forward(self, x):
        return torch.max(self.mlp(x), 2)[0]


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
def test_pointnet2_set_abstraction_pools_inside_the_op(dynamo, tmp_path):
    """The pooled axis (samples, axis 2 of [B, C, samples, centres]) goes last among the rows' axes
    ([B, centres, samples, C]), so its rows lie together and the max joins the fused op; the pooled
    [B, centres, C] is transposed back (a small tensor)."""
    torch.manual_seed(1)
    module = SetAbstractionMLP().eval()
    src = _export(module, torch.randn(2, 6, 16, 8), tmp_path / "sa.onnx", dynamo)
    res = onnx2fused.convert(src, tmp_path / "sa.fused.onnx", cache_dir=tmp_path / "cache", with_cuda=False)
    assert len(res.chains) == 1 and "_poolmax_" in res.chains[0].name and not res.validation.failures
    fused = onnx.load(str(tmp_path / "sa.fused.onnx"))
    # in front [B, C, samples, centres] -> [B, centres, samples, C]; behind, the pooled [B, centres, C] back
    assert [list(n.attribute[0].ints) for n in fused.graph.node if n.op_type == "Transpose"] == [[0, 3, 2, 1], [0, 2, 1]]
    assert "ReduceMax" not in _ops(fused)
    sess = plugin_session(fused, res.library_path)
    xs = rand([3, 6, 9, 5], seed=2)
    with torch.no_grad():
        want = module(torch.from_numpy(xs)).numpy()
    assert_close(sess.run(None, {sess.get_inputs()[0].name: xs})[0], want, 1e-4)


def test_dgcnn_edge_conv_pools_over_the_neighbours():
    """DGCNN's EdgeConv: one Conv2d(k=1) + LeakyReLU on the edge features [B, 2C, points, k], then the max
    over the k neighbours (axis 3): a lone Conv that a pool reads is a run, and the pool joins the op."""
    g = G()
    w = g.init((g.rng.standard_normal((16, 6, 1, 1)) * 0.4).astype(np.float32))
    h = g.op("LeakyRelu", [g.op("Conv", ["x", w, g.vec(16)], kernel_shape=[1, 1])], alpha=0.2)
    g.op("ReduceMax", [h], axes=[3], keepdims=0, outputs=["y"])
    m = g.model([("x", ["b", 6, "n", 20])], [("y", ["b", 16, "n"])])
    model, plan = fusion_plan(m, with_cuda=False)
    (chain,) = plan.chains
    assert chain.pool == "max" and chain.widths == (6, 16)
    fused = rewrite(model, plan, [chain.to_spec("fp32")])
    assert [n.op_type for n in fused.graph.node if n.domain != DOMAIN] == ["Transpose", "Transpose"]
    _same_outputs(m, fused, {"x": rand([2, 6, 7, 20])})


@pytest.mark.parametrize("pool,dynamo", [("adaptive_max", False), ("maxpool", False), ("adaptive_avg", False),
                                         ("adaptive_max", True)])
def test_global_pools_as_the_exporters_write_them(pool, dynamo, tmp_path):
    """TorchScript writes AdaptiveMaxPool1d(1) and MaxPool1d(num_points) as a MaxPool over the whole (static)
    length, AdaptiveAvgPool1d(1) as GlobalAveragePool; the dynamo exporter AdaptiveMaxPool1d(1) as Unsqueeze
    -> ReduceMax -> Squeeze: the pools join the fused op (keepdims), the mean as a ReduceMean over the rows."""
    layer = {"adaptive_max": nn.AdaptiveMaxPool1d(1), "maxpool": nn.MaxPool1d(50),
             "adaptive_avg": nn.AdaptiveAvgPool1d(1)}[pool]
    module = nn.Sequential(nn.Conv1d(3, 16, 1), nn.ReLU(), nn.Conv1d(16, 24, 1), layer, nn.Flatten()).eval()
    path = tmp_path / "m.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if dynamo:
            torch.onnx.export(module, (torch.randn(2, 3, 50),), str(path), dynamo=True, input_names=["x"],
                              dynamic_shapes=({0: torch.export.Dim("b")},), verbose=False)
        else:
            torch.onnx.export(module, (torch.randn(2, 3, 50),), str(path), dynamo=False, opset_version=17,
                              input_names=["x"], dynamic_axes={"x": {0: "b"}})
    m = onnx.load(str(path))
    assert {"MaxPool", "GlobalAveragePool", "Unsqueeze"} & set(_ops(m))
    model, plan = fusion_plan(m, with_cuda=False)
    (chain,) = plan.chains
    assert chain.pool == ("meank" if pool == "adaptive_avg" else "maxk")
    fused = rewrite(model, plan, [chain.to_spec("fp32")])
    assert not {"MaxPool", "GlobalAveragePool", "Conv", "Unsqueeze", "Squeeze", "ReduceMax", "ReduceMean"} & set(_ops(fused))
    x = rand([3, 3, 50])
    with torch.no_grad():
        want = module(torch.from_numpy(x)).numpy()
    assert_close(run(fused, {m.graph.input[0].name: x})[0], want, 1e-5)


def test_a_maxpool_that_is_not_global_stays():
    g = G()
    ws = [g.init(g.rng.standard_normal(sh).astype(np.float32)) for sh in ((8, 4, 1), (8, 8, 1))]
    h = g.op("Conv", [g.op("Relu", [g.op("Conv", ["x", ws[0]], kernel_shape=[1])]), ws[1]], kernel_shape=[1])
    g.op("MaxPool", [h], kernel_shape=[5], strides=[5], outputs=["y"])
    m = g.model([("x", ["b", 4, 20])], [("y", ["b", 8, 4])])
    res = as_channels_last(m)
    assert "MaxPool" in _ops(res.model) and "Transpose back" in res.rewritten[0]
    _same_outputs(m, res.model, {"x": rand([2, 4, 20])})


@pytest.mark.parametrize("seg", [False, True], ids=["cls", "seg"])
def test_fxia22_pointnet_with_its_transform_net_converts(seg, tmp_path):
    """PointNet as fxia22's pointnet.pytorch writes it (benchmarks/pointnet.py PointNetSTN): the transform
    net's MLP and the feature MLP each one chain with its max pool (keepdim, then view), the two heads
    chains of their own; the segmentation net's per-point head over [global feature repeated, point
    features] one more chain. Converted CPU-only, matching torch at another batch."""
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from pointnet import PointNetSTN, export
    torch.manual_seed(3)
    module = PointNetSTN(classes=4, seg=True) if seg else PointNetSTN()
    src = export(module, tmp_path / "pn.onnx", points=200)
    res = onnx2fused.convert(src, tmp_path / "pn.fused.onnx", cache_dir=tmp_path / "cache", with_cuda=False)
    widths = [list(c.widths) for c in res.chains]
    assert widths[:2] == [[3, 64, 128, 1024], [1024, 512, 256, 9]] and len(widths) == 4, widths
    assert widths[2] == ([64, 128, 1024] if seg else [3, 64, 128, 1024])
    assert [("max over the rows" in " ".join(c.takes_in)) for c in res.chains] == [True, False, True, False]
    assert widths[3] == ([1088, 512, 256, 128, 4] if seg else [1024, 512, 256, 40])
    fused = onnx.load(str(tmp_path / "pn.fused.onnx"))
    # seg: the first 3 -> 64 Conv feeds the Concat too, a lone Conv that stays one (the rest fuse)
    assert _ops(fused).count("Conv") == int(seg) and "ReduceMax" not in _ops(fused)
    sess = plugin_session(fused, res.library_path)
    x = rand([3, 3, 200], seed=6)
    with torch.no_grad():
        want = module(torch.from_numpy(x)).numpy()
    assert_close(sess.run(None, {sess.get_inputs()[0].name: x})[0], want, 1e-4)


@pytest.mark.parametrize("perm,left", [([0, 2, 1], 0), ([2, 0, 1], 1)])
def test_a_transpose_after_the_run_composes_with_the_one_back(perm, left):
    """A segmentation head's conv(x).transpose(2, 1): the Transpose back and the model's own compose into one
    permutation of the channels-last rows, none at all where they cancel."""
    g = G()
    ws = [g.init(g.rng.standard_normal(sh).astype(np.float32)) for sh in ((8, 4, 1), (5, 8, 1))]
    h = g.op("Conv", [g.op("Relu", [g.op("Conv", ["x", ws[0]], kernel_shape=[1])]), ws[1]], kernel_shape=[1])
    g.op("Sigmoid", [g.op("Transpose", [h], perm=perm)], outputs=["y"])
    m = g.model([("x", ["b", 4, "n"])], [("y", None)], check=False)
    res = as_channels_last(m)
    assert _ops(res.model).count("Transpose") == 1 + left and "the Transpose after it" in res.rewritten[0]
    _same_outputs(m, res.model, {"x": rand([2, 4, 7])})


def test_a_cnns_other_global_pools_stay():
    """A squeeze-and-excitation block (GlobalAveragePool -> 1x1 -> ReLU -> 1x1 -> Sigmoid -> Mul): its two
    1x1 Convs are a run, while the GlobalAveragePool in front of them, which reads no run, stays as it is."""
    g = G()
    ws = [g.init((g.rng.standard_normal(sh) * 0.3).astype(np.float32)) for sh in ((4, 16, 1, 1), (16, 4, 1, 1))]
    s = g.op("GlobalAveragePool", ["x"])
    s = g.op("Sigmoid", [g.op("Conv", [g.op("Relu", [g.op("Conv", [s, ws[0]], kernel_shape=[1, 1])]), ws[1]],
                              kernel_shape=[1, 1])])
    g.op("Mul", ["x", s], outputs=["y"])
    m = g.model([("x", ["b", 16, 5, 5])], [("y", ["b", 16, 5, 5])])
    res = as_channels_last(m)
    assert "GlobalAveragePool" in _ops(res.model) and "ReduceMean" not in _ops(res.model)
    assert len(res.rewritten) == 1
    _same_outputs(m, res.model, {"x": rand([2, 16, 5, 5])})
