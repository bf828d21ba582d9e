"""The wide design's per-GPU kernel search (onnx2fused/wide_tune.py) on issue 5's cases, with every
candidate's time: what `onnx2fused convert` does once per spec and GPU model, made visible.

    python benchmarks/tune_wide.py [--out DIR] [--cases ffn,head] [--prebuilt DIR] [--reps 20] [--fp16-model]

For each case (benchmarks/wide_cases.py builds the model) whose plan is wide: build the tuning library
(or take DIR/lib<spec name>.so, compiled elsewhere from the same source), time the candidates, print
per layer and row bucket the default kernel's time and the fastest, and store the record where
`convert` looks for it ($ONNX2FUSED_CACHE/tune/, or --cache), plus a copy under --out.
No ONNX Runtime needed.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from onnx2fused import passes, wide_tune  # noqa: E402
from onnx2fused.library import build_plugin  # noqa: E402
from onnx2fused.plan.choose import make_plan  # noqa: E402
from onnx2fused.plan.options import PlanOptions  # noqa: E402
from onnx2fused.plan.wide import with_kernels  # noqa: E402
from onnx2fused.headers import default_cache_dir  # noqa: E402
from onnx2fused.loader import load_model  # noqa: E402
from wide_cases import BLOCK_CASES, CASES, build_model  # noqa: E402


def case_spec(name: str, out: Path, fp16_model: bool = False):
    """The case's chain (fp16); `fp16_model`: that of the model's fp16 copy (fp16 I/O), which ORT fp16 runs
    and wide_cases.py --fp16-model converts."""
    widths, act, in_shape, _, _ = CASES[name]
    path = build_model(widths, act, in_shape, out / f"{name}.onnx", block=name in BLOCK_CASES)
    if fp16_model:
        from onnx2fused import bench
        path = bench.fp16_model_file(path, out / f"{name}.fp16.onnx")
    model = load_model(str(path))
    chains = passes.find_chains(model).chains
    assert len(chains) == 1, f"{name}: {len(chains)} chains"
    return chains[0].to_spec("fp16")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/tune_wide"))
    ap.add_argument("--cases", default="ffn,head,dlrm")
    ap.add_argument("--prebuilt", help="folder with lib<spec name>.so tuning libraries")
    ap.add_argument("--cache", help="build cache (default: $ONNX2FUSED_CACHE or ~/.cache/onnx2fused)")
    ap.add_argument("--reps", type=int, default=wide_tune.REPS)
    ap.add_argument("--print-specs", action="store_true", help="print the spec names and exit")
    ap.add_argument("--fp16-model", action="store_true",
                    help="tune the chain of each case's fp16 copy (fp16 I/O: wide_cases.py --fp16-model's fused_fp16)")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    cache = Path(a.cache) if a.cache else default_cache_dir()
    gpu = wide_tune.current_gpu()
    specs = {name: case_spec(name, out, a.fp16_model) for name in a.cases.split(",")}
    if a.print_specs:
        for name, spec in specs.items():
            print(name, spec.name)
        return
    options = PlanOptions.from_env()
    plans = {name: make_plan(s, options) for name, s in specs.items()}
    tuning = {name: with_kernels(p, tuning=True) for name, p in plans.items() if p.design == "wide"
              or print(f"{name}: not a wide plan, nothing to tune")}
    specs = {name: specs[name] for name in tuning}

    def tuning_library(name) -> Path:
        spec = specs[name]
        lib = Path(a.prebuilt) / f"lib{spec.name}.so" if a.prebuilt else None
        if lib is None or not lib.is_file():
            lib = build_plugin([spec], with_cuda=True, cache_dir=cache, cpu_enabled={spec.name: False},
                               plans={spec.name: tuning[name]}, progress=print).path
        return lib
    with ThreadPoolExecutor(len(specs) or 1) as pool:   # nvcc jobs of all cases at once; timing one by one
        libs = dict(zip(specs, pool.map(tuning_library, specs)))
    for name, spec in specs.items():
        record = wide_tune.run_tuning(libs[name], tuning[name], a.reps)
        if gpu:
            wide_tune.store_record(cache, spec, gpu, record)   # where convert looks for it
        else:
            record["gpu"] = ""
        (out / f"{name}.tune.json").write_text(json.dumps(record, indent=1))
        print(f"== {name} ({spec.name}) on {record['gpu']}")
        print(f"{'layer':>5} {'rows':>6} {'default ms':>10} {'best ms':>8} {'gain':>6}  chosen / fastest")
        for g, per in enumerate(record["timings"]):
            for t in per:
                gain = t["default_ms"] / t["ms"] if t["ms"] else float("nan")
                print(f"{g:5d} {t['rows']:6d} {t['default_ms']:10.4f} {t['ms']:8.4f} {gain:6.2f}  "
                      f"{t['choice']} / {t['fastest']}")


if __name__ == "__main__":
    main()
