"""How long one CUTLASS 3.x kernel instance takes to compile with nvcc flag variants (issue 14 §5).

    python benchmarks/instance_flags.py [--model models/mnist.opset17.onnx] [--reps 2] [--out DIR]

A cold convert of a wide chain waits on its Hopper instance units (one nvcc each, serial inside: cicc is
most of it). This converts MODEL once into a fresh cache (no validation), takes the instance units'
exact compile commands from `build._jobs`, and compiles the first one again with each variant: as
built, without `-lineinfo`, with `-split-compile=0` (NVVM's optimizer over every core), and both.
Prints the wall time of each compile (median of --reps) and whether the SASS of each variant is
identical to the build's (cuobjdump -sass, header lines dropped), and writes instance_flags.json.
Run on the GPU host (16 cores); split compilation is pointless on 2.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from onnx2fused import build, targets  # noqa: E402
from onnx2fused.headers import find_cutlass_headers, locate_ort_headers  # noqa: E402

VARIANTS = {
    "as built": lambda args: args,
    "no -lineinfo": lambda args: [a for a in args if a != "-lineinfo"],
    "-split-compile=0": lambda args: [args[0], "-split-compile=0", *args[1:]],
    "both": lambda args: [args[0], "-split-compile=0", *[a for a in args[1:] if a != "-lineinfo"]],
}


def sass(obj: Path) -> str | None:
    """The object's SASS without the lines that name the file or the ptxas options; None without cuobjdump."""
    tool = shutil.which("cuobjdump") or next((str(p) for p in Path("/usr/local").glob("cuda*/bin/cuobjdump")), None)
    if not tool:
        return None
    text = subprocess.run([tool, "-sass", str(obj)], capture_output=True, text=True).stdout
    return "\n".join(l for l in text.splitlines() if "identifier =" not in l and "ptxasOptions =" not in l)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(ROOT / "models" / "mnist.opset17.onnx"))
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="o2f-inst-") as tmp:
        tmp = Path(tmp)
        cache = tmp / "cache"
        subprocess.run([sys.executable, "-m", "onnx2fused", "convert", args.model, "-o", str(tmp / "m.onnx"),
                        "--no-validate", "--quiet", "--cache-dir", str(cache)], check=True)
        entry = next(p for p in cache.iterdir() if (p / "sources").is_dir())
        sources = {p.name: p.read_text() for p in (entry / "sources").iterdir()}
        nvcc = targets.find_nvcc()
        jobs = build._jobs(sources, targets.find_cxx(), nvcc, targets.cpu_host_flags(), targets.nvcc_flags()
                           + ["-DONNX2FUSED_WITH_CUDA"], set(build.plugin_sources(True)), {}, find_cutlass_headers())
        instances = [j for j in jobs if targets.sm90a_only(sources[j.name])]
        if not instances:
            raise SystemExit(f"{args.model}: no Hopper instance unit in its library")
        job = instances[0]
        include = locate_ort_headers(cache).path
        rows, reference = [], None
        for name, change in VARIANTS.items():
            times, same = [], None
            for r in range(args.reps):
                obj = tmp / f"v{len(rows)}_{r}.o"
                cmd = change(job.command(entry / "sources", include, obj))
                t0 = time.monotonic()
                p = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp)
                times.append(time.monotonic() - t0)
                if p.returncode != 0:
                    raise SystemExit(f"{name}: nvcc failed: {p.stderr.strip()[-400:]}")
            code = sass(obj)
            if reference is None:
                reference = code
            elif code is not None:
                same = code == reference
            rows.append({"variant": name, "seconds": [round(t, 1) for t in times],
                         "median_s": round(statistics.median(times), 1), "sass_identical": same})
            print(f"{name:18s} {statistics.median(times):6.1f} s  {times}  SASS identical: {same}", flush=True)
        result = {"unit": job.name, "cores": os.cpu_count(), "nvcc": targets.compiler_version(nvcc), "rows": rows,
                  "instances": [j.name for j in instances]}
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / "instance_flags.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
