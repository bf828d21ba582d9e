"""The wide design's one-kernel FFN (templates/cuda_wide_ffn.cu.j2, o2f_ffn_pair.cuh) alone on the GPU: the
unit rendered from a plan as convert renders it, compiled with build.py's sm_90a flags into a small program
(benchmarks/ffn_unit_main.cu) that packs random weights through the unit's own `pack`, runs its `run` on
fp32 rows, checks sampled rows against a float64 reference and times the launches with CUDA events. No
ONNX Runtime: the kernel's own time, where `wide_cases.py` measures it through ORT (RESULTS.md, twenty-ninth
run: the prototype gained 11 % from the warpgroups' turns, the library through ORT 2 %).

    python3 benchmarks/ffn_unit_check.py [--cases swiglu256 swiglu256_a32 pair256] [--rows 262144,65536]
                                         [--diag NAME=CASE:MACRO[+MACRO]] [--out DIR] [--build-only]

--build-only builds the programs on a host without a GPU (nvcc only) for a later run on the GPU host (carry the
folder; RESULTS.md, thirty-first run, ran its builds that way).

A case is a spec (CASES); `_a32` renders it with act_math "fp32" (the glu in fp32 where the default packs it).
--diag builds CASE again with O2F_DIAG_<MACRO> defined (NO_TURNS: the two warpgroups in step, as before the
turns; BIAS_EPI: the hidden bias added in the activation, not as the accumulators' start; X_SMEM: layer 0's
input A operand all from shared memory; NO_FILL: the ring moves no weight bytes; NO_X: the input tile
converted on the first pass only; NO_STORE: no output stores; the last three wrong by design), or with a macro named in
full (O2F_...). Every build prints its error on the sampled rows (a NO_FILL build's is wrong by design).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from onnx2fused import codegen, targets  # noqa: E402
from onnx2fused import expr as ex  # noqa: E402
from onnx2fused.plan import choose  # noqa: E402
from onnx2fused.plan.options import WideOptions  # noqa: E402
from onnx2fused.spec import LayerSpec, MLPSpec  # noqa: E402
from onnx2fused.wide_params import ffn_unit  # noqa: E402

# name -> (K0, H, N, gated, hidden activation, its reference in ffn_unit_main.cu, precision, act_math)
CASES = {
    "swiglu256": (256, 1024, 256, True, ex.silu(), "SILU", "fp16", "packed"),
    "swiglu256_a32": (256, 1024, 256, True, ex.silu(), "SILU", "fp16", "fp32"),   # the glu in fp32
    "swiglu256_bf16": (256, 1024, 256, True, ex.silu(), "SILU", "bf16", "packed"),
    "pair256": (256, 4096, 256, False, ex.gelu_erf(), "GELU", "fp16", "packed"),
    "pair64": (64, 1000, 48, False, ex.gelu_erf(), "GELU", "fp16", "packed"),
    "vitt": (192, 768, 192, False, ex.gelu_erf(), "GELU", "fp16", "packed"),
    "one_chunk": (16, 32, 24, True, ex.silu(), "SILU", "fp16", "packed"),   # padded widths, a single chunk
}
MAIN = Path(__file__).with_name("ffn_unit_main.cu")


def render(case: str, folder: Path) -> Path:
    """The case's FFN unit and the headers it includes, written into `folder`; the unit's path."""
    k0, h, n, gated, act, _, precision, act_math = CASES[case]
    spec = MLPSpec((LayerSpec(k0, h, True, act, gated=gated), LayerSpec(h, n, True, ex.identity())), precision, "f32",
                   act_math=act_math)
    unit = ffn_unit(choose.wide_plan(spec, WideOptions()))
    if unit is None:
        raise SystemExit(f"{case}: no one-kernel FFN for this spec")
    name, params = unit
    folder.mkdir(parents=True, exist_ok=True)
    for file, text in codegen._with_headers({name: codegen._render(params["template"], params)}).items():
        (folder / file).write_text(text)
    (folder / "unit_name.h").write_text(f"#define FFN_UNIT_NS {params['name']}\n#include \"{name}\"\n")
    return folder / name


def build(case: str, folder: Path, defines: list[str]) -> Path:
    render(case, folder)
    exe = folder / "ffn_unit"
    flags = targets.sm90a_nvcc_flags(targets.nvcc_flags())
    cmd = ["nvcc", *flags, "-Xptxas", "-v", "-I", str(folder), f"-DREF_{CASES[case][5]}", *defines,
           str(MAIN), "-o", str(exe)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    (folder / "nvcc.txt").write_text(r.stdout + r.stderr)
    if r.returncode:
        raise SystemExit(f"{case}: nvcc failed:\n{r.stderr[-3000:]}")
    lines = (r.stdout + r.stderr).splitlines()
    start = next((i for i, l in enumerate(lines) if "Compiling entry function" in l and "ffn_kernel" in l), 0)
    report = [l.split("info    :")[-1].strip() for l in lines[start:start + 6] if "registers" in l or "spill" in l]
    report += [l.strip() for l in lines if "C75" in l]   # ptxas's wgmma warnings (serialized, injected fences)
    print(f"{folder.name}: ffn_kernel " + "; ".join(report), flush=True)
    return exe


def main() -> None:
    os.environ.setdefault("ONNX2FUSED_CUDA_ARCHS", "90")   # the unit holds sm_90a code only
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", nargs="*", default=["swiglu256", "swiglu256_a32", "pair256"], choices=sorted(CASES))
    ap.add_argument("--rows", default="262144,65536", help="batches, comma-separated")
    ap.add_argument("--diag", nargs="*", default=[], metavar="NAME=CASE:MACRO")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/ffn_unit"))
    ap.add_argument("--build-only", action="store_true",
                    help="build every program into OUT/NAME/ffn_unit and stop (nvcc here, the runs on the GPU host: "
                         "carry OUT, run OUT/NAME/ffn_unit ROWS...)")
    a = ap.parse_args()
    out = Path(a.out)
    builds = [(c, c, []) for c in a.cases]
    for item in a.diag:
        name, _, rest = item.partition("=")
        case, _, macros = rest.partition(":")
        if case not in CASES or not name or not macros:
            raise SystemExit(f"--diag {item!r}: expected NAME=CASE:MACRO[+MACRO]")
        # a macro named in full (O2F_...) as it is, else O2F_DIAG_<MACRO>
        builds.append((name, case, [f"-D{m}" if m.startswith("O2F_") else f"-DO2F_DIAG_{m.upper()}"
                                    for m in macros.split("+")]))
    exes = {name: build(case, out / name, defines) for name, case, defines in builds}
    if a.build_only:
        print("\n".join(f"{exe} {a.rows.replace(',', ' ')}" for exe in exes.values()))
        return
    rows = [r for r in a.rows.split(",") if r]
    results = {}
    for name, _, defines in builds:
        p = subprocess.run([str(exes[name]), *rows], capture_output=True, text=True, timeout=300)
        print(f"== {name}{' (' + ' '.join(defines) + ')' if defines else ''}\n{p.stdout}{p.stderr}",
              end="", flush=True)
        results[name] = {"defines": defines, "rc": p.returncode, "output": p.stdout}
    (out / "ffn_unit_check.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
