"""The plugin at run time on the CUDA EP (GPU host only): the checks of test_reliability.py's CPU-EP half.

Bad inputs give an ORT error naming the expected shape and the process lives on; an input on the wrong
device is copied by ORT; batch 0 gives an empty output; NaN and ±Inf propagate as stock ORT (CPU, fp32)
would; one session from 8 threads x 200 runs, and from 8 threads on the wide design (whose runs write
scratch in the workspace); two models (two libraries) at once; one library loaded twice; and sessions
on GPU 0 and GPU 1 at once, the resident kernels and the Hopper designs (skipped with fewer than 2 GPUs).
"""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest

from gpu_support import rel_l2, require_cuda  # noqa: E402   (rel_l2 fails on NaN or unwritten outputs)

pytestmark = pytest.mark.gpu
ort, torch = require_cuda()

import onnx2fused  # noqa: E402
from onnx2fused.targets import find_nvcc  # noqa: E402
from onnx2fused.session import plugin_path  # noqa: E402

from onnx_builders import mlp  # noqa: E402
from thread_support import run_threads, runs_unlike_alone  # noqa: E402

if find_nvcc() is None:
    pytest.skip("nvcc not found: the CUDA kernels cannot be built", allow_module_level=True)

ROOT = Path(__file__).resolve().parent.parent
TOL = {"fp16": 2e-3, "fp32": 1e-5}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """{(name, precision): (original, fused)} for nerf (ReLU, 32 -> 64x4 -> 16) and a Tanh MLP."""
    cache = tmp_path_factory.mktemp("gpu-rel-cache")
    d = tmp_path_factory.mktemp("gpu-rel")
    onnx.save(mlp([9, 24, 16, 5], act="Tanh"), str(d / "tanh.onnx"))
    sources = {"relu": ROOT / "models" / "nerf.opset17.onnx", "tanh": d / "tanh.onnx"}
    out = {}
    for name, src in sources.items():
        for precision in ("fp16", "fp32"):
            fused = d / f"{name}.{precision}.fused.onnx"
            res = onnx2fused.convert(src, fused, precision=precision, cache_dir=cache, with_cuda=True)
            assert res.with_cuda and res.validation.provider == "CUDAExecutionProvider"
            out[name, precision] = (src, fused)
    return out


def width(path) -> int:
    return onnx.load(str(path)).graph.input[0].type.tensor_type.shape.dim[-1].dim_value


def cuda_session(path, device_id=0, lib=None):
    """A CUDA-EP session of a fused model with its plugin (or `lib`) registered; no CPU fallback allowed."""
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    so.register_custom_ops_library(str(lib or plugin_path(path)))
    # CUDA EP only: ORT refuses an explicit CPU EP together with disable_cpu_ep_fallback.
    providers = [("CUDAExecutionProvider", {"device_id": str(device_id)})]
    return ort.InferenceSession(str(path), so, providers=providers)


def stock(src, x):
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(str(src), so, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


def test_bad_inputs_are_ort_errors_and_the_process_lives(converted, tmp_path):
    src, fused = converted["relu", "fp16"]
    model = onnx.load(str(fused))
    model.graph.input[0].type.tensor_type.ClearField("shape")  # only the plugin checks the shape now
    loose = fused.parent / "loose.onnx"
    onnx.save(model, str(loose))
    sess = cuda_session(loose)
    good = np.random.default_rng(1).standard_normal((7, 32)).astype(np.float32)
    for bad, expect in [(np.ones((4, 33), np.float32), "[4, 33]"), (np.ones((32,), np.float32), "rank >= 2"),
                        (np.array(1.0, np.float32), "rank >= 2"), (np.ones((2, 3, 31), np.float32), "[2, 3, 31]")]:
        with pytest.raises(Exception) as err:
            sess.run(None, {"x": bad})
        assert expect in str(err.value) and "[..., 32]" in str(err.value), str(err.value)
        assert rel_l2(sess.run(None, {"x": good})[0], stock(src, good)) <= TOL["fp16"]
    for dtype in (np.float64, np.float16, np.int32):
        with pytest.raises(Exception):
            sess.run(None, {"x": good.astype(dtype)})
    assert rel_l2(sess.run(None, {"x": good})[0], stock(src, good)) <= TOL["fp16"]


def test_an_input_on_the_host_is_copied_to_the_device(converted):
    src, fused = converted["relu", "fp16"]
    sess = cuda_session(fused)
    x = np.random.default_rng(2).standard_normal((129, 32)).astype(np.float32)
    io = sess.io_binding()
    io.bind_cpu_input("x", x)                 # host memory for a node that runs on the GPU
    io.bind_output("y", "cuda", 0)
    sess.run_with_iobinding(io)
    assert rel_l2(io.copy_outputs_to_cpu()[0], stock(src, x)) <= TOL["fp16"]


@pytest.mark.parametrize("name", ["relu", "tanh"])
def test_batch_zero_gives_an_empty_output(converted, name):
    src, fused = converted[name, "fp16"]
    k = width(src)
    y = cuda_session(fused).run(None, {"x": np.zeros((0, k), np.float32)})[0]
    assert y.shape == stock(src, np.zeros((0, k), np.float32)).shape and y.shape[0] == 0


@pytest.mark.parametrize("precision", ["fp16", "fp32"])
@pytest.mark.parametrize("name", ["relu", "tanh"])
def test_nan_and_inf_propagate_like_stock_ort(converted, name, precision):
    src, fused = converted[name, precision]
    k = width(src)
    x = np.random.default_rng(3).standard_normal((300, k)).astype(np.float32)
    specials = [np.nan, np.inf, -np.inf]
    for row in range(0, 300, 3):
        x[row, row % k] = specials[row % len(specials)]
    x[299, :] = np.inf
    got, ref = cuda_session(fused).run(None, {"x": x})[0], stock(src, x)
    assert np.isnan(ref).any() or np.isinf(ref).any(), "the inputs must reach the outputs"
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))
    np.testing.assert_array_equal(np.isposinf(got), np.isposinf(ref))
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(ref))
    finite_rows = np.isfinite(ref).all(axis=1) & np.isfinite(x).all(axis=1)
    assert rel_l2(got[finite_rows], ref[finite_rows]) <= TOL[precision]


