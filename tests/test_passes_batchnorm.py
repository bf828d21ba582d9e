"""Inference BatchNormalization on rank-2 rows that no chain takes, as Mul + Add in models with CUDA kernels
(passes/batchnorm.py): RTDL's ResNet head, against the original in onnxruntime; what is left alone."""
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

torch = pytest.importorskip("torch")

from onnx2fused.library import find_fusions  # noqa: E402
from onnx2fused.loader import load_model  # noqa: E402
from onnx2fused.passes import rewrite  # noqa: E402
from onnx2fused.passes.batchnorm import find_batchnorms  # noqa: E402
from onnx2fused.passes.constants import GraphIndex  # noqa: E402
from onnx_builders import G, run  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from tabular_resnet import export, tabular_resnet  # noqa: E402


@pytest.mark.parametrize("dynamo", [False, True])
def test_resnet_head_batchnorm_becomes_mul_add_with_cuda_kernels(tmp_path, dynamo):
    torch.manual_seed(4)
    mod = tabular_resnet(d_in=7, d=24, hidden=48)
    with torch.no_grad():   # the head's statistics away from the identity's too
        mod[3].running_mean.copy_(torch.randn(24))
        mod[3].running_var.copy_(torch.rand(24) * 3 + 0.2)
        mod[3].weight.copy_(torch.rand(24) + 0.5)
    m = load_model(export(mod, tmp_path / "m.onnx", 7, dynamo=dynamo))
    assert sum(n.op_type == "BatchNormalization" for n in m.graph.node) >= 1
    plan = find_fusions(m, with_cuda=True)
    (bn,) = plan.batchnorms
    assert "Mul + Add" in bn.describe() and "65536" in bn.describe()
    r = rewrite(m, plan, [c.to_spec("fp32") for c in plan.chains])
    onnx.checker.check_model(r)
    assert not any(n.op_type == "BatchNormalization" for n in r.graph.node), [n.op_type for n in r.graph.node]
    name = m.graph.input[0].name
    x = np.random.default_rng(0).standard_normal((33, 7)).astype(np.float32)
    (a,), (b,) = run(m, {name: x}), run(r, {name: x})
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)
    # a CPU-only library leaves it to the CPU EP, where the stock op is as fast
    assert find_fusions(m, with_cuda=False).batchnorms == []


def test_only_rank2_float_rows_with_constant_parameters():
    g = G(opset=17)
    c = 6
    params = [g.init(v.astype(np.float32)) for v in (np.ones(c), np.zeros(c), np.zeros(c), np.ones(c))]
    g.op("BatchNormalization", ["x2", *params], name="rank2", outputs=["y2"])
    g.op("BatchNormalization", ["x3", *params], name="rank3", outputs=["y3"])
    g.op("BatchNormalization", ["x2", "gamma", *params[1:]], name="runtime_scale", outputs=["y4"])
    m = g.model([("x2", ["N", c]), ("x3", ["N", c, 5]), ("gamma", [c])],
                [("y2", ["N", c]), ("y3", ["N", c, 5]), ("y4", ["N", c])])
    found = find_batchnorms(GraphIndex(m), set())
    assert [b.name for b in found] == ["rank2"]
    assert find_batchnorms(GraphIndex(m), {"rank2"}) == []   # taken by a chain
