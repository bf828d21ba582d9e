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
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from onnx2fused.bench.models import model_info  # noqa: E402
from onnx2fused.bench.timing import _burst, _cuda_torch, _Dev, _ort_gpu_runner  # noqa: E402
from onnx2fused.bench.variants import convert_model, fused_session  # noqa: E402

BURSTS = (10, 100, 400)
PROFILED_RUNS = 60


def probe(dev: _Dev, name: str, rows: int, out: Path) -> None:
    """One model's bursts, waited runs and profiled period (the module's docstring), printed."""
    import onnxruntime as ort
    import torch
    from torch.profiler import ProfilerActivity, profile
    fused, lib = convert_model(ROOT / "models" / f"{name}.opset17.onnx", out / name, "fp16", with_cuda=True)
    sess = fused_session(fused, lib, ort.SessionOptions(), ["CUDAExecutionProvider"])
    step, _, buffers = _ort_gpu_runner(dev, sess, model_info(fused), rows)   # buffers: alive while step runs

    def burst(n: int) -> float:
        dev.sync()
        return _burst(step, n)

    for i in range(10):
        step(i)
    times = {f"burst{b}": float(np.median([burst(b) for _ in range(7)])) for b in BURSTS}
    times["sync_run"] = float(np.median([burst(1) for _ in range(50)]))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(PROFILED_RUNS):
            step(i, wait=False)
        step(PROFILED_RUNS)
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
    torch = _cuda_torch()
    if torch is None:
        raise SystemExit("ort_bursts.py needs torch with CUDA (device buffers, the profiler)")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for item in a.models.split(","):
        name, rows = item.split(":")
        probe(_Dev(torch), name, int(rows), out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