def test_one_session_eight_threads_two_hundred_runs(converted):
    src, fused = converted["relu", "fp16"]
    sess = cuda_session(fused)
    rng = np.random.default_rng(4)
    xs = [[rng.standard_normal((int(rng.integers(1, 300)) if r % 10 else 5000, 32)).astype(np.float32)
           for r in range(200)] for _ in range(8)]
    refs = [[stock(src, x) for x in per] for per in xs]
    bad: list[str] = []

    def work(t):
        for r, x in enumerate(xs[t]):
            y = sess.run(None, {"x": x})[0]
            if y.shape != refs[t][r].shape or rel_l2(y, refs[t][r]) > TOL["fp16"]:
                bad.append(f"thread {t} run {r}")

    run_threads(work, [(t,) for t in range(8)])
    assert not bad, bad[:10]


@pytest.fixture(scope="module")
def wide_converted(tmp_path_factory):
    """(original, fused) of an MLP forced onto the wide design (CUTLASS GEMMs, headers from nvidia-cutlass
    or ONNX2FUSED_CUTLASS_DIR): its cuda_run writes converted input and hidden activations into the
    workspace, which the plugin shares between the runs of one session."""
    from onnx2fused.plan.options import DESIGN_ENV
    d = tmp_path_factory.mktemp("gpu-rel-wide")
    src, fused = d / "wide.onnx", d / "wide.fp16.fused.onnx"
    onnx.save(mlp([256, 768, 768, 256]), str(src))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(DESIGN_ENV, "wide")
        res = onnx2fused.convert(src, fused, precision="fp16", cache_dir=d / "cache", with_cuda=True)
    assert res.with_cuda and res.validation.provider == "CUDAExecutionProvider"
    assert len(res.chains) == 1 and res.chains[0].cuda_plan.startswith("GPU: wide"), res.chains
    return src, fused


def test_wide_design_one_session_eight_threads(wide_converted):
    """ORT gives concurrent Run() calls their own streams: runs of the wide design must not overlap on its
    scratch, so each output equals its input run alone (the same session, one thread)."""
    src, fused = wide_converted
    sess = cuda_session(fused)
    rng = np.random.default_rng(7)
    xs = [[rng.standard_normal((int(rng.integers(1, 2000)), 256)).astype(np.float32) for _ in range(30)]
          for _ in range(8)]
    # another run's rows (or half-written ones) differ by O(1); reordered fp32 sums by far less
    alone, bad = runs_unlike_alone(lambda x: sess.run(None, {"x": x})[0], xs,
                                   lambda y, ref: y.shape == ref.shape and np.abs(y - ref).max() <= 1e-2 * np.abs(ref).max())
    assert rel_l2(alone[0][0], stock(src, xs[0][0])) <= TOL["fp16"]
    assert not bad, bad[:10]


