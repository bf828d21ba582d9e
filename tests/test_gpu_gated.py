"""Gated layers (SwiGLU/GeGLU, issue 16) in the fused CUDA kernels, against stock ONNX Runtime (GPU host only).

The zoo's gated-only blocks (swiglu, geglu) at fp16, bf16 and tf32 in the resident and the streamed design,
and two-linear SwiGLU chains of odd widths (padding columns of the interleaved gate/up GEMM, a gated last
layer, two gated layers in a row), with outputs poisoned with NaN so unwritten elements show.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest

from gpu_support import rel_l2, require_cuda, run_poisoned  # noqa: E402

pytestmark = pytest.mark.gpu
ort, torch = require_cuda()

from onnx2fused import library, passes  # noqa: E402
from onnx2fused.loader import load_model  # noqa: E402
from onnx2fused.plan.choose import make_plans  # noqa: E402
from onnx2fused.plan.options import PlanOptions  # noqa: E402
from onnx_builders import G  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
ZOO = json.loads((ROOT / "models" / "zoo.json").read_text())
GATED = [(m["name"], kind) for m in ZOO["models"] if m.get("block") in ("swiglu", "geglu") for kind in m["files"]]
TOL = {"fp16": 2e-3, "bf16": 1e-2, "tf32": 1e-3}


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("gpu_gated_cache")


def _reference(model_path, x):
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    s = ort.InferenceSession(str(model_path), so, providers=["CPUExecutionProvider"])
    return s.run(None, {s.get_inputs()[0].name: x})[0]


def _gated_plans(model_path: Path, precision: str, design: str):
    """(chains, specs, plans) of the model with `design` asked for (wgmma off)."""
    model = load_model(str(model_path))
    plan = passes.find_chains(model, **library.fusion_refusals(True))
    assert any(l.gated for c in plan.chains for l in c.layers), plan.describe()
    specs = [c.to_spec(precision) for c in plan.chains]
    return model, plan, specs, make_plans(specs, PlanOptions(design=design, wgmma=False))


def _fused_session(model_path: Path, precision: str, design: str, cache_dir: Path, out: Path):
    model, plan, specs, plans = _gated_plans(model_path, precision, design)
    assert {p.design for p in plans.values()} == {design}, "; ".join(p.describe() for p in plans.values())
    lib = library.build_plugin(specs, with_cuda=True, cache_dir=cache_dir, plans=plans)
    onnx.save(passes.rewrite(model, plan, specs), str(out))
    so = ort.SessionOptions()
    so.register_custom_ops_library(str(lib.path))
    return ort.InferenceSession(str(out), so, providers=["CUDAExecutionProvider", "CPUExecutionProvider"])


def _check(sess, src, k, precision, label, batches=(1, 37, 129, 4099)):
    rng = np.random.default_rng(16)
    for batch in batches:
        x = rng.standard_normal((batch, k)).astype(np.float32)
        ref = _reference(src, x)
        err = rel_l2(run_poisoned(sess, x, ref.shape), ref)
        assert err <= TOL[precision], f"{label} batch {batch}: rel L2 {err:.2e} > {TOL[precision]:.0e}"


def _zoo_src(name: str, kind: str) -> Path:
    entry = next(m for m in ZOO["models"] if m["name"] == name)
    return ROOT / "models" / entry["files"][kind]["file"]


# every zoo gated model, precision and design the planner takes (pure Python, decided at collection, so
# no case is collected only to be skipped): swiglu's 512 gate and up columns do not fit the resident
# design's shared memory, so it runs geglu only
GATED_CASES = [(n, k, p, d) for n, k in GATED for p in ("fp16", "bf16", "tf32") for d in ("resident", "streamed")
               if {x.design for x in _gated_plans(_zoo_src(n, k), p, d)[3].values()} == {d}]


@pytest.mark.parametrize("name,kind,precision,design", GATED_CASES, ids=["-".join(c) for c in GATED_CASES])
def test_gated_zoo_model_on_cuda_ep(name, kind, precision, design, cache_dir, tmp_path):
    entry = next(m for m in ZOO["models"] if m["name"] == name)
    src = _zoo_src(name, kind)
    sess = _fused_session(src, precision, design, cache_dir, tmp_path / "fused.onnx")
    _check(sess, src, entry["feature_shape"][0], precision, f"{name}/{kind} {precision} {design}")


def _swiglu_chain(k: int, widths: list[int], gated: set[int], seed: int = 5) -> onnx.ModelProto:
    """x [B, k] -> layers of `widths` outputs; layer i in `gated`: silu(x Wg + bg) * (x Wu + bu) (two
    linears on the same input), else ReLU (the last: none)."""
    g = G(opset=17, seed=seed)
    t, n_in = "x", k
    for i, n in enumerate(widths):
        last = i == len(widths) - 1
        out = ["y"] if last else 1
        if i in gated:
            gate = g.linear(t, n_in, n, name=f"gate{i}")
            up = g.linear(t, n_in, n, name=f"up{i}")
            s = g.op("Sigmoid", [gate])
            t = g.op("Mul", [g.op("Mul", [gate, s]), up], name=f"mul{i}", outputs=out)
        else:
            t = g.linear(t, n_in, n, name=f"fc{i}")
            if not last:
                t = g.op("Relu", [t])
            elif out:
                t = g.op("Identity", [t], outputs=out)
        n_in = n
    return g.model([("x", ["B", k])], [("y", ["B", n_in])])


@pytest.mark.parametrize("design", ["resident", "streamed"])
@pytest.mark.parametrize("precision", ["fp16", "bf16", "tf32"])
@pytest.mark.parametrize("k,widths,gated", [
    (40, [37, 5], {0}),             # odd hidden width: padding columns of the interleave
    (64, [100, 37], {0, 1}),        # two gated layers, the last one gated and odd
    (48, [24, 37], {1}),            # a gated last layer after a plain one
])
def test_gated_odd_widths(k, widths, gated, precision, design, cache_dir, tmp_path):
    src = tmp_path / "swiglu.onnx"
    onnx.save(_swiglu_chain(k, widths, gated), str(src))
    sess = _fused_session(src, precision, design, cache_dir, tmp_path / "fused.onnx")
    _check(sess, src, k, precision, f"{k}->{widths} gated {sorted(gated)} {precision} {design}")


# -- the wide design: one GEMM of gate and up columns, the glu in its epilogue (Hopper's light kernel) or a
# glu pass after it (the sm80 kernels), the next GEMM ------------------------------------------------------

def _hopper() -> bool:
    return torch.cuda.get_device_capability() == (9, 0)


def _kernel_names(sess, x) -> str:
    """The CUDA kernels one run of `sess` on x launches (after a warm-up run), by name."""
    from torch.profiler import ProfilerActivity, profile
    sess.run(None, {"x": x})
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        sess.run(None, {"x": x})
    return " ".join(e.name for e in prof.events())


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize("k,widths,gated", [
    (256, [1000, 250], {0}),        # odd halves (1000: the last 64-column tile's gate box runs into the up rows)
    (96, [520, 300, 64], {0, 1}),   # two gated layers in a row, padded halves, a plain last layer
    (64, [256, 512, 64], {1}),      # a gated layer after a plain one (its input the first GEMM's buffer)
    (72, [40, 24], {0}),            # a half under one 64-column tile: the up box runs past the 2n rows
])
def test_gated_layers_in_the_wide_design(k, widths, gated, precision, cache_dir, tmp_path, monkeypatch):
    """Against stock ORT with NaN-poisoned outputs; on Hopper with both kernel families of one session: the
    light kernel's gated epilogue (the untuned default) and the sm80 GEMM + glu pass
    (ONNX2FUSED_WIDE_KERNELS=sm80, read on every run)."""
    from onnx2fused.plan import wide
    src = tmp_path / "swiglu.onnx"
    onnx.save(_swiglu_chain(k, widths, gated), str(src))
    sess = _fused_session(src, precision, "wide", cache_dir, tmp_path / "fused.onnx")
    for family in ("default", "sm80") if _hopper() else ("default",):
        if family == "sm80":
            monkeypatch.setenv(wide.SM80_ENV, "sm80")
        _check(sess, src, k, precision, f"{k}->{widths} gated {sorted(gated)} {precision} wide, {family} kernels",
               batches=(1, 37, 129, 4099, 70001))
    monkeypatch.delenv(wide.SM80_ENV, raising=False)


def test_hopper_runs_the_glu_in_the_light_kernels_epilogue(cache_dir, tmp_path, monkeypatch):
    """Which kernels one run launches (torch's profiler): on Hopper the gated GEMM is the light kernel and
    no glu pass runs (the products never reach memory); with the sm80 kernels, the glu pass does."""
    if not _hopper():
        pytest.skip("the light kernel runs on compute capability 9.0 only")
    from onnx2fused.plan import wide
    src = tmp_path / "swiglu.onnx"
    onnx.save(_swiglu_chain(256, [1000, 250], {0}), str(src))
    sess = _fused_session(src, "fp16", "wide", cache_dir, tmp_path / "fused.onnx")
    x = np.random.default_rng(3).standard_normal((4099, 256)).astype(np.float32)
    names = _kernel_names(sess, x)
    if not names:
        pytest.skip("the profiler recorded no CUDA kernels here (CUPTI unavailable)")
    assert "light_gemm" in names and "glu_rows" not in names, names
    monkeypatch.setenv(wide.SM80_ENV, "sm80")
    names = _kernel_names(sess, x)
    monkeypatch.delenv(wide.SM80_ENV, raising=False)
    assert "glu_rows" in names and "light_gemm" not in names, names


def test_big_swiglu_goes_wide_by_default_and_matches_stock(tmp_path):
    """256 -> SwiGLU 4096 -> 256 (too wide for the fused kernels' tiles): convert() with defaults makes ONE
    gated chain in the wide design and validates it on the CUDA EP."""
    import onnx2fused
    from onnx2fused.spec import DOMAIN
    src = tmp_path / "big.onnx"
    onnx.save(_swiglu_chain(256, [4096, 256], {0}), str(src))
    res = onnx2fused.convert(src, tmp_path / "big.fused.onnx", cache_dir=tmp_path / "cache")
    (chain,) = res.chains
    assert res.refusals == [] and res.validation.provider == "CUDAExecutionProvider" and res.validation.passed
    assert "glu pass" in chain.cuda_plan and chain.cuda_plan.startswith("GPU: wide")
    assert [n.domain for n in onnx.load(res.output_path).graph.node] == [DOMAIN]
    x = np.random.default_rng(7).standard_normal((3001, 256)).astype(np.float32)
    y = onnx2fused.InferenceSession(res.output_path).run(None, {"x": x})[0]
    assert rel_l2(y, _reference(src, x)) <= max(TOL[chain.precision], res.validation.tolerance)
