"""A small linear head beside a chain, concatenated with the chain's output (NeRF's density), rides the chain
(passes/head_fold.py): one fused op writes the Concat, which the CPU kernel, the stock body and the
numerics model compute as the model does; heads the chain cannot carry stay chains of their own."""
from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from onnx_builders import G, assert_cpu_kernel_matches_stock, fuse, plugin_session, rand, run

from onnx2fused.library import build_plugin
from onnx2fused.passes.head_fold import HEAD_MAX, carry_mode
from onnx2fused import expr as ex


def headed_mlp(widths=(12, 24, 5), acts=("Relu", None), head: int = 1, head_first: bool = False,
               head_from: str = "x", head_act: str | None = None, views: int = 0, seed: int = 0):
    """x (widths[0]) -> [linear -> act] per layer -> out; a head: linear(head_from) -> `head` outputs; y =
    Concat(out, head) (or head first). views > 0: the chain's first layer reads Concat(x, v) of a second input
    v (views wide; NeRF's view head, the head its density reading x). head_from "w": a third input w (4 wide)
    that the chain does not read."""
    assert len(acts) == len(widths) - 1
    g = G(seed=seed)
    first_in = "x" if not views else g.op("Concat", ["x", "v"], name="xv_cat", axis=-1)
    h, k = first_in, widths[0] + views
    for i, (n, act) in enumerate(zip(widths[1:], acts)):
        h = g.linear(h, k, n, name=f"fc{i}")
        if act:
            h = g.op(act, [h], name=f"act{i}")
        k = n
    a = g.linear(head_from, {"x": widths[0], "v": views, "w": 4}[head_from], head, name="head")
    if head_act == "PRelu":
        a = g.op("PRelu", [a, g.init(np.linspace(0.1, 0.3, head).astype(np.float32))], name="head_act")
    elif head_act:
        a = g.op(head_act, [a], name="head_act")
    g.op("Concat", [a, h] if head_first else [h, a], name="out_cat", outputs=["y"], axis=-1)
    inputs = ([("x", ["B", widths[0]])] + ([("v", ["B", views])] if views else [])
              + ([("w", ["B", 4])] if head_from == "w" else []))
    return g.model(inputs, [("y", ["B", widths[-1] + head])])


def _check_on_cpu(model, feeds, rtol=1e-4, atol=1e-5):
    plan, specs, fused = fuse(model)
    sess = plugin_session(fused, build_plugin(specs, with_cuda=False).path)
    np.testing.assert_allclose(sess.run(None, feeds)[0], run(model, feeds)[0], rtol=rtol, atol=atol)
    return plan, fused


@pytest.mark.parametrize("head_first", [False, True])
def test_head_rides_a_relu_chain_as_a_pair_and_the_op_writes_the_concat(head_first):
    model = headed_mlp(head=2, head_first=head_first)
    plan, fused = _check_on_cpu(model, {"x": rand((37, 12), scale=2.0)})
    (chain,) = plan.chains
    assert chain.output == "y" and {"head", "out_cat"} <= set(chain.nodes) and "'head' (12 -> 2)" in chain.head
    assert chain.widths == (12, 28, 7)   # [h, a, -a] out of the ReLU layer, then a written
    assert [n.op_type for n in fused.graph.node if n.domain != "onnx2fused"] == []


def test_head_rides_layers_without_activation_as_it_is():
    model = headed_mlp(widths=(12, 24, 20, 5), acts=(None, None, None), head=3)
    plan, _ = _check_on_cpu(model, {"x": rand((9, 12))})
    assert plan.chains[0].widths == (12, 27, 23, 8)


def test_two_heads_on_one_input_are_one_layer():
    model = headed_mlp(widths=(12, 5), acts=(None,), head=1)
    plan, _ = _check_on_cpu(model, {"x": rand((9, 12))})
    assert plan.chains[0].widths == (12, 6) and plan.chains[0].head


