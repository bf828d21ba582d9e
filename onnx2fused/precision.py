"""Automatic precision: per chain, the fastest precision whose numerics pass.

    choose_precisions(chains, reference, with_cuda) -> [PrecisionChoice]

The ladder is fp16 -> bf16 -> tf32 -> fp32 (fastest first); fp16 is tried with the hidden activations
in packed fp16x2 arithmetic first (act_math "packed", expr.PACKED_FORMS; reports say `fp16`; the wgmma
kernel adds the bias in fp16), then, where the chain has such layers, the same with the bias added in
fp32 (`fp16b32`) and with fp32 activations (`fp16a32`). Each chain is judged on its own: its input
and output tensors come from stock ONNX Runtime running the original model on the validation inputs
(`reference`: tensor name -> list of arrays, one per input set), and a NUMERICS MODEL of the CUDA
kernels computes the chain at each precision from that reference input. The first precision whose
relative L2 error stays within MARGIN x its tolerance (validate.TOLERANCES) is chosen; the margin leaves
room for the real kernel's accumulation order, which the model does not reproduce.

The numerics model is what every tensor-core design does (docs/DESIGN.md):
    fp16 / bf16   the chain input and the weights rounded to the 16-bit type (round to nearest even),
                  products summed in fp32 from a bias-initialised accumulator, the activation in fp32,
                  each hidden activation rounded to the 16-bit type before the next layer (registers or
                  the wide design's 16-bit intermediates alike), the last layer's output in fp32;
                  fp16 packed layers: the accumulators rounded to fp16 and the bias added in fp16
                  (the wgmma kernel's BIAS16), the activation's packed form
                  evaluated in float16 op by op (the wide design computes these in fp32: the model is
                  then a little pessimistic); hidden gated layers: the bias held in the 16-bit type, g and
                  u rounded to it before act(g) * u (the wide design's gate buffer; the FFN and wgmma
                  kernels keep them in fp32), and with a packed form (fp16, the one-kernel FFN) act(g)
                  in the form's steps times u in fp16;
    tf32          weights rounded to tf32 (cvt.rna: to nearest, ties away from zero), activations
                  carried as two tf32 terms (hi + lo), i.e. within ~2^-22 of fp32: modelled as exact;
    fp32          CUDA cores, exact.
fp16 also needs every value the kernel stores in fp16 to stay finite: an intermediate beyond 65504
overflows to inf whatever the relative error on the validation inputs says (the range check).

Where this runs: convert calls it for libraries with CUDA kernels, before the first build, so that a
CPU host with nvcc (where validation can only run the CPU kernels, which compute in fp32) still picks
precisions the GPU can serve; on a GPU host the real validation then confirms each chain on the CUDA EP
and moves up a chain that fails there (convert.py). A CPU-only library computes in fp32 whatever its
label, so every chain keeps the cheapest label, fp16, with no range check.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np

from . import expr as ex
from .plan.wgmma import BIAS16
from .spec import ACT_MATH_TAGS, PACKED_MATHS
from .validate import FP16_MAX, NOISE_FACTOR

LADDER = ("fp16", "bf16", "tf32", "fp32")
# The modelled error must stay within MARGIN x the tolerance: the model rounds exactly as the kernels do
# and differs only in summation order and the kernels' activation approximations (~1e-5 relative; in bf16
# chains the hardware tanh, ~2^-11 relative and ~2^-12 absolute where 1 + tanh cancels, a quarter of bf16's
# half step or less: expr.FAST_C_BF16), so a small margin suffices; the real validation has the last word on
# a GPU host.
MARGIN = 0.8
# A chain that amplifies rounding (a SIREN's sin(30 x)) differs from stock ORT by more than fp32's 1e-5
# even when computed exactly in fp32: stock's own fp32 result is that far from the float64-accumulated
# one. Such a chain is held to NOISE_FACTOR x that distance where it exceeds its precision's tolerance
# (validate.py applies the same rule to the real kernels).


@dataclass
class PrecisionChoice:
    precision: str
    why: str                                  # one line: why this one (and why not the faster ones)
    errors: dict[str, float] | None = None    # modelled rel L2 per step tried ("fp16", "fp16a32", "bf16", ...)
    noise: float = 0.0                        # stock fp32 vs float64-accumulated fp32: the chain's conditioning
    act_math: str = "packed"                  # fp16: hidden activations in packed fp16x2 forms ("packed_b32":
                                              # the bias added in fp32), or "fp32"

    def tolerance(self, tolerances: dict[str, float]) -> float:
        """What validation holds this chain to: its precision's tolerance, or more for an ill-conditioned
        chain (NOISE_FACTOR x its own fp32 noise)."""
        return max(tolerances[self.precision], NOISE_FACTOR * self.noise)


def next_precision(precision: str) -> str | None:
    """The next slower, more exact precision of the ladder, or None after fp32."""
    i = LADDER.index(precision)
    return LADDER[i + 1] if i + 1 < len(LADDER) else None


def next_step(precision: str, act_math: str, has_packed: bool, bias16_matters: bool = True) -> tuple[str, str] | None:
    """The step after (precision, act_math): fp16 with packed activations -> the same with the bias added
    in fp32 (where `bias16_matters`: a packed glu adds its bias in fp32 anyway) -> fp16 with fp32
    activations (those two where the chain has packed layers) -> bf16 -> tf32 -> fp32; None after fp32."""
    if precision == "fp16" and has_packed and act_math in PACKED_MATHS:
        return "fp16", "packed_b32" if act_math == "packed" and bias16_matters else "fp32"
    p = next_precision(precision)
    return (p, "packed") if p else None


def step_label(precision: str, act_math: str, has_packed: bool) -> str:
    """How reports name a step: `fp16` (packed activations where the chain has them), `fp16b32` (the
    same, the bias added in fp32) or `fp16a32` (fp32 activations)."""
    return precision + (ACT_MATH_TAGS[act_math] if precision == "fp16" and has_packed else "")


# ------------------------------------------------------------------------------------------ rounding
def round_fp16(a: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return a.astype(np.float16).astype(np.float32)


def round_bf16(a: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 -> float32, round to nearest even (NaN stays NaN)."""
    a = np.ascontiguousarray(a, dtype=np.float32)
    bits = a.view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16).astype(np.uint32)
    out = rounded.view(np.float32)
    return np.where(np.isnan(a), a, out)


