"""The wide CUDA design (CUTLASS GEMM per layer, onnx2fused/plan/wide.py) on the CUDA EP, against stock
ONNX Runtime in fp32 (GPU host only; CUTLASS headers from nvidia-cutlass or ONNX2FUSED_CUTLASS_DIR).

Widths 512 ... 8192, several not multiples of 16 (or of 8), fp32 and fp16 model I/O, batches off every
tile multiple and past one row block of the workspace; outputs poisoned with NaN before each run
(IOBinding on device buffers) so unwritten elements show. The design is forced with
ONNX2FUSED_CUDA_DESIGN=wide so narrow chains exercise it too; each test asserts the plan is wide.
"""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from gpu_support import check_cuda_graph_replay, rel_l2, require_cuda, run_poisoned  # noqa: E402

pytestmark = pytest.mark.gpu
ort, torch = require_cuda()

from onnx2fused import build, library, passes  # noqa: E402
from onnx2fused.plan import sm90, wide  # noqa: E402
from onnx2fused.plan.choose import make_plan  # noqa: E402
from onnx2fused.plan.options import DESIGN_ENV, PlanOptions, WideOptions  # noqa: E402

WIDE = PlanOptions(design="wide")
# The tests on the `shared` library run in one xdist worker (`--dist loadgroup`, as gpu_host.sh runs
# them): a module fixture is built once per worker, and one CUTLASS build per worker, each compiling
# ~10 instances on every core, had the GPU host's OOM killer take compilers (seventeenth run).
ON_SHARED = pytest.mark.xdist_group("gpu-wide-shared")
from onnx2fused.loader import load_model  # noqa: E402

TOL = {"fp16": 2e-3, "bf16": 1e-2}
ACTS = {"relu": "Relu", "tanh": "Tanh", "sigmoid": "Sigmoid", "none": None}


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("gpu_wide_cache")


@pytest.fixture(autouse=True)
def _force_wide(monkeypatch):
    monkeypatch.setenv(DESIGN_ENV, "wide")   # for the builds that plan from the environment


CASES = [
    ([512, 512, 512], "relu"),
    ([768, 3072, 768], "gelu"),            # FFN pair
    ([1000, 520, 1000], "tanh"),           # multiples of 8, not of 16
    ([1001, 517, 999], "sigmoid"),         # odd: padded K / hidden columns, alignment-1 output epilogue
    ([2048, 8192, 2048], "relu"),
    ([8192, 4096, 1000], "relu"),
    ([512, 256, 64, 1], "relu"),           # DLRM tower: tf32 first layer, then 256 -> 64 -> 1 as one fused tail
    ([512, 256, 64, 2], "relu"),           # without the tail (NO_TAIL): a 2-output narrow last layer GEMM chain
    ([1000, 520, 3], "tanh"),              # a narrow last layer of 3 outputs, K padded to 520
]


NO_TAIL = {"512x256x64x2_relu"}   # built with every layer a GEMM (WideOptions.tail_from=0)


def _case_id(widths, act):
    return "x".join(map(str, widths)) + "_" + act


def _mlp(path, widths, act, gelu=False, seed=0):
    """Gemm(transB=1) + activation per hidden layer; GELU in torch's opset-17 erf form when `gelu`."""
    rng = np.random.default_rng(seed)
    nodes, inits, h = [], [], "x"
    for i, (k, n) in enumerate(zip(widths, widths[1:])):
        w = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)
        b = (rng.standard_normal(n) * 0.1).astype(np.float32)
        inits += [numpy_helper.from_array(w, f"w{i}"), numpy_helper.from_array(b, f"b{i}")]
        nodes.append(helper.make_node("Gemm", [h, f"w{i}", f"b{i}"], [f"g{i}"], transB=1))
        h = f"g{i}"
        if i < len(widths) - 2:
            if gelu:
                inits += [numpy_helper.from_array(np.array(v, np.float32), f"c{i}_{j}")
                          for j, v in enumerate((1.4142135381698608, 1.0, 0.5))]
                nodes += [helper.make_node("Div", [h, f"c{i}_0"], [f"d{i}"]),
                          helper.make_node("Erf", [f"d{i}"], [f"e{i}"]),
                          helper.make_node("Add", [f"e{i}", f"c{i}_1"], [f"a{i}"]),
                          helper.make_node("Mul", [h, f"a{i}"], [f"m{i}"]),
                          helper.make_node("Mul", [f"m{i}", f"c{i}_2"], [f"act{i}"])]
                h = f"act{i}"
            elif ACTS[act]:
                nodes.append(helper.make_node(ACTS[act], [h], [f"act{i}"]))
                h = f"act{i}"
    nodes.append(helper.make_node("Identity", [h], ["y"]))
    g = helper.make_graph(nodes, "wide", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", widths[0]])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", widths[-1]])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.save(m, str(path))
    return path


