"""Automatic precision (precision.py) and validation that cannot pass vacuously (validate.py).

The numerics model must round like the hardware (checked against torch's bfloat16/float16 casts), pick
the fastest precision that passes and say why, and see what each precision does to hard chains (a
SIREN's sin(30 x), activations beyond the fp16 range). Validation must not call a degenerate reference
(all zeros, NaN or inf) evidence: it tries other input scales, and warns when none helps.
"""
from __future__ import annotations

import importlib
import json
from types import SimpleNamespace

import numpy as np
import onnx
import pytest

import onnx2fused
from onnx2fused import expr as ex
from onnx2fused import precision as prec
from onnx2fused import validate as val
from onnx2fused.passes import find_chains

from onnx_builders import G, mlp

conv = importlib.import_module("onnx2fused.convert")


def test_rounding_matches_torch():
    torch = pytest.importorskip("torch")
    x = np.random.default_rng(0).standard_normal(100_000).astype(np.float32) * np.float32(37.0)
    x[:4] = [np.inf, -np.inf, 0.0, -0.0]
    assert np.array_equal(prec.round_bf16(x), torch.from_numpy(x).bfloat16().float().numpy())
    assert np.array_equal(prec.round_fp16(x), torch.from_numpy(x).half().float().numpy())
    assert np.isnan(prec.round_bf16(np.array([np.nan], np.float32)))[0]


def test_tf32_rounding_keeps_ten_mantissa_bits_ties_away():
    one_ulp = np.float32(2.0 ** -10)
    x = np.array([1 + one_ulp / 2, 1 + one_ulp / 4, -(1 + one_ulp / 2), 3.0], np.float32)
    assert prec.round_tf32(x).tolist() == [1 + one_ulp, 1.0, -(1 + one_ulp), 3.0]
    r = prec.round_tf32(np.random.default_rng(1).standard_normal(1000).astype(np.float32))
    assert np.all((r.view(np.uint32) & 0x1FFF) == 0)


def test_ladder():
    assert [prec.next_precision(p) for p in prec.LADDER] == ["bf16", "tf32", "fp32", None]


def siren(exporter_scale: float = 30.0) -> onnx.ModelProto:
    """x -> sin(30 (x W0 + b0)) -> sin(30 (. W1 + b1)) -> . W2 + b2: a SIREN, whose first-layer frequency
    multiplies every rounding error by 30."""
    g = G(seed=3)
    h = g.linear("x", 3, 64)
    h = g.op("Sin", [g.op("Mul", [h, g.init(np.array(exporter_scale, np.float32))])])
    h = g.linear(h, 64, 64)
    h = g.op("Sin", [g.op("Mul", [h, g.init(np.array(exporter_scale, np.float32))])])
    g.linear(h, 64, 1)
    g.nodes[-1].output[0] = "y"
    return g.model([("x", ["batch", 3])], [("y", ["batch", 1])])


def choose(model) -> list[prec.PrecisionChoice]:
    chains = find_chains(model).chains
    cases, _ = val.validation_cases(model)
    return conv.initial_precisions(model, chains, cases, True, lambda s: None)


def test_a_siren_is_not_left_in_fp16_and_the_reason_says_why():
    (c,) = choose(siren())
    assert c.precision in ("tf32", "fp32"), c
    assert "fp16: modelled rel. L2" in c.why and c.errors["fp16"] > 2e-3 * prec.MARGIN


def test_a_plain_relu_mlp_stays_fp16():
    (c,) = choose(mlp([32, 64, 64, 16]))
    assert c.precision == "fp16" and c.why.startswith("modelled rel. L2") and c.errors["fp16"] < 1e-3


def test_choice_is_the_first_that_passes():
    layers = [type("L", (), dict(weight=np.eye(4, dtype=np.float32), bias=None,
                                 activation=onnx2fused.expr.identity()))()]
    x = [np.array([[1.0, 2.0, 3.0, 1.0 + 2 ** -12]], np.float32)]
    y = [x[0].copy()]
    tight = {"fp16": 1e-9, "bf16": 1e-9, "tf32": 1e-9, "fp32": 0.0}
    c = prec.choose_precision(layers, x, y, True, tight)
    assert c.precision == "tf32" and "fp16: modelled" in c.why and "bf16: modelled" in c.why


