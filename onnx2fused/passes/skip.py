"""Skip connections: a chain's input concatenated with a hidden layer's output into the next layer.

    h_j = f_j(Concat(x, h_{j-1}) W_j + b_j)     (NeRF's trunk: torch.cat([input_pts, h], -1) after layer 5;
                                                 DeepSDF: torch.cat([h, input], 1) in the middle)

where x is the tensor the chain's first layer reads. The Concat (two inputs, the last axis; NeuS, IDR and
VolSDF scale it by a constant, `cat([h, x]) / sqrt(2)`, which folds into the layer's weight) and the layers
on both sides are one chain (spec.MLPSpec.skip = j): layer j reads [x zero-padded to skip_width, h_{j-1}],
so its weight is laid out here as [skip_width + N_{j-1}, N_j], x's rows first whatever order the Concat had,
zero rows between (the tensor cores take x's part as whole k-steps, as they take the first layer's input).

A chain may have several (spec.MLPSpec.skip holds every skip layer; skip_merge.py joins chains whose second
one reads a piece of the first one's input beside its output). A Concat of anything else (another tensor
than the chain's input, a third input, another axis), or one the library cannot run (`skip_refused`: no CUDA
kernel plans the chain with it) ends the chain at the Concat, with the reason; the layers after it start a
chain of their own, as before.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping

import numpy as np

from ..spec import SKIP_ALIGN
from .activations import scalar_gain
from .constants import GraphIndex, default_opset
from .linear import LinearLayer

MIN_OPSET = 10   # the stock body slices the skip layer's weight (Slice with input bounds)
# what a norm in front or a residual behind meets in a chain with a skip (find_block's `refused`)
SKIP_NO_BLOCK = "the {what} stays a stock op: its chain has a skip Concat, which reads the chain's input as it is"


@dataclass(frozen=True)
class SkipConcat:
    node: int         # the Concat
    output: str       # what the next layer reads
    other: str        # the Concat's input beside the hidden layer's output (the chain's input, if a skip)
    width: int        # other's features
    other_first: bool  # other is the Concat's first input
    scale: float = 1.0       # a constant the Concat's output is multiplied by (or divided by) before the layer
    scale_node: int | None = None   # that Mul or Div

    @property
    def nodes(self) -> list[int]:
        return [self.node] + ([self.scale_node] if self.scale_node is not None else [])


def match_skip_concat(ix: GraphIndex, t: str, users: list[int]) -> SkipConcat | None:
    """The Concat that is `t`'s only reader, of t and one other tensor of known width along the last axis,
    or None."""
    if len(users) != 1:
        return None
    u = users[0]
    n = ix.node(u)
    if n.op_type != "Concat" or len(n.input) != 2 or list(n.input).count(t) != 1 or n.output[0] in ix.graph_outputs:
        return None
    other = n.input[1] if n.input[0] == t else n.input[0]
    rank, shape = ix.rank(t), ix.shapes.get(other)
    axis = ix.attr(u, "axis", 0)
    if rank is None or not shape or ix.rank(other) != rank or not ix.last_axis(t, axis):
        return None
    width = shape[-1]
    if not isinstance(width, int) or width < 1 or ix.types.get(other) != ix.types.get(t):
        return None
    skip = SkipConcat(u, n.output[0], other, width, n.input[0] == other)
    return _scaled(ix, skip) or skip


def _scaled(ix: GraphIndex, skip: SkipConcat) -> SkipConcat | None:
    """`skip` through a Mul or Div of its output by a scalar constant (its only reader), or None."""
    users = ix.users(skip.output)
    if len(users) != 1 or skip.output in ix.graph_outputs:
        return None
    out = ix.node(users[0]).output[0]
    gain = scalar_gain(ix, users[0], (ix.shapes.get(skip.output) or [None])[-1])
    if gain is None or gain[0] != skip.output or gain[1] == 0.0 or out in ix.graph_outputs:
        return None
    return replace(skip, output=out, scale=gain[1], scale_node=users[0])


def not_a_skip(ix: GraphIndex, s: SkipConcat, own: str) -> str:
    """Why the Concat `s` does not join its layers as a skip: it joins another tensor than the input `own`."""
    return f"feeds {ix.describe(s.node)}, which joins '{s.other}' to it: a skip connection joins the chain's own input ('{own}')"


def skip_cut(ix: GraphIndex, seq: list, widened: bool, refused: Mapping[int, str] | None = None,
             key: int | None = None) -> tuple[int, str] | None:
    """Where the chain `seq` (passes.chains._Layer) must end before a layer linked through a Concat, and
    why: (its position, the reason), or None where every such link is its skip. `widened`: the chain reads
    the float32 input in front of a float16 converter's Cast (the Concat reads the Cast's output).
    `refused`: {chain key: reason} of the library (skip_refusal), the chain's key `key`."""
    first = seq[0].linear
    for at, layer in enumerate(seq):
        s = layer.skip
        if s is None:
            continue
        concat = ix.describe(s.node)
        if s.other != first.input:
            return at, not_a_skip(ix, s, first.input)
        if any(s_.gated for s_ in seq):
            return at, f"feeds {concat}: a skip connection in a chain with a gated layer (not supported)"
        if widened:
            return at, f"feeds {concat}: the chain reads the float32 input in front of a float16 converter's Cast"
        if default_opset(ix.model, MIN_OPSET) < MIN_OPSET:
            return at, f"feeds {concat}: a skip connection needs opset >= {MIN_OPSET}"
        if refused and key in refused:
            return at, f"feeds {concat}: {refused[key]}"
    return None


def lay_out_skip_weight(linear: LinearLayer, skip: SkipConcat, k0: int) -> None:
    """The skip layer's weight as its kernels read it: [x's k0 rows, zero rows up to skip_width, the hidden
    layer's rows] (the Concat's order undone), in place."""
    w = linear.weight
    hidden = w.shape[0] - k0
    x_rows, h_rows = (w[:k0], w[k0:]) if skip.other_first else (w[hidden:], w[:hidden])
    pad = -(-k0 // SKIP_ALIGN) * SKIP_ALIGN
    out = np.zeros((pad + hidden, w.shape[1]), np.float64)
    out[:k0], out[pad:] = x_rows, h_rows
    linear.weight = (out * skip.scale).astype(np.float32)   # (x, h) * s W == (x, h) (s W)