def _fuse(src, precision, cache_dir, out):
    model = load_model(str(src))
    plan = passes.find_chains(model)
    assert len(plan.chains) == 1, plan.describe()
    specs = [c.to_spec(precision) for c in plan.chains]
    cplan = make_plan(specs[0], WIDE)
    assert cplan.design == "wide", cplan.describe()
    lib = library.build_plugin(specs, with_cuda=True, cache_dir=cache_dir, plans={specs[0].name: cplan})
    onnx.save(passes.rewrite(model, plan, specs), str(out))
    return out, lib.path, cplan


@pytest.fixture(scope="module")
def shared(tmp_path_factory, cache_dir):
    """Every model of CASES plus an fp16-I/O one (fp16 and bf16 kernels), fused with ONE plugin library:
    its .cu files compile in parallel, once (CUTLASS builds take minutes)."""
    from onnx2fused.bench import to_fp16
    d = tmp_path_factory.mktemp("wide_models")
    jobs = [(_case_id(w, a), _mlp(d / f"{_case_id(w, a)}.onnx", w, a, gelu=a == "gelu"), "fp16") for w, a in CASES]
    src32 = _mlp(d / "io16.onnx", [1024, 4096, 1024], "relu")
    src16 = d / "io16.f16.onnx"
    onnx.save(to_fp16(onnx.load(str(src32))), str(src16))
    jobs += [("io16_fp16", src16, "fp16"), ("io16_bf16", src16, "bf16")]
    out, specs, plans = {}, [], {}
    for key, src, precision in jobs:
        model = load_model(str(src))
        plan = passes.find_chains(model)
        assert len(plan.chains) == 1, plan.describe()
        spec = plan.chains[0].to_spec(precision)
        cplan = make_plan(spec, WIDE, WideOptions(tail_from=0) if key in NO_TAIL else None)
        assert cplan.design == "wide", cplan.describe()
        fused = d / f"{key}.fused.onnx"
        onnx.save(passes.rewrite(model, plan, [spec]), str(fused))
        specs.append(spec)
        plans[spec.name] = cplan
        out[key] = (src32 if key.startswith("io16") else src, fused, cplan)
    lib = library.build_plugin(specs, with_cuda=True, cache_dir=cache_dir, plans=plans).path
    return out, lib


def _session(model_path, lib=None):
    so = ort.SessionOptions()
    if lib:
        so.register_custom_ops_library(str(lib))
    return ort.InferenceSession(str(model_path), so, providers=["CUDAExecutionProvider", "CPUExecutionProvider"])


def _reference(model_path, x):
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    s = ort.InferenceSession(str(model_path), so, providers=["CPUExecutionProvider"])
    return s.run(None, {"x": x})[0]


def _hopper() -> bool:
    return torch.cuda.get_device_capability() == (9, 0)


# On an sm_90 GPU the library (built with ONNX2FUSED_CUDA_ARCHS=90: sm_90a) runs CUTLASS 3.x kernels
# where the plan allows; ONNX2FUSED_WIDE_KERNELS=sm80, read by the launcher on every run, makes the
# same session run the CUTLASS 2.x kernels, so both families are checked against the same reference.
KERNEL_FAMILIES = ("default", "sm80")