def round_tf32(a: np.ndarray) -> np.ndarray:
    """float32 -> tf32 (10 mantissa bits), to nearest with ties away from zero, like cvt.rna.tf32.f32."""
    a = np.ascontiguousarray(a, dtype=np.float32)
    bits = a.view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x1000) & 0xFFFFE000).astype(np.uint32)
    out = rounded.view(np.float32)
    return np.where(np.isfinite(a), out, a)


ROUND_OPERAND = {"fp16": round_fp16, "bf16": round_bf16, "tf32": lambda a: a, "fp32": lambda a: a}
ROUND_WEIGHT = {"fp16": round_fp16, "bf16": round_bf16, "tf32": round_tf32, "fp32": lambda a: a}


# ------------------------------------------------------------------------------------------ model
@dataclass
class ChainRun:
    """The modelled chain output and the largest |value| stored in 16 bits (fp16 range check)."""
    output: np.ndarray
    peak_stored: float


def chain_block(chain) -> SimpleNamespace | None:
    """A found chain's transformer-block parts as model_chain reads them (.norm: passes.block.NormMatch or
    None, .residual, .half_io), or None for a chain without them."""
    if chain.norm is None and not chain.residual:
        return None
    return SimpleNamespace(norm=chain.norm, residual=chain.residual, half_io=chain.input_dtype == "f16")


def normalise(x: np.ndarray, norm, half_io: bool = False) -> np.ndarray:
    """A block's norm of the rows of x (`norm`: .kind, .eps, .scale, .bias), in fp32 as the kernels compute
    it; fp16 I/O with a layer norm rounds the result to fp16, as ORT's fp16 kernel writes it."""
    x = np.asarray(x, np.float32)
    k0 = x.shape[-1]
    with np.errstate(all="ignore"):
        if norm.kind == "layernorm":   # the variance of the deviations (the kernels' stable form)
            mean = (x.astype(np.float64).sum(-1, keepdims=True) / k0).astype(np.float32)
            ssd = ((x.astype(np.float64) - mean) ** 2).sum(-1, keepdims=True).astype(np.float32)
            denom = np.sqrt(ssd / np.float32(k0) + np.float32(norm.eps))
            h = (x - mean) / denom * np.asarray(norm.scale, np.float32)
            if norm.bias is not None:
                h = h + np.asarray(norm.bias, np.float32)
            return round_fp16(h) if half_io else h.astype(np.float32)
        sumsq = (x.astype(np.float64) ** 2).sum(-1, keepdims=True).astype(np.float32)
        inv = np.float32(1.0) / np.sqrt(sumsq / np.float32(k0) + np.float32(norm.eps))
        return (x * inv * np.asarray(norm.scale, np.float32)).astype(np.float32)


