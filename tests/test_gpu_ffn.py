"""The whole FFN in one Hopper kernel (onnx2fused/plan/ffn.py) against stock ONNX Runtime (GPU host only).

Two-layer chains in the wide design, gated (SwiGLU) and not, with every width padded somewhere; batches
below the kernel's threshold (the GEMMs run) and above it (one kernel), outputs poisoned with NaN so
unwritten elements show; the same session with ONNX2FUSED_WIDE_FFN=0 (the GEMMs at every batch) and =1
(the kernel at every batch), and the kernels one run launches (torch's profiler)."""
from __future__ import annotations

import numpy as np
import onnx
import pytest

from gpu_support import check_cuda_graph_replay, rel_l2, require_cuda, run_poisoned  # noqa: E402
from thread_support import runs_unlike_alone  # noqa: E402

pytestmark = pytest.mark.gpu
ort, torch = require_cuda()

from onnx2fused import library, passes  # noqa: E402
from onnx2fused.loader import load_model  # noqa: E402
from onnx2fused.plan import ffn  # noqa: E402
from onnx2fused.plan.choose import make_plans  # noqa: E402
from onnx2fused.plan.options import PlanOptions  # noqa: E402
from test_gpu_gated import TOL, _hopper, _kernel_names, _reference, _swiglu_chain  # noqa: E402


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("gpu_ffn_cache")


def _fused_session(src, cache_dir, out, precision="fp16"):
    """A session of the model's one chain at `precision` in the wide design, which carries the FFN kernel."""
    return _session_with(out, _fused_library(src, cache_dir, out, precision))


def _fused_library(src, cache_dir, out, precision="fp16"):
    """The model's one chain at `precision` in the wide design, written to `out`; its library's path."""
    model = load_model(str(src))
    plan = passes.find_chains(model, **library.fusion_refusals(True))
    specs = [c.to_spec(precision) for c in plan.chains]
    plans = make_plans(specs, PlanOptions(design="wide", wgmma=False))
    assert len(specs) == 1 and plans[specs[0].name].ffn is not None, plans[specs[0].name].describe()
    lib = library.build_plugin(specs, with_cuda=True, cache_dir=cache_dir, plans=plans)
    onnx.save(passes.rewrite(model, plan, specs), str(out))
    return lib.path


def _session_with(fused, lib, cuda_options=None):
    so = ort.SessionOptions()
    so.register_custom_ops_library(str(lib))
    return ort.InferenceSession(str(fused), so, providers=[("CUDAExecutionProvider", cuda_options or {}),
                                                           "CPUExecutionProvider"])