@ON_SHARED
@pytest.mark.parametrize("widths,act", CASES, ids=[_case_id(w, a) for w, a in CASES])
def test_wide_matches_stock_fp32(widths, act, shared, monkeypatch):
    models, lib = shared
    src, fused, plan = models[_case_id(widths, act)]
    sess = _session(fused, lib)
    rng = np.random.default_rng(1)
    for batch in (1, 37, 129, 1000):  # 129 and 1000 rows: stream-K splits (few 128x256 tiles) on Hopper
        x = rng.standard_normal((batch, widths[0])).astype(np.float32)
        ref = _reference(src, x)
        for family in KERNEL_FAMILIES if _hopper() else ("default",):
            if family == "sm80":
                monkeypatch.setenv(wide.SM80_ENV, "sm80")
            else:
                monkeypatch.delenv(wide.SM80_ENV, raising=False)
            got = run_poisoned(sess, x, ref.shape)
            assert rel_l2(got, ref) <= TOL["fp16"], f"{widths} batch {batch} {family} kernels"
    monkeypatch.delenv(wide.SM80_ENV, raising=False)
@ON_SHARED
def test_dlrm_cases_cover_the_segmented_plan_and_the_narrow_layer(shared):
    """The two DLRM builds above run different code: a fused tail kernel after one GEMM, and three GEMMs
    ending in the thread-per-row narrow layer (both checked against stock ORT by the test above)."""
    models, _ = shared
    segmented, plain = models["512x256x64x1_relu"][2], models["512x256x64x2_relu"][2]
    assert segmented.tail_from == 1 and len(segmented.gemms) == 1
    assert plain.tail_from == 0 and plain.gemms[-1].narrow


def _kernel_names(sess, x, out_shape) -> str:
    """The CUDA kernels one run of `sess` on x launches (after a warm-up run), by name."""
    from torch.profiler import ProfilerActivity, profile
    run_poisoned(sess, x, out_shape)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run_poisoned(sess, x, out_shape)
    return " ".join(e.name for e in prof.events())


@ON_SHARED
def test_hopper_runs_the_sm90a_kernels(shared, monkeypatch):
    """The kernels launched, by name (torch's profiler sees every kernel of the process, ORT's included):
    our own sm_90a GEMM (Light128x128, the untuned default) on sm_90 unless overridden, CUTLASS 2.x's with
    the override."""
    if not _hopper():
        pytest.skip("sm_90a kernels run on compute capability 9.0 only")
    models, lib = shared
    src, fused, plan = models[_case_id([768, 3072, 768], "gelu")]
    sess = _session(fused, lib)
    x = np.random.default_rng(4).standard_normal((4096, 768)).astype(np.float32)
    names = {}
    for family in KERNEL_FAMILIES:
        if family == "sm80":
            monkeypatch.setenv(wide.SM80_ENV, "sm80")
        else:
            monkeypatch.delenv(wide.SM80_ENV, raising=False)
        names[family] = _kernel_names(sess, x, (4096, 768))
    monkeypatch.delenv(wide.SM80_ENV, raising=False)
    if not names["default"]:
        pytest.skip("the profiler recorded no CUDA kernels here (CUPTI unavailable)")
    assert "o2f_light::light_gemm" in names["default"] and "MmaMultistage" not in names["default"]
    assert "MmaMultistage" in names["sm80"] and "light_gemm" not in names["sm80"]


def test_cutlass_default_kernel_by_name_matches_stock(cache_dir, tmp_path, monkeypatch):
    """ONNX2FUSED_WIDE_DEFAULT_KERNEL=Pingpong128x128 at convert time: the untuned choices run CUTLASS 3.x's
    ping-pong kernel in place of ours (the way back; the tuned choices' kernels), and agree with stock."""
    if not _hopper():
        pytest.skip("sm_90a kernels run on compute capability 9.0 only")
    monkeypatch.setenv(sm90.DEFAULT_KERNEL_ENV, "Pingpong128x128")
    src = _mlp(tmp_path / "ffn.onnx", [768, 3072, 768], "gelu", gelu=True, seed=5)
    fused, lib, plan = _fuse(src, "fp16", cache_dir, tmp_path / "ffn.fused.onnx")
    assert {sm90.SM90_KERNELS[c.kernel].name for per in plan.choices for c in per} == {"Pingpong128x128"}
    x = np.random.default_rng(6).standard_normal((3000, 768)).astype(np.float32)
    ref = _reference(src, x)
    sess = _session(fused, lib)
    assert rel_l2(run_poisoned(sess, x, ref.shape), ref) <= TOL["fp16"]
    names = _kernel_names(sess, x, ref.shape)
    if names:   # (CUPTI may be unavailable)
        assert "GemmUniversal" in names and "MainloopSm90TmaGmmaWarpSpecialized" in names and "light_gemm" not in names