def chain_layers(chain) -> list[SimpleNamespace]:
    """A found chain's layers (passes.find_chains) as model_chain reads them (weight [K, N], bias, activation)."""
    skip = getattr(chain, "skip", ())
    return [SimpleNamespace(weight=l.linear.weight, bias=l.linear.bias, activation=l.activation,
                            gated=getattr(l, "gated", False), skip=i in skip)
            for i, l in enumerate(chain.layers)]


def _packed(layers, i: int, precision: str, act_math: str, gated: bool = False) -> ex.PackedForm | None:
    """Hidden layer i's packed fp16x2 form where the kernels use it: a plain layer's (MLPSpec.packed_layers),
    or with `gated` a gated layer's glu (the one-kernel FFN, MLPSpec.packed_glu_layers); else None."""
    if (precision != "fp16" or act_math not in PACKED_MATHS or i + 1 >= len(layers)
            or getattr(layers[i], "gated", False) != gated):
        return None
    return ex.packed_form(layers[i].activation)


def packable(layers) -> bool:
    """Whether an fp16 chain of these layers has hidden activations with packed forms (act_math matters)."""
    return any(_packed(layers, i, "fp16", "packed", gated) for i in range(len(layers)) for gated in (False, True))


def _packed_glu_hidden(acc: np.ndarray, bias, form: ex.PackedForm) -> tuple[np.ndarray, float]:
    """A packed gated layer's hidden values from its fp32 accumulators [rows, 2H] (gate columns first), as
    the one-kernel FFN computes them: g and u each with its bias (held in fp16) added in fp32 and rounded to
    fp16, then act(g) in the form's fp16 steps (op by op: the kernel's HFMA2 rounds once where the model
    rounds twice) and one fp16 multiply by u. Also the largest finite value stored."""
    n = acc.shape[-1] // 2
    bias = None if bias is None else round_fp16(np.asarray(bias, np.float32)).astype(np.float64)   # as packed
    g = _packed_preactivation(acc[:, :n], None if bias is None else bias[:n], False)
    u = _packed_preactivation(acc[:, n:], None if bias is None else bias[n:], False)
    with np.errstate(all="ignore"):
        h = (form.model(g).astype(np.float16) * u).astype(np.float16)
    return h.astype(np.float32), max(_finite_peak(g), _finite_peak(u), _finite_peak(h))


def _packed_preactivation(acc: np.ndarray, bias, bias16: bool) -> np.ndarray:
    """A packed layer's fp16 pre-activations from its fp32 accumulators: `bias16` (act_math "packed": the
    wgmma kernel's BIAS16) the accumulators rounded to fp16 and the bias's fp16 copy added in fp16, else
    the bias added in fp32 and the sum rounded (act_math "packed_b32"; the mma.sync kernels and the wide
    design always, for which the former is then a little pessimistic on average)."""
    with np.errstate(all="ignore"):
        if bias is None:
            return acc.astype(np.float32).astype(np.float16)
        if bias16:
            return acc.astype(np.float32).astype(np.float16) + np.asarray(bias, np.float32).astype(np.float16)
        return (acc + np.asarray(bias, np.float64)).astype(np.float32).astype(np.float16)


