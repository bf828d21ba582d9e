"""A fused model's GPU time through plain onnxruntime (IOBinding on device buffers, CUDA events), for the
GPU tests that compare timings within one test (never against a fixed number)."""
from __future__ import annotations

import numpy as np


def time_fused(model_path, library, rows: int, reps: int = 100, warmup: int = 20) -> float:
    """Median milliseconds of one Run of `model_path` (its single input [rows, K]) with `library`."""
    import onnxruntime as ort
    import torch
    so = ort.SessionOptions()
    so.register_custom_ops_library(str(library))
    sess = ort.InferenceSession(str(model_path), so, providers=["CUDAExecutionProvider", "CPUExecutionProvider"])
    inp, out = sess.get_inputs()[0], sess.get_outputs()[0]
    k, n = inp.shape[-1], out.shape[-1]
    x = torch.randn(rows, k, device="cuda")
    y = torch.empty(rows, n, device="cuda")
    io = sess.io_binding()
    io.bind_input(inp.name, "cuda", 0, np.float32, [rows, k], x.data_ptr())
    io.bind_output(out.name, "cuda", 0, np.float32, [rows, n], y.data_ptr())
    for _ in range(warmup):
        sess.run_with_iobinding(io)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        sess.run_with_iobinding(io)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return float(np.median(times))
