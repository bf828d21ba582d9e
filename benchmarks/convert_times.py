"""How long `onnx2fused convert` takes with default options, cold and warm, on every zoo model.

    python benchmarks/convert_times.py [--models nerf,gelu] [--export opset17] [--out DIR] [--cpu-only]

Cold: an empty build cache (the ORT headers are copied in, so no download is timed) and nothing else
shared, so every translation unit compiles. Warm: the same command again on that cache (library hit).
Each convert runs as its own process, as a user runs it; the wall time includes Python start-up,
loading, planning, building, writing and validating. Prints a table and writes convert_times.json.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_convert(src: Path, out: Path, cache: Path, cpu_only: bool) -> tuple[float, dict]:
    cmd = [sys.executable, "-m", "onnx2fused", "convert", str(src), "-o", str(out), "--json", "--quiet",
           "--cache-dir", str(cache)] + (["--cpu-only"] if cpu_only else [])
    t0 = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.monotonic() - t0
    if p.returncode != 0:
        raise SystemExit(f"convert failed on {src.name}: {p.stderr.strip().splitlines()[-1:]}")
    return seconds, json.loads(p.stdout)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="", help="comma-separated zoo names (default: all)")
    ap.add_argument("--export", default="opset17", help="zoo export to use (opset17 or dynamo)")
    ap.add_argument("--out", default="", help="folder for convert_times.json")
    ap.add_argument("--cpu-only", action="store_true", help="CPU-only libraries")
    args = ap.parse_args()
    zoo = json.loads((ROOT / "models" / "zoo.json").read_text())["models"]
    wanted = set(filter(None, args.models.split(",")))
    headers = os.environ.get("ONNXRUNTIME_INCLUDE_DIR")
    rows = []
    with tempfile.TemporaryDirectory(prefix="o2f-times-") as tmp:
        for m in zoo:
            if wanted and m["name"] not in wanted or args.export not in m["files"]:
                continue
            src = ROOT / "models" / m["files"][args.export]["file"]
            cache = Path(tmp) / f"cache-{m['name']}"
            cache.mkdir()
            if not headers:  # reuse the fetched headers: their download is not the build
                home = Path(os.environ.get("ONNX2FUSED_CACHE", Path.home() / ".cache" / "onnx2fused"))
                if (home / "headers").is_dir():
                    shutil.copytree(home / "headers", cache / "headers")
            cold, report = run_convert(src, Path(tmp) / f"{m['name']}.cold.onnx", cache, args.cpu_only)
            warm, again = run_convert(src, Path(tmp) / f"{m['name']}.warm.onnx", cache, args.cpu_only)
            rows.append({"model": m["name"], "cold_s": round(cold, 2), "warm_s": round(warm, 2),
                         "build_s": round(report["build_seconds"], 2), "warm_hit": again["cache_hit"],
                         "precisions": [c["precision"] for c in report["chains"]],
                         "with_cuda": report["with_cuda"]})
            print(f"{m['name']:8s} cold {cold:6.1f} s (build {report['build_seconds']:5.1f})  "
                  f"warm {warm:5.1f} s  hit={again['cache_hit']}  {rows[-1]['precisions']}", flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "convert_times.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
