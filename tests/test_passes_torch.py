"""Real torch exports (legacy opset-17 and dynamo opset-20 with external data): chains, widths, activations,
and the rewritten model matching the original in plain onnxruntime."""
import sys
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from onnx2fused import expr as ex  # noqa: E402
from onnx2fused.loader import load_model  # noqa: E402
from onnx2fused.passes import find_chains, rewrite  # noqa: E402
from onnx2fused.passes.activations import describe_expr  # noqa: E402
from onnx_builders import run  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from gpt2_blocks import GPT2FFN, export  # noqa: E402
from hf_rmsnorm_blocks import GatedFFN  # noqa: E402
from tabular_resnet import tabular_resnet  # noqa: E402

ACTS = {
    "relu": (nn.ReLU, ex.relu()),
    "gelu": (nn.GELU, ex.gelu_erf()),
    "silu": (nn.SiLU, ex.silu()),
    "tanh": (nn.Tanh, ex.tanh()),
    "mish": (nn.Mish, ex.mish()),
    "softplus": (nn.Softplus, None),  # beta/threshold form: a Where over a threshold
    "leaky": (lambda: nn.LeakyReLU(0.1), ex.leaky_relu(0.1)),
    "hardswish": (nn.Hardswish, ex.hard_swish()),
    "elu": (nn.ELU, ex.elu(1.0)),
    "hardshrink": (nn.Hardshrink, None),  # TorchScript: Where(Or(Cast(x > l), Cast(x < -l)), x, 0)
}


def _export(module, x, path, dynamo):
    module.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if dynamo:
            torch.onnx.export(module, (x,), str(path), dynamo=True, dynamic_shapes=None, verbose=False)
        else:
            torch.onnx.export(module, (x,), str(path), dynamo=False, opset_version=17,
                              input_names=["x"], output_names=["y"])
    return load_model(path)


def _check(m, x, widths, act, tol=1e-5):
    plan = find_chains(m)
    assert len(plan.chains) == 1, plan.describe()
    (c,) = plan.chains
    assert c.widths == widths
    # the last activation ends the chain; compare the hidden ones numerically (and by name when known)
    probe = np.linspace(-6, 6, 241, dtype=np.float32)
    ref = torch_act_values(act, probe)
    for a in c.activations[:-1]:
        np.testing.assert_allclose(ex.evaluate(a, probe), ref, rtol=1e-5, atol=1e-6)
    assert c.activations[-1] == ex.identity()
    specs = [c.to_spec("fp32")]
    r = rewrite(m, plan, specs)
    onnx.checker.check_model(r, full_check=True)
    assert r.ir_version == m.ir_version
    name = m.graph.input[0].name
    xa = x.numpy()
    (a,), (b,) = run(m, {name: xa}), run(r, {name: xa})
    np.testing.assert_allclose(b, a, rtol=tol, atol=tol)
    return c


def torch_act_values(act, probe):
    with torch.no_grad():
        return ACTS[act][0]()(torch.from_numpy(probe)).numpy()


@pytest.mark.parametrize("act", sorted(ACTS))
def test_legacy_export(tmp_path, act):
    torch.manual_seed(0)
    f = ACTS[act][0]
    mod = nn.Sequential(nn.Linear(8, 16), f(), nn.Linear(16, 16), f(), nn.Linear(16, 4))
    x = torch.randn(5, 8) * 3
    m = _export(mod, x, tmp_path / "m.onnx", dynamo=False)
    assert m.ir_version == 8
    c = _check(m, x, (8, 16, 16, 4), act)
    if ACTS[act][1] is not None:
        assert c.activations[:2] == [ACTS[act][1]] * 2


@pytest.mark.parametrize("act", ["relu", "gelu", "silu", "mish", "softplus", "hardswish"])
def test_dynamo_export_external_data(tmp_path, act):
    torch.manual_seed(0)
    f = ACTS[act][0]
    mod = nn.Sequential(nn.Linear(8, 32), f(), nn.Linear(32, 4))
    x = torch.randn(5, 8) * 3
    p = tmp_path / "m.onnx"
    m = _export(mod, x, p, dynamo=True)
    assert (tmp_path / "m.onnx.data").is_file()  # weights as external data, loaded by load_model
    c = _check(m, x, (8, 32, 4), act)
    if ACTS[act][1] is not None:
        assert c.activations[0] == ACTS[act][1]


