"""A converted model's runs back to back through ORT, against the GPU's own period between them (issue 15).

    python benchmarks/ort_bursts.py [--models nerf:2097152,gelu:1048576,silu:262144,sdf:1048576] [--out DIR]

bench's `fused_pipelined` times bursts of 10 runs from an idle GPU. This asks what such a figure is made of,
per model of models/ (its opset-17 export, converted at fp16 as bench converts it, float32 rows bound by
IOBinding):
  - burstB: host time per run of B runs back to back (all but the last without ORT's stream wait,
    run option disable_synchronize_execution_providers), B = 10, 100 and 400, medians of 7;
  - sync_run: one run with ORT's wait, host time, median of 50;
  - under torch's profiler, 60 runs back to back: each kernel's device time, the gaps between one GPU
    activity's end and the next one's start, and the period from one run's kernel start to the next's.
Where a burst's time per run exceeds that period, the runs' kernels themselves took longer in the burst
(the board's power limit lowers the clock within milliseconds of sustained work: RESULTS.md, twenty-second
run), not ORT's host work, which the period would show as gaps.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from onnx2fused.bench.variants import convert_model  # noqa: E402

BURSTS = (10, 100, 400)
PROFILED_RUNS = 60


def _session(name: str, out: Path):
    import onnxruntime as ort
    fused, lib = convert_model(ROOT / "models" / f"{name}.opset17.onnx", out / name, "fp16", with_cuda=True)
    so = ort.SessionOptions()
    so.register_custom_ops_library(str(lib))
    return ort.InferenceSession(str(fused), so, providers=["CUDAExecutionProvider"])


def _host_ms(run, n: int) -> float:
    """Host ms per run of n runs back to back, the last one waiting for the GPU."""
    import torch
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n - 1):
        run(False)
    run(True)
    return (time.perf_counter() - t0) * 1e3 / n


def probe(name: str, rows: int, out: Path) -> None:
    import onnxruntime as ort
    import torch
    from torch.profiler import ProfilerActivity, profile
    sess = _session(name, out)
    x_info, y_info = sess.get_inputs()[0], sess.get_outputs()[0]
    k, n = x_info.shape[-1], y_info.shape[-1]
    x = torch.randn(rows, k, device="cuda")
    y = torch.empty(rows, n, device="cuda")
    io = sess.io_binding()
    io.bind_input(x_info.name, "cuda", 0, np.float32, [rows, k], x.data_ptr())
    io.bind_output(y_info.name, "cuda", 0, np.float32, [rows, n], y.data_ptr())
    no_wait = ort.RunOptions()
    no_wait.add_run_config_entry("disable_synchronize_execution_providers", "1")

    def run(wait: bool) -> None:
        sess.run_with_iobinding(io, None if wait else no_wait)

    for _ in range(10):
        run(True)
    times = {f"burst{b}": float(np.median([_host_ms(run, b) for _ in range(7)])) for b in BURSTS}
    times["sync_run"] = float(np.median([_host_ms(run, 1) for _ in range(50)]))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILED_RUNS):
            run(False)
        run(True)
        torch.cuda.synchronize()
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                   if e.device_type.name == "CUDA")
    kernels: dict[str, list[float]] = {}
    for start, end, kname in spans:
        kernels.setdefault(kname[:90], []).append(end - start)
    gaps = [spans[i + 1][0] - spans[i][1] for i in range(len(spans) - 1)]
    starts = [s for s, _, _ in spans]
    print(f"== {name} rows {rows}: " + ", ".join(f"{a} {b:.4f} ms" for a, b in times.items()))
    for kname, ds in kernels.items():
        print(f"   kernel {np.median(ds):8.1f} us x{len(ds)}  {kname}")
    print(f"   gaps between GPU activities: median {np.median(gaps):.2f} us, p90 {np.percentile(gaps, 90):.2f}, "
          f"max {max(gaps):.2f}")
    print(f"   period (one kernel's start to the next's) median {np.median(np.diff(starts)):.2f} us")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="nerf:2097152,gelu:1048576,silu:262144,sdf:1048576",
                    help="comma-separated NAME:ROWS of models/NAME.opset17.onnx")
    ap.add_argument("--out", default="/tmp/ort_bursts")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for item in a.models.split(","):
        name, rows = item.split(":")
        probe(name, int(rows), out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
