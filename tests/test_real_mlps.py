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
from nerf_mlp import NeRF, export  # noqa: E402
from neus_sdf import SDFNetwork  # noqa: E402

CUDA = PlanOptions()   # the planner's defaults, as a library with CUDA kernels (and CUTLASS) has them


def _export(module, path: Path, features: int) -> Path:
    torch.manual_seed(0)
    return export(module, path, features)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("real")
    torch.manual_seed(0)
    return {"nerf": _export(NeRF(), d / "nerf.onnx", 90), "neus": _export(SDFNetwork(), d / "neus.onnx", 39),
            "deepsdf": _export(DeepSDF(), d / "deepsdf.onnx", 259)}


def test_nerf_trunk_is_one_chain_its_feature_layer_and_density_join_the_view_head(models):
    plan = find_fusions(onnx.load(str(models["nerf"])), with_cuda=True, options=CUDA)
    trunk, view = plan.chains
    assert trunk.skip == 5 and trunk.widths == (63,) + (256,) * 8
    # the density head (256 -> 1) rides the view head as [a, -a] through its ReLU layer; the op writes the
    # model's output Concat([rgb, alpha])
    assert view.widths == (283, 130, 4) and view.input_edit is not None and view.input_edit[2] == trunk.output
    assert "alpha_linear" in view.head and view.output == "y"
    assert any("feature_linear" in r and "folded into the next layer" in r for r in plan.rewritten)
    assert make_plan(trunk.to_spec("fp16"), CUDA).design == "wgmma"


def test_neus_is_one_chain_with_its_scaled_skip_and_257_outputs(models):
    plan = find_fusions(onnx.load(str(models["neus"])), with_cuda=True, options=CUDA)
    (chain,) = plan.chains
    assert chain.skip == 4 and chain.widths[0] == 39 and chain.widths[-1] == 257
    assert make_plan(chain.to_spec("fp16"), CUDA).design == "wgmma"


def test_deepsdf_keeps_its_skip_split_where_the_halves_run_wide(models):
    model = onnx.load(str(models["deepsdf"]))
    split = find_fusions(model, with_cuda=True, options=CUDA)
    assert [c.widths[0] for c in split.chains] == [259, 512] and not any(c.skip for c in split.chains)
    assert "the skip connection stays a stock Concat" in split.describe()
    (joined,) = find_fusions(model, with_cuda=False).chains   # CPU-only libraries join it
    assert joined.skip == 4


@pytest.mark.parametrize("name", ["nerf", "neus", "deepsdf"])
def test_cpu_only_convert_validates_against_stock(models, name, tmp_path):
    res = onnx2fused.convert(models[name], tmp_path / "m.onnx", with_cuda=False, cache_dir=tmp_path / "cache")
    assert res.validation.passed and res.chains
