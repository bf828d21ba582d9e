"""GPU time per kernel of one fused wide case through ORT (torch's profiler sees every kernel the process
launches): where a case's time goes, kernel by kernel.

    python benchmarks/profile_case.py dlrm [--runs 20] [--batch N] [--stock] [--fp16-model] [--out DIR] [--external]
    python benchmarks/profile_case.py --model M.onnx [--batch N] [--stock] ...   (any model: input 'x', output
        'y' or the model's one output; its first symbolic dim N rows, the others 1; --stock: M itself)

--fp16-model profiles the fp16 copy ORT fp16 runs, converted (fp16 rows in and out: wide_cases.py's
fused_fp16), in place of the fp32 model converted. --stock profiles stock ORT's fp16 copy of the same model beside it (bench.fp16_model_file), for the
kernel-by-kernel comparison. --external runs the fused session --runs times without torch's profiler,
for a profiler outside the process (Nsight Compute: benchmarks/gpu_host.sh ncuwide).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import onnxruntime as ort  # noqa: E402
import torch  # noqa: E402

from onnx2fused import bench  # noqa: E402
from kernel_profile import host_timeline, kernel_table, profiled_kernels  # noqa: E402
from wide_cases import BLOCK_CASES, CASES, build_model  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("case", choices=list(CASES), nargs="?")
    ap.add_argument("--model", help="profile this ONNX model (its own element type) instead of a case")
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--batch", type=int, help="the case's batch replaced")
    ap.add_argument("--stock", action="store_true", help="also profile stock ORT on the model's fp16 copy")
    ap.add_argument("--fp16-model", action="store_true", help="convert and profile the model's fp16 copy (fp16 I/O)")
    ap.add_argument("--out", default=str(ROOT / "build" / "bench" / "profile"))
    ap.add_argument("--external", action="store_true", help="no torch profiler: for Nsight Compute")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.model:
        return _profile_model(Path(a.model), a.batch or 256, out, a.runs, a.stock, a.external)
    if a.case is None:
        ap.error("name a case or --model")
    widths, act, in_shape, batch, _ = CASES[a.case]
    batch = a.batch or batch
    model = build_model(widths, act, in_shape, out / f"{a.case}.onnx", block=a.case in BLOCK_CASES)
    fp16_copy = bench.fp16_model_file(model, out / f"{a.case}.fp16.onnx") if a.fp16_model or a.stock else None
    src, io_type = (fp16_copy, torch.float16) if a.fp16_model else (model, torch.float32)
    fused, lib = bench.convert_model(src, out / (a.case + ("_fp16" if a.fp16_model else "")), "fp16", with_cuda=True)
    so = ort.SessionOptions()
    so.register_custom_ops_library(str(lib))
    shape = [batch if d == "batch" else d for d in in_shape]
    _profile(f"{a.case} fused" + (" (fp16 copy)" if a.fp16_model else ""),
             ort.InferenceSession(str(fused), so, providers=["CUDAExecutionProvider"]),
             shape, widths[-1], io_type, a.runs, a.external)
    if a.stock:
        stock = fp16_copy
        _profile(f"{a.case} ORT fp16", ort.InferenceSession(str(stock), providers=["CUDAExecutionProvider"]),
                 shape, widths[-1], torch.float16, a.runs)
    return 0


def _profile_model(model: Path, rows: int, out: Path, runs: int, stock: bool, external: bool) -> int:
    import onnx
    m = onnx.load(str(model), load_external_data=False)
    dims = [d.dim_value if d.HasField("dim_value") else None for d in m.graph.input[0].type.tensor_type.shape.dim]
    shape = [d if d is not None else (rows if i == dims.index(None) else 1) for i, d in enumerate(dims)]
    dtype = torch.float16 if m.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT16 else torch.float32
    out_dims = [d.dim_value if d.HasField("dim_value") else None for d in m.graph.output[0].type.tensor_type.shape.dim]
    width_out = out_dims[-1]
    # an output of another rank than the input (PointNet: [B, 3, N] -> [B, 40]): its own dims, the batch's
    # symbolic one as the input's
    out_shape = (None if len(out_dims) == len(dims) else
                 [d if d is not None else (shape[dims.index(None)] if i == out_dims.index(None) else 1)
                  for i, d in enumerate(out_dims)])
    fused, lib = bench.convert_model(model, out / model.stem, "fp16", with_cuda=True)
    so = ort.SessionOptions()
    so.register_custom_ops_library(str(lib))
    _profile(f"{model.name} fused", ort.InferenceSession(str(fused), so, providers=["CUDAExecutionProvider"]),
             shape, width_out, dtype, runs, external, names=(m.graph.input[0].name, m.graph.output[0].name),
             out_shape=out_shape)
    if stock:
        _profile(f"{model.name} stock", ort.InferenceSession(str(model), providers=["CUDAExecutionProvider"]),
                 shape, width_out, dtype, runs, names=(m.graph.input[0].name, m.graph.output[0].name),
                 out_shape=out_shape)
    return 0


def _profile(title: str, sess, shape: list, width_out: int, dtype, runs: int, external: bool = False,
             names: tuple[str, str] = ("x", "y"), out_shape: list | None = None) -> None:
    """Print the GPU time per run of each kernel `sess` launches, `runs` runs under torch's profiler
    (`external`: only run it `runs` times, for a profiler outside the process). The output is
    shape[:-1] + [width_out] unless `out_shape` is given."""
    np_type = np.float16 if dtype == torch.float16 else np.float32
    x = torch.randn(shape, device="cuda").to(dtype)
    y = torch.empty(out_shape or list(shape[:-1]) + [width_out], device="cuda", dtype=dtype)
    io = sess.io_binding()
    io.bind_input(names[0], "cuda", 0, np_type, list(x.shape), x.data_ptr())
    io.bind_output(names[1], "cuda", 0, np_type, list(y.shape), y.data_ptr())
    for _ in range(5):
        sess.run_with_iobinding(io)
    torch.cuda.synchronize()
    if external:   # inside an NVTX range, which Nsight Compute can filter on (validation runs are outside)
        torch.cuda.nvtx.range_push("o2f_runs")
        for _ in range(runs):
            sess.run_with_iobinding(io)
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
        return
    spans: list[float] = []
    per = profiled_kernels(lambda: sess.run_with_iobinding(io), runs, spans)
    print(f"{title}: kernel time per run (us), {runs} runs")
    print("\n".join(kernel_table(per, runs)))
    if spans:
        print(f"  {float(np.median(spans)):8.1f}  first kernel's start to last kernel's end, median per run (us)")
    # the host's side of as many more runs: ORT's time before the first launch, the launch calls, the wait.
    # Separate runs on purpose: with CPU activity the profiler slows each launch call (~9 us on the H100
    # host), which would widen the spans above.
    phases = host_timeline(lambda: sess.run_with_iobinding(io), runs)
    print(f"{title}: host time per run (us, medians of {runs} runs)")
    for name, ts in phases.items():
        print(f"  {float(np.median(ts)):8.1f}  {name}")


if __name__ == "__main__":
    raise SystemExit(main())
