"""A float16 model with float32 inputs and outputs (onnxconverter-common's keep_io_types=True): the Casts at
the ends of a 16-bit chain (passes/casts.py)."""
from pathlib import Path

import numpy as np
import onnx
import pytest

from onnx2fused.loader import load_model
from onnx2fused.passes import find_chains, rewrite
from onnx_builders import F16, G, fp16_keep_io, mlp, rand, run

MODELS = Path(__file__).resolve().parent.parent / "models"


def _check(m, plan, x, tol=2e-3):
    r = rewrite(m, plan, [c.to_spec("fp32") for c in plan.chains])
    np.testing.assert_allclose(run(r, {"x": x})[0], run(m, {"x": x})[0], rtol=tol, atol=tol)
    return r


def test_the_chain_reads_and_writes_float32_across_both_casts():
    m = fp16_keep_io(mlp([8, 16, 16, 4], act="Tanh"))
    plan = find_chains(m)
    (c,) = plan.chains
    assert plan.refusals == [] and (c.input, c.output, c.input_dtype) == ("x", "y", "f32")
    assert c.nodes[0] == "graph_input_cast0" and c.nodes[-1] == "graph_output_cast0" and c.input_map == "Cast"
    r = _check(m, plan, rand([9, 8], seed=1))
    assert len(r.graph.node) == 1


@pytest.mark.parametrize("kind", ["opset17", "dynamo"])
def test_the_tabular_zoo_model_as_float16_is_one_float32_chain(kind):
    """Its input BatchNorm stays float16 between the converter's Cast and the first layer: both fold."""
    m = fp16_keep_io(load_model(MODELS / f"tabular.{kind}.onnx"))
    plan = find_chains(m)
    (c,) = plan.chains
    assert plan.refusals == [] and c.input == "x" and c.input_dtype == "f32"
    assert c.input_map == "Cast/BatchNormalization" and c.widths == (24, 128, 128, 1)
    _check(m, plan, rand([7, 24], seed=2))


def test_only_an_output_cast_leaves_the_chain():
    """float16 input, float32 output: the widening Cast leaves the last activation and stays a stock op
    after the float16 chain (which could not be fused at all before)."""
    g = G()
    h = g.op("Relu", [g.linear("x", 8, 16, dtype=np.float16)])
    g.op("Cast", [g.linear(h, 16, 4, dtype=np.float16)], name="widen", outputs=["y"], to=onnx.TensorProto.FLOAT)
    m = g.model([("x", ["B", 8])], [("y", ["B", 4])], elem=F16, check=False)
    m.graph.output[0].type.tensor_type.elem_type = onnx.TensorProto.FLOAT
    onnx.checker.check_model(m)
    plan = find_chains(m)
    (c,) = plan.chains
    assert c.input == "x" and c.input_dtype == "f16" and "widen" not in c.nodes and plan.refusals == []
    r = _check(m, plan, rand([5, 8], seed=3).astype(np.float16))
    assert [n.op_type for n in r.graph.node][-1] == "Cast"


def test_a_float32_layer_norm_in_front_stays_stock_with_its_reason():
    """LayerNorm in float32, then the converter's Cast: the chain reads the norm's float32 output (the norm
    and a residual around a float16 MLP are not taken)."""
    g = G()
    ln = g.op("LayerNormalization", ["x", g.vec(8), g.vec(8)], name="ln", axis=-1)
    h16 = g.op("Cast", [ln], name="down", to=onnx.TensorProto.FLOAT16)
    h = g.op("Relu", [g.linear(h16, 8, 16, dtype=np.float16)])
    g.op("Cast", [g.linear(h, 16, 4, dtype=np.float16)], name="up", outputs=["y"], to=onnx.TensorProto.FLOAT)
    m = g.model([("x", ["B", 8])], [("y", ["B", 4])])
    plan = find_chains(m)
    (c,) = plan.chains
    assert c.input == next(n for n in m.graph.node if n.name == "ln").output[0] and c.input_dtype == "f32"
    assert c.norm is None
    (r,) = plan.refusals
    assert r.reason == (f"chain 0 starts: input '{c.input}' comes from LayerNormalization 'ln': the layer norm in "
                        "front stays a stock op: the chain reads the float32 input of a float16 converter's Cast")
    _check(m, plan, rand([5, 8], seed=4))


ZOO_NAMES = sorted(p.name.split(".")[0] for p in MODELS.glob("*.opset17.onnx"))


@pytest.mark.parametrize("name", ZOO_NAMES)
def test_every_zoo_model_in_the_float16_keep_io_form_fuses_as_its_export(name):
    """Each zoo model in that form: the same chains as the float32 export (widths, gated layers, norm,
    residual), and the rewritten model computes what the float16 model computes. Plain chains read x and
    write y across the Casts; a block (a norm in front, a residual behind) keeps them as stock ops."""
    src = load_model(MODELS / f"{name}.opset17.onnx")
    m = fp16_keep_io(src)
    want = [(c.widths, c.norm is not None, c.residual) for c in find_chains(src).chains]
    plan = find_chains(m)
    assert [(c.widths, c.norm is not None, c.residual) for c in plan.chains] == want, plan.describe()
    (c,) = plan.chains
    if c.norm is None and not c.residual:
        assert (c.input, c.output, c.input_dtype) == ("x", "y", "f32")
    x = rand([6, src.graph.input[0].type.tensor_type.shape.dim[-1].dim_value], seed=5)
    if len(src.graph.input[0].type.tensor_type.shape.dim) == 3:
        x = x.reshape(6, 1, -1)
    _check(m, plan, x, tol=3e-3)


@pytest.mark.parametrize("dynamo", [False, True])
def test_a_float16_autocast_export_is_one_float32_chain(dynamo, tmp_path):
    """A model run under torch.autocast(float16) when exported: a Cast to float16 in front of the first
    layer, float16 layers and activations, a Cast back behind (the .float()): one chain reading x."""
    torch = pytest.importorskip("torch")
    import warnings

    class Autocast(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 16),
                                         torch.nn.Softplus(), torch.nn.Linear(16, 2))

        def forward(self, x):
            with torch.autocast("cpu", dtype=torch.float16):
                return self.m(x).float()

    torch.manual_seed(4)
    path = tmp_path / "ac.onnx"
    kw = dict(dynamo=True) if dynamo else dict(dynamo=False, opset_version=17, input_names=["x"],
                                                output_names=["y"], dynamic_axes={"x": {0: "B"}})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(Autocast().eval(), (torch.randn(4, 8),), str(path), verbose=False, **kw)
    m = load_model(path)
    name = m.graph.input[0].name
    plan = find_chains(m)
    (c,) = plan.chains
    assert (c.input, c.input_dtype, c.widths) == (name, "f32", (8, 16, 16, 2)) and plan.refusals == [], plan.describe()
    r = rewrite(m, plan, [c.to_spec("fp32")])
    assert len(r.graph.node) == 1
    x = rand([4, 8], seed=6)   # (the dynamo export has the example batch static)
    np.testing.assert_allclose(run(r, {name: x})[0], run(m, {name: x})[0], rtol=3e-3, atol=3e-3)