def model_chain(layers, x: np.ndarray, precision: str, act_math: str = "packed", block=None) -> ChainRun:
    """Run a chain's layers (objects with .weight [K, N], .bias [N] or None, .activation Expr, and
    optionally .gated: weight [K, 2N], act(gate) * up) on the rows `x` (..., K0) as the CUDA kernel at
    `precision` computes them. A packed layer (fp16, act_math
    "packed") rounds its pre-activations to fp16, which the range check then covers too, and evaluates
    the activation's fp16x2 form op by op in float16. `block` (chain_block): a transformer block's norm
    of the input rows in fp32 before they are rounded to the operand type, and its residual (the rows as
    they came in) added to the last layer's fp32 output. A layer with `.skip` (passes/skip.py) reads the
    rows [x as the first layer read it, zeros up to its weight's x rows, the layer before's output]."""
    rnd, rnd_w = ROUND_OPERAND[precision], ROUND_WEIGHT[precision]
    x0 = np.asarray(x, np.float32).reshape(-1, np.shape(x)[-1])
    h = x0 if block is None or block.norm is None else normalise(x0, block.norm, block.half_io)
    peak = _finite_peak(h)
    h = x_in = rnd(h)
    for i, layer in enumerate(layers):
        if getattr(layer, "skip", False):
            pad = np.shape(layer.weight)[0] - h.shape[-1] - x_in.shape[-1]
            h = np.concatenate([x_in, np.zeros((h.shape[0], pad), h.dtype), h], axis=-1)
        w = rnd_w(np.asarray(layer.weight, np.float32)).astype(np.float64)
        with np.errstate(all="ignore"):  # inf inputs (an fp16 overflow) give inf/NaN, which is the point
            acc = h.astype(np.float64) @ w
        form = _packed(layers, i, precision, act_math)
        if form is not None:
            bias16 = BIAS16 and act_math == "packed"
            pre = _packed_preactivation(acc, layer.bias, bias16)
            peak = max(peak, _finite_peak(pre))
            if bias16:   # the accumulators and the bias are held in fp16 too, not only their sum
                bias_peak = _finite_peak(np.asarray(layer.bias, np.float32)) if layer.bias is not None else 0.0
                peak = max(peak, _finite_peak(acc.astype(np.float32)), bias_peak)
            with np.errstate(all="ignore"):
                h = form.model(pre).astype(np.float32)
            peak = max(peak, _finite_peak(h))
            continue
        glu = _packed(layers, i, precision, act_math, gated=True)
        if glu is not None:
            h, stored = _packed_glu_hidden(acc, layer.bias, glu)
            peak = max(peak, stored)
            continue
        # a hidden gated layer as the wide design computes it: its bias held in the operand type, g and u
        # stored in it (the gate buffer) before the glu; the FFN and wgmma kernels keep both in fp32, for
        # which this is a little pessimistic
        glu_hidden = getattr(layer, "gated", False) and i + 1 < len(layers)
        if layer.bias is not None:
            bias = np.asarray(layer.bias, np.float32)
            acc += (rnd(bias) if glu_hidden else bias).astype(np.float64)
        if getattr(layer, "gated", False):   # act(gate) * up: the weight's first half of columns is the gate
            n = acc.shape[-1] // 2
            g, u = acc[:, :n].astype(np.float32), acc[:, n:].astype(np.float32)
            if glu_hidden:
                g, u = rnd(g), rnd(u)
                peak = max(peak, _finite_peak(g), _finite_peak(u))
            with np.errstate(all="ignore"):
                h = ex.evaluate(layer.activation, g) * u
        else:
            h = ex.evaluate(layer.activation, acc.astype(np.float32))
        if i + 1 < len(layers):
            peak = max(peak, _finite_peak(h))
            h = rnd(h)
    if block is not None and block.residual:
        h = h + x0
    return ChainRun(h.reshape(*np.shape(x)[:-1], h.shape[-1]), peak)


def _finite_peak(a: np.ndarray) -> float:
    a = np.abs(a[np.isfinite(a)])
    return float(a.max()) if a.size else 0.0


def rel_l2(got: np.ndarray, ref: np.ndarray) -> float:
    """||got - ref|| / ||ref|| over the elements where the reference is finite (inf where got is not)."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    keep = np.isfinite(ref)
    got, ref = got[keep], ref[keep]
    if not np.all(np.isfinite(got)):
        return float("inf")
    nr = float(np.linalg.norm(ref))
    if nr == 0.0:
        return float(np.linalg.norm(got - ref))
    return float(np.linalg.norm(got - ref)) / nr


# Rows of an input set the numerics model computes: a ViT's 37 chains on [batch, 197, D] tokens took
# minutes in full. Evenly spaced rows estimate the relative error; the rows of largest magnitude are added
# for the fp16 range check, whose overflows start there (validation on the GPU still sees every row).
MODEL_ROWS = 4096
MODEL_PEAK_ROWS = 256


def model_rows(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(x, y) as rows (..., K) -> (R, K), at most about MODEL_ROWS of them: evenly spaced, and the
    MODEL_PEAK_ROWS whose largest |x| is largest (NaN and inf rows first), in their order."""
    x, y = np.asarray(x), np.asarray(y)
    x2, y2 = x.reshape(-1, x.shape[-1]), y.reshape(-1, y.shape[-1])
    n = x2.shape[0]
    if n <= MODEL_ROWS:
        return x2, y2
    with np.errstate(invalid="ignore"):
        size = np.nan_to_num(np.abs(x2.astype(np.float32)), nan=np.inf).max(axis=-1)
    keep = np.unique(np.concatenate([np.linspace(0, n - 1, MODEL_ROWS - MODEL_PEAK_ROWS).astype(np.int64),
                                     np.argsort(size, kind="stable")[-MODEL_PEAK_ROWS:]]))
    return x2[keep], y2[keep]


