"""What the GPU-marked test modules share: the module-level skip on hosts without a CUDA device or
onnxruntime's CUDA EP, a run on device-resident buffers whose output is poisoned with NaN first (so
elements the kernel never writes show up), the relative L2 error that rejects such elements, and the
CUDA-graph replay check."""
from __future__ import annotations

import numpy as np
import pytest


def require_cuda():
    """(onnxruntime, torch) when both can use a GPU; otherwise the calling test module is skipped."""
    ort = pytest.importorskip("onnxruntime")
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip("onnxruntime has no CUDAExecutionProvider", allow_module_level=True)
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device", allow_module_level=True)
    return ort, torch


def run_poisoned(sess, x: np.ndarray, out_shape, offset: int = 0) -> np.ndarray:
    """Run `sess` on x through IOBinding with the input and a NaN-filled output on the device; `offset`:
    x placed that many elements into its device buffer (an input pointer of less alignment)."""
    import torch
    host = np.concatenate([np.zeros(offset, x.dtype), x.ravel()]) if offset else x   # (no copy at offset 0)
    buf = torch.from_numpy(host).cuda()
    yt = torch.full(tuple(out_shape), float("nan"), dtype=buf.dtype, device="cuda")
    io = sess.io_binding()
    io.bind_input(sess.get_inputs()[0].name, "cuda", 0, x.dtype, list(x.shape), buf.data_ptr() + offset * x.itemsize)
    io.bind_output(sess.get_outputs()[0].name, "cuda", 0, x.dtype, list(out_shape), yt.data_ptr())
    sess.run_with_iobinding(io)
    torch.cuda.synchronize()
    return yt.cpu().numpy()


def rel_l2(got: np.ndarray, ref: np.ndarray) -> float:
    """Relative L2 error; fails on an all-zero or non-finite reference and on any NaN/Inf in `got`."""
    ref = ref.astype(np.float64)
    assert np.isfinite(ref).all() and np.abs(ref).max() > 0, "reference is not finite or all zeros"
    assert np.isfinite(got).all(), f"{np.count_nonzero(~np.isfinite(got))} outputs unwritten or NaN"
    return float(np.linalg.norm(got.astype(np.float64) - ref) / np.linalg.norm(ref))


def check_cuda_graph_replay(sess, reference, rows: int, k: int, n: int, tol: float, replays: int = 3) -> None:
    """`sess` (CUDA EP with enable_cuda_graph) on fixed device buffers: the first run captures the graph,
    later runs replay it with new data written into the same input buffer; every output must match
    `reference(x)` (the NaN poison catches a replay that writes nothing)."""
    import torch
    xt = torch.empty((rows, k), device="cuda")
    yt = torch.empty((rows, n), device="cuda")
    io = sess.io_binding()
    io.bind_input(sess.get_inputs()[0].name, "cuda", 0, np.float32, [rows, k], xt.data_ptr())
    io.bind_output(sess.get_outputs()[0].name, "cuda", 0, np.float32, [rows, n], yt.data_ptr())
    for seed in range(1 + replays):
        x = np.random.default_rng(seed).standard_normal((rows, k)).astype(np.float32)
        xt.copy_(torch.from_numpy(x))
        yt.fill_(float("nan"))
        sess.run_with_iobinding(io)
        torch.cuda.synchronize()
        assert rel_l2(yt.cpu().numpy(), reference(x)) <= tol, f"run {seed} (0: the capture)"