# ----------------------------------------------------------------------------------- vacuous validation
def dead_at_unit_scale() -> onnx.ModelProto:
    """y = relu(fc(x) - 50): all zeros on N(0, 1) inputs, informative on N(0, 100^2) ones."""
    g = G(seed=4)
    h = g.linear("x", 8, 16)
    h = g.op("Relu", [h])
    h = g.linear(h, 16, 4)
    h = g.op("Sub", [h, g.init(np.array(50.0, np.float32))])
    g.op("Relu", [h], outputs=["y"])
    return g.model([("x", ["batch", 8])], [("y", ["batch", 4])])


def always_zero() -> onnx.ModelProto:
    """y = 0 * fc(relu(fc(x))): no input scale makes it informative."""
    g = G(seed=4)
    h = g.op("Relu", [g.linear("x", 8, 16)])
    h = g.linear(h, 16, 4)
    g.op("Mul", [h, g.init(np.array(0.0, np.float32))], outputs=["y"])
    return g.model([("x", ["batch", 8])], [("y", ["batch", 4])])


def test_degenerate():
    assert val.degenerate(np.zeros(3, np.float32)) == "all zeros"
    assert val.degenerate(np.full(3, np.nan, np.float32)) == "all NaN"
    assert val.degenerate(np.array([np.inf, -np.inf], np.float32)) == "all ±inf"
    assert val.degenerate(np.array([0.0, np.nan], np.float32)) == "only zeros, NaN and ±inf"
    assert val.degenerate(np.array([0.0, 1e-30], np.float32)) is None
    assert val.degenerate(np.zeros(3, np.int64)) is None  # labels are judged exactly, not here


def test_validation_moves_to_an_informative_input_scale(tmp_path):
    src = tmp_path / "dead.onnx"
    onnx.save(dead_at_unit_scale(), str(src))
    cases, vacuous = val.validation_cases(dead_at_unit_scale())
    assert not vacuous and "N(0, " in cases[0][0] and "N(0, 1^2)" not in cases[0][0]
    res = onnx2fused.convert(src, tmp_path / "d.onnx", with_cuda=False, cache_dir=tmp_path / "c")
    assert res.validation.passed and not res.validation.vacuous
    assert all(e.reference_nonzero for e in res.validation.outputs)


def test_vacuous_validation_is_reported_as_a_warning_and_in_json(tmp_path):
    src = tmp_path / "zero.onnx"
    onnx.save(always_zero(), str(src))
    res = onnx2fused.convert(src, tmp_path / "z.onnx", with_cuda=False, cache_dir=tmp_path / "c")
    assert res.validation.vacuous == ["'y' is all zeros"]
    assert any(w.startswith("validation vacuous: 'y' is all zeros on every input scale tried") for w in res.warnings)
    assert "warning: validation vacuous" in res.format()
    d = json.loads(json.dumps(res.to_dict()))
    assert d["validation"]["vacuous"] == ["'y' is all zeros"]


def test_user_inputs_that_are_informative_clear_the_warning(tmp_path):
    x = np.random.default_rng(0).standard_normal((16, 8)).astype(np.float32)
    cases, vacuous = val.validation_cases(always_zero(), {"x": x})
    assert vacuous  # 0 * anything stays 0, whatever the inputs
    cases, vacuous = val.validation_cases(dead_at_unit_scale(), {"x": 300 * x})
    assert not vacuous and cases[-1][0] == "user inputs"


