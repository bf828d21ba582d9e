"""CPU A/B of models in one process: ONNX Runtime CPU sessions timed in turns (so that a slow phase of a
shared host hits all of them), medians per batch size. A fused model takes its plugin library after a
colon; the original runs stock. The batch replaces the input's first dimension (PointNet's [B, 3, 1024]).

    python benchmarks/cpu_ab.py --batches 1,3,64,512 model.onnx old/model.fused.onnx:old/lib.so \\
        new/model.fused.onnx:new/lib.so
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import onnxruntime as ort


def session(spec: str, threads: int) -> ort.InferenceSession:
    path, _, lib = spec.partition(":")
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    if lib:
        so.register_custom_ops_library(lib)
    return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+", help="MODEL.onnx or FUSED.onnx:PLUGIN.so")
    ap.add_argument("--batches", default="1,64,512")
    ap.add_argument("--reps", type=int, default=60)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--stat", choices=("median", "min"), default="median",
                    help="min: the fastest run of each (a shared host's slow phases drop out)")
    args = ap.parse_args()
    sessions = [session(m, args.threads) for m in args.models]
    inp = sessions[0].get_inputs()[0]
    # the batch replaces the first dim; the others as the model fixes them (a symbolic one: 1)
    rest = [d if isinstance(d, int) and d > 0 else 1 for d in inp.shape[1:]]
    print("batch " + "  ".join(f"ms[{k}]" for k in range(len(sessions)))
          + f"   ({args.stat}s; models in argument order)")
    stat = np.median if args.stat == "median" else np.min
    for batch in (int(b) for b in args.batches.split(",")):
        x = np.random.default_rng(batch).standard_normal([batch] + rest).astype(np.float32)
        times = [[] for _ in sessions]
        for s in sessions:   # warm-up
            s.run(None, {inp.name: x})
        for _ in range(args.reps):
            for k, s in enumerate(sessions):
                t0 = time.perf_counter()
                s.run(None, {inp.name: x})
                times[k].append(time.perf_counter() - t0)
        print(f"{batch:5d} " + "  ".join(f"{stat(t) * 1e3:8.4f}" for t in times))


if __name__ == "__main__":
    main()
