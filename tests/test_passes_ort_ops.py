"""Models saved by ONNX Runtime's graph optimisers: its own ops (domain com.microsoft: FusedGemm,
FusedMatMul, Gelu, QuickGelu, FastGelu, BiasGelu, SkipLayerNormalization) fuse into the same chains as
the exports they came from, and the rewritten models match the optimised ones in plain onnxruntime."""
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from onnx2fused import expr as ex
from onnx2fused.passes import find_chains, rewrite
from onnx2fused.passes.activations import describe_expr
from onnx2fused.passes.constants import GraphIndex
from onnx_builders import G, rand, run

ORT_DOMAIN = "com.microsoft"
MODELS = "models"


def _ort_optimised(src: str, path) -> onnx.ModelProto:
    """`src` as ORT's extended graph optimisations leave it (what optimized_model_filepath saves)."""
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    so.optimized_model_filepath = str(path)
    ort.InferenceSession(src, so, providers=["CPUExecutionProvider"])
    return onnx.load(str(path))


def _same_outputs(m, r, x, tol=2e-5):
    name = m.graph.input[0].name
    (a,), (b,) = run(m, {name: x}), run(r, {name: x})
    np.testing.assert_allclose(b, a, rtol=tol, atol=tol)


@pytest.mark.parametrize("zoo,ort_ops", [
    ("nerf", {"FusedGemm"}),          # Gemm + Relu
    ("gelu", {"Gelu"}),               # the erf chain
    ("silu", {"QuickGelu"}),          # x * sigmoid(x)
    ("swiglu", {"QuickGelu"}),        # the gated layer's SiLU
    ("preln", {"Gelu"}),              # a block: LayerNorm in front, residual behind
])
def test_ort_optimised_zoo_model_fuses_like_its_export(zoo, ort_ops, tmp_path):
    src = f"{MODELS}/{zoo}.opset17.onnx"
    opt = _ort_optimised(src, tmp_path / "opt.onnx")
    assert ort_ops <= {n.op_type for n in opt.graph.node if n.domain == ORT_DOMAIN}
    want, got = find_chains(onnx.load(src)), find_chains(opt)
    assert len(got.chains) == len(want.chains) == 1, got.describe()
    (c,), (w,) = got.chains, want.chains
    assert c.widths == w.widths and c.activation_labels() == w.activation_labels()
    assert (c.norm is None) == (w.norm is None) and c.residual == w.residual
    assert c.to_spec("fp16").name == w.to_spec("fp16").name   # the same kernel
    r = rewrite(opt, got, [c.to_spec("fp32")])
    assert not any(n.domain == ORT_DOMAIN for n in r.graph.node), [n.op_type for n in r.graph.node]
    _same_outputs(opt, r, rand([37, c.widths[0]], seed=1))


def test_types_flow_through_ort_ops():
    """onnx's shape inference does not know ORT's ops: without the stand-ins, every tensor after one
    has an unknown type and its layers are refused ("element type unknown")."""
    g = G()
    h = g.op("FusedGemm", ["x", g.weight(8, 16), g.vec(16)], domain=ORT_DOMAIN, activation="Relu")
    h = g.op("Gelu", [g.linear(h, 16, 16, kind="matmul")], domain=ORT_DOMAIN)
    g.op("Gemm", [h, g.weight(16, 4)], name="last", outputs=["y"])
    m = g.model([("x", ["B", 8])], [("y", ["B", 4])], check=False)
    ix = GraphIndex(m)
    assert ix.types[h] == onnx.TensorProto.FLOAT and ix.shapes[h] == ["B", 16]
    plan = find_chains(m)
    assert [c.widths for c in plan.chains] == [(8, 16, 16, 4)] and plan.refusals == [], plan.describe()
    assert plan.chains[0].activations == [ex.relu(), ex.gelu_erf(), ex.identity()]


@pytest.mark.parametrize("activation,attrs,expected", [
    ("LeakyRelu", {"activation_alpha": 0.2}, ex.leaky_relu(0.2)),
    ("Sigmoid", {}, ex.sigmoid()),
    ("Tanh", {}, ex.tanh()),
    ("HardSigmoid", {"activation_alpha": 0.3, "activation_beta": 0.4}, ex.hard_sigmoid(0.3, 0.4)),
    ("Elu", {"activation_alpha": 0.7}, ex.elu(0.7)),   # (ORT's fusion copies every attribute)
])
def test_fused_gemm_activations(activation, attrs, expected):
    g = G()
    h = g.op("FusedGemm", ["x", g.weight(16, 8), g.vec(16)], domain=ORT_DOMAIN, transB=1, alpha=0.5, beta=2.0,
             activation=activation, **attrs)   # weight [N, K] (transB)
    g.op("Gemm", [h, g.weight(16, 3), g.vec(3)], outputs=["y"])
    m = g.model([("x", ["B", 8])], [("y", ["B", 3])], check=False)
    plan = find_chains(m)
    assert [c.widths for c in plan.chains] == [(8, 16, 3)], plan.describe()
    assert plan.chains[0].activations[0] == expected
    _same_outputs(m, rewrite(m, plan, [plan.chains[0].to_spec("fp32")]), rand([11, 8], seed=2) * 3)