@pytest.mark.parametrize("dynamo", [False, True])
def test_no_bias_and_3d_input(tmp_path, dynamo):
    torch.manual_seed(0)
    mod = nn.Sequential(nn.Linear(8, 16, bias=False), nn.ReLU(), nn.Linear(16, 4))
    x = torch.randn(2, 3, 8)
    m = _export(mod, x, tmp_path / "m.onnx", dynamo=dynamo)
    c = _check(m, x, (8, 16, 4), "relu")
    assert [l.linear.has_bias for l in c.layers] == [False, True]
    assert c.activations[0] == ex.relu()


class _LoraLinear(nn.Module):
    """peft's LoRA Linear left unmerged: base(x) + lora_B(lora_A(dropout(x))) * scaling."""

    def __init__(self, k: int, n: int, r: int = 4, alpha: float = 8.0, bias: bool = True):
        super().__init__()
        self.base_layer = nn.Linear(k, n, bias=bias)
        self.lora_A, self.lora_B = nn.Linear(k, r, bias=False), nn.Linear(r, n, bias=False)
        self.lora_dropout, self.scaling = nn.Dropout(0.1), alpha / r
        nn.init.normal_(self.lora_B.weight, std=0.5)   # (peft starts it at zero: as after fine-tuning)

    def forward(self, x):
        return self.base_layer(x) + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling


@pytest.mark.parametrize("dynamo", [False, True])
def test_unmerged_lora_layers_fold_into_one_chain(tmp_path, dynamo):
    """LoRA adapters left unmerged (no merge_and_unload before export): each adapted layer is its base
    weight plus scaling * A B, one layer, so the MLP is one chain (it was five pieces: the base layers, the
    adapters' two-layer chains, the Adds)."""
    torch.manual_seed(6)
    mod = nn.Sequential(_LoraLinear(16, 64), nn.GELU(), _LoraLinear(64, 64, bias=False), nn.GELU(), nn.Linear(64, 4))
    x = torch.randn(5, 16)
    m = _export(mod, x, tmp_path / "m.onnx", dynamo=dynamo)
    c = _check(m, x, (16, 64, 64, 4), "gelu")
    plan = find_chains(m)
    assert plan.refusals == [], plan.describe()
    r = rewrite(m, plan, [c.to_spec("fp32")])
    assert [n.domain for n in r.graph.node if n.op_type not in ("Constant",)] == ["onnx2fused"], \
        [n.op_type for n in r.graph.node]


class _LoraSwiGLU(nn.Module):
    """LLaMA's FFN with LoRA on gate_proj and up_proj (a common peft target), unmerged."""

    def __init__(self):
        super().__init__()
        self.gate, self.up = _LoraLinear(32, 64, bias=False), _LoraLinear(32, 64, bias=False)
        self.down = nn.Linear(64, 32, bias=False)

    def forward(self, x):
        return self.down(nn.functional.silu(self.gate(x)) * self.up(x))


@pytest.mark.parametrize("dynamo", [False, True])
def test_unmerged_lora_on_a_gated_layer(tmp_path, dynamo):
    """LoRA on a SwiGLU's gate and up projections: each folds into its layer and the two are still one
    gated layer (the input is read by both layers and both adapters)."""
    torch.manual_seed(7)
    mod = _LoraSwiGLU()
    x = torch.randn(5, 32)
    m = _export(mod, x, tmp_path / "m.onnx", dynamo=dynamo)
    c = _check(m, x, (32, 64, 32), "silu")
    assert c.layers[0].gated and find_chains(m).refusals == [], find_chains(m).describe()


class _EinsumMLP(nn.Module):
    """Layers written as torch.einsum on parameters (one W as [K, N], one as torch's [N, K])."""

    def __init__(self):
        super().__init__()
        self.w1, self.b1 = nn.Parameter(torch.randn(8, 32) / 3), nn.Parameter(torch.randn(32) * 0.1)
        self.w2 = nn.Parameter(torch.randn(4, 32) / 6)

    def forward(self, x):
        h = torch.nn.functional.gelu(torch.einsum("...i,ij->...j", x, self.w1) + self.b1)
        return torch.einsum("bsj,nj->bsn", h, self.w2)