@pytest.mark.parametrize("kernel", ["", "Tf32Light128x128"])
def test_tf32_first_layer_in_place_matches_stock(kernel, cache_dir, tmp_path, monkeypatch):
    """A DLRM-like first layer reads the fp32 input in place on tf32 wgmma (K = 520: a partial last
    k-block of 8 columns, zero-filled by TMA) with the untuned default, CUTLASS's Tf32Pingpong128x128, or
    ours by name at convert time (ONNX2FUSED_WIDE_DEFAULT_TF32_KERNEL=Tf32Light128x128: no CUTLASS 3.x
    kernel runs); the results agree with stock at every row count (37 and 1000: row tails; 65536: many
    tiles per CTA)."""
    if not _hopper():
        pytest.skip("sm_90a kernels run on compute capability 9.0 only")
    if kernel:
        monkeypatch.setenv(sm90.DEFAULT_TF32_KERNEL_ENV, kernel)
    src = _mlp(tmp_path / "dlrm.onnx", [520, 256, 64, 1], "relu", seed=7)
    fused, lib, plan = _fuse(src, "fp16", cache_dir, tmp_path / "dlrm.fused.onnx")
    assert plan.tf32_first and {sm90.SM90_KERNELS[c.kernel].name for c in plan.choices[0]} == {kernel or "Tf32Pingpong128x128"}
    sess = _session(fused, lib)
    rng = np.random.default_rng(8)
    for batch in (37, 1000, 65536):
        x = rng.standard_normal((batch, 520)).astype(np.float32)
        ref = _reference(src, x)
        assert rel_l2(run_poisoned(sess, x, ref.shape), ref) <= TOL["fp16"], batch
    names = _kernel_names(sess, x, ref.shape)
    if names:   # (CUPTI may be unavailable)
        assert ("MainloopSm90TmaGmmaWarpSpecialized" in names) != bool(kernel)
        assert not kernel or "light_gemm" in names


@ON_SHARED
def test_wide_fp16_io_in_place_and_bf16(shared):
    """An fp16 model (bench.to_fp16 of the fp32 one: fp16 input, weights, output) against stock fp32."""
    models, lib = shared
    x = np.random.default_rng(2).standard_normal((333, 1024)).astype(np.float16)
    for precision in ("fp16", "bf16"):
        src32, fused, plan = models[f"io16_{precision}"]
        assert plan.spec.io_dtype == "f16"
        assert plan.convert_input == (precision == "bf16")  # fp16 rows of 1024 are the GEMM's A as they are
        ref = _reference(src32, x.astype(np.float32))
        got = run_poisoned(_session(fused, lib), x, ref.shape).astype(np.float32)
        assert rel_l2(got, ref) <= TOL[precision], precision


def test_rows_past_one_row_block(cache_dir, tmp_path, monkeypatch):
    """More rows than the workspace's row block: the launcher loops over blocks on the stream. A small
    scratch budget makes the block 128 rows, so the stock CPU reference stays quick."""
    monkeypatch.setattr(wide, "SCRATCH_BUDGET", 1 << 20)
    widths = [1024, 2048, 1024, 520]
    src = _mlp(tmp_path / "m.onnx", widths, "relu")
    fused, lib, plan = _fuse(src, "fp16", cache_dir, tmp_path / "fused.onnx")
    rows = plan.row_block * 2 + 77
    x = np.random.default_rng(3).standard_normal((rows, widths[0])).astype(np.float32)
    ref = _reference(src, x)
    got = run_poisoned(_session(fused, lib), x, ref.shape)
    assert rel_l2(got, ref) <= TOL["fp16"]
    assert rel_l2(got[-77:], ref[-77:]) <= TOL["fp16"]  # the partial last block
@ON_SHARED
def test_cuda_graph_replay(shared):
    models, lib = shared
    src, fused, _ = models[_case_id([768, 3072, 768], "gelu")]
    so = ort.SessionOptions()
    so.register_custom_ops_library(str(lib))
    sess = ort.InferenceSession(str(fused), so, providers=[("CUDAExecutionProvider", {"enable_cuda_graph": "1"}),
                                                           "CPUExecutionProvider"])
    check_cuda_graph_replay(sess, lambda x: _reference(src, x), 512, 768, 768, TOL["fp16"], replays=2)