def test_fused_gemm_with_an_unknown_activation_is_refused_with_its_name():
    g = G()
    g.op("FusedGemm", ["x", g.weight(8, 8)], name="fg", domain=ORT_DOMAIN, activation="Mystery", outputs=["y"])
    m = g.model([("x", ["B", 8])], [("y", ["B", 8])], check=False)
    plan = find_chains(m)
    assert plan.chains == [] and [r.reason for r in plan.refusals] == [
        "FusedGemm 'fg': its activation 'Mystery' is not one onnx2fused knows"]


def test_fused_matmul_alpha_and_transposed_weight_then_bias():
    g = G()
    w = g.init(rand([12, 8], seed=4))   # [N, K]: transB
    h = g.op("FusedMatMul", ["x", w], domain=ORT_DOMAIN, alpha=0.25, transB=1)
    h = g.op("Relu", [g.op("Add", [h, g.vec(12)])])
    g.op("MatMul", [h, g.weight(12, 5)], outputs=["y"])
    m = g.model([("x", ["B", 3, 8])], [("y", ["B", 3, 5])], check=False)
    plan = find_chains(m)
    (c,) = plan.chains
    assert c.widths == (8, 12, 5) and c.layers[0].linear.has_bias and c.activations[0] == ex.relu()
    _same_outputs(m, rewrite(m, plan, [c.to_spec("fp32")]), rand([2, 3, 8], seed=5))


def test_fused_matmul_with_a_transposed_input_is_refused():
    g = G()
    g.op("FusedMatMul", ["x", g.weight(8, 8)], name="fm", domain=ORT_DOMAIN, transA=1, outputs=["y"])
    m = g.model([("x", [8, 8])], [("y", [8, 8])], check=False)
    assert [r.reason for r in find_chains(m).refusals] == [
        "FusedMatMul 'fm': transA=1 (a transposed input) is not supported"]


def test_transformers_optimizer_ffn_bias_gelu_and_skip_layer_norm(tmp_path):
    """onnxruntime.transformers' BERT optimiser: MatMul, BiasGelu (the first bias), MatMul, then
    SkipLayerNormalization holding the second bias and the residual. The chain takes the MatMuls; the
    BiasGelu's bias becomes the first layer's bias (f stays the named GELU, with its packed kernel)."""
    torch = pytest.importorskip("torch")
    from onnxruntime.transformers.optimizer import optimize_model

    class PostLN(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.f1, self.f2, self.n = torch.nn.Linear(32, 128), torch.nn.Linear(128, 32), torch.nn.LayerNorm(32)
            self.f3, self.f4, self.n2 = torch.nn.Linear(32, 128), torch.nn.Linear(128, 32), torch.nn.LayerNorm(32)

        def forward(self, x):
            x = self.n(x + self.f2(torch.nn.functional.gelu(self.f1(x))))
            return self.n2(x + self.f4(torch.nn.functional.gelu(self.f3(x), approximate="tanh")))

    torch.manual_seed(0)
    src = tmp_path / "ffn.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(PostLN().eval(), (torch.randn(2, 5, 32),), str(src), input_names=["x"], opset_version=17,
                          dynamo=False, dynamic_axes={"x": {0: "b", 1: "s"}})
        opt = optimize_model(str(src), model_type="bert", num_heads=0, hidden_size=0, opt_level=0)
    m = opt.model
    ops = {n.op_type for n in m.graph.node if n.domain == ORT_DOMAIN}
    assert {"BiasGelu", "FastGelu", "SkipLayerNormalization"} <= ops, ops
    plan = find_chains(m)
    assert [c.widths for c in plan.chains] == [(32, 128, 32)] * 2, plan.describe()
    assert [describe_expr(c.activations[0]) for c in plan.chains] == ["gelu", "gelutanh"]
    assert all(c.layers[0].linear.has_bias and not c.layers[1].linear.has_bias for c in plan.chains)
    assert "SkipLayerNormalization is a normalisation across the row" in plan.refusals[0].reason
    r = rewrite(m, plan, [c.to_spec("fp32") for c in plan.chains])
    _same_outputs(m, r, rand([3, 7, 32], seed=6))