@pytest.mark.parametrize("dynamo", [False, True])
def test_einsum_layers_are_one_chain(tmp_path, dynamo):
    """torch.einsum as a linear layer (both exporters keep the Einsum node): one chain, its weights read
    as x @ W, transposed where the equation reads W as [N, K]."""
    torch.manual_seed(3)
    mod = _EinsumMLP()
    x = torch.randn(2, 3, 8)
    m = _export(mod, x, tmp_path / "m.onnx", dynamo=dynamo)
    assert sum(n.op_type == "Einsum" for n in m.graph.node) == 2
    c = _check(m, x, (8, 32, 4), "gelu")
    assert [l.linear.op for l in c.layers] == ["Einsum", "Einsum"]
    assert [l.linear.has_bias for l in c.layers] == [True, False]


def test_spectral_norm_layers_are_one_chain(tmp_path):
    """torch's spectral_norm (GAN discriminators, Lipschitz MLPs) through the dynamo exporter (TorchScript
    cannot export its vdot): W / (u . W v) computed in the graph, MatMuls of constants among it, folds;
    one chain and no refusal for those MatMuls."""
    torch.manual_seed(5)
    sn = nn.utils.parametrizations.spectral_norm
    mod = nn.Sequential(sn(nn.Linear(16, 128)), nn.ReLU(), sn(nn.Linear(128, 128)), nn.ReLU(), nn.Linear(128, 4))
    mod.train()
    with torch.no_grad():   # a few power iterations: u and v away from their random start
        for _ in range(3):
            mod(torch.randn(8, 16))
    x = torch.randn(5, 16)
    m = _export(mod, x, tmp_path / "m.onnx", dynamo=True)
    assert sum(n.op_type == "MatMul" for n in m.graph.node) >= 2
    _check(m, x, (16, 128, 128, 4), "relu")
    assert find_chains(m).refusals == []


@pytest.mark.parametrize("api", ["parametrizations", "legacy"])
@pytest.mark.parametrize("dynamo", [False, True])
def test_weight_norm_layers_are_one_chain(tmp_path, dynamo, api):
    """torch's weight_norm (DeepSDF, NeRF variants, audio models): the dynamo exporter computes each weight
    in the graph (ReduceL2, Div, Mul on g and v) for weights as large as 128 x 128 (it folds small ones
    itself); the constant folding takes them, so the layers are one chain and the parameters' nodes go
    with the fused node."""
    torch.manual_seed(0)
    wn = nn.utils.parametrizations.weight_norm if api == "parametrizations" else nn.utils.weight_norm
    mod = nn.Sequential(wn(nn.Linear(3, 128)), nn.ReLU(), wn(nn.Linear(128, 128)), nn.ReLU(), wn(nn.Linear(128, 2)))
    with torch.no_grad():   # g away from ||v||, so that a weight read as v alone would not pass
        for lin in (mod[0], mod[2], mod[4]):
            g = lin.parametrizations.weight.original0 if api == "parametrizations" else lin.weight_g
            g.mul_(torch.linspace(0.5, 2.0, g.shape[0]).reshape(g.shape))
    x = torch.randn(5, 3)
    m = _export(mod, x, tmp_path / "m.onnx", dynamo=dynamo)
    _check(m, x, (3, 128, 128, 2), "relu")
    r = rewrite(m, find_chains(m), [find_chains(m).chains[0].to_spec("fp32")])
    assert [n.op_type for n in r.graph.node if n.domain == ""] == [], [n.op_type for n in r.graph.node]