def test_an_ill_conditioned_chain_is_held_to_its_own_fp32_noise():
    """A SIREN's stock fp32 result is itself ~1e-5 off the float64-accumulated one: an exact fp32 kernel
    cannot be held to 1e-5 against it. The chosen precision carries that noise, and its tolerance grows
    to NOISE_FACTOR x it; a well-conditioned chain keeps its precision's tolerance."""
    (c,) = choose(siren())
    assert c.precision == "fp32" and c.noise > 1e-6 and "ill-conditioned" in c.why
    assert c.tolerance(val.TOLERANCES) == pytest.approx(val.NOISE_FACTOR * c.noise)
    (plain,) = choose(mlp([32, 64, 64, 16]))
    assert plain.noise < 1e-6 and plain.tolerance(val.TOLERANCES) == val.TOLERANCES["fp16"]


@pytest.mark.parametrize("name", ["preln.opset17", "preln.dynamo", "llama.opset17", "llama.dynamo"])
def test_a_transformer_block_is_modelled_with_its_norm_and_residual(name):
    """A block chain's input is the rows before the norm and its output the residual Add's: the model
    computes both, so stock fp32 agrees with it to rounding (no false "ill-conditioned", which would
    loosen validation to 4x an error of ~1) and its fp32 run matches stock to 1e-5."""
    from pathlib import Path
    model = onnx.load(str(Path(__file__).resolve().parent.parent / "models" / f"{name}.onnx"))
    (chain,) = find_chains(model).chains
    assert chain.norm is not None and chain.residual
    (c,) = conv.initial_precisions(model, [chain], val.validation_cases(model)[0], True, lambda s: None)
    assert c.noise < 1e-5 and "ill-conditioned" not in c.why, c
    assert c.precision == "fp16" and c.tolerance(val.TOLERANCES) == val.TOLERANCES["fp16"]


