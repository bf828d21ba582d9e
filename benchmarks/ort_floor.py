"""ONNX Runtime's own cost of one run on the CUDA EP, beside a converted model's (issues 15, 16).

    python benchmarks/ort_floor.py [MODEL] [--batches 1,2097152] [--reps 300] [--out DIR]

A target through ORT is a kernel time plus what every `run_with_iobinding` costs before and after the
GPU works. This times, in turns (bench's interleaved timing, IOBinding, device-resident buffers):
  - `one Relu`: a model of one stock Relu node on MODEL's input: the least a CUDA-EP run can cost;
  - `stock fp32`: MODEL as it is;
  - `fused`: MODEL converted at fp16 as `onnx2fused bench` converts it (its plugin registered).
At batch 1 the kernels take a few microseconds, so each row is the per-run cost of ORT (and, for the
fused model, of the custom op's host code); at a large batch the difference from `one Relu`'s batch-1
time is what the kernels leave. Prints medians (ms) and writes ort_floor.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import onnx
from onnx import helper

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from onnx2fused.bench.models import model_info  # noqa: E402
from onnx2fused.bench.timing import _cuda_torch, _Dev, _ort_gpu_runner  # noqa: E402
from onnx2fused.bench.variants import convert_model, fused_session  # noqa: E402


def relu_model(src: Path, dst: Path) -> Path:
    """One Relu over src's first input (same name, type and shape), written to dst."""
    first = onnx.load(str(src), load_external_data=False).graph.input[0]
    out = helper.make_tensor_value_info("relu_out", first.type.tensor_type.elem_type, None)
    graph = helper.make_graph([helper.make_node("Relu", [first.name], ["relu_out"])], "one_relu", [first], [out])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(dst))
    return dst


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default=str(ROOT / "models" / "nerf.opset17.onnx"))
    ap.add_argument("--batches", default="1,2097152")
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    import onnxruntime as ort
    torch = _cuda_torch()
    if torch is None:
        raise SystemExit("ort_floor.py needs torch with CUDA (device buffers, CUDA events)")
    dev = _Dev(torch)
    providers = ["CUDAExecutionProvider", "CPUExecutionProvider"]
    src = Path(args.model)
    rows = []
    with tempfile.TemporaryDirectory(prefix="o2f-floor-") as tmp:
        relu = relu_model(src, Path(tmp) / "relu.onnx")
        fused, lib = convert_model(src, Path(tmp) / "fused", "fp16", True)   # as onnx2fused bench converts
        sessions = {
            "one Relu": (ort.InferenceSession(str(relu), ort.SessionOptions(), providers=providers), model_info(relu)),
            "stock fp32": (ort.InferenceSession(str(src), ort.SessionOptions(), providers=providers), model_info(src)),
            "fused": (fused_session(fused, lib, ort.SessionOptions(), providers), model_info(fused)),
        }
        for batch in [int(b) for b in args.batches.split(",")]:
            runners = {name: _ort_gpu_runner(dev, sess, info, batch) for name, (sess, info) in sessions.items()}
            ts = dev.time_interleaved({name: r[0] for name, r in runners.items()}, args.reps, 20)
            del runners
            row = {"batch": batch, **{name: round(statistics.median(t), 4) for name, t in ts.items()}}
            rows.append(row)
            print(" ".join(f"{k} {v}" for k, v in row.items()), flush=True)
    result = {"model": src.name, "device": torch.cuda.get_device_name(), "reps": args.reps, "rows": rows}
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "ort_floor.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