def chain_noise(layers, inputs: list[np.ndarray], outputs: list[np.ndarray], block=None) -> float:
    """The chain's conditioning: how far stock's fp32 result (`outputs`) is from the float64-accumulated
    one over the input sets (on a sample of their rows, model_rows). Validation allows an ill-conditioned
    chain NOISE_FACTOR x this, on every EP and for every precision (a CPU-only build's fp32 kernels too)."""
    pairs = [model_rows(x, y) for x, y in zip(inputs, outputs)]
    return max((rel_l2(model_chain(layers, x, "fp32", block=block).output, y) for x, y in pairs), default=0.0)


def noise_note(noise: float, tolerances: dict[str, float]) -> str:
    """"; ill-conditioned: ..." where NOISE_FACTOR x `noise` exceeds the fp32 tolerance, else ""."""
    if NOISE_FACTOR * noise <= tolerances["fp32"]:
        return ""
    return (f"; ill-conditioned: stock fp32 itself is {noise:.2g} from the float64-accumulated result, "
            f"so validation allows {NOISE_FACTOR:g}x that")


def choose_precision(layers, inputs: list[np.ndarray], outputs: list[np.ndarray], range_check: bool,
                     tolerances: dict[str, float], start: str = "fp16", block=None) -> PrecisionChoice:
    """The first precision from `start` up the ladder whose modelled error over every input set is within
    MARGIN x its tolerance (and, for fp16 with `range_check`, whose stored values stay finite). `block`:
    the chain's norm and residual (chain_block), which its input and output tensors include. Large input
    sets are modelled on a sample of their rows (model_rows)."""
    pairs = [model_rows(x, y) for x, y in zip(inputs, outputs)]
    inputs, outputs = [x for x, _ in pairs], [y for _, y in pairs]
    errors: dict[str, float] = {}
    refused: list[str] = []
    noise = chain_noise(layers, inputs, outputs, block)
    note = noise_note(noise, tolerances)
    has_packed = packable(layers)
    bias16_matters = any(_packed(layers, i, "fp16", "packed") for i in range(len(layers)))
    step: tuple[str, str] | None = (start, "packed")
    while step is not None:
        p, math = step
        label = step_label(p, math, has_packed)
        if p == "fp32":
            why = "exact (CUDA cores)" + (f"; {'; '.join(refused)}" if refused else "") + note
            return PrecisionChoice("fp32", why, errors, noise)
        step = next_step(p, math, has_packed, bias16_matters)
        runs = [model_chain(layers, x, p, math, block) for x in inputs]
        err = max((rel_l2(r.output, y) for r, y in zip(runs, outputs)), default=0.0)
        errors[label] = err
        peak = max((r.peak_stored for r in runs), default=0.0)
        if p == "fp16" and range_check and peak > FP16_MAX:
            refused.append(f"{label}: intermediate values reach {peak:.4g} > {FP16_MAX:g} (overflow)")
            continue
        limit = MARGIN * max(tolerances[p], NOISE_FACTOR * noise)
        if err <= limit:
            how = " (packed fp16 activations)" if label == "fp16" and has_packed else ""
            why = (f"modelled rel. L2 {err:.2g} <= {limit:.2g}{how}" + (f"; {'; '.join(refused)}" if refused else "")
                   + note)
            return PrecisionChoice(p, why, errors, noise, math)
        refused.append(f"{label}: modelled rel. L2 {_fmt(err)} > {limit:.2g}")
    raise AssertionError("the ladder ends with fp32")  # pragma: no cover


def _fmt(x: float) -> str:
    return "inf" if x == float("inf") else f"{x:.2g}"