def test_norm_model_matches_a_float64_layer_norm_and_rms_norm():
    from types import SimpleNamespace
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((50, 24)) * 3 + 1).astype(np.float32)
    w = (rng.standard_normal((24, 24)) / 5).astype(np.float32)
    layers = [SimpleNamespace(weight=w, bias=None, activation=ex.identity())]
    scale, bias = rng.standard_normal(24).astype(np.float32), rng.standard_normal(24).astype(np.float32)
    x64 = x.astype(np.float64)
    mean, var = x64.mean(-1, keepdims=True), x64.var(-1, keepdims=True)
    ln = (x64 - mean) / np.sqrt(var + 1e-5) * scale + bias
    rms = x64 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + 1e-6) * scale
    for norm, want in [(SimpleNamespace(kind="layernorm", eps=1e-5, scale=scale, bias=bias), ln),
                       (SimpleNamespace(kind="rmsnorm", eps=1e-6, scale=scale, bias=None), rms)]:
        block = SimpleNamespace(norm=norm, residual=True, half_io=False)
        got = prec.model_chain(layers, x, "fp32", block=block).output
        assert np.allclose(got, want @ w + x64, rtol=1e-4, atol=1e-4)
        block = SimpleNamespace(norm=norm, residual=False, half_io=False)
        plain = prec.model_chain(layers, x, "fp32", block=block).output
        assert np.allclose(plain, want @ w, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------- packed fp16x2 activations
def _layers(widths, act, seed=0, bias_shift=0.0):
    from types import SimpleNamespace
    rng = np.random.default_rng(seed)
    out = []
    for i, (k, n) in enumerate(zip(widths, widths[1:])):
        w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
        b = (rng.standard_normal(n) * 0.1 + bias_shift).astype(np.float32)
        out.append(SimpleNamespace(weight=w, bias=b, activation=act if i < len(widths) - 2 else ex.identity()))
    return out


def _exact(layers, x):
    h = x.astype(np.float64)
    for l in layers:
        h = ex.evaluate(l.activation, (h @ l.weight.astype(np.float64) + l.bias).astype(np.float32)).astype(np.float64)
    return h



@pytest.mark.parametrize("act", [ex.gelu_erf(), ex.silu(), ex.tanh(), ex.sigmoid()])
def test_packed_model_costs_a_little_more_than_rounding_and_is_chosen_first(act):
    layers = _layers([64, 128, 128, 128, 32], act)
    x = np.random.default_rng(1).standard_normal((2048, 64)).astype(np.float32)
    ref = _exact(layers, x)
    packed = prec.rel_l2(prec.model_chain(layers, x, "fp16").output, ref)
    fp32_act = prec.rel_l2(prec.model_chain(layers, x, "fp16", "fp32").output, ref)
    # the packed forms round the pre-activation too and compute in fp16: more error, but of the same order
    assert fp32_act < packed < 4 * fp32_act, (packed, fp32_act)
    choice = prec.choose_precision(layers, [x], [ref.astype(np.float32)], range_check=True,
                                   tolerances=val.TOLERANCES)
    assert (choice.precision, choice.act_math) == ("fp16", "packed")
    assert "packed fp16 activations" in choice.why


def test_only_the_activations_that_halve_their_input_are_prescaled():
    """tanh's packed form starts from x itself: no prescale and no scaled model (what the wgmma and mma.sync
    kernels take to leave its weights unscaled)."""
    assert ex.packed_form(ex.tanh()).prescale == 1.0 and ex.packed_form(ex.tanh()).scaled_model is None
    assert all(ex.packed_form(a).prescale == 0.5 and ex.packed_form(a).scaled_model is not None
               for a in (ex.gelu_erf(), ex.gelu_tanh(), ex.silu(), ex.sigmoid(), ex.quick_gelu()))


@pytest.mark.parametrize("act", [ex.gelu_erf(), ex.gelu_tanh(), ex.silu(), ex.sigmoid(), ex.quick_gelu()])
def test_a_prescaled_packed_form_gives_the_same_fp16_value_for_every_input(act):
    """The wgmma design packs such a layer's weights and bias times `prescale` and evaluates the form of
    h = prescale * x (one HMUL2 a pair fewer): op by op in float16, that form of x * prescale is bit for
    bit the form of x, over every finite fp16 x, so the numerics model of x holds for it."""
    form = ex.packed_form(act)
    x = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    x = x[np.isfinite(x)]
    with np.errstate(all="ignore"):
        h = (x * np.float16(form.prescale)).astype(np.float16)
        a, b = form.model(x), form.scaled_model(h)
    same = (a.view(np.uint16) == b.view(np.uint16)) | (np.isnan(a) & np.isnan(b))
    assert same.all(), x[~same][:8]


def test_relu_has_no_packed_form_and_one_fp16_step():
    """ReLU is exact in either arithmetic and its packed form was slower: it keeps the fp32 form, and a
    ReLU chain has no fp16a32 step."""
    layers = _layers([16, 64, 64, 8], ex.relu())
    assert ex.packed_form(ex.relu()) is None and not prec.packable(layers)
    x = np.random.default_rng(2).standard_normal((512, 16)).astype(np.float32)
    a = prec.model_chain(layers, x, "fp16").output
    assert np.array_equal(a, prec.model_chain(layers, x, "fp16", "fp32").output)


def test_a_packed_layer_rounds_its_accumulator_before_the_bias():
    """The wgmma kernel (BIAS16) rounds a packed layer's fp32 accumulators to fp16 and adds the bias's fp16
    copy in fp16, as stock ORT's fp16 MatMul then Add does: where the bias cancels the accumulator the
    rounding of the larger value shows. The accumulator 1000 + 0.2998 (the weights 1000 and 0.3 in fp16) is
    1000.5 in fp16 (steps of 0.5): 1000.5 - 1000 = 0.5, where the fp32 sum would leave 0.2998."""
    from onnx2fused.plan import wgmma
    assert wgmma.BIAS16
    w0 = np.array([[1000.0], [0.3]], np.float32)
    layers = [SimpleNamespace(weight=w0, bias=np.array([-1000.0], np.float32), activation=ex.gelu_erf()),
              SimpleNamespace(weight=np.ones((1, 1), np.float32), bias=None, activation=ex.identity())]
    x = np.ones((1, 2), np.float32)
    pre = np.float16(np.float16(np.float32(1000.0) + np.float32(np.float16(0.3))) + np.float16(-1000.0))
    assert pre == 0.5
    got = prec.model_chain(layers, x, "fp16").output
    want = ex.packed_form(ex.gelu_erf()).model(np.array([[pre]], np.float16)).astype(np.float32)
    assert np.array_equal(got, want) and abs(float(got[0, 0]) - 0.3457) < 1e-3   # gelu(0.5), not gelu(0.3)
    # fp16 with fp32 activations (the kernels' fp32 forms) adds the bias in fp32, before any rounding
    a32 = prec.model_chain(layers, x, "fp16", "fp32").output
    assert abs(float(a32[0, 0]) - 0.1854) < 2e-3   # gelu(0.2998)
    # and so does act_math "packed_b32" (validation's next step), then rounds and runs the packed form
    b32 = prec.model_chain(layers, x, "fp16", "packed_b32").output
    assert abs(float(b32[0, 0]) - 0.1854) < 2e-3 and not np.array_equal(b32, got)


def test_pre_activations_beyond_fp16_move_a_packed_chain_to_fp32_activations():
    """silu of pre-activations near -1e5: 0 in fp32, but -inf * sigmoid(-inf) = NaN once rounded to fp16
    first. The range check sees the packed layers' pre-activations; fp16 with fp32 activations is fine."""
    layers = _layers([8, 32, 32, 4], ex.silu(), bias_shift=-1e5)
    x = np.random.default_rng(3).standard_normal((256, 8)).astype(np.float32)
    ref = _exact(layers, x).astype(np.float32)
    assert np.isnan(prec.model_chain(layers, x, "fp16").output).any()
    choice = prec.choose_precision(layers, [x], [ref], range_check=True, tolerances=val.TOLERANCES)
    assert (choice.precision, choice.act_math) == ("fp16", "fp32"), choice.why
    assert "fp16: intermediate values reach" in choice.why


def test_steps_after_packed_fp16():
    # packed with the bias in fp16 (BIAS16) -> packed with the bias in fp32 -> fp32 activations -> bf16
    assert prec.next_step("fp16", "packed", True) == ("fp16", "packed_b32")
    assert prec.next_step("fp16", "packed_b32", True) == ("fp16", "fp32")
    assert [prec.step_label("fp16", m, True) for m in ("packed", "packed_b32", "fp32")] == ["fp16", "fp16b32", "fp16a32"]
    assert prec.next_step("fp16", "packed", False) == ("bf16", "packed")   # nothing packed: no second fp16 step
    assert prec.next_step("fp16", "fp32", True) == ("bf16", "packed")
    assert prec.next_step("fp32", "packed", True) is None
    assert prec.step_label("fp16", "fp32", True) == "fp16a32" and prec.step_label("bf16", "fp32", True) == "bf16"


def _swiglu(k, h, n, seed=0):
    """A gated FFN pair k -> SwiGLU h -> n, as chain_layers gives it (weight [k, 2h]: gate columns first)."""
    rng = np.random.default_rng(seed)
    w0 = (rng.standard_normal((k, 2 * h)) / np.sqrt(k)).astype(np.float32)
    w1 = (rng.standard_normal((h, n)) / np.sqrt(h)).astype(np.float32)
    return [SimpleNamespace(weight=w0, bias=(rng.standard_normal(2 * h) * 0.1).astype(np.float32),
                            activation=ex.silu(), gated=True),
            SimpleNamespace(weight=w1, bias=(rng.standard_normal(n) * 0.1).astype(np.float32),
                            activation=ex.identity())]


def test_a_packed_glu_is_modelled_as_the_ffn_kernel_computes_it():
    """The one-kernel FFN's packed glu: g and u (fp32 products + the bias held in fp16) each rounded to fp16,
    SiLU's packed form on g, one fp16 multiply by u. The model gives that hidden tensor (the last layer then
    from it), and its error is above the fp32 glu's (act_math "fp32": g and u rounded, act(g) * u in fp32)
    and below 2.5 times it."""
    layers = _swiglu(64, 96, 32)
    assert prec.packable(layers) and not prec.packable(layers[1:])
    x = np.random.default_rng(4).standard_normal((1024, 64)).astype(np.float32)
    x16 = x.astype(np.float16).astype(np.float64)
    acc = (x16 @ layers[0].weight.astype(np.float16).astype(np.float64)
           + layers[0].bias.astype(np.float16).astype(np.float64))
    g, u = (acc[:, :96].astype(np.float32).astype(np.float16), acc[:, 96:].astype(np.float32).astype(np.float16))
    hidden = (ex.packed_form(ex.silu()).model(g) * u).astype(np.float16)
    want = (hidden.astype(np.float64) @ layers[1].weight.astype(np.float16).astype(np.float64)
            + layers[1].bias).astype(np.float32)
    got = prec.model_chain(layers, x, "fp16").output
    assert np.allclose(got, want, rtol=1e-6, atol=1e-6)
    ref = _exact_glu(layers, x)
    packed, a32 = prec.rel_l2(got, ref), prec.rel_l2(prec.model_chain(layers, x, "fp16", "fp32").output, ref)
    assert a32 < packed < 2.5 * a32
    # bf16 has no packed forms: the glu in fp32 there
    bf16 = prec.model_chain(layers, x, "bf16").output
    assert np.array_equal(bf16, prec.model_chain(layers, x, "bf16", "fp32").output)


def _exact_glu(layers, x):
    acc = x.astype(np.float64) @ layers[0].weight.astype(np.float64) + layers[0].bias
    n = acc.shape[1] // 2
    h = ex.evaluate(ex.silu(), acc[:, :n].astype(np.float32)).astype(np.float64) * acc[:, n:]
    return h @ layers[1].weight.astype(np.float64) + layers[1].bias


def test_a_glu_only_chain_goes_from_packed_fp16_to_fp32_activations():
    """A packed glu adds its bias in fp32 whatever act_math says, so a chain whose only packable layer is
    gated has no `fp16b32` step: a packed glu that fails goes to the glu in fp32 (`fp16a32`)."""
    layers = _swiglu(32, 64, 16)
    x = np.random.default_rng(5).standard_normal((512, 32)).astype(np.float32)
    ref = _exact_glu(layers, x).astype(np.float32)
    packed = prec.rel_l2(prec.model_chain(layers, x, "fp16").output, ref)
    a32 = prec.rel_l2(prec.model_chain(layers, x, "fp16", "fp32").output, ref)
    # a tolerance between the two errors: packed fails, the fp32 glu passes
    tol = {**val.TOLERANCES, "fp16": (packed + a32) / 2 / prec.MARGIN}
    choice = prec.choose_precision(layers, [x], [ref], range_check=True, tolerances=tol)
    assert (choice.precision, choice.act_math) == ("fp16", "fp32"), choice.why
    assert list(choice.errors) == ["fp16", "fp16a32"]
    assert prec.next_step("fp16", "packed", True, bias16_matters=False) == ("fp16", "fp32")


def test_large_input_sets_are_modelled_on_a_sample_that_keeps_the_largest_rows():
    """The numerics model computes at most about MODEL_ROWS rows of an input set: evenly spaced ones, and
    the rows of largest magnitude, so an fp16 overflow that starts in one row is still found."""
    from onnx2fused import precision as pr
    rng = np.random.default_rng(3)
    x = rng.standard_normal((40, 500, 16)).astype(np.float32)   # 20000 rows of 16 features
    x[17, 123, 5] = 3e4                                         # the one row that matters for the range check
    y = x.sum(-1, keepdims=True)
    xs, ys = pr.model_rows(x, y)
    assert pr.MODEL_ROWS - pr.MODEL_PEAK_ROWS <= len(xs) <= pr.MODEL_ROWS and xs.shape[1:] == (16,)
    assert np.abs(xs).max() == 3e4 and np.allclose(ys[:, 0], xs.sum(-1))   # rows stay paired with outputs
    small = rng.standard_normal((100, 16)).astype(np.float32)
    assert pr.model_rows(small, small)[0].shape == (100, 16)
    # through choose_precision: a layer whose output of that row overflows fp16 is refused fp16
    layer = SimpleNamespace(weight=np.eye(16, dtype=np.float32) * 4, bias=None, activation=ex.identity())
    choice = pr.choose_precision([layer, SimpleNamespace(weight=np.eye(16, dtype=np.float32), bias=None,
                                                         activation=ex.identity())],
                                 [x], [x * 4], True, {"fp16": 2e-3, "bf16": 1e-2, "tf32": 1e-3, "fp32": 1e-5})
    assert choice.precision != "fp16" and "overflow" in choice.why


def test_validation_skips_the_fp32_bias_step_where_no_kernel_adds_it_in_fp16():
    """After packed fp16 fails GPU validation, fp16b32 (the bias added in fp32) is tried only where the
    chain's plan adds it in fp16 (the wgmma kernel, BIAS16); an mma.sync chain would rebuild the same
    kernel, so it goes on to fp32 activations."""
    from onnx2fused.convert import _next_step
    from onnx2fused.plan.options import PlanOptions
    from onnx_builders import mlp
    failed = prec.PrecisionChoice("fp16", "modelled", act_math="packed")
    wide = find_chains(mlp([64, 128, 128, 64], act="Tanh")).chains[0]
    wgmma, mma_sync = PlanOptions(design="wgmma"), PlanOptions(design="resident")
    assert _next_step(wide, failed, wgmma) == ("fp16", "packed_b32")
    assert _next_step(wide, failed, mma_sync) == ("fp16", "fp32")
    assert _next_step(wide, failed) == ("fp16", "packed_b32")   # no plan to ask: the whole ladder
    b32 = prec.PrecisionChoice("fp16", "fp16 failed", act_math="packed_b32")
    assert _next_step(wide, b32, wgmma) == ("fp16", "fp32")


def test_validation_steps_past_fp32_activations_where_no_kernel_packs_the_glu():
    """A chain whose only packable layer is a glu (the zoo's 64 -> SwiGLU 256 -> 64): after packed fp16
    fails GPU validation it goes to fp16a32 (no fp16b32: the packed glu adds its bias in fp32 anyway) where
    its plan carries the one-kernel FFN, which computes the glu packed; any other plan computes it in fp32
    at both steps, so it goes straight to bf16."""
    from onnx2fused.convert import _next_step
    from onnx2fused.plan.choose import make_plan
    from onnx2fused.plan.options import PlanOptions
    from pathlib import Path
    zoo = Path(__file__).resolve().parent.parent / "models"
    chain = find_chains(onnx.load(str(zoo / "swiglu.opset17.onnx"))).chains[0]
    spec = chain.to_spec("fp16")
    assert spec.packable_glu_layers and not spec.packable_layers
    failed = prec.PrecisionChoice("fp16", "modelled", act_math="packed")
    wide, mma_sync = PlanOptions(design="wide"), PlanOptions(design="resident")
    assert make_plan(chain.to_spec("fp16", "packed"), wide).ffn is not None
    assert _next_step(chain, failed, wide) == ("fp16", "fp32")
    assert _next_step(chain, failed, mma_sync) == ("bf16", "packed")
    assert _next_step(chain, failed) == ("fp16", "fp32")   # no plan to ask: fp16a32, never fp16b32


def test_the_range_check_counts_what_each_bias_add_holds_in_fp16():
    """BIAS16 holds a packed layer's accumulators and bias in fp16 as well as their sum: an accumulator
    of 2 x 35008 cancelled by a bias of -70000 overflows there, not where the bias is added in fp32
    first (fp16b32 holds only the sum, 16)."""
    layers = [SimpleNamespace(weight=np.array([[35008.0]], np.float32), bias=np.array([-70000.0], np.float32),
                              activation=ex.silu()),
              SimpleNamespace(weight=np.ones((1, 1), np.float32), bias=None, activation=ex.identity())]
    x = np.full((1, 1), 2.0, np.float32)
    assert prec.model_chain(layers, x, "fp16", "packed").peak_stored > val.FP16_MAX
    b32 = prec.model_chain(layers, x, "fp16", "packed_b32")
    assert b32.peak_stored < val.FP16_MAX and abs(float(b32.output[0, 0]) - 16.0) < 0.05   # silu(16)
