"""convert with default options on the GPU host, end to end (issue 14), against stock ONNX Runtime.

- The provider matrix's CUDA rows: a library with CUDA on [CUDA, CPU] runs both fused nodes on the CUDA
  EP, on [CPU] both on the CPU EP (the generated kernel and the stock body), and without the plugin the
  functions are inlined; all match stock.
- Automatic precision: every zoo model, and the cases that fp16 refused (a SIREN from both exporters, an
  intermediate feeding two chains, a Pow with exponent 6, a head whose activations overflow fp16), convert
  with defaults and match stock on the CUDA EP; the report names each chain's precision and why.
- The first run after a fresh convert in the same process is as fast as in a new process.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from gpu_support import rel_l2, require_cuda  # noqa: E402

pytestmark = pytest.mark.gpu
ort, torch = require_cuda()

import onnx2fused  # noqa: E402
from onnx2fused.spec import DOMAIN  # noqa: E402

from onnx_builders import G, fp16_keep_io, skip_mlp  # noqa: E402
from test_precision import siren  # noqa: E402
from test_provider_matrix import two_chain_model  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
ZOO = json.loads((ROOT / "models" / "zoo.json").read_text())
# every zoo model, the gated blocks (swiglu, geglu) and transformer blocks (preln, llama) included: a CUDA
# library fuses the gated layers and the blocks' norms and residual Adds (resident/streamed kernels), and
# the result must convert and match stock
ZOO_FILES = [(m, kind) for m in ZOO["models"] for kind in sorted(m["files"])]
TOL = {"fp16": 2e-3, "bf16": 1e-2, "tf32": 1e-3, "fp32": 1e-5}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("gpu_convert_cache")


def stock(path, feeds):
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"]).run(None, feeds)


def session(path, library, providers, profile_dir=None):
    so = ort.SessionOptions()
    if library is not None:
        so.register_custom_ops_library(str(library))
    if profile_dir is not None:
        so.enable_profiling = True
        so.profile_file_prefix = str(Path(profile_dir) / "prof")
    return ort.InferenceSession(str(path), so, providers=providers)


def ran_on(sess) -> dict[str, str]:
    events = json.loads(Path(sess.end_profiling()).read_text())
    return {e["args"]["op_name"]: e["args"].get("provider", "") for e in events
            if e.get("cat") == "Node" and "op_name" in e.get("args", {})}


def check_defaults(src: Path, out: Path, cache, feeds_of) -> onnx2fused.ConversionResult:
    """convert with default options; the fused model through plain onnxruntime on the CUDA EP matches
    stock within the loosest tolerance of the chains' precisions."""
    res = onnx2fused.convert(src, out, cache_dir=cache)
    assert res.with_cuda and res.validation.provider == "CUDAExecutionProvider" and res.validation.passed
    assert all(c.precision in TOL and c.precision_why for c in res.chains)
    text = res.format()
    assert all(f"precision {c.precision}: " in text for c in res.chains)
    # the loosest chain precision's tolerance, or what validation allowed an ill-conditioned chain (a SIREN:
    # NOISE_FACTOR x stock fp32's own distance from float64 accumulation)
    tol = max(max(TOL[c.precision] for c in res.chains), res.validation.tolerance)
    feeds = feeds_of(np.random.default_rng(7))
    ref = stock(src, feeds)
    got = session(out, res.library_path, ["CUDAExecutionProvider", "CPUExecutionProvider"]).run(None, feeds)
    for g, r in zip(got, ref):
        if np.issubdtype(r.dtype, np.floating):
            assert rel_l2(g, r) <= tol
    return res


def test_provider_matrix_on_cuda_ep(cache, tmp_path):
    src = tmp_path / "two.onnx"
    onnx.save(two_chain_model(), str(src))
    res = onnx2fused.convert(src, tmp_path / "two.fused.onnx", cache_dir=cache)
    ops = {c.name for c in res.chains}
    x = np.random.default_rng(1).standard_normal((1031, 16)).astype(np.float32)
    ref = stock(src, {"x": x})[0]
    tol = max(TOL[c.precision] for c in res.chains)
    rows = {"cuda": (res.library_path, ["CUDAExecutionProvider", "CPUExecutionProvider"], "CUDAExecutionProvider"),
            "cpu": (res.library_path, ["CPUExecutionProvider"], "CPUExecutionProvider"),
            "none": (None, ["CUDAExecutionProvider", "CPUExecutionProvider"], None)}
    for name, (lib, providers, where) in rows.items():
        sess = session(res.output_path, lib, providers, tmp_path)
        y = sess.run(None, {"x": x})[0]
        if name == "none":  # stock ops on the CUDA EP (TF32 GEMMs by default): as the original runs there
            ref_here = session(src, None, providers).run(None, {"x": x})[0]
            assert rel_l2(y, ref_here) <= 1e-5, name
        else:
            assert rel_l2(y, ref) <= (tol if name == "cuda" else 1e-4), name
        ran = ran_on(sess)
        if where is None:
            assert not ops & ran.keys(), ran
        else:
            assert {ran[o] for o in ops} == {where}, (name, ran)


@pytest.mark.parametrize("entry,kind", ZOO_FILES, ids=[f"{m['name']}.{k}" for m, k in ZOO_FILES])
def test_zoo_converts_with_defaults(entry, kind, cache, tmp_path):
    f = entry["files"][kind]
    dims = [37 if d == "batch" else 3 if isinstance(d, str) else d for d in f["input_dims"]]
    check_defaults(ROOT / "models" / f["file"], tmp_path / "m.onnx", cache,
                   lambda rng: {entry["input"]: rng.standard_normal(dims).astype(np.float32)})


