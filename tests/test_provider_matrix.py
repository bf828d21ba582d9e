"""The fused model runs, and matches stock ONNX Runtime, on every provider with every library.

The matrix (issue 14 §1): library built without / with CUDA x session providers [CPU], [CUDA, CPU], and
no plugin at all x a chain whose generated CPU kernel is registered / declined by the cost model
(cpu_policy.py). One model holds both chains, so one build serves each library row.

Once a library registers any kernel for an op type, ONNX Runtime gives the node that op's schema and no
longer inlines the model-local function: without a CPU kernel for the op, a CPU session failed to load
("Could not find an implementation"). The plugin therefore registers a CPU kernel for every op: the
generated C++ one, or the chain's stock body run in an inner ORT session for declined chains.

The "library with CUDA" rows compile CUDA (nvcc, one arch to keep it short) and run on any host with
nvcc: a CPU session must not need a GPU. The CUDA-EP rows with a real GPU are in test_gpu.py's
test_provider_matrix_on_cuda_ep.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest

ort = pytest.importorskip("onnxruntime")

import onnx2fused  # noqa: E402
from onnx2fused.cpu_policy import cpu_kernel_wins  # noqa: E402
from onnx2fused.spec import DOMAIN  # noqa: E402

from onnx_builders import G  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:Specified provider 'CUDAExecutionProvider'")

PROVIDER_ROWS = {
    "cpu": ["CPUExecutionProvider"],
    "cuda,cpu": ["CUDAExecutionProvider", "CPUExecutionProvider"],
    "no plugin": ["CPUExecutionProvider"],
}


def two_chain_model() -> onnx.ModelProto:
    """x -> [16 -> 32 relu -> 16] -> Softmax -> [16 -> 24 sin -> 8] -> y: the first chain's CPU kernel is
    registered, the second's declined (sin is a scalar libm call in the generated C++)."""
    g = G(seed=5)
    h = g.linear("x", 16, 32)
    h = g.op("Relu", [h])
    h = g.linear(h, 32, 16)
    h = g.op("Softmax", [h], axis=-1)
    h = g.linear(h, 16, 24)
    h = g.op("Sin", [h])
    g.linear(h, 24, 8, name="last")
    g.nodes[-1].output[0] = "y"
    return g.model([("x", ["batch", 16])], [("y", ["batch", 8])])


def profile_ops(sess) -> list[dict]:
    events = json.loads(Path(sess.end_profiling()).read_text())
    return [e for e in events if e.get("cat") == "Node" and "op_name" in e.get("args", {})]


def session(path: Path, library: Path | None, providers: list[str], tmp: Path):
    so = ort.SessionOptions()
    so.log_severity_level = 3  # the CPU package warns that CUDA is not available: expected here
    so.enable_profiling = True
    so.profile_file_prefix = str(tmp / "prof")
    if library is not None:
        so.register_custom_ops_library(str(library))
    return ort.InferenceSession(str(path), so, providers=providers)


def stock(path: Path, feeds: dict) -> np.ndarray:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"]).run(None, feeds)[0]


