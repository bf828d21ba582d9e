"""A per-channel scale and shift of a chain's input, folded into its first layer.

    y = L_n(... L_1(x * s + t))   ->   the chain reads x; L_1 has W' = diag(s) W and b' = t W + b

where x * s + t is what the nodes between x and the first layer compute, read back from the layer one
node at a time (activations.affine_step): Mul / Add / Sub / Div by a scalar or a [K0] constant (input
normalisation: (x - mean) / std, NeRF's x * 2 - 1), an inference BatchNorm on a rank-2 x (BatchNorm1d
on a tabular model's features), Identity and casts that do not round; and the ONNX-ML Scaler,
(x - offset) * scale, which skl2onnx writes for scikit-learn's StandardScaler in front of an MLPRegressor
or MLPClassifier (ONNX Runtime runs it on the CPU only: a CUDA session copied the rows to the host and
back for it). Each node's output must feed only the next one (the last one's, only the chain's first
layer) and be no graph output; x keeps the element type the first layer read. Those nodes then go with the chain: on the GPU the input rows are read once,
by the fused kernel, instead of once more by a stock elementwise kernel that writes a normalised copy.

The limit on the shift: the fused kernel rounds x to 16 bits (and the weights diag(s) W) before the
products, where stock rounds the normalised x * s + t. For an input normalised to values of order 1, x's
rounding error in those units is 2^-11 (|y| + |t|) instead of 2^-11 |y|, and t W cancels against x s W
in the sum: a shift of |t| <= SHIFT_LIMIT costs at most ~2.3x the input's own rounding error (measured:
relative L2 2.9e-4 -> 6.8e-4 at |t| = 2 on a 32 -> 64 layer, 2.3e-3 at 8, over fp16's 2e-3 tolerance).
A larger shift (a feature centred far from 0: x - 1000) stays a stock op and says why, so that the chain
keeps its 16-bit precision; the scale and the nodes after such a shift still fold.

The limits on the scale: folded, the kernel holds the raw x in 16 bits, and the normalisation says how
large x is: |x| ~ (|t| + a few) / |s|. Validation cannot see that (its inputs are drawn near 0), so a
scale below SCALE_MIN (a feature of order 10^3 and more: prices, distances in metres) stays a stock op, and
with it x's magnitude stays out of fp16's range (65504); SCALE_MIN leaves it 60 standard deviations of
room. A scale above SCALE_MAX (a feature of order 10^-4) would put x among fp16's subnormals and diag(s) W
near its largest values. Per channel; s = 0 (a feature the model ignores) is always fine.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

import onnx

from .activations import affine_step
from .casts import rounding_input_cast
from .constants import GraphIndex

SHIFT_LIMIT = 2.5
SCALE_MIN, SCALE_MAX = 2.0 ** -10, 2.0 ** 12


@dataclass
class InputAffine:
    input: str              # x, what the chain reads instead of the first layer's input
    scale: np.ndarray       # float32 [K0]
    shift: np.ndarray       # float32 [K0]
    node_indices: list[int]
    ops: tuple[str, ...]    # the folded nodes' op types, x's side first
    widened: bool = False   # a float16 converter's rounding Cast of a float32 x taken (casts.py): x is float32

    @property
    def label(self) -> str:
        return "/".join(dict.fromkeys(self.ops))


def _vector(v, n: int) -> np.ndarray:
    return np.broadcast_to(np.asarray(v, dtype=np.float64), (n,))


def _scaler(ix: GraphIndex, p: int, width: int) -> tuple[str, np.ndarray, np.ndarray] | None:
    """ONNX-ML's Scaler as (x, s, t): y = (x - offset) * scale = x * scale - offset * scale, its
    attributes one value or one per feature."""
    vals = []
    for name in ("offset", "scale"):
        v = np.asarray(ix.attr(p, name, [0.0] if name == "offset" else [1.0]), dtype=np.float32).reshape(-1)
        if v.size not in (1, width):
            return None
        vals.append(np.broadcast_to(v, (width,)))
    offset, scale = vals
    return ix.node(p).input[0], scale, (-offset * scale).astype(np.float32)


def _step(ix: GraphIndex, p: int, width: int):
    n = ix.node(p)
    if n.domain == "ai.onnx.ml":
        return _scaler(ix, p, width) if n.op_type == "Scaler" and ix.rank(n.input[0]) == 2 else None
    return affine_step(ix, p, width)


def _out_of_limits(scale: np.ndarray, shift: np.ndarray) -> str:
    """Why x * scale + shift cannot fold into a 16-bit layer ('' when it can)."""
    if np.abs(shift).max() > SHIFT_LIMIT:
        return (f"it shifts the input by up to {np.abs(shift).max():.3g} (in the first layer's units), which "
                f"would cancel in 16-bit arithmetic folded into the layer (limit {SHIFT_LIMIT:g})")
    mag = np.abs(scale[scale != 0])
    if mag.size and mag.min() < SCALE_MIN:
        return (f"it scales the input by {mag.min():.3g}: folded, the kernel would hold inputs of order "
                f"{1 / mag.min():.3g} in 16 bits (limit {SCALE_MIN:g})")
    if mag.size and mag.max() > SCALE_MAX:
        return (f"it scales the input by {mag.max():.3g}: folded, the kernel would hold inputs of order "
                f"{1 / mag.max():.3g} in 16 bits (limit {SCALE_MAX:g})")
    return ""


def match_input_affine(ix: GraphIndex, t: str, readers: set[int], width: int, claimed: set[int],
                       widen: bool = False) -> tuple[InputAffine | None, str]:
    """The scale and shift in front of tensor t (the first layer's input, `width` features, read by the
    nodes `readers`), None where there is none; and why the walk stopped at a node it could have taken
    ('' when nothing foldable was left behind). `claimed`: nodes other layers own (never taken).
    `widen`: a 16-bit chain whose output is float32 (casts.py): the walk also takes one Cast rounding a
    float32 value to t's type, as an identity step, and goes on in float32 (`InputAffine.widened`)."""
    scale, shift = np.ones(width), np.zeros(width)
    nodes: list[int] = []
    cur, reason, widened = t, "", False
    dtype = ix.types.get(t)
    while cur not in ix.graph_outputs and ix.users(cur) and set(ix.users(cur)) <= readers:
        p = ix.producer.get(cur)
        if (widen and not widened and p is not None and p not in claimed
                and rounding_input_cast(ix, cur, readers) is not None):
            widened, dtype, cur, readers = True, onnx.TensorProto.FLOAT, ix.node(p).input[0], {p}
            nodes.append(p)
            continue
        step = None if p is None or p in claimed else _step(ix, p, width)
        if step is None or ix.types.get(step[0]) != dtype:
            break
        x, s, sh = step
        with np.errstate(all="ignore"):   # t = cur S + T with cur = x s + sh
            new_scale, new_shift = _vector(s, width) * scale, _vector(sh, width) * scale + shift
        if not (np.isfinite(new_scale).all() and np.isfinite(new_shift).all()):
            break
        why = _out_of_limits(new_scale, new_shift)
        if why:
            reason = f"input '{cur}' comes from {ix.describe(p)}: {why}; it stays a stock op"
            break
        scale, shift, cur, readers = new_scale, new_shift, x, {p}
        nodes.append(p)
    if not nodes:
        return None, reason
    ops = tuple(ix.node(i).op_type for i in reversed(nodes))
    return (InputAffine(cur, scale.astype(np.float32), shift.astype(np.float32), sorted(nodes), ops, widened),
            reason)


__all__ = ["InputAffine", "SCALE_MAX", "SCALE_MIN", "SHIFT_LIMIT", "match_input_affine"]