@pytest.mark.parametrize("zoo", ["nerf", "gelu", "silu", "preln", "swiglu"])
def test_ort_optimised_zoo_model_converts_with_defaults(zoo, cache, tmp_path):
    """The zoo model as ORT's extended graph optimisations save it (FusedGemm, Gelu, QuickGelu:
    test_passes_ort_ops.py) converts to the chain of its export and matches stock on the CUDA EP."""
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    so.optimized_model_filepath = str(tmp_path / "opt.onnx")
    ort.InferenceSession(str(ROOT / "models" / f"{zoo}.opset17.onnx"), so, providers=["CPUExecutionProvider"])
    opt = onnx.load(str(tmp_path / "opt.onnx"))
    assert any(n.domain == "com.microsoft" for n in opt.graph.node)
    entry = next(m for m in ZOO["models"] if m["name"] == zoo)
    dims = [1031 if isinstance(d, str) else d for d in entry["files"]["opset17"]["input_dims"]]
    res = check_defaults(tmp_path / "opt.onnx", tmp_path / "m.onnx", cache,
                         lambda rng: {entry["input"]: rng.standard_normal(dims).astype(np.float32)})
    assert len(res.chains) == 1 and list(res.chains[0].widths) == entry["widths"]


def vit_ffn_block(path: Path, act, layerscale: bool = False, opset: int = 17) -> Path:
    """x + [gamma *] fc2(act(fc1(LN(x)))) at ViT-B's widths (768 -> 3072 -> 768), rows [S, B, 768]."""
    class Block(torch.nn.Module):
        def __init__(self, d=768):
            super().__init__()
            self.n = torch.nn.LayerNorm(d)
            self.f = torch.nn.Sequential(torch.nn.Linear(d, 4 * d), act, torch.nn.Linear(4 * d, d))
            self.gamma = torch.nn.Parameter(torch.rand(d) * 0.1 + 0.01) if layerscale else None

        def forward(self, x):
            y = self.f(self.n(x))
            return x + (self.gamma * y if self.gamma is not None else y)

    torch.manual_seed(0)
    torch.onnx.export(Block().eval(), (torch.randn(5, 2, 768),), str(path), input_names=["x"], opset_version=opset,
                      dynamo=False, dynamic_axes={"x": {0: "s", 1: "b"}})
    return path


def _check_vit_block(src: Path, cache, tmp_path):
    res = check_defaults(src, tmp_path / "m.onnx", cache,
                         lambda rng: {"x": rng.standard_normal((77, 3, 768)).astype(np.float32)})
    (c,) = res.chains
    return c


def test_layerscale_block_folds_into_the_wide_design(cache, tmp_path):
    """A ViT block with LayerScale (x + gamma * FFN(LN(x)): DeiT-III, CaiT, DINOv2): gamma folds into the
    last layer, so the block runs in the wide design (it ran in the streamed kernel, 18 MB of weights
    through a narrow kernel) and matches stock on the CUDA EP."""
    c = _check_vit_block(vit_ffn_block(tmp_path / "ls.onnx", torch.nn.GELU(), layerscale=True), cache, tmp_path)
    assert c.activations == ["gelu", "id"] and "wide" in c.cuda_plan, c.cuda_plan


def test_clip_quickgelu_block_runs_the_packed_form_in_the_wide_design(cache, tmp_path):
    """OpenAI CLIP's MLP block, x + c_proj(quick_gelu(c_fc(ln_2(x)))) with QuickGELU x sigmoid(1.702 x): the
    activation is named and evaluated in the packed fp16x2 form in the wide GEMM's epilogue; matches stock."""
    class QuickGELU(torch.nn.Module):
        def forward(self, x):
            return x * torch.sigmoid(1.702 * x)

    c = _check_vit_block(vit_ffn_block(tmp_path / "clip.onnx", QuickGELU()), cache, tmp_path)
    assert c.activations == ["quickgelu", "id"] and "wide" in c.cuda_plan and c.precision == "fp16", c