def rel_l2(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.abs(b).max() > 0 and np.isfinite(a).all()
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def convert_two_chains(tmp: Path, with_cuda: bool, monkeypatch) -> tuple[Path, Path, list]:
    src = tmp / "two.onnx"
    onnx.save(two_chain_model(), str(src))
    monkeypatch.setenv("ONNX2FUSED_CUDA_ARCHS", "80")  # one arch: the CUDA row compiles in half the time
    res = onnx2fused.convert(src, tmp / "two.fused.onnx", precision="fp16", cache_dir=tmp / "cache",
                             with_cuda=with_cuda)
    assert res.with_cuda == with_cuda and len(res.chains) == 2
    return src, Path(res.output_path), res.chains


def check_matrix(tmp: Path, with_cuda: bool, monkeypatch) -> None:
    src, fused, chains = convert_two_chains(tmp, with_cuda, monkeypatch)
    library = fused.parent / (fused.name[: -len(".onnx")] + ".onnx2fused.so")
    registered, declined = chains
    # the model really covers both cases of the cost model
    spec_ops = {n.op_type for n in onnx.load(str(fused)).graph.node if n.domain == DOMAIN}
    assert spec_ops == {registered.name, declined.name}
    assert "CPU: fused CPU kernel" in registered.cuda_plan
    assert "CPU: stock ops" in declined.cuda_plan

    for rows in (1, 300, 1031):
        x = np.random.default_rng(rows).standard_normal((rows, 16)).astype(np.float32)
        ref = stock(src, {"x": x})
        for row, providers in PROVIDER_ROWS.items():
            lib = None if row == "no plugin" else library
            sess = session(fused, lib, providers, tmp)
            y = sess.run(None, {"x": x})[0]
            assert y.shape == ref.shape
            err = rel_l2(y, ref)
            assert err <= 1e-4, (row, rows, err)
            ran = {e["args"]["op_name"]: e["args"].get("provider", "") for e in profile_ops(sess)}
            if lib is None:  # the functions were inlined: stock ops ran, no fused node
                assert not ran.keys() & spec_ops and ran.keys() & {"MatMul", "Gemm"}, ran
            else:            # both fused nodes ran as nodes of their own, on the CPU EP here
                assert spec_ops <= ran.keys(), ran
                assert {ran[op] for op in spec_ops} == {"CPUExecutionProvider"}, ran


def test_library_without_cuda(tmp_path, monkeypatch):
    check_matrix(tmp_path, with_cuda=False, monkeypatch=monkeypatch)


@pytest.mark.cuda_build
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
def test_library_with_cuda_on_a_cpu_session(tmp_path, monkeypatch):
    """The library registers CUDA kernels for both ops; a CPU session must still load and run it."""
    check_matrix(tmp_path, with_cuda=True, monkeypatch=monkeypatch)


def test_stock_path_declined_chain_matches_stock_exactly_enough(tmp_path, monkeypatch):
    """The declined chain's CPU kernel is ONNX Runtime's own ops: fp32-exact up to summation order,
    across the row split into parallel tasks (1031 rows: uneven tasks)."""
    src, fused, chains = convert_two_chains(tmp_path, False, monkeypatch)
    assert not cpu_kernel_wins_for(chains[1])
    x = np.random.default_rng(0).standard_normal((1031, 16)).astype(np.float32)
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    so.register_custom_ops_library(str(fused.parent / "two.fused.onnx2fused.so"))
    y = ort.InferenceSession(str(fused), so, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert rel_l2(y, stock(src, {"x": x})) <= 1e-6


def cpu_kernel_wins_for(chain_report) -> bool:
    return "CPU: fused CPU kernel" in chain_report.cuda_plan


def test_old_model_without_stock_body_gets_a_clear_error(tmp_path, monkeypatch):
    """A node converted before the stock body existed: the declined chain's CPU kernel says what to do."""
    _, fused, chains = convert_two_chains(tmp_path, False, monkeypatch)
    m = onnx.load(str(fused))
    for n in m.graph.node:
        if n.domain == DOMAIN:
            keep = [a for a in n.attribute if a.name != "stock_model"]
            del n.attribute[:]
            n.attribute.extend(keep)
    old = tmp_path / "old.onnx"
    onnx.save(m, str(old))
    so = ort.SessionOptions()
    so.register_custom_ops_library(str(fused.parent / "two.fused.onnx2fused.so"))
    with pytest.raises(Exception, match="re-run onnx2fused convert"):
        ort.InferenceSession(str(old), so, providers=["CPUExecutionProvider"])


def test_cost_model_cases_are_what_the_matrix_assumes():
    """Guards the matrix's premise: a sin layer is declined, a small relu chain registered."""
    from onnx2fused.passes import find_chains
    plan = find_chains(two_chain_model())
    wins = [cpu_kernel_wins(c.to_spec("fp16"))[0] for c in plan.chains]
    assert wins == [True, False]


def test_a_lone_linear_layer_runs_its_stock_body_on_the_cpu():
    """One linear layer with nothing after it (a transformer's qkv projection) has nothing to fuse: the
    CPU runs its stock body (MLAS), while an activation, a second layer, a norm or a gate keep the kernel."""
    from onnx2fused import expr as ex
    from onnx2fused.spec import LayerSpec, MLPSpec, NormSpec

    def spec(layers, norm=None, residual=False):
        return MLPSpec(tuple(layers), "fp16", "f32", norm=norm, residual=residual)

    lone = spec([LayerSpec(192, 576, True, ex.identity())])
    wins, why = cpu_kernel_wins(lone)
    assert not wins and "one linear layer" in why
    keep = [spec([LayerSpec(192, 576, True, ex.relu())]),
            spec([LayerSpec(192, 64, True, ex.identity()), LayerSpec(64, 8, True, ex.identity())]),
            spec([LayerSpec(64, 64, True, ex.identity())], norm=NormSpec("layernorm", 1e-5, True), residual=True),
            spec([LayerSpec(64, 32, True, ex.identity(), gated=True)])]
    assert [cpu_kernel_wins(s)[0] for s in keep] == [True] * 4