def test_bert_layer_after_the_transformers_optimizer(tmp_path):
    """A BERT encoder layer after onnxruntime.transformers (Attention, SkipLayerNormalization, BiasGelu):
    its FFN is found behind the Attention op (whose output type onnx's inference does not know)."""
    torch = pytest.importorskip("torch")
    from onnxruntime.transformers.optimizer import optimize_model

    class Layer(torch.nn.Module):
        def __init__(self, d=32, heads=2):
            super().__init__()
            self.heads = heads
            self.q, self.k, self.v, self.o = (torch.nn.Linear(d, d) for _ in range(4))
            self.n1, self.n2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
            self.f1, self.f2 = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

        def forward(self, x, mask):
            b, s, d = x.shape
            hd = d // self.heads
            q = self.q(x).view(b, s, self.heads, hd).permute(0, 2, 1, 3)
            k = self.k(x).view(b, s, self.heads, hd).permute(0, 2, 3, 1)
            v = self.v(x).view(b, s, self.heads, hd).permute(0, 2, 1, 3)
            bias = (1.0 - mask[:, None, None, :].float()) * -10000.0
            a = torch.softmax(torch.matmul(q, k) / 4.0 + bias, -1)
            x = self.n1(x + self.o(torch.matmul(a, v).permute(0, 2, 1, 3).reshape(b, s, d)))
            return self.n2(x + self.f2(torch.nn.functional.gelu(self.f1(x))))

    torch.manual_seed(0)
    src = tmp_path / "layer.onnx"
    x, mask = torch.randn(2, 8, 32), torch.ones(2, 8, dtype=torch.int64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(Layer().eval(), (x, mask), str(src), input_names=["x", "mask"], opset_version=14,
                          dynamo=False, dynamic_axes={"x": {0: "b", 1: "s"}, "mask": {0: "b", 1: "s"}})
        m = optimize_model(str(src), model_type="bert", num_heads=2, hidden_size=32, opt_level=0).model
    assert {"Attention", "SkipLayerNormalization", "BiasGelu"} <= {n.op_type for n in m.graph.node
                                                                 if n.domain == ORT_DOMAIN}
    plan = find_chains(m)
    assert (32, 128, 32) in [c.widths for c in plan.chains], plan.describe()
    ffn = next(c for c in plan.chains if c.widths == (32, 128, 32))
    assert ffn.activations[0] == ex.gelu_erf()
    r = rewrite(m, plan, [c.to_spec("fp32") for c in plan.chains])
    feeds = {"x": rand([3, 5, 32], seed=8), "mask": np.ones((3, 5), np.int64)}
    (a,), (b,) = run(m, feeds), run(r, feeds)
    np.testing.assert_allclose(b, a, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("opset", [13, 16])
def test_ort_fused_layernorm_below_opset_17_is_the_blocks_norm(opset, tmp_path):
    """A pre-LN block exported below opset 17 (nn.LayerNorm as its ops), saved by ORT's optimiser: ORT
    fuses those ops into a LayerNormalization node although the model's opset has none; it is the block's
    norm all the same, and the rewritten model's stock body writes the ops again."""
    torch = pytest.importorskip("torch")

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.n, self.a, self.b = torch.nn.LayerNorm(16), torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)

        def forward(self, x):
            return x + self.b(torch.nn.functional.gelu(self.a(self.n(x))))

    torch.manual_seed(3)
    src = tmp_path / "b.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(Block().eval(), (torch.randn(3, 16),), str(src), input_names=["x"], output_names=["y"],
                          dynamo=False, opset_version=opset, dynamic_axes={"x": {0: "B"}})
    opt = _ort_optimised(str(src), tmp_path / "opt.onnx")
    assert "LayerNormalization" in {n.op_type for n in opt.graph.node}
    plan = find_chains(opt)
    (c,) = plan.chains
    assert c.norm is not None and c.norm.kind == "layernorm" and c.residual and plan.refusals == [], plan.describe()
    r = rewrite(opt, plan, [c.to_spec("fp32")])
    assert [n.op_type for n in r.graph.node] == [c.to_spec("fp32").name]
    _same_outputs(opt, r, rand([37, 16], seed=2))


def test_ort_default_domain_ops_pass_the_loader(tmp_path):
    """ORT's optimiser writes SimplifiedLayerNormalization into the default domain (LLaMA's RMSNorm), which
    the ONNX checker does not know: the loader takes the model (ORT runs it), shapes are inferred through
    the op, and the norm is the chain's. ORT also wrote the residual Add into the down projection's Gemm
    (MatMulAddFusion: C is the block's input), which is not a linear layer here and says why."""
    from onnx2fused.loader import load_model

    path = tmp_path / "opt.onnx"
    opt = _ort_optimised(f"{MODELS}/llama.opset17.onnx", path)
    assert "SimplifiedLayerNormalization" in {n.op_type for n in opt.graph.node if n.domain == ""}
    with pytest.raises(Exception):
        onnx.checker.check_model(opt)
    plan = find_chains(load_model(path))
    (c,) = plan.chains
    assert c.norm is not None and c.norm.kind == "rmsnorm" and c.layers[0].gated and c.input == "x"
    assert any(r.reason.endswith("bias 'x' is not a constant (a tensor added to every row, such as a residual Add "
                                 "that ONNX Runtime's optimiser folded into the Gemm: convert the model as exported)")
               for r in plan.refusals), plan.describe()