def _rows_for_the_kernel() -> int:
    """A batch just over the kernel's threshold on this GPU (MIN_ROWS_PER_SM rows per SM), odd."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return ffn.MIN_ROWS_PER_SM * sms + 37


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize("k,widths,gated", [
    (256, [1024, 256], {0}),    # issue 16's SwiGLU block (with biases)
    (72, [1000, 50], {0}),      # K0 padded to 128, the hidden to 1024, the outputs to 64
    (192, [768, 192], set()),   # ViT-tiny's widths, ReLU: a plain (not gated) hidden layer
    (256, [4096, 256], {0}),    # a wide gated hidden layer: 128 chunks, each with its bias in the ring slot
    (16, [32, 24], {0}),        # one chunk: the peeled first and last turns are the same chunk's
])
def test_the_ffn_kernel_matches_stock_ort(k, widths, gated, precision, cache_dir, tmp_path, monkeypatch):
    src = tmp_path / "ffn.onnx"
    onnx.save(_swiglu_chain(k, widths, gated), str(src))
    sess = _fused_session(src, cache_dir, tmp_path / "fused.onnx", precision)
    tol = TOL[precision]
    rng = np.random.default_rng(11)
    big = _rows_for_the_kernel()
    for batch in (1, 4099, big, 2 * big + 1):
        x = rng.standard_normal((batch, k)).astype(np.float32)
        ref = _reference(src, x)
        y = run_poisoned(sess, x, ref.shape)
        err = rel_l2(y, ref)
        assert err <= tol, f"{k}->{widths} {precision} batch {batch}: rel L2 {err:.2e}"
        monkeypatch.setenv(ffn.FFN_ENV, "0")   # the GEMMs on the same session
        y_gemms = run_poisoned(sess, x, ref.shape)
        monkeypatch.setenv(ffn.FFN_ENV, "1")   # the kernel from 1 row: every batch here (1 row: one CTA)
        y_kernel = run_poisoned(sess, x, ref.shape)
        monkeypatch.delenv(ffn.FFN_ENV)
        for other in (y_gemms, y_kernel):
            assert rel_l2(other, ref) <= tol and rel_l2(y, other) <= tol, batch


def test_hopper_runs_the_ffn_as_one_kernel_from_a_pass_per_sm(cache_dir, tmp_path, monkeypatch):
    if not _hopper():
        pytest.skip("the FFN kernel runs on compute capability 9.0 only")
    src = tmp_path / "swiglu.onnx"
    onnx.save(_swiglu_chain(256, [1024, 256], {0}), str(src))
    sess = _fused_session(src, cache_dir, tmp_path / "fused.onnx")
    x = np.random.default_rng(3).standard_normal((_rows_for_the_kernel(), 256)).astype(np.float32)
    names = _kernel_names(sess, x)
    if not names:
        pytest.skip("the profiler recorded no CUDA kernels here (CUPTI unavailable)")
    assert "ffn_kernel" in names and "light_gemm" not in names and "convert_rows" not in names, names
    small = _kernel_names(sess, x[:4099])   # under the threshold: the GEMMs
    assert "ffn_kernel" not in small and "light_gemm" in small, small
    monkeypatch.setenv(ffn.FFN_ENV, "0")
    off = _kernel_names(sess, x)
    monkeypatch.setenv(ffn.FFN_ENV, "4000")   # the threshold moved to 4000 rows: 4099 rows take the kernel
    moved = _kernel_names(sess, x[:4099])
    monkeypatch.delenv(ffn.FFN_ENV)
    assert "ffn_kernel" not in off and "light_gemm" in off, off
    assert "ffn_kernel" in moved and "light_gemm" not in moved, moved


def test_convert_validates_the_kernel_at_every_batch(tmp_path):
    """convert() with defaults: the SwiGLU block goes wide with the kernel, and validation runs its sets
    (1, 37 and 256 rows: under the threshold) again with the kernel taken at every batch."""
    import onnx2fused
    src = tmp_path / "swiglu.onnx"
    onnx.save(_swiglu_chain(256, [1024, 256], {0}), str(src))
    res = onnx2fused.convert(src, tmp_path / "swiglu.fused.onnx", cache_dir=tmp_path / "cache")
    (chain,) = res.chains
    assert "whole FFN in one kernel" in chain.cuda_plan
    v = res.validation
    assert v.provider == "CUDAExecutionProvider" and v.passed, v
    assert "every set again with the FFN kernel at every batch" in v.tolerance_note, v.tolerance_note


def test_the_ffn_kernel_under_a_cuda_graph_and_eight_threads(cache_dir, tmp_path, monkeypatch):
    """The kernel taken at every batch (ONNX2FUSED_WIDE_FFN=1): a CUDA graph captured around its run replays
    with new inputs, and eight threads on one session (ORT gives each Run its own stream; the kernel's
    image is shared, read-only) each get their own rows back."""
    if not _hopper():
        pytest.skip("the FFN kernel runs on compute capability 9.0 only")
    monkeypatch.setenv(ffn.FFN_ENV, "1")
    src = tmp_path / "swiglu.onnx"
    onnx.save(_swiglu_chain(256, [1024, 256], {0}), str(src))
    fused = tmp_path / "fused.onnx"
    lib = _fused_library(src, cache_dir, fused)
    sess = _session_with(fused, lib)
    graphed = _session_with(fused, lib, {"enable_cuda_graph": "1"})
    check_cuda_graph_replay(graphed, lambda x: _reference(src, x), 3001, 256, 256, TOL["fp16"], replays=2)

    rng = np.random.default_rng(5)
    xs = [[rng.standard_normal((int(rng.integers(1, 3000)), 256)).astype(np.float32) for _ in range(12)]
          for _ in range(8)]
    alone, bad = runs_unlike_alone(lambda x: sess.run(None, {"x": x})[0], xs,
                                   lambda y, ref: y.shape == ref.shape and np.array_equal(y, ref))   # same kernel, same rows
    assert rel_l2(alone[0][0], _reference(src, xs[0][0])) <= TOL["fp16"]
    assert not bad, bad[:10]