def test_head_reading_a_part_of_the_first_layers_concat_input():
    """NeRF's view head: its first layer reads Concat(x, views); the density reads x alone."""
    model = headed_mlp(widths=(12, 16, 3), acts=("Relu", None), head=1, views=5)
    plan, _ = _check_on_cpu(model, {"x": rand((21, 12)), "v": rand((21, 5), seed=2)})
    (chain,) = plan.chains
    assert chain.widths == (17, 18, 4) and chain.output == "y"
    w0 = chain.layers[0].linear.weight
    assert not w0[12:, 16:].any()   # the head's columns read x's rows only


@pytest.mark.parametrize("why", ["tanh chain", "per-channel head activation", "other input"])
def test_heads_the_chain_cannot_carry_stay_their_own_chains(why):
    kw = {"tanh chain": dict(acts=("Tanh", None)), "per-channel head activation": dict(head_act="PRelu", head=3),
          "other input": dict(head_from="w")}[why]
    model = headed_mlp(**kw)
    feeds = {"x": rand((7, 12))} | ({"w": rand((7, 4), seed=3)} if why == "other input" else {})
    plan, fused = _check_on_cpu(model, feeds)
    assert not any(c.head for c in plan.chains)
    assert any(n.op_type == "Concat" and n.output[0] == "y" for n in fused.graph.node)


def test_carry_modes():
    """Only the layers before the last count (its own activation is masked off the head's columns)."""
    relu, ident, tanh = ex.relu(), ex.identity(), ex.tanh()
    assert carry_mode([ident]) is False and carry_mode([ident, ident]) is False and carry_mode([relu]) is False
    assert carry_mode([relu, ident]) is True and carry_mode([relu, ident, relu, ident]) is True
    assert carry_mode([relu, ex.sigmoid()]) is True and carry_mode([ident, tanh]) is False
    prelu_last = ex.Op("select", (ex.Op("lt", (ex.X, ex.Const(0.0))), ex.X * ex.Chan((0.1, 0.2)), ex.X))
    for acts in ([ident, relu, ident], [relu, tanh, ident], [relu, prelu_last]):
        assert carry_mode(acts) is None, acts


@pytest.mark.parametrize("head_act,last,label", [("Exp", None, "id[5 of 6], exp(x)[1 of 6]"),
                                                 ("Sigmoid", "Sigmoid", "sigmoid"),
                                                 ("Softplus", "Relu", "relu[5 of 6], softplus[1 of 6]")])
def test_a_head_with_an_activation_gets_it_on_its_columns(head_act, last, label):
    """nerfstudio's density: exp of a linear head; its activation applies to its columns of the last layer
    (the same as the chain's own: everywhere)."""
    model = headed_mlp(widths=(12, 24, 5), acts=("Relu", last), head=1, head_act=head_act)
    plan, _ = _check_on_cpu(model, {"x": rand((23, 12), scale=1.0)})
    (chain,) = plan.chains
    assert chain.widths == (12, 26, 6) and "head_act" in chain.nodes
    assert chain.activation_labels()[-1] == label


@pytest.mark.parametrize("last", ["Sigmoid", "Relu"])
def test_head_rides_a_chain_whose_last_layer_has_an_activation(last):
    """kwea123's nerf_pl: rgb = Sigmoid(Linear(...)), out = cat([rgb, sigma]): the last layer's activation
    applies to its own columns only (select on a per-column mask), the density comes out as it went in."""
    model = headed_mlp(widths=(12, 24, 5), acts=("Relu", last), head=1, views=4)
    plan, fused = _check_on_cpu(model, {"x": rand((29, 12)), "v": rand((29, 4), seed=3)})
    (chain,) = plan.chains
    assert chain.widths == (16, 26, 6) and chain.output == "y"
    mask = ex.chan_leaves(chain.layers[-1].activation)
    assert len(mask) == 1 and mask[0].values == (1.0,) * 5 + (0.0,)


def test_head_wider_than_head_max_stays_its_own_chain():
    plan, _, _ = fuse(headed_mlp(head=HEAD_MAX + 1))
    assert not any(c.head for c in plan.chains) and len(plan.chains) == 2


