"""Transformer blocks (a norm in front, a residual behind; issue 16) in the fused CUDA kernels, against stock
ONNX Runtime (GPU host only).

The zoo's blocks (preln: LayerNorm, GELU FFN, residual; llama: RMSNorm, SwiGLU, residual) from both
exporters, and hand-built blocks of odd widths (K0 40 and 72: lane groups with a partial last round and
padded features; layer norms with and without a bias, RMS norms, a norm alone, a residual alone, a gated
layer; a float16 model), at fp16, bf16 and tf32 in each forced design (resident, streamed: PlanOptions, and
$ONNX2FUSED_CUDA_DESIGN through convert) and at fp32 (CUDA cores). Each converted block is ONE fused op;
its output on the CUDA EP, poisoned with NaN first so unwritten elements show, must match stock ORT on the
CPU EP (the reference) and stock ORT on the CUDA EP (within the precision's tolerance plus the distance of
stock CUDA from stock CPU: stock's TF32 GEMMs), on batches 0, 1, odd ones and 1000003 rows; with a
residual the layers' part (output less input) is held to the tolerance too, so a residual cannot hide
their errors. The same library's CPU kernel runs the model on the CPU EP.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest

from gpu_support import check_cuda_graph_replay, rel_l2, require_cuda, run_poisoned  # noqa: E402

pytestmark = pytest.mark.gpu
ort, torch = require_cuda()

import onnx2fused  # noqa: E402
from onnx2fused import library, passes  # noqa: E402
from onnx2fused.loader import load_model  # noqa: E402
from onnx2fused.plan.choose import make_plans  # noqa: E402
from onnx2fused.plan.options import DESIGN_ENV, PlanOptions, WgmmaOptions  # noqa: E402
from onnx2fused.spec import DOMAIN  # noqa: E402
from onnx_builders import G  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
ZOO = {m["name"]: m for m in json.loads((ROOT / "models" / "zoo.json").read_text())["models"]}
TOL = {"fp16": 2e-3, "bf16": 1e-2, "tf32": 1e-3, "fp32": 1e-5}
DESIGNS = ["resident", "streamed"]
# (precision, design) of each run: the tensor-core precisions in both fused designs, fp32 on CUDA cores
RUNS = [(p, d) for p in ("fp16", "bf16", "tf32") for d in DESIGNS] + [("fp32", "fp32")]
LARGE = 1000003


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("gpu_block_cache")


def _stock(model_path, x, providers):
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    s = ort.InferenceSession(str(model_path), so, providers=providers)
    return s.run(None, {s.get_inputs()[0].name: x})[0]


def _fuse(src: Path, precision: str, design: str, cache_dir: Path, out: Path):
    """The block converted by a library WITH CUDA kernels, `design` forced: one fused op (norm, layers and
    residual all in it). Returns (fused model path, library path, the chain)."""
    # the wide design with its GEMV path too: a pass of <= 16 rows runs it (batch 1 below); the wgmma design
    # with its block support asked for (plan.wgmma.BLOCKS, off by default until these tests pass on a GPU)
    options = (PlanOptions(design="wgmma", wgmma_overrides=WgmmaOptions(blocks=True)) if design == "wgmma" else
               PlanOptions(design="auto" if design == "fp32" else design, wgmma=False, wide_gemv=design == "wide"))
    model = load_model(str(src))
    plan = library.find_fusions(model, True, options)
    (chain,) = plan.chains
    assert plan.refusals == [] and (chain.norm is not None or chain.residual), plan.describe()
    specs = [chain.to_spec(precision)]
    plans = make_plans(specs, options)
    assert {p.design for p in plans.values()} == {design}, [p.describe() for p in plans.values()]
    lib = library.build_plugin(specs, with_cuda=True, cache_dir=cache_dir, plans=plans)
    fused = passes.rewrite(model, plan, specs)
    assert [n.domain for n in fused.graph.node] == [DOMAIN]
    onnx.save(fused, str(out))
    return out, lib.path, chain


def _session(path, lib, providers, profile=None, cuda_graph=False):
    so = ort.SessionOptions()
    so.register_custom_ops_library(str(lib))
    if profile is not None:
        so.enable_profiling = True
        so.profile_file_prefix = str(profile)
    if cuda_graph:
        providers = [("CUDAExecutionProvider", {"enable_cuda_graph": "1"})] + providers[1:]
    return ort.InferenceSession(str(path), so, providers=providers)


def _inputs(rng, batch, k, dtype):
    """Off-centre rows of a larger scale: a norm that were skipped, or took the padding into its sums,
    could not pass."""
    return (rng.standard_normal((batch, k)) * 2 + 0.5).astype(dtype)


def check_block(src, fused, lib, chain, precision, batches=(0, 1, 37, 4099), label=""):
    """The fused model on the CUDA EP against stock on the CPU EP and on the CUDA EP; on the CPU EP (the
    library's CPU kernel, which computes in fp32) against stock on the CPU EP."""
    cuda = _session(fused, lib, ["CUDAExecutionProvider", "CPUExecutionProvider"])
    cpu = _session(fused, lib, ["CPUExecutionProvider"])
    k, dtype = chain.widths[0], np.float16 if chain.input_dtype == "f16" else np.float32
    tol = TOL[precision]
    rng = np.random.default_rng(16)
    for batch in batches:
        x = _inputs(rng, batch, k, dtype)
        what = f"{label} {precision} batch {batch}"
        if batch == 0:   # no rows: an empty output of the right shape, on both EPs
            for sess in (cuda, cpu):
                assert sess.run(None, {"x": x})[0].shape == (0, chain.widths[-1]), what
            continue
        ref = _stock(src, x, ["CPUExecutionProvider"])
        ref_cuda = _stock(src, x, ["CUDAExecutionProvider", "CPUExecutionProvider"])
        got = run_poisoned(cuda, x, ref.shape)
        stock_gap = rel_l2(ref_cuda, ref)   # stock on the CUDA EP (TF32 GEMMs, fp16 ops) vs on the CPU EP
        assert rel_l2(got, ref) <= tol, f"{what}: rel L2 {rel_l2(got, ref):.2e} vs stock CPU"
        assert rel_l2(got, ref_cuda) <= tol + stock_gap, f"{what}: rel L2 {rel_l2(got, ref_cuda):.2e} vs stock CUDA"
        if chain.residual and dtype == np.float32:   # the layers' part: output less input (fp32 I/O: exact)
            xf = x.astype(np.float64)
            err = rel_l2(got - xf, ref - xf)
            assert err <= tol, f"{what}: the layers' part, rel L2 {err:.2e} vs stock CPU"
            gap = rel_l2(ref_cuda - xf, ref - xf)
            assert rel_l2(got - xf, ref_cuda - xf) <= tol + gap, f"{what}: the layers' part vs stock CUDA"
        if batch < LARGE:   # the CPU kernel (fp32) on the CPU EP
            y = cpu.run(None, {"x": x})[0]
            assert rel_l2(y, ref) <= (1e-4 if dtype == np.float16 else 1e-5), f"{what}: CPU EP"


# -- the zoo's blocks ----------------------------------------------------------------------------------

@pytest.mark.parametrize("precision,design", RUNS, ids=[f"{p}-{d}" for p, d in RUNS])
@pytest.mark.parametrize("kind", ["dynamo", "opset17"])
@pytest.mark.parametrize("name", ["preln", "llama"])
def test_zoo_block_on_cuda_ep(name, kind, precision, design, cache_dir, tmp_path):
    src = ROOT / "models" / ZOO[name]["files"][kind]["file"]
    fused, lib, chain = _fuse(src, precision, design, cache_dir, tmp_path / "fused.onnx")
    assert chain.norm.kind == ("layernorm" if name == "preln" else "rmsnorm") and chain.residual
    check_block(src, fused, lib, chain, precision, label=f"{name}/{kind} {design}")


@pytest.mark.parametrize("design", DESIGNS + ["fp32", "wide", "wgmma"])
def test_layer_norm_of_rows_with_a_large_mean_and_a_small_spread(design, cache_dir, tmp_path):
    """Rows offset + 0.1 N(0, 1): the FFN branch y - x against stock's, on the CUDA EP, in every design
    that runs a norm (norm_rows of o2f_block_norm.cuh, the fp32 kernel's normalise_row, the wide design's
    norm pass, the wgmma kernel's norm_tile: on a GPU other than compute capability 9.0 its mma.sync fallback). mean(x^2) - mean^2 in fp32 cancelled there (the CPU kernel: 22 % off at 100, NaN at 300)."""
    src = ROOT / "models" / ZOO["preln"]["files"]["opset17"]["file"]
    if design == "wide":   # the zoo block is narrow: a hand-built one the wide design takes
        src = tmp_path / "wide_block.onnx"
        onnx.save(block_model(**BLOCKS[WIDE_BLOCKS[0]]), str(src))
    precision = "fp32" if design == "fp32" else "fp16"
    fused, lib, chain = _fuse(src, precision, design, cache_dir, tmp_path / "fused.onnx")
    assert chain.norm.kind == "layernorm"
    sess = _session(fused, lib, ["CUDAExecutionProvider", "CPUExecutionProvider"])
    rng = np.random.default_rng(31)
    for offset in (100.0, 300.0):
        x = (offset + 0.1 * rng.standard_normal((4099, chain.widths[0]))).astype(np.float32)
        y, ref = sess.run(None, {"x": x})[0], _stock(src, x, ["CPUExecutionProvider"])
        assert np.isfinite(y).all(), f"{design} offset {offset}: {np.count_nonzero(~np.isfinite(y).all(1))} NaN rows"
        err = rel_l2(y - x, ref - x)
        assert err <= max(TOL[precision], 1e-3), f"{design} offset {offset}: branch rel L2 {err:.2e}"


def test_zoo_block_runs_on_the_cuda_ep_and_replays_in_a_cuda_graph(cache_dir, tmp_path):
    """The fused block's node runs on the CUDA EP (the profiler's record), and in a captured CUDA graph
    replayed on new inputs."""
    src = ROOT / "models" / ZOO["preln"]["files"]["opset17"]["file"]
    fused, lib, chain = _fuse(src, "fp16", "resident", cache_dir, tmp_path / "fused.onnx")
    sess = _session(fused, lib, ["CUDAExecutionProvider", "CPUExecutionProvider"], profile=tmp_path / "prof")
    x = _inputs(np.random.default_rng(3), 4099, 64, np.float32)
    assert rel_l2(run_poisoned(sess, x, (4099, 64)), _stock(src, x, ["CPUExecutionProvider"])) <= TOL["fp16"]
    trace = json.loads(Path(sess.end_profiling()).read_text())
    op = onnx.load(str(fused)).graph.node[0].op_type
    assert {e["args"].get("provider") for e in trace if e.get("cat") == "Node"
            and e["args"].get("op_name") == op} == {"CUDAExecutionProvider"}
    graph = _session(fused, lib, ["CUDAExecutionProvider", "CPUExecutionProvider"], cuda_graph=True)
    check_cuda_graph_replay(graph, lambda v: _stock(src, v, ["CPUExecutionProvider"]), 2048, 64, 64, TOL["fp16"])


@pytest.mark.parametrize("design", DESIGNS)
@pytest.mark.parametrize("name", ["preln", "llama"])
def test_zoo_block_converts_with_each_design(name, design, tmp_path, monkeypatch):
    """convert() end to end with $ONNX2FUSED_CUDA_DESIGN forcing the design: automatic precision, the
    validation on the CUDA EP, one fused op."""
    monkeypatch.setenv(DESIGN_ENV, design)
    src = ROOT / "models" / ZOO[name]["files"]["opset17"]["file"]
    res = onnx2fused.convert(src, tmp_path / "m.fused.onnx", cache_dir=tmp_path / "cache")
    (chain,) = res.chains
    assert res.with_cuda and res.validation.provider == "CUDAExecutionProvider" and res.validation.passed
    assert res.refusals == [] and "_res_" in chain.name
    assert f"GPU: {design} weights" in chain.cuda_plan, chain.cuda_plan
    assert [n.domain for n in onnx.load(res.output_path).graph.node] == [DOMAIN]
    x = _inputs(np.random.default_rng(4), 1031, 64, np.float32)
    y = onnx2fused.InferenceSession(res.output_path).run(None, {"x": x})[0]
    assert rel_l2(y, _stock(src, x, ["CPUExecutionProvider"])) <= max(TOL[chain.precision], res.validation.tolerance)


# -- hand-built blocks of odd widths ------------------------------------------------------------------

def _norm(g, kind, k, bias, f16=False):
    dt = np.float16 if f16 else np.float32
    scale = (1 + 0.2 * g.rng.standard_normal(k)).astype(dt)
    if kind == "layernorm":
        ins = ["x", g.init(scale)] + ([g.init((0.3 * g.rng.standard_normal(k)).astype(dt))] if bias else [])
        return g.op("LayerNormalization", ins, axis=-1, epsilon=1e-4)
    # the dynamo exporter's RMSNorm: Pow, ReduceMean, Add(eps), Sqrt, Reciprocal, Mul, Mul(weight)
    ms = g.op("ReduceMean", [g.op("Pow", ["x", g.init(np.array(2.0, dt))]), g.init(np.array([-1], np.int64))],
              keepdims=1)
    r = g.op("Reciprocal", [g.op("Sqrt", [g.op("Add", [ms, g.init(np.array(1e-6, dt))])])])
    return g.op("Mul", [g.op("Mul", ["x", r]), g.init(scale)])


def block_model(k, h, norm, bias=True, residual=True, act="Relu", gated=False, f16=False, seed=21):
    """x [B, k] -> [norm] -> fc k -> h -> act (gated: silu(x Wg) * (x Wu)) -> fc h -> k -> [+ x] -> y."""
    g = G(opset=18, seed=seed)
    dt = np.float16 if f16 else np.float32
    t = _norm(g, norm, k, bias, f16) if norm else "x"
    if gated:
        gate, up = g.linear(t, k, h, kind="matmul", dtype=dt), g.linear(t, k, h, kind="matmul", dtype=dt)
        a = g.op("Mul", [g.op("Mul", [gate, g.op("Sigmoid", [gate])]), up])
    else:
        a = g.op(act, [g.linear(t, k, h, kind="matmul", dtype=dt)])
    y = g.linear(a, h, k, kind="matmul", dtype=dt)
    if residual:
        g.op("Add", [y, "x"], outputs=["y"])
    else:
        g.op("Identity", [y], outputs=["y"])
    return g.model([("x", ["B", k])], [("y", ["B", k])], **({"elem": onnx.TensorProto.FLOAT16} if f16 else {}))


BLOCKS = {   # name: block_model's arguments
    "k40_ln": dict(k=40, h=100, norm="layernorm"),                              # 10 pieces over 8 lanes; 8 padded
    "k40_ln_nobias_no_residual": dict(k=40, h=64, norm="layernorm", bias=False, residual=False, act="Tanh"),
    "k72_rms": dict(k=72, h=120, norm="rmsnorm", act="Sigmoid"),               # 18 pieces over 16 lanes
    "k72_ln": dict(k=72, h=120, norm="layernorm"),
    "k72_residual_alone": dict(k=72, h=120, norm=None),
    "k40_rms_swiglu": dict(k=40, h=56, norm="rmsnorm", gated=True),             # LLaMA's block, odd widths
    "k40_ln_f16": dict(k=40, h=100, norm="layernorm", f16=True, act="Tanh"),    # fp16 I/O: the norm rounded to fp16
    "k30_ln": dict(k=30, h=64, norm="layernorm"),   # 120-byte rows TMA cannot store: the sm80 kernels even on sm_90
}
# every block at fp16 in both designs and at fp32; the layer/RMS norms, the gated one and the f16 model at
# bf16 and tf32 too
HAND_RUNS = [(b, p, d) for b in BLOCKS for p, d in RUNS
             if p in ("fp16", "fp32") or b in ("k40_ln", "k72_rms", "k40_rms_swiglu", "k40_ln_f16")]


@pytest.mark.parametrize("block,precision,design", HAND_RUNS, ids=[f"{b}-{p}-{d}" for b, p, d in HAND_RUNS])
def test_hand_built_block_on_cuda_ep(block, precision, design, cache_dir, tmp_path):
    src = tmp_path / f"{block}.onnx"
    onnx.save(block_model(**BLOCKS[block]), str(src))
    fused, lib, chain = _fuse(src, precision, design, cache_dir, tmp_path / "fused.onnx")
    assert chain.input_dtype == ("f16" if BLOCKS[block].get("f16") else "f32")
    # the large odd batch: tall tiles, every lane group's last round past the batch (once per design)
    batches = (0, 1, 37, 129, LARGE) if precision == "fp16" else (0, 1, 37, 4099)
    check_block(src, fused, lib, chain, precision, batches, label=f"{block} {design}")


# -- blocks in the wide design: the norm as its conversion pass, the residual as the last GEMM's source
# operand (x's rows in a CUTLASS 3.x epilogue; y = x + b first for the 2.x ones and the GEMV path) --------
# wide only: rows wider than a warp's lanes hold (K0 > 1024), a block of threads a row in the norm pass
# (o2f_block_norm.cuh, norm_row_block): 2050 (128 threads, 513 pieces: the last thread's one, the scalar
# loads and 2 padded features), LLaMA-7B's 4096 in fp16 with its RMS norm (128 threads, 8 pieces each),
# 5000 (256 threads)
WIDE_ONLY = {"k2050_ln": dict(k=2050, h=256, norm="layernorm"),
             "k4096_rms_f16": dict(k=4096, h=256, norm="rmsnorm", f16=True, act="Sigmoid"),
             "k5000_ln_swiglu": dict(k=5000, h=128, norm="layernorm", gated=True)}
WIDE_BLOCKS = ["k40_ln", "k40_ln_nobias_no_residual", "k72_rms", "k72_residual_alone", "k40_rms_swiglu", "k40_ln_f16",
               "k30_ln", *WIDE_ONLY]
WIDE_RUNS = [(b, p) for b in WIDE_BLOCKS for p in ("fp16", "bf16")]


@pytest.mark.parametrize("block,precision", WIDE_RUNS, ids=[f"{b}-{p}" for b, p in WIDE_RUNS])
def test_hand_built_block_in_the_wide_design(block, precision, cache_dir, tmp_path):
    src = tmp_path / f"{block}.onnx"
    onnx.save(block_model(**{**BLOCKS, **WIDE_ONLY}[block]), str(src))
    fused, lib, chain = _fuse(src, precision, "wide", cache_dir, tmp_path / "fused.onnx")
    # 1 and 16 rows: the GEMV path; 17 and more the GEMMs, 70001 in several passes
    check_block(src, fused, lib, chain, precision, (0, 1, 16, 17, 4099, 70001), label=f"{block} wide")


def test_vit_base_block_in_the_wide_design(cache_dir, tmp_path, monkeypatch):
    """ViT-B's block (pre-LN, 768 -> 3072 -> 768 GELU, residual) as the cost model plans it: wide, one op,
    on both kernel families (the CUTLASS 3.x sm_90a kernels, and the 2.x ones the same library runs with
    ONNX2FUSED_WIDE_KERNELS=sm80)."""
    from onnx2fused.plan.wide import SM80_ENV
    src = tmp_path / "vitb.onnx"
    onnx.save(block_model(k=768, h=3072, norm="layernorm", act="Tanh"), str(src))
    fused, lib, chain = _fuse(src, "fp16", "wide", cache_dir, tmp_path / "fused.onnx")
    check_block(src, fused, lib, chain, "fp16", (1, 300, 16384), label="vit-b sm90")
    monkeypatch.setenv(SM80_ENV, "sm80")
    check_block(src, fused, lib, chain, "fp16", (300,), label="vit-b sm80")


# -- blocks in the wgmma kernel (plan.wgmma.BLOCKS: fp32 I/O, a norm over <= 128 features), asked for --------

# wgmma only: rows too wide for two staged tiles a warpgroup (one, k-steps prefetched, x from global memory
# a chunk's stores at a time: plan.wgmma RESIDUAL_AHEAD_ROOMY)
WGMMA_ONLY = {"k200_residual_alone": dict(k=200, h=256, norm=None, act="Sigmoid")}
WGMMA_BLOCKS = ["k40_ln", "k72_rms", "k72_residual_alone", "k40_rms_swiglu", "k30_ln", *WGMMA_ONLY]


@pytest.mark.parametrize("name,precision", [(n, p) for n in ("preln", "llama") for p in ("fp16", "bf16")])
def test_zoo_block_in_the_wgmma_kernel(name, precision, cache_dir, tmp_path):
    """The zoo's blocks in the wgmma kernel's norm prologue and residual epilogue, against stock ORT (on a GPU
    of another compute capability the same library runs its mma.sync fallback)."""
    src = ROOT / "models" / ZOO[name]["files"]["opset17"]["file"]
    fused, lib, chain = _fuse(src, precision, "wgmma", cache_dir, tmp_path / "fused.onnx")
    check_block(src, fused, lib, chain, precision, (0, 1, 37, 129, LARGE), label=f"{name} wgmma")


@pytest.mark.parametrize("block", WGMMA_BLOCKS)
def test_hand_built_block_in_the_wgmma_kernel(block, cache_dir, tmp_path):
    """Padded K0 (40, 30: odd pieces of a row in the quad's lanes), RMS norms, a residual alone, a gated
    block, at fp16, against stock ORT."""
    src = tmp_path / f"{block}.onnx"
    onnx.save(block_model(**{**BLOCKS, **WGMMA_ONLY}[block]), str(src))
    fused, lib, chain = _fuse(src, "fp16", "wgmma", cache_dir, tmp_path / "fused.onnx")
    check_block(src, fused, lib, chain, "fp16", (0, 1, 37, 129, LARGE), label=f"{block} wgmma")
