"""Fourier features (passes/sincos.py): Concat(sin(z), cos(z)) of a linear layer's output z into the next
layer is one layer of twice the width with a sin activation (bias shifted by pi/2 on the cos half)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from onnx_builders import G, fuse, plugin_session, rand, run

from onnx2fused import expr as ex
from onnx2fused.library import build_plugin


def fourier_mlp(sin_first: bool = True, extra_reader: bool = False, bias: bool = False):
    """x (2) -> z = x B (no bias; 16 frequencies) -> Concat(sin z, cos z) -> 24 ReLU -> 3."""
    g = G(seed=4)
    z = g.linear("x", 2, 16, kind="matmul" if not bias else "gemm", bias=bias, name="proj")
    s, c = g.op("Sin", [z], name="sin"), g.op("Cos", [z], name="cos")
    cat = g.op("Concat", [s, c] if sin_first else [c, s], name="ff_cat", axis=-1)
    h = g.op("Relu", [g.linear(cat, 32, 24, name="fc0")])
    g.linear(h, 24, 3, name="fc1")
    g.nodes[-1].output[0] = "y"
    outputs = [("y", ["B", 3])]
    if extra_reader:
        g.op("Identity", [s], outputs=["s_copy"])
        outputs.append(("s_copy", ["B", 16]))
    return g.model([("x", ["B", 2])], outputs)


@pytest.mark.parametrize("sin_first,bias", [(True, False), (False, True)])
def test_sin_cos_concat_is_one_sin_layer(sin_first, bias):
    model = fourier_mlp(sin_first, bias=bias)
    plan, specs, fused = fuse(model)
    assert len(plan.chains) == 1, plan.describe()
    chain = plan.chains[0]
    assert chain.widths == (2, 32, 24, 3) and chain.layers[0].activation == ex.sin()
    assert {"sin", "cos", "ff_cat"} <= set(chain.nodes)
    layer = chain.layers[0].linear
    np.testing.assert_array_equal(layer.weight[:, :16], layer.weight[:, 16:])
    shift = layer.bias[16:] - layer.bias[:16]
    np.testing.assert_allclose(shift, math.pi / 2 if sin_first else -math.pi / 2, rtol=1e-6)
    sess = plugin_session(fused, build_plugin(specs, with_cuda=False).path)
    x = rand((50, 2), scale=2.0)
    np.testing.assert_allclose(sess.run(None, {"x": x})[0], run(model, {"x": x})[0], rtol=1e-4, atol=2e-5)


def test_a_sin_read_elsewhere_keeps_the_pair_stock():
    plan, _, _ = fuse(fourier_mlp(extra_reader=True))
    assert not any(c.layers[0].activation == ex.sin() for c in plan.chains)
    assert "has 2 consumers (Sin 'sin', Cos 'cos')" in plan.describe()