def _swiglu_mlp(path, k: int, hidden: int, n: int, seed: int = 6):
    """x [B, k] -> silu(x Wg + bg) * (x Wu + bu) [B, hidden] -> Linear -> y [B, n] (a gated chain, like
    tests/test_gpu_gated.py's)."""
    from onnx_builders import G
    g = G(opset=17, seed=seed)
    gate, up = g.linear("x", k, hidden, name="gate"), g.linear("x", k, hidden, name="up")
    h = g.op("Mul", [g.op("Mul", [gate, g.op("Sigmoid", [gate])]), up])
    g.op("Identity", [g.linear(h, hidden, n, name="down")], outputs=["y"])
    onnx.save(g.model([("x", ["B", k])], [("y", ["B", n])]), str(path))
    return path


def test_gemv_path_matches_stock(cache_dir, tmp_path, monkeypatch):
    """ONNX2FUSED_WIDE_GEMV=on (the default, set explicitly here): passes of <= 16 rows run the
    weight-streaming GEMV kernels (1, 3 and 16 rows),
    more rows the GEMMs (17, 300), against stock fp32 ORT with NaN-poisoned outputs: fp32 rows of odd widths
    (scalar loads of x), a segmented plan (GEMV, then the fused tail), fp16 rows in place and rounded to bf16
    (16-byte loads), and a gated chain (gate and up pairs straight into the hidden buffer)."""
    from onnx2fused.bench import to_fp16
    from onnx2fused.plan.options import WIDE_GEMV_ENV
    monkeypatch.setenv(WIDE_GEMV_ENV, "on")
    options = PlanOptions.from_env()
    assert options.wide_gemv and options.design == "wide"
    src16 = tmp_path / "io16.f16.onnx"
    src32_16 = _mlp(tmp_path / "io16.onnx", [1024, 4096, 1024], "relu")
    onnx.save(to_fp16(onnx.load(str(src32_16))), str(src16))
    jobs = [("odd", _mlp(tmp_path / "odd.onnx", [1001, 517, 999], "sigmoid"), None, "fp16"),
            ("dlrm", _mlp(tmp_path / "dlrm.onnx", [512, 256, 64, 1], "relu"), None, "fp16"),
            ("io16_fp16", src16, src32_16, "fp16"), ("io16_bf16", src16, src32_16, "bf16"),
            ("gated", _swiglu_mlp(tmp_path / "gated.onnx", 1000, 2500, 999), None, "fp16")]
    specs, plans, cases = [], {}, []
    for key, src, ref_src, precision in jobs:
        model = load_model(str(src))
        found = passes.find_chains(model)
        assert len(found.chains) == 1, found.describe()
        spec = found.chains[0].to_spec(precision)
        plan = make_plan(spec, options)
        assert plan.design == "wide" and plan.gemv_rows == wide.GEMV_MAX_ROWS, plan.describe()
        assert (key == "dlrm") == bool(plan.tail_from) and (key == "gated") == any(g.gated for g in plan.gemms)
        fused = tmp_path / f"{key}.fused.onnx"
        onnx.save(passes.rewrite(model, found, [spec]), str(fused))
        specs.append(spec)
        plans[spec.name] = plan
        cases.append((key, ref_src or src, fused, spec))
    lib = library.build_plugin(specs, with_cuda=True, cache_dir=cache_dir, plans=plans).path
    rng = np.random.default_rng(8)
    for key, ref_src, fused, spec in cases:
        sess = _session(fused, lib)
        io_dt = np.float16 if spec.io_dtype == "f16" else np.float32
        for batch in (1, 3, 16, 17, 300):   # <= 16: the GEMV kernels; 17 and 300: the GEMMs
            x = rng.standard_normal((batch, spec.widths[0])).astype(io_dt)
            ref = _reference(ref_src, x.astype(np.float32))
            got = run_poisoned(sess, x, ref.shape).astype(np.float32)
            err = rel_l2(got, ref)
            assert err <= TOL[spec.precision], f"{key} batch {batch}: rel L2 {err:.2e}"
