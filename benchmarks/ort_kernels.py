"""Which CUDA kernels a converted model launches inside ONNX Runtime, and for how long (issue 15: where the
time between the fused kernel alone and the same model through ORT goes).

    python benchmarks/ort_kernels.py FUSED.onnx --rows N [--reps 20]

Runs the fused model on the CUDA EP with IOBinding (inputs and outputs on the GPU, as `onnx2fused bench`
does), then once more per rep under torch's profiler, which sees every kernel of the process (ORT's
included, through CUPTI: benchmarks/kernel_profile.py). Prints each kernel's device time and launches per
run, and the wall time of one `run_with_iobinding` for comparison.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kernel_profile import kernel_table, profiled_kernels, ranked  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--rows", type=int, required=True)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--names", help="also write each kernel's full (mangled) name and time to this file")
    a = ap.parse_args()
    import onnx
    import onnxruntime as ort

    from onnx2fused.session import InferenceSession

    m = onnx.load(a.model, load_external_data=False)
    print("ops:", sorted({n.op_type for n in m.graph.node}))
    sess = InferenceSession(a.model, providers=["CUDAExecutionProvider"])
    binding = sess.io_binding()
    for i in sess.get_inputs():
        shape = [a.rows if not isinstance(d, int) else d for d in i.shape]
        dtype = np.float16 if "float16" in i.type else np.float32
        x = ort.OrtValue.ortvalue_from_numpy(np.random.default_rng(0).standard_normal(shape).astype(dtype), "cuda", 0)
        binding.bind_ortvalue_input(i.name, x)
    for o in sess.get_outputs():
        binding.bind_output(o.name, "cuda", 0)
    for _ in range(5):
        sess.run_with_iobinding(binding)
    t = []
    for _ in range(a.reps):
        t0 = time.perf_counter()
        sess.run_with_iobinding(binding)
        binding.synchronize_outputs()
        t.append(time.perf_counter() - t0)
    print(f"run_with_iobinding: median {1e3 * float(np.median(t)):.4f} ms over {a.reps}")
    per = profiled_kernels(lambda: sess.run_with_iobinding(binding), a.reps)
    print(f"kernels (device time per run, us; {a.reps} runs):")
    print("\n".join(kernel_table(per, a.reps, width=150)))
    if a.names:
        Path(a.names).write_text("".join(f"{len(t)} x {np.mean(t) / 1e3:.4f} ms\n{n}\n\n" for n, t in ranked(per)))


if __name__ == "__main__":
    main()
