"""Real neural-field MLPs as their reference code writes them (benchmarks/nerf_mlp.py, neus_sdf.py,
deepsdf_mlp.py; TorchScript export): what convert makes of their skip Concats and heads, on the graph (a
library with CUDA kernels plans them; no GPU needed) and through a CPU-only convert that validates against
stock ONNX Runtime. The GPU tests and benchmarks/RESULTS.md (forty-first to forty-third runs) time them."""
from __future__ import annotations

import sys
from pathlib import Path

import onnx
import pytest
import torch

import onnx2fused
from onnx2fused.library import find_fusions
from onnx2fused.plan.choose import make_plan
from onnx2fused.plan.options import PlanOptions

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from deepsdf_mlp import DeepSDF  # noqa: E402
from nerf_mlp import NeRF, NeRFPL, export  # noqa: E402
from neus_sdf import SDFNetwork  # noqa: E402

CUDA = PlanOptions()   # the planner's defaults, as a library with CUDA kernels (and CUTLASS) has them


def _export(module, path: Path, features: int) -> Path:
    torch.manual_seed(0)
    return export(module, path, features)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("real")
    torch.manual_seed(0)
    return {"nerf": _export(NeRF(), d / "nerf.onnx", 90), "nerf_pl": _export(NeRFPL(), d / "nerf_pl.onnx", 90),
            "neus": _export(SDFNetwork(), d / "neus.onnx", 39),
            "deepsdf": _export(DeepSDF(), d / "deepsdf.onnx", 259)}


def test_nerf_mlp_is_one_chain_reading_x(models):
    """The whole NeRF MLP one op: the trunk reads x (its Split gone: zero rows for the view directions), its
    skip and the view layer read x again (skip_merge.py), feature_linear folds into the view layer
    (concat_fold.py), the density rides the view head (head_fold.py) and the op writes the output Concat."""
    model = onnx.load(str(models["nerf"]))
    plan = find_fusions(model, with_cuda=True, options=CUDA)
    (chain,) = plan.chains
    assert chain.input == "x" and chain.output == "y" and chain.skip == (5, 8)
    assert chain.widths == (90,) + (256,) * 8 + (130, 4) and "alpha_linear" in chain.head
    ops = {n.op_type for n in model.graph.node if n.name in chain.nodes}
    assert {"Split", "Concat", "Gemm", "Relu"} <= ops
    assert not plan.concat_edits and not [r for r in plan.refusals if r.chain >= 0], plan.describe()
    w0 = chain.layers[0].linear.weight
    assert w0.shape == (90, 256) and not w0[63:].any()           # the view directions' rows
    w5, w8 = chain.layers[5].linear.weight, chain.layers[8].linear.weight
    assert w5.shape == (96 + 256, 256) and not w5[63:96].any()    # the points into layer 6
    assert w8.shape == (96 + 256, 130) and not w8[:63].any() and not w8[90:96].any()   # the views into the view layer
    spec = chain.to_spec("fp16")
    assert "_skip5_8_" in spec.name and make_plan(spec, CUDA).design == "wgmma"


def test_nerf_pl_is_one_chain_its_sigmoid_masked_off_the_density(models):
    """kwea123's nerf_pl: the skip before the fifth layer, rgb = Sigmoid(...): one chain, the last layer's
    Sigmoid on rgb's 3 columns only (head_fold.last_activation)."""
    plan = find_fusions(onnx.load(str(models["nerf_pl"])), with_cuda=True, options=CUDA)
    (chain,) = plan.chains
    assert chain.input == "x" and chain.output == "y" and chain.skip == (4, 8)
    assert chain.widths == (90,) + (256,) * 8 + (130, 4)
    assert chain.activation_labels()[-1] == "sigmoid[3 of 4]"
    assert make_plan(chain.to_spec("fp16"), CUDA).design == "wgmma"


def test_small_nerf_one_op_on_the_cpu_kernel(tmp_path):
    """A NeRF of width 32 (weights small enough for the fused CPU kernel, both skips assembled there)
    converted CPU-only: one op, validated against stock ORT, and run at a few batch sizes."""
    import numpy as np
    torch.manual_seed(1)
    src = export(NeRF(width=32), tmp_path / "nerf32.onnx", 90)
    res = onnx2fused.convert(src, tmp_path / "m.onnx", with_cuda=False, cache_dir=tmp_path / "cache")
    assert res.validation.passed and len(res.chains) == 1 and "_skip5_8_" in res.chains[0].name
    assert "fused CPU kernel" in res.chains[0].cuda_plan, res.chains[0].cuda_plan
    assert res.chains[0].takes_in == ["the input joins layers 6, 9 (skip Concats)",
                                      "two chains joined through pieces of the input",
                                      "head '/alpha_linear/Gemm' (32 -> 1) rides it into its output Concat"]
    assert "    takes in: the input joins layers 6, 9 (skip Concats); two chains" in res.format()
    fused = onnx.load(str(res.output_path))
    assert [n.domain for n in fused.graph.node] == ["onnx2fused"]
    from onnx_builders import plugin_session, run
    sess = plugin_session(fused, res.library_path)
    for rows in (1, 7, 300):
        x = np.random.default_rng(rows).standard_normal((rows, 90)).astype(np.float32)
        np.testing.assert_allclose(sess.run(None, {"x": x})[0], run(onnx.load(str(src)), {"x": x})[0],
                                   rtol=1e-4, atol=1e-5)


def test_neus_is_one_chain_with_its_scaled_skip_and_257_outputs(models):
    plan = find_fusions(onnx.load(str(models["neus"])), with_cuda=True, options=CUDA)
    (chain,) = plan.chains
    assert chain.skip == (4,) and chain.widths[0] == 39 and chain.widths[-1] == 257
    assert make_plan(chain.to_spec("fp16"), CUDA).design == "wgmma"


def test_deepsdf_keeps_its_skip_split_where_the_halves_run_wide(models):
    model = onnx.load(str(models["deepsdf"]))
    split = find_fusions(model, with_cuda=True, options=CUDA)
    assert [c.widths[0] for c in split.chains] == [259, 512] and not any(c.skip for c in split.chains)
    assert "the skip connection stays a stock Concat" in split.describe()
    (joined,) = find_fusions(model, with_cuda=False).chains   # CPU-only libraries join it
    assert joined.skip == (4,)


@pytest.mark.parametrize("name", ["nerf", "nerf_pl", "neus", "deepsdf"])
def test_cpu_only_convert_validates_against_stock(models, name, tmp_path):
    res = onnx2fused.convert(models[name], tmp_path / "m.onnx", with_cuda=False, cache_dir=tmp_path / "cache")
    assert res.validation.passed and res.chains
