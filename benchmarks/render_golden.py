"""Render the generated sources of a fixed set of cases into a folder, and compare two such folders.

    python benchmarks/render_golden.py render OUT       one folder per case, one file per source
    python benchmarks/render_golden.py compare A B      differences, with the .cuh headers inlined
    python benchmarks/render_golden.py compare --code A B   the same, comment lines (//) left out

The cases: every zoo model (models/zoo.json, both exports) at every precision, and the specs of the
planning and codegen tests (test_wide_plan, test_streamed_pairs, test_cuda_ptx, test_codegen,
test_registry_scratch, test_wide_tune), each with the CUDA design the cost model picks and with every
design forced (resident, streamed, wide, wide without a fused tail, wgmma), CPU-only, the wide design's tuning
build and tuned kernel choices. A case whose planning fails writes ERROR (the message) instead.

It is the check that a refactoring of planning or templates changes no generated source: render before,
render after, compare. `compare` inlines each `#include "<name>.cuh"` of a generated source with that
header (from the same folder, its own leading comment and `#pragma once` dropped), so moving static code
into a header is no difference when the expanded text is the same.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from onnx2fused import codegen, passes  # noqa: E402
from onnx2fused import expr as ex  # noqa: E402
from onnx2fused.loader import load_model  # noqa: E402
from onnx2fused.plan import choose, sm90  # noqa: E402
from onnx2fused.plan.options import PlanOptions, WideOptions  # noqa: E402
from onnx2fused.spec import LayerSpec, MLPSpec  # noqa: E402

PRECISIONS = ("fp16", "bf16", "tf32", "fp32")
DESIGNS = {  # case suffix -> the plan options
    "auto": PlanOptions(),
    "resident": PlanOptions(design="resident"),
    "streamed": PlanOptions(design="streamed"),
    "wide": PlanOptions(design="wide"),
    "wide_notail": PlanOptions(design="wide", wide_tail=False),
    "wgmma": PlanOptions(design="wgmma"),
}


def _spec(widths, act=ex.relu(), precision="fp16", io="f32", last=ex.identity()):
    n = len(widths) - 1
    return MLPSpec(tuple(LayerSpec(a, b, True, act(b) if callable(act) else act) if i < n - 1 else
                         LayerSpec(a, b, True, last(b) if callable(last) else last)
                         for i, (a, b) in enumerate(zip(widths, widths[1:]))), precision, io)


def _prelu(n):
    slope = ex.Chan(tuple(np.linspace(0.01, 0.3, n)))
    return ex.Op("select", (ex.Op("lt", (ex.X, ex.Const(0.0))), ex.X * slope, ex.X))


def _affine(n):
    return ex.X * ex.Chan(tuple(np.linspace(-1, 1, n))) + ex.Chan(tuple(np.arange(n) % 3))


def zoo_specs() -> dict[str, list[MLPSpec]]:
    out = {}
    zoo = json.loads((ROOT / "models" / "zoo.json").read_text())
    for entry in zoo["models"]:
        for kind, f in sorted(entry["files"].items()):
            chains = passes.find_chains(load_model(str(ROOT / "models" / f["file"]))).chains
            for p in PRECISIONS:
                out[f"zoo_{entry['name']}_{kind}_{p}"] = [c.to_spec(p) for c in chains]
    return out


def test_specs() -> dict[str, list[MLPSpec]]:
    widths_16 = [  # test_wide_plan, test_streamed_pairs, test_registry_scratch, test_wide_tune
        [9216, 4096, 4096, 1000], [768, 3072, 768], [32, 64, 64, 16], [256, 256, 256, 256, 256], [30, 64, 64, 16],
        [512, 256, 64, 1], [513, 256, 64, 1], [512, 260, 64, 1], [1024, 2048, 512, 64, 1], [1001, 520, 999],
        [1001, 517, 999], [512, 2048, 512], [32, 64, 16], [256, 4096, 256], [256, 4096, 128], [64, 1000, 48],
        [128, 2048, 2048, 64], [64, 320, 512, 64], [64, 512, 64, 520, 9], [300, 272, 9], [64, 64, 1000],
        [256, 256, 256, 256], [64, 128, 128, 64], [64, 200, 64], [13, 37, 5], [784, 512, 512, 10],
    ]
    out = {}
    for w in widths_16:
        name = "x".join(map(str, w))
        for p in ("fp16", "bf16", "tf32", "fp32"):
            for io in ("f32", "f16"):
                if io == "f16" and p != "fp16":
                    continue
                out[f"t_{name}_relu_{p}_{io}"] = [_spec(w, ex.relu(), p, io)]
        out[f"t_{name}_gelu_fp16_f32"] = [_spec(w, ex.gelu_erf())]
        out[f"t_{name}_silu_bf16_f32"] = [_spec(w, ex.silu(), "bf16")]
        out[f"t_{name}_sigmoid_fp16_f16"] = [_spec(w, ex.sigmoid(), io="f16")]
    # test_cuda_ptx
    for w, p in (([32, 50, 50, 7], "fp16"), ([300, 520, 9], "bf16"), ([64, 1000, 48], "bf16"),
                 ([64, 1000, 48], "tf32"), ([13, 37, 5], "fp32")):
        out[f"t_{'x'.join(map(str, w))}_prelu_affine_{p}"] = [_spec(w, _prelu, p, last=_affine)]
    out["t_1001x520x999_silu_nobias_fp16_f16"] = [
        MLPSpec((LayerSpec(1001, 520, True, ex.silu()), LayerSpec(520, 999, False, ex.identity())), "fp16", "f16")]
    out["t_512x2048x512_relu_last_relu"] = [_spec([512, 2048, 512], ex.relu(), "fp16", "f32", ex.relu())]
    # test_codegen
    out["t_codegen_specs"] = [
        _spec([32, 64, 64, 16]),
        MLPSpec((LayerSpec(13, 37, False, ex.gelu_erf()), LayerSpec(37, 5, True, ex.tanh())), "fp16", "f16"),
        MLPSpec((LayerSpec(7, 9, False, ex.leaky_relu(0.2)),), "fp16", "f32"),
    ]
    out["t_registry_mix"] = [_spec([9216, 4096, 4096, 1000]), _spec([32, 64, 16]), _spec([768, 3072, 768], precision="fp32")]
    return out


def wide_cases() -> list[tuple[str, MLPSpec, WideOptions]]:
    """The wide design with make_wide_plan options: tuning builds, tuned choices, fixed tails."""
    head, ffn, dlrm = _spec([9216, 4096, 4096, 1000]), _spec([768, 3072, 768], ex.gelu_erf()), _spec([512, 256, 64, 1])
    split4 = sm90.Sm90Choice(1, "split_k", 4)
    nb = 4
    out = [
        ("tuning_ffn", ffn, WideOptions(tuning=True)),
        ("tuning_dlrm", dlrm, WideOptions(tuning=True)),
        ("tuning_dlrm_f16", _spec([512, 256, 64, 1], io="f16"), WideOptions(tuning=True)),
        ("tuning_512x2048x512_bf16", _spec([512, 2048, 512], ex.relu(), "bf16", "f32", ex.relu()), WideOptions(tuning=True)),
        ("tuning_head", head, WideOptions(tuning=True)),
        ("choices_head", head, WideOptions(choices=((split4,) + (sm90.DEFAULT_CHOICE,) * (nb - 1),)
                                           + ((sm90.DEFAULT_CHOICE,) * nb,) * 2, tuned_on="H")),
        ("choices_ffn_block", ffn, WideOptions(choices=((sm90.Sm90Choice(6, "data_parallel"),) * nb,
                                                        (sm90.Sm90Choice(1, "stream_k"),) * nb),
                                               tuned_on="NVIDIA H100", chain_block=4096)),
        ("tail0_dlrm", dlrm, WideOptions(tail_from=0)),
        ("tail2_1024", _spec([1024, 2048, 512, 64, 1]), WideOptions(tail_from=2)),
        ("tail1_dlrm_f16", _spec([512, 256, 64, 1], io="f16"), WideOptions(tail_from=1)),
    ]
    return out


def _write(folder: Path, render) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    try:
        files = render()
    except Exception as e:  # noqa: BLE001 - the failure is part of the behaviour compared
        (folder / "ERROR").write_text(f"{type(e).__name__}: {e}\n")
        return
    for name, text in files.items():
        (folder / name).write_text(text)


def render_all(out: Path) -> int:
    n = 0
    cases = {**zoo_specs(), **test_specs()}
    for case, specs in cases.items():
        _write(out / f"{case}__cpu", lambda: codegen.render(specs, False))
        n += 1
        for suffix, options in DESIGNS.items():
            def render(specs=specs, options=options):
                return codegen.render(specs, True, plans=choose.make_plans(specs, options))
            _write(out / f"{case}__{suffix}", render)
            n += 1
    for case, spec, wide in wide_cases():
        for suffix in ("auto", "wide"):
            def render(spec=spec, wide=wide, options=DESIGNS[suffix]):
                return codegen.render([spec], True, {spec.name: False},
                                      plans=choose.make_plans([spec], options, {spec.name: wide}))
            _write(out / f"w_{case}__{suffix}", render)
            n += 1
    return n


def _inline(folder: Path, text: str) -> str:
    """`text` with each `#include "<name>.cuh"` line replaced by that header's text after its `#pragma once`
    line (the header's own description comes before it)."""
    out = []
    for line in text.splitlines(keepends=True):
        s = line.strip()
        if s.startswith('#include "') and s.endswith('.cuh"'):
            header = (folder / s[len('#include "'):-1]).read_text()
            out.append(_inline(folder, header.split("#pragma once\n", 1)[1]))
        else:
            out.append(line)
    return "".join(out)


_GENERATED_FROM = re.compile(r"^// Generated by onnx2fused from templates/[\w.]+: do not edit\.$", re.M)


def _template_line_only(a: str, b: str) -> bool:
    """Whether `a` and `b` differ in the name of the template they say they come from, and nothing else."""
    line = "// Generated by onnx2fused from templates/*: do not edit."
    return _GENERATED_FROM.sub(line, a) == _GENERATED_FROM.sub(line, b)


def _code(text: str) -> str:
    """`text` without its comments: whole-line ones, and trailing ones on lines without a string literal."""
    out = []
    for line in text.splitlines():
        if line.lstrip().startswith("//"):
            continue
        out.append(line.split("//", 1)[0].rstrip() if '"' not in line else line)
    return "\n".join(out)


def compare(a: Path, b: Path, code_only: bool = False) -> int:
    """Differences between two render folders, headers inlined. A source that differs only in the name of
    its template (the first line) is counted apart, not as a difference."""
    import difflib
    differ = renamed = 0
    cases = sorted({p.name for p in a.iterdir()} | {p.name for p in b.iterdir()})
    for case in cases:
        fa, fb = a / case, b / case
        na = {p.name for p in fa.iterdir() if p.suffix != ".cuh"} if fa.is_dir() else set()
        nb = {p.name for p in fb.iterdir() if p.suffix != ".cuh"} if fb.is_dir() else set()
        if na != nb:
            print(f"{case}: files differ: only before {sorted(na - nb)}, only after {sorted(nb - na)}")
            differ += 1
            continue
        for name in sorted(na):
            ta, tb = _inline(fa, (fa / name).read_text()), _inline(fb, (fb / name).read_text())
            if code_only:
                ta, tb = _code(ta), _code(tb)
            if ta != tb and _template_line_only(ta, tb):
                renamed += 1
            elif ta != tb:
                differ += 1
                diff = list(difflib.unified_diff(ta.splitlines(), tb.splitlines(), f"before/{case}/{name}",
                                                 f"after/{case}/{name}", n=1, lineterm=""))
                print("\n".join(diff[:40]) + ("\n..." if len(diff) > 40 else ""))
    print(f"{len(cases)} cases compared: {differ} difference(s); {renamed} source(s) identical but for the "
          "template name on their first line")
    return 1 if differ else 0


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "render":
        print(f"{render_all(Path(argv[1]))} renders written to {argv[1]}")
        return 0
    if len(argv) == 3 and argv[0] == "compare":
        return compare(Path(argv[1]), Path(argv[2]))
    if len(argv) == 4 and argv[:2] == ["compare", "--code"]:
        return compare(Path(argv[2]), Path(argv[3]), code_only=True)
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