@pytest.mark.parametrize("order", ["bn_relu", "relu_bn"])
@pytest.mark.parametrize("trained", [True, False], ids=["trained", "fresh"])
@pytest.mark.parametrize("dynamo", [False, True])
def test_batchnorm1d_after_linear_joins_the_chain(tmp_path, dynamo, trained, order):
    """A tabular MLP: Linear, BatchNorm1d, ReLU, Dropout (or Linear, ReLU, BatchNorm1d). The TorchScript
    exporter keeps the BatchNormalization nodes (the dynamo exporter folds them into the Linear when they
    follow it): either way one chain of plain ReLUs, the BatchNorms folded into the layer before them or
    after them, with statistics that are not the identity's."""
    torch.manual_seed(0)
    def block(k, n):
        return ([nn.Linear(k, n), nn.BatchNorm1d(n), nn.ReLU()] if order == "bn_relu"
                else [nn.Linear(k, n), nn.ReLU(), nn.BatchNorm1d(n)])
    mod = nn.Sequential(*block(8, 16), nn.Dropout(0.2), *block(16, 16), nn.Linear(16, 3))
    mod.train()
    with torch.no_grad():
        for _ in range(3 if trained else 0):   # running statistics away from (0, 1); fresh: all equal
            mod(torch.randn(64, 8) * 4 + 1)
    x = torch.randn(5, 8) * 3
    m = _export(mod, x, tmp_path / "m.onnx", dynamo=dynamo)
    if not dynamo:
        assert sum(n.op_type == "BatchNormalization" for n in m.graph.node) == 2
    plan = find_chains(m)
    assert [c.widths for c in plan.chains] == [(8, 16, 16, 3)], plan.describe()
    # folded into the layers (as the dynamo exporter folds it): the plain ReLU chain
    assert [describe_expr(a) for a in plan.chains[0].activations] == ["relu", "relu", "id"]
    r = rewrite(m, plan, [plan.chains[0].to_spec("fp32")])
    xa = x.numpy()
    (a,), (b,) = run(m, {"x" if not dynamo else m.graph.input[0].name: xa}), \
        run(r, {"x" if not dynamo else r.graph.input[0].name: xa})
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)


class _Standardise(nn.Module):
    """Input normalisation as models write it: buffers for the feature statistics."""

    def __init__(self, mean, std):
        super().__init__()
        self.register_buffer("mean", mean)
        self.register_buffer("std", std)

    def forward(self, x):
        return (x - self.mean) / self.std


class _ToUnitCube(nn.Module):
    def forward(self, x):   # NeRF-style: coordinates in [0, 1] to [-1, 1]
        return x * 2 - 1