def _run_concurrently(jobs) -> list[str]:
    """jobs: [(session, src, seed)]; each thread runs 40 random batches and checks them."""
    bad: list[str] = []

    def work(sess, src, seed):
        rng = np.random.default_rng(seed)
        k = width(src)
        for r in range(40):
            x = rng.standard_normal((int(rng.integers(1, 3000)), k)).astype(np.float32)
            if rel_l2(sess.run(None, {"x": x})[0], stock(src, x)) > TOL["fp16"]:
                bad.append(f"{src.name} seed {seed} run {r}")

    run_threads(work, jobs)
    return bad


def test_two_models_two_libraries_one_process(converted):
    jobs = []
    for seed, name in enumerate(["relu", "tanh", "relu", "tanh"]):
        src, fused = converted[name, "fp16"]
        jobs.append((cuda_session(fused), src, seed))
    assert plugin_path(converted["relu", "fp16"][1]) != plugin_path(converted["tanh", "fp16"][1])
    assert not _run_concurrently(jobs)


def test_the_same_library_loaded_twice(converted, tmp_path):
    src, fused = converted["relu", "fp16"]
    lib = plugin_path(fused)
    copy = tmp_path / "again.so"
    shutil.copyfile(lib, copy)
    sessions = [cuda_session(fused, lib=lib), cuda_session(fused, lib=lib), cuda_session(fused, lib=copy)]
    x = np.random.default_rng(5).standard_normal((1025, 32)).astype(np.float32)
    ref = stock(src, x)
    for s in sessions:
        assert rel_l2(s.run(None, {"x": x})[0], ref) <= TOL["fp16"]
    del sessions[0]  # a session going away (its packed weights freed) leaves the others working
    for s in sessions:
        assert rel_l2(s.run(None, {"x": x})[0], ref) <= TOL["fp16"]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_sessions_on_two_gpus_at_once(converted):
    """device_id 0 and 1 in one process: each session packs its weights on its own GPU."""
    jobs = []
    for seed, (name, dev) in enumerate([("relu", 0), ("relu", 1), ("tanh", 0), ("tanh", 1)]):
        src, fused = converted[name, "fp16"]
        jobs.append((cuda_session(fused, device_id=dev), src, seed))
    assert not _run_concurrently(jobs)
    # device-resident input and output on GPU 1, bound explicitly
    src, fused = converted["relu", "fp16"]
    sess = cuda_session(fused, device_id=1)
    x = np.random.default_rng(6).standard_normal((4099, 32)).astype(np.float32)
    xt = torch.from_numpy(x).to("cuda:1")
    yt = torch.full((4099, 16), float("nan"), device="cuda:1")
    io = sess.io_binding()
    io.bind_input("x", "cuda", 1, np.float32, [4099, 32], xt.data_ptr())
    io.bind_output("y", "cuda", 1, np.float32, [4099, 16], yt.data_ptr())
    sess.run_with_iobinding(io)
    torch.cuda.synchronize(1)
    assert rel_l2(yt.cpu().numpy(), stock(src, x)) <= TOL["fp16"]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_the_hopper_designs_on_two_gpus_at_once(tmp_path, monkeypatch):
    """The wgmma design (the zoo's silu) and the wide design's one-kernel FFN (256 -> SwiGLU 1024 -> 256,
    taken at every batch) on GPU 1 first, then on both GPUs at once from threads: each device gets its own
    packed weights and its own kernel attributes (a kernel's shared-memory size is set per device)."""
    from test_gpu_gated import _swiglu_chain

    from onnx2fused.plan.ffn import FFN_ENV
    swiglu = tmp_path / "swiglu.onnx"
    onnx.save(_swiglu_chain(256, [1024, 256], {0}), str(swiglu))
    sources = {"silu": ROOT / "models" / "silu.opset17.onnx", "swiglu": swiglu}
    expected = {"silu": "GPU: wgmma", "swiglu": "whole FFN in one kernel"}
    fused = {}
    for name, src in sources.items():
        fused[name] = tmp_path / f"{name}.fused.onnx"
        res = onnx2fused.convert(src, fused[name], cache_dir=tmp_path / "cache", with_cuda=True)
        assert len(res.chains) == 1 and expected[name] in res.chains[0].cuda_plan, res.chains[0].cuda_plan
    monkeypatch.setenv(FFN_ENV, "1")
    rng = np.random.default_rng(8)
    sessions = {(name, dev): cuda_session(fused[name], device_id=dev) for name in sources for dev in (1, 0)}
    for (name, dev), sess in sessions.items():   # the library's first launches on GPU 1 (then GPU 0)
        x = rng.standard_normal((3001, width(sources[name]))).astype(np.float32)
        assert rel_l2(sess.run(None, {"x": x})[0], stock(sources[name], x)) <= TOL["fp16"], (name, dev)
    jobs = [(sess, sources[name], seed) for seed, ((name, _), sess) in enumerate(sessions.items())]
    assert not _run_concurrently(jobs)