@pytest.mark.parametrize("name", ["nerf_std", "sdf_cube", "tabular_bn"])
def test_input_normalisation_folds_and_keeps_fp16(name, cache, tmp_path):
    """MLPs that normalise their input first ((x - mean) / std, x * 2 - 1, an input BatchNorm1d): the
    scale and shift fold into the first layer, the fused op reads the model's input and is the graph's
    only node, the chain keeps fp16 and matches stock on the CUDA EP."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from input_norm_models import export

    (src,) = export(tmp_path, (name,))
    k = onnx.load(str(src)).graph.input[0].type.tensor_type.shape.dim[1].dim_value
    res = check_defaults(src, tmp_path / "m.onnx", cache,
                         lambda rng: {"x": rng.uniform(0, 1, (1031, k)).astype(np.float32)})
    (c,) = res.chains
    assert c.precision == "fp16", c
    fused = onnx.load(str(res.output_path))
    assert [(n.domain, list(n.input[:1])) for n in fused.graph.node] == [(DOMAIN, ["x"])]


@pytest.mark.parametrize("name", ["gelu", "tabular"])
def test_float16_model_with_float32_io_is_one_float32_op(name, cache, tmp_path):
    """A zoo model as onnxconverter-common's float16 conversion with keep_io_types=True writes it (float16
    inside, Casts at the ends; it fused nothing before): one fused op reading x and writing y in float32,
    matching stock ORT running the float16 model."""
    src = tmp_path / "f16.onnx"
    onnx.save(fp16_keep_io(onnx.load(str(ROOT / "models" / f"{name}.opset17.onnx"))), str(src))
    k = next(m for m in ZOO["models"] if m["name"] == name)["widths"][0]
    res = check_defaults(src, tmp_path / "m.onnx", cache,
                         lambda rng: {"x": rng.standard_normal((1031, k)).astype(np.float32)})
    fused = onnx.load(str(res.output_path))
    assert [(n.domain, list(n.input[:1]), list(n.output)) for n in fused.graph.node] == [(DOMAIN, ["x"], ["y"])]


def test_vit_block_exported_below_opset_17_is_one_block(cache, tmp_path):
    """ViT-B's pre-LN FFN block exported at opset 14, where nn.LayerNorm becomes ReduceMean, Sub, Pow, ...:
    the norm and the residual join the chain as at opset 17 (the wide design) and it matches stock."""
    c = _check_vit_block(vit_ffn_block(tmp_path / "vit14.onnx", torch.nn.GELU(), opset=14), cache, tmp_path)
    assert c.activations == ["gelu", "id"] and "wide" in c.cuda_plan and "_ln_gelu_id_res_" in c.name, c


def torch_siren(dynamo: bool, path: Path) -> Path:
    class Sine(torch.nn.Module):
        def forward(self, x):
            return torch.sin(30.0 * x)
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(3, 64), Sine(), torch.nn.Linear(64, 64), Sine(), torch.nn.Linear(64, 1))
    kw = dict(dynamo=True) if dynamo else dict(dynamo=False, opset_version=17)
    torch.onnx.export(m, (torch.randn(4, 3),), str(path), input_names=["x"], output_names=["y"],
                      dynamic_axes={"x": {0: "batch"}}, **kw)
    return path


@pytest.mark.parametrize("dynamo", [False, True], ids=["opset17", "dynamo"])
def test_siren_converts_with_defaults(dynamo, cache, tmp_path):
    src = torch_siren(dynamo, tmp_path / "siren.onnx")
    res = check_defaults(src, tmp_path / "s.onnx", cache,
                         lambda rng: {"x": rng.uniform(-1, 1, (257, 3)).astype(np.float32)})
    assert res.chains[0].precision != "fp16"


def test_handbuilt_siren_and_pow6_and_shared_intermediate(cache, tmp_path):
    src = tmp_path / "siren.onnx"
    onnx.save(siren(), str(src))
    check_defaults(src, tmp_path / "s.onnx", cache, lambda rng: {"x": rng.standard_normal((99, 3)).astype(np.float32)})

    g = G(seed=2)  # Pow with exponent 6: values far outside the fp16 range for |h| > 6.3
    h = g.linear("x", 16, 64)
    h = g.op("Pow", [h, g.init(np.array(6.0, np.float32))])
    g.linear(h, 64, 8)
    g.nodes[-1].output[0] = "y"
    src = tmp_path / "pow6.onnx"
    onnx.save(g.model([("x", ["batch", 16])], [("y", ["batch", 8])]), str(src))
    check_defaults(src, tmp_path / "p.onnx", cache, lambda rng: {"x": rng.standard_normal((50, 16)).astype(np.float32)})

    g = G(seed=3)  # one intermediate feeds two chains
    h = g.op("Relu", [g.linear("x", 32, 64)])
    a = g.op("Relu", [g.linear(h, 64, 64)])
    g.linear(a, 64, 4)
    g.nodes[-1].output[0] = "y1"
    b = g.op("Tanh", [g.linear(h, 64, 32)])
    g.linear(b, 32, 2)
    g.nodes[-1].output[0] = "y2"
    src = tmp_path / "shared.onnx"
    onnx.save(g.model([("x", ["batch", 32])], [("y1", ["batch", 4]), ("y2", ["batch", 2])]), str(src))
    res = check_defaults(src, tmp_path / "sh.onnx", cache,
                         lambda rng: {"x": rng.standard_normal((300, 32)).astype(np.float32)})
    assert len(res.chains) == 3


@pytest.mark.slow
def test_large_head_overflowing_fp16_converts_with_defaults(cache, tmp_path):
    """9216 -> 4096 -> 4096 -> 1000 with activations beyond 65504 on its inputs (AlexNet-style head)."""
    g = G(seed=4)
    h = g.op("Relu", [g.linear("x", 9216, 4096)])
    h = g.op("Relu", [g.linear(h, 4096, 4096)])
    g.linear(h, 4096, 1000)
    g.nodes[-1].output[0] = "y"
    m = g.model([("x", ["batch", 9216])], [("y", ["batch", 1000])])
    for t in m.graph.initializer[:2]:  # scale the first layer so its outputs reach ~1e5
        t.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(t) * np.float32(3e4), t.name))
    src = tmp_path / "head.onnx"
    onnx.save(m, str(src))
    res = check_defaults(src, tmp_path / "h.onnx", cache,
                         lambda rng: {"x": rng.standard_normal((64, 9216)).astype(np.float32)})
    assert res.chains[0].precision != "fp16" and "overflow" in res.chains[0].precision_why


FIRST_RUN = r"""
import sys, numpy as np, onnxruntime as ort, torch
sys.path.insert(0, sys.argv[1])
from timing_support import time_fused
print(time_fused(sys.argv[2], sys.argv[3], int(sys.argv[4])))
"""


def test_first_run_after_fresh_convert_is_not_slower(tmp_path):
    """Issue 14 §6: the fused model timed in the process that converted it (cold cache) runs as fast as
    in a new process with the cache warm. Three rounds in turns, the best of each side: under xdist other
    workers share the GPU, and one round taken during their kernels measured 0.125 against 0.054 ms."""
    from timing_support import time_fused
    src = ROOT / "models" / "mnist.opset17.onnx"
    res = onnx2fused.convert(src, tmp_path / "m.onnx", cache_dir=tmp_path / "cold")
    sames, freshes = [], []
    for _ in range(3):
        sames.append(time_fused(res.output_path, res.library_path, 4096))
        p = subprocess.run([sys.executable, "-c", FIRST_RUN, str(Path(__file__).parent), res.output_path,
                            res.library_path, "4096"], capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr
        freshes.append(float(p.stdout.split()[-1]))
    same, fresh = min(sames), min(freshes)
    print(f"fused mnist at 4096 rows: {sames} ms in the converting process, {freshes} ms in new ones")
    assert same <= 1.25 * fresh + 0.01


@pytest.mark.parametrize("kind", ["ts", "dynamo"])
@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("style", ["llama", "gemma"])
def test_hf_rmsnorm_blocks_fuse_whole(style, dtype, kind, cache, tmp_path):
    """LLaMA's and Gemma's FFN block with HF's RMSNorm code (normalised in float32, rounded back to the
    model's type before or after the weight; the float32 TorchScript export keeps its Casts to float):
    one fused node reading x, matching stock on the CUDA EP, in a float16 and a float32 model."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from hf_rmsnorm_blocks import GatedFFN
    from gpt2_blocks import export

    torch.manual_seed(6)
    src = export(GatedFFN(64, 172, style), tmp_path / f"{style}.{kind}.onnx", kind == "dynamo",
                 dtype=getattr(torch, dtype))
    res = check_defaults(src, tmp_path / "m.onnx", cache,
                         lambda rng: {"x": rng.standard_normal((3, 347, 64)).astype(dtype)})
    (c,) = res.chains
    fused = onnx.load(str(res.output_path))
    assert [(n.domain, list(n.input[:1])) for n in fused.graph.node] == [(DOMAIN, ["x"])]