def test_a_head_too_wide_for_the_layers_it_would_ride_stays_its_own_chain():
    """Carried as a pair, 4 outputs add 8 columns to each layer they ride: more than a quarter of a 24-wide
    layer (head_fold.CARRY_SHARE), where the head's own pass over its input is the cheaper one."""
    plan, _, _ = fuse(headed_mlp(widths=(12, 24, 5), head=4))
    assert not any(c.head for c in plan.chains) and len(plan.chains) == 2
    (chain,) = fuse(headed_mlp(widths=(12, 32, 5), head=4))[0].chains
    assert chain.widths == (12, 40, 9)


def test_stock_body_of_a_headed_chain_matches_the_model():
    """The fused op's fallback function (stock ops) computes the widened layers too."""
    model = headed_mlp(head=2, views=3)
    plan, specs, fused = fuse(model)
    assert plan.chains[0].head
    feeds = {"x": rand((11, 12)), "v": rand((11, 3), seed=5)}
    np.testing.assert_allclose(run(fused, feeds)[0], run(model, feeds)[0], rtol=1e-5, atol=1e-5)


def test_numerics_model_sees_the_carried_head_rounded():
    """At fp16 the carried density comes out of the tensor cores rounded to fp16: the chain's modelled
    error covers it, and convert's validation passes at the fp16 tolerance."""
    from onnx2fused.precision import chain_layers, model_chain, rel_l2
    model = headed_mlp(widths=(12, 64, 64, 3), acts=("Relu", "Relu", None), head=1)
    plan, _, _ = fuse(model)
    (chain,) = plan.chains
    x = rand((256, 12), scale=1.0)
    ref, = run(model, {"x": x})
    assert rel_l2(model_chain(chain_layers(chain), x, "fp32").output, ref) < 1e-6
    fp16 = model_chain(chain_layers(chain), x, "fp16").output
    assert 0 < rel_l2(fp16[:, 3], ref[:, 3]) < 2e-3   # the carried density, rounded once more
    np.testing.assert_array_equal(fp16[:, 3], fp16[:, 3].astype(np.float16).astype(np.float32))


# -- property: random headed chains fuse whole and match stock -------------------------------------------
HEAD_EXAMPLES = int(os.environ.get("ONNX2FUSED_PROPERTY_EXAMPLES", "10"))


@st.composite
def head_recipes(draw):
    depth = draw(st.integers(1, 4))
    # hidden layers wide enough to carry a head of up to 2 outputs as a pair (head_fold.carry_fits)
    widths = ((draw(st.integers(1, 40)),) + tuple(draw(st.lists(st.integers(16, 40), min_size=depth - 1, max_size=depth - 1)))
              + (draw(st.integers(1, 40)),))
    relu = draw(st.booleans()) and depth > 1
    last = draw(st.sampled_from([None, None, "Sigmoid", "Relu"]))   # (masked off the head's columns)
    acts = (("Relu",) + tuple(draw(st.sampled_from(["Relu", None])) for _ in range(depth - 2)) + (last,)
            if relu else (None,) * (depth - 1) + (last,))
    return dict(widths=widths, acts=acts, head=draw(st.integers(1, 2)), head_first=draw(st.booleans()),
                head_act=draw(st.sampled_from([None, None, "Sigmoid", "Tanh"])),
                views=draw(st.sampled_from([0, 0, 3])), seed=draw(st.integers(0, 2**16)))


@settings(max_examples=HEAD_EXAMPLES, deadline=None, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(r=head_recipes())
def test_random_headed_chain_matches_stock(r, tmp_path_factory):
    model = headed_mlp(**r)
    plan, specs, fused = fuse(model)
    assert len(plan.chains) == 1 and plan.chains[0].head and plan.chains[0].output == "y", plan.describe()
    feeds = {"x": rand((6, r["widths"][0]), seed=r["seed"], scale=1.0)}
    if r["views"]:
        feeds["v"] = rand((6, r["views"]), seed=r["seed"] + 1, scale=1.0)
    assert_cpu_kernel_matches_stock(model, specs, fused, feeds, tmp_path_factory.getbasetemp() / "head_plugins")