@pytest.mark.parametrize("front", ["batchnorm", "standardise", "unit_cube"])
@pytest.mark.parametrize("dynamo", [False, True])
def test_input_normalisation_folds_into_the_first_layer(tmp_path, dynamo, front):
    """An MLP that normalises its input first (a tabular model's BatchNorm1d on the features, buffers of
    mean and std, x * 2 - 1): the normalisation folds into the first layer, so that the chain reads the
    model's input and no stock op is left in front of it."""
    torch.manual_seed(1)
    if front == "batchnorm":
        norm = nn.BatchNorm1d(6)
        with torch.no_grad():
            norm.running_mean.copy_(torch.rand(6) * 2)
            norm.running_var.copy_(torch.rand(6) * 3 + 0.5)
            norm.weight.copy_(torch.rand(6) + 0.5)
            norm.bias.copy_(torch.randn(6) * 0.1)
    elif front == "standardise":
        norm = _Standardise(torch.rand(6) * 3, torch.rand(6) * 2 + 1)
    else:
        norm = _ToUnitCube()
    mod = nn.Sequential(norm, nn.Linear(6, 16), nn.SiLU(), nn.Linear(16, 2))
    x = torch.rand(5, 6) * 2
    m = _export(mod, x, tmp_path / "m.onnx", dynamo=dynamo)
    plan = find_chains(m)
    (c,) = plan.chains
    name = m.graph.input[0].name
    assert c.widths == (6, 16, 2) and c.input == name and plan.refusals == [], plan.describe()
    assert "folded into layer 1" in c.describe()
    r = rewrite(m, plan, [c.to_spec("fp32")])
    assert len(r.graph.node) == 1, [n.op_type for n in r.graph.node]
    (a,), (b,) = run(m, {name: x.numpy()}), run(r, {name: x.numpy()})
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dynamo", [False, True])
def test_flatten_between_linears_is_one_chain(tmp_path, dynamo):
    """nn.Flatten after a hidden layer (a no-op on [B, N]; the TorchScript exporter keeps the node)."""
    torch.manual_seed(2)
    mod = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Flatten(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    x = torch.randn(5, 8)
    c = _check(_export(mod, x, tmp_path / "m.onnx", dynamo=dynamo), x, (8, 16, 16, 4), "relu")
    assert c.activation_labels() == ["relu", "relu", "id"]


@pytest.mark.parametrize("block", ["mlp", "norm_residual", "residual"])
@pytest.mark.parametrize("dynamo", [False, True])
def test_hf_conv1d_mlp_is_one_chain(tmp_path, dynamo, block):
    """GPT-2's MLP (HF Conv1D: view to [-1, K], addmm, view back) with its tanh GELU between the views:
    one chain of one GELU, not two one-layer chains with the GELU a stock op; with the block's LayerNorm
    in front and residual behind (the views then inside the chain) one fused node is the whole graph
    (the Shape -> Gather -> Concat nodes that computed the views' shapes go with it), matching the
    original at other batch and sequence sizes than the export's."""
    torch.manual_seed(3)
    mod = GPT2FFN(16, 64, norm=block == "norm_residual", residual=block != "mlp")
    m = load_model(export(mod, tmp_path / "m.onnx", dynamo))
    plan = find_chains(m)
    (c,) = plan.chains
    assert c.widths == (16, 64, 16) and c.activations == [ex.gelu_tanh(), ex.identity()], plan.describe()
    assert (c.norm is not None, c.residual) == (block == "norm_residual", block != "mlp")
    r = rewrite(m, plan, [c.to_spec("fp32")])
    onnx.checker.check_model(r, full_check=True)
    if block != "mlp":
        assert c.input == m.graph.input[0].name and [n.domain for n in r.graph.node] == ["onnx2fused"]
    for shape in ((3, 5, 16), (1, 1, 16)):
        xa = torch.randn(*shape).numpy()
        (a,), (b,) = run(m, {"x": xa}), run(r, {"x": xa})
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("style", ["llama", "gemma"])
@pytest.mark.parametrize("dynamo", [False, True])
def test_hf_rmsnorm_blocks_fuse_whole(tmp_path, dynamo, style, dtype):
    """LLaMA's and Gemma's FFN block with HF's RMSNorm code (the norm in float32, rounded back to the
    model's type before or after the weight): the norm with its Casts, the gated layer and the residual
    are one fused node reading x, in a float32 and a float16 model; the rewritten model matches."""
    torch.manual_seed(5)
    m = load_model(export(GatedFFN(16, 40, style), tmp_path / "m.onnx", dynamo, dtype=getattr(torch, dtype)))
    plan = find_chains(m)
    (c,) = plan.chains
    assert c.widths == (16, 40, 16) and c.norm is not None and c.norm.kind == "rmsnorm" and c.residual, plan.describe()
    assert c.input == m.graph.input[0].name and plan.refusals == []
    r = rewrite(m, plan, [c.to_spec("fp32")])
    onnx.checker.check_model(r, full_check=True)
    assert [n.domain for n in r.graph.node] == ["onnx2fused"]
    tol = 1e-5 if dtype == "float32" else 2e-2
    for shape in ((3, 5, 16), (1, 1, 16)):
        xa = torch.randn(*shape).to(getattr(torch, dtype)).numpy()
        (a,), (b,) = run(m, {"x": xa}), run(r, {"x": xa})
        assert b.dtype == a.dtype
        np.testing.assert_allclose(b.astype(np.float32), a.astype(np.float32), rtol=tol, atol=tol)


@pytest.mark.parametrize("dynamo", [False, True])
def test_resnet_tabular_blocks_fold_their_batchnorm_and_take_the_residual(tmp_path, dynamo):
    """RTDL's ResNet (an input layer, two blocks x + MLP(BN(x)), the head BN -> ReLU -> Linear): each block is
    one fused node reading its x, the BatchNorm folded into its first layer and x added behind it; the
    BatchNorm statistics are not the identity's."""
    torch.manual_seed(2)
    d = 24
    mod = tabular_resnet(d_in=7, d=d, hidden=48)
    x = torch.randn(5, 7)
    m = _export(mod, x, tmp_path / "m.onnx", dynamo=dynamo)
    plan = find_chains(m)
    res = [c for c in plan.chains if c.residual]
    assert [c.widths for c in res] == [(d, 48, d)] * 2, plan.describe()
    assert all("folded into layer 1" in c.describe() for c in res), plan.describe()
    assert res[1].input == res[0].output   # the second block reads the first one's sum, and adds it
    r = rewrite(m, plan, [c.to_spec("fp32") for c in plan.chains])
    ops = [n.op_type for n in r.graph.node]
    assert "Add" not in ops and ops.count("BatchNormalization") <= 1, ops   # (the head's BatchNorm stays)
    name = m.graph.input[0].name
    (a,), (b,) = run(m, {name: x.numpy()}), run(r, {name: x.numpy()})
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)