@pytest.mark.parametrize("kind", ["ts", "dynamo"])
@pytest.mark.parametrize("name", ["gpt2_mlp", "gpt2_ffn"])
def test_gpt2_conv1d_blocks_fuse_whole(name, kind, cache, tmp_path):
    """GPT-2's MLP as HF's Conv1D writes it (views around each addmm, the tanh GELU between them) is one
    chain with its GELU; with the block's LayerNorm and residual the fused op is the graph's only node,
    reading x [B, T, 64]; both match stock on the CUDA EP at a batch and sequence other than the export's."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from gpt2_blocks import GPT2FFN, export

    torch.manual_seed(4)
    block = name == "gpt2_ffn"
    src = export(GPT2FFN(64, 256, norm=block, residual=block), tmp_path / f"{name}.{kind}.onnx", kind == "dynamo")
    res = check_defaults(src, tmp_path / "m.onnx", cache,
                         lambda rng: {"x": rng.standard_normal((3, 347, 64)).astype(np.float32)})
    (c,) = res.chains
    assert c.activations == ["gelutanh", "id"], c
    if block:
        fused = onnx.load(str(res.output_path))
        assert [(n.domain, list(n.input[:1])) for n in fused.graph.node] == [(DOMAIN, ["x"])]


def test_nerf_mlp_wide_first_layers_on_cuda_ep(cache, tmp_path):
    """The original NeRF MLP (benchmarks/nerf_mlp.py): its trunk with the skip Concat is one chain (the x
    part of layer 6 re-read in the wgmma kernel), its view head reads 283 features (plan.wgmma.FIRST_WIDTH_MAX:
    wider than the hidden layers' 256), rows that are not 16-byte aligned; converted with defaults, both run
    in the wgmma design on Hopper and the model matches stock on the CUDA EP at batch sizes past a tile, a
    pass and a wave."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from nerf_mlp import NeRF, export

    torch.manual_seed(5)
    src = export(NeRF(), tmp_path / "nerf_mlp.onnx")
    res = check_defaults(src, tmp_path / "m.onnx", cache,
                         lambda rng: {"x": rng.standard_normal((100003, 90)).astype(np.float32)})
    sess = session(res.output_path, res.library_path, ["CUDAExecutionProvider", "CPUExecutionProvider"])
    rng = np.random.default_rng(8)
    for rows in (1, 63, 129):
        feeds = {"x": rng.standard_normal((rows, 90)).astype(np.float32)}
        assert rel_l2(sess.run(None, feeds)[0], stock(src, feeds)[0]) <= TOL["fp16"], rows
    # one op: the trunk reads x (skip_merge.py), x joins layers 6 and 9, the density rides the view head
    # (head_fold.py) and the op writes the model's output
    (chain,) = res.chains
    assert list(chain.widths) == [90] + [256] * 8 + [130, 4] and "_skip5_8_" in chain.name, chain.name
    if torch.cuda.get_device_capability(0) == (9, 0):
        assert "wgmma (sm_90a)" in chain.cuda_plan, chain.cuda_plan


def test_nerf_pl_on_cuda_ep(cache, tmp_path):
    """kwea123's nerf_pl (benchmarks/nerf_mlp.py NeRFPL: the skip before the fifth layer, a Sigmoid on rgb):
    one op whose last layer's Sigmoid is masked off the density, converted with defaults, matching stock on
    the CUDA EP at 1, 63, 129 and 100003 rows."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from nerf_mlp import NeRFPL, export
    torch.manual_seed(6)
    src = export(NeRFPL(), tmp_path / "nerf_pl.onnx")
    res = check_defaults(src, tmp_path / "m.onnx", cache,
                         lambda rng: {"x": rng.standard_normal((100003, 90)).astype(np.float32)})
    (chain,) = res.chains
    assert "_skip4_8_" in chain.name and chain.activations[-1] == "sigmoid[3 of 4]", (chain.name, chain.activations)
    sess = session(res.output_path, res.library_path, ["CUDAExecutionProvider", "CPUExecutionProvider"])
    rng = np.random.default_rng(8)
    for rows in (1, 63, 129):
        feeds = {"x": rng.standard_normal((rows, 90)).astype(np.float32)}
        assert rel_l2(sess.run(None, feeds)[0], stock(src, feeds)[0]) <= TOL["fp16"], rows


def test_fourier_feature_mlp_on_cuda_ep(cache, tmp_path):
    """Tancik's Fourier-feature MLP (benchmarks/fourier_mlp.py: sin and cos of 2 pi B x, sigma 10, concatenated):
    one chain whose first layer is the pair as one sin layer (arguments of a few hundred), matching stock on
    the CUDA EP at 1, 129 and 70001 rows."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from fourier_mlp import FourierMLP
    from nerf_mlp import export
    torch.manual_seed(3)
    src = export(FourierMLP(), tmp_path / "ff.onnx", 2)
    res = check_defaults(src, tmp_path / "m.onnx", cache,
                         lambda rng: {"x": rng.uniform(0, 1, (70001, 2)).astype(np.float32)})
    assert len(res.chains) == 1 and list(res.chains[0].widths[:2]) == [2, 256], [c.widths for c in res.chains]
    sess = session(res.output_path, res.library_path, ["CUDAExecutionProvider", "CPUExecutionProvider"])
    rng = np.random.default_rng(2)
    for rows in (1, 129):
        feeds = {"x": rng.uniform(0, 1, (rows, 2)).astype(np.float32)}
        assert rel_l2(sess.run(None, feeds)[0], stock(src, feeds)[0]) <= TOL[res.chains[0].precision], rows


@pytest.mark.parametrize("x_first,design", [(True, "auto"), (False, "auto"), (True, "wgmma"), (False, "streamed")])
def test_skip_chain_on_cuda_ep(cache, tmp_path, monkeypatch, x_first, design):
    """A skip Concat of the chain's input (21 features: element-wise loads; hidden layers of 100, padded)
    in either order is one chain, its kernel (the resident mma.sync one by default; wgmma and streamed
    forced) matching stock on the CUDA EP at 1, 63, 129 and 100003 rows; rank-3 input."""
    monkeypatch.setenv("ONNX2FUSED_CUDA_DESIGN", design)
    model = skip_mlp(21, [100, 100, 72, 5], at=2, x_first=x_first, act="Tanh", rank=3)
    src = tmp_path / "skip.onnx"
    onnx.save(model, str(src))
    res = check_defaults(src, tmp_path / "m.onnx", cache,
                         lambda rng: {"x": rng.standard_normal((3, 33335, 21)).astype(np.float32)})
    assert len(res.chains) == 1 and "_skip2_" in res.chains[0].name
    expected = {"auto": "resident weights", "streamed": "streamed weights", "wgmma": "wgmma (sm_90a)"}[design]
    assert res.chains[0].cuda_plan.startswith("GPU: " + expected), res.chains[0].cuda_plan
    sess = session(res.output_path, res.library_path, ["CUDAExecutionProvider", "CPUExecutionProvider"])
    rng = np.random.default_rng(4)
    for rows in (1, 63, 129):
        feeds = {"x": rng.standard_normal((1, rows, 21)).astype(np.float32)}
        assert rel_l2(sess.run(None, feeds)[0], stock(src, feeds)[0]) <= TOL[res.chains[0].precision], rows


@pytest.mark.parametrize("design", ["auto", "wgmma", "streamed"])
def test_joined_chain_with_two_skips_on_cuda_ep(cache, tmp_path, monkeypatch, design):
    """NeRF in small (tests/test_skip.py's _nerf_like: x cut by a Split, the trunk's skip, the view head
    reading Concat(h, views)) joined into one chain with skip layers 1 and 2 reading x (skip_merge.py); each
    CUDA design (resident by default at these widths) matches stock on the CUDA EP at 1, 63, 129 and 70001 rows."""
    from test_skip import _nerf_like
    monkeypatch.setenv("ONNX2FUSED_CUDA_DESIGN", design)
    src = tmp_path / "nerf_like.onnx"
    onnx.save(_nerf_like(), str(src))
    res = check_defaults(src, tmp_path / "m.onnx", cache,
                         lambda rng: {"x": rng.standard_normal((70001, 20)).astype(np.float32)})
    assert len(res.chains) == 1 and "_skip1_2_" in res.chains[0].name, [c.name for c in res.chains]
    expected = {"auto": "resident weights", "streamed": "streamed weights", "wgmma": "wgmma (sm_90a)"}[design]
    assert res.chains[0].cuda_plan.startswith("GPU: " + expected), res.chains[0].cuda_plan
    sess = session(res.output_path, res.library_path, ["CUDAExecutionProvider", "CPUExecutionProvider"])
    rng = np.random.default_rng(9)
    for rows in (1, 63, 129):
        feeds = {"x": rng.standard_normal((rows, 20)).astype(np.float32)}
        assert rel_l2(sess.run(None, feeds)[0], stock(src, feeds)[0]) <= TOL[res.chains[0].precision], rows


@pytest.mark.parametrize("design", ["auto", "wgmma", "streamed", "resident"])
def test_headed_chain_on_cuda_ep(cache, tmp_path, monkeypatch, design):
    """A density-like head (3 outputs, first in the output Concat, exp of a linear layer) reading x beside a
    view head whose first layer reads Concat(x, v) rides it as [a, -a] through its ReLU layers (head_fold.py),
    the last layer's Sigmoid on its own columns and the head's Exp on the head's (a per-column select); each
    CUDA design writes the Concat and matches stock on the CUDA EP at 1, 63, 129 and 70001 rows."""
    from test_head_fold import headed_mlp
    monkeypatch.setenv("ONNX2FUSED_CUDA_DESIGN", design)
    model = headed_mlp(widths=(40, 136, 72, 3), acts=("Relu", "Relu", "Sigmoid"), head=3, head_first=True, views=27,
                       head_act="Exp")
    src = tmp_path / "headed.onnx"
    onnx.save(model, str(src))
    res = check_defaults(src, tmp_path / "m.onnx", cache,
                         lambda rng: {"x": rng.standard_normal((70001, 40)).astype(np.float32),
                                      "v": rng.standard_normal((70001, 27)).astype(np.float32)})
    assert len(res.chains) == 1 and list(res.chains[0].widths) == [67, 142, 78, 6], res.chains[0].widths
    if design != "auto":
        expected = {"streamed": "streamed weights", "wgmma": "wgmma (sm_90a)", "resident": "resident weights"}[design]
        assert res.chains[0].cuda_plan.startswith("GPU: " + expected), res.chains[0].cuda_plan
    sess = session(res.output_path, res.library_path, ["CUDAExecutionProvider", "CPUExecutionProvider"])
    rng = np.random.default_rng(6)
    for rows in (1, 63, 129):
        feeds = {"x": rng.standard_normal((rows, 40)).astype(np.float32),
                 "v": rng.standard_normal((rows, 27)).astype(np.float32)}
        assert rel_l2(sess.run(None, feeds)[0], stock(src, feeds)[0]) <= TOL[res.chains[0].precision], rows


def test_resnet_tabular_blocks_on_cuda_ep(cache, tmp_path):
    """RTDL's ResNet for tabular data (x + MLP(BN(x)) blocks): each block one fused node with the BatchNorm
    folded into its first layer and x added behind, the head's BatchNorm as Mul + Add (stock ORT's cuDNN
    BatchNorm fails on these 70001 rows), converted with defaults and matching stock (CPU EP) on the CUDA
    EP at batch sizes past a tile and a wave."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from tabular_resnet import export, tabular_resnet
    torch.manual_seed(6)
    src = export(tabular_resnet(), tmp_path / "resnet.onnx", 20)
    res = check_defaults(src, tmp_path / "m.onnx", cache,
                         lambda rng: {"x": rng.standard_normal((70001, 20)).astype(np.float32)})
    fused = onnx.load(str(res.output_path))
    ops = [n.op_type for n in fused.graph.node]
    assert ops.count("Add") == 1 and "BatchNormalization" not in ops, ops   # (the head's shift)
    sess = session(res.output_path, res.library_path, ["CUDAExecutionProvider", "CPUExecutionProvider"])
    rng = np.random.default_rng(3)
    for rows in (1, 129):
        feeds = {"x": rng.standard_normal((rows, 20)).astype(np.float32)}
        assert rel_l2(sess.run(None, feeds)[0], stock(src, feeds)[0]) <= TOL["fp16"], rows


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
def test_pointnet_on_cuda_ep(dynamo, cache, tmp_path):
    """PointNet's classifier (benchmarks/pointnet.py): its five pointwise Conv1d one chain over channels-last
    rows (passes/pointwise_conv.py) with the max pool behind them (passes/pool.py: on Hopper the wgmma
    kernel's epilogue raises each cloud's maxima), its head a second chain; converted with defaults,
    matching stock on the CUDA EP at 1, 3 and 37 clouds of 1024 points."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from pointnet import PointNetCls, export
    torch.manual_seed(4)
    src = export(PointNetCls(), tmp_path / "pointnet.onnx", dynamo=dynamo)
    res = check_defaults(src, tmp_path / "m.onnx", cache,
                         lambda rng: {"x": rng.standard_normal((37, 3, 1024)).astype(np.float32)})
    assert [list(c.widths) for c in res.chains] == [[3, 64, 64, 64, 128, 1024], [1024, 512, 256, 40]]
    fused = onnx.load(str(res.output_path))
    assert [n.op_type for n in fused.graph.node if n.domain != DOMAIN] == ["Transpose"]
    assert "_poolmax_" in res.chains[0].name
    assert res.chains[0].cuda_plan.startswith("GPU: wgmma (sm_90a)"), res.chains[0].cuda_plan
    _matches_stock_at(res, src, [(1, 3, 1024), (3, 3, 1024)], seed=8)


def _matches_stock_at(res, src, shapes, seed):
    """The converted model's first output on the CUDA EP against stock ORT's at random inputs of each shape
    (fp16's tolerance)."""
    sess = session(res.output_path, res.library_path, ["CUDAExecutionProvider", "CPUExecutionProvider"])
    rng = np.random.default_rng(seed)
    for shape in shapes:
        feeds = {sess.get_inputs()[0].name: rng.standard_normal(shape).astype(np.float32)}
        assert rel_l2(sess.run(None, feeds)[0], stock(src, feeds)[0]) <= TOL["fp16"], shape


@pytest.mark.parametrize("pool", ["sum", "mean"])
def test_deep_sets_on_cuda_ep(pool, cache, tmp_path):
    """Deep Sets (benchmarks/deepsets.py): phi and its sum or mean over each set of 1024 one op (on Hopper the
    wgmma kernel adds each set's rows), rho a second chain; converted with defaults, matching stock on the
    CUDA EP at 1 and 5 sets."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from deepsets import DeepSets, export
    torch.manual_seed(5)
    src = export(DeepSets(pool), tmp_path / "deepsets.onnx")
    res = check_defaults(src, tmp_path / "m.onnx", cache,
                         lambda rng: {"x": rng.standard_normal((9, 1024, 3)).astype(np.float32)})
    assert [list(c.widths) for c in res.chains] == [[3, 256, 256, 256], [256, 256, 40]]
    assert f"_pool{pool}_" in res.chains[0].name
    assert res.chains[0].cuda_plan.startswith("GPU: wgmma (sm_90a)"), res.chains[0].cuda_plan
    _matches_stock_at(res, src, [(1, 1024, 3), (5, 1024, 3)], seed=9)


@pytest.mark.parametrize("mode", ["gap", "max"])
def test_cnn_head_global_pool_on_cuda_ep(mode, cache, tmp_path):
    """A CNN head's 1x1 convs and its global pool over a 7 x 7 map (test_pointwise_conv.ConvPoolHead): the
    positions flattened into one axis of rows, the pool in the op (49 rows a group: the mma.sync pool);
    converted with defaults, matching stock on the CUDA EP at 1 and 37 images."""
    import warnings
    from test_pointwise_conv import ConvPoolHead
    torch.manual_seed(6)
    src = tmp_path / "head.onnx"
    with warnings.catch_warnings():   # (the batch dynamic, the map 7 x 7)
        warnings.simplefilter("ignore")
        torch.onnx.export(ConvPoolHead(mode).eval(), (torch.randn(2, 16, 7, 7),), str(src), dynamo=False,
                          opset_version=17, input_names=["x"], dynamic_axes={"x": {0: "b"}})
    res = check_defaults(src, tmp_path / "m.onnx", cache,
                         lambda rng: {"x": rng.standard_normal((64, 16, 7, 7)).astype(np.float32)})
    assert [list(c.widths) for c in res.chains] == [[16, 32, 48]]
    assert ("_poolmeank_" if mode == "gap" else "_poolmaxk_") in res.chains[0].name
    _matches_stock_at(res, src, [(1, 16, 7, 7), (37, 16, 7, 7)], seed=10)


def test_pointwise_conv2d_head_on_cuda_ep(cache, tmp_path):
    """A 1x1 Conv2d head with SiLU on a feature map (test_pointwise_conv.ConvHead: a Transpose back for its
    map output, the mean pool over the channels-last rows), converted with defaults, matching stock on the
    CUDA EP at odd map sizes."""
    from test_pointwise_conv import ConvHead, _export
    torch.manual_seed(2)
    src = _export(ConvHead().eval(), torch.randn(2, 32, 6, 5), tmp_path / "head.onnx", False)
    res = check_defaults(src, tmp_path / "m.onnx", cache,
                         lambda rng: {"x": rng.standard_normal((3, 32, 97, 131)).astype(np.float32)})
    assert [list(c.widths) for c in res.chains] == [[32, 48, 5]]
    sess = session(res.output_path, res.library_path, ["CUDAExecutionProvider", "CPUExecutionProvider"])
    feeds = {"x": np.random.default_rng(3).standard_normal((1, 32, 7, 3)).astype(np.float32)}
    for got, ref in zip(sess.run(None, feeds), stock(src, feeds)):
        assert rel_l2(got, ref) <= TOL[res.chains[0].precision]


@pytest.mark.parametrize("design,precision,io,n", [("resident", "fp16", "f32", 5), ("streamed", "fp16", "f32", 5),
                                                   ("streamed", "bf16", "f16", 5), ("auto", "fp32", "f32", 5),
                                                   ("resident", "tf32", "f16", 5), ("streamed", "fp16", "f16", 8),
                                                   ("resident", "fp16", "f16", 8), ("wgmma", "fp16", "f32", 5),
                                                   ("wgmma", "bf16", "f16", 8), ("wgmma", "fp16", "f16", 5)])
@pytest.mark.parametrize("keepdims", [0, 1])
def test_pooled_chain_on_cuda_ep(design, precision, io, n, keepdims, cache, tmp_path, monkeypatch):
    """A chain with the max pool behind it (test_pool.pooled_mlp: [b, c, m, 6] -> 16 -> 24 -> n, then
    ReduceMax over m, 8 input features where the wgmma kernel stages them) in each design that pools (wgmma:
    its sm_90a kernel on Hopper where a group has at least 16 rows, else its mma.sync fallback), at
    groups of 37 rows (a warp's rows straddle two groups), 1 row, 300 rows, 48 rows (a warpgroup's 64-row
    tiles straddle groups), 256 rows (tiles inside a group) and 0 rows (-inf), float32 I/O and float16 I/O
    (odd and even n), the pooled axis dropped or kept (keepdims), against stock ORT on the CPU EP."""
    _check_pooled_chain("max", design, precision, io, n, keepdims, cache, tmp_path, monkeypatch)


@pytest.mark.parametrize("design,precision,io,n,keepdims", [
    ("resident", "fp16", "f32", 5, 0), ("streamed", "fp16", "f16", 8, 1), ("auto", "fp32", "f32", 5, 1),
    ("streamed", "bf16", "f16", 5, 0), ("wgmma", "fp16", "f32", 5, 1), ("wgmma", "fp16", "f16", 8, 0)])
@pytest.mark.parametrize("kind", ["sum", "mean"])
def test_sum_and_mean_pools_on_cuda_ep(kind, design, precision, io, n, keepdims, cache, tmp_path, monkeypatch):
    """The same chains with a ReduceSum (Deep Sets) or a ReduceMean (a global average pool) behind them: the
    kernels add each group's values into float entries (float atomics), the mean's sums scaled by 1 / rows
    at the end; groups of no rows give 0, as stock ORT's ReduceSum and ReduceMean do."""
    _check_pooled_chain(kind, design, precision, io, n, keepdims, cache, tmp_path, monkeypatch)


def _check_pooled_chain(kind, design, precision, io, n, keepdims, cache, tmp_path, monkeypatch):
    from test_pool import POOL_OPS, pooled_mlp
    from onnx_builders import F16
    monkeypatch.setenv("ONNX2FUSED_CUDA_DESIGN", design)
    k0 = 8 if design == "wgmma" and io == "f32" else 6   # (8: the wgmma kernel stages its input tiles)
    m = pooled_mlp([k0, 16, 24, n], rank=4, elem=F16 if io == "f16" else None, keepdims=keepdims, op=POOL_OPS[kind])
    src = tmp_path / "pooled.onnx"
    onnx.save(m, str(src))
    res = onnx2fused.convert(src, tmp_path / "m.onnx", precision=precision, cache_dir=cache)
    assert f"_pool{kind}{'k' if keepdims else ''}_" in res.chains[0].name
    if design == "wgmma":
        assert res.chains[0].cuda_plan.startswith("GPU: wgmma (sm_90a)"), res.chains[0].cuda_plan
    assert res.validation.provider == "CUDAExecutionProvider"
    sess = session(res.output_path, res.library_path, ["CUDAExecutionProvider", "CPUExecutionProvider"])
    rng = np.random.default_rng(4)
    dtype = np.float16 if io == "f16" else np.float32
    for shape in ((3, 5, 37, k0), (2, 2, 1, k0), (1, 3, 300, k0), (2, 3, 48, k0), (2, 2, 256, k0)):
        feeds = {"x": rng.standard_normal(shape).astype(dtype)}
        got, ref = sess.run(None, feeds)[0], stock(src, feeds)[0]
        assert got.shape == ref.shape == (shape[0], shape[1]) + (1,) * keepdims + (n,)
        assert rel_l2(got, ref) <= max(TOL[precision], 2e-3 if io == "f16" else 0), shape
    # groups of no rows: -inf, ONNX's max of nothing, or 0 (this host's stock ORT returns [2, 1, 0, n] there)
    empty = sess.run(None, {"x": np.zeros((2, 1, 0, k0), dtype)})[0]
    assert empty.shape == (2, 1) + (1,) * keepdims + (n,)
    assert (np.isneginf(empty) if kind == "max" else empty == 0).all()


@pytest.mark.parametrize("design,kind", [("wgmma", "max"), ("streamed", "max"), ("wgmma", "mean")])
def test_pooled_float16_chain_under_cuda_graphs(design, kind, cache, tmp_path, monkeypatch):
    """A pooled chain with float16 I/O (its float entries in a scratch the plugin takes from ORT's allocator,
    inside the graph's capture) run by ORT's CUDA graphs on fixed device buffers: the capture and three
    replays on new data each match stock ORT (the output NaN-poisoned before every run)."""
    import torch
    from test_pool import POOL_OPS, pooled_mlp
    from onnx_builders import F16
    monkeypatch.setenv("ONNX2FUSED_CUDA_DESIGN", design)
    src = tmp_path / "pooled.onnx"
    onnx.save(pooled_mlp([6, 16, 24, 8], rank=4, elem=F16, op=POOL_OPS[kind]), str(src))
    res = onnx2fused.convert(src, tmp_path / "m.onnx", precision="fp16", cache_dir=cache)
    assert f"_pool{kind}_" in res.chains[0].name and res.chains[0].cuda_plan.startswith(
        "GPU: " + {"wgmma": "wgmma (sm_90a)", "streamed": "streamed weights"}[design]), res.chains[0].cuda_plan
    sess = session(res.output_path, res.library_path,
                   [("CUDAExecutionProvider", {"enable_cuda_graph": "1"}), "CPUExecutionProvider"])
    shape, out_shape = (3, 5, 300, 6), (3, 5, 8)
    xt = torch.empty(shape, dtype=torch.float16, device="cuda")
    yt = torch.empty(out_shape, dtype=torch.float16, device="cuda")
    io = sess.io_binding()
    io.bind_input(sess.get_inputs()[0].name, "cuda", 0, np.float16, list(shape), xt.data_ptr())
    io.bind_output(sess.get_outputs()[0].name, "cuda", 0, np.float16, list(out_shape), yt.data_ptr())
    for seed in range(4):
        x = np.random.default_rng(seed).standard_normal(shape).astype(np.float16)
        xt.copy_(torch.from_numpy(x))
        yt.fill_(float("nan"))
        sess.run_with_iobinding(io)
        torch.cuda.synchronize()
        ref = stock(src, {sess.get_inputs()[0].name: x})[0]
        assert rel_l2(yt.cpu().numpy(), ref) <= 2e-3, f"run {seed} (0: the capture)"


@pytest.mark.parametrize("seg", [False, True], ids=["cls", "seg"])
def test_fxia22_pointnet_on_cuda_ep(seg, cache, tmp_path):
    """PointNet as fxia22's pointnet.pytorch writes it (benchmarks/pointnet.py PointNetSTN: the transform net,
    the max pools as torch.max(x, 2, keepdim=True)[0].view(-1, 1024), the classifier or the segmentation
    head), converted with defaults, matching stock on the CUDA EP at 1 and 5 clouds of 1024 points."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from pointnet import PointNetSTN, export
    torch.manual_seed(7)
    src = export(PointNetSTN(classes=4, seg=True) if seg else PointNetSTN(), tmp_path / "pn.onnx")
    res = check_defaults(src, tmp_path / "m.onnx", cache,
                         lambda rng: {"x": rng.standard_normal((9, 3, 1024)).astype(np.float32)})
    assert sum("_poolmaxk_" in c.name for c in res.chains) == 2, [c.name for c in res.chains]
    sess = session(res.output_path, res.library_path, ["CUDAExecutionProvider", "CPUExecutionProvider"])
    rng = np.random.default_rng(9)
    for clouds in (1, 5):
        feeds = {"x": rng.standard_normal((clouds, 3, 1024)).astype(np.float32)}
        assert rel_l2(sess.run(None, feeds)[0], stock(src, feeds)[0]) <= TOL["fp16"], clouds
