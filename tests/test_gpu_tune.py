"""The wide design's per-GPU kernel search (onnx2fused/wide_tune.py) for real, on a Hopper GPU: convert
builds and runs the tuning library once, stores the choice per spec and GPU, builds the final library
with the chosen kernels, and a second convert reuses the choice. The fused model must then match stock
ONNX Runtime at row counts in every bucket, so every chosen kernel runs.

The model is fp16 in and out with ReLU on both layers: one (activation, output type) pair, so the tuning
build instantiates each Hopper kernel configuration once (the cheapest honest case to compile).
"""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from gpu_support import rel_l2, require_cuda, run_poisoned  # noqa: E402

pytestmark = pytest.mark.gpu
ort, torch = require_cuda()

import onnx2fused  # noqa: E402
from onnx2fused import wide_tune  # noqa: E402
from onnx2fused.plan.options import DESIGN_ENV  # noqa: E402
from onnx2fused.plan.sm90 import SM90_KERNELS  # noqa: E402

WIDTHS = [512, 2048, 512]


def _model(path):
    rng = np.random.default_rng(0)
    nodes, inits, h = [], [], "x"
    for i, (k, n) in enumerate(zip(WIDTHS, WIDTHS[1:])):
        inits += [numpy_helper.from_array((rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float16), f"w{i}"),
                  numpy_helper.from_array((rng.standard_normal(n) * 0.1).astype(np.float16), f"b{i}")]
        nodes += [helper.make_node("Gemm", [h, f"w{i}", f"b{i}"], [f"g{i}"], transB=1),
                  helper.make_node("Relu", [f"g{i}"], [f"r{i}"])]
        h = f"r{i}"
    nodes.append(helper.make_node("Identity", [h], ["y"]))
    g = helper.make_graph(nodes, "tune", [helper.make_tensor_value_info("x", TensorProto.FLOAT16, ["n", WIDTHS[0]])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT16, ["n", WIDTHS[-1]])], inits)
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(path))
    return path


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    gpu = wide_tune.current_gpu()
    if gpu is None or gpu.cc != 90:
        pytest.skip(f"the Hopper kernels need compute capability 9.0 (this GPU: {gpu})")
    d = tmp_path_factory.mktemp("tune")
    cache = d / "cache"
    src = _model(d / "m.onnx")
    said: list[str] = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(wide_tune.TUNE_ENV, "1")
        mp.setenv(DESIGN_ENV, "wide")
        report = onnx2fused.convert(str(src), str(d / "m.fused.onnx"), cache_dir=cache, progress=said.append,
                                    tune=True)  # the search runs only on request (`--tune`, `onnx2fused tune`)
        again_said: list[str] = []
        again = onnx2fused.convert(str(src), str(d / "again.fused.onnx"), cache_dir=cache, progress=again_said.append)
    return gpu, cache, src, d / "m.fused.onnx", report, said, again, again_said


def test_convert_tunes_once_and_stores_the_choice(tuned):
    gpu, cache, _, _, report, said, again, again_said = tuned
    assert any("tuning the Hopper GEMM kernels" in s for s in said), said
    records = list((cache / "tune").glob("*.json"))
    assert len(records) == 1 and gpu.name.split()[0] in records[0].name.replace("-", " ")
    rec = json.loads(records[0].read_text())
    assert rec["gpu"] == gpu.name and len(rec["timings"]) == 2
    for per in rec["timings"]:
        for t in per:
            assert t["default_ms"] > 0 and t["ms"] > 0 and t["ms"] <= t["default_ms"] * 1.0001
            timed = [v for v in t["candidates"].values() if v > 0]
            sixteen_bit = [k for k in SM90_KERNELS if not k.tf32]   # fp16 input: no tf32 candidates
            assert len(timed) >= len(sixteen_bit), t  # most candidates ran and matched the default
            assert -2 not in t["candidates"].values(), t          # none computed something else
    assert str(rec["chain_block"]) in rec["passes"]["ms"]  # the pass size is one of those timed
    assert f"tuned on {gpu.name}" in report.chains[0].cuda_plan
    # the second conversion: the stored choice, no tuning build, the same library from the cache
    assert not any("tuning the Hopper" in s for s in again_said) and again.cache_hit
    assert again.chains[0].cuda_plan == report.chains[0].cuda_plan


@pytest.mark.parametrize("rows", [1, 300, 3000, 20000])   # every row bucket, and more than one pass
def test_tuned_library_matches_stock_onnxruntime(tuned, rows):
    _, _, src, fused, *_ = tuned
    x = np.random.default_rng(rows).standard_normal((rows, WIDTHS[0])).astype(np.float16)
    stock = ort.InferenceSession(str(src), providers=["CUDAExecutionProvider"])
    ref = stock.run(None, {"x": x})[0].astype(np.float32)
    sess = onnx2fused.InferenceSession(str(fused), providers=["CUDAExecutionProvider"])
    got = run_poisoned(sess, x, (rows, WIDTHS[-1])).astype(np.float32)
    assert rel_l2(got, ref) <= 2e-3
