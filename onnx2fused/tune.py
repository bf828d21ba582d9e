"""`onnx2fused tune MODEL`: the wide design's Hopper kernel search for a model, as a step of its own.

convert uses the kernel choices cached for this GPU, else the default kernels: the search (minutes of
nvcc and GPU time per wide chain, wide_tune.py) is off its critical path. This command runs it for
every wide chain of MODEL that has no cached choice on this GPU, and stores the choices in the build
cache, where every later convert of a chain with the same spec on the same GPU model finds them (as
does `convert --tune`, which searches in line). Nothing is written beside MODEL.
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

from .errors import ConversionError


def add_arguments(parser) -> None:
    parser.add_argument("model", metavar="MODEL", help="an original (unfused) ONNX model")
    parser.add_argument("--precision", choices=["auto", "fp16", "bf16", "tf32", "fp32"], default="auto",
                        help="the chains' precision, as convert would choose it (default auto)")
    parser.add_argument("--cache-dir", metavar="DIR", help="build cache to store the choices in "
                                                         "(default $ONNX2FUSED_CACHE or ~/.cache/onnx2fused)")
    parser.add_argument("--json", action="store_true", help="print the chains and their plans as JSON")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")


def main(args) -> int:
    from . import wide_tune
    from .cli import progress
    from .convert import convert
    if wide_tune.tunable_gpu() is None:
        why = ("ONNX2FUSED_TUNE=0 turns it off" if not wide_tune.tuning_enabled()
               else "no GPU of compute capability 9.0 is visible")
        raise ConversionError(f"nothing to tune: the kernel search runs on a Hopper GPU ({why}); convert uses "
                              "the default kernels elsewhere")
    with tempfile.TemporaryDirectory(prefix="onnx2fused-tune-") as tmp:
        result = convert(args.model, Path(tmp) / "tuned.onnx", precision=args.precision, validate=False,
                         cache_dir=args.cache_dir, tune=True, progress=progress(args))
    rows = [{"chain": c.index, "op": c.name, "precision": c.precision, "plan": c.cuda_plan} for c in result.chains]
    if args.json:
        print(json.dumps(rows, indent=1))
    elif not rows:
        print(f"{args.model}: no chain to tune ({result.nothing_to_fuse})")
    else:
        for r in rows:
            print(f"chain {r['chain']} ({r['precision']}): {r['plan']}")
    return 0
