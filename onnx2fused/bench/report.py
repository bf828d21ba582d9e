"""bench: the result's metadata (versions, commit, command line, device), the table, bench.json and the
plot."""
from __future__ import annotations

import importlib
import importlib.util
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import traceback
from pathlib import Path

import numpy as np

from .models import _reason

LABELS = {
    "ort_fp32": "ORT CUDA fp32", "ort_fp16": "ORT CUDA fp16", "fused": "onnx2fused",
    "fused_graph": "onnx2fused CUDA graph", "fused_fp16": "onnx2fused on the fp16 copy",
    "ort_fp16_pipelined": "ORT CUDA fp16 pipelined", "fused_pipelined": "onnx2fused pipelined",
    "fused_sustained": "onnx2fused sustained",
    "torch_eager": "torch eager fp16", "torch_compile": "torch.compile fp16",
    "ort_cpu": "ORT CPU", "fused_cpu": "onnx2fused CPU",
}
GPU_VARIANTS = ["ort_fp32", "ort_fp16", "fused", "fused_graph", "torch_eager", "torch_compile"]


# ----------------------------------------------------------------------------------------- metadata

COMMIT_ENV = "ONNX2FUSED_COMMIT"


def _git_commit() -> str | None:
    """HEAD of the checkout this runs from (`-dirty` with uncommitted changes), or $ONNX2FUSED_COMMIT: a
    copy of the tree whose .git is stale (the GPU host's copy keeps the session's first one) is told
    which commit it holds."""
    told = os.environ.get(COMMIT_ENV, "").strip()
    if told:
        return told
    here = Path(__file__).resolve().parent
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10)
        if sha.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=10)
        return sha.stdout.strip() + ("-dirty" if dirty.returncode == 0 and dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def _versions() -> dict:
    v = {"python": platform.python_version()}
    for mod in ("onnx2fused", "onnxruntime", "onnx", "numpy", "torch"):
        try:
            v[mod] = importlib.import_module(mod).__version__
        except Exception:
            v[mod] = None
    try:
        import torch
        v["torch_cuda"] = torch.version.cuda
    except Exception:
        pass
    return v


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _command_line() -> str:
    if not sys.argv:
        return ""
    prog = Path(sys.argv[0]).name
    if prog == "__main__.py":
        prog = f"python -m {Path(sys.argv[0]).resolve().parent.name}"
    return " ".join([prog] + [shlex.quote(a) for a in sys.argv[1:]])


# ------------------------------------------------------------------------------------------ output

def _fmt(v, spec="{:.4f}") -> str:
    return "n/a" if v is None else spec.format(v)


def _timing_cell(r: dict, v: str) -> str:
    """`median (p10..p90)` of a variant in a row (ms); the median alone for rows without the spread."""
    med = r["ms"].get(v)
    if med is None:
        return "n/a"
    p10, p90 = r.get("p10_ms", {}).get(v), r.get("p90_ms", {}).get(v)
    return f"{med:.4f}" if p10 is None or p90 is None else f"{med:.4f} ({p10:.4f}..{p90:.4f})"


SPREAD = " (p10..p90)"


def format_table(result: dict) -> str:
    """The result's table: per batch, each variant's median time with its p10..p90 spread, the speed-ups
    (of the medians) and, on a GPU, the floor; then why each missing value is missing."""
    if result["mode"] == "cpu":
        cols = [("batch", lambda r: str(r["batch"])),
                ("ORT CPU ms" + SPREAD, lambda r: _timing_cell(r, "ort_cpu")),
                ("fused CPU ms" + SPREAD, lambda r: _timing_cell(r, "fused_cpu")),
                ("speed-up", lambda r: _fmt(r.get("speedup_vs_ort_cpu"), "{:.2f}x")),
                ("fused GFLOP/s", lambda r: _fmt(r.get("fused_gflops"), "{:.1f}"))]
    else:
        cols = [("batch", lambda r: str(r["batch"]))]
        variants = result.get("variants") or GPU_VARIANTS
        for v in variants:
            cols.append((LABELS[v] + " ms" + SPREAD, lambda r, v=v: _timing_cell(r, v)))
        cols += [("fused/fp32 x", lambda r: _fmt(r.get("speedup_vs_ort_fp32"), "{:.2f}")),
                 ("fused/fp16 x", lambda r: _fmt(r.get("speedup_vs_ort_fp16"), "{:.2f}"))]
        if "fused_fp16" in variants:   # the fp16 copy fused, against ORT on the same copy
            cols.append(("fused fp16 copy/fp16 x", lambda r: _fmt(r.get("speedup_fp16_vs_ort_fp16"), "{:.2f}")))
        if "fused_pipelined" in variants:   # both pipelined
            cols.append(("pipelined fused/fp16 x", lambda r: _fmt(r.get("speedup_pipelined_vs_ort_fp16"), "{:.2f}")))
        cols += [("fused TFLOP/s", lambda r: _fmt(r.get("fused_tflops"), "{:.2f}")),
                 ("floor ms", lambda r: _fmt(r.get("floor_ms"))),
                 ("fused/floor", lambda r: _fmt(r.get("fused_over_floor"), "{:.2f}"))]
    table = [[h for h, _ in cols]] + [[f(r) for _, f in cols] for r in result["rows"]]
    widths = [max(len(row[i]) for row in table) for i in range(len(cols))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    na = {}
    for r in result["rows"]:
        for v, why in r.get("na", {}).items():
            na.setdefault(v, why)
    lines += [f"n/a {v}: {why}" for v, why in na.items()]
    return "\n".join(lines)


def _jsonable(o):
    if isinstance(o, dict):
        return {str(k): _jsonable(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_jsonable(v) for v in o]
    if isinstance(o, (np.floating, np.integer)):
        return o.item()
    if isinstance(o, float) and not math.isfinite(o):
        return None
    return o


NO_MATPLOTLIB = 'no plot: matplotlib is not installed (pip install matplotlib, or the "bench" extra)'


def _write_outputs(result: dict, out_dir: Path, say=None) -> None:
    """bench.json, then bench.png when matplotlib is there: without it, or when plotting fails, one note
    line on stderr (the numbers are in the JSON; a plotting problem must not lose them)."""
    say = say or (lambda msg: None)
    jp = out_dir / "bench.json"
    jp.write_text(json.dumps(_jsonable(result), indent=1) + "\n")
    print(f"wrote {jp}")
    if importlib.util.find_spec("matplotlib") is None:
        print(f"onnx2fused: {NO_MATPLOTLIB}", file=sys.stderr)
        return
    say("plotting")
    try:
        pp = plot(result, out_dir / "bench.png")
        print(f"wrote {pp}")
    except Exception as e:
        if os.environ.get("ONNX2FUSED_DEBUG"):
            traceback.print_exc()
        print(f"onnx2fused: no plot: {_reason(e)}", file=sys.stderr)


def plot(result: dict, path: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    rows = result["rows"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))
    for v in result["variants"]:
        pts = [(r["batch"], r["ms"][v]) for r in rows if r["ms"].get(v)]
        if pts:
            line, = ax1.plot(*zip(*pts), marker="o", label=LABELS.get(v, v))
            band = [(r["batch"], r["p10_ms"][v], r["p90_ms"][v]) for r in rows
                    if r.get("p10_ms", {}).get(v) and r.get("p90_ms", {}).get(v)]
            if len(band) > 1:   # the p10..p90 spread around the median
                bx, lo, hi = zip(*band)
                ax1.fill_between(bx, lo, hi, color=line.get_color(), alpha=0.15, lw=0)
    if result["mode"] == "gpu":
        pts = [(r["batch"], r["floor_ms"]) for r in rows if r.get("floor_ms")]
        if pts:
            ax1.plot(*zip(*pts), "k--", label="floor (measured BW / TC)")
        sp = [("speedup_vs_ort_fp32", "fused vs ORT fp32"), ("speedup_vs_ort_fp16", "fused vs ORT fp16"),
              ("speedup_fp16_vs_ort_fp16", "fused fp16 copy vs ORT fp16")]
    else:
        sp = [("speedup_vs_ort_cpu", "fused vs ORT CPU")]
    ax1.set_xscale("log", base=2)
    ax1.set_yscale("log")
    ax1.set_xlabel("batch")
    ax1.set_ylabel("time per run (ms, median; band p10..p90)")
    ax1.set_title(f"{Path(result['model']).name} on {result['device']}", fontsize=9)
    ax1.grid(True, which="both", alpha=0.3)
    ax1.legend(fontsize=8)
    for key, label in sp:
        pts = [(r["batch"], r[key]) for r in rows if r.get(key)]
        if pts:
            ax2.plot(*zip(*pts), marker="o", label=label)
    ax2.axhline(1.0, color="gray", lw=0.8)
    ax2.set_xscale("log", base=2)
    ax2.set_xlabel("batch")
    ax2.set_ylabel("speed-up (x)")
    ax2.set_title("speed-up of the fused model", fontsize=9)
    ax2.grid(True, which="both", alpha=0.3)
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
